"""The zoo's GShard MoE under expert parallelism (models/zoo/moe_gshard.py): the correct
program refines in every configuration, each bug does not, at its line; the capture features
and rules it needs, each on a small program of its own.

Quick tier: the smoke configuration, the dropless variant's refusal, the small programs and
the rules' soundness. Slow: the other configurations and the bugs (about 2 min a bug: the
counterexample and its localization run on ~800-node graphs)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models.zoo import load
from refine import capture
from refine.frontends.capture import CaptureError
from refine.ops.registry import Rule, load_registry, rewrite, rule
from refine.prove.harness import Harness
from tests.helpers.capture import failing, timed_capture, wrong_numerically

ZOO = load("moe_gshard")
PROGRAM = ZOO.program


def test_the_program_is_well_formed() -> None:
    assert len(PROGRAM.configs) >= 2
    marked = ZOO.marked()
    for bug in PROGRAM.bugs:
        assert len(ZOO.culprit_lines(bug)) == 1, (bug, marked)


def test_the_smoke_configuration_refines() -> None:
    case = timed_capture(ZOO.make_case(PROGRAM.smoke))
    report = case.check()
    assert report.refines, report
    rel = {o.name: o.relation for o in report.outputs}
    assert rel["loss"] == "loss@0"
    for layer in range(2):  # each rank holds its experts' gradients, whole
        for w in ("wi", "wo"):
            name = f"layers.{layer}.moe.experts.{w}.grad"
            assert rel[name] == f"cat({name}@0, {name}@1, dim=0)"
    ops = {n["op"] for n in case.dist_doc["ranks"][0]["graph"]["nodes"]}
    assert {"all_to_all", "argmax", "cumsum"} <= ops  # dist.all_to_all_single, GShard's gating


# every configuration's verdict: tests/cases/test_zoo.py


WRONG = {  # bug -> the outputs it makes wrong
    "expert_grad_not_scaled": {f"layers.{i}.moe.experts.{w}.grad" for i in range(2) for w in ("wi", "wo")},
    "router_grad_not_reduced": {f"layers.{i}.moe.gate.weight.grad" for i in range(2)},
}


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(PROGRAM.bugs))
def test_each_bug_does_not_refine_at_its_line(bug: str) -> None:
    case = timed_capture(ZOO.make_case(PROGRAM.bugs[bug].config, bug))
    report = case.check()
    assert not report.refines
    assert report.culprit is not None
    if bug in WRONG:
        assert wrong_numerically(case) == WRONG[bug]
        assert failing(report) == WRONG[bug]
        assert report.culprit.rank_source in ZOO.culprit_lines(bug), report.culprit
    else:
        # a reorder of clean values: found where they meet the gate weights (the combine),
        # not at the reordering line (the module docstring says why)
        assert "loss" in failing(report)
        line = next(i for i, t in enumerate(ZOO.path.read_text().splitlines(), 1)
                    if 'return torch.cat([torch.einsum("sec,ecm->sm"' in t)
        assert report.culprit.source == f"moe_gshard.py:{line}"


def test_the_dropless_variant_is_refused_where_sizes_depend_on_data() -> None:
    """At the ranks' first read of the routing's counts (more: tests/cases/test_zoo_moe_dropless.py)."""
    with pytest.raises(CaptureError, match="data-dependent") as e:
        capture(ZOO.module.make_dropless_case())
    line = next(i for i, t in enumerate(ZOO.path.read_text().splitlines(), 1)
                if "send = counts.reshape(w, local).sum(1).tolist()" in t)
    assert f"moe_gshard.py:{line}" in str(e.value)


# ---------------------------------------------------------------------------------------
# what it needs, each on a small program: GShard's gating ops (argmax, one_hot, a cast to
# bool and back to int, cumsum), dist.all_to_all_single, a select's backward


class _Gating(nn.Module):
    """Tokens sharded; top-1 routing by argmax, a slot by cumsum, weights by one_hot."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(4, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = F.softmax(self.w(x), dim=-1)
        mask = F.one_hot(torch.argmax(gates, dim=-1), 3)
        pos = torch.cumsum(mask, dim=-1) * (mask.sum(-1, keepdim=True) < 2)  # int * bool
        keep = (gates * mask).bool().to(x.dtype)
        return (gates * keep).sum(-1) * pos.sum(-1).to(x.dtype) + x.select(1, 2)


def _gating_step(model: nn.Module, x: torch.Tensor, ranks: bool = False) -> torch.Tensor:
    loss = model(x).pow(2).sum()
    loss.backward()
    if ranks:  # a sum over the rows: the ranks' gradients and losses add up
        dist.all_reduce(model.w.weight.grad)
        dist.all_reduce(loss := loss.detach().clone())
    return loss


