"""The integer values a program singles out, for random inputs that reach its special cases.

A program that compares an integer input with a literal treats that value apart: an
`ignore_index` of -100 (`target != -100`), a padding id masked out, a threshold `ids < k`,
a rank's vocab range `ids >= start`, `ids < end`. Integers drawn uniformly below a bound
almost never hit such a value (-100 never), so a bug in what the program does with them
(a mean that divides by the ignored tokens too, `<=` for `<`) shows on no random draw.
`special_values` finds these values: from each integer sequential input, and from the rank
inputs that hold it, it walks the (core) graphs forward through the ops that only move,
select or convert elements (views, slices, concats, `where` branches, casts, gathers of the
values, collectives that move them), never through arithmetic, and collects the literals
the values reached are compared with (`eq`, `ne`, `lt`, `le`, `gt`, `ge` against a
constant). `refine.ops.interp.random_inputs(..., specials=...)` mixes them into the
sequential value before it is split over the ranks, so every rank's piece agrees with it.

Which values may be drawn: a value must be one the sequential program can evaluate on.
Where the sequential walk reaches an index use (a gather's, a scatter's or an embedding's
indices, through moves only) the values below the smallest indexed size are valid; a value
outside that range only when the sequential program compares the input with exactly it (it
guards that value: `target != -100` before the lookup). Where no index use is reached
(labels only compared, masks) every literal and its neighbours may be drawn, but they are
`unsure`: the caller draws them together with the sure ones first and, should the programs
fail to evaluate on them (an index computed from the input with arithmetic), again with
the sure ones only. A draw the programs cannot evaluate on is never evidence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from refine.ir.graph import Dist, Graph, Node
from refine.ir.term import LEAF_OPS, Term
from refine.ops.lower import lower
from refine.ops.registry import Registry

# core ops whose output's elements are elements of some of their tensor args, unchanged up to
# a cast or a selection (None: every tensor arg; else the positions): a literal compared with
# the output singles out the same values of the input
MOVES: dict[str, tuple[int, ...] | None] = {
    "view": None, "slice": None, "transpose": None, "expand": None, "cat": None,
    "cast_float_t": None, "cast_trunc_t": None, "clamp_t": None,
    "Max": None, "rmax": None, "maximum_t": None, "minimum_t": None,
    "where_t": (1, 2), "masked_fill_t": (0,), "gather": (0,), "sort_values": (0,), "topk_values": (0,),
    "all_gather": None, "all_to_all": None, "broadcast": None,
}

# comparisons of a value with a constant; the order ones have a boundary on both sides of it
EQUALITIES = frozenset({"eq_t", "ne_t"})
ORDERS = frozenset({"lt_t", "le_t", "gt_t", "ge_t"})

# ops that move a constant without changing it (the constant side of a comparison is often a
# scalar `full` broadcast to the compared shape)
_CONST_MOVES = frozenset({"view", "slice", "transpose", "expand", "cast_float_t", "cast_trunc_t"})

# term ops a define may apply to sequential inputs and still hold their values unchanged
_TERM_MOVES = frozenset({"cat", "slice", "transpose", "view", "expand"})


def _index_limit(core: Graph, n: Node, pos: int) -> int | None:
    """The size the values of tensor arg `pos` of `n` index into (they must lie below it), or
    None when `n` does not index with that arg."""
    args = n.tensor_args()
    dim = n.attrs.get("dim", 0)

    def size(shape: tuple, d: int) -> int | None:
        s = shape[d % len(shape)] if shape else None
        return s if isinstance(s, int) else None

    if n.op in ("gather", "scatter_value", "scatter_src") and pos == 1:
        return size(core.type_of(args[0]).shape, int(dim))
    if n.op == "embedding" and pos == 1:
        return size(core.type_of(args[0]).shape, 0)
    if n.op == "index_put_acc" and pos == 0:
        return size(tuple(n.attrs["shape"]), 0)
    if n.op == "scatter_acc" and pos == 0:
        return size(tuple(n.attrs["shape"]), int(dim))
    return None


def _constant(idx: dict, ref: str) -> float | None:
    """The value of every element of `ref` when it is a constant (a `full`, moved), else None."""
    while True:
        n = idx.get(ref)
        if not isinstance(n, Node):
            return None
        if n.op == "full":
            v = n.attrs.get("value")
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
        if n.op not in _CONST_MOVES or len(n.tensor_args()) != 1:
            return None
        ref = n.tensor_args()[0]


@dataclass
class Singled:
    """What a walk from an input found: literals it is compared with exactly, values next to
    an order comparison's literal, and the smallest size it indexes into (None: none)."""

    exact: set[int] = field(default_factory=set)
    near: set[int] = field(default_factory=set)
    limit: int | None = None

    def add(self, other: Singled) -> None:
        self.exact |= other.exact
        self.near |= other.near
        if other.limit is not None:
            self.limit = other.limit if self.limit is None else min(self.limit, other.limit)


