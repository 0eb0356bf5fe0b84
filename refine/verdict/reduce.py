"""Shape reduction: the same programs at small sizes, for a counterexample search on programs
too large to evaluate (TrainVerify reduces shapes before it runs its solver; this is our own
take on it).

A concrete case names its sizes as plain integers: a hidden size 1536, a sequence 1024, a
vocabulary 98304 and what the programs derive from them (1536/2 on a rank, 3*48 for fused
QKV heads, 32*1024 rows after a view). Every place a size is written is an *occurrence* with
its own symbol: each dim of each tensor type (per program), each element of a size
attribute (per node), each size in a relation term (`Sites`). What the programs rely on ties
occurrences, never values: an output dim equal to an input dim or attribute (read from the
op's own shape rule, probed: see `Sites`), a matmul's contracted dims, a view's runs of dims
with equal products, a concat's sum, a slice's start, end and cut (and where slices of one
dim meet: one position), a collective's and a relation's whole and rank piece (mesh sizes
are never reduced), a tensor of one name on every rank. Equalities make classes; each class
is written as a small rational constant times a product of powers of a few *bases* (with
base 16: 48 = 3*16, 1024 = 4*16^2, 98304 = 24*16^3), the exponents chosen (Z3) so that the
products keep and what scales alike keeps its exponents; each base is mapped to a small
value and every occurrence rewritten by its class. The exponents are chosen first with every
class of one value alike (a small problem; the reduction by value where one exists); where
the relations conflict, only the values the conflict names split into their classes, until
none conflicts (every class on its own last). So two occurrences of one value that nothing
ties may reduce apart: GPT on 8 ranks, where 8 * 1536 = 12288 tokens is also the
vocabulary's shard 98304 / 8 and the batch 8 is also the mesh's; aws_llama on 8 ranks,
where 4 is GQA's repeat and the query heads per rank. The map by value (`Sizes`, what a
counterexample records) lists such a value's reduced sizes by role. Then the rewritten
programs go through the loader's checks again: each op's shape rule must accept the new
attributes and give the rewritten shape, each program must lower (the decompositions check
what a shape rule may not: masked_fill's mask); relations, layouts, expectations, defines
and collectives must type-check. Any failure, and there is no reduction (`try_reduce` says
why: a conflict names the relations and the occurrences in them, from Z3's unsat core).

Soundness: a reduction is used by the counterexample search only (a REFINES is a proof over
the given sizes and never sees it). A counterexample at reduced sizes shows the program
family wrong, the evidence issue 22 asks for. A reduction that changed meaning would show as
a counterexample on a correct program, so what could change meaning is refused:
- a number that looks derived from a size the reduction changes (n * p/q with small p, q,
  of the number, its reciprocal, its square or that's reciprocal: a mean's 1/n, attention's
  1/sqrt(d)) is kept only when both sides hold it as a literal (both then compute with the
  same number at any size); one side deriving it from a shape (a mean op) and the other
  holding it would disagree after the reduction (the tests show the false counterexample);
- an integer literal on integer tensors equal to a changed size, or a multiple r * v below
  the number of ranks (a vocabulary shard's offset, `ids >= 49152`), is index arithmetic over
  that size and is rewritten with it; a size whose roles reduce apart, or a multiple of sizes
  that map differently, is refused (which role the literal counts in is unknown), and so is
  an index attribute (padding_idx) over a changed size;
- a size above 1 stays above 1 (a dim of 1 broadcasts) and no size grows, and every
  attribute that holds a size is known by its kind (`refine.ops.registry.ATTR_SORTS`: size
  and shape; `ints` lists except the ranks and dims named in `_NOT_SIZES`).
The tests check that correct programs reduced still agree on every draw (bundled-style
families at large sizes, one with a value in two roles, and the corpus's GPT, Qwen2 and
aws_llama layers, GPT and aws_llama on 8 ranks reduced by role).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from fractions import Fraction
from typing import Any

from refine.ir.graph import Dist, Graph, Input, Output, Placement, TensorType, value_class
from refine.ir.term import LEAF_OPS, Term
from refine.ops.lower import lower, normalize_attrs
from refine.ops.registry import Registry

# `ints` attributes that hold dims or ranks, not sizes (by name; every other `ints`
# attribute, a view's shape, a norm's normalized_shape, a repeat's counts, holds sizes)
_NOT_SIZES = ("group",)
_NOT_SIZE_SUFFIXES = ("dims", "dimensions", "_map")
# `int` attributes that hold sizes (slice_scatter's bounds); other `int` attributes are
# dims, ranks, steps or flags
_INT_SIZES = ("start", "end")

# A size is written c * prod(base_i ** e_i) with c = p/q, p and q at most this, e_i at most
# MAX_EXP; the representation of least p + q is taken.
MAX_TERM = 64
MAX_EXP = 6
MAX_BASES = 3
# reduced base values tried, smallest first
BASE_VALUES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# first bases tried (best first): a rejected reduction is retried with the next
FIRST_BASES = 3
# bases are taken among sizes at least this large (smaller ones stay what they are unless
# some base writes them more simply)
MIN_BASE = 8
# a literal matches a size when they agree to this relative precision
LITERAL_RTOL = 1e-9
# a literal of at least DERIVED_MIN (or its reciprocal, ...) looks derived from a size n when
# it is n * p/q with p, q at most DERIVED_TERM; a smaller one only when it is a size
DERIVED_MIN = 16
DERIVED_TERM = 8
# an integer attribute that is no size (an index: embedding's padding_idx, a loss's
# ignore_index) and at least this large must not equal a changed size or a small multiple
INDEX_MIN = 16




def reduce_sizes(seq: Graph, dist: Dist, registry: Registry, budget: int) -> tuple[Graph, Dist, Sizes] | None:
    """The programs with their large sizes mapped to small ones consistently, and the map
    (original size -> reduced, see `Sizes`); None when no consistent reduction within
    `budget` elements (`refine.ops.interp.eval_elements`) is found."""
    got = try_reduce(seq, dist, registry, budget)
    return None if isinstance(got, str) else got


def try_reduce(seq: Graph, dist: Dist, registry: Registry, budget: int) -> tuple[Graph, Dist, Sizes] | str:
    """As `reduce_sizes`, or why there is none. Fails closed: anything the reduction cannot
    read or check is no reduction, never an error of the check that asked for it."""
    if seq.symbols or any(g.symbols for g in dist.ranks.values()):
        return "symbolic sizes (instantiated instead)"
    try:
        return _try_reduce(seq, dist, registry, budget)
    except _Refused as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - an op or term the reduction does not know: no reduction
        return f"the reduction failed ({type(e).__name__}: {e})"


def _try_reduce(seq: Graph, dist: Dist, registry: Registry, budget: int) -> tuple[Graph, Dist, Sizes] | str:
    sites = Sites(seq, dist, registry)
    why = "no size to reduce"
    # First every class of one value alike (a small problem, and it reduces most where it
    # exists); where relations conflict, the values they name split into their classes (their
    # roles), again until none conflicts; last, every class on its own
    values = set(sites.values())
    split: set[int] = set()
    while True:
        reasons: list[str] = []
        classes, rels, to_class = sites.problem(split)
        maps = [to_class(m) for m in candidate_maps(classes, rels, reasons, sites.describe_class)]
        why = reasons[0] if reasons else why
        got = _first_valid(seq, dist, registry, sites, maps, budget)
        if not isinstance(got, str):
            return got
        why = got if maps else why
        named = {u if isinstance(u, int) else sites.value[u] for r in reasons if isinstance(r, Conflict)
                 for u in r.units if u != FIXED}
        more = named - split if named - split else values - split
        if not more:
            return why
        split |= more


def _first_valid(seq: Graph, dist: Dist, registry: Registry, sites: Sites, maps: list[dict[Occ, int]], budget: int
                 ) -> tuple[Graph, Dist, Sizes] | str:
    """The smallest of the maps whose programs check and fit the budget, or why none does."""
    from refine.ops.interp import eval_elements

    why = "no map"
    for cmap in sorted(maps, key=sites.elements):  # the smallest programs first
        try:
            s, d = rewrite(seq, dist, registry, sites, cmap)
            problem = validate(s, d, registry)
        except _Refused as e:
            why = str(e)
            continue
        except Exception as e:  # noqa: BLE001 - a rewritten program a check cannot read: not a reduction
            why = f"the reduced programs do not type-check ({type(e).__name__}: {e})"
            continue
        if problem is not None:
            why = f"the reduced programs do not type-check: {problem}"
            continue
        if eval_elements(s, d) > budget:
            why = f"reduced to {eval_elements(s, d):.3g} elements, above the budget of {budget:.3g}"
            continue
        return s, d, sites.by_value(cmap)
    return why


def apply(seq: Graph, dist: Dist, registry: Registry, mapping: Sizes) -> tuple[Graph, Dist]:
    """The programs rewritten by a map `reduce_sizes` returned (sizes it does not name stay).
    A value mapped by role (a list) names one reduced value per class of that value, in the
    order `Sites.by_value` gives them; a list that does not fit these programs is an error."""
    sites = Sites(seq, dist, registry)
    cmap: dict[Occ, int] = {}
    for v, classes in sites.values().items():
        m = mapping.get(v, v)
        ms = [m] * len(classes) if isinstance(m, int) else list(m)
        if len(ms) != len(classes):
            raise ValueError(f"the reduction maps {v} by {len(ms)} roles; these programs hold it in {len(classes)}")
        cmap.update(zip(classes, ms, strict=True))
    return rewrite(seq, dist, registry, sites, cmap)


class _Refused(ValueError):
    """A program the reduction must not rewrite."""


# ---------------------------------------------------------------------------------------
# Where sizes are


def _size_attr(name: str, kind: str) -> str | None:
    """How an attribute holds sizes: "one", "list", or None."""
    kind = kind.rstrip("?")
    if kind == "size" or (kind == "int" and name in _INT_SIZES):
        return "one"
    if kind == "shape" or (kind == "ints" and name not in _NOT_SIZES and not name.endswith(_NOT_SIZE_SUFFIXES)):
        return "list"
    return None


# f(attribute name, index in its list or None, value) -> the value to write
AttrFn = Callable[[str, int | None, int], int]


def _map_attrs(attrs: dict[str, Any], kinds: Iterable[tuple[str, str]], f: AttrFn) -> dict[str, Any]:
    out = dict(attrs)
    for name, kind in kinds:
        how, v = _size_attr(name, kind), attrs.get(name)
        if how is None or v is None:
            continue
        if how == "one":
            out[name] = _map_int(v, lambda x, name=name: f(name, None, x))
        else:
            out[name] = type(v)(_map_int(x, lambda x, name=name, i=i: f(name, i, x)) for i, x in enumerate(v))
    return out


def _map_int(v: Any, f: Callable[[int], int]) -> Any:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Refused(f"a size attribute holds {v!r}, no integer")
    return v if v < 0 else f(v)  # -1: inferred by a view


def _map_term(t: Term, registry: Registry, f: Callable[[tuple[int, ...], str, int | None, int], int],
              path: tuple[int, ...] = ()) -> Term:
    """The term with each size attribute x at `path` (child indices from the root) as
    f(path, attribute name, index, x)."""
    if t.op in LEAF_OPS:
        return t
    args = tuple(_map_term(a, registry, f, (*path, i)) for i, a in enumerate(t.args))
    op = registry.ops.get(t.op)
    if op is None:
        if t.attrs:
            raise _Refused(f"a relation term's {t.op} has attributes the reduction cannot read")
        return Term(t.op, args, t.attrs)
    attrs = []
    for (name, kind), v in zip(op.attrs, t.attrs, strict=False):
        how = _size_attr(name, kind)
        if how == "one":
            v = _map_int(v, lambda x, name=name: f(path, name, None, x))
        elif how == "list":
            v = type(v)(_map_int(x, lambda x, name=name, i=i: f(path, name, i, x)) for i, x in enumerate(v))
        attrs.append(v)
    return Term(t.op, args, (*attrs, *t.attrs[len(attrs):]))


def _graphs(seq: Graph, dist: Dist) -> list[tuple[str, Graph]]:
    return [("seq", seq), *((f"rank {r}", g) for r, g in sorted(dist.ranks.items()))]


def _terms(dist: Dist) -> list[tuple[str, Term]]:
    """Every relation term, with what it is."""
    out: list[tuple[str, Term]] = []
    for rel in dist.relations:
        if rel.layout is not None:
            out += [(f"the relation of {rel.source}", t) for t in (rel.layout, *rel.replicas)]
    for ex in dist.expectations:
        out += [(f"the expectation of {ex.output}", t) for t in ex.layout or ()]
    out += [(f"the define of {d.input}@{d.rank}", d.term) for d in dist.defines]
    return out


# ---------------------------------------------------------------------------------------
# Occurrences and what ties them. Every place a size is written is an occurrence with its own
# symbol: a dim of a tensor type (per program), an element of a size attribute (per node), a
# size in a relation term. What the programs rely on relates occurrences, never values:
# - an equality, read from the op's own shape rule: an occurrence in a node (an input's dim,
#   a size attribute) is moved to v * _PROBE with the fewest others of its value that keep
#   the rule satisfied (a matmul's contracted dims move together; a gather's index with the
#   dim it indexes), and the output dims that move with it are the same size, those that
#   move by the factor _PROBE under several moves their product (a mean over leading dims).
#   A move of a node of several arguments that changes no output must also lower (the
#   decomposition checks what the rule may not: masked_fill's mask against its input).
#   Conservative where the rule says too little: an attribute it accepts moved but whose
#   move changes no output (a bound it only checks), an occurrence no move satisfies, an
#   output dim nothing explains, is tied to everything of its value in the node;
# - a view (one tensor argument, as many elements, not a permutation) relates runs of dims
#   with equal products (a run of one dim each side is an equality), its shape attribute
#   its output dims;
# - a sum, when a move confirms it: a node whose output dim is its arguments' dims summed (a
#   concat); a slice's start, end and cut (from 0: the end is the cut); a shard: a
#   collective's input and output dim, a relation's or expectation's whole and rank piece
#   (mesh sizes are never reduced; a piece of 1 keeps its whole): these scale alike (same
#   exponents), and alike of one value are one size;
# - the bounds of the slices of one dim are positions on it: equal ones are one position
#   (where the fused QKV's query part ends its key part starts), and one equal to the dim is
#   its end;
# - a relation term is checked like a node; its value is the relation's whole; a tensor of
#   one name on every rank (an SPMD program) has one size at each dim and attribute.
# Equalities make classes (union-find); the exponents are then chosen per class, so two
# occurrences of 4 that nothing ties (GQA's repeat, the KV heads per rank) may reduce apart.

Occ = tuple[Any, ...]
# the map by value: original -> reduced, or, for a value whose classes (roles) reduce to
# different values, one reduced value per class in `Sites.values` order
Sizes = dict[int, int | list[int]]
# a probe moves a size to this multiple: a prime, so no product or sum of the node's other
# sizes lands on it by chance
_PROBE = 1_000_003
# occurrences of one value in one node tried together at most (more: tied alike)
_PROBE_WITH = 3
_PROBE_MAX = 8

Relations = tuple[dict[tuple[tuple[Any, ...], tuple[Any, ...]], str], dict[frozenset[Any], str]]


# stands in an alike set for a size that never changes (1, or a size over the mesh): every
# member keeps its size
FIXED: Occ = ("fixed",)


def _dim(side: Any, name: str, i: int) -> Occ:
    return ("dim", side, name, i)


def _attr(side: Any, node: str, name: str, i: int | None) -> Occ:
    return ("attr", side, node, name, i)


def _tattr(t: int, path: tuple[int, ...], name: str, i: int | None) -> Occ:
    return ("tattr", t, path, name, i)


class Sites:
    """The size occurrences of a pair of programs, their classes and what relates them."""

    def __init__(self, seq: Graph, dist: Dist, registry: Registry) -> None:
        self.registry = registry
        self.value: dict[Occ, int] = {}  # every occurrence of a size above 1, in walk order
        self.parent: dict[Occ, Occ] = {}
        self.prods: dict[tuple[tuple[Occ, ...], tuple[Occ, ...]], str] = {}
        self.same: dict[frozenset[Occ], str] = {}
        self.pieces: set[Occ] = set()  # rank pieces' dims along a sharded dim
        self.term_where: list[str] = []
        self._count: dict[Occ, int] | None = None  # occurrences per class, once they are made
        # a tensor's dim -> the bounds of the slices taken along it: one position per value
        self.axes: dict[Occ, list[Occ]] = {}
        self._walk(seq, dist)
        for axis, bounds in self.axes.items():
            for o in bounds:
                self.union(o, axis if self.value[axis] == self.value[o] else None)
                for x in bounds:
                    if self.value[x] == self.value[o]:
                        self.union(o, x)
        for group in list(self.same):  # alike and equal: one size
            by_v: dict[int, list[Occ]] = {}
            for o in group - {FIXED}:
                by_v.setdefault(self.value[o], []).append(o)
            for os_ in by_v.values():
                for o in os_[1:]:
                    self.union(os_[0], o)

    # -- union-find
    def find(self, o: Occ) -> Occ:
        root = o
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        while o != root:
            self.parent[o], o = root, self.parent.get(o, o)
        return root

    def union(self, a: Occ | None, b: Occ | None) -> None:
        if a is None or b is None or a not in self.value or b not in self.value:
            return
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        if self.value[ra] != self.value[rb]:
            raise _Refused(f"internal: tying {self.describe(a)} to {self.describe(b)} of another size")
        first, second = (ra, rb) if self._order[ra] < self._order[rb] else (rb, ra)
        self.parent[second] = first

    def _occ(self, key: Occ, v: Any) -> Occ | None:
        if isinstance(v, bool) or not isinstance(v, int):
            raise _Refused(f"a size is not an integer: {v!r} at {self.describe(key)}")
        if v <= 1:
            return None  # 0, 1 and -1 stay what they are
        if key not in self.value:
            self.value[key] = v
            self._order[key] = len(self._order)
        return key

    # -- what is where
    def describe(self, o: Occ) -> str:
        if o == FIXED:
            return "a size that stays (1, or taken over the mesh)"
        kind, *rest = o
        if kind == "dim":
            side, name, i = rest
            return f"{'seq' if side == 'seq' else f'rank {side}'} {name} dim {i}"
        if kind == "attr":
            side, node, name, i = rest
            return f"{'seq' if side == 'seq' else f'rank {side}'} {node}.{name}" + ("" if i is None else f"[{i}]")
        if kind == "tattr":
            t, path, name, i = rest
            return f"{self.term_where[t]}: term {list(path)} {name}" + ("" if i is None else f"[{i}]")
        t, path, i = rest
        return f"{self.term_where[t]}: term {list(path)} dim {i}"

    def describe_class(self, root: Occ) -> str:
        """A class: its size, its first occurrence and how many more it ties."""
        if not isinstance(root, tuple):  # a size (the problem by value)
            return str(root)
        if root not in self.value:
            return self.describe(root)
        if self._count is None:
            self._count = {}
            for o in self.value:
                self._count[self.find(o)] = self._count.get(self.find(o), 0) + 1
        n = self._count.get(self.find(root), 1)
        return f"{self.value[root]} [{self.describe(self.find(root))}{f' and {n - 1} more' if n > 1 else ''}]"

    def classes(self) -> dict[Occ, int]:
        """Each class (by its first occurrence) and its value."""
        return {o: v for o, v in self.value.items() if self.find(o) == o}

    def values(self) -> dict[int, list[Occ]]:
        """Each value's classes, in walk order."""
        out: dict[int, list[Occ]] = {}
        for o, v in self.classes().items():
            out.setdefault(v, []).append(o)
        return dict(sorted(out.items()))

    def relations(self) -> Relations:
        """The products and alike sets over classes, each with where it was read first."""
        prods: dict[tuple[tuple[Occ, ...], tuple[Occ, ...]], str] = {}
        same: dict[frozenset[Occ], str] = {}
        for (lhs, rhs), where in self.prods.items():
            a, b = sorted(map(self.find, lhs), key=self._order.get), sorted(map(self.find, rhs), key=self._order.get)
            if a != b:
                prods.setdefault((tuple(a), tuple(b)), where)
        for group, where in self.same.items():
            g = frozenset(map(self.find, group))
            if len(g) > 1:
                same.setdefault(g, where)
        return prods, same

    Problem = tuple[dict[Any, int], Relations, Callable[[dict[Any, int]], dict[Occ, int]]]

    def problem(self, split: set[int]) -> Problem:
        """The unknowns: a class for each value in `split`, one for all classes of any other
        value; their relations; and how a solution maps the classes."""
        prods: dict[tuple[tuple[Any, ...], tuple[Any, ...]], str] = {}
        same: dict[frozenset[Any], str] = {}

        def v(c: Occ) -> Any:
            if c not in self.value or self.value[c] in split:
                return c  # FIXED, or a class on its own
            return self.value[c]

        p, s = self.relations()
        for (lhs, rhs), where in p.items():
            a, b = tuple(sorted(map(v, lhs), key=str)), tuple(sorted(map(v, rhs), key=str))
            if a != b:
                prods.setdefault((a, b), where)
        for group, where in s.items():
            g = frozenset(map(v, group))
            if len(g) > 1:
                same.setdefault(g, where)
        classes = self.classes()
        unknowns = {v(c): x for c, x in classes.items()}
        return unknowns, (prods, same), lambda m: {c: m[v(c)] for c in classes}

    def size(self, o: Occ, v: int, cmap: dict[Occ, int]) -> int:
        """Occurrence o (of value v) under a class map."""
        return cmap[self.find(o)] if o in self.value else v

    def elements(self, cmap: dict[Occ, int]) -> int:
        return sum(math.prod(self.size(_dim(side, x.name, i), d, cmap) for i, d in enumerate(x.type.shape))
                   for side, g in self._sides for x in (*g.inputs, *g.nodes))

    def by_value(self, cmap: dict[Occ, int]) -> Sizes:
        out: Sizes = {}
        for v, classes in self.values().items():
            got = [cmap.get(c, v) for c in classes]
            if len(set(got)) > 1:
                out[v] = got
            elif got[0] != v:
                out[v] = got[0]
        return out

    # -- the walk
    def _walk(self, seq: Graph, dist: Dist) -> None:
        self._order: dict[Occ, int] = {}
        self._sides: list[tuple[Any, Graph]] = [("seq", seq), *sorted(dist.ranks.items())]
        dims: dict[Any, dict[str, tuple[list[Occ | None], TensorType]]] = {}
        for side, g in self._sides:
            label = "seq" if side == "seq" else f"rank {side}"
            types = dims[side] = {}
            for x in (*g.inputs, *g.nodes):
                types[x.name] = ([self._occ(_dim(side, x.name, i), d) for i, d in enumerate(x.type.shape)], x.type)
            for n in g.nodes:
                op = self.registry.ops[n.op]
                attr_occs = self._attr_occs(n.attrs, op, lambda name, i, side=side, n=n: _attr(side, n.name, name, i))
                ins = [types[a] for a in n.tensor_args()]

                def shape(ts: list[TensorType], attrs: dict[str, Any], op: Any = op) -> TensorType:
                    return op.shape(ts, normalize_attrs(op, attrs, ts))

                self._node(f"{label} {n.name} ({n.op})", op, shape, ins, n.attrs, attr_occs, types[n.name],
                           lambda moved, n=n, op=op: self._lowers(n, op, *moved))
        self._spmd(dist)
        seq_types, outs = dims["seq"], {o.name: o.ref for o in seq.outputs}
        for rel in dist.relations:
            whole = seq_types[rel.source][0]
            if rel.layout is not None:
                for t in (rel.layout, *rel.replicas):
                    self._root(t, f"the relation of {rel.source}", whole,
                               lambda leaf: self._rank_leaf(dims, dist, leaf, outputs=False))
                continue
            local = rel.local or rel.source
            shards = {p.dim for p in rel.placements or () if p.kind == "shard"}
            for r, g in dist.ranks.items():
                if local in g.index():
                    self._placed(whole, dims[r][local][0], shards, f"the relation of {rel.source}")
        for ex in dist.expectations:
            whole = seq_types[outs[ex.output]][0]
            if ex.layout is not None:
                for t in ex.layout:
                    self._root(t, f"the expectation of {ex.output}", whole,
                               lambda leaf: self._rank_leaf(dims, dist, leaf, outputs=True))
                continue
            local = ex.local or ex.output
            for r, g in dist.ranks.items():
                ref = {o.name: o.ref for o in g.outputs}.get(local)
                if ref is not None:
                    self._placed(whole, dims[r][ref][0], set(), f"the expectation of {ex.output}")
        for d in dist.defines:
            self._root(d.term, f"the define of {d.input}@{d.rank}", dims[d.rank][d.input][0],
                       lambda leaf: seq_types[leaf])

    def _lowers(self, n: Any, op: Any, ts: list[TensorType], attrs: dict[str, Any]) -> bool:
        """Whether node n alone, its arguments and attributes as given, lowers."""
        args = n.tensor_args()
        try:
            out = op.shape(ts, normalize_attrs(op, attrs, ts))
            g = Graph([Input(a, t) for a, t in dict(zip(args, ts, strict=True)).items()],
                      [replace(n, attrs=attrs, type=out)], [Output(n.name, n.name)])
            lower(g, self.registry)
        except Exception:  # noqa: BLE001 - a refusal anywhere is a move the op does not take
            return False
        return True

    def _attr_occs(self, attrs: dict[str, Any], op: Any, key: Callable[[str, int | None], Occ]
                   ) -> dict[tuple[str, int | None], Occ]:
        out: dict[tuple[str, int | None], Occ] = {}
        for name, kind in op.attrs:
            how, v = _size_attr(name, kind), attrs.get(name)
            if how is None or v is None:
                continue
            for i, x in ([(None, v)] if how == "one" else enumerate(v)):
                o = self._occ(key(name, i), x)
                if o is not None:
                    out[name, i] = o
        return out

    def _rank_leaf(self, dims: dict[Any, Any], dist: Dist, leaf: str, outputs: bool) -> tuple[list[Occ | None], TensorType]:
        name, _, r = leaf.rpartition("@")
        g = dist.ranks[int(r)]
        if outputs:
            name = {o.name: o.ref for o in g.outputs}[name]
        return dims[int(r)][name]

    def _placed(self, whole: list[Occ | None], piece: list[Occ | None], shards: set[int | None], where: str) -> None:
        for i, (a, b) in enumerate(zip(whole, piece, strict=False)):
            if i in shards and b is not None:
                self.pieces.add(b)
            if a is not None:  # a piece of 1: its whole is the mesh's, and stays
                self.same.setdefault(frozenset((a, FIXED if b is None else b)), where)

    def _spmd(self, dist: Dist) -> None:
        """A tensor (and a node's attributes) of one name on every rank: one size each."""
        first: dict[str, tuple[int, Any]] = {}
        for r, g in sorted(dist.ranks.items()):
            for x in (*g.inputs, *g.nodes):
                if x.name not in first:
                    first[x.name] = (r, x)
                    continue
                r0, x0 = first[x.name]
                if len(x0.type.shape) == len(x.type.shape):
                    for i, (a, b) in enumerate(zip(x0.type.shape, x.type.shape, strict=True)):
                        if a == b:
                            self.union(_dim(r0, x.name, i), _dim(r, x.name, i))
                if getattr(x, "op", None) is not None and x.op == getattr(x0, "op", None):
                    for key in [k for k in self.value if k[0] == "attr" and k[1] == r and k[2] == x.name]:
                        other = _attr(r0, x.name, key[3], key[4])
                        if self.value.get(other) == self.value[key]:
                            self.union(other, key)

    def _root(self, t: Term, where: str, whole: list[Occ | None],
              leaf: Callable[[str], tuple[list[Occ | None], TensorType]]) -> None:
        index = len(self.term_where)
        self.term_where.append(where)
        occs, _ = self._term(t, index, (), leaf, where)
        for a, b in zip(whole, occs, strict=False):
            self.union(a, b)

    def _term(self, t: Term, index: int, path: tuple[int, ...], leaf: Callable[[str], tuple[list[Occ | None], TensorType]],
              where: str) -> tuple[list[Occ | None], TensorType]:
        if t.op in LEAF_OPS:
            return leaf(t.attrs[0])
        ins = [self._term(a, index, (*path, i), leaf, where) for i, a in enumerate(t.args)]
        op = self.registry.ops.get(t.op)
        if op is None:
            raise _Refused(f"{where}: a term's {t.op} is no op the reduction knows")
        attrs = {name: v for (name, _), v in zip(op.attrs, t.attrs, strict=False)}
        out = op.shape([x for _, x in ins], attrs)
        occs = [self._occ(("tdim", index, path, i), d) for i, d in enumerate(out.shape)]
        attr_occs = self._attr_occs(attrs, op, lambda name, i: _tattr(index, path, name, i))
        self._node(f"{where}: {t.op} at {list(path)}", op, op.shape, ins, attrs, attr_occs, (occs, out))
        return occs, out

    def _node(self, where: str, op: Any, shape: Callable[[list[TensorType], dict[str, Any]], TensorType],
              ins: list[tuple[list[Occ | None], TensorType]], attrs: dict[str, Any],
              attr_occs: dict[tuple[str, int | None], Occ], out: tuple[list[Occ | None], TensorType],
              confirm: Callable[[tuple[list[TensorType], dict[str, Any]]], bool] | None = None) -> None:
        """What one node (or term) relies on between its inputs', attributes' and output's sizes."""
        out_occs, out_type = out
        in_shapes = [t.shape for _, t in ins]
        here = list(dict.fromkeys([o for occs, _ in ins for o in occs if o is not None] + list(attr_occs.values())
                                  + [o for o in out_occs if o is not None]))
        tied: set[Occ] = set()

        def tie_alike(o: Occ) -> None:  # conservative: one size with all of its value here
            for x in here:
                if self.value[x] == self.value[o]:
                    self.union(o, x)
                    tied.add(x)

        outs = out_type.shape
        if len(ins) == 1 and math.prod(in_shapes[0]) == math.prod(outs) and sorted(in_shapes[0]) != sorted(outs):
            occs = ins[0][0]
            for a, b in _runs(in_shapes[0], outs):
                la, lb = [occs[i] for i in a], [out_occs[j] for j in b]
                if len(la) == 1 and len(lb) == 1:
                    self.union(la[0], lb[0])
                else:
                    self.prods.setdefault((tuple(la), tuple(lb)), where)  # type: ignore[arg-type]
            for (name, i), o in attr_occs.items():  # a view's shape attribute is its output shape
                v = attrs[name]
                if i is not None and len(v) == len(outs) and out_occs[i] is not None and outs[i] == v[i]:
                    self.union(o, out_occs[i])
                else:
                    tie_alike(o)
            return
        covered: set[int] = set()
        if op.kind == "collective":
            for j, (a, b) in enumerate(zip(ins[0][0] if ins else [], out_occs, strict=False)):
                if b is not None and (a is None or self.value[a] != self.value[b]):
                    self.same.setdefault(frozenset((FIXED if a is None else a, b)), where)
                    covered.add(j)
        if len(ins) >= 2 and all(len(s) == len(outs) for s in in_shapes):
            for j, o in enumerate(outs):
                parts = [s[j] for s in in_shapes]
                first = next((occs[j] for occs, _ in ins if occs[j] is not None), None)
                if sum(parts) != o or len(set(parts + [o])) == 1 or first is None:
                    continue
                got = self._move(shape, ins, attrs, attr_occs, (first,))  # a sum, not sizes that add up by chance
                moved = sum(p * _PROBE if occs[j] == first else p for p, (occs, _) in zip(parts, ins, strict=True))
                if got is not None and got[j] == moved:
                    group = [occs[j] for occs, _ in ins] + [out_occs[j]]
                    self.same.setdefault(frozenset(FIXED if x is None and p == 1 else x for x, p in
                                                   zip(group, [*parts, o], strict=True) if x is not None or p == 1), where)
                    covered.add(j)
        start, end = attrs.get("start"), attrs.get("end")
        d = attrs.get("dim")
        if isinstance(d, int) and ins and ins[0][1].ndim and ins[0][0][d % ins[0][1].ndim] is not None:
            # the bounds of a slice are positions along its input's dim: where one slice ends and
            # another starts is one position (a fused QKV split), and so is the dim's end
            bounds = [attr_occs[k] for k in (("start", None), ("end", None)) if k in attr_occs]
            self.axes.setdefault(ins[0][0][d % ins[0][1].ndim], []).extend(bounds)  # type: ignore[index]
        if isinstance(d, int) and outs and isinstance(end, int) and isinstance(start, int | None) and \
                ("end", None) in attr_occs:
            # the cut: the output's dim (a slice) or an argument's (slice_scatter's source) of end - start
            j, n = d % len(outs), end - (start or 0)
            cut = [FIXED if o is None else o for o, v in
                   [(out_occs[j], outs[j])] + [(occs[j], t.shape[j]) for occs, t in ins[1:] if t.ndim == len(outs)]
                   if v == n]
            covered.update([j] if outs[j] == n else [])
            if not start:  # from 0: the cut is the end
                for o in cut:
                    self.union(attr_occs["end", None], o)
                    tied.add(o)
            else:
                group = [attr_occs.get(("start", None)), attr_occs["end", None], *cut]
                self.same.setdefault(frozenset(x for x in group if x is not None), where)
        # slice bounds: positions (above) in a sum, the rule only checks them (start <= end)
        bounds = {attr_occs[k] for k in (("start", None), ("end", None)) if k in attr_occs and isinstance(d, int)}
        self._probe(shape, ins, attrs, attr_occs, out, tied, tie_alike, bounds, where, confirm)
        for j, o in enumerate(out_occs):  # an output dim nothing here explains: one size with its value here
            if o is not None and o not in tied and j not in covered:
                tie_alike(o)

    @staticmethod
    def _moved_args(ins: list[tuple[list[Occ | None], TensorType]], attrs: dict[str, Any],
                    attr_occs: dict[tuple[str, int | None], Occ], group: tuple[Occ, ...]
                    ) -> tuple[list[TensorType], dict[str, Any]]:
        """The argument types and attributes with the occurrences of `group` moved to _PROBE
        times their size."""
        attr_of = {o: k for k, o in attr_occs.items()}
        g = set(group)
        ts = [TensorType(tuple(d * _PROBE if o in g else d for o, d in zip(occs, t.shape, strict=True)), t.dtype)
              for occs, t in ins]
        a = dict(attrs)
        for o in g & set(attr_of):
            name, i = attr_of[o]
            if i is None:
                a[name] = a[name] * _PROBE
            else:
                a[name] = type(a[name])(x * _PROBE if j == i else x for j, x in enumerate(a[name]))
        return ts, a

    def _move(self, shape: Callable[[list[TensorType], dict[str, Any]], TensorType],
              ins: list[tuple[list[Occ | None], TensorType]], attrs: dict[str, Any],
              attr_occs: dict[tuple[str, int | None], Occ], group: tuple[Occ, ...]) -> tuple[int, ...] | None:
        """The output shape with the occurrences of `group` moved, or None where the shape
        rule refuses it."""
        try:
            return tuple(shape(*self._moved_args(ins, attrs, attr_occs, group)).shape)
        except Exception:  # noqa: BLE001 - the rule refuses the move
            return None

    def _probe(self, shape: Callable[[list[TensorType], dict[str, Any]], TensorType],
               ins: list[tuple[list[Occ | None], TensorType]], attrs: dict[str, Any],
               attr_occs: dict[tuple[str, int | None], Occ], out: tuple[list[Occ | None], TensorType],
               tied: set[Occ], tie_alike: Callable[[Occ], None], bounds: set[Occ], where: str,
               confirm: Callable[[tuple[list[TensorType], dict[str, Any]]], bool] | None) -> None:
        """The equalities the shape rule shows (see above), and the products: an output dim
        that each of some moves multiplies by _PROBE, the product of their sizes (a mean over
        the leading dims keeps their product); `bounds` are attributes a reader relates
        already, not tied for want of a move."""
        out_occs, out_type = out
        outs = out_type.shape
        attr_of = {o: k for k, o in attr_occs.items()}

        def moved(group: tuple[Occ, ...]) -> tuple[int, ...] | None:
            return self._move(shape, ins, attrs, attr_occs, group)

        if moved(()) != tuple(outs):  # the rule does not give the recorded shape: nothing to read from it
            for o in list(attr_occs.values()) + [o for o in out_occs if o is not None]:
                tie_alike(o)
            return
        free = list(dict.fromkeys([o for occs, _ in ins for o in occs if o is not None] + list(attr_occs.values())))
        by_v: dict[int, list[Occ]] = {}
        for o in free:
            by_v.setdefault(self.value[o], []).append(o)
        factors: dict[int, list[Occ]] = {}
        for v, left in by_v.items():
            if len(left) > _PROBE_MAX:
                tie_alike(left[0])
                continue
            every = list(left)
            while left:
                first, found = left[0], None
                others = [o for o in every if o != first]  # those grouped already too: idx with x
                for k in range(min(len(every), _PROBE_WITH)):
                    for rest in itertools.combinations(others, k):
                        got = moved((first, *rest))
                        if got == tuple(outs) and len(ins) > 1 and confirm is not None and \
                                not confirm(self._moved_args(ins, attrs, attr_occs, (first, *rest))):
                            # a size the rule ignores in a node of several arguments: its
                            # decomposition may need it (masked_fill's mask against its input)
                            got = None
                        if got is not None:
                            found = ((first, *rest), got)
                            break
                    if found:
                        break
                if found is None:  # no move the rule accepts: one size with its value here
                    if first not in bounds:
                        tie_alike(first)
                    left = [o for o in left if o not in tied and o != first]
                    continue
                group, got = found
                for o in group[1:]:
                    self.union(first, o)
                with_it = [out_occs[j] for j in range(len(outs)) if outs[j] == v and got[j] == v * _PROBE]
                for o in with_it:
                    self.union(first, o)
                    tied.add(o)
                tied.update(group)
                for j in range(len(outs)):
                    if outs[j] != v and got[j] == outs[j] * _PROBE:
                        factors.setdefault(j, []).append(first)
                if got == tuple(outs) and any(o in attr_of and o not in bounds for o in group):  # a bound the rule only checks
                    tie_alike(first)
                left = [o for o in left if o not in group]
        for j, fs in factors.items():
            o = out_occs[j]
            if o is not None and len(fs) > 1 and math.prod(self.value[f] for f in fs) == outs[j]:
                self.prods.setdefault((tuple(fs), (o,)), where)
                tied.add(o)


