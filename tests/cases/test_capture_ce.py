"""Vocab-parallel cross-entropy (models/capture/vocab_ce.py) captured and checked end to end,
its bug twins localized, and the loss rule family (rules/loss.py) on its own.

Verdicts come from refine's checker; the captured programs are also run (simulated
collectives, `refine.ops.interp`) to show each twin is wrong exactly where the checker says.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from refine import capture
from refine.frontends.capture import trace
from refine.ir.graph import Graph, Input, Node, Output, TensorType
from refine.ops.interp import apply_op, close, eval_graph, eval_ranks, eval_term, random_inputs
from refine.ops.lower import lower
from refine.ops.registry import load_registry
from refine.prove.engine import Engine
from refine.prove.harness import Harness
from refine.verdict.expect import expected_terms
from tests.helpers.capture import MODELS, failing, line_of, load_model

CE_PATH = MODELS / "vocab_ce.py"
GRADS = {"fc.weight.grad", "fc.bias.grad", "head.weight.grad"}


CE = load_model("vocab_ce")


def wrong_numerically(case: capture.Case, ignored: bool = True) -> set[str]:
    """Outputs whose rank values differ from the sequential ones, on random inputs whose
    targets (random classes) include ignored tokens when `ignored` (the random inputs of
    `refine.oracle.differential.differential` never pick ignore_index)."""
    reg = case.registry
    seq_in, rank_in = random_inputs(case.seq, case.dist, 3, reg)
    if ignored:
        t = seq_in["target"].clone()
        t[::3] = CE.IGNORE
        seq_in["target"] = t
        for r in rank_in:
            rank_in[r]["target"] = t.clone()
    seq_vals = eval_graph(case.seq, reg, seq_in)
    rank_vals = eval_ranks(case.dist.ranks, reg, rank_in)
    outs = {f"{o.name}@{r}": rank_vals[r][o.ref] for r, g in case.dist.ranks.items() for o in g.outputs}
    wrong = set()
    for o in case.seq.outputs:
        terms = expected_terms(case.dist, o.name, set(outs))
        assert terms, o.name
        if not all(close(eval_term(t, reg, outs), seq_vals[o.ref]) for t in terms):
            wrong.add(o.name)
    return wrong


@pytest.fixture(scope="module")
def ce_case() -> capture.Case:
    return capture(CE.make_case())


@pytest.fixture(scope="module")
def fused_case() -> capture.Case:
    return capture(CE.make_case(fused=True))


# ---------------------------------------------------------------------------------------
# the correct step


def test_vocab_parallel_ce_whole_step_refines(ce_case: capture.Case) -> None:
    report = ce_case.check()
    assert report.refines, report
    assert {o.name for o in report.outputs} == {"loss"} | GRADS
    assert wrong_numerically(ce_case) == set()
    rel = {r["from"]: r["placements"] for r in ce_case.dist_doc["relations"]}
    assert rel["head.weight"] == ["Shard(0)"]
    # Megatron's collectives: max and sum-exp over the vocab, the predicted log-prob, the
    # smoothing sum; backward the sum of the log-prob gradient and "f"'s input gradient
    rank0 = ce_case.dist_doc["ranks"][0]["graph"]["nodes"]
    reduces = sorted((n["attrs"]["reduce_op"], n["source"]) for n in rank0 if n["op"] == "all_reduce")
    assert [op for op, _ in reduces].count("max") == 1 and len(reduces) == 6
    assert ("max", line_of(CE_PATH, 'local_max = funcol.all_reduce(local_max, "max", group)')) in reduces


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{"label_smoothing": 0.0}, {"world_size": 4}])
def test_without_smoothing_and_on_four_ranks(kw: dict[str, Any]) -> None:
    report = capture(CE.make_case(**kw)).check()
    assert report.refines, report


def test_megatron_per_token_mix_refines(fused_case: capture.Case) -> None:
    """The sequential nll masked on its own (where_1) has no rank counterpart when the step
    mixes the terms per token first: carried into its users (refine.prove.walk.infer), the
    loss relates as a whole."""
    report = fused_case.check()
    assert report.refines, report


def test_megatron_per_token_mix_computes_the_same(fused_case: capture.Case) -> None:
    assert wrong_numerically(fused_case) == set()


@pytest.mark.parametrize("bug,wrong", [
    ("predicted_not_all_reduced", {"loss"}),
    ("sum_exp_not_all_reduced", {"loss"} | GRADS),
    ("backward_sum_not_all_reduced", GRADS),
    ("backward_scaled", GRADS),
])
def test_megatron_per_token_mix_twins_do_not_refine(bug: str, wrong: set[str]) -> None:
    """Bugs inside the region the per-token mix fuses (the carried nll and smoothing terms,
    the backward through them) are still no refinement, and fail where the numbers do."""
    case = capture(CE.make_case(bug=bug, fused=True))
    assert wrong_numerically(case) == wrong
    report = case.check()
    assert report.verdict == "DOES NOT REFINE", report
    assert wrong <= failing(report), report


# ---------------------------------------------------------------------------------------
# bug twins: verdict, failing outputs, the culprit and its lines


@pytest.mark.slow
@pytest.mark.parametrize("bug,wrong", [
    ("max_not_all_reduced", {"loss"} | GRADS),
    ("target_mask_missing", {"loss"}),  # the backward keeps the mask: gradients stay right
    ("predicted_not_all_reduced", {"loss"}),
    ("ignored_in_denominator", {"loss"} | GRADS),
])
def test_twins_are_wrong_where_expected(bug: str, wrong: set[str]) -> None:
    assert wrong_numerically(capture(CE.make_case(bug=bug))) == wrong


def _culprit(bug: str) -> tuple[Any, Any]:
    report = capture(CE.make_case(bug=bug)).check()
    assert not report.refines
    assert report.culprit is not None
    return report, report.culprit


SEQ_LINE = "loss = F.cross_entropy(model(x), target"


def test_max_not_all_reduced_is_found_at_the_log_softmax() -> None:
    report, c = _culprit("max_not_all_reduced")
    assert failing(report) == {"loss"} | GRADS
    # the shifted logits relate (to the max of the ranks' maxes), their exp does not
    assert c.node == "_log_softmax" and c.source == line_of(CE_PATH, SEQ_LINE)
    assert "max(amax.rmax@0, amax.rmax@1)" in str(c.inputs)
    sub_line = line_of(CE_PATH, "shifted = logits - local_max")
    assert any(x.startswith("sub.Sum@0") and x.endswith(sub_line) for x in c.rank_nodes), c.rank_nodes


def test_target_mask_missing_is_found_at_the_lookup() -> None:
    report, c = _culprit("target_mask_missing")
    assert failing(report) == {"loss"}
    assert c.node == "gather" and c.op == "gather" and c.source == line_of(CE_PATH, SEQ_LINE)
    gather_line = line_of(CE_PATH, "predicted = log_probs.gather(-1, local_target)")
    assert any(x.startswith("gather@0") and x.endswith(gather_line) for x in c.rank_nodes), c.rank_nodes


def test_predicted_not_all_reduced_is_found_where_a_rank_uses_its_piece() -> None:
    report, c = _culprit("predicted_not_all_reduced")
    assert failing(report) == {"loss"}
    # the ranks' predicted log-probs are pieces of a sum nobody takes: the step masks each
    assert "partial sum" in c.reason or "not linear" in c.reason
    # masked, summed and divided, each rank's loss is still its piece of the sequential one
    # (a partial sum, numerically) up to where the step adds the (replicated) smoothing term;
    # every value from the masked predictions on, held whole instead of in pieces, makes the
    # outputs right: the counterexample's divergence is the first, where the all-reduce belongs
    d = c.divergence
    assert d is not None and d.held == "placed [Partial(sum)]" and d.placement == "placed [Replicate]", c
    assert c.rank_source == d.source == line_of(CE_PATH, "predicted = predicted.masked_fill(mask, 0.0)")


def test_ignored_in_denominator_has_a_counterexample_with_ignored_targets() -> None:
    # only ignored targets show the bug, and a plain draw (classes below a bound) has none:
    # the counterexample is a draw with the values the programs compare the targets with
    report = capture(CE.make_case(bug="ignored_in_denominator")).check()
    assert report.verdict == "DOES NOT REFINE" and report.search is not None, str(report)
    found = report.search.found
    assert found is not None and CE.IGNORE in found.mixed["target"], str(report)
    assert (found.seq_inputs["target"] == CE.IGNORE).any() and (found.seq_inputs["target"] != CE.IGNORE).any()
    assert "compare them with" in str(report)


def test_ignored_in_denominator_is_found_at_the_float_token_count() -> None:
    report, c = _culprit("ignored_in_denominator")
    assert failing(report) == {"loss"} | GRADS
    # the sequential mean divides by the count of targets not ignored as a float: the ranks
    # count them too (the smoothing mean's `(~ignored).sum()`, related since not(==) is !=,
    # rules/mask.py), but never divide by that count as a float
    assert c.node == "_to_copy" and c.source == line_of(CE_PATH, SEQ_LINE), c


# ---------------------------------------------------------------------------------------
# the rule family


LOSS_RULES = ["gather-vocab-split", "gather-off-split", "gather-off-first", "gather-off-shifted",
              "one-hot-piece-first", "one-hot-piece-shifted", "where-view-view-const", "where-view-scalar-const",
              "where-view-const-scalar"] + [f"{p}-view-const" for p in ("lt_t", "le_t", "gt_t", "ge_t", "eq_t", "ne_t")]


@pytest.mark.slow
@pytest.mark.parametrize("symbolic", [False, True])
def test_loss_rules_sound_and_fire(symbolic: bool) -> None:
    results = Harness(load_registry(), symbolic=symbolic).run(LOSS_RULES)
    assert results
    for res in results:
        assert res.fired and not res.failures, res


MASK_RULES = ["where-zero-sum", "where-zero-by", "where-zero-scale", "where-zero-scale-in", "scale-into-div",
              "scale-into-expand", "scale-full-one", "where-eq-as-ne", "where-ne-as-eq", "not-eq", "not-ne",
              "div-by-cast"]


@pytest.mark.slow
@pytest.mark.parametrize("symbolic", [False, True])
def test_mask_rules_sound_and_fire(symbolic: bool) -> None:
    results = Harness(load_registry(), symbolic=symbolic).run(MASK_RULES)
    assert {r.rule for r in results} == set(MASK_RULES)
    for res in results:
        assert res.fired and not res.failures, res


@pytest.mark.parametrize("factor,fires", [(Fraction(1, 320), True), (Fraction(-9, 10), True), (Fraction(1, 3), True),
                                          (Fraction(1, 96), True), (Fraction(3, 2 ** 70), True),
                                          (Fraction(0.003125), False), (Fraction(0.1), False),
                                          (Fraction(2 ** 60 + 1, 2 ** 60), False)])
def test_a_factor_becomes_a_float_constant_only_when_it_is_the_floats_reading(factor: Fraction, fires: bool) -> None:
    """scale-full-one: r * full(1.0) is full(float(r)) only when r is the rational that float
    stands for (refine.ops.lower.float_rational: 0.003125 is 1/320, not its binary
    fraction). The harness compares within a tolerance, so it cannot
    tell a binary fraction from the simple rational next to it: this test does."""
    eng = Engine(load_registry())
    r = f'(bigrat (from-string "{factor.numerator}") (from-string "{factor.denominator}"))'
    eng._run("(push)")
    try:
        eng._run(f"(let $s (Scale (full 1.0 (vec-of 2)) {r}))\n(run 3)")
        try:
            eng._run(f"(check (= $s (full {float(factor)!r} (vec-of 2))))")
            fired = True
        except RuntimeError:
            fired = False
    finally:
        eng._run("(pop)")
    assert fired == fires


@pytest.mark.slow
def test_a_wrong_lookup_rule_is_caught(tmp_path: Path) -> None:
    """The tempting rule without the outer mask (out-of-range targets not zeroed: the
    target_mask_missing bug as a rule) is reported unsound."""
    (tmp_path / "wrong.py").write_text(
        "from refine.ops.registry import rule\n"
        "RULES = [rule('gather-off-unmasked', ['(= e (GatherOff w i g s))', '(= s (dim 0))', '(= si (shape i))'],\n"
        "              ['(union e (gather w (where_t (logical_or_t (lt_t i (full 0.0 si)) "
        "(ge_t i (full (to-f64 (size w g)) si))) (full 0.0 si) i) g))'], symbolic=False)]\n")
    reg = load_registry([tmp_path])
    (res,) = Harness(reg).run(["gather-off-unmasked"])
    assert res.failures, res


def _one_op(op: str, ins: list[TensorType], args: list[Any], attrs: dict[str, Any], reg: Any) -> Graph:
    g = Graph([Input(f"a{i}", t) for i, t in enumerate(ins)], [], [], "one")
    names = [f"a{i}" for i in range(len(ins))]
    out = reg.ops[op].shape(ins, attrs)
    g.nodes.append(Node("y", op, [*names, *args], attrs, out))
    g.outputs = [Output("y", "y", "other")]
    return g


@pytest.mark.parametrize("op,attrs", [
    ("log_softmax_stable", {"dim": 1}),
    ("nll_loss_forward", {"reduction": 0, "ignore_index": -100}),
    ("nll_loss_forward", {"reduction": 1, "ignore_index": -100}),
    ("nll_loss_forward", {"reduction": 2, "ignore_index": 3}),
    ("nll_loss_total_weight", {"reduction": 1, "ignore_index": -100}),
    ("nll_loss_backward", {"reduction": 1, "ignore_index": -100}),
    ("nll_loss_backward", {"reduction": 0, "ignore_index": -100}),
    ("_log_softmax_backward_data", {"dim": 1}),
])
def test_loss_op_decompositions_match_torch(op: str, attrs: dict[str, Any]) -> None:
    reg = load_registry()
    torch.manual_seed(0)
    x = torch.log_softmax(torch.randn(5, 7, dtype=torch.float64), 1)
    t = torch.tensor([1, attrs.get("ignore_index", -100), 3, 6, 0])  # one ignored target
    if op == "log_softmax_stable":
        vals = [torch.randn(5, 7, dtype=torch.float64) * 30]
    elif op in ("nll_loss_forward", "nll_loss_total_weight"):
        vals = [x, t]
    elif op == "nll_loss_backward":
        g = torch.randn(5, dtype=torch.float64) if attrs["reduction"] == 0 else torch.tensor(0.7, dtype=torch.float64)
        vals = [g, x, t, torch.tensor(4.0, dtype=torch.float64)]
    else:
        vals = [torch.randn(5, 7, dtype=torch.float64), x]
    types = [TensorType(tuple(v.shape), "int64" if not v.is_floating_point() else "float64") for v in vals]
    graph = _one_op(op, types, [], attrs, reg)
    core, rename = lower(graph, reg)
    got = eval_graph(core, reg, {f"a{i}": v for i, v in enumerate(vals)})[rename["y"]]
    want = apply_op(reg, op, vals, attrs)
    assert close(got, want), (got, want)


def test_unknown_nll_variants_fail_closed() -> None:
    reg = load_registry()
    with pytest.raises(Exception, match="without class weights"):
        reg.ops["nll_loss_forward"].shape([TensorType((5, 7)), TensorType((5,), "int64"), TensorType((7,))], {})


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_aten_nll_ops_map_when_not_decomposed(monkeypatch: pytest.MonkeyPatch, reduction: str) -> None:
    """Graphs that keep nll_loss_forward/backward and _log_softmax_backward_data (no
    decomposition): the capture replay checks the translation against eager float64."""
    table = dict(trace.DECOMPOSITIONS)
    for o in (torch.ops.aten.nll_loss_forward.default, torch.ops.aten.nll_loss_backward.default,
              torch.ops.aten._log_softmax_backward_data.default):
        table.pop(o, None)
    monkeypatch.setattr(trace, "DECOMPOSITIONS", table)

    def step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = F.nll_loss(F.log_softmax(model(x), -1), target, reduction=reduction)
        loss.backward()
        return loss

    torch.manual_seed(0)
    m, x, t = nn.Linear(4, 6), torch.randn(5, 4), torch.tensor([1, -100, 3, 5, 0])
    case = capture(capture.Spec(capture.Step(m, step, {"x": x, "target": t}),
                                lambda r: capture.Step(m, step, {"x": x, "target": t}), world_size=1))
    ops = {n["op"] for n in case.seq_doc["graph"]["nodes"]}
    assert {"nll_loss_forward", "nll_loss_total_weight", "nll_loss_backward", "_log_softmax_backward_data"} <= ops
    assert case.check().refines
