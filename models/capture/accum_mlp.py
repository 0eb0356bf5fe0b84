"""Gradient accumulation over micro-batches, data parallel: a whole training step captured.

    refine capture models/capture/accum_mlp.py:make_case --out case/

The sequential step runs the whole batch once. Each rank holds the whole model and its
shard of the batch (annotated Shard(0)), splits it into `micro_batches` micro-batches and
calls `backward()` once per micro-batch on the loss scaled by 1/M, so the gradients
accumulate in `.grad`; then it averages them over the ranks once (DDP style, AVG). The
trace unrolls the loop: each backward is its own piece of the graph and the `.grad` the
step leaves behind is their sum. `make_case(bug=...)` builds the buggy twins:

- "loss_divided_twice": the micro-batch losses are scaled by 1/M for backward and the
  accumulated gradients are divided by M once more (a loss-scaling mix-up seen in real
  training loops): the gradients come out M times too small;
- "mean_over_global_batch": each micro-batch loss is its sum of squared errors divided by
  the element count of the *global* batch (instead of the mean over the micro-batch, scaled
  by 1/M). Summed over the micro-batches that is this rank's share of the global mean, which
  would be right if the ranks' gradients were summed; they are averaged, so the gradients
  and the loss come out world times too small.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from refine import capture

B, H, FFN = 8, 16, 32  # global batch, hidden size, MLP size
BUGS: dict[str, dict[str, object]] = {  # bug -> the make_case arguments of its twin
    "loss_divided_twice": {}, "mean_over_global_batch": {},
}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(H, FFN)
        self.fc2 = nn.Linear(FFN, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    return loss


def micro_loss(model: nn.Module, x: torch.Tensor, target: torch.Tensor, micro_batches: int,
               bug: str | None, batch: int = B) -> torch.Tensor:
    """One micro-batch's share of this rank's mean squared error (`batch`: the global batch)."""
    if bug == "mean_over_global_batch":
        return F.mse_loss(model(x), target, reduction="sum") / (batch * H)  # BUG: mean_over_global_batch (the wrong count)
    return F.mse_loss(model(x), target) / micro_batches


def accum_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor, micro_batches: int,
               bug: str | None = None, batch: int = B) -> torch.Tensor:
    reported = torch.zeros(())
    for xs, ts in zip(x.chunk(micro_batches), target.chunk(micro_batches), strict=True):
        loss = micro_loss(model, xs, ts, micro_batches, bug, batch)
        loss.backward()  # accumulates into .grad
        reported = reported + loss.detach()
    for p in model.parameters():
        if bug == "loss_divided_twice":
            p.grad.div_(micro_batches)  # BUG: loss_divided_twice (the loss was already scaled by 1/M)
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    return funcol.all_reduce(reported, "avg", dist.group.WORLD)


def make_case(world_size: int = 2, micro_batches: int = 2, bug: str | None = None,
              batch: int = B) -> capture.Spec:
    """The step at `batch` rows in all (the global batch), split over the ranks, then micro-batches."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(BUGS)})")
    if batch % (world_size * micro_batches):
        raise ValueError(f"the batch of {batch} does not split into {world_size} ranks x {micro_batches} micro-batches")
    torch.manual_seed(0)
    seq = MLP()
    x, target = torch.randn(batch, H), torch.randn(batch, H)
    b = batch // world_size

    def rank(r: int) -> capture.Step:
        model = MLP()
        model.load_state_dict(seq.state_dict())
        shard = {"x": capture.shard(x[r * b:(r + 1) * b], 0), "target": capture.shard(target[r * b:(r + 1) * b], 0)}
        return capture.Step(model, lambda m, **inputs: accum_step(m, **inputs, micro_batches=micro_batches, bug=bug,
                                                                 batch=batch),
                            shard)

    return capture.Spec(sequential=capture.Step(seq, train_step, {"x": x, "target": target}), rank=rank,
                        world_size=world_size, mesh={"dp": world_size},
                        name=f"accum_mlp{'' if batch == B else f'_b{batch}'}_m{micro_batches}"
                             f"{'_bug_' + bug if bug else ''}")
