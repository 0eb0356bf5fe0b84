"""Grouped-query attention (GQA) under tensor parallelism: a whole training step.

    refine capture models/capture/gqa_tp.py:make_case --out case/
    refine check case/seq.json case/dist.json

The sequential model is one causal attention layer with `heads` query heads sharing
`kv_heads` key/value heads (query head h reads key/value head h // (heads / kv_heads),
Hugging Face's `repeat_kv`), q/k/v/o projections without bias, and an MSE loss. Each rank
holds `heads / world` query heads (q's rows and o's columns: Megatron's column / row
parallel split, with the output all-reduced) and the key/value heads they read:

- **KV heads split** (`kv_heads >= world`, mesh `{"tp": world}`): rank r holds key/value
  heads `[r * kv_heads / world, (r + 1) * kv_heads / world)`, every one of them read only by
  this rank's query heads; k and v are Shard(0) like q;
- **KV heads replicated** (`kv_heads < world`, mesh `{"kv": kv_heads, "rep": world /
  kv_heads}`, ranks row-major): the `world / kv_heads` ranks of a "rep" group hold the same
  one key/value head (vLLM / Megatron replicate KV heads this way when the TP degree exceeds
  their number): k and v are Shard(0) along "kv" and Replicate along "rep", q and o are
  split over both axes. Each rank's k/v gradient only sees its own query heads, so the step
  all-reduces it over the "rep" group after backward (the gradient of a replicated weight).

`make_case(select=True)` (replicated regime) is the other common layout: every rank holds the
whole k/v projections (Replicate) and picks its kv head's columns, `r // (world / kv_heads)`;
each rank's k/v gradient holds its share in its head's rows, so the step sums them over all
ranks.

`make_case(bug=...)`:

- "kv_grad_not_summed" (replicated regime): the step skips that all-reduce, so each replica
  of a key/value head keeps only its own query heads' share of the gradient;
- "kv_heads_tiled": the rank expands its key/value heads with `repeat` (k0, k1, k0, k1)
  instead of `repeat_interleave` (k0, k0, k1, k1), so a query head reads another group's
  key/value head (needs at least two KV heads per rank: the split regime with
  kv_heads >= 2 * world);
- "wrong_kv_head" (select layout): ranks pick kv heads round-robin, `r % kv_heads`, so a
  query head attends with another group's keys and values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from refine import capture

T, D, HEAD = 6, 8, 2  # tokens, model size, head size
BUGS: dict[str, dict[str, object]] = {  # bug -> the make_case arguments of its twin
    "kv_grad_not_summed": {"kv_heads": 1},
    "kv_heads_tiled": {"heads": 8, "kv_heads": 4},
    "wrong_kv_head": {"world_size": 4, "kv_heads": 2, "select": True},
}


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[kv, T, d] -> [kv * n_rep, T, d], each head repeated n_rep times in place (HF's repeat_kv)."""
    kv, t, d = x.shape
    return x[:, None].expand(kv, n_rep, t, d).reshape(kv * n_rep, t, d)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [h, T, d], k/v [h, T, d] (already expanded): causal softmax attention per head."""
    s = (q @ k.transpose(1, 2)) * HEAD ** -0.5
    p = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1)
    return p @ v


class GQA(nn.Module):
    """The sequential model."""

    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.q = nn.Linear(D, heads * HEAD, bias=False)
        self.k = nn.Linear(D, kv_heads * HEAD, bias=False)
        self.v = nn.Linear(D, kv_heads * HEAD, bias=False)
        self.o = nn.Linear(heads * HEAD, D, bias=False)
        self.register_buffer("mask", torch.ones(T, T, dtype=torch.bool).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).view(T, self.heads, HEAD).transpose(0, 1)
        k = self.k(x).view(T, self.kv_heads, HEAD).transpose(0, 1)
        v = self.v(x).view(T, self.kv_heads, HEAD).transpose(0, 1)
        n_rep = self.heads // self.kv_heads
        y = attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), self.mask)
        return self.o(y.transpose(0, 1).reshape(T, self.heads * HEAD))


class ReduceFromTP(torch.autograd.Function):
    """Megatron's "g": all-reduce forward; the gradient passes through backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        return funcol.all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return grad, None


