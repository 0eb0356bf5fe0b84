"""Shape reduction: the same programs at small sizes, for a counterexample search on programs
too large to evaluate (TrainVerify reduces shapes before it runs its solver; this is our own
take on it).

A concrete case names its sizes as plain integers: a hidden size 1536, a sequence 1024, a
vocabulary 98304 and what the programs derive from them (1536/2 on a rank, 3*48 for fused
QKV heads, 32*1024 rows after a view). `reduce_sizes` reads every size the two programs hold
(tensor shapes, size-valued attributes, the bounds in layouts and defines), writes each as
a small rational constant times a product of powers of a few *bases* (with base 16: 48 =
3*16, 1024 = 4*16^2, 98304 = 24*16^3), maps each base to a small value and rewrites every
size through the same map. The exponents are chosen (Z3) so that what the programs rely on
keeps: a view's runs of dims with equal products keep equal exponents, and so do the terms
of a sum (a concat, a slice from an offset) and a dim and its shard (mesh sizes are never
reduced). Then the rewritten programs go through the loader's checks again: each op's shape
rule must accept the new attributes and give the rewritten shape; relations, layouts,
expectations, defines and collectives must type-check. Any failure, and there is no
reduction (`try_reduce` says why: a conflict names the relations, from Z3's unsat core).

The map is by value: every occurrence of a size maps alike. A value that plays two roles
which must scale differently blocks it (a batch of 8 on 8 ranks where 8 * 1536 = 12288 is
also the vocabulary's shard; 4 as both GQA's repeat and the KV heads per rank): finding
the roles (a symbol per occurrence, unified along the ops' shape rules) is what is left.

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
  that size and is rewritten with it; a multiple of sizes that map differently is refused,
  and so is an index attribute (padding_idx) over a changed size;
- a size above 1 stays above 1 (a dim of 1 broadcasts) and no size grows, and every
  attribute that holds a size is known by its kind (`refine.ops.registry.ATTR_SORTS`: size
  and shape; `ints` lists except the ranks and dims named in `_NOT_SIZES`).
The tests check that correct programs reduced still agree on every draw (bundled-style
families at large sizes, and the corpus's GPT and Qwen2 layers).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import replace
from fractions import Fraction
from typing import Any

from refine.ir.graph import Dist, Graph, Placement, TensorType, value_class
from refine.ir.term import LEAF_OPS, Term
from refine.ops.lower import normalize_attrs
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


Sizes = dict[int, int]


def reduce_sizes(seq: Graph, dist: Dist, registry: Registry, budget: int) -> tuple[Graph, Dist, Sizes] | None:
    """The programs with their large sizes mapped to small ones consistently, and the map
    (original size -> reduced); None when no consistent reduction within `budget`
    elements (`refine.ops.interp.eval_elements`) is found."""
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
    from refine.ops.interp import eval_elements

    values = sorted(collect_sizes(seq, dist, registry))
    reasons: list[str] = []
    maps = list(candidate_maps(values, read_relations(seq, dist, registry), reasons))
    why = reasons[0] if reasons else "no size to reduce"
    for mapping in sorted(maps, key=lambda m: _elements(seq, dist, m)):  # the smallest programs first
        try:
            s, d = rewrite(seq, dist, registry, mapping)
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
        return s, d, {k: v for k, v in mapping.items() if k != v}
    return why


def _elements(seq: Graph, dist: Dist, mapping: Sizes) -> int:
    return sum(math.prod(mapping[d] for d in x.type.shape) for _, g in _graphs(seq, dist) for x in (*g.inputs, *g.nodes))


def apply(seq: Graph, dist: Dist, registry: Registry, mapping: Sizes) -> tuple[Graph, Dist]:
    """The programs rewritten by a map `reduce_sizes` returned (sizes it does not name stay)."""
    sizes = collect_sizes(seq, dist, registry)
    return rewrite(seq, dist, registry, {v: mapping.get(v, v) for v in sizes})


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


def _map_attrs(attrs: dict[str, Any], kinds: Iterable[tuple[str, str]], f: Callable[[int], int]) -> dict[str, Any]:
    out = dict(attrs)
    for name, kind in kinds:
        how, v = _size_attr(name, kind), attrs.get(name)
        if how is None or v is None:
            continue
        if how == "one":
            out[name] = _map_int(v, f)
        else:
            out[name] = [_map_int(x, f) for x in v]
    return out


def _map_int(v: Any, f: Callable[[int], int]) -> Any:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Refused(f"a size attribute holds {v!r}, no integer")
    return v if v < 0 else f(v)  # -1: inferred by a view


def _map_term(t: Term, registry: Registry, f: Callable[[int], int]) -> Term:
    if t.op in LEAF_OPS:
        return t
    args = tuple(_map_term(a, registry, f) for a in t.args)
    op = registry.ops.get(t.op)
    if op is None:
        if t.attrs:
            raise _Refused(f"a relation term's {t.op} has attributes the reduction cannot read")
        return Term(t.op, args, t.attrs)
    attrs = []
    for (name, kind), v in zip(op.attrs, t.attrs, strict=False):
        how = _size_attr(name, kind)
        if how == "one":
            v = _map_int(v, f)
        elif how == "list":
            v = type(v)(_map_int(x, f) for x in v)
        attrs.append(v)
    return Term(t.op, args, (*attrs, *t.attrs[len(attrs):]))


def _graphs(seq: Graph, dist: Dist) -> list[tuple[str, Graph]]:
    return [("seq", seq), *((f"rank {r}", g) for r, g in sorted(dist.ranks.items()))]


def _terms(dist: Dist) -> list[Term]:
    out: list[Term] = []
    for rel in dist.relations:
        if rel.layout is not None:
            out += [rel.layout, *rel.replicas]
    for ex in dist.expectations:
        out += list(ex.layout or ())
    out += [d.term for d in dist.defines]
    return out


def collect_sizes(seq: Graph, dist: Dist, registry: Registry) -> set[int]:
    """Every size the programs hold: shapes, size attributes, sizes in relation terms."""
    out: set[int] = set()
    seen: list[int] = []
    for _, g in _graphs(seq, dist):
        for x in (*g.inputs, *g.nodes):
            out.update(x.type.shape)
        for n in g.nodes:
            _map_attrs(n.attrs, registry.ops[n.op].attrs, lambda v: seen.append(v) or v)
    for t in _terms(dist):
        _map_term(t, registry, lambda v: seen.append(v) or v)
    out.update(seen)
    if any(not isinstance(v, int) for v in out):
        raise _Refused("a size is not an integer")
    return out


# ---------------------------------------------------------------------------------------
# What the programs rely on. A size is written c * prod(base_j ** k_j); the reduced size is
# c * prod(small_j ** k_j). A product the programs rely on (a view merging dims) stays a
# product when the exponents add up across it; a sum (a concat, a slice from an offset) and
# a shard (a dim over the ranks: mesh sizes are never reduced) stay so when their terms have
# the same exponents. The relations are read from the programs' structure, not from op names:
# any node of one tensor argument that keeps its element count and does not just permute its
# dims (a view) relates the runs of dims whose products match; a collective, a relation's or expectation's
# shard relates a dim to its piece; a node whose output dim is the sum of its tensor
# arguments' (a concat), or a start/end pair, makes a sum.


# (products: (lhs, rhs) with prod(lhs) == prod(rhs); sets of sizes that share their
# exponents), each with where it was read first (for the message when they conflict)
Relations = tuple[dict[tuple[tuple[int, ...], tuple[int, ...]], str], dict[frozenset[int], str]]


def read_relations(seq: Graph, dist: Dist, registry: Registry) -> Relations:
    """The products and sums the programs rely on, by where they were read."""
    prods: dict[tuple[tuple[int, ...], tuple[int, ...]], str] = {}
    same: dict[frozenset[int], str] = {}

    def pair(a: int, b: int, where: str) -> None:
        if a != b and a > 1 and b > 1:
            same.setdefault(frozenset((a, b)), where)

    for side, g in _graphs(seq, dist):
        types = {x.name: x.type for x in (*g.inputs, *g.nodes)}
        for n in g.nodes:
            op = registry.ops[n.op]
            where = f"{side} {n.name} ({n.op})"
            ins = [types[a].shape for a in n.tensor_args()]
            out = n.type.shape
            if op.kind == "collective":
                for x in ins[:1]:
                    for a, b in zip(x, out, strict=False):
                        pair(a, b, where)
                continue
            if len(ins) == 1 and math.prod(ins[0]) == math.prod(out) and sorted(ins[0]) != sorted(out):
                for grp in _groups(ins[0], out):  # (dims permuted, a transpose: no product to keep)
                    prods.setdefault(grp, where)
            if len(ins) >= 2 and all(len(x) == len(out) for x in ins):
                for i, o in enumerate(out):
                    parts = [x[i] for x in ins]
                    if sum(parts) == o and len(set(parts + [o])) > 1:
                        same.setdefault(frozenset(v for v in (*parts, o) if v > 1), where)
            start, end = n.attrs.get("start"), n.attrs.get("end")
            kinds = op.attr_kinds()
            if isinstance(start, int) and isinstance(end, int) and start > 0 and \
                    _size_attr("start", kinds.get("start", "")) and _size_attr("end", kinds.get("end", "")):
                same.setdefault(frozenset(v for v in (start, end, end - start) if v > 1), where)
    seq_types = {i.name: i.type for i in seq.inputs}
    outs = {o.name: o.ref for o in seq.outputs}
    shards = [(seq_types[r.source].shape, r.local or r.source, False, f"the relation of {r.source}")
              for r in dist.relations if r.placements]
    shards += [(seq.type_of(outs[e.output]).shape, e.local or e.output, True, f"the expectation of {e.output}")
               for e in dist.expectations if e.placements]
    for whole, local, output, where in shards:
        for g in dist.ranks.values():
            ref = {o.name: o.ref for o in g.outputs}.get(local, local) if output else local
            if ref in g.index():
                for a, b in zip(whole, g.type_of(ref).shape, strict=False):
                    pair(a, b, where)
    return prods, same


def _groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The smallest runs of dims of a and b with equal products (dims of 1 left out), where
    a run is more than one dim on either side."""
    xs, ys = [d for d in a if d != 1], [d for d in b if d != 1]
    out = []
    i = j = 0
    while i < len(xs) and j < len(ys):
        gi, gj = [xs[i]], [ys[j]]
        i, j = i + 1, j + 1
        while math.prod(gi) != math.prod(gj):
            if math.prod(gi) < math.prod(gj) and i < len(xs):
                gi.append(xs[i])
                i += 1
            elif j < len(ys):
                gj.append(ys[j])
                j += 1
            else:
                return out
        if len(gi) > 1 or len(gj) > 1:
            out.append((tuple(sorted(gi)), tuple(sorted(gj))))
    return out


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


