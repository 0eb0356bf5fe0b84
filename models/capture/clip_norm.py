"""torch.nn.utils.clip_grad_norm_ against Megatron's tensor-parallel gradient norm: a whole
training step captured.

    refine capture models/capture/clip_norm.py:make_case --out case/
    refine check case/seq.json case/dist.json

The model is tp_mlp.py's (column-parallel fc1, row-parallel fc2, replicated LayerNorm and
fc2 bias). The sequential step calls `clip_grad_norm_(model.parameters(), MAX_NORM)` itself:
torch's norm of the per-gradient norms (`_foreach_norm`, `stack`, `vector_norm`), then
`_foreach_mul_` of every gradient by `clamp(max_norm / (total + 1e-6), max=1)`.

Each rank computes the norm as Megatron's `get_grad_norm_fp32` does: the 2-norm of its local
gradients (torch's `get_total_norm`), skipping the replicated parameters' gradients except
on tensor-parallel rank 0 (`param_is_not_tensor_parallel_duplicate`: counted once), squared,
summed over the TP group with an all-reduce, and its square root taken; then
`clip_grads_with_norm_` scales the gradients by that norm. `make_case(bug=...)` builds the
buggy twins:

- "replicated_norm_all_reduced": every rank counts the replicated gradients, so the
  all-reduce adds their squares world times: the norm is too large.
- "norm_not_all_reduced": the all-reduce of the squared norm is missing, so each rank
  clips with the norm of its own shards.
- "bias_counted_on_two_ranks": TP rank 1 counts the replicated fc2 bias as well (a shared
  parameter's gradient counted on two ranks, as Megatron-LM #7227's tied embedding).
- "shard_listed_twice": rank 1 lists its fc1 weight shard's gradient twice.
- "shard_left_out": rank 1 leaves its fc1 bias shard's gradient out (a dropped rank term).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from refine import capture

_spec = importlib.util.spec_from_file_location("refine_models_capture_tp_mlp", Path(__file__).with_name("tp_mlp.py"))
assert _spec is not None and _spec.loader is not None
tp_mlp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tp_mlp)

MAX_NORM = 0.25  # below the gradients' global norm (about 0.55): clipping really scales them
BUGS: dict[str, dict[str, object]] = {  # bug -> the make_case arguments of its twin
    "replicated_norm_all_reduced": {}, "norm_not_all_reduced": {}, "bias_counted_on_two_ranks": {},
    "shard_listed_twice": {}, "shard_left_out": {},
}


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor, foreach: bool | None = None) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=foreach)
    return loss


def param_is_not_tensor_parallel_duplicate(model: nn.Module, name: str, group: dist.ProcessGroup) -> bool:
    """Megatron's test: a tensor-parallel (sharded) parameter, or any on TP rank 0. (Megatron
    reads a `tensor_model_parallel` attribute of the parameter; tracing swaps parameters for
    fresh tensors, so the model lists the names.)"""
    return name in model.tensor_model_parallel or dist.get_rank(group) == 0


def get_grad_norm(model: nn.Module, group: dist.ProcessGroup, bug: str | None) -> torch.Tensor:
    """The global 2-norm of the gradients over the TP group (Megatron's get_grad_norm_fp32)."""
    grads = [p.grad for n, p in model.named_parameters()
             if bug == "replicated_norm_all_reduced" or param_is_not_tensor_parallel_duplicate(model, n, group)
             or (bug == "bias_counted_on_two_ranks" and n == "fc2.bias")]
    if bug == "shard_listed_twice" and dist.get_rank(group) == 1:
        grads.append(model.fc1.weight.grad)
    if bug == "shard_left_out" and dist.get_rank(group) == 1:
        grads = [g for g in grads if g is not model.fc1.bias.grad]  # BUG: shard_left_out
    # the line summing the terms (each gradient's squares) of a rank's piece of the norm: where
    # a term is counted twice, and where the left-out one is missing (the first wrong value)
    grad_norm = torch.nn.utils.get_total_norm(grads)  # BUG: replicated_norm_all_reduced BUG: bias_counted_on_two_ranks BUG: shard_listed_twice BUG: shard_left_out
    total_norm = grad_norm ** 2  # BUG: norm_not_all_reduced
    if bug != "norm_not_all_reduced":
        dist.all_reduce(total_norm, group=group)
    return total_norm ** 0.5


def tp_train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor, bug: str | None) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    total_norm = get_grad_norm(model, dist.group.WORLD, bug)  # type: ignore[arg-type]
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), MAX_NORM, total_norm)
    return loss


def tp_model(seq: nn.Module, rank: int, world_size: int) -> nn.Module:
    """tp_mlp's rank model, with the names of its sharded (tensor-parallel) parameters."""
    model = tp_mlp.TPMLP(seq, rank, world_size, dist.group.WORLD)  # type: ignore[arg-type]
    model.tensor_model_parallel = frozenset({"fc1.weight", "fc1.bias", "fc2.weight"})
    return model


def make_case(world_size: int = 2, bug: str | None = None, foreach: bool | None = None) -> capture.Spec:
    """`foreach=False`: the sequential clip_grad_norm_ takes one vector_norm and one mul_ per
    gradient instead of the foreach ops (None: torch's choice, the foreach ones on CPU)."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(BUGS)})")
    torch.manual_seed(0)
    seq = tp_mlp.MLP()
    x, target = torch.randn(tp_mlp.T, tp_mlp.H), torch.randn(tp_mlp.T, tp_mlp.H)
    return capture.Spec(
        sequential=capture.Step(seq, lambda m, **kw: train_step(m, **kw, foreach=foreach), {"x": x, "target": target}),
        rank=lambda r: capture.Step(tp_model(seq, r, world_size),
                                    lambda m, **kw: tp_train_step(m, **kw, bug=bug), {"x": x, "target": target}),
        world_size=world_size, mesh={"tp": world_size}, name=f"clip_norm{'_bug_' + bug if bug else ''}",
    )
