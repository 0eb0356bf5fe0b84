"""A residual stack under DTensor tensor + sequence parallelism, [batch, sequence, hidden]
(torchtitan's layout): the residual stream lives in sequence shards between the blocks.

    refine capture models/capture/sp_residual.py:make_case --out case/
    refine check case/seq.json case/dist.json

The sequential model is `layers` blocks `x + fc2(silu(fc1(norm(x))))` (torch's nn.RMSNorm), a
final RMSNorm and a head, with an MSE loss. Each rank deep-copies it and parallelizes it on a
1-D DeviceMesh "tp" with torchtitan's plan shapes: the norms `SequenceParallel()` (sequence
dim 1), fc1 and the head `ColwiseParallel(input_layouts=Shard(1))` (an all-gather of the
sequence in, the head's output gathered to Replicate), fc2 `RowwiseParallel(output_layouts=
Shard(1))` (a reduce-scatter of the partial sums back to sequence shards). The input arrives
in sequence shards, a plain tensor, as torchtitan's embedding leaves it.

The residual stream after n blocks is, on the ranks, the sum of n + 1 reduce-scattered pieces
per rank; written as a partial sum over the ranks it has world * (n + 1) terms, so the proof
must keep it as the concat of what each rank holds (refine.prove.walk's `_pieces`).

Twin (`bug=`): "norm_grad_not_reduced": every gradient re-wrapped with its parameter's
placement after backward: a SequenceParallel norm's weight gradient is Partial (each rank's sum
over its own tokens), so it loses its reduction.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from refine import capture

B, S, H, FFN, OUT = 2, 8, 16, 32, 8
BUGS: dict[str, dict[str, object]] = {"norm_grad_not_reduced": {}}  # bug -> the make_case arguments of its twin


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(H, eps=1e-6)
        self.fc1 = nn.Linear(H, FFN, bias=False)
        self.fc2 = nn.Linear(FFN, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.silu(self.fc1(self.norm(x))))  # BUG: norm_grad_not_reduced (every norm)


class Stack(nn.Module):
    """The sequential model."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.RMSNorm(H, eps=1e-6)
        self.head = nn.Linear(H, OUT, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))  # BUG: norm_grad_not_reduced


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    return loss


def norm_grad_not_reduced_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = train_step(model, x, target)
    for p in model.parameters():
        p.grad = DTensor.from_local(p.grad.to_local(), p.device_mesh, p.placements, run_check=False)
    return loss


def make_case(world_size: int = 2, layers: int = 2, bug: str | None = None) -> capture.Spec:
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(BUGS)})")
    torch.manual_seed(0)
    seq = Stack(layers)
    x, target = torch.randn(B, S, H), torch.randn(B, S, OUT)

    def rank(r: int) -> capture.Step:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
        model = copy.deepcopy(seq)
        plan: dict[str, object] = {"norm": SequenceParallel(),
                                   "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
        for i in range(layers):
            plan[f"blocks.{i}.norm"] = SequenceParallel()
            plan[f"blocks.{i}.fc1"] = ColwiseParallel(input_layouts=Shard(1))
            plan[f"blocks.{i}.fc2"] = RowwiseParallel(output_layouts=Shard(1))
        parallelize_module(model, mesh, plan)
        tokens = capture.shard(x.chunk(world_size, dim=1)[r], 1)  # the rank's sequence shard, a plain tensor
        capture.replicate("target")
        step = norm_grad_not_reduced_step if bug == "norm_grad_not_reduced" else train_step
        return capture.Step(model, step, {"x": tokens, "target": target})

    name = f"sp_residual_tp{world_size}_l{layers}{'_bug_' + bug if bug else ''}"
    return capture.Spec(sequential=capture.Step(seq, train_step, {"x": x, "target": target}), rank=rank,
                        world_size=world_size, mesh={"tp": world_size}, name=name)
