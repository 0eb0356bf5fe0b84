"""Relations read each rank element for one sequential element only.

A relation says what a sequential input is, as an expression over rank tensors. If one
element of a rank tensor stood for two sequential elements (`cat(w@0, w@0)`, overlapping
slices of it, a slice and the whole of it, or two relations reading it), the relations
would hold only for sequential inputs whose elements agree there: the prover would take
two independent inputs (or halves of one) as equal, and a verdict would cover only such
inputs. Such relations are refused.

A rank element may be read more than once for the same sequential element: the replicas of a
relation (the same tensor held by other ranks, or the same rank's tensor read by each replica
at the same place) state equalities of rank tensors only. A define (`refine.ir.graph.Define`)
gives a rank input from sequential inputs and may repeat a region of them (copies of a KV
head): that also constrains the ranks only, and is not looked at here.

Each read is a box of a rank tensor (an interval per dim, symbolic sizes compared by proof,
`refine.ir.sizes`) with the map that places it in the sequential tensor: a translation and a
permutation of dims through cat, slice and transpose. Under any other op (a view) the map
is opaque: two reads of it are the same only if the path to them is. When a comparison is
not proven, the reads are taken to overlap and to map differently: refused, never assumed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from refine.ir import sizes
from refine.ir.term import LEAF_OPS, NARY, Term

Box = tuple[tuple[Any, Any], ...]  # [start, end) per dim
# per dim of a term, (dim of the sequential tensor, offset): seq[dim] = coord + offset;
# or ("opaque", path) when an op between the root and the term does not place elements
Map = tuple[Any, ...]


@dataclass(frozen=True)
class Read:
    leaf: str  # the rank tensor, "name@rank"
    box: Box  # the part of it read
    place: Map  # where that part goes in the sequential tensor
    claim: int  # which relation
    term: int  # which of its terms (the layout, or a replica)


def reads(t: Term, shape_of: Callable[[Term], tuple[Any, ...]], claim: int = 0, term: int = 0) -> list[Read]:
    """Every rank tensor region term `t` reads, with where it puts it. ValueError when the
    term does not let the sequential tensor take every value (a scale by 0)."""
    shape = shape_of(t)
    out: list[Read] = []
    _walk(t, tuple((0, s) for s in shape), tuple((d, 0) for d in range(len(shape))), shape_of, claim, term, out)
    return out


def _walk(t: Term, box: Box, place: Map, shape_of: Callable[[Term], tuple[Any, ...]], claim: int, term: int,
          out: list[Read]) -> None:
    if any(sizes.le(hi, lo) for lo, hi in box):
        return  # reads nothing
    if t.op in LEAF_OPS:
        out.append(Read(t.attrs[0], box, place, claim, term))
        return
    opaque = place[:1] == ("opaque",)
    if t.op == "slice":
        d, s, _ = t.attrs
        sub = _shift(box, d, s)
        _walk(t.args[0], sub, _path(place, t, 0) if opaque else _move(place, d, -s), shape_of, claim, term, out)
        return
    if t.op == "cat":
        (d,) = t.attrs
        at: Any = 0
        for i, a in enumerate(t.args):
            size = shape_of(a)[d]
            sub = _clip(box, d, at, size)
            if sub is not None:
                _walk(a, sub, _path(place, t, i) if opaque else _move(place, d, at), shape_of, claim, term, out)
            at = sizes.add(at, size)
        return
    if t.op == "transpose":
        i, j = t.attrs
        sub = _swap(box, i, j)
        _walk(t.args[0], sub, _path(place, t, 0) if opaque else _swap(place, i, j), shape_of, claim, term, out)
        return
    if t.op in NARY or t.op == "Scale":
        # each term of a sum (a partial placement) puts its elements where the sum does; a
        # scale by 0 reads nothing, so the sequential tensor would have to be zero there
        if t.op == "Scale" and t.attrs[0] == 0:
            raise ValueError("a scale by 0 makes the sequential tensor zero whatever the ranks hold")
        for a in t.args:
            _walk(a, box, place, shape_of, claim, term, out)
        return
    # a view (or anything else) does not place elements by a translation: read all of its
    # argument, placed by the path that leads there
    for i, a in enumerate(t.args):
        whole = tuple((0, s) for s in shape_of(a))
        _walk(a, whole, _path(place, t, i), shape_of, claim, term, out)


def _path(place: Map, t: Term, i: int) -> Map:
    """An opaque place, one step further (the path names the op, its attributes and the argument)."""
    prefix = place[1] if place[:1] == ("opaque",) else (repr(place),)
    return ("opaque", (*prefix, (t.op, t.attrs, i)))


def _shift(box: Box, d: int, s: Any) -> Box:
    return tuple((sizes.add(lo, s), sizes.add(hi, s)) if k == d else (lo, hi) for k, (lo, hi) in enumerate(box))


def _move(place: Map, d: int, by: Any) -> Map:
    """The place of an argument at `by` along dim d of the term (a term coordinate is the
    argument's plus `by`): its offset grows by `by`."""
    return tuple((sd, sizes.add(off, by)) if k == d else (sd, off) for k, (sd, off) in enumerate(place))


def _swap(xs: tuple[Any, ...], i: int, j: int) -> tuple[Any, ...]:
    out = list(xs)
    out[i], out[j] = out[j], out[i]
    return tuple(out)


def _clip(box: Box, d: int, at: Any, size: Any) -> Box | None:
    """The part of `box` that falls in a concat's piece [at, at + size) along d, in the
    piece's coordinates; None when provably none does. An unproven bound keeps the piece's
    own (a larger box: conservative)."""
    lo, hi = box[d]
    end = sizes.add(at, size)
    if sizes.le(hi, at) or sizes.le(end, lo):
        return None
    new_lo = sizes.sub(lo, at) if sizes.le(at, lo) else 0
    new_hi = sizes.sub(hi, at) if sizes.le(hi, end) else size
    return tuple((new_lo, new_hi) if k == d else b for k, b in enumerate(box))


def _disjoint(a: Box, b: Box) -> bool:
    return any(sizes.le(h1, l2) or sizes.le(h2, l1) for (l1, h1), (l2, h2) in zip(a, b, strict=True))


def _same_place(a: Read, b: Read) -> bool:
    if len(a.place) != len(b.place):
        return False
    if a.place[:1] == ("opaque",) or b.place[:1] == ("opaque",):
        return a.place == b.place
    return all(x[0] == y[0] and sizes.eq(x[1], y[1]) for x, y in zip(a.place, b.place, strict=True))


def conflict(all_reads: list[Read]) -> tuple[Read, Read] | None:
    """Two reads of one rank element that stand for different sequential elements (or any
    two reads of it within one term), or None."""
    by_leaf: dict[str, list[Read]] = {}
    for r in all_reads:
        by_leaf.setdefault(r.leaf, []).append(r)
    for group in by_leaf.values():
        for i, a in enumerate(group):
            for b in group[i + 1:]:
                if _disjoint(a.box, b.box):
                    continue
                if a.claim != b.claim or a.term == b.term or not _same_place(a, b):
                    return a, b
    return None


def show_box(r: Read) -> str:
    return f"{r.leaf}[{', '.join(f'{lo}:{hi}' for lo, hi in r.box)}]"
