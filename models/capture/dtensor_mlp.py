"""A DTensor tensor-parallel MLP (torchtitan style): `parallelize_module` with Colwise/Rowwise
(and SequenceParallel) plans, a whole training step captured from PyTorch code.

    refine capture models/capture/dtensor_mlp.py:make_case --out case/
    refine check case/seq.json case/dist.json

The sequential model is LayerNorm -> fc1 -> gelu -> fc2 with an MSE loss. Each rank deep-copies
it and parallelizes it on a 1-D DeviceMesh "tp":

- default: {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}; the LayerNorm stays a plain
  replicated module (annotated), the output is replicated, the loss is the same on every rank;
- `sequence_parallel=True`: {"ln": SequenceParallel(sequence_dim=0), "fc1": ColwiseParallel(input_layouts=
  Shard(0)), "fc2": RowwiseParallel(output_layouts=Shard(0))}: each rank gets its tokens
  (rows of x) as a DTensor, the LayerNorm runs on them, fc1 all-gathers them, fc2
  reduce-scatters back to token shards, and the loss is taken on the gathered output (as
  torchtitan's output layer gathers to Replicate without loss parallel).

The DTensor machinery does every collective; refine derives each parameter's relation from
its placements. Buggy twins (`bug=`):

- "partial_output_loss" (default plan): fc2 is RowwiseParallel(output_layouts=Partial()), to
  delay the all-reduce, and the loss is then taken on the local output, which is only this
  rank's partial sum;
- "grad_placements_partial" (default plan): fc2 keeps a DTensor output and the step takes
  `out.to_local(grad_placements=[Partial()])`, declaring each rank's output gradient a partial
  sum; but every rank computes the whole gradient of the replicated loss, so all gradients
  come out summed over the ranks (twice too large);
- "local_loss" (sequence parallel): fc2 keeps its token shard as a local tensor and each rank
  takes the MSE on its own tokens: a mean over half the tokens, so the loss and every
  gradient are off (the ranks' losses are not the loss, and each counts its tokens twice);
- "ln_grad_not_reduced" (sequence parallel): a gradient hook of the step re-wraps every
  gradient's local tensor with its parameter's placement; the SequenceParallel LayerNorm's
  gradients are Partial (each rank's sum over its own tokens), so they lose the reduction.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from refine import capture

T, H, FFN = 8, 16, 32  # tokens, hidden size, MLP size
BUGS: dict[str, dict[str, object]] = {  # bug -> the make_case arguments of its twin
    "partial_output_loss": {},
    "grad_placements_partial": {},
    "local_loss": {"sequence_parallel": True},
    "ln_grad_not_reduced": {"sequence_parallel": True},
}


class MLP(nn.Module):
    """The sequential model."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(H)
        self.fc1 = nn.Linear(H, FFN)
        self.fc2 = nn.Linear(FFN, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(self.ln(x)))  # BUG: ln_grad_not_reduced
        return self.fc2(h)  # BUG: partial_output_loss (the plan leaves this a partial sum, unreduced)


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if isinstance(out, DTensor):
        out = out.full_tensor()  # the output gathered to Replicate (no loss parallel)
    loss = F.mse_loss(out, target)
    loss.backward()
    return loss


def local_loss_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Twin "local_loss": the loss of this rank's tokens only."""
    out = model(x)  # this rank's token shard, a plain tensor (use_local_output=True)
    r, n = dist.get_rank(), dist.get_world_size()
    loss = F.mse_loss(out, target.chunk(n, dim=0)[r])  # BUG: local_loss
    loss.backward()
    return loss


def grad_placements_partial_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Twin "grad_placements_partial": the output's gradient declared a partial sum."""
    out = model(x).to_local(grad_placements=[Partial()])  # BUG: grad_placements_partial
    loss = F.mse_loss(out, target)
    loss.backward()
    return loss


def ln_grad_not_reduced_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Twin "ln_grad_not_reduced": gradients re-wrapped with their parameter's placement."""
    loss = train_step(model, x, target)
    for p in model.parameters():
        p.grad = DTensor.from_local(p.grad.to_local(), p.device_mesh, p.placements, run_check=False)
    return loss


def make_case(world_size: int = 2, bug: str | None = None, sequence_parallel: bool = False) -> capture.Spec:
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(BUGS)})")
    if bug is not None and BUGS[bug].get("sequence_parallel", False) != sequence_parallel:
        raise ValueError(f"bug {bug!r} is a twin of the {'tensor' if sequence_parallel else 'sequence'}-parallel "
                         f"variant: make_case(bug={bug!r}, sequence_parallel={not sequence_parallel})")
    torch.manual_seed(0)
    seq = MLP()
    x, target = torch.randn(T, H), torch.randn(T, H)
    name = f"dtensor_mlp{'_sp' if sequence_parallel else ''}{'_bug_' + bug if bug else ''}"

    def rank(r: int) -> capture.Step:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
        model = copy.deepcopy(seq)
        step = train_step
        if not sequence_parallel:
            fc2 = RowwiseParallel(use_local_output=bug != "grad_placements_partial")
            if bug == "partial_output_loss":
                fc2 = RowwiseParallel(output_layouts=Partial())  # BUG: partial_output_loss
            if bug == "grad_placements_partial":
                step = grad_placements_partial_step
            parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": fc2})
            for name in ("ln.weight", "ln.bias", "x", "target"):  # plain tensors, the same on every rank
                capture.replicate(name)
            return capture.Step(model, step, {"x": x, "target": target})
        local_out = bug == "local_loss"
        parallelize_module(model, mesh, {
            "ln": SequenceParallel(sequence_dim=0),
            "fc1": ColwiseParallel(input_layouts=Shard(0)),
            "fc2": RowwiseParallel(output_layouts=Shard(0), use_local_output=local_out),
        })
        if bug == "local_loss":
            step = local_loss_step
        elif bug == "ln_grad_not_reduced":
            step = ln_grad_not_reduced_step
        tokens = DTensor.from_local(x.chunk(world_size, dim=0)[r], mesh, [Shard(0)], run_check=False)
        capture.replicate("target")
        return capture.Step(model, step, {"x": tokens, "target": target})

    return capture.Spec(sequential=capture.Step(seq, train_step, {"x": x, "target": target}), rank=rank,
                        world_size=world_size, mesh={"tp": world_size}, name=name)
