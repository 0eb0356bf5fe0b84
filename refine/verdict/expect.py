"""What the rank outputs must make for each sequential output, as terms over rank outputs.

An output's expectation (`refine.ir.graph.Expectation`) is either an explicit layout (terms
over `output@rank` names, each equal to the output) or a placement of a rank output on the
mesh (`refine.ir.layout.placed_terms`). An output without one that every rank makes under
its own name must be one of the standard placements of those copies (`expectation_options`:
each mesh axis Replicate, Partial sum, the ranks' mean or Shard(d)); one only some ranks
make must be reconstructible from rank outputs somehow (no term to compare with). The
checker proves the output's relation equal to these terms; the counterexample search and
the oracles evaluate them and compare.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection

from refine.ir.graph import Dist, Placement
from refine.ir.layout import placed_terms
from refine.ir.term import Term


def expectation_options(dist: Dist, output: str, ndim: int, rank_outputs: Collection[str]
                        ) -> list[tuple[tuple[Placement, ...] | None, list[Term]]] | None:
    """The ways the rank outputs may make sequential output `output` (of `ndim` dims), each
    a placement (None for an explicit layout) and the terms (leaves `name@rank`) that must
    all equal the output; the output is right when one option holds. None when nothing
    states what to compare with: no expectation and not every rank makes the output."""
    for e in dist.expectations:
        if e.output == output and e.layout is not None:
            return [(None, list(e.layout))]
        if e.output == output:
            local = e.local or output
            pl = e.placements or ()
            return [(pl, placed_terms(lambda r, local=local: f"{local}@{r}", pl, dist.mesh))]
    if not all(f"{output}@{r}" in rank_outputs for r in dist.ranks):
        return None
    kinds = [Placement("replicate"), Placement("partial"), Placement("partial", reduce="avg"),
             *(Placement("shard", d) for d in range(ndim))]
    return [(pl, placed_terms(lambda r: f"{output}@{r}", pl, dist.mesh))
            for pl in itertools.product(kinds, repeat=len(dist.mesh.axes))]


def expected_terms(dist: Dist, output: str, rank_outputs: Collection[str] = ()) -> list[Term]:
    """What the rank outputs must make for sequential output `output`: its explicit
    expectation's terms (leaves `name@rank`), or, with none, the rank outputs of the same
    name replicated (the first standard placement) when `rank_outputs` holds one on every
    rank; else no term."""
    options = expectation_options(dist, output, 0, rank_outputs)
    return options[0][1] if options else []