def _gating_spec() -> capture.Spec:
    torch.manual_seed(0)
    model, x = _Gating(), torch.randn(4, 4)
    n = 4 // 2

    def rank(r: int) -> capture.Step:
        return capture.Step(model, lambda m, **kw: _gating_step(m, **kw, ranks=True),
                            {"x": capture.shard(x[r * n:(r + 1) * n], 0, "dp")})

    return capture.Spec(sequential=capture.Step(model, _gating_step, {"x": x}), rank=rank, world_size=2,
                        mesh={"dp": 2}, name="gating")


def test_gating_ops_capture_and_refine() -> None:
    """argmax, one_hot, int * bool, x.bool(), a select's backward: captured (the sequential
    program replayed against torch by capture itself) and refined under data parallelism."""
    case = capture(_gating_spec())
    ops = {n["op"] for n in case.seq_doc["graph"]["nodes"]}
    assert {"argmax", "cast", "ne", "cumsum"} <= ops
    report = case.check()
    assert report.refines, report


class _Exchange(nn.Module):
    """Rows sharded; each rank's rows scaled, exchanged by dist.all_to_all_single (chunk j to
    rank j) and read back in source order: the sequential program is the rows, transposed
    in blocks."""

    def __init__(self, ranks: bool = False, bug: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.ranks, self.bug = ranks, bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.w
        if not self.ranks:  # [ranks, chunks, 4] -> [chunks, ranks, 4]
            return y.reshape(2, 2, 4).transpose(0, 1).reshape(4, 4)
        out = ZOO.module.AllToAll.apply(dist.group.WORLD, y)  # dist.all_to_all_single, backward reversed
        return out.flip(0) if self.bug else out


def _exchange_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).pow(2).sum()
    loss.backward()
    if model.ranks:
        dist.all_reduce(model.w.grad)
        dist.all_reduce(loss := loss.detach().clone())
    return loss


def _exchange_spec(bug: bool) -> capture.Spec:
    torch.manual_seed(0)
    seq, x = _Exchange(), torch.randn(4, 4)

    def rank(r: int) -> capture.Step:
        m = _Exchange(ranks=True, bug=bug)
        m.load_state_dict(seq.state_dict())
        capture.replicate(m.w)
        return capture.Step(m, _exchange_step, {"x": capture.shard(x[2 * r:2 * r + 2], 0, "dp")})

    return capture.Spec(sequential=capture.Step(seq, _exchange_step, {"x": x}), rank=rank, world_size=2,
                        mesh={"dp": 2}, name="exchange")


def test_the_legacy_all_to_all_single_is_an_exchange() -> None:
    """dist.all_to_all_single(out, x) writes its output buffer (c10d alltoall_base_): its
    readers read the exchange. The rows it delivers are checked; read in the wrong order
    they are not the sequential ones."""
    case = capture(_exchange_spec(bug=False))
    assert [n["op"] for n in case.dist_doc["ranks"][0]["graph"]["nodes"]].count("all_to_all") == 2  # and back
    assert case.check().refines
    assert not capture(_exchange_spec(bug=True)).check().refines


# ---------------------------------------------------------------------------------------
# the rules it added: sound and exercised, and wrong variants caught

NEW = ("transpose-unit-dims-view", "slice-view-outer-dim", "slice-view-merged-dim", "cat-scale-common",
       "sum-common-scale", "argmax_k")


@pytest.mark.parametrize("symbolic", [False, True])
def test_the_new_rules_are_sound_and_fire(symbolic: bool) -> None:
    reg = load_registry()
    names = [r.name for r in reg.rules if r.name.startswith(NEW)]
    assert len(names) >= 30
    for r in Harness(reg, seed=1, symbolic=symbolic).run(names):
        assert not r.failures, (r.rule, r.failures[:4])
        assert r.fired, f"{r.rule} never fired"


def test_the_harness_catches_wrong_variants() -> None:
    reg = load_registry()
    bad = [
        # a transpose over two dims of size other than 1 is no view
        rule("bad-transpose-view", ["(= e (transpose x i j))", "(= j (+ i 1))", "(= sx (shape x))"],
             ["(union e (view x (vec-set (vec-set sx i (vec-get sx j)) j (vec-get sx i))))"]),
        # the common factor taken twice
        rewrite("bad-cat-scale", "(cat (Scale a r) (Scale b r) d)", "(Scale (cat a b d) (* r r))"),
        # argmax over a concat along its own dim
        rewrite("bad-argmax-cat", "(argmax_k (cat a b d) d)", "(cat (argmax_k a d) (argmax_k b d) d)"),
    ]
    # each in the family it imitates, so it is given that family's seeds
    families = {"bad-transpose-view": "reshape", "bad-cat-scale": "structure", "bad-argmax-cat": "moe"}
    extra = [Rule(r.name, r.text, families[r.name]) for r in bad]
    reg = replace(reg, rules=list(reg.rules) + extra, ops=dict(reg.ops), decls=list(reg.decls),
                  families=list(reg.families))
    results = {r.rule: r for r in Harness(reg, seed=0).run([r.name for r in bad])}
    for r in bad:
        assert results[r.name].failures, f"{r.name} was not caught"
