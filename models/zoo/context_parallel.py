"""Context parallelism written as its users write it by hand with torch.distributed: a 2-layer
causal transformer (pre-norm attention + MLP blocks; bidirectional in the ring's encoder
configurations), a whole training step, with either DeepSpeed-Ulysses attention or ring
attention.

Each rank holds a contiguous block of the sequence (tokens and targets); the parameters are
replicated, their gradients summed over the ranks after backward (each rank's loss is its
squared error over the global element count) and the loss summed.

- **Ulysses** (DeepSpeed-Ulysses): q, k and v are computed for the rank's tokens, then an
  all_to_all (`dist.all_to_all_single` in an autograd Function whose backward is the reverse
  all_to_all) scatters the heads and gathers the sequence: each rank holds the whole sequence
  for NH/W heads and runs ordinary causal attention on it; a second all_to_all scatters the
  sequence and gathers the heads back before the output projection.
- **Ring**: each rank's queries attend to every key block (causal: to every block up to its
  own, later blocks skipped, its own block masked by global positions). The key and value blocks are
  all-gathered; the attention is an autograd Function that merges the blocks with the online
  softmax (a running row max and sum, rescaled as each block raises the max) and computes the
  backward flash-attention style from the merged log-sum-exp, reduce-scattering the key and
  value gradients to the blocks' owners.

Configurations: "ulysses_cp2" (4 heads, 2 per rank), "ulysses_cp2_1head" (2 heads, 1 per
rank), and ring attention over a bidirectional (encoder) model, "ring_cp2_bidir" (4 heads)
and "ring_cp2_bidir_1head" (rules/online_softmax.py relates the running-max merge to
attention). Three more are built by `make_case` but left out of PROGRAM, as they do not
refine yet:

- "ulysses_cp4": UNPROVEN at the scores' bmm: the structural search's free walks,
  Policy.struct_free, run out over four ranks' chunk/stack/all_to_all/unbind/concat chains;
  with more it proves further but its steps hit the e-graph budgets.
- "ring_cp2" (causal): UNPROVEN at the sequential scores `q @ k^T` (`attention`, the
  `scores = ...` line): the ranks skip the key blocks after their own, so no rank holds the
  scores above the diagonal, which the sequential program only masks afterwards. Missing: a
  relation for a tensor held in part whose unheld part a constant mask overwrites before
  any use (the scores passed to their users as a term, like a fused op's), rules for the
  mask's blocks (a slice of `triu` against the ranks' `k_pos > q_pos` from offset ranges;
  an all-True block makes `where(mask, -inf, x)` the constant -inf, and attention over a
  concat with an all -inf block is attention over the rest), and the backward's zero
  blocks (`zeros_like` for the skipped blocks' key/value gradients).
- "ring_cp2_causal", "ring_cp2_causal_1head" (1 head), "ring_cp4_causal" (2 heads): the causal
  ring under the head-tail load-balanced layout torch's and Megatron's context parallelism use
  (rank r holds sequence chunks r and 2W-1-r of 2W; `sequence_shard` states the layout). Each
  query chunk merges the key chunks up to its own in sequence order (later chunks all masked,
  skipped), the diagonal chunk masked by global positions; the backward leaves zero key/value
  gradients for chunks no local query sees. Numerically equal to the sequential step, and not
  proven for the same reason as "ring_cp2": the sequential scores above the diagonal are never
  computed on any rank.
- "ring_cp4_bidir": UNPROVEN at the attention output `softmax(scores) @ v`: four blocks
  merged one after another make a left-nested concat of the score (and value) blocks, while
  the sequential relation holds them balanced (refine.ir.term.cat), with the rows of the 4x4
  score blocks to bring out first; concat has no associativity rule (on purpose: re-nesting
  makes every bracketing). Measured on one attention layer (4 ranks, 2 heads): a rule joining
  two bracketings that both exist, `(cat (cat a b) c)` with `(cat a (cat b c))`, together
  with Policy.deep_iterations 14 instead of 6 (each merge of the running chain costs deep
  iterations), proves it (199 s on 2 loaded cores); either alone does not.

Bugs (RING_BUGS, built in the causal ring configurations and kept out with them; the
counterexample search finds each: DOES NOT REFINE):

- "qkv_grad_not_reduced": the qkv projection's gradient is not summed over the ranks, as if
  Ulysses made it head-parallel (the ranks of a sequence-parallel group left out of the
  gradient reduction).
- "ulysses_gather_wrong_dim": the output all_to_all gathers the heads along the head dim
  instead of the head-count dim (its scatter/gather indices mixed up): the columns reach the
  output projection out of order.
- "ring_mask_local_positions": the causal mask of a key block is built from local positions
  (arange of the block) for every block, missing the ranks' offsets: earlier blocks lose keys
  they may see.
- "ring_diagonal_unmasked": the diagonal chunk (a query chunk against its own keys) attended
  without the causal mask, as a fully visible earlier chunk (`is_causal` only on the first
  step of a ring, applied to the wrong step).
- "ring_zigzag_contiguous_positions": the mask and the chunks skipped computed from contiguous
  positions (query chunk i of rank r taken as chunk 2r+i) while the tokens are laid out
  head-tail: the mask of another rank's offsets.
- "ring_no_rescale": the running output and sum are not rescaled when a block raises the row
  max (the online-softmax correction left out). Found at the sequential attention output:
  each term of the merged sum is right at its own max shift, only the shifts differ.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from models.zoo import Bug, Program
from refine import capture

REQUIRES = ()

T, H = 8, 8  # sequence length, hidden size
LAYERS = 2

PROGRAM = Program(
    configs={
        "ulysses_cp2": "DeepSpeed-Ulysses over 2 ranks, 4 heads (2 per rank)",
        "ulysses_cp2_1head": "DeepSpeed-Ulysses over 2 ranks, 2 heads (1 per rank)",
        "ring_cp2_bidir": "ring attention over 2 ranks, 4 heads, bidirectional (an encoder)",
        "ring_cp2_bidir_1head": "ring attention over 2 ranks, 1 head, bidirectional (an encoder)",
    },
    smoke="ulysses_cp2",
    bugs={
        "qkv_grad_not_reduced": Bug(
            "ulysses_cp2", "the qkv projection's gradient left unreduced over the Ulysses group, as if it were "
            "head-parallel (the sequence-parallel ranks left out of the gradient reduction)"),
        "ulysses_gather_wrong_dim": Bug(
            "ulysses_cp2", "the output all_to_all gathers the heads along the wrong dim (Ulysses layout bugs)",
            known_miss="the misgathered columns are a permutation of the sequential ones: the report names the "
                       "output projection, the first sequential node without a relation, not the all_to_all"),
        "ring_no_rescale": Bug(
            "ring_cp2_bidir", "the running output and sum not rescaled when a block raises the row max (the "
            "online-softmax correction left out, as in hand-written ring/flash attention)",
            known_miss="each term of the merged sum is right at its own max shift, only the two shifts differ: "
                       "the report names the sequential attention output `softmax(scores) @ v`, no rank line"),
    },
)

# config -> (attention, ranks, heads, causal, zigzag); the ones not in PROGRAM do not refine yet
# (module docstring). A non-causal one is a bidirectional (encoder) model; zigzag: the head-tail
# load-balanced sequence layout (rank r holds chunks r and 2W-1-r of 2W), else contiguous blocks.
_CONFIGS = {"ulysses_cp2": ("ulysses", 2, 4, True, False), "ulysses_cp2_1head": ("ulysses", 2, 2, True, False),
            "ulysses_cp4": ("ulysses", 4, 4, True, False), "ring_cp2": ("ring", 2, 4, True, False),
            "ring_cp2_bidir": ("ring", 2, 4, False, False), "ring_cp2_bidir_1head": ("ring", 2, 1, False, False),
            "ring_cp4_bidir": ("ring", 4, 4, False, False),
            "ring_cp2_causal": ("ring", 2, 4, True, True), "ring_cp2_causal_1head": ("ring", 2, 1, True, True),
            "ring_cp4_causal": ("ring", 4, 2, True, True)}
# bugs of the causal ring configurations (kept out with them): config each is built in
RING_BUGS = {"ring_mask_local_positions": "ring_cp2", "ring_diagonal_unmasked": "ring_cp2_causal",
             "ring_zigzag_contiguous_positions": "ring_cp2_causal"}


def chunks(r: int, w: int, zigzag: bool) -> tuple[int, ...]:
    """The sequence chunks rank r holds, in order: its block of W, or (head-tail load balance,
    as torch's and Megatron's context parallelism) chunks r and 2W-1-r of 2W."""
    return (r, 2 * w - 1 - r) if zigzag else (r,)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """q, k, v [heads, T, D] over the whole sequence -> [heads, T, D]."""
    n = q.shape[1]
    scores = q @ k.transpose(1, 2) * q.shape[-1] ** -0.5
    if causal:
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


class SeqAllToAll(torch.autograd.Function):
    """DeepSpeed-Ulysses' exchange: x split into W chunks along `scatter`, chunk j sent to rank
    j, the chunks received concatenated along `gather`; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scatter: int, gather: int, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.scatter, ctx.gather, ctx.group = scatter, gather, group
        w = dist.get_world_size(group)
        send = torch.stack(x.chunk(w, dim=scatter)).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        return torch.cat(recv.unbind(0), dim=gather)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # noqa: ANN001
        return SeqAllToAll.apply(grad, ctx.gather, ctx.scatter, ctx.group), None, None, None


