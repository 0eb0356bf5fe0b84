"""The walk starts from a frozen program (refine.prove.walk.settle): what it learns (tensors a
step found equal, opaque leaves of unclean nodes) goes in its own view of the program, so
the program says the same to every walk, in any order."""

from __future__ import annotations

import pytest

from refine.check import engine_for
from refine.frontends.graphfile import load_dist, load_seq
from refine.ir.term import leaf
from refine.ops.lower import lower
from refine.ops.registry import load_registry
from refine.prove.walk import infer, settle
from refine.relate.program import build_program, seq_input_relations
from tests.helpers import MODELS

REG = load_registry()


@pytest.mark.parametrize("case", ["tp_attention", "sp_mlp_bug_gather_wrong_dim"])
def test_walks_leave_the_frozen_program_as_it_was(case: str) -> None:
    seq = load_seq(MODELS / case / "seq.json", REG)
    dist = load_dist(MODELS / case / "dist.json", REG, seq)
    core, _ = lower(seq, REG)
    prog, _ = build_program(dist, REG, "dist")
    inputs = seq_input_relations(dist, seq, prog, REG, "dist")
    engine = engine_for(REG)
    settle(prog, engine, REG)
    assert prog.frozen
    classes = {x: prog.same.find(x) for x in prog.types}
    first = infer(core, inputs, prog, engine, REG)
    second = infer(core, inputs, prog, engine, REG)
    assert {x: prog.same.find(x) for x in prog.types} == classes and not prog.opaque
    assert first.relations == second.relations and first.clean == second.clean
    assert first.program is not prog and first.program.opaque == second.program.opaque
    with pytest.raises(RuntimeError, match="frozen"):
        prog.same.union(*sorted(prog.types)[:2])
    with pytest.raises(RuntimeError, match="frozen"):
        prog.add_fact(leaf("a@0"), leaf("a@1"))
    # an unclean node's users saw an opaque leaf: recorded in the walk's view only
    assert all(first.clean.values()) or first.program.opaque
