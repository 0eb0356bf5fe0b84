"""Context-parallel (ring) attention with the online-softmax merge: a whole training step.

    refine capture models/capture/cp_attention.py:make_case --out case/
    refine check case/seq.json case/dist.json

The sequential model is single-head softmax attention (q/k/v/out projections, no bias) with
an MSE loss. Each rank holds a contiguous block of the sequence (the tokens and their
targets: context parallel); the parameters are replicated. The attention is a custom
autograd Function, as ring / context-parallel implementations write it:

- forward: the ranks all-gather the key and value blocks; each rank computes, for its query
  block against each key block j, the block's attention output `o_j` (normalised by the
  block's own exp-sum) and its log-sum-exp `lse_j = m_j + log(sum(exp(s_j - m_j)))` (m_j the
  block's row max), and merges the blocks with the online-softmax update: the new
  `lse = mx + log(exp(lse - mx) + exp(lse_j - mx))` (mx = max(lse, lse_j), computed stably)
  and `out = out * exp(lse_old - lse) + o_j * exp(lse_j - lse)`;
- backward: flash-attention style, from the merged `lse`: each block's probabilities are
  recomputed as `P_j = exp(s_j - lse)`, `D = sum_j rowsum(dP_j * P_j)` (the softmax
  backward's row term, block by block), `dS_j = P_j * (dP_j - D)`; the key and value
  gradients (every key block gets a piece from this rank's queries) are reduce-scattered
  back to the ranks that own the blocks (the transpose of the forward's all-gather).

The loss is each rank's squared error over its tokens divided by the global element count;
the parameter gradients and the loss are summed over the ranks (data parallel over the
sequence). `make_case(bug=...)`:

- "no_rescale": the merge adds the new block without rescaling the running output by
  `exp(lse_old - lse_new)`;
- "wrong_block_max": a block's log-sum-exp adds the previous block's row max instead of its
  own (`lse_j = m_{j-1} + log(sum(exp(s_j - m_j)))`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from refine import capture

T, H = 8, 4  # tokens, hidden size (= the head size: one head)
SCALE = H ** -0.5
BUGS: dict[str, dict[str, object]] = {  # bug -> the make_case arguments of its twin
    "no_rescale": {}, "wrong_block_max": {},
}


class Attention(nn.Module):
    """The sequential model: plain softmax attention."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(H, H, bias=False)
        self.k = nn.Linear(H, H, bias=False)
        self.v = nn.Linear(H, H, bias=False)
        self.o = nn.Linear(H, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        p = torch.softmax(q @ k.t() * SCALE, dim=-1)
        return self.o(p @ v)


def merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lse_j: torch.Tensor,
          bug: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax update of a running (out, lse) by a new block (o, lse_j)."""
    mx = torch.maximum(lse, lse_j)
    new = mx + torch.log(torch.exp(lse - mx) + torch.exp(lse_j - mx))
    if bug == "no_rescale":
        return out + o * torch.exp(lse_j - new), new  # BUG: no_rescale
    return out * torch.exp(lse - new) + o * torch.exp(lse_j - new), new


class RingAttention(torch.autograd.Function):
    """softmax(q k^T * SCALE) v for this rank's query block, over every rank's key block."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,  # noqa: ANN001
                bug: str | None) -> torch.Tensor:
        kf, vf = funcol.all_gather_tensor(k, 0, group), funcol.all_gather_tensor(v, 0, group)
        n, world = k.shape[0], dist.get_world_size(group)
        out = lse = m_prev = None
        for j in range(world):
            kj, vj = kf[j * n:(j + 1) * n], vf[j * n:(j + 1) * n]
            s = q @ kj.t() * SCALE
            m = s.amax(-1, keepdim=True)
            e = torch.exp(s - m)
            total = e.sum(-1, keepdim=True)
            o = (e @ vj) / total
            lse_j = (m_prev if bug == "wrong_block_max" and m_prev is not None else m) + torch.log(total)  # BUG: wrong_block_max
            out, lse = (o, lse_j) if out is None else merge(out, lse, o, lse_j, bug)
            m_prev = m
        ctx.save_for_backward(q, kf, vf, lse)
        ctx.group, ctx.world, ctx.n = group, world, n
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
        q, kf, vf, lse = ctx.saved_tensors
        n = ctx.n
        ps, dps = [], []
        for j in range(ctx.world):
            kj, vj = kf[j * n:(j + 1) * n], vf[j * n:(j + 1) * n]
            ps.append(torch.exp(q @ kj.t() * SCALE - lse))  # the global softmax's block j
            dps.append(dout @ vj.t())
        pdps = [dp * p for dp, p in zip(dps, ps, strict=True)]
        d = sum(x.sum(-1, keepdim=True) for x in pdps)
        dq, dks, dvs = None, [], []
        for j in range(ctx.world):
            kj = kf[j * n:(j + 1) * n]
            ds = (pdps[j] - ps[j] * d) * SCALE  # P_j * (dP_j - D), in the softmax backward's two terms
            dq = ds @ kj if dq is None else dq + ds @ kj
            dks.append(ds.t() @ q)
            dvs.append(ps[j].t() @ dout)
        dk = funcol.reduce_scatter_tensor(torch.cat(dks), "sum", 0, ctx.group)
        dv = funcol.reduce_scatter_tensor(torch.cat(dvs), "sum", 0, ctx.group)
        return dq, dk, dv, None, None


class CPAttention(nn.Module):
    """One rank's copy of Attention: replicated weights, attention over the ring."""

    def __init__(self, seq: Attention, bug: str | None = None) -> None:
        super().__init__()
        for name in ("q", "k", "v", "o"):
            lin = nn.Linear(H, H, bias=False)
            lin.load_state_dict(getattr(seq, name).state_dict())
            capture.replicate(lin.weight)
            setattr(self, name, lin)
        self.bug = bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        return self.o(RingAttention.apply(q, k, v, dist.group.WORLD, self.bug))


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    return loss


def cp_train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Each rank's squared error over its tokens, normalised by the global element count (as
    context-parallel trainers do), so the gradients and the loss are summed over the ranks."""
    count = x.shape[0] * dist.get_world_size() * target.shape[-1]
    loss = F.mse_loss(model(x), target, reduction="sum") / count
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    return funcol.all_reduce(loss.detach(), "sum", dist.group.WORLD)


def make_case(world_size: int = 2, bug: str | None = None) -> capture.Spec:
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(BUGS)})")
    torch.manual_seed(0)
    seq = Attention()
    x, target = torch.randn(T, H), torch.randn(T, H)
    n = T // world_size

    def rank(r: int) -> capture.Step:
        shard = {k: capture.shard(v[r * n:(r + 1) * n], 0, axis="cp") for k, v in (("x", x), ("target", target))}
        return capture.Step(CPAttention(seq, bug), cp_train_step, shard)

    return capture.Spec(sequential=capture.Step(seq, train_step, {"x": x, "target": target}), rank=rank,
                        world_size=world_size, mesh={"cp": world_size},
                        name=f"cp_attention{'_bug_' + bug if bug else ''}")
