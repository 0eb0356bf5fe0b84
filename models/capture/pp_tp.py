"""Pipeline parallelism combined with tensor parallelism (PP x TP), hand-written as Megatron's
users write it: torch.distributed.pipelining stages whose blocks are Megatron-style column /
row parallel layers.

    refine capture models/capture/pp_tp.py:make_case --out case/

The sequential model is a stack of pre-norm residual MLP blocks (LayerNorm, fc1, GELU, fc2)
and a mean-squared error loss. The ranks form a 2-D mesh {"pp": stages, "tp": tp}, ranks
row-major (rank = stage * tp + tp_rank); every rank makes the tensor-parallel groups (one per
stage) and the pipeline groups (one per tensor-parallel rank) in one order. Stage s holds
block s: its LayerNorm replicated, fc1 split by output features (column parallel, Megatron's
"f" in front: identity forward, all-reduce of the input gradient backward) and fc2 by input
features (row parallel, "g" after the matmul: all-reduce forward, then the replicated bias).
So each parameter is held by one stage's tensor-parallel group only, sharded or replicated
within it, and annotated so (`capture.shard(w, 0, "tp")`): capture relates it to the
sequential parameter within that group (refine.frontends.capture.annotate.submesh_layouts).

Each rank wraps its block in a `PipelineStage` over its pipeline group (its micro-batch's
input and output given: static shapes); a schedule (GPipe or 1F1B) runs the step, the first
stage's ranks feeding `x`, the last stage's computing the loss on `y`. After the schedule the
replicated parameters' gradients are averaged over the stage's tensor-parallel group (equal
copies stay equal; Megatron does it for sequence-parallel norms).

`make_case(bias_split=True)`: fc2's bias split over the partial sums as DTensor's
RowwiseParallel does it (each rank adds bias / tp before the all-reduce; its gradient, a part
on each rank, summed over the group).

`make_case(bug=...)` builds the twins:
- "stage1_missing_all_reduce": the last stage's row-parallel fc2 skips its forward
  all-reduce, so its output is one tensor-parallel rank's partial sum;
- "grads_averaged_over_pp": the replicated gradients are averaged over the pipeline group
  instead of the tensor-parallel one (the mesh axes mixed up): each stage's gradient becomes
  the mean of its own and the other stage's same-shaped one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from refine import capture

B, H, FFN = 8, 8, 16  # batch, hidden size, MLP size
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
BUGS: dict[str, dict[str, object]] = {"stage1_missing_all_reduce": {}, "grads_averaged_over_pp": {}}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(H)
        self.fc1, self.fc2 = nn.Linear(H, FFN), nn.Linear(FFN, H)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(F.gelu(self.fc1(self.ln(h))))


class Stack(nn.Module):
    """The blocks in a ModuleDict keyed by their index: a stage keeps its own, and its
    parameters keep the sequential names."""

    def __init__(self, blocks: dict[str, nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict(blocks)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            h = block(h)
        return h


class CopyToTP(torch.autograd.Function):
    """Megatron's "f": the identity forward; the input gradient is all-reduced backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return funcol.all_reduce(grad, "sum", ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's "g": all-reduce forward; the gradient passes through backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        return funcol.all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return grad, None


