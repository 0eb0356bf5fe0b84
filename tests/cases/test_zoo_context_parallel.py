"""The zoo's context parallelism (models/zoo/context_parallel.py): DeepSpeed-Ulysses over a
2-layer causal transformer refines in every configuration, each bug does not, at its line;
and the `relayout` strategy (refine.prove.walk) the Ulysses exchange needs, shown on one
attention layer.

Quick tier: one Ulysses attention layer with and without the strategy. Slow: the whole
program (about 1 min a configuration, 2 min a bug)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from models.zoo import load
from refine import capture, check
from refine.prove.policy import DEFAULT, STRATEGIES
from tests.helpers.capture import failing, timed_capture, wrong_numerically

ZOO = load("context_parallel")
PROGRAM = ZOO.program
CP = ZOO.module


def test_the_program_is_well_formed() -> None:
    assert len(PROGRAM.configs) >= 2
    for bug in PROGRAM.bugs:
        assert len(ZOO.culprit_lines(bug)) == 1, bug


# ---------------------------------------------------------------------------------------
# one Ulysses attention layer: the exchange's counterpart lies past the chunk, stack,
# all_to_all, unbind and concat of each exchange


def _step(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), target, reduction="sum")
    loss.backward()
    if dist.is_initialized():
        for p in model.parameters():
            dist.all_reduce(p.grad)
        return funcol.all_reduce(loss.detach(), "sum", dist.group.WORLD)
    return loss


def _attention_case() -> capture.Case:
    torch.manual_seed(0)
    seq = CP.Attention(4)
    x, target = torch.randn(8, 8), torch.randn(8, 8)

    def rank(r: int) -> capture.Step:
        m = CP.Attention(4, "ulysses")
        m.load_state_dict(seq.state_dict())
        for p in m.parameters():
            capture.replicate(p)
        rows = slice(4 * r, 4 * r + 4)
        return capture.Step(m, _step, {"x": capture.shard(x[rows], 0, "cp"), "target": capture.shard(target[rows], 0, "cp")})

    return capture(capture.Spec(sequential=capture.Step(seq, _step, {"x": x, "target": target}), rank=rank,
                                world_size=2, mesh={"cp": 2}, name="ulysses_attention"))


@pytest.fixture(scope="module")
def attention() -> capture.Case:
    return _attention_case()


def test_ulysses_attention_refines(attention: capture.Case) -> None:
    report = check(*attention)
    assert report.refines, report
    assert report.stats["strategies"]["relayout"]["kept"] > 0


def test_without_the_relayout_strategy_it_is_not_proven(attention: capture.Case) -> None:
    """The exchange's counterpart is out of the wide try's reach: without the structural
    retry the output projection has no clean relation (the false alarm issue 23 lists)."""
    policy = replace(DEFAULT, strategies=tuple(s for s in STRATEGIES if s != "relayout"))
    report = check(*attention, policy=policy, tries=1)
    assert not report.refines and report.culprit is not None
    assert report.culprit.op == "mm"


# ---------------------------------------------------------------------------------------
# one ring attention layer (non-causal): the online softmax with a running max
# (rules/online_softmax.py), a flash-style backward from the merged log-sum-exp, the key and
# value gradients reduce-scattered over the sequence dim


def _ring_case(world: int, heads: int, bug: str | None = None) -> capture.Case:
    torch.manual_seed(0)
    seq = CP.Attention(heads, causal=False)
    x, target = torch.randn(8, 8), torch.randn(8, 8)
    n = 8 // world

    def rank(r: int) -> capture.Step:
        m = CP.Attention(heads, "ring", bug, causal=False)
        m.load_state_dict(seq.state_dict())
        for p in m.parameters():
            capture.replicate(p)
        rows = slice(n * r, n * (r + 1))
        return capture.Step(m, _step, {"x": capture.shard(x[rows], 0, "cp"), "target": capture.shard(target[rows], 0, "cp")})

    return capture(capture.Spec(sequential=capture.Step(seq, _step, {"x": x, "target": target}), rank=rank,
                                world_size=world, mesh={"cp": world}, name=f"ring_attention_{world}x{heads}"))


@pytest.fixture(scope="module")
def ring() -> capture.Case:
    return _ring_case(2, 4)


def test_ring_attention_refines(ring: capture.Case) -> None:
    report = check(*ring)
    assert report.refines, report


@pytest.mark.slow
@pytest.mark.parametrize(("world", "heads"), [(2, 1), (4, 2)])
def test_ring_attention_refines_over_ranks_and_heads(world: int, heads: int) -> None:
    report = check(*_ring_case(world, heads))
    assert report.refines, report


def test_without_the_online_softmax_rules_the_merge_is_not_attention(ring: capture.Case) -> None:
    """The running-max merge is what rules/online_softmax.py relates: without the family the
    proof stops at the attention output `softmax(s) @ v` (softmax itself is fused into it)."""
    reg = ring.registry
    rules = [r for r in reg.rules if r.family != "online_softmax"]
    report = check(ring.seq, ring.dist, replace(reg, rules=rules), tries=1)
    assert not report.refines and report.culprit is not None
    assert report.culprit.op == "bmm" and report.culprit.source == _line("return torch.softmax(scores, dim=-1) @ v")


def test_a_block_merged_without_its_max_shift_does_not_refine() -> None:
    """ring_no_rescale: the running sums stay at the old max while the new block is at the new
    one; two shifts in one sum are no attention. Each term is right at its own shift, so the
    report names the sequential attention output, with no rank line (Bug.known_miss)."""
    case = _ring_case(2, 4, bug="ring_no_rescale")
    assert wrong_numerically(case)
    report = check(*case)
    assert not report.refines and report.culprit is not None
    assert report.culprit.op == "bmm" and report.culprit.source == _line("return torch.softmax(scores, dim=-1) @ v")


def _line(snippet: str) -> str:
    return f"context_parallel.py:{next(i for i, t in enumerate(ZOO.path.read_text().splitlines(), 1) if snippet in t)}"


# ---------------------------------------------------------------------------------------
# the whole program


# every configuration's verdict: tests/cases/test_zoo.py


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(PROGRAM.bugs))
def test_each_bug_does_not_refine(bug: str) -> None:
    case = timed_capture(ZOO.make_case(PROGRAM.bugs[bug].config, bug))
    report = case.check()
    assert not report.refines
    assert report.culprit is not None
    if bug == "qkv_grad_not_reduced":
        wrong = {f"layers.{i}.attn.qkv.weight.grad" for i in range(2)}
        assert wrong_numerically(case) == wrong == failing(report)
        assert report.culprit.rank_source in ZOO.culprit_lines(bug), report.culprit
    elif bug == "ring_no_rescale":  # two max shifts in one sum: found at the attention output
        assert wrong_numerically(case) == failing(report)
        assert report.culprit.source == _line("return torch.softmax(scores, dim=-1) @ v"), report.culprit
    else:
        # heads out of order: clean values in the wrong columns, found where they meet the
        # output projection, not at the exchange (as moe_gshard's combine order)
        assert "loss" in failing(report)
        line = next(i for i, t in enumerate(ZOO.path.read_text().splitlines(), 1)
                    if "return self.proj(o.transpose(0, 1)" in t)
        assert report.culprit.source == f"context_parallel.py:{line}"
