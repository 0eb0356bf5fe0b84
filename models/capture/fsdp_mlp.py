"""FSDP-style (ZeRO-3) data parallel MLP: a whole training step captured from PyTorch code.

    refine capture models/capture/fsdp_mlp.py:make_case --out case/
    refine check case/seq.json case/dist.json

The sequential model is fc1 -> gelu -> fc2 with an MSE loss over the whole batch. Each rank
holds the Shard(0) piece of every parameter (rows of the weights, a piece of each bias) and
its shard of the batch. Forward all-gathers each full parameter just before it is used; the
gather's backward reduce-scatters the full parameter's gradient with AVG, so each rank ends
with its Shard(0) piece of the batch-averaged gradient, the piece it would update.
`make_case(bug=...)` builds the buggy twin:

- "reduce_scatter_sum_not_avg": the gradients are reduce-scattered with SUM instead of AVG:
  world times too large.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from refine import capture

B, H, FFN = 8, 8, 8  # batch, hidden size, MLP size
BUGS: dict[str, dict[str, object]] = {  # bug -> the make_case arguments of its twin
    "reduce_scatter_sum_not_avg": {},
}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(H, FFN)
        self.fc2 = nn.Linear(FFN, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class GatherParam(torch.autograd.Function):
    """All-gather a parameter's shards along `dim` forward; reduce-scatter its gradient back
    to the shards backward (the mean over the data-parallel ranks, or the sum in the twin)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, dim: int, op: str, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.dim, ctx.op, ctx.group = dim, op, group
        return funcol.all_gather_tensor(shard, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # noqa: ANN001
        return funcol.reduce_scatter_tensor(grad.contiguous(), ctx.op, ctx.dim, ctx.group), None, None, None  # BUG: reduce_scatter_sum_not_avg


class FSDPLinear(nn.Module):
    """A Linear whose parameters are Shard(0) on every rank, gathered for each use."""

    def __init__(self, full: nn.Linear, rank: int, world: int, bug: str | None) -> None:
        super().__init__()
        rows, n = full.out_features // world, full.bias.numel() // world
        self.weight = capture.shard(nn.Parameter(full.weight.detach()[rank * rows:(rank + 1) * rows].clone()), 0)
        self.bias = capture.shard(nn.Parameter(full.bias.detach()[rank * n:(rank + 1) * n].clone()), 0)
        self.op = "sum" if bug == "reduce_scatter_sum_not_avg" else "avg"  # BUG: reduce_scatter_sum_not_avg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = dist.group.WORLD
        w = GatherParam.apply(self.weight, 0, self.op, group)
        b = GatherParam.apply(self.bias, 0, self.op, group)
        return F.linear(x, w, b)


class FSDPMLP(nn.Module):
    def __init__(self, seq: MLP, rank: int, world: int, bug: str | None) -> None:
        super().__init__()
        self.fc1 = FSDPLinear(seq.fc1, rank, world, bug)
        self.fc2 = FSDPLinear(seq.fc2, rank, world, bug)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    return loss


def fsdp_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The gradients are synchronised inside backward (the gathers' reduce-scatters); the
    loss is averaged over the ranks for logging."""
    loss = F.mse_loss(model(x), target)
    loss.backward()
    return funcol.all_reduce(loss.detach(), "avg", dist.group.WORLD)


def make_case(world_size: int = 2, bug: str | None = None) -> capture.Spec:
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(BUGS)})")
    torch.manual_seed(0)
    seq = MLP()
    x, target = torch.randn(B, H), torch.randn(B, H)
    b = B // world_size

    def rank(r: int) -> capture.Step:
        shard = {"x": capture.shard(x[r * b:(r + 1) * b], 0), "target": capture.shard(target[r * b:(r + 1) * b], 0)}
        return capture.Step(FSDPMLP(seq, r, world_size, bug), fsdp_step, shard)

    return capture.Spec(sequential=capture.Step(seq, train_step, {"x": x, "target": target}), rank=rank,
                        world_size=world_size, mesh={"dp": world_size},
                        name=f"fsdp_mlp{'_bug_' + bug if bug else ''}")