class TPBlock(nn.Module):
    """One tensor-parallel rank's part of a Block: the LayerNorm replicated, fc1 column
    parallel, fc2 row parallel (its bias added once, after the all-reduce)."""

    def __init__(self, full: Block, tp_rank: int, tp: int, group: dist.ProcessGroup, reduce: bool,
                 bias_split: bool = False) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(H)
        self.ln.load_state_dict(full.ln.state_dict())
        capture.replicate(self.ln.weight, "tp")
        capture.replicate(self.ln.bias, "tp")
        rows, cols = slice(tp_rank * FFN // tp, (tp_rank + 1) * FFN // tp), slice(tp_rank * FFN // tp,
                                                                                 (tp_rank + 1) * FFN // tp)
        self.fc1 = nn.Linear(H, FFN // tp)
        self.fc2 = nn.Linear(FFN // tp, H)
        with torch.no_grad():
            self.fc1.weight.copy_(full.fc1.weight[rows])
            self.fc1.bias.copy_(full.fc1.bias[rows])
            self.fc2.weight.copy_(full.fc2.weight[:, cols])
            self.fc2.bias.copy_(full.fc2.bias)
        capture.shard(self.fc1.weight, 0, "tp")
        capture.shard(self.fc1.bias, 0, "tp")
        capture.shard(self.fc2.weight, 1, "tp")
        capture.replicate(self.fc2.bias, "tp")
        self.group, self.reduce, self.tp, self.bias_split = group, reduce, tp, bias_split

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a = F.gelu(self.fc1(CopyToTP.apply(self.ln(h), self.group)))
        if self.bias_split:  # DTensor's RowwiseParallel: each rank adds bias / tp to its partial sum
            y = F.linear(a, self.fc2.weight, self.fc2.bias / self.tp)
            return h + ReduceFromTP.apply(y, self.group)
        y = F.linear(a, self.fc2.weight)  # BUG: stage1_missing_all_reduce (the partial sum it leaves unreduced)
        if self.reduce:
            y = ReduceFromTP.apply(y, self.group)
        return h + y + self.fc2.bias


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss


def pipeline_step(schedule: object, first: bool, last: bool, sync_group: dist.ProcessGroup, bias_split: bool
                  ) -> object:
    def step(stage: nn.Module, x: torch.Tensor | None = None, y: torch.Tensor | None = None) -> torch.Tensor | None:
        stage.zero_grad()
        losses: list[torch.Tensor] = []
        if first:
            schedule.step(x)  # type: ignore[attr-defined]
        elif last:
            schedule.step(target=y, losses=losses)  # type: ignore[attr-defined]
        else:
            schedule.step()  # type: ignore[attr-defined]
        for name, p in stage.named_parameters():  # the tensor-parallel replicas' gradients, kept equal
            if name.endswith(("ln.weight", "ln.bias", "fc2.bias")):
                # a bias split over the partial sums gets a part of its gradient on each rank: summed
                op = dist.ReduceOp.SUM if bias_split and name.endswith("fc2.bias") else dist.ReduceOp.AVG
                dist.all_reduce(p.grad, op=op, group=sync_group)  # BUG: grads_averaged_over_pp
        return torch.stack(losses).mean() if last else None
    return step


def make_case(stages: int = 2, tp: int = 2, schedule: str = "gpipe", micro: int = 2, bias_split: bool = False,
              bug: str | None = None) -> capture.Spec:
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(BUGS)})")
    torch.manual_seed(0)
    seq = Stack({str(i): Block() for i in range(stages)})
    x, y = torch.randn(B, H), torch.randn(B, H)

    def rank(r: int) -> capture.Step:
        s, t = divmod(r, tp)
        # every rank makes every group, in one order (torch requires it)
        tp_groups = [dist.new_group([k * tp + j for j in range(tp)]) for k in range(stages)]
        pp_groups = [dist.new_group([k * tp + j for k in range(stages)]) for j in range(tp)]
        first, last = s == 0, s == stages - 1
        reduce = not (bug == "stage1_missing_all_reduce" and s == 1)
        held = Stack({str(s): TPBlock(seq.blocks[str(s)], t, tp, tp_groups[s], reduce, bias_split)})  # type: ignore[arg-type]
        mb = (B // micro, H)
        stage = PipelineStage(held, s, stages, torch.device("cpu"), group=pp_groups[t],
                              input_args=torch.empty(mb, requires_grad=s > 0),
                              output_args=torch.empty(mb, requires_grad=True))
        sched = SCHEDULES[schedule](stage, n_microbatches=micro, loss_fn=loss_fn)
        sync = pp_groups[t] if bug == "grads_averaged_over_pp" else tp_groups[s]
        inputs = {"x": capture.replicate(x.clone(), "tp")} if first else \
            {"y": capture.replicate(y.clone(), "tp")} if last else {}
        return capture.Step(held, pipeline_step(sched, first, last, sync, bias_split), inputs)

    return capture.Spec(sequential=capture.Step(seq, train_step, {"x": x, "y": y}), rank=rank,
                        world_size=stages * tp, mesh={"pp": stages, "tp": tp},
                        name=f"pp{stages}_tp{tp}_{schedule}_m{micro}{'_bug_' + bug if bug else ''}")