def choose_bases(values: list[int], first: int | None = None) -> tuple[int, ...] | None:
    """Bases that write every size (greedy: each next base the one that leaves the least
    cost); `first` fixes the first. None when MAX_BASES do not suffice."""
    big = [v for v in values if v >= MIN_BASE]
    bases: tuple[int, ...] = () if first is None else (first,)
    while True:
        left = [v for v in values if _represent(v, bases) is None]
        if not left:
            return bases
        if len(bases) == MAX_BASES:
            return None
        pool = [v for v in left if v >= MIN_BASE] or big
        if not pool:
            return None
        bases = min(((*bases, b) for b in pool), key=lambda bs: (_cost(values, bs), bs))


def solve_exponents(values: list[int], bases: tuple[int, ...], rels: Relations) -> dict[int, Rep] | str:
    """For each size a way to write it over the bases such that every relation keeps (the
    simplest such, by the total of numerators and denominators: Z3's optimizer), or which
    relations conflict."""
    import z3

    prods, same = rels
    ks: dict[int, list[Any]] = {}
    choice: dict[int, tuple[Any, list[Rep]]] = {}
    hard: list[Any] = []
    cost = []
    for v in values:
        if v <= 1:
            continue
        opts = _options(v, bases)
        if not opts:
            return f"{v} is no small multiple of powers of the bases {list(bases)}"
        ks[v] = [z3.Int(f"k_{v}_{j}") for j in range(len(bases))]
        pick = z3.Int(f"pick_{v}")
        hard.append(z3.And(pick >= 0, pick < len(opts)))
        for i, (_, exps) in enumerate(opts):
            hard.append(z3.Implies(pick == i, z3.And(*(k == e for k, e in zip(ks[v], exps, strict=True)))))
        cost.append(z3.Sum(*(z3.If(pick == i, c.numerator + c.denominator, 0) for i, (c, _) in enumerate(opts))))
        choice[v] = (pick, opts)

    def k(v: int, j: int) -> Any:
        return ks[v][j] if v in ks else 0

    tracked: list[tuple[Any, str]] = []
    for (lhs, rhs), where in prods.items():
        text = f"{' * '.join(map(str, lhs))} = {' * '.join(map(str, rhs))} ({where})"
        tracked.append((z3.And(*(z3.Sum(0, *(k(v, j) for v in lhs)) == z3.Sum(0, *(k(v, j) for v in rhs))
                                 for j in range(len(bases)))), text))
    for group, where in same.items():
        first, *rest = sorted(group)
        text = f"{', '.join(map(str, sorted(group)))} scale alike ({where})"
        tracked.append((z3.And(*(k(first, j) == k(v, j) for v in rest for j in range(len(bases)))), text))
    opt = z3.Optimize()
    opt.set("timeout", 10_000)
    opt.add(*hard, *(c for c, _ in tracked))
    opt.minimize(z3.Sum(0, *cost))
    if opt.check() == z3.sat:
        model = opt.model()
        out: dict[int, Rep] = {v: (Fraction(v), (0,) * len(bases)) for v in values if v <= 1}
        for v, (pick, opts) in choice.items():
            out[v] = opts[model.eval(pick, model_completion=True).as_long()]
        return out
    core = z3.Solver()
    core.set("timeout", 10_000)
    core.add(*hard)
    labels = {z3.Bool(f"rel_{i}"): text for i, (_, text) in enumerate(tracked)}
    for (c, _), label in zip(tracked, labels, strict=True):
        core.assert_and_track(c, label)
    if core.check() != z3.unsat:
        return f"no writing over the bases {list(bases)} found in time"
    names = [labels[z3.Bool(str(x))] for x in core.unsat_core()]
    return (f"over the bases {list(bases)} the sizes cannot all scale (a size plays roles that scale differently): "
            + "; ".join(names[:6]) + (f"; ... {len(names) - 6} more" if len(names) > 6 else ""))