def _blocks(a: int, b: int, n: int, bug: str | None) -> torch.Tensor:
    """The causal mask of query chunk a against key chunk b, n tokens each (True: masked)."""
    if bug == "ring_mask_local_positions":
        q_pos, k_pos = torch.arange(n), torch.arange(n)  # BUG: ring_mask_local_positions
    else:
        q_pos, k_pos = a * n + torch.arange(n), b * n + torch.arange(n)
    return k_pos[None, :] > q_pos[:, None]


def _seen(a: int, held: list[int], causal: bool) -> list[int]:
    """Where in `held` (the key chunks in gathered order) the key chunks query chunk a sees
    are: all, or (causal) those up to a in sequence order (the later ones are all masked)."""
    if not causal:
        return list(range(len(held)))
    return sorted((i for i, b in enumerate(held) if b <= a), key=lambda i: held[i])


def _scores(q: torch.Tensor, kj: torch.Tensor, a: int, b: int, causal: bool, bug: str | None) -> torch.Tensor:
    s = q @ kj.transpose(1, 2) * q.shape[-1] ** -0.5
    if bug == "ring_diagonal_unmasked" and a == b:
        return s  # BUG: ring_diagonal_unmasked
    return s.masked_fill(_blocks(a, b, q.shape[1], bug), float("-inf")) if causal else s


