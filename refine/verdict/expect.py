"""What the rank outputs must make for each sequential output, as terms over rank outputs.

An output's expectation (`refine.ir.graph.Expectation`) is either an explicit layout (terms
over `output@rank` names, each equal to the output) or a placement of a rank output on the
mesh (`refine.ir.layout.placed_terms`). Without one, an output every rank makes under its
own name is expected replicated. The checker proves the output's relation equal to these
terms; the oracles evaluate them and compare.
"""

from __future__ import annotations

from collections.abc import Collection

from refine.ir.graph import Dist, Placement
from refine.ir.layout import placed_terms
from refine.ir.term import Term


def expected_terms(dist: Dist, output: str, rank_outputs: Collection[str] = ()) -> list[Term]:
    """What the rank outputs must make for sequential output `output`: its explicit
    expectation's terms (leaves `name@rank`), or, with none, the rank outputs of the same
    name replicated when `rank_outputs` holds one on every rank; else no term."""
    for e in dist.expectations:
        if e.output == output and e.layout is not None:
            return list(e.layout)
        if e.output == output:
            local = e.local or output
            return placed_terms(lambda r, local=local: f"{local}@{r}", e.placements or (), dist.mesh)
    if all(f"{output}@{r}" in rank_outputs for r in dist.ranks):
        rep = tuple(Placement("replicate") for _ in dist.mesh.axes)
        return placed_terms(lambda r: f"{output}@{r}", rep, dist.mesh)
    return []
