"""Gradient clipping by the global norm on the Megatron MLP: a whole training step captured.

    refine capture models/capture/clip_mlp.py:make_case --out case/

The model is tp_mlp.py's (column-parallel fc1, row-parallel fc2, replicated LayerNorm and
fc2 bias). After backward the step clips the gradients to a global norm of `MAX_NORM` with
torch.nn.utils.clip_grad_norm_'s formula: total = sqrt(sum of every gradient's squares),
coef = clamp(max_norm / (total + 1e-6), max=1), every gradient times coef. The sequential
step computes it over whole gradients. Each rank holds only its shards of the TP-split
gradients, so, as Megatron's clip_grad_norm does, every rank sums the squares of its shards,
tensor-parallel rank 0 adds the replicated gradients' squares (counted once), and the sum is
all-reduced over the TP group. `make_case(bug=...)` builds the buggy twin:

- "norm_not_all_reduced": the all-reduce of the squared norm is missing, so each rank
  clips with its local norm: every clipped gradient is scaled by the wrong coefficient.

(Both steps write the sum of squares directly. clip_grad_norm_ itself takes the norm of the
per-gradient norms, sqrt(sum(sqrt(s_i)^2)), equal to sqrt(sum(s_i)) because each s_i >= 0:
clip_norm.py captures torch's own clip_grad_norm_ against Megatron's norm, which
rules/vector_norm.py's non-negativity analysis proves.)
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol  # noqa: F401 - tp_mlp's collectives
import torch.nn.functional as F
from torch import nn

from refine import capture

_spec = importlib.util.spec_from_file_location("refine_models_capture_tp_mlp", Path(__file__).with_name("tp_mlp.py"))
assert _spec is not None and _spec.loader is not None
tp_mlp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tp_mlp)

MAX_NORM = 0.25  # below the gradients' global norm (about 0.55): clipping really scales them
EPS = 1e-6  # clip_grad_norm_'s
BUGS: dict[str, dict[str, object]] = {  # bug -> the make_case arguments of its twin
    "norm_not_all_reduced": {},
}
SHARDED = ("fc1.weight", "fc1.bias", "fc2.weight")  # Megatron: tensor_model_parallel parameters


def squares(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """The sum of the squares of every element of every gradient."""
    total = torch.zeros(())
    for g in grads:
        total = total + g.pow(2).sum()
    return total


def scale_grads(model: nn.Module, sq_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ from the squared global norm: scale every gradient, return the norm."""
    total = torch.sqrt(sq_norm)
    coef = torch.clamp(max_norm / (total + EPS), max=1.0)
    for p in model.parameters():
        p.grad.mul_(coef)
    return total


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    scale_grads(model, squares(p.grad for p in model.parameters()), MAX_NORM)
    return loss


def tp_train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor, bug: str | None) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    grads = dict((n, p.grad) for n, p in model.named_parameters())
    sq = squares(grads[n] for n in SHARDED)  # BUG: norm_not_all_reduced
    if dist.get_rank() == 0:  # replicated gradients: counted once, on tensor-parallel rank 0
        sq = sq + squares(g for n, g in grads.items() if n not in SHARDED)  # BUG: norm_not_all_reduced
    if bug != "norm_not_all_reduced":
        dist.all_reduce(sq)
    scale_grads(model, sq, MAX_NORM)
    return loss


def make_case(world_size: int = 2, bug: str | None = None) -> capture.Spec:
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(BUGS)})")
    torch.manual_seed(0)
    seq = tp_mlp.MLP()
    x, target = torch.randn(tp_mlp.T, tp_mlp.H), torch.randn(tp_mlp.T, tp_mlp.H)
    return capture.Spec(
        sequential=capture.Step(seq, train_step, {"x": x, "target": target}),
        rank=lambda r: capture.Step(tp_mlp.TPMLP(seq, r, world_size, dist.group.WORLD),  # type: ignore[arg-type]
                                    lambda m, **kw: tp_train_step(m, **kw, bug=bug), {"x": x, "target": target}),
        world_size=world_size, mesh={"tp": world_size}, name=f"clip_mlp{'_bug_' + bug if bug else ''}",
    )