def candidate_maps(values: list[int], rels: Relations = ({}, {}), why: list[str] | None = None
                   ) -> Iterable[Sizes]:
    """Maps size -> reduced size to try: for each choice of bases whose exponents keep the
    relations, the smallest base values that keep every size a positive integer, above 1
    where it was, and no larger than it was (and the next larger, in case the smallest
    degenerates). `why` collects why a choice of bases gave none."""
    big = sorted({v for v in values if v >= MIN_BASE}, key=lambda b: (_cost(values, (b,)), b))
    tried: set[tuple[int, ...]] = set()
    for first in big[:FIRST_BASES]:
        bases = choose_bases(values, first)
        if bases is None or bases in tried:
            continue
        tried.add(bases)
        reps = solve_exponents(values, bases, rels)
        if isinstance(reps, str):
            if why is not None:
                why.append(reps)
            continue
        combos = sorted(itertools.product(BASE_VALUES, repeat=len(bases)), key=lambda bs: (math.prod(bs), bs))
        made = 0
        for small in combos:
            if any(s >= b for s, b in zip(small, bases, strict=True)):
                continue
            mapping = _map_with(reps, small)
            if mapping is not None:
                yield mapping
                made += 1
                if made == 2:
                    break


def _map_with(reps: dict[int, Rep], small: tuple[int, ...]) -> Sizes | None:
    out: Sizes = {}
    for v, (c, exps) in reps.items():
        x = c * math.prod(s ** e for s, e in zip(small, exps, strict=True))
        if x.denominator != 1 or x > v or (v > 1 and x < 2) or (v in (0, 1) and x != v):
            return None
        out[v] = int(x)
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


