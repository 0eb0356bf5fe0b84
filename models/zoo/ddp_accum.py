"""torch's DistributedDataParallel with gradient accumulation, as its users write it.

A 2-layer MLP wrapped in `DistributedDataParallel(model)`; each rank takes its shard of the
batch, splits it into micro-batches, runs all but the last under `model.no_sync()` (DDP's
reducer averages the accumulated gradients over the ranks at the last backward) and scales
each micro-batch loss by 1/M. The sequential step runs the whole batch at once.

Bugs (each a kind public trackers record):
- "never_synced": `no_sync()` is held over the last micro-batch too, so the gradients are
  never all-reduced (each rank steps on its own shard's gradients);
- "synced_first": the condition is inverted, so the first micro-batch's backward
  synchronises and the later ones accumulate locally, after the all-reduce.

- "loss_not_divided": the micro-batch losses are not divided by the accumulation steps, so
  the gradients are M times too large; the statement left out, the report names the line
  making the value it should have divided (the micro-batch loss, mse_loss's line, whose forward
  mean and backward scale refine.verdict.factor edits at once).

A missing synchronisation is reported at the gradient the ranks then hold unreduced: the
accumulation of the layers' gradients, which capture attributes to the forward line that
made them (the model's `forward`), marked for those bugs too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from models.zoo import Bug, Program
from refine import capture

REQUIRES = ()
B, H, FFN = 16, 8, 16  # global batch, hidden, MLP size

CONFIGS = {"dp2_m2": (2, 2), "dp4_m2": (4, 2), "dp2_m4": (2, 4)}  # name -> (data-parallel ranks, micro-batches)
PROGRAM = Program(
    configs={"dp2_m2": "DDP over 2 ranks, 2 micro-batches each",
             "dp4_m2": "DDP over 4 ranks, 2 micro-batches each",
             "dp2_m4": "DDP over 2 ranks, 4 micro-batches each"},
    smoke="dp2_m2",
    bugs={
        "never_synced": Bug("dp2_m2", "no_sync() held over the last micro-batch too: the gradients are never "
                            "all-reduced (a classic DDP gradient-accumulation mistake)", smoke=True),
        "synced_first": Bug("dp2_m4", "no_sync() on all but the first micro-batch: the later micro-batches' "
                            "gradients accumulate after the all-reduce, unsynchronised"),
        "loss_not_divided": Bug("dp2_m2", "the micro-batch losses not divided by the accumulation steps: gradients "
                                "M times too large (the gradient-accumulation loss-scaling bug trackers record)"),
    },
)


class MLP(nn.Module):
    """Two layers: fc2(gelu(fc1(x)))."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(H, FFN)
        self.fc2 = nn.Linear(FFN, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # BUG: never_synced BUG: synced_first (grads accumulated here)


def accumulate(micro: int, bug: str | None = None) -> Callable[..., torch.Tensor]:
    """The training step: `micro` micro-batches, no_sync() on all but the last."""
    def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(())
        for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            if bug == "never_synced":
                syncs = False  # BUG: never_synced
            elif bug == "synced_first":
                syncs = i == 0  # BUG: synced_first
            else:
                syncs = i == micro - 1
            with contextlib.nullcontext() if syncs or not isinstance(model, DDP) else model.no_sync():
                loss = F.mse_loss(model(xs), ys)  # BUG: loss_not_divided (the division after it left out)
                if bug != "loss_not_divided":
                    loss = loss / micro
                loss.backward()
            total = total + loss.detach()
        return total
    return step


def make_case(config: str, bug: str | None = None) -> capture.Spec:
    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r} (configurations: {', '.join(CONFIGS)})")
    if bug is not None and bug not in PROGRAM.bugs:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(PROGRAM.bugs)})")
    world, micro = CONFIGS[config]
    torch.manual_seed(0)
    seq = MLP()
    x, y = torch.randn(B, H), torch.randn(B, H)
    b = B // world

    def rank(r: int) -> capture.Step:
        m = MLP()
        m.load_state_dict(seq.state_dict())
        part = slice(r * b, (r + 1) * b)
        return capture.Step(DDP(m), accumulate(micro, bug),
                            {"x": capture.shard(x[part], 0), "y": capture.shard(y[part], 0)})

    return capture.Spec(sequential=capture.Step(seq, accumulate(1), {"x": x, "y": y}), rank=rank,
                        world_size=world, mesh={"dp": world}, name=f"ddp_accum_{config}{'_bug_' + bug if bug else ''}")
