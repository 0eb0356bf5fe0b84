"""Data parallel MLP, DDP style: a whole training step captured from PyTorch code.

Each rank holds the whole model and its shard of the batch (annotated Shard(0)); after
`loss.backward()` every gradient is all-reduced with AVG, and the loss is averaged too (as
training loops do for logging). `make_case(bug=...)` builds the buggy twins:

- "sum_not_avg": the gradients are all-reduced with SUM: world times too large;
- "loss_averaged_twice": the loss is divided by the world size before backward *and* the
  gradients are averaged: world times too small.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from refine import capture

B, H, FFN = 8, 16, 32  # batch, hidden size, MLP size
BUGS: dict[str, dict[str, object]] = {  # bug -> the make_case arguments of its twin
    "sum_not_avg": {}, "loss_averaged_twice": {},
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


def ddp_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor, bug: str | None = None) -> torch.Tensor:
    world = dist.get_world_size()
    loss = F.mse_loss(model(x), target)
    if bug == "loss_averaged_twice":
        loss = loss / world  # BUG: loss_averaged_twice
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM if bug == "sum_not_avg" else dist.ReduceOp.AVG)  # BUG: sum_not_avg
    return funcol.all_reduce(loss.detach(), "avg", dist.group.WORLD)


def make_case(world_size: int = 2, bug: str | None = None) -> capture.Spec:
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(BUGS)})")
    torch.manual_seed(0)
    seq = MLP()
    x, target = torch.randn(B, H), torch.randn(B, H)
    b = B // world_size

    def rank(r: int) -> capture.Step:
        model = MLP()
        model.load_state_dict(seq.state_dict())
        shard = {"x": capture.shard(x[r * b:(r + 1) * b], 0), "target": capture.shard(target[r * b:(r + 1) * b], 0)}
        return capture.Step(model, lambda m, **inputs: ddp_step(m, **inputs, bug=bug), shard)

    return capture.Spec(sequential=capture.Step(seq, train_step, {"x": x, "target": target}), rank=rank,
                        world_size=world_size, mesh={"dp": world_size},
                        name=f"ddp_mlp{'_bug_' + bug if bug else ''}")
