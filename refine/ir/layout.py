"""Relation layouts as terms: what a placement denotes, and what two replicas of a layout
say about the rank tensors they read.

`placed_terms`: rank tensors placed along a mesh (each axis Shard, Replicate or Partial)
make the term that concatenates the shards and sums (or takes the max or the mean of) the
partial values, one term per choice of coordinates along the replicated axes (all of them
must be equal). The interpreter, relating, the expectations and the oracles all read
placements through it.

A relation's `replicas` (refine.ir.graph.Relation) are more copies of its layout: the same
expression over other ranks' tensors, equal in value to it. That makes two leaves equal as
whole tensors only where each appears whole in its expression, reached through ops that
determine their operands from their result (a concat of pieces of equal shapes, a view, a
transpose). Under a slice only the sliced region is known: `slice(w@0, 0, 0, 2)` and
`slice(w@1, 0, 0, 2)` equal say nothing of the rows after 2, which each rank may use for
something else (its own query heads next to a replicated KV head). Those equalities are
kept as facts between the subterms, never as a union of the whole tensors (`join_replicas`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from fractions import Fraction

from refine.ir.graph import Mesh, Placement
from refine.ir.term import Term, cat, leaf, nary, scale


def placed_terms(name_at: Callable[[int], str], placements: tuple[Placement, ...], mesh: Mesh) -> list[Term]:
    """The tensor that rank tensors `name_at(r)` placed this way make: one term for each
    choice of coordinates along the replicated axes (all of them must be equal)."""
    rep_axes = [i for i, p in enumerate(placements) if p.kind == "replicate"]
    out = []
    for choice in itertools.product(*(range(mesh.axes[i][1]) for i in rep_axes)):
        fixed = dict(zip(rep_axes, choice, strict=True))

        def build(axis: int, coords: tuple[int, ...], fixed: dict[int, int] = fixed) -> Term:
            if axis == len(mesh.axes):
                return leaf(name_at(mesh.rank(coords)))
            if axis in fixed:
                return build(axis + 1, coords + (fixed[axis],))
            p = placements[axis]
            parts = [build(axis + 1, coords + (c,)) for c in range(mesh.axes[axis][1])]
            if p.kind == "shard":
                return cat(parts, p.dim)  # type: ignore[arg-type]
            if p.reduce == "avg":  # the mean of the ranks' values (only the checker's default asks this),
                # as the sum of the scaled values: the form the rules distribute a scale into
                return nary("Sum", [scale(x, Fraction(1, len(parts))) for x in parts])
            return nary("Max" if p.reduce == "max" else "Sum", parts)

        out.append(build(0, ()))
    return out


# ops whose result determines their operands, given the operands' shapes
_INJECTIVE = frozenset({"cat", "view", "transpose"})


def join_replicas(a: Term, b: Term, shape_of: Callable[[Term], tuple[object, ...]]
                  ) -> tuple[list[tuple[str, str]], list[tuple[Term, Term]]]:
    """Split `a == b` (structurally parallel terms) into whole rank tensors that are equal
    (leaf name pairs) and equalities of subterms that only hold of parts (facts)."""
    leaves: list[tuple[str, str]] = []
    facts: list[tuple[Term, Term]] = []

    def go(x: Term, y: Term) -> None:
        if x == y:
            return
        if x.op == "D" and y.op == "D":
            if shape_of(x) == shape_of(y):
                leaves.append((x.attrs[0], y.attrs[0]))
            else:  # no whole-tensor equality between different shapes (a refused layout, really)
                facts.append((x, y))
            return
        if (x.op in _INJECTIVE and x.op == y.op and x.attrs == y.attrs and len(x.args) == len(y.args)
                and all(shape_of(p) == shape_of(q) for p, q in zip(x.args, y.args, strict=True))):
            for p, q in zip(x.args, y.args, strict=True):
                go(p, q)
            return
        facts.append((x, y))

    go(a, b)
    return leaves, facts + _coalesce(facts)


def _coalesce(facts: list[tuple[Term, Term]]) -> list[tuple[Term, Term]]:
    """Facts between adjacent slices of the same two tensors, joined: the key and value
    columns of a fused weight are two facts, and a rank slices both at once (its k and v
    columns of the QKV product). Equal pieces make an equal concat, so each run of adjacent
    regions is a fact too."""
    runs: dict[tuple[str, str, object], list[tuple[int, int]]] = {}
    for x, y in facts:
        if x.op == y.op == "slice" and x.attrs == y.attrs and x.args[0].op == y.args[0].op == "D":
            dim, start, end = x.attrs
            if isinstance(start, int) and isinstance(end, int):
                runs.setdefault((x.args[0].attrs[0], y.args[0].attrs[0], dim), []).append((start, end))
    out = []
    for (xa, ya, dim), spans in sorted(runs.items(), key=lambda kv: str(kv[0])):
        spans.sort()
        lo, hi, n = spans[0][0], spans[0][1], 1
        for s, e in spans[1:] + [(-1, -1)]:
            if s == hi:
                hi, n = e, n + 1
                continue
            if n > 1:
                out.append((Term("slice", (Term("D", (), (xa,)),), (dim, lo, hi)),
                            Term("slice", (Term("D", (), (ya,)),), (dim, lo, hi))))
            lo, hi, n = s, e, 1
    return out

