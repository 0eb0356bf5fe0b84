"""GShard-style top-2 mixture of experts under expert parallelism, written as DeepSpeed-MoE /
fairseq / GShard users write it by hand with torch.distributed: a 2-layer model, a whole
training step (forward, loss, backward, gradient synchronisation).

Each layer is pre-norm and residual, `x + MoE(LayerNorm(x))`. The MoE layer follows the GShard
paper's algorithm (top-2 gating with a capacity, einsum dispatch and combine):

- tokens come in groups (GShard's G dim; here each rank's tokens are one group);
- gating: softmax over the experts; the first expert is the argmax, the second the argmax of
  the others; a token's slot in an expert's buffer is the running count (cumsum over the
  group's tokens) of the tokens routed there before it, the second choices queued after every
  first choice; tokens past the capacity C are dropped; the two kept gates are renormalised;
- `combine[g, s, e, c]` is token s's gate weight for expert e at slot c, `dispatch` its
  nonzero pattern; `dispatch` scatters the tokens into the [E, G, C, M] expert buffers and
  `combine` gathers the weighted expert outputs back (both einsums);
- each expert is an MLP (einsum with its stacked weights, tanh-approximated gelu).

Expert parallelism: W ranks, each holding one group of S tokens and E/W experts (the stacked
expert weights are Shard(0) over "ep"; the norms and the router are replicated). A rank gates
its own group, and an all_to_all (`dist.all_to_all_single` inside an autograd Function whose
backward is the reverse all_to_all) sends each rank the slots of its experts from every
group; a second all_to_all brings the outputs back. The sequential model is the same layer on
one device with the G = W groups, so the same capacity semantics.

The loss is each rank's mean over its own tokens (the data-parallel idiom); after backward the
replicated parameters' gradients are averaged over the ranks (all-reduce, divide by W), and the
experts' gradients, which already hold every rank's tokens' contributions, are divided by W
(each rank's loss was a mean over its own tokens only). The returned loss is the ranks' mean.

Configurations: "ep2" (2 ranks, 4 experts: 2 per rank), "ep4" (4 ranks, 4 experts: 1 per
rank), "ep2_e2" (2 ranks, 2 experts). Bugs:

- "expert_grad_not_scaled": the experts' gradients are not divided by the EP size (pytorch
  #160285: expert gradients exactly 2x at EP=2; megablocks #20 "scale weight gradients by
  1/world_size when ep is enabled").
- "router_grad_not_reduced": the router's gradient is left local, never averaged over the
  ranks (torchtitan #2387: the router's gradient not reduced, the replicas diverge).
- "combine_wrong_expert_order": the returned expert outputs are laid out expert-major, as if
  the all_to_all's chunks were ordered by expert instead of by source rank (a no-op with one
  expert per rank, so built at "ep2"). DOES NOT REFINE, but the report names the combine
  einsum (the first sequential node without a relation), not the reordering line: the
  reordered tensor is still a clean permutation of the sequential slots, and no rank node
  of the reorder's shape is a placement of a sequential tensor for the counterexample's
  repair to try.

The sequential model runs each group's gating and dispatch on its own (a loop over groups,
as each rank runs one): a GShard `gsec` formulation with a group dim (G on the sequential
side, 1 on each rank) does not refine yet, because torch's einsum then lowers the two sides
through different permutes (a size-1 batch dim placed elsewhere than a larger one), which
compose only as views (`torch.einsum("gse,gsm->gem")` with g sharded is the smallest such pair).

The dropless variant (`make_dropless_case(config, bug)`, "ep2" and "ep4"; megablocks /
DeepSpeed-dropless style: top-1, every routed token kept, the tokens sorted by expert, the
per-expert counts exchanged, an uneven `all_to_all_single` there and back whose split sizes are
those counts; the sequential model dense, every expert on every token, masked) is refused by
capture at the ranks' first read of the counts, as data-dependent sizes: a graph traced with
the captured counts would hold only for inputs routed as the captured ones, no proof for every
input. Its bugs (`DROPLESS_BUGS`, not in PROGRAM) are the experts' gradients not scaled and the
received counts read expert-major (split sizes of the wrong rank). tests/cases/
test_zoo_moe_dropless.py runs them on real gloo process groups: the correct program matches
the sequential model, each twin does not.

What refining it for every routing needs (none of it exists): size symbols bound to tensor
values (the count u = counts[e] of a routing, u >= 0, the counts summing to the tokens; torch's
make_fx already traces `counts.tolist()` as such unbacked symbols), so that sizes may depend on
data; an all_to_all with (symbolic) uneven splits, lowered to slices at symbolic offsets; and
rules linking values to those sizes, checked by a harness that draws routings and their counts
together: rows `[o_e, o_e + u_e)` of `x[argsort(k, stable)]` are the rows of x routed to e, in
order (so the sequential sort of the concatenated tokens is the ranks' per-expert blocks,
concatenated), and `index_copy` by the sort's order undoes it. Routing given as an input of both
programs instead changes none of this: the sizes are still functions of its values.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models.zoo import Bug, Program
from refine import capture

REQUIRES = ()

S, M, HID, K = 8, 8, 16, 2  # tokens per group (= per rank), model dim, expert hidden dim, top-k
CAPACITY_FACTOR = 1.0
LAYERS = 2

PROGRAM = Program(
    configs={
        "ep2": "2 ranks, 4 experts (2 per rank), one group of tokens per rank",
        "ep4": "4 ranks, 4 experts (1 per rank)",
        "ep2_e2": "2 ranks, 2 experts (1 per rank)",
    },
    smoke="ep2",
    bugs={
        "expert_grad_not_scaled": Bug(
            "ep2", "expert gradients not divided by the EP size: 2x at EP=2 (pytorch #160285, megablocks #20)"),
        "router_grad_not_reduced": Bug(
            "ep2", "the router's gradient is never averaged over the ranks (torchtitan #2387)", smoke=True),
        "combine_wrong_expert_order": Bug(
            "ep2", "the combined outputs read expert-major instead of source-rank-major after the all_to_all",
            known_miss="the reordered tensor is still a clean permutation of the sequential slots: the report "
                       "names the combine einsum, the first sequential node without a relation, and no rank node "
                       "of the reorder is a placement of a sequential tensor for the repair to try"),
    },
)

_CONFIGS = {"ep2": (2, 4), "ep4": (4, 4), "ep2_e2": (2, 2)}  # config -> (ranks, experts)


def capacity(experts: int) -> int:
    """Slots per expert per group: the capacity factor times a fair share of the K*S choices."""
    return math.ceil(CAPACITY_FACTOR * K * S / experts)


def top2_gating(logits: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One group's logits [S, E] -> (combine, dispatch), both [S, E, C]."""
    experts = logits.shape[-1]
    gates = F.softmax(logits, dim=-1)
    first = torch.argmax(gates, dim=-1)
    mask1 = F.one_hot(first, experts)
    second = torch.argmax(gates.masked_fill(mask1.bool(), float("-inf")), dim=-1)
    mask2 = F.one_hot(second, experts)
    # slot of each token in its expert's buffer: the tokens routed there before it (the
    # group's first choices, then its second choices)
    pos1 = torch.cumsum(mask1, dim=0) - 1
    pos2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    mask1 = mask1 * (pos1 < cap)  # drop the tokens past the capacity
    mask2 = mask2 * (pos2 < cap)
    g1 = (gates * mask1).sum(dim=-1)
    g2 = (gates * mask2).sum(dim=-1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(gates.dtype).eps)
    g1, g2 = g1 / denom, g2 / denom
    slot1 = F.one_hot((pos1 * mask1).sum(dim=-1), cap).to(gates.dtype)
    slot2 = F.one_hot((pos2 * mask2).sum(dim=-1), cap).to(gates.dtype)
    combine = (torch.einsum("s,se,sc->sec", g1, mask1.to(gates.dtype), slot1)
               + torch.einsum("s,se,sc->sec", g2, mask2.to(gates.dtype), slot2))
    return combine, combine.bool()


