"""Megatron-style tensor-parallel MLP: a whole training step, captured from PyTorch code.

    refine capture models/capture/tp_mlp.py:make_case --out case/
    refine check case/seq.json case/dist.json

The sequential model is LayerNorm -> fc1 -> gelu -> fc2 with an MSE loss. Each rank keeps
the LayerNorm replicated, splits fc1 by output features (column parallel: Megatron's "f",
identity forward and all-reduce of the input gradient backward, in front of it) and fc2 by
input features (row parallel: "g", all-reduce forward and identity backward, after it; then
the replicated bias). `make_case(bug=...)` builds the buggy twins:

- "bias_before_sum": the row-parallel bias is added on every rank before the all-reduce;
- "missing_grad_all_reduce": "f" forgets the backward all-reduce, so the LayerNorm's
  gradients only see this rank's half of fc1;
- "grad_reduced_twice": "g" is the autograd-aware functional all_reduce, whose backward
  all-reduces the (already replicated) output gradient again: gradients come out world
  times too large.

`make_case(dp=2)` adds data parallelism: a dp x tp mesh of `dist.new_group` subgroups, the
batch sharded over dp, gradients and loss averaged over each dp group. Its twin
"loss_averaged_twice" divides the loss by the dp size before backward as well.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from refine import capture

T, H, FFN = 8, 16, 32  # tokens, hidden size, MLP size
BUGS: dict[str, dict[str, object]] = {  # bug -> the make_case arguments of its twin
    "bias_before_sum": {},
    "missing_grad_all_reduce": {},
    "grad_reduced_twice": {},
    "loss_averaged_twice": {"dp": 2},
}


class MLP(nn.Module):
    """The sequential model."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(H)
        self.fc1 = nn.Linear(H, FFN)
        self.fc2 = nn.Linear(FFN, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(self.ln(x)))
        return self.fc2(h)


class CopyToTP(torch.autograd.Function):
    """Megatron's "f": the identity forward; the input gradient is all-reduced backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, reduce_grad: bool) -> torch.Tensor:  # noqa: ANN001
        ctx.group, ctx.reduce_grad = group, reduce_grad
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
        if ctx.reduce_grad:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's "g": all-reduce forward; the gradient passes through backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        return funcol.all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return grad, None


class ColumnParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear, rank: int, world: int, group: dist.ProcessGroup, bug: str | None) -> None:
        super().__init__()
        rows = full.out_features // world
        self.weight = capture.shard(nn.Parameter(full.weight.detach()[rank * rows:(rank + 1) * rows].clone()), 0, "tp")
        self.bias = capture.shard(nn.Parameter(full.bias.detach()[rank * rows:(rank + 1) * rows].clone()), 0, "tp")
        self.group, self.bug = group, bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = CopyToTP.apply(x, self.group, self.bug != "missing_grad_all_reduce")  # BUG: missing_grad_all_reduce
        return F.linear(x, self.weight, self.bias)  # BUG: missing_grad_all_reduce


class RowParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear, rank: int, world: int, group: dist.ProcessGroup, bug: str | None) -> None:
        super().__init__()
        cols = full.in_features // world
        self.weight = capture.shard(nn.Parameter(full.weight.detach()[:, rank * cols:(rank + 1) * cols].clone()), 1, "tp")
        self.bias = capture.replicate(nn.Parameter(full.bias.detach().clone()))
        self.group, self.bug = group, bug

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = F.linear(h, self.weight)
        if self.bug == "bias_before_sum":
            return ReduceFromTP.apply(y + self.bias, self.group)  # BUG: bias_before_sum
        if self.bug == "grad_reduced_twice":
            y = funcol.all_reduce(y, "sum", self.group)  # BUG: grad_reduced_twice (its backward all-reduces the gradient too)
        else:
            y = ReduceFromTP.apply(y, self.group)
        return y + self.bias


class TPMLP(nn.Module):
    """One rank's part of MLP; the LayerNorm stays replicated (not annotated: guessed)."""

    def __init__(self, seq: MLP, tp_rank: int, tp: int, group: dist.ProcessGroup, bug: str | None = None) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(H)
        self.ln.load_state_dict(seq.ln.state_dict())
        self.fc1 = ColumnParallelLinear(seq.fc1, tp_rank, tp, group, bug)
        self.fc2 = RowParallelLinear(seq.fc2, tp_rank, tp, group, bug)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.ln(x))))


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    return loss


def dp_train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor, dp_group: dist.ProcessGroup,
                  bug: str | None) -> torch.Tensor:
    """Data parallel on top: average the gradients (and the reported loss) over the dp group."""
    loss = F.mse_loss(model(x), target)
    if bug == "loss_averaged_twice":
        loss = loss / dist.get_world_size(dp_group)  # BUG: loss_averaged_twice
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=dp_group)
    return funcol.all_reduce(loss.detach(), "avg", dp_group)


def make_case(world_size: int = 2, bug: str | None = None, dp: int = 1) -> capture.Spec:
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(BUGS)})")
    if bug == "loss_averaged_twice" and dp < 2:
        raise ValueError("loss_averaged_twice needs data parallelism (dp >= 2): "
                         "make_case(bug='loss_averaged_twice', dp=2)")
    tp = world_size // dp
    torch.manual_seed(0)
    seq = MLP()
    x, target = torch.randn(T, H), torch.randn(T, H)
    name = f"tp_mlp{f'_dp{dp}' if dp > 1 else ''}{'_bug_' + bug if bug else ''}"
    if dp == 1:
        return capture.Spec(
            sequential=capture.Step(seq, train_step, {"x": x, "target": target}),
            rank=lambda r: capture.Step(TPMLP(seq, r, tp, dist.group.WORLD, bug), train_step,  # type: ignore[arg-type]
                                        {"x": x, "target": target}),
            world_size=world_size, mesh={"tp": tp}, name=name,
        )

    def rank(r: int) -> capture.Step:
        # every rank makes every group, in one order (torch requires it); ranks are dp-major
        tp_groups = [dist.new_group([d * tp + t for t in range(tp)]) for d in range(dp)]
        dp_groups = [dist.new_group([d * tp + t for d in range(dp)]) for t in range(tp)]
        d, t = divmod(r, tp)
        b = T // dp
        shard = {k: capture.shard(v[d * b:(d + 1) * b], 0, axis="dp") for k, v in (("x", x), ("target", target))}
        model = TPMLP(seq, t, tp, tp_groups[d], bug)
        for p in (model.ln.weight, model.ln.bias):
            capture.replicate(p)
        return capture.Step(model, lambda m, **kw: dp_train_step(m, **kw, dp_group=dp_groups[t], bug=bug), shard)

    return capture.Spec(sequential=capture.Step(seq, train_step, {"x": x, "target": target}), rank=rank,
                        world_size=world_size, mesh={"dp": dp, "tp": tp}, name=name)
