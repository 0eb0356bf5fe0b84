"""Casts from bool / integer to floating point (rules/cast.py): captured as `cast`, related
through concats and slices, never through sums; value-changing casts stay refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from refine import capture
from refine.frontends.capture import CaptureError
from refine.ir.graph import TensorType
from refine.ops.registry import ShapeError, load_registry
from refine.oracle.differential import differential
from refine.prove.harness import Harness

REG = load_registry()


class Masked(nn.Module):
    """A masked mean: the mask count is a bool -> float cast, summed."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1.0, 1.0, 4))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keep = (t > 0).float()
        return (x * self.w * keep).sum(), keep.sum()


def seq_step(model: nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    total, count = model(x, t)
    loss = total / count
    loss.backward()
    return loss


def dp_step(model: nn.Module, x: torch.Tensor, t: torch.Tensor, bug: str | None = None) -> torch.Tensor:
    """Rows split over ranks: the loss needs the global total and the global count."""
    total, count = model(x, t)
    if bug != "local_count":
        count = funcol.all_reduce(count, "sum", dist.group.WORLD)
    loss = total / count  # this rank's share of the global masked mean
    loss.backward()
    dist.all_reduce(model.w.grad)
    return funcol.all_reduce(loss.detach(), "sum", dist.group.WORLD)


def spec(bug: str | None = None) -> capture.Spec:
    torch.manual_seed(0)
    x, t = torch.randn(6, 4), torch.randint(-2, 3, (6, 4))
    model = Masked()

    def rank(r: int) -> capture.Step:
        m = Masked()
        capture.replicate(m.w)
        xs, ts = capture.shard(x[3 * r:3 * r + 3], 0), capture.shard(t[3 * r:3 * r + 3], 0)
        return capture.Step(m, lambda mod, x, t: dp_step(mod, x, t, bug), {"x": xs, "t": ts})

    return capture.Spec(capture.Step(model, seq_step, {"x": x, "t": t}), rank, world_size=2)


def test_a_mask_count_cast_to_float_refines() -> None:
    case = capture(spec())
    ops = {n["op"]: n for n in case.seq_doc["graph"]["nodes"]}
    assert ops["cast"]["attrs"] == {"dtype": "float32"}
    report = case.check()
    assert report.refines, report


def test_a_count_that_misses_the_other_ranks_is_found_at_the_division() -> None:
    case = capture(spec(bug="local_count"))
    wrong = {d.output for d in differential(case.seq, case.dist, case.registry, seed=1) if d.ok is False}
    assert wrong == {"loss", "w.grad"}
    report = case.check()
    assert not report.refines
    assert report.culprit is not None and report.culprit.op == "div", report


def test_value_changing_casts_are_refused() -> None:
    class ToInt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return (x * self.w).sum() + (x * 3).long().sum(), torch.ones(())

    x, t = torch.randn(6, 4), torch.zeros(6, 4)
    s = capture.Step(ToInt(), seq_step, {"x": x, "t": t})
    with pytest.raises(CaptureError, match="a cast from torch.float32 to torch.int64"):
        capture(capture.Spec(s, lambda r: s, world_size=1))
    cast = REG.ops["cast"]
    with pytest.raises(ShapeError, match="changes values"):
        cast.shape([TensorType((2,), "float32")], {"dtype": "int64"})
    with pytest.raises(ShapeError, match="changes values"):
        cast.shape([TensorType((2,), "int64")], {"dtype": "bool"})
    assert cast.shape([TensorType((2,), "bool")], {"dtype": "float32"}) == TensorType((2,), "float32")


def test_cast_rules_are_sound_and_none_crosses_a_sum() -> None:
    names = [r.name for r in REG.rules if "cast_float_t" in r.name]
    assert sorted(names) == ["cast_float_t-of-slice", "cast_float_t-out-of-transpose", "cast_float_t-out-of-view",
                             "cast_float_t-over-cat", "slice-into-cast_float_t", "view-into-cast_float_t"]
    for r in Harness(REG, seed=5).run(names):
        assert r.fired and not r.failures, (r.rule, r.failures[:3])
