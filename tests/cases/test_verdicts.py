"""The three verdicts (refine.check, refine.verdict.counterexample): REFINES is a proof; DOES
NOT REFINE comes with a counterexample (inputs consistent with the relations on which an
output differs), written and read back by --counterexample; UNPROVEN (exit 3) when the proof
stops and the search finds none: correct programs the prover cannot relate get it, never
DOES NOT REFINE. A REFINES the numbers contradict is a soundness failure."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from refine.check import SoundnessFailure, _self_check, check_files
from refine.cli import main
from refine.frontends.build import GraphBuilder, dist_doc, seq_doc, write_case
from refine.frontends.graphfile import load_dist, load_seq
from refine.ir.graph import Placement
from refine.ops.interp import canon, eval_graph, eval_ranks, split_placed
from refine.ops.registry import load_registry
from refine.verdict import counterexample
from refine.verdict.counterexample import SIGNIFICANT, Counterexample, OutputError, Search
from tests.helpers import MODELS

BUG_TWINS = sorted(p.name for p in MODELS.iterdir() if "_bug_" in p.name and (p / "dist.json").exists())
CORRECT = sorted(p.name for p in MODELS.iterdir() if "_bug_" not in p.name and (p / "dist.json").exists())

# y = f(x) elementwise, x sharded by rows on 2 ranks, each rank computing an equal function
# the rules have no identity for: correct, numerically equal, unprovable by rewriting.
Body = Callable[[GraphBuilder, str], str]
IDENTITIES: dict[str, tuple[Body, Body]] = {
    "tanh = 2 sigmoid(2x) - 1": (
        lambda g, x: g.op("tanh", x),
        lambda g, x: g.op("sub", g.op("mul", g.op("sigmoid", g.op("mul", x, 2.0)), 2.0), 1.0)),
    "relu = (x + |x|) / 2": (
        lambda g, x: g.op("relu", x),
        lambda g, x: g.op("mul", g.op("add", x, g.op("abs", x)), 0.5)),
    "sin(2x) = 2 sin(x) cos(x)": (
        lambda g, x: g.op("sin", g.op("mul", x, 2.0)),
        lambda g, x: g.op("mul", g.op("mul", g.op("sin", x), g.op("cos", x)), 2.0)),
    "exp(x)^2 = exp(2x)": (
        lambda g, x: g.op("mul", g.op("exp", x), g.op("exp", x)),
        lambda g, x: g.op("exp", g.op("mul", x, 2.0))),
}


def _elementwise(tmp: Path, seq_body: Body, rank_body: Body) -> tuple[Path, Path]:
    s = GraphBuilder()
    s.output("y", seq_body(s, s.input("x", [4, 6])))
    ranks = {}
    for r in range(2):
        d = GraphBuilder()
        d.output("y", rank_body(d, d.input("x", [2, 6])))
        ranks[r] = d
    write_case(tmp, seq_doc(s), dist_doc({"tp": 2}, ranks, [{"from": "x", "placements": ["Shard(0)"]}],
                                         [{"output": "y", "placements": ["Shard(0)"]}]))
    return tmp / "seq.json", tmp / "dist.json"


@pytest.mark.parametrize("case", BUG_TWINS)
def test_every_bundled_bug_twin_has_a_counterexample(case: str) -> None:
    report = check_files(MODELS / case / "seq.json", MODELS / case / "dist.json")
    assert report.verdict == "DOES NOT REFINE" and report.exit_code == 1, str(report)
    assert report.search is not None and report.search.found is not None, str(report)
    bad = report.search.found.failing()
    assert bad and all(o.rel_err > SIGNIFICANT for o in bad), bad
    assert "counterexample: random inputs" in str(report)


@pytest.mark.parametrize("case", CORRECT)
def test_every_bundled_correct_case_refines_without_a_search(case: str) -> None:
    report = check_files(MODELS / case / "seq.json", MODELS / case / "dist.json", self_check=True)
    assert report.verdict == "REFINES" and report.exit_code == 0 and report.search is None, str(report)


@pytest.mark.parametrize("name", sorted(IDENTITIES))
def test_a_correct_program_the_prover_cannot_relate_is_unproven(tmp_path: Path, name: str) -> None:
    seq, dist = _elementwise(tmp_path, *IDENTITIES[name])
    report = check_files(seq, dist)
    assert report.verdict == "UNPROVEN" and report.exit_code == 3, str(report)
    assert report.search is not None and report.search.found is None
    assert report.search.agreed == counterexample.TRIES
    assert report.culprit is not None, "UNPROVEN names the node where the proof stopped"
    text = str(report)
    assert "UNPROVEN" in text and "the proof stopped at" in text
    assert f"agreed on {counterexample.TRIES} random input" in text
    out = CliRunner().invoke(main, ["check", str(seq), str(dist), "--format", "json"])
    assert out.exit_code == 3, out.output
    doc = json.loads(out.output)
    assert doc["verdict"] == "UNPROVEN" and doc["search"]["counterexample"] is None


@pytest.mark.parametrize("name", sorted(IDENTITIES))
def test_the_same_programs_with_a_wrong_constant_do_not_refine(tmp_path: Path, name: str) -> None:
    seq_body, rank_body = IDENTITIES[name]
    seq, dist = _elementwise(tmp_path, seq_body, lambda g, x: g.op("mul", rank_body(g, x), 1.01))
    report = check_files(seq, dist)
    assert report.verdict == "DOES NOT REFINE", str(report)
    assert report.search is not None and report.search.found is not None
    (err,) = report.search.found.failing()
    assert err.output == "y" and err.rel_err > 1e-3


def test_without_a_search_a_bug_is_unproven() -> None:
    """No counterexample, no DOES NOT REFINE: --tries 0 leaves a bug twin UNPROVEN."""
    case = MODELS / "tp_mlp_bug_bias_before_sum"
    out = CliRunner().invoke(main, ["check", str(case / "seq.json"), str(case / "dist.json"), "--tries", "0"])
    assert out.exit_code == 3, out.output
    assert "UNPROVEN" in out.output


@pytest.mark.parametrize("case", ["tp_mlp_bug_bias_before_sum", "tp_mlp_symbolic_bug_bias_before_sum",
                                  "vocab_embedding_bug_wrong_offset"])
def test_the_counterexample_is_written_and_read_back(tmp_path: Path, case: str) -> None:
    seq_path, dist_path = MODELS / case / "seq.json", MODELS / case / "dist.json"
    cex_dir = tmp_path / "cex"
    out = CliRunner().invoke(main, ["check", str(seq_path), str(dist_path), "--counterexample", str(cex_dir)])
    assert out.exit_code == 1, out.output
    doc = json.loads((cex_dir / "counterexample.json").read_text())
    assert all("/" not in t["file"] for t in doc["tensors"])
    cex = counterexample.load(cex_dir)
    registry = load_registry()
    seq = load_seq(seq_path, registry)
    dist = load_dist(dist_path, registry, seq)
    report = check_files(seq_path, dist_path)
    assert report.search is not None and report.search.found is not None
    found = report.search.found
    assert cex.seed == found.seed and cex.sizes == found.sizes
    for name, x in found.seq_inputs.items():
        assert torch.equal(cex.seq_inputs[name], x)
    for r, vals in found.rank_inputs.items():
        for name, x in vals.items():
            assert torch.equal(cex.rank_inputs[r][name], x)
    replayed = counterexample.replay(seq, dist, registry, cex)
    assert [(o.output, o.ok, o.abs_err) for o in replayed] == [(o.output, o.ok, o.abs_err) for o in found.outputs]
    assert not replayed[0].ok


def test_significant_ignores_rounding_but_not_a_small_bug() -> None:
    want = torch.randn(64, dtype=torch.float64)
    assert not counterexample.significant(want + 1e-13, want)[0]
    assert counterexample.significant(want * 1.001, want)[0]
    assert counterexample.significant(want[:3], want)[0]  # another shape
    assert not counterexample.significant(torch.tensor([float("nan")]), torch.tensor([float("nan")]))[0]
    assert counterexample.significant(torch.tensor([1.0]), torch.tensor([float("nan")]))[0]


def test_a_refines_the_numbers_contradict_is_a_soundness_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """The self check runs a REFINES on random inputs; outputs that differ raise (the CLI
    says so, exit 2, never a verdict)."""
    case = MODELS / "tp_mlp"
    assert check_files(case / "seq.json", case / "dist.json", self_check=True).refines
    # the check the self check makes, on a pair that truly differs, finds it
    registry = load_registry()
    bug = MODELS / "tp_mlp_bug_bias_before_sum"
    seq = load_seq(bug / "seq.json", registry)
    with pytest.raises(SoundnessFailure, match="differs on random inputs"):
        _self_check(seq, load_dist(bug / "dist.json", registry, seq), registry)
    # and a REFINES whose numbers it contradicts fails loudly

    def contradicted(*args: object, **kw: object) -> Search:
        return Search(1, 0, Counterexample(0, {}, [OutputError("y", "y@0", 1.0, 1.0, False)]))

    monkeypatch.setattr(counterexample, "search", contradicted)
    with pytest.raises(SoundnessFailure):
        check_files(case / "seq.json", case / "dist.json", self_check=True)
    out = CliRunner().invoke(main, ["check", str(case / "seq.json"), str(case / "dist.json"), "--self-check"])
    assert out.exit_code == 2 and "SoundnessFailure" in out.output, out.output


# The rank node each bundled twin's bug makes wrong first (models/make_examples.py): the op the
# bug plants, or, for a missing op, the node whose value it should have transformed (for a
# missing all-reduce, the partial sum it should have reduced: the matmul, the masked lookup); and
# rank nodes the report must list among those it is computed from (a wrong offset sits in
# the range tests, not in the lookup that reads them).
BUG_NODE: dict[str, tuple[str, set[str]]] = {
    "sp_mlp_bug_bias_before_reduce_scatter": ("fc2_bias", set()),
    "sp_mlp_bug_gather_wrong_dim": ("sp_gather_view", {"sp_gather"}),
    "sp_mlp_bug_gather_wrong_order": ("sp_gather", set()),
    "sp_mlp_symbolic_bug_bias_before_reduce_scatter": ("fc2_bias", set()),
    "sp_mlp_symbolic_bug_gather_wrong_dim": ("sp_gather_view", {"sp_gather"}),
    "tp_attention_bug_bias_before_sum": ("out_bias", set()),
    "tp_attention_bug_missing_all_reduce": ("out_proj", set()),
    "tp_attention_bug_reduce_replicated_input": ("x_sum", set()),
    "tp_mlp_bug_bias_before_sum": ("fc2_bias", set()),
    "tp_mlp_bug_double_all_reduce": ("fc2_sum_again", set()),
    "tp_mlp_bug_missing_all_reduce": ("fc2", set()),
    "tp_mlp_symbolic_bug_bias_before_sum": ("fc2_bias", set()),
    "vocab_embedding_bug_missing_all_reduce": ("tok_embed_masked", set()),
    "vocab_embedding_bug_missing_output_mask": ("tok_embed", set()),
    "vocab_embedding_bug_wrong_offset": ("tok_embed", {"below", "above", "local_ids"}),
}


def test_the_table_covers_every_twin() -> None:
    assert sorted(BUG_NODE) == BUG_TWINS


@pytest.mark.parametrize("case", BUG_TWINS)
def test_the_report_names_the_rank_line_the_counterexample_shows_wrong(case: str) -> None:
    report = check_files(MODELS / case / "seq.json", MODELS / case / "dist.json")
    c = report.culprit
    node, chain = BUG_NODE[case]
    dist = json.loads((MODELS / case / "dist.json").read_text())
    sources = {n["name"]: n.get("source") for n in dist["ranks"][0]["graph"]["nodes"]}
    assert c is not None, str(report)
    if c.seq_source is not None:  # the localization's own numeric repair named the rank line
        assert c.divergence is None and c.rank_source == sources[node], str(report)
        return
    assert c.divergence is not None, str(report)
    d = c.divergence
    assert d.rank_node == node, str(report)
    assert chain <= {n for n, _ in d.chain}, d.chain
    # the report's rank line is the divergence's (or, on the same line, the localization's
    # name for the op there, e.g. the core `fc2_bias.Sum@0` of the user's `fc2_bias` add)
    assert d.source == sources[node] and c.rank_source == d.source
    assert f"the first rank value that is wrong: {node} ({d.op}) at {d.source}" in " ".join(str(report).split())


def test_a_divergence_is_a_repair_the_numbers_confirm() -> None:
    """Setting the named rank node to what the report says it should hold makes every output
    right on the counterexample; the node as the ranks compute it does not."""
    case = MODELS / "tp_mlp_bug_bias_before_sum"
    reg = load_registry()
    seq = load_seq(case / "seq.json", reg)
    dist = load_dist(case / "dist.json", reg, seq)
    found = counterexample.search(seq, dist, reg).found
    assert found is not None
    d = counterexample.diverge(seq, dist, reg, found)
    assert d is not None and d.placement == "placed [Partial(sum)]" and d.seq_node == "fc2_bias"
    seq_vals = eval_graph(seq, reg, found.seq_inputs)
    pieces = split_placed(seq_vals["fc2_bias"], (Placement("partial"),), dist.mesh, torch.Generator().manual_seed(1))
    override = {(r, d.rank_node): canon(pieces[r], "float32") for r in d.ranks}
    fixed = eval_ranks(dist.ranks, reg, found.rank_inputs, override=override)
    errors, _ = counterexample.compare(seq, dist, reg, seq_vals, fixed)
    assert all(e.ok for e in errors)
    as_is = eval_ranks(dist.ranks, reg, found.rank_inputs)
    assert not all(e.ok for e in counterexample.compare(seq, dist, reg, seq_vals, as_is)[0])


@pytest.mark.parametrize("case", [c for c in BUG_TWINS if c.endswith("_bug_missing_all_reduce")])
def test_a_missing_all_reduce_is_named_where_the_partial_sum_is_made(case: str) -> None:
    """The ranks' values are right, in pieces: the divergence is the partial sum that, held
    whole on every rank, makes every output right (the node after which the all-reduce
    belongs), not the first value computed from it."""
    report = check_files(MODELS / case / "seq.json", MODELS / case / "dist.json")
    d = report.culprit.divergence if report.culprit else None
    assert d is not None and d.held == "placed [Partial(sum)]" and d.placement == "placed [Replicate]", str(report)
    assert d.rank_node == BUG_NODE[case][0]
    assert "a collective is missing after it" in " ".join(str(report).replace("│", " ").split())
