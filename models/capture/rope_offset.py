"""Rotary position embeddings on sequence chunks: each rank rotates its tokens by their
global positions, read from the cos/sin tables at the chunk's offset. A whole training step.

    refine capture models/capture/rope_offset.py:make_case --out case/
    refine check case/seq.json case/dist.json

The sequential model projects each token to `HEADS` query heads, rotates every head with
the rotary embedding (Llama's `q * cos + rotate_half(q) * sin`, the tables precomputed for
`MAX_POS` positions, as Hugging Face and Megatron keep them) and projects back, with an MSE
loss. Each rank holds a contiguous chunk of `T / world` tokens (sequence / context
parallel: the tokens and targets are Shard(0), the weights and tables Replicate) and must
slice the tables at its chunk's first global position, `rank * T / world`. The loss is each
rank's squared error over the global element count; gradients and loss are summed over the
ranks (`backward=False`: the loss alone). `make_case(positions=True)` reads the tables by a position-id tensor instead
(`cos[position_ids]`, Hugging Face's form): the ranks make `arange(offset, offset + n)`.

`make_case(bug=...)`:

- "offset_not_applied": every rank slices the tables from position 0 (its own local
  positions), the classic context-parallel rotary bug.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from refine import capture

T, D, HEADS, HEAD = 8, 8, 2, 4  # tokens, model size, heads, head size
MAX_POS = 2 * T  # the tables cover more positions than one step uses: every slice is a real one
BUGS: dict[str, dict[str, object]] = {  # bug -> the make_case arguments of its twin
    "offset_not_applied": {},
}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rope(nn.Module):
    """The sequential model; `offset(n)` is the first global position of the tokens it sees."""

    def __init__(self, positions: bool = False) -> None:
        super().__init__()
        self.q = nn.Linear(D, HEADS * HEAD, bias=False)
        self.o = nn.Linear(HEADS * HEAD, D, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD, 2).float() / HEAD))
        angles = torch.outer(torch.arange(MAX_POS).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos_cached", angles.cos())
        self.register_buffer("sin_cached", angles.sin())
        self.positions = positions

    def offset(self, n: int) -> int:
        return 0

    def tables(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.offset(n)
        if self.positions:
            ids = torch.arange(start, start + n)
            return self.cos_cached[ids], self.sin_cached[ids]
        return self.cos_cached[start:start + n], self.sin_cached[start:start + n]  # BUG: offset_not_applied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q = self.q(x).view(n, HEADS, HEAD)
        cos, sin = self.tables(n)
        q = q * cos[:, None] + rotate_half(q) * sin[:, None]
        return self.o(q.reshape(n, HEADS * HEAD))


class ChunkRope(Rope):
    """One rank's copy: replicated weights and tables, its tokens at their global positions."""

    def __init__(self, seq: Rope, rank: int, bug: str | None) -> None:
        super().__init__(seq.positions)
        self.load_state_dict(seq.state_dict())
        for t in (self.q.weight, self.o.weight, self.cos_cached, self.sin_cached):
            capture.replicate(t)
        self.rank, self.bug = rank, bug

    def offset(self, n: int) -> int:
        if self.bug == "offset_not_applied":
            return 0  # BUG: offset_not_applied
        return self.rank * n


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    return loss


def chunk_train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Each rank's squared error over the global element count; gradients summed over ranks."""
    count = x.shape[0] * dist.get_world_size() * target.shape[-1]
    loss = F.mse_loss(model(x), target, reduction="sum") / count
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    return funcol.all_reduce(loss.detach(), "sum", dist.group.WORLD)


def forward_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss alone (no backward)."""
    return F.mse_loss(model(x), target)


def chunk_forward_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    count = x.shape[0] * dist.get_world_size() * target.shape[-1]
    return funcol.all_reduce(F.mse_loss(model(x), target, reduction="sum") / count, "sum", dist.group.WORLD)


def make_case(world_size: int = 2, bug: str | None = None, positions: bool = False,
              backward: bool = True) -> capture.Spec:
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(BUGS)})")
    torch.manual_seed(0)
    seq = Rope(positions)
    x, target = torch.randn(T, D), torch.randn(T, D)
    n = T // world_size

    def rank(r: int) -> capture.Step:
        shard = {k: capture.shard(v[r * n:(r + 1) * n], 0, axis="sp") for k, v in (("x", x), ("target", target))}
        return capture.Step(ChunkRope(seq, r, bug), chunk_train_step if backward else chunk_forward_step, shard)

    name = f"rope_offset{'_ids' if positions else ''}{'' if backward else '_forward'}{'_bug_' + bug if bug else ''}"
    seq_step = capture.Step(seq, train_step if backward else forward_step, {"x": x, "target": target})
    return capture.Spec(sequential=seq_step, rank=rank,
                        world_size=world_size, mesh={"sp": world_size}, name=name)
