"""Megatron's [s, b, h] activation layout under data parallelism: a whole step captured.

    refine capture models/capture/sbh_dp.py:make_case --out case/

Megatron keeps activations sequence-first, [s, b, h]. A Linear on a 3-d input computes on
its [s*b, h] view, where the batch (dim 1, the one data parallelism and micro-batches split)
is the inner factor of the merged rows: a rank's rows are no contiguous block of them.
The sequential model is a residual MLP block (LayerNorm, fc1, gelu, fc2) under an MSE loss
over the whole [s, b, h] batch. Each rank holds the whole model and its Shard(1) piece of the
batch, splits it into `micro_batches` along dim 1, accumulates the gradients of the
micro-batch losses scaled by 1/M, then averages the gradients over the ranks.
`make_case(bug=...)` builds the buggy twin:

- "grads_summed": the gradients are all-reduced with SUM, not AVG: world times too large.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from refine import capture

S, B, H, FFN = 4, 4, 8, 16  # sequence, global batch, hidden size, MLP size
BUGS: dict[str, dict[str, object]] = {"grads_summed": {}}  # bug -> the make_case arguments of its twin


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(H)
        self.fc1 = nn.Linear(H, FFN)
        self.fc2 = nn.Linear(FFN, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    return loss


def dp_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor, micro_batches: int,
            bug: str | None = None) -> torch.Tensor:
    reported = torch.zeros(())
    for xs, ts in zip(x.chunk(micro_batches, dim=1), target.chunk(micro_batches, dim=1), strict=True):
        loss = F.mse_loss(model(xs), ts) / micro_batches
        loss.backward()
        reported = reported + loss.detach()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM if bug == "grads_summed" else dist.ReduceOp.AVG)  # BUG: grads_summed
    return funcol.all_reduce(reported, "avg", dist.group.WORLD)


def make_case(world_size: int = 2, micro_batches: int = 1, bug: str | None = None) -> capture.Spec:
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(BUGS)})")
    if B % (world_size * micro_batches):
        raise ValueError(f"the batch of {B} does not split into {world_size} ranks x {micro_batches} micro-batches")
    torch.manual_seed(0)
    seq = Block()
    x, target = torch.randn(S, B, H), torch.randn(S, B, H)
    b = B // world_size

    def rank(r: int) -> capture.Step:
        model = Block()
        model.load_state_dict(seq.state_dict())
        mine = {"x": x[:, r * b:(r + 1) * b].contiguous(), "target": target[:, r * b:(r + 1) * b].contiguous()}
        return capture.Step(model, lambda m, **inputs: dp_step(m, **inputs, micro_batches=micro_batches, bug=bug),
                            {k: capture.shard(v, 1) for k, v in mine.items()})

    return capture.Spec(sequential=capture.Step(seq, train_step, {"x": x, "target": target}), rank=rank,
                        world_size=world_size, mesh={"dp": world_size},
                        name=f"sbh_dp{world_size}_m{micro_batches}{'_bug_' + bug if bug else ''}")