def singled_out(core: Graph, starts: set[str]) -> Singled:
    """Walk `core` forward from `starts` through moves; what the values reached are compared
    with and index into."""
    idx = core.index()
    users = core.users()
    out = Singled()
    seen, todo = set(starts), list(starts)
    while todo:
        x = todo.pop()
        for n in users.get(x, []):
            args = n.tensor_args()
            for pos, a in enumerate(args):
                if a != x:
                    continue
                if n.op in MOVES and (MOVES[n.op] is None or pos in MOVES[n.op]):  # type: ignore[operator]
                    if n.name not in seen:
                        seen.add(n.name)
                        todo.append(n.name)
                elif n.op in EQUALITIES or n.op in ORDERS:
                    c = _constant(idx, args[1 - pos]) if len(args) == 2 else None
                    if c is None or not math.isfinite(c):
                        continue
                    if c == int(c):
                        out.exact.add(int(c))
                        if n.op in ORDERS:
                            out.near |= {int(c) - 1, int(c) + 1}
                    elif n.op in ORDERS:
                        out.near |= {math.floor(c), math.ceil(c)}
                elif (lim := _index_limit(core, n, pos)) is not None:
                    out.limit = lim if out.limit is None else min(out.limit, lim)
    return out


def index_limits(core: Graph) -> dict[str, int]:
    """Per integer input of `core`: the smallest size it indexes into through moves (a
    gather's class count, a table's rows), for inputs that reach an index use."""
    out: dict[str, int] = {}
    for i in core.inputs:
        if i.type.dtype.startswith(("int", "uint")) and (lim := singled_out(core, {i.name}).limit) is not None:
            out[i.name] = lim
    return out


@dataclass(frozen=True)
class Specials:
    """The values to mix into one integer sequential input: the literals the sequential
    program compares it with (`guarded`), the other values it evaluates on (`sure`), and
    values no index use bounds (`unsure`: drawn only while the programs evaluate on them)."""

    guarded: tuple[int, ...]
    sure: tuple[int, ...] = ()
    unsure: tuple[int, ...] = ()

    def mix(self, unsure: bool) -> Mix:
        return Mix(self.guarded, self.sure + (self.unsure if unsure else ()))


@dataclass(frozen=True)
class Mix:
    """Values mixed into a draw: every one of `first`, then as many of `rest` as fit."""

    first: tuple[int, ...]
    rest: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.first or self.rest)

    def apply(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """x with half its elements (at least one; at random) replaced by these values:
        `first`, then `rest` in a random order, cycled. Half, so the plain values around
        them stay (an ignored token counts only beside tokens that are not)."""
        n = x.numel()
        if n == 0 or not self:
            return x
        rest = [self.rest[i] for i in torch.randperm(len(self.rest), generator=gen).tolist()]
        pool = torch.tensor([*self.first, *rest], dtype=x.dtype)
        where = torch.randperm(n, generator=gen)[:max(1, n // 2)]
        out = x.clone().reshape(-1)
        out[where] = pool[torch.arange(len(where)) % len(pool)]
        return out.reshape(x.shape)


def _rank_inputs(dist: Dist, source: str) -> dict[int, set[str]]:
    """The rank inputs that hold `source`'s values (placed, in a layout or a replica, or
    defined from it by moves only), per rank."""
    out: dict[int, set[str]] = {r: set() for r in dist.ranks}
    rels = [r for r in dist.relations if r.source == source]
    for rel in rels:
        if rel.layout is None:
            for r in dist.ranks:
                out[r].add(rel.local or rel.source)
            continue
        for t in (rel.layout, *rel.replicas):
            for leaf in t.leaves():
                base, _, r = leaf.rpartition("@")
                out.setdefault(int(r), set()).add(base)
    if not rels:  # read as replicated, under its own name (refine.relate.program)
        for r in dist.ranks:
            out[r].add(source)
    for d in dist.defines:
        if source in d.term.leaves() and _only_moves(d.term):
            out.setdefault(d.rank, set()).add(d.input)
    return out


def _only_moves(t: Term) -> bool:
    return t.op in LEAF_OPS or (t.op in _TERM_MOVES and all(_only_moves(a) for a in t.args))


def special_values(seq: Graph, dist: Dist, registry: Registry, bounds: dict[str, int]) -> dict[str, Specials]:
    """Per integer sequential input, the values the programs single out that may be drawn
    (`bounds`: the plain draw's bound per input, `refine.ops.interp.int_bounds`)."""
    ints = [i for i in seq.inputs if i.type.dtype.startswith(("int", "uint"))]
    if not ints:
        return {}
    seq_core, _ = lower(seq, registry)
    rank_cores: dict[int, Graph] = {}
    out: dict[str, Specials] = {}
    for inp in ints:
        own = singled_out(seq_core, {inp.name})
        ranks = Singled()
        for r, names in _rank_inputs(dist, inp.name).items():
            names = {x for x in names if x in {i.name for i in dist.ranks[r].inputs}}
            if not names:
                continue
            if r not in rank_cores:
                rank_cores[r] = lower(dist.ranks[r], registry)[0]
            ranks.add(singled_out(rank_cores[r], names))
        limit = own.limit
        if limit is None and inp.name in bounds:
            limit = bounds[inp.name]
        candidates = own.exact | own.near | ranks.exact | ranks.near
        sure = {v for v in candidates if limit is not None and 0 <= v < limit} | own.exact
        unsure = set() if limit is not None else candidates - sure
        if sure or unsure:
            out[inp.name] = Specials(tuple(sorted(own.exact)), tuple(sorted(sure - own.exact)), tuple(sorted(unsure)))
    return out
