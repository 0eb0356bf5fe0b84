"""A top-k routed mixture of experts under expert parallelism with all_to_all dispatch: a whole
training step captured from PyTorch code.

    refine capture models/capture/moe_ep.py:make_case --out case/
    refine check case/seq.json case/dist.json

The layer: a router (`gate`, a linear map to E logits) picks each token's top K=2 experts by
softmax probability, renormalises the two probabilities (Mixtral style) and the token's output is
the weighted sum of its two experts' outputs (each expert a small MLP, weights stacked along a
leading expert dim); loss MSE.

**Dispatch with static shapes.** The tokens are split into G groups (GShard's groups), and every
expert has a capacity of C = S slots per group (S tokens per group), so no token is ever dropped
and every shape is static. For each (group, expert) the group's tokens are sorted with the
expert's routed tokens first, in token order (`sort` of the key `(1 - routed) * S + position`:
the keys are distinct, so the order is unique); the expert's buffer slot j holds the token at
`perm[j]` (`gather`), zero past the routed ones. Combining is the inverse: each slot's output,
weighted by its token's gate weight (0 for padding), is added back at its token (`scatter_add`)
and summed over the experts. No cumulative sums, no data-dependent sizes. With C = S nothing is
dropped, so each token's output does not depend on the grouping (the groups only fix where its
slots are): the layer is the usual dropless top-2 MoE.

**Expert parallelism.** Each of the W ranks holds S tokens (one group: the data is sharded over
the tokens, data parallel) and E/W experts (the stacked expert parameters Shard(0) over "ep";
the router is replicated). A rank routes its tokens, builds its [E, S, H] buffer, and
`all_to_all_single` (equal splits: E/W experts' slots to each rank) delivers to rank r the
slots of its experts from every rank, ordered by source rank; the experts run on them, and a
second all_to_all returns every slot's output to its token's rank. The sequential model is the
same layer with all experts on one device and the same G = W groups, hence the same capacity
semantics. Each rank's loss is its share of the global mean (its tokens' squared errors over
all tokens' count); after backward the router's gradient, a partial sum over the rank's tokens,
is all-reduced (summed) over the data-parallel ranks, while an expert's gradient is already
complete on its owner (the backward all_to_all brought every token's gradient to it) and stays
local. The loss is summed over ranks.

`make_case(bug=...)` builds a buggy twin:

- "router_grad_not_summed": the router's gradient is never summed over ranks.
- "combine_wrong_expert_order": the returned expert outputs are reordered as if experts were
  placed round-robin (expert e on rank e % W) while they are placed contiguously.
- "gate_not_renormalized": the ranks weight the experts' outputs by the raw top-k probabilities,
  the sequential model by the renormalised ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from refine import capture

S, H, FFN, K = 4, 8, 8, 2  # tokens per group (= per rank), hidden size, expert MLP size, top-k
BUGS: dict[str, dict[str, object]] = {  # bug -> the make_case arguments of its twin
    "router_grad_not_summed": {},
    "combine_wrong_expert_order": {},
    "gate_not_renormalized": {},
}


class Experts(nn.Module):
    """`n` small MLPs (fc1 -> gelu -> fc2), their weights stacked along dim 0."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n, FFN, H) / H ** 0.5)
        self.b1 = nn.Parameter(torch.randn(n, FFN) * 0.1)
        self.w2 = nn.Parameter(torch.randn(n, H, FFN) / FFN ** 0.5)
        self.b2 = nn.Parameter(torch.randn(n, H) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, slots, H]: expert i's slots -> expert i's outputs, [n, slots, H]."""
        h = F.gelu(torch.bmm(x, self.w1.transpose(1, 2)) + self.b1.unsqueeze(1))
        return torch.bmm(h, self.w2.transpose(1, 2)) + self.b2.unsqueeze(1)


def route(gate: nn.Linear, x: torch.Tensor, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (weights, routed), both [T, E]: each token's gate weight per expert (0 for
    the experts it does not use) and the 0/1 routing mask."""
    probs = torch.softmax(gate(x), dim=-1)  # BUG: router_grad_not_summed
    top_p, top_i = torch.topk(probs, K, dim=-1)  # BUG: gate_not_renormalized
    if renormalize:
        top_p = top_p / top_p.sum(-1, keepdim=True)
    weights = torch.zeros_like(probs).scatter(1, top_i, top_p)
    routed = torch.zeros_like(probs).scatter(1, top_i, 1.0)
    return weights, routed