def rewrite(seq: Graph, dist: Dist, registry: Registry, mapping: Sizes) -> tuple[Graph, Dist]:
    """Both sides with every size v replaced by mapping[v] (raises _Refused where a number
    looks derived from a changed size and only one side holds it)."""
    changed = {v for v, w in mapping.items() if v != w}

    def f(v: int) -> int:
        return mapping[v]

    def typ(t: TensorType) -> TensorType:
        return TensorType(tuple(mapping[d] for d in t.shape), t.dtype)

    def _index_literal(x: int) -> int | None:
        """An integer on integer tensors is index arithmetic: a changed size, or a multiple
        r * v of one with r below the number of ranks (the offset of rank r's shard of a
        vocabulary, r * V/n), is rewritten with it; v a shard's size where one fits."""
        if x in changed:
            return mapping[x]
        fits = [v for v in changed if x % v == 0 and x // v < dist.mesh.size]
        made = {x // v * mapping[v] for v in ([v for v in fits if v in pieces] or fits)}
        if len(made) > 1:  # multiples of sizes that scale differently: which one it is, is unknown
            raise _Refused(f"the integer {x} is a multiple of sizes the reduction maps differently")
        return made.pop() if made else None

    # the sizes of the rank pieces of sharded inputs (along their sharded dims)
    pieces = {dist.ranks[r].type_of(rel.local or rel.source).shape[p.dim]  # type: ignore[index]
              for rel in dist.relations if rel.placements for p in rel.placements if p.kind == "shard"
              for r in dist.ranks if (rel.local or rel.source) in dist.ranks[r].index()}
    held: dict[str, set[Any]] = {}  # literal -> the sides holding it ("seq", "rank")
    where: dict[Any, str] = {}

    def graph(side: str, g: Graph) -> Graph:
        types = {x.name: x.type for x in (*g.inputs, *g.nodes)}
        nodes = []
        for n in g.nodes:
            ints = value_class(n.type.dtype) == "int" or any(value_class(types[a].dtype) == "int"
                                                              for a in n.tensor_args())
            args = list(n.args)
            for i, a in enumerate(args):
                if ints and isinstance(a, int) and not isinstance(a, bool) and (m := _index_literal(abs(a))):
                    args[i] = m * (1 if a > 0 else -1)
            kept = [a for a, b in zip(n.args, args, strict=True) if a is b]
            for name, x in _numbers(replace(n, args=kept), registry):
                if _derived_from(x, changed) is not None:
                    held.setdefault(repr(float(Fraction(x))), set()).add(side)
                    where.setdefault(repr(float(Fraction(x))), f"{n.name} ({n.op}) {name}={x}")
            for name, kind in registry.ops[n.op].attrs:
                v = n.attrs.get(name)
                if kind.rstrip("?") == "int" and _size_attr(name, kind) is None and isinstance(v, int) and \
                        abs(v) >= INDEX_MIN and any(abs(v) % c == 0 and abs(v) // c <= MAX_TERM for c in changed):
                    raise _Refused(f"{side} {n.name} ({n.op}): its {name}={v} is an index over a size the reduction "
                                   "changes")
            nodes.append(replace(n, args=args, attrs=_map_attrs(n.attrs, registry.ops[n.op].attrs, f), type=typ(n.type)))
        return Graph([replace(i, type=typ(i.type)) for i in g.inputs], nodes, list(g.outputs), g.name, {})

    s = graph("seq", seq)
    ranks = {r: graph("rank", g) for r, g in dist.ranks.items()}
    for x, sides in held.items():
        if sides != {"seq", "rank"}:
            one = "the sequential program" if sides == {"seq"} else "the rank programs"
            raise _Refused(f"the number {where[x]} looks derived from a size the reduction changes "
                           f"(size {_derived_from(float(x), changed)}) and only {one} hold it")
    for t in _terms(dist):
        _scales_ok(t, changed)

    def term(t: Term) -> Term:
        return _map_term(t, registry, f)

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