def _position(r: int, i: int, a: int, bug: str | None) -> int:
    """The sequence chunk the i-th query chunk of rank r is masked as: its own, a."""
    if bug == "ring_zigzag_contiguous_positions":
        return 2 * r + i  # BUG: ring_zigzag_contiguous_positions
    return a


def _part(t: torch.Tensor, i: int, n: int, parts: int) -> torch.Tensor:
    """Chunk i of n tokens of t [heads, tokens, D] (t itself when it is one chunk)."""
    return t if parts == 1 else t[:, i * n:(i + 1) * n]


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0] if len(ts) == 1 else torch.cat(ts, 1)


class RingAttention(torch.autograd.Function):
    """Softmax attention of this rank's query chunks [heads, tokens, D] over the key and value
    chunks of every rank, or (causal) of those up to each query chunk in sequence order (the
    later ones are all masked and skipped); each query chunk's blocks merged with the online
    softmax."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,  # noqa: ANN001
                bug: str | None, causal: bool, zigzag: bool) -> torch.Tensor:
        r, w = dist.get_rank(group), dist.get_world_size(group)
        mine = chunks(r, w, zigzag)
        held = [b for j in range(w) for b in chunks(j, w, zigzag)]  # key chunks in gathered order
        n = q.shape[1] // len(mine)
        kf, vf = funcol.all_gather_tensor(k, 1, group), funcol.all_gather_tensor(v, 1, group)
        outs, lses = [], []
        for i, a in enumerate(mine):
            qa, a = _part(q, i, n, len(mine)), _position(r, i, a, bug)
            out = total = m = None
            for j in _seen(a, held, causal):
                kj, vj = kf[:, j * n:(j + 1) * n], vf[:, j * n:(j + 1) * n]
                s = _scores(qa, kj, a, held[j], causal, bug)
                mj = s.amax(-1, keepdim=True)
                e = torch.exp(s - mj)
                if out is None:
                    out, total, m = e @ vj, e.sum(-1, keepdim=True), mj
                    continue
                new = torch.maximum(m, mj)
                if bug == "ring_no_rescale":
                    out = out + (e @ vj) * torch.exp(mj - new)  # BUG: ring_no_rescale
                    total = total + e.sum(-1, keepdim=True) * torch.exp(mj - new)
                else:
                    out = out * torch.exp(m - new) + (e @ vj) * torch.exp(mj - new)
                    total = total * torch.exp(m - new) + e.sum(-1, keepdim=True) * torch.exp(mj - new)
                m = new
            outs.append(out / total)
            lses.append(m + torch.log(total))
        ctx.save_for_backward(q, kf, vf, _cat(lses))
        ctx.group, ctx.bug, ctx.causal, ctx.zigzag = group, bug, causal, zigzag
        return _cat(outs)

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        q, kf, vf, lse = ctx.saved_tensors
        group = ctx.group
        w, r, scale = dist.get_world_size(group), dist.get_rank(group), q.shape[-1] ** -0.5
        mine = chunks(r, w, ctx.zigzag)
        held = [b for j in range(w) for b in chunks(j, w, ctx.zigzag)]
        n = q.shape[1] // len(mine)
        dqs: list[torch.Tensor] = []
        dks: list[torch.Tensor | None] = [None] * len(held)
        dvs: list[torch.Tensor | None] = [None] * len(held)
        for i, a in enumerate(mine):
            qa, da, la = (_part(t, i, n, len(mine)) for t in (q, dout, lse))
            a = _position(r, i, a, ctx.bug)
            seen = _seen(a, held, ctx.causal)
            ps, dps = {}, {}
            for j in seen:
                s = _scores(qa, kf[:, j * n:(j + 1) * n], a, held[j], ctx.causal, ctx.bug)
                ps[j] = torch.exp(s - la)  # block j of the whole row's softmax
                dps[j] = da @ vf[:, j * n:(j + 1) * n].transpose(1, 2)
            d = sum((dps[j] * ps[j]).sum(-1, keepdim=True) for j in seen)
            dq = torch.zeros_like(qa)
            for j in seen:
                ds = ps[j] * (dps[j] - d) * scale
                dq = dq + ds @ kf[:, j * n:(j + 1) * n]
                dk, dv = ds.transpose(1, 2) @ qa, ps[j].transpose(1, 2) @ da
                dks[j] = dk if dks[j] is None else dks[j] + dk
                dvs[j] = dv if dvs[j] is None else dvs[j] + dv
            dqs.append(dq)
        # a key chunk no query chunk here sees (all masked) gets no gradient from this rank
        dk = funcol.reduce_scatter_tensor(torch.cat([t if t is not None else torch.zeros_like(dqs[0])
                                                     for t in dks], 1), "sum", 1, group)
        dv = funcol.reduce_scatter_tensor(torch.cat([t if t is not None else torch.zeros_like(dqs[0])
                                                     for t in dvs], 1), "sum", 1, group)
        return _cat(dqs), dk, dv, None, None, None, None


class Attention(nn.Module):
    """Multi-head attention, causal or not; `mode` None: the whole sequence here (the sequential
    model), else this rank's block of it under "ulysses" or "ring"."""

    def __init__(self, heads: int, mode: str | None = None, bug: str | None = None, causal: bool = True,
                 zigzag: bool = False) -> None:
        super().__init__()
        self.heads, self.mode, self.bug, self.causal, self.zigzag = heads, mode, bug, causal, zigzag
        self.qkv = nn.Linear(H, 3 * H, bias=False)
        self.proj = nn.Linear(H, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, H] -> [tokens, H]."""
        tokens = x.shape[0]
        q, k, v = (t.reshape(tokens, self.heads, -1).transpose(0, 1)  # [heads, tokens, D]
                   for t in self.qkv(x).chunk(3, dim=-1))  # BUG: qkv_grad_not_reduced
        group = dist.group.WORLD
        if self.mode is None:
            o = attention(q, k, v, self.causal)
        elif self.mode == "ulysses":
            # heads scattered, sequence gathered: [NH/W, T, D], ordinary attention on it
            q, k, v = (SeqAllToAll.apply(t, 0, 1, group) for t in (q, k, v))
            o = attention(q, k, v, self.causal)
            if self.bug == "ulysses_gather_wrong_dim":
                o = SeqAllToAll.apply(o, 1, 2, group)  # BUG: ulysses_gather_wrong_dim
            else:
                o = SeqAllToAll.apply(o, 1, 0, group)  # sequence scattered, heads gathered back
        else:
            o = RingAttention.apply(q, k, v, group, self.bug, self.causal, self.zigzag)
        return self.proj(o.transpose(0, 1).reshape(tokens, H))


class Block(nn.Module):
    def __init__(self, heads: int, mode: str | None, bug: str | None, causal: bool, zigzag: bool) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.attn = Attention(heads, mode, bug, causal, zigzag)
        self.fc1, self.fc2 = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Model(nn.Module):
    def __init__(self, heads: int, mode: str | None = None, bug: str | None = None, causal: bool = True,
                 zigzag: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(heads, mode, bug, causal, zigzag) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def train_step(model: Model, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    return loss


def cp_train_step(model: Model, x: torch.Tensor, target: torch.Tensor, bug: str | None = None) -> torch.Tensor:
    """Each rank's squared error over its tokens, over the global element count: the
    gradients and the loss are summed over the ranks."""
    loss = F.mse_loss(model(x), target, reduction="sum") / (x.shape[0] * dist.get_world_size() * H)
    loss.backward()
    for name, p in model.named_parameters():
        if not (bug == "qkv_grad_not_reduced" and name.endswith("qkv.weight")):
            dist.all_reduce(p.grad)
    return funcol.all_reduce(loss.detach(), "sum", dist.group.WORLD)


def sequence_shard(t: torch.Tensor, r: int, w: int, zigzag: bool, name: str) -> torch.Tensor:
    """Rank r's rows of t [T, ...] annotated: a contiguous block (Shard(0)), or its head-tail
    chunks, whose relation is the sequence's chunks in order over the ranks' halves."""
    if not zigzag:
        n = t.shape[0] // w
        return capture.shard(t[r * n:(r + 1) * n], 0, "cp")
    c = t.shape[0] // (2 * w)
    rows = torch.cat([t[a * c:(a + 1) * c] for a in chunks(r, w, True)])
    owner = {a: (j, i) for j in range(w) for i, a in enumerate(chunks(j, w, True))}
    parts = ", ".join(f"slice({name}@{owner[a][0]}, 0, {owner[a][1] * c}, {(owner[a][1] + 1) * c})"
                      for a in range(2 * w))
    return capture.layout(rows, f"cat({parts}, dim=0)")


def make_case(config: str, bug: str | None = None) -> capture.Spec:
    if config not in _CONFIGS:
        raise ValueError(f"unknown configuration {config!r} (configurations: {', '.join(_CONFIGS)})")
    if bug is not None and bug not in PROGRAM.bugs and bug not in RING_BUGS:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(PROGRAM.bugs)}, {', '.join(RING_BUGS)})")
    mode, world, heads, causal, zigzag = _CONFIGS[config]
    torch.manual_seed(0)
    seq = Model(heads, causal=causal)
    x, target = torch.randn(T, H), torch.randn(T, H)

    def rank(r: int) -> capture.Step:
        model = Model(heads, mode, bug, causal, zigzag)
        model.load_state_dict(seq.state_dict())
        for p in model.parameters():
            capture.replicate(p)
        shard = {k: sequence_shard(v, r, world, zigzag, k) for k, v in (("x", x), ("target", target))}
        return capture.Step(model, lambda m, **kw: cp_train_step(m, **kw, bug=bug), shard)

    return capture.Spec(sequential=capture.Step(seq, train_step, {"x": x, "target": target}), rank=rank,
                        world_size=world, mesh={"cp": world},
                        name=f"context_parallel_{config}{'_bug_' + bug if bug else ''}")
