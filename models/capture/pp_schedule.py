"""Pipeline parallelism with torch.distributed.pipelining, as its users write it: a whole
training step captured.

    refine capture models/capture/pp_schedule.py:make_case --out case/

The sequential model is a stack of blocks (`model="mlp"`: Linear + GELU blocks;
`model="transformer"`: pre-norm blocks of causal self-attention and an MLP) and a mean-squared
error loss. The pipeline splits it as torch's pipelining tutorial does: each rank copies the
model, deletes the blocks it does not hold and wraps each block it holds in a `PipelineStage`
(with the micro-batch's input and output given, so the stages agree on static shapes), and a
schedule (`ScheduleGPipe` or `Schedule1F1B` over one stage per rank; `"interleaved"`:
`ScheduleInterleaved1F1B` over two virtual stages per rank, r and r + world_size) runs `step(x)` on the first stage, `step(target=y,
losses=losses)` on the last; the schedule splits the batch into `micro` micro-batches, and
scales the gradients by 1/micro (its default `scale_grads=True`).

Before anything else the schedule's stages vote, by send and recv, on how to infer shapes, and
each branches on the result's `.item()`; capture resolves that read by running the ranks'
traced prefixes (refine.frontends.capture.scalars). `make_case(bug=...)` builds the twins:

- "grads_not_scaled": the schedule built with `scale_grads=False` while the loss function
  returns each micro-batch's mean: the gradients are `micro` times too large;
- "zero_grad_after_step": the first stage calls `zero_grad()` after the schedule's step
  instead of before it, so its gradients are dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from refine import capture

B, T, H = 8, 4, 8  # batch, tokens (transformer), hidden size
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}
BUGS: dict[str, dict[str, object]] = {"grads_not_scaled": {}, "zero_grad_after_step": {}}


class MLPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(H, H)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(h))


class TransformerBlock(nn.Module):
    def __init__(self, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.q, self.k, self.v, self.proj = (nn.Linear(H, H) for _ in range(4))
        self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        x = self.norm1(h)
        q, k, v = (f(x).view(b, t, self.heads, H // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, H))
        return h + self.down(F.gelu(self.up(self.norm2(h))))


class Stack(nn.Module):
    """The blocks in a ModuleDict keyed by their index: a stage deletes the others, and its
    parameters keep the sequential names."""

    def __init__(self, blocks: int, model: str) -> None:
        super().__init__()
        make = MLPBlock if model == "mlp" else TransformerBlock
        self.blocks = nn.ModuleDict({str(i): make() for i in range(blocks)})

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            h = block(h)
        return h


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss


def pipeline_step(schedule: object, first: bool, last: bool, bug: str | None
                  ) -> object:
    def step(stage: nn.Module, x: torch.Tensor | None = None, y: torch.Tensor | None = None) -> torch.Tensor | None:
        if bug != "zero_grad_after_step":
            stage.zero_grad()
        losses: list[torch.Tensor] = []
        if first:
            schedule.step(x)  # type: ignore[attr-defined]
        elif last:
            schedule.step(target=y, losses=losses)  # type: ignore[attr-defined]
        else:
            schedule.step()  # type: ignore[attr-defined]
        if bug == "zero_grad_after_step" and first:
            stage.zero_grad(set_to_none=False)  # BUG: zero_grad_after_step
        return torch.stack(losses).mean() if last else None
    return step


def make_case(world_size: int = 2, schedule: str = "gpipe", micro: int = 2, model: str = "mlp",
              bug: str | None = None) -> capture.Spec:
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(BUGS)})")
    virtual = 2 if schedule == "interleaved" else 1  # stages per rank: r, r + world_size, ...
    stages = world_size * virtual
    torch.manual_seed(0)
    seq = Stack(stages, model)
    shape = (B, H) if model == "mlp" else (B, T, H)
    x, y = torch.randn(shape), torch.randn(shape)

    def rank(r: int) -> capture.Step:
        first, last = r == 0, r == world_size - 1  # holds stage 0, holds the last stage
        held = Stack(stages, model)
        held.load_state_dict(seq.state_dict())
        mine = [r + v * world_size for v in range(virtual)]
        for k in list(held.blocks):
            if int(k) not in mine:
                del held.blocks[k]
        mb = (B // micro, *shape[1:])
        pipeline_stages = []
        for i in mine:  # a stage's module: the rank's block i (shared with `held`)
            part = Stack(0, model)
            part.blocks[str(i)] = held.blocks[str(i)]
            pipeline_stages.append(PipelineStage(part, i, stages, torch.device("cpu"),
                                                 input_args=torch.empty(mb, requires_grad=i > 0),
                                                 output_args=torch.empty(mb, requires_grad=True)))
        sched = SCHEDULES[schedule](pipeline_stages if virtual > 1 else pipeline_stages[0], n_microbatches=micro,
                                    loss_fn=loss_fn, scale_grads=bug != "grads_not_scaled")  # BUG: grads_not_scaled
        inputs = {"x": x} if first else {"y": y} if last else {}
        return capture.Step(held, pipeline_step(sched, first, last, bug), inputs)

    return capture.Spec(sequential=capture.Step(seq, train_step, {"x": x, "y": y}), rank=rank,
                        world_size=world_size, mesh={"pp": world_size},
                        name=f"pp_{model}_{schedule}_{world_size}x{micro}{'_bug_' + bug if bug else ''}")