def permute(x: torch.Tensor, routed: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [G*S, H], routed [G*S, E] -> (buffer [G, E, S, H], perm [G, E, S]): slot j of expert e
    in group g holds token perm[g, e, j] of the group if it is routed to e, else zeros."""
    e = routed.shape[1]
    m = routed.view(groups, S, e).transpose(1, 2)  # [G, E, S]
    key = (1 - m) * S + torch.arange(S, dtype=x.dtype)  # routed tokens first, in token order
    skey, perm = torch.sort(key, dim=-1, stable=True)
    valid = (skey < S).to(x.dtype)
    index = perm.unsqueeze(-1).expand(groups, e, S, H)
    xs = x.view(groups, 1, S, H).expand(groups, e, S, H)
    return torch.gather(xs, 2, index) * valid.unsqueeze(-1), perm


def unpermute(y: torch.Tensor, weights: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """y [G, E, S, H] slot outputs -> [G*S, H]: each token's gate-weighted sum of its experts'
    outputs (padding slots point at tokens the expert does not serve: weight 0)."""
    g, e = perm.shape[:2]
    w = torch.gather(weights.view(g, S, e).transpose(1, 2), 2, perm)  # each slot's gate weight
    index = perm.unsqueeze(-1).expand(g, e, S, H)
    out = torch.zeros_like(y).scatter_add(2, index, y * w.unsqueeze(-1))
    return out.sum(1).reshape(g * S, H)


class MoE(nn.Module):
    """The sequential model: all experts on one device, tokens in `groups` groups."""

    def __init__(self, experts: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.gate = nn.Linear(H, experts, bias=False)
        self.experts = Experts(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, e = self.groups, self.gate.out_features
        weights, routed = route(self.gate, x)
        buf, perm = permute(x, routed, g)
        slots = buf.transpose(0, 1).reshape(e, g * S, H)  # expert-major: [E, G*S, H]
        y = self.experts(slots).view(e, g, S, H).transpose(0, 1)
        return unpermute(y, weights, perm)


class EPMoE(nn.Module):
    """One rank's part of MoE: the router replicated, E/W experts local, one group of tokens."""

    def __init__(self, seq: MoE, rank: int, world: int, group: dist.ProcessGroup, bug: str | None) -> None:
        super().__init__()
        e = seq.gate.out_features
        self.world, self.local, self.group, self.bug = world, e // world, group, bug
        self.gate = nn.Linear(H, e, bias=False)
        self.gate.load_state_dict(seq.gate.state_dict())
        capture.replicate(self.gate.weight)
        self.experts = Experts(self.local)
        lo, hi = rank * self.local, (rank + 1) * self.local
        for name, p in self.experts.named_parameters():
            p.data = getattr(seq.experts, name).detach()[lo:hi].clone()
            capture.shard(p, 0, "ep")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, c, e = self.world, self.local, self.gate.out_features
        weights, routed = route(self.gate, x, renormalize=self.bug != "gate_not_renormalized")
        buf, perm = permute(x, routed, 1)
        # dispatch: chunk j of the expert dim (rank j's experts) goes to rank j; what arrives is
        # [source rank, my expert, slot, H]
        got = funcol.all_to_all_single_autograd(buf.view(e, S, H), None, None, self.group)
        slots = got.view(w, c, S, H).transpose(0, 1).reshape(c, w * S, H)
        y = self.experts(slots).view(c, w, S, H).transpose(0, 1).reshape(e, S, H)
        # combine: every slot's output back to its token's rank, ordered by expert owner
        back = funcol.all_to_all_single_autograd(y, None, None, self.group)
        if self.bug == "combine_wrong_expert_order":
            back = back.view(c, w, S, H).transpose(0, 1).reshape(e, S, H)  # BUG: combine_wrong_expert_order (as if expert i lived on rank i % W)
        return unpermute(back.view(1, e, S, H), weights, perm)


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    return loss


def ep_train_step(model: EPMoE, x: torch.Tensor, target: torch.Tensor, bug: str | None) -> torch.Tensor:
    # this rank's share of the global mean: its tokens' squared errors over all tokens' count
    loss = F.mse_loss(model(x), target) / model.world
    loss.backward()
    if bug != "router_grad_not_summed":
        # the router saw only this rank's tokens: sum the data-parallel shares
        dist.all_reduce(model.gate.weight.grad, group=model.group)
    return funcol.all_reduce(loss.detach(), "sum", model.group)


def make_case(world_size: int = 2, experts: int = 4, bug: str | None = None) -> capture.Spec:
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(BUGS)})")
    if experts % world_size or experts < K:
        raise ValueError(f"{experts} experts do not split over {world_size} ranks (or fewer than top-{K})")
    torch.manual_seed(0)
    seq = MoE(experts, groups=world_size)
    x, target = torch.randn(world_size * S, H), torch.randn(world_size * S, H)

    def rank(r: int) -> capture.Step:
        model = EPMoE(seq, r, world_size, dist.group.WORLD, bug)  # type: ignore[arg-type]
        rows = slice(r * S, (r + 1) * S)
        shard = {"x": capture.shard(x[rows], 0, "ep"), "target": capture.shard(target[rows], 0, "ep")}
        return capture.Step(model, lambda m, **kw: ep_train_step(m, **kw, bug=bug), shard)

    return capture.Spec(sequential=capture.Step(seq, train_step, {"x": x, "target": target}), rank=rank,
                        world_size=world_size, mesh={"ep": world_size},
                        name=f"moe_ep{'_bug_' + bug if bug else ''}")