class Experts(nn.Module):
    """`n` MLPs, their weights stacked along dim 0 (GShard's E dim)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.wi = nn.Parameter(torch.randn(n, M, HID) / M ** 0.5)
        self.wo = nn.Parameter(torch.randn(n, HID, M) / HID ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, slots, M] -> [n, slots, M]: expert e's MLP on its slots."""
        return torch.bmm(F.gelu(torch.bmm(x, self.wi), approximate="tanh"), self.wo)  # BUG: expert_grad_not_scaled


class AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0; its gradient goes back by the reverse all_to_all."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor]:  # noqa: ANN001
        return None, AllToAll.apply(ctx.group, grad)


class MoE(nn.Module):
    """The GShard layer. `group` None: every expert local, the tokens in groups of S (the
    sequential model); else the expert-parallel group, this rank holding one group of tokens
    and `local` of the `experts` experts."""

    def __init__(self, experts: int, local: int, group: dist.ProcessGroup | None = None,
                 bug: str | None = None) -> None:
        super().__init__()
        self.num_experts, self.group, self.bug = experts, group, bug
        self.gate = nn.Linear(M, experts, bias=False)
        self.experts = Experts(local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, M] -> [tokens, M]."""
        e, cap = self.num_experts, capacity(self.num_experts)
        if self.group is None:
            groups = x.split(S)
            gating = [top2_gating(self.gate(xg), cap) for xg in groups]
            buf = torch.stack([torch.einsum("sec,sm->ecm", d.to(x.dtype), xg)
                               for (_, d), xg in zip(gating, groups, strict=True)], 1)  # [E, G, C, M]
            y = self.experts(buf.reshape(e, -1, M)).reshape(e, len(groups), cap, M)
            return torch.cat([torch.einsum("sec,ecm->sm", c, yg) for (c, _), yg in zip(gating, y.unbind(1), strict=True)])
        w = dist.get_world_size(self.group)
        combine, dispatch = top2_gating(self.gate(x), cap)  # BUG: router_grad_not_reduced
        buf = torch.einsum("sec,sm->ecm", dispatch.to(x.dtype), x)  # [E, C, M]
        # dispatch: chunk j of the expert dim (rank j's experts) goes to rank j; what comes
        # back is [source rank = group, local expert, C, M]
        got = AllToAll.apply(self.group, buf)
        local = got.reshape(w, e // w, cap, M).transpose(0, 1).reshape(e // w, w * cap, M)
        y = self.experts(local).reshape(e // w, w, cap, M)
        back = AllToAll.apply(self.group, y.transpose(0, 1))  # each group's slots back to its rank
        if self.bug == "combine_wrong_expert_order":
            out = back.reshape(e // w, w, cap, M).transpose(0, 1).reshape(e, cap, M)  # BUG: combine_wrong_expert_order
        else:
            out = back.reshape(e, cap, M)  # [owner rank, its expert] = expert order
        return torch.einsum("sec,ecm->sm", combine, out)


class Block(nn.Module):
    def __init__(self, experts: int, local: int, group: dist.ProcessGroup | None, bug: str | None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(M)
        self.moe = MoE(experts, local, group, bug)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class Model(nn.Module):
    def __init__(self, experts: int, local: int, group: dist.ProcessGroup | None = None,
                 bug: str | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(experts, local, group, bug) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def train_step(model: Model, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    return loss


def ep_train_step(model: Model, x: torch.Tensor, target: torch.Tensor, bug: str | None = None) -> torch.Tensor:
    w = dist.get_world_size()
    loss = F.mse_loss(model(x), target)  # the mean over this rank's tokens
    loss.backward()
    for name, p in model.named_parameters():
        if ".experts." in name:
            # every rank's tokens reached this rank's experts, each rank's loss a mean over
            # its own tokens only: the sum over ranks is W times the global mean's gradient
            if bug != "expert_grad_not_scaled":
                p.grad.div_(w)
        elif not (bug == "router_grad_not_reduced" and name.endswith("gate.weight")):
            dist.all_reduce(p.grad)
            p.grad.div_(w)
    dist.all_reduce(loss := loss.detach().clone())
    return loss / w


def make_case(config: str, bug: str | None = None) -> capture.Spec:
    if config not in _CONFIGS:
        raise ValueError(f"unknown configuration {config!r} (configurations: {', '.join(_CONFIGS)})")
    if bug is not None and bug not in PROGRAM.bugs:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(PROGRAM.bugs)})")
    world, experts = _CONFIGS[config]
    local = experts // world
    torch.manual_seed(0)
    seq = Model(experts, experts)
    x, target = torch.randn(world * S, M), torch.randn(world * S, M)

    def rank(r: int) -> capture.Step:
        model = Model(experts, local, dist.group.WORLD, bug)  # type: ignore[arg-type]
        state = seq.state_dict()
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.data = state[name][r * local:(r + 1) * local].clone()
                capture.shard(p, 0, "ep")
            else:
                p.data = state[name].clone()
                capture.replicate(p)
        rows = slice(r * S, (r + 1) * S)
        inputs = {"x": capture.shard(x[rows], 0, "ep"), "target": capture.shard(target[rows], 0, "ep")}
        return capture.Step(model, lambda m, **kw: ep_train_step(m, **kw, bug=bug), inputs)

    return capture.Spec(sequential=capture.Step(seq, train_step, {"x": x, "target": target}), rank=rank,
                        world_size=world, mesh={"ep": world},
                        name=f"moe_gshard_{config}{'_bug_' + bug if bug else ''}")


class AllToAllV(torch.autograd.Function):
    """all_to_all_single over dim 0 with uneven splits (`send[j]` rows to rank j, `recv[j]` from
    rank j); its gradient goes back by the reverse exchange, the splits swapped."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, x: torch.Tensor, recv: list[int],  # noqa: ANN001
                send: list[int]) -> torch.Tensor:
        ctx.group, ctx.recv, ctx.send = group, recv, send
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor, None, None]:  # noqa: ANN001
        return None, AllToAllV.apply(ctx.group, grad, ctx.send, ctx.recv), None, None


