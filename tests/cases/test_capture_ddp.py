"""torch's DistributedDataParallel as users write it: `DDP(model)` in the rank factory, the
step calling `loss.backward()` and nothing else, `no_sync()` for gradient accumulation.
Capture writes the reducer's averaging into the trace (refine.frontends.capture.ddp): the
correct programs refine and compute the sequential step; a step that never leaves
`no_sync()` or forgets to divide the micro-batch losses does not refine; what capture
cannot follow (a communication hook, find_unused_parameters) is refused by name."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from refine import capture
from refine.frontends.capture import CaptureError
from tests.helpers.capture import wrong_numerically

B, H = 8, 6


class MLP(nn.Module):
    def __init__(self, buffer: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)
        if buffer:  # a non-trainable scale DDP broadcasts from the first rank at each forward
            self.register_buffer("scale", torch.full((H,), 0.5))
        self.buffer = buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(torch.tanh(self.fc1(x)))
        return y * self.scale if self.buffer else y


def train_step(micro: int, bug: str | None = None) -> Callable[..., torch.Tensor]:
    """Gradient accumulation over `micro` micro-batches, the DDP way: no_sync() but on the last."""
    def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(())
        for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            last = i == micro - 1 and bug != "never_synced"
            sync = contextlib.nullcontext() if last or not isinstance(model, DDP) else model.no_sync()
            with sync:
                loss = F.mse_loss(model(xs), ys)
                if bug != "loss_not_divided":
                    loss = loss / micro
                loss.backward()
            total = total + loss.detach()
        return total
    return step


def make_case(world: int = 2, micro: int = 1, bug: str | None = None, buffer: bool = False,
              wrap: Callable[[nn.Module], nn.Module] = DDP) -> capture.Spec:
    torch.manual_seed(0)
    seq = MLP(buffer)
    x, y = torch.randn(B, H), torch.randn(B, H)
    b = B // world

    def rank(r: int) -> capture.Step:
        model = MLP(buffer)
        model.load_state_dict(seq.state_dict())
        part = slice(r * b, (r + 1) * b)
        return capture.Step(wrap(model), train_step(micro, bug),
                            {"x": capture.shard(x[part], 0), "y": capture.shard(y[part], 0)})

    return capture.Spec(sequential=capture.Step(seq, train_step(micro), {"x": x, "y": y}), rank=rank,
                        world_size=world, name=f"ddp_{world}_{micro}_{bug}")


@pytest.mark.parametrize("world, micro, buffer", [(2, 1, False), (4, 1, False), (2, 2, False), (2, 1, True)])
def test_ddp_refines(world: int, micro: int, buffer: bool) -> None:
    case = capture(make_case(world, micro, buffer=buffer))
    assert wrong_numerically(case) == set()
    ops = [n.op for g in case.dist.ranks.values() for n in g.nodes]
    assert "all_reduce" in ops and ("broadcast" in ops) == buffer
    report = case.check()
    assert report.verdict == "REFINES", report


def test_micro_batched_ranks_refine_the_whole_batch_step() -> None:
    """The sequential step runs the whole batch at once; each rank accumulates micro-batches.
    The sequential loss is a Sum over every micro-batch of every rank, the ranks' mean a Sum
    of per-rank Sums: they meet only when both sides are rewritten (refine.check._expect_step)."""
    spec = make_case(2, 2)
    spec.sequential.step = train_step(1)  # type: ignore[union-attr]
    case = capture(spec)
    assert wrong_numerically(case) == set()
    report = case.check()
    assert report.verdict == "REFINES", report


def sgd(step: Callable[..., torch.Tensor], lr: float) -> Callable[..., torch.Tensor]:
    """The step, then an SGD update of every parameter in place (the optimizer's step)."""
    def stepped(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = step(model, x, y)
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(lr * p.grad)
        return loss
    return stepped


@pytest.mark.parametrize("rank_lr, verdict", [(0.1, "REFINES"), (0.2, "DOES NOT REFINE")])
def test_parameters_updated_in_place_are_outputs_placed_like_them(rank_lr: float, verdict: str) -> None:
    spec = make_case(2, 1)
    spec.sequential.step = sgd(train_step(1), 0.1)  # type: ignore[union-attr]
    rank = spec.rank
    spec.rank = lambda r: (lambda s: capture.Step(s.model, sgd(s.step, rank_lr), s.inputs))(rank(r))
    case = capture(spec)
    outputs = [o["name"] for o in case.seq_doc["graph"]["outputs"]]
    assert [o for o in outputs if o.endswith(".updated")] == [f"{p}.updated" for p, _ in MLP().named_parameters()]
    assert {"output": "fc1.weight.updated", "placements": ["Replicate"]} in case.dist_doc["expectations"]
    assert (wrong_numerically(case) == set()) == (verdict == "REFINES")
    report = case.check()
    assert report.verdict == verdict, report


@pytest.mark.parametrize("bug, micro", [("never_synced", 2), ("never_synced", 1), ("loss_not_divided", 2)])
def test_ddp_bugs_do_not_refine(bug: str, micro: int) -> None:
    case = capture(make_case(2, micro, bug))
    assert {o for o in wrong_numerically(case) if o.endswith(".grad")}
    report = case.check()
    assert report.verdict == "DOES NOT REFINE", report
    assert report.search is not None and report.search.found is not None


def test_a_comm_hook_is_refused() -> None:
    def hooked(m: nn.Module) -> nn.Module:
        w = DDP(m)
        w.register_comm_hook(None, lambda state, bucket: dist.all_reduce(bucket.buffer(), async_op=True).get_future()
                             .then(lambda f: f.value()[0]))
        return w

    with pytest.raises(CaptureError, match="communication hook"):
        capture(make_case(wrap=hooked))


def test_find_unused_parameters_is_refused() -> None:
    with pytest.raises(CaptureError, match="find_unused_parameters"):
        capture(make_case(wrap=lambda m: DDP(m, find_unused_parameters=True)))