class TPGQA(nn.Module):
    """Rank r's part: query heads [r * heads / world, (r + 1) * heads / world) and the
    key/value heads they read (their own, or one head shared with the rank's "rep" group)."""

    def __init__(self, seq: GQA, rank: int, world: int, bug: str | None, select: bool = False) -> None:
        super().__init__()
        heads, kv = seq.heads, seq.kv_heads
        self.local_heads = heads // world
        qrows = self.local_heads * HEAD
        replicated = kv < world
        self.local_kv = 1 if replicated else kv // world
        # the key/value heads rank r reads: its own block, or (replicated) the one head that
        # its query heads map to, r // (world / kv), shared with the other ranks of its group
        first_kv = rank // (world // kv) if replicated else rank * self.local_kv
        kvrows = self.local_kv * HEAD
        self.q = nn.Linear(D, qrows, bias=False)
        self.k = nn.Linear(D, kvrows, bias=False)
        self.v = nn.Linear(D, kvrows, bias=False)
        self.o = nn.Linear(qrows, D, bias=False)
        with torch.no_grad():
            self.q.weight.copy_(seq.q.weight[rank * qrows:(rank + 1) * qrows])
            self.k.weight.copy_(seq.k.weight[first_kv * HEAD:first_kv * HEAD + kvrows])
            self.v.weight.copy_(seq.v.weight[first_kv * HEAD:first_kv * HEAD + kvrows])
            self.o.weight.copy_(seq.o.weight[:, rank * qrows:(rank + 1) * qrows])
        for axis in ("kv", "rep") if replicated else ("tp",):  # query heads: split over every rank
            capture.shard(self.q.weight, 0, axis)
            capture.shard(self.o.weight, 1, axis)
        for w in (self.k.weight, self.v.weight):
            if replicated:
                capture.replicate(capture.shard(w, 0, "kv"), "rep")
            else:
                capture.shard(w, 0, "tp")
        self.register_buffer("mask", capture.replicate(torch.ones(T, T, dtype=torch.bool).triu(1)))
        self.bug, self.pick = bug, None
        if select:  # whole k/v projections on every rank; the rank picks its kv head's columns
            self.k, self.v = nn.Linear(D, kv * HEAD, bias=False), nn.Linear(D, kv * HEAD, bias=False)
            self.k.load_state_dict(seq.k.state_dict())
            self.v.load_state_dict(seq.v.state_dict())
            for w in (self.k.weight, self.v.weight):
                capture.replicate(w)
            self.kv = kv
            self.pick = rank % kv if bug == "wrong_kv_head" else first_kv  # the bug: kv heads dealt round-robin

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        n_rep = self.local_heads // self.local_kv
        if self.bug == "kv_heads_tiled":
            return x.repeat(n_rep, 1, 1)  # BUG: kv_heads_tiled (the bug: k0, k1, k0, k1 instead of k0, k0, k1, k1)
        return repeat_kv(x, n_rep)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).view(T, self.local_heads, HEAD).transpose(0, 1)
        if self.pick is None:
            k = self.k(x).view(T, self.local_kv, HEAD).transpose(0, 1)  # BUG: kv_grad_not_summed
            v = self.v(x).view(T, self.local_kv, HEAD).transpose(0, 1)  # BUG: kv_grad_not_summed
        else:
            k = self.k(x).view(T, self.kv, HEAD)[:, self.pick:self.pick + 1].transpose(0, 1)  # BUG: wrong_kv_head
            v = self.v(x).view(T, self.kv, HEAD)[:, self.pick:self.pick + 1].transpose(0, 1)  # BUG: wrong_kv_head
        y = attention(q, self.expand(k), self.expand(v), self.mask)
        y = self.o(y.transpose(0, 1).reshape(T, self.local_heads * HEAD))
        return ReduceFromTP.apply(y, dist.group.WORLD)


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    return loss


def tp_train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor, rep_group: dist.ProcessGroup | None,
                  bug: str | None) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    if rep_group is not None and bug != "kv_grad_not_summed":
        for p in (model.k.weight, model.v.weight):  # a replicated kv head: sum its replicas' gradients
            dist.all_reduce(p.grad, group=rep_group)
    return loss


def make_case(world_size: int = 2, heads: int = 4, kv_heads: int = 2, bug: str | None = None,
              select: bool = False) -> capture.Spec:
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(BUGS)})")
    if heads % kv_heads or heads % world_size or (kv_heads % world_size and world_size % kv_heads):
        raise ValueError(f"{heads} query heads, {kv_heads} kv heads on {world_size} ranks: each count must divide "
                         "the next")
    twin = f"make_case(bug={bug!r}, {', '.join(f'{k}={v}' for k, v in BUGS[bug].items())})" if bug else ""
    if bug == "kv_grad_not_summed" and kv_heads >= world_size:
        raise ValueError(f"kv_grad_not_summed needs replicated kv heads (kv_heads < world_size): {twin}")
    if select and kv_heads >= world_size:
        raise ValueError("select is a replicated-kv layout: kv_heads < world_size")
    if bug == "wrong_kv_head" and not (select and 2 <= kv_heads < world_size):
        # with one kv head, r % kv_heads and the right head are both 0: no bug
        raise ValueError(f"wrong_kv_head is a twin of the select layout with two or more kv heads: {twin}")
    if bug == "kv_heads_tiled" and kv_heads < 2 * world_size:
        raise ValueError(f"kv_heads_tiled needs at least two kv heads per rank (kv_heads >= 2 * world_size): {twin}")
    torch.manual_seed(0)
    seq = GQA(heads, kv_heads)
    x, target = torch.randn(T, D), torch.randn(T, D)
    replicated = kv_heads < world_size
    rep = world_size // kv_heads if replicated else 1
    mesh = {"kv": kv_heads, "rep": rep} if replicated else {"tp": world_size}
    name = f"gqa_tp{world_size}_h{heads}_kv{kv_heads}{'_select' if select else ''}{'_bug_' + bug if bug else ''}"

    def rank(r: int) -> capture.Step:
        groups = [dist.new_group([g * rep + i for i in range(rep)]) for g in range(kv_heads)] if replicated else []
        # the ranks sharing a kv head sum their shares of its gradient; with whole projections
        # (select) every rank holds every head's rows, so all ranks sum them
        group = dist.group.WORLD if select else groups[r // rep] if replicated else None
        data = {k: capture.replicate(v.clone()) for k, v in (("x", x), ("target", target))}
        return capture.Step(TPGQA(seq, r, world_size, bug, select),
                            lambda m, **kw: tp_train_step(m, **kw, rep_group=group, bug=bug), data)

    return capture.Spec(sequential=capture.Step(seq, train_step, {"x": x, "target": target}), rank=rank,
                        world_size=world_size, mesh=mesh, name=name)