def _runs(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """The smallest runs of dims (indices) of a and b with equal products, dims of 1 left
    out, in order."""
    xs, ys = [i for i, d in enumerate(a) if d != 1], [j for j, d in enumerate(b) if d != 1]
    out = []
    i = j = 0
    while i < len(xs) and j < len(ys):
        gi, gj = [xs[i]], [ys[j]]
        i, j = i + 1, j + 1
        while math.prod(a[x] for x in gi) != math.prod(b[y] for y in gj):
            if math.prod(a[x] for x in gi) < math.prod(b[y] for y in gj) and i < len(xs):
                gi.append(xs[i])
                i += 1
            elif j < len(ys):
                gj.append(ys[j])
                j += 1
            else:
                return out
        out.append((gi, gj))
    return out


def _groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The smallest runs of dims of a and b with equal products (dims of 1 left out), where
    a run is more than one dim on either side (by value, sorted)."""
    return [(tuple(sorted(a[i] for i in x)), tuple(sorted(b[j] for j in y)))
            for x, y in _runs(a, b) if len(x) > 1 or len(y) > 1]


# ---------------------------------------------------------------------------------------
# Bases, exponents and the map


Rep = tuple[Fraction, tuple[int, ...]]


def _options(v: int, bases: tuple[int, ...]) -> list[Rep]:
    """Every way to write v as c * prod(b ** e) with c small, simplest first."""
    out = []
    for exps in itertools.product(range(MAX_EXP + 1), repeat=len(bases)):
        c = Fraction(v, math.prod(b ** e for b, e in zip(bases, exps, strict=True)))
        if c.numerator <= MAX_TERM and c.denominator <= MAX_TERM:
            out.append((c, exps))
    return sorted(out, key=lambda r: (r[0].numerator + r[0].denominator, -sum(r[1])))


def _represent(v: int, bases: tuple[int, ...]) -> Rep | None:
    """v written the simplest way (least numerator + denominator of c), or None."""
    opts = _options(v, bases)
    return opts[0] if opts else None


def _cost(values: list[int], bases: tuple[int, ...]) -> int:
    total = 0
    for v in values:
        r = _represent(v, bases)
        total += 10_000 if r is None else r[0].numerator + r[0].denominator
    return total


def choose_bases(values: list[int], first: int | None = None, unwritten: list[int] | None = None
                 ) -> tuple[int, ...] | None:
    """Bases that write every size (greedy: each next base the one that leaves the least
    cost); `first` fixes the first. None when MAX_BASES do not suffice (`unwritten` gets the
    sizes the greedy's bases leave)."""
    big = [v for v in values if v >= MIN_BASE]
    bases: tuple[int, ...] = () if first is None else (first,)
    while True:
        left = [v for v in values if _represent(v, bases) is None]
        if not left:
            return bases
        if len(bases) == MAX_BASES:
            if unwritten is not None:
                unwritten += left
            return None
        pool = [v for v in left if v >= MIN_BASE] or big
        if not pool:
            return None
        bases = min(((*bases, b) for b in pool), key=lambda bs: (_cost(values, bs), bs))


def _reducible(v: int, rep: Rep, bases: tuple[int, ...]) -> bool:
    """Whether some small base values make v's writing an integer in [2, v] (the exponents
    alone do not say it: 2 = 8/4 over the base 8 has no such value)."""
    c, exps = rep
    smalls = [[s for s in BASE_VALUES if s < b] if e else [1] for b, e in zip(bases, exps, strict=True)]
    for small in itertools.product(*smalls):
        x = c * math.prod(s ** e for s, e in zip(small, exps, strict=True))
        if x.denominator == 1 and 2 <= x <= v:
            return True
    return False


def _as_classes(values: Mapping[Any, int] | Iterable[int]) -> dict[Any, int]:
    """Classes and their values: a plain list of sizes is one class per value."""
    return dict(values) if isinstance(values, Mapping) else {v: v for v in values}


def solve_exponents(values: Mapping[Any, int] | Iterable[int], bases: tuple[int, ...], rels: Relations,
                    describe: Callable[[Any], str] = str) -> dict[Any, Rep] | str:
    """For each class (a size, or a class of occurrences of one) a way to write its value
    over the bases such that every relation keeps (the simplest such, by the total of
    numerators and denominators: Z3's optimizer), or which relations conflict, each class
    named by `describe`."""
    import z3

    classes = _as_classes(values)
    prods, same = rels
    index = {c: i for i, c in enumerate(classes)}
    ks: dict[Any, list[Any]] = {}
    choice: dict[Any, tuple[Any, list[Rep]]] = {}
    hard: list[Any] = []
    cost = []
    options = {v: [r for r in _options(v, bases) if _reducible(v, r, bases)] for v in set(classes.values()) if v > 1}
    for c, v in classes.items():
        if v <= 1:
            continue
        opts = options[v]
        if not opts:
            return f"{v} is no small multiple of powers of the bases {list(bases)}"
        ks[c] = [z3.Int(f"k_{index[c]}_{j}") for j in range(len(bases))]
        pick = z3.Int(f"pick_{index[c]}")
        hard.append(z3.And(pick >= 0, pick < len(opts)))
        for i, (_, exps) in enumerate(opts):
            hard.append(z3.Implies(pick == i, z3.And(*(k == e for k, e in zip(ks[c], exps, strict=True)))))
        cost.append(z3.Sum(*(z3.If(pick == i, r.numerator + r.denominator, 0) for i, (r, _) in enumerate(opts))))
        choice[c] = (pick, opts)

    def k(c: Any, j: int) -> Any:
        return ks[c][j] if c in ks else 0

    tracked: list[tuple[Any, str]] = []
    units: list[set[Any]] = []  # the classes each tracked relation names
    for (lhs, rhs), where in prods.items():
        text = f"{' * '.join(map(describe, lhs))} = {' * '.join(map(describe, rhs))} ({where})"
        tracked.append((z3.And(*(z3.Sum(0, *(k(v, j) for v in lhs)) == z3.Sum(0, *(k(v, j) for v in rhs))
                                 for j in range(len(bases)))), text))
        units.append({*lhs, *rhs})
    for group, where in same.items():
        first, *rest = members = sorted(group, key=lambda c: index.get(c, -1))
        text = f"{', '.join(map(describe, members))} scale alike ({where})"
        tracked.append((z3.And(*(k(first, j) == k(v, j) for v in rest for j in range(len(bases)))), text))
        units.append(set(group))
    opt = z3.Optimize()
    opt.set("timeout", 10_000)
    opt.add(*hard, *(c for c, _ in tracked))
    opt.minimize(z3.Sum(0, *cost))
    if opt.check() == z3.sat:
        model = opt.model()
        out: dict[Any, Rep] = {c: (Fraction(v), (0,) * len(bases)) for c, v in classes.items() if v <= 1}
        for c, (pick, opts) in choice.items():
            out[c] = opts[model.eval(pick, model_completion=True).as_long()]
        return out
    core = z3.Solver()
    core.set("timeout", 10_000)
    core.add(*hard)
    labels = {z3.Bool(f"rel_{i}"): text for i, (_, text) in enumerate(tracked)}
    for (c, _), label in zip(tracked, labels, strict=True):
        core.assert_and_track(c, label)
    if core.check() != z3.unsat:
        return f"no writing over the bases {list(bases)} found in time"
    index_of = {label: i for i, label in enumerate(labels)}
    in_core = [index_of[z3.Bool(str(x))] for x in core.unsat_core()]
    names = [tracked[i][1] for i in in_core]
    return Conflict(f"over the bases {list(bases)} the sizes cannot all scale (one class of occurrences plays roles "
                    "that scale differently): " + "; ".join(names[:8]) +
                    (f"; ... {len(names) - 8} more" if len(names) > 8 else ""),
                    set().union(*(units[i] for i in in_core)))


class Conflict(str):
    """Why no writing keeps the relations, and the classes the conflicting relations name."""

    units: set[Any]

    def __new__(cls, text: str, units: set[Any]) -> Conflict:
        out = super().__new__(cls, text)
        out.units = units
        return out


def candidate_maps(values: Mapping[Any, int] | Iterable[int], rels: Relations = ({}, {}),
                   why: list[str] | None = None, describe: Callable[[Any], str] = str) -> Iterable[dict[Any, int]]:
    """Maps class -> reduced size to try (`values`: each class's size; a plain list of sizes
    is one class per size): for each choice of bases whose exponents keep the relations,
    the smallest base values that keep every size a positive integer, above 1 where it was,
    and no larger than it was (and the next larger, in case the smallest degenerates). `why`
    collects why a choice of bases gave none."""
    classes = _as_classes(values)
    sizes = sorted(set(classes.values()))
    big = sorted({v for v in sizes if v >= MIN_BASE}, key=lambda b: (_cost(sizes, (b,)), b))
    tried: set[tuple[int, ...]] = set()
    for first in big[:FIRST_BASES]:
        odd: list[int] = []
        bases = choose_bases(sizes, first, odd)
        if bases is None:
            if why is not None:
                why.append(f"no {MAX_BASES} bases with {first} write every size as a small multiple of their powers "
                           f"(left: {', '.join(map(str, odd[:8]))}{', ...' if len(odd) > 8 else ''})")
            continue
        if bases in tried:
            continue
        tried.add(bases)
        reps = solve_exponents(classes, bases, rels, describe)
        if isinstance(reps, str):
            if why is not None:
                why.append(reps)
            continue
        combos = sorted(itertools.product(BASE_VALUES, repeat=len(bases)), key=lambda bs: (math.prod(bs), bs))
        made = 0
        for small in combos:
            if any(s >= b for s, b in zip(small, bases, strict=True)):
                continue
            mapping = _map_with(reps, classes, small)
            if mapping is not None:
                yield mapping
                made += 1
                if made == 2:
                    break


def _map_with(reps: dict[Any, Rep], classes: dict[Any, int], small: tuple[int, ...]) -> dict[Any, int] | None:
    out: dict[Any, int] = {}
    for c, (r, exps) in reps.items():
        v = classes[c]
        x = r * math.prod(s ** e for s, e in zip(small, exps, strict=True))
        if x.denominator != 1 or x > v or (v > 1 and x < 2) or (v in (0, 1) and x != v):
            return None
        out[c] = int(x)
    return out


# ---------------------------------------------------------------------------------------
# Rewriting


def _numbers(n: Any, registry: Registry) -> list[tuple[str, Any]]:
    """The number literals of a node: ("arg", x) and (attribute name, x) for float ones."""
    out: list[tuple[str, Any]] = [("arg", a) for a in n.args if not isinstance(a, str) and not isinstance(a, bool)]
    for name, kind in registry.ops[n.op].attrs:
        if kind.rstrip("?") in ("float", "rational") and n.attrs.get(name) is not None:
            out.append((name, n.attrs[name]))
    return out


def _derived_from(x: Any, changed: set[int]) -> int | None:
    """The changed size n a literal looks derived from, or None: y = n * p/q with p, q at
    most DERIVED_TERM, where y is the literal's magnitude, its reciprocal, its square or
    that's reciprocal (a mean's 1/n, 2/n, attention's 1/sqrt(d)). Exactly, to LITERAL_RTOL:
    a number that only comes near a size (1e-5, -10000) is not one."""
    try:
        a = abs(float(Fraction(x)))
    except (ValueError, TypeError, OverflowError, ZeroDivisionError):
        return None
    if a == 0 or not math.isfinite(a):
        return None
    ys = (a, 1 / a, a * a, 1 / (a * a))
    for y in ys:  # a size itself first
        n = round(y)
        if n in changed and abs(y - n) <= LITERAL_RTOL * n:
            return n
    for y in ys:
        if y < DERIVED_MIN:  # small numbers (1, 2, 0.5) are everywhere: only an exact size counts
            continue
        for n in sorted(changed):
            r = Fraction(y / n).limit_denominator(DERIVED_TERM)
            if r.numerator <= DERIVED_TERM and abs(float(r) - y / n) <= LITERAL_RTOL * y / n:
                return n
    return None


def rewrite(seq: Graph, dist: Dist, registry: Registry, sites: Sites, cmap: dict[Occ, int]) -> tuple[Graph, Dist]:
    """Both sides with every size occurrence replaced by its class's reduced size (raises
    _Refused where a number looks derived from a changed size and only one side holds it, or
    where an integer literal is index arithmetic over a size that reduces differently by role)."""
    reduced: dict[int, set[int]] = {}  # value -> the sizes its classes reduce to
    for c, v in sites.classes().items():
        reduced.setdefault(v, set()).add(cmap.get(c, v))
    changed = {v for v, ws in reduced.items() if ws != {v}}
    pieces: dict[int, set[int]] = {}  # the sizes of the rank pieces of sharded inputs, along their sharded dims
    for o in sites.pieces:
        pieces.setdefault(sites.value[o], set()).add(sites.size(o, sites.value[o], cmap))

    def roles(v: int) -> str:
        return "; ".join(f"{sites.describe_class(c)} -> {cmap.get(c, v)}" for c in sites.values().get(v, []))

    def _index_literal(x: int, at: str) -> int | None:
        """An integer on integer tensors is index arithmetic: a changed size, or a multiple
        r * v of one with r below the number of ranks (the offset of rank r's shard of a
        vocabulary, r * V/n), is rewritten with it; v a shard's size where one fits."""
        if x in changed:
            if len(reduced[x]) > 1:
                raise _Refused(f"{at}: the integer {x} is index arithmetic over a size that reduces differently by "
                               f"role ({roles(x)})")
            return next(iter(reduced[x]))
        fits = [v for v in changed if x % v == 0 and x // v < dist.mesh.size]
        made = set()
        for v in [v for v in fits if v in pieces] or fits:
            made |= {x // v * w for w in (pieces[v] if v in pieces else reduced[v])}
        if len(made) > 1:  # multiples of sizes that scale differently: which one it is, is unknown
            raise _Refused(f"{at}: the integer {x} is a multiple of sizes the reduction maps differently")
        return made.pop() if made else None

    held: dict[str, set[Any]] = {}  # literal -> the sides holding it ("seq", "rank")
    where: dict[Any, str] = {}

    def graph(side: Any, g: Graph) -> Graph:
        label = "seq" if side == "seq" else "rank"
        types = {x.name: x.type for x in (*g.inputs, *g.nodes)}

        def typ(name: str, t: TensorType) -> TensorType:
            return TensorType(tuple(sites.size(_dim(side, name, i), d, cmap) for i, d in enumerate(t.shape)), t.dtype)

        nodes = []
        for n in g.nodes:
            ints = value_class(n.type.dtype) == "int" or any(value_class(types[a].dtype) == "int"
                                                              for a in n.tensor_args())
            args = list(n.args)
            for i, a in enumerate(args):
                if ints and isinstance(a, int) and not isinstance(a, bool) and \
                        (m := _index_literal(abs(a), f"{label} {n.name} ({n.op})")):
                    args[i] = m * (1 if a > 0 else -1)
            kept = [a for a, b in zip(n.args, args, strict=True) if a is b]
            for name, x in _numbers(replace(n, args=kept), registry):
                if _derived_from(x, changed) is not None:
                    held.setdefault(repr(float(Fraction(x))), set()).add(label)
                    where.setdefault(repr(float(Fraction(x))), f"{n.name} ({n.op}) {name}={x}")
            for name, kind in registry.ops[n.op].attrs:
                v = n.attrs.get(name)
                if kind.rstrip("?") == "int" and _size_attr(name, kind) is None and isinstance(v, int) and \
                        abs(v) >= INDEX_MIN and any(abs(v) % c == 0 and abs(v) // c <= MAX_TERM for c in changed):
                    raise _Refused(f"{label} {n.name} ({n.op}): its {name}={v} is an index over a size the reduction "
                                   "changes")

            def f(name: str, i: int | None, x: int, n: Any = n) -> int:
                return sites.size(_attr(side, n.name, name, i), x, cmap)

            nodes.append(replace(n, args=args, attrs=_map_attrs(n.attrs, registry.ops[n.op].attrs, f),
                                 type=typ(n.name, n.type)))
        return Graph([replace(i, type=typ(i.name, i.type)) for i in g.inputs], nodes, list(g.outputs), g.name, {})

    s = graph("seq", seq)
    ranks = {r: graph(r, g) for r, g in dist.ranks.items()}
    for x, sides in held.items():
        if sides != {"seq", "rank"}:
            one = "the sequential program" if sides == {"seq"} else "the rank programs"
            raise _Refused(f"the number {where[x]} looks derived from a size the reduction changes "
                           f"(size {_derived_from(float(x), changed)}) and only {one} hold it")
    terms = iter(range(len(sites.term_where)))
    for _, t in _terms(dist):
        _scales_ok(t, changed)

    def term(t: Term) -> Term:
        index = next(terms)
        return _map_term(t, registry, lambda path, name, i, x: sites.size(_tattr(index, path, name, i), x, cmap))

    rels = [replace(r, layout=term(r.layout), replicas=tuple(map(term, r.replicas))) if r.layout is not None else r
            for r in dist.relations]
    exps = [replace(e, layout=tuple(map(term, e.layout))) if e.layout is not None else e for e in dist.expectations]
    defs = [replace(d, term=term(d.term)) for d in dist.defines]
    return s, Dist(dist.mesh, ranks, rels, exps, defs)


def _scales_ok(t: Term, changed: set[int]) -> None:
    """A relation term's numbers (scales, fills) must not look derived from a changed size."""
    if t.op in LEAF_OPS:
        return
    for a in t.attrs:
        if isinstance(a, (float, Fraction)) and _derived_from(a, changed) is not None:
            raise _Refused(f"a relation term's {t.op} holds {a}, which looks derived from a size the reduction changes")
    for a in t.args:
        _scales_ok(a, changed)


# ---------------------------------------------------------------------------------------
# Validation: the loader's checks, on the rewritten programs


def validate(seq: Graph, dist: Dist, registry: Registry) -> str | None:
    """Why the programs do not type-check (the loader's shape inference, placements,
    layouts, expectations, collectives and defines), or None."""
    from refine.frontends import graphfile
    from refine.ir.errors import InputError

    for side, g in _graphs(seq, dist):
        problem = _graph_problem(g, registry)
        if problem is not None:
            return f"{side}: {problem}"
    c = graphfile._Ctx("reduced")
    try:
        graphfile._check_collectives(c, dist.ranks, {r: f"rank {r}" for r in dist.ranks}, registry)
    except InputError as e:
        return str(e)
    seq_types = {i.name: i.type for i in seq.inputs}
    for rel in dist.relations:
        want = seq_types[rel.source].shape
        if rel.layout is not None:
            for t in (rel.layout, *rel.replicas):
                problem = _term_problem(t, lambda leaf: _rank_type(dist, leaf, outputs=False), registry, want)
                if problem:
                    return f"the layout of {rel.source!r}: {problem}"
            continue
        local, pl = rel.local or rel.source, rel.placements or ()
        problem = _placed_problem(dist, pl, lambda r, local=local: dist.ranks[r].type_of(local).shape, want)
        if problem:
            return f"the relation of {rel.source!r}: {problem}"
    outs = {o.name: o.ref for o in seq.outputs}
    for ex in dist.expectations:
        want = seq.type_of(outs[ex.output]).shape
        if ex.layout is not None:
            for t in ex.layout:
                problem = _term_problem(t, lambda leaf: _rank_type(dist, leaf, outputs=True), registry, want)
                if problem:
                    return f"the expectation of {ex.output!r}: {problem}"
            continue
        local = ex.local or ex.output
        refs = {r: {o.name: o.ref for o in g.outputs}[local] for r, g in dist.ranks.items()}
        pl = ex.placements or tuple(Placement("replicate") for _ in dist.mesh.axes)
        problem = _placed_problem(dist, pl, lambda r, refs=refs: dist.ranks[r].type_of(refs[r]).shape, want)
        if problem:
            return f"the expectation of {ex.output!r}: {problem}"
    for d in dist.defines:
        want = dist.ranks[d.rank].type_of(d.input).shape
        problem = _term_problem(d.term, lambda leaf: seq_types[leaf], registry, want)
        if problem:
            return f"the define of {d.input}@{d.rank}: {problem}"
    if dist.defines:
        from refine.ops.interp import define_conflict

        bad = define_conflict(seq, dist, registry)
        if bad is not None:
            return f"the define of {bad[0].input}@{bad[0].rank} contradicts the relations: {bad[1]}"
    return None


def _graph_problem(g: Graph, registry: Registry) -> str | None:
    types: dict[str, TensorType] = {i.name: i.type for i in g.inputs}
    for n in g.nodes:
        op = registry.ops[n.op]
        ins = [types[a] for a in n.tensor_args()]
        try:
            got = op.shape(ins, normalize_attrs(op, n.attrs, ins))
        except Exception as e:  # noqa: BLE001 - any refusal of the shape rule is a failed reduction
            return f"node {n.name!r} ({n.op}): {type(e).__name__}: {e}"
        if tuple(got.shape) != tuple(n.type.shape):
            return f"node {n.name!r} ({n.op}) gives {list(got.shape)}, not {list(n.type.shape)}"
        types[n.name] = n.type
    try:  # the decompositions check what an op's own shape rule may not (masked_fill's mask)
        lower(g, registry)
    except Exception as e:  # noqa: BLE001 - any refusal is a failed reduction
        return f"lowering: {type(e).__name__}: {e}"
    return None


def _rank_type(dist: Dist, leaf: str, outputs: bool) -> TensorType:
    name, _, r = leaf.rpartition("@")
    g = dist.ranks[int(r)]
    if outputs:
        name = {o.name: o.ref for o in g.outputs}[name]
    return g.type_of(name)


def _term_problem(t: Term, leaf_type: Callable[[str], TensorType], registry: Registry,
                  want: tuple[Any, ...]) -> str | None:
    def shape(x: Term) -> TensorType:
        if x.op in LEAF_OPS:
            return leaf_type(x.attrs[0])
        op = registry.ops[x.op]
        ins = [shape(a) for a in x.args]
        return op.shape(ins, {k: v for (k, _), v in zip(op.attrs, x.attrs, strict=False)})

    try:
        got = shape(t)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None if tuple(got.shape) == tuple(want) else f"makes {list(got.shape)}, not {list(want)}"


def _placed_problem(dist: Dist, placements: tuple[Placement, ...], shape_of: Callable[[int], tuple[Any, ...]],
                    want: tuple[Any, ...]) -> str | None:
    from refine.frontends import graphfile
    from refine.ir.errors import InputError

    try:
        got = graphfile._placed_shape(graphfile._Ctx("reduced"), dist.mesh, placements, shape_of, "", "pieces")
    except InputError as e:
        return str(e)
    return None if tuple(got) == tuple(want) else f"the pieces make {list(got)}, not {list(want)}"