DROPLESS_BUGS = {  # bug -> what it does; each twin's line is marked `# BUG: <name>`
    "dropless_expert_grad_not_scaled": "the experts' gradients are not divided by the EP size (pytorch #160285)",
    "dropless_counts_read_expert_major": "the received per-(source rank, expert) token counts read expert-major: "
                                         "the split sizes of the wrong rank (same totals, tokens given to the wrong "
                                         "expert; a no-op with one expert per rank, so built at ep2)",
}


class DroplessMoE(nn.Module):
    """Dropless top-1 routing (megablocks / DeepSpeed-dropless style): every routed token is
    kept, so an expert's batch is as large as the tokens routed to it. The tokens are sorted by
    expert (a stable argsort), split by the per-expert counts, each expert applied to its rows,
    the rows put back in token order and weighted by their gate probability.

    `group` None: the sequential model, dense (every expert on every token, each token keeping
    its expert's output: static shapes, the same values). Else expert parallelism: the
    per-expert counts are exchanged first (all_to_all: rank j receives, from every rank, the
    counts of j's experts), the sorted tokens go to their experts' ranks by an uneven
    all_to_all (split sizes: the counts), come back by the reverse one. Every size past the
    routing is data-dependent."""

    def __init__(self, experts: int, local: int, group: dist.ProcessGroup | None = None,
                 bug: str | None = None) -> None:
        super().__init__()
        self.num_experts, self.group, self.bug = experts, group, bug
        self.gate = nn.Linear(M, experts, bias=False)
        self.experts = Experts(local)

    def expert(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """Local expert i's MLP on rows t [n, M]."""
        return F.gelu(t @ self.experts.wi[i], approximate="tanh") @ self.experts.wo[i]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, M] -> [tokens, M]."""
        probs = F.softmax(self.gate(x), dim=-1)
        choice = torch.argmax(probs, dim=-1)
        weight = probs.gather(1, choice[:, None])  # the chosen expert's probability
        if self.group is None:  # every expert on every token, each token keeping its own expert's output
            picked = F.one_hot(choice, self.num_experts).to(x.dtype)
            return sum(self.expert(i, x) * picked[:, i:i + 1] for i in range(self.num_experts)) * weight
        order = torch.argsort(choice, stable=True)
        counts = F.one_hot(choice, self.num_experts).sum(0)  # tokens per expert
        w = dist.get_world_size(self.group)
        local = self.num_experts // w
        got = torch.empty_like(counts)  # [source rank, local expert]: the tokens each rank sends each local expert
        dist.all_to_all_single(got, counts, group=self.group)
        send = counts.reshape(w, local).sum(1).tolist()  # data-dependent sizes
        recv = got.reshape(w, local).sum(1).tolist()
        tokens = AllToAllV.apply(self.group, x[order], recv, send)  # source-rank-major, expert within
        if self.bug == "dropless_counts_read_expert_major":
            sizes = got.reshape(local, w).transpose(0, 1).reshape(-1).tolist()  # BUG: dropless_counts_read_expert_major
        else:
            sizes = got.tolist()
        chunks = tokens.split(sizes)  # chunk s * local + e: from rank s for local expert e
        out = list(chunks)
        for e in range(local):  # each local expert on its rows from every source rank at once
            mine = [s * local + e for s in range(w)]
            y_e = self.expert(e, torch.cat([chunks[k] for k in mine])).split([sizes[k] for k in mine])
            for k, part in zip(mine, y_e, strict=True):
                out[k] = part
        y = AllToAllV.apply(self.group, torch.cat(out), send, recv)
        unsorted = torch.zeros_like(y).index_copy(0, order, y)  # back in token order
        return unsorted * weight


def dropless_step(model: Model, x: torch.Tensor, target: torch.Tensor, bug: str | None = None) -> torch.Tensor:
    """The expert-parallel step of the dropless model (as `ep_train_step`)."""
    w = dist.get_world_size()
    loss = F.mse_loss(model(x), target)
    loss.backward()
    for name, p in model.named_parameters():
        if ".experts." in name:
            if bug != "dropless_expert_grad_not_scaled":
                p.grad.div_(w)  # BUG: dropless_expert_grad_not_scaled
        else:
            dist.all_reduce(p.grad)
            p.grad.div_(w)
    dist.all_reduce(loss := loss.detach().clone())
    return loss / w


def _dropless(model: Model, experts: int, local: int, group: dist.ProcessGroup | None, bug: str | None) -> Model:
    """`model` with its MoE layers made dropless (the same parameters)."""
    for layer in model.layers:
        moe = DroplessMoE(experts, local, group, bug)
        moe.load_state_dict(layer.moe.state_dict())
        layer.moe = moe  # type: ignore[assignment]
    return model


def make_dropless_case(config: str = "ep2", bug: str | None = None) -> capture.Spec:
    """The dropless variant: refused by capture, its ranks' sizes depend on the routing, so on the
    data (tests/cases/test_zoo_moe_dropless.py runs it on real process groups against the
    sequential model)."""
    if config not in ("ep2", "ep4"):
        raise ValueError(f"unknown dropless configuration {config!r} (ep2, ep4)")
    if bug is not None and bug not in DROPLESS_BUGS:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(DROPLESS_BUGS)})")
    spec = make_case(config)
    world, experts = _CONFIGS[config]
    seq = _dropless(spec.sequential.model, experts, experts, None, None)

    def rank(r: int) -> capture.Step:
        step = spec.rank(r)
        model = _dropless(step.model, experts, experts // world, dist.group.WORLD, bug)  # type: ignore[arg-type]
        return capture.Step(model, lambda m, **kw: dropless_step(m, **kw, bug=bug), step.inputs)

    return capture.Spec(sequential=capture.Step(seq, train_step, spec.sequential.inputs), rank=rank,
                        world_size=world, mesh=spec.mesh,
                        name=f"moe_gshard_dropless_{config}{'_bug_' + bug if bug else ''}")
