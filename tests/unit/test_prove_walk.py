"""The walk starts from a frozen program (refine.prove.walk.settle): what it learns (tensors a
step found equal, opaque leaves of unclean nodes) goes in its own view of the program, so
the program says the same to every walk, in any order."""

from __future__ import annotations

from pathlib import Path

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


def _positions_case(tmp_path: Path, scale: float) -> tuple[Path, Path]:
    """x * float(arange(S)) with x's rows sharded: the positions are computed from constants
    alone, on every rank alike (a rotary table's `arange().float()`); a rank that scales
    them by `scale` computes something else."""
    from refine.frontends.build import GraphBuilder, dist_doc, seq_doc, write_case

    rows, S, world = 4, 6, 2

    def program(g: GraphBuilder, n: int, k: float) -> None:
        x = g.input("x", [n, S])
        pos = g.op("cast", g.op("arange", end=S), dtype="float32")
        if k != 1:
            pos = g.op("mul", pos, k)
        g.output("y", g.op("mul", x, g.op("expand", g.op("reshape", pos, shape=[1, S]), shape=[n, S])))

    s = GraphBuilder()
    program(s, rows, 1)
    ranks = {}
    for r in range(world):
        ranks[r] = GraphBuilder()
        program(ranks[r], rows // world, scale)
    write_case(tmp_path, seq_doc(s), dist_doc({"dp": world}, ranks, [{"from": "x", "placements": ["Shard(0)"]}],
                                             [{"output": "y", "placements": ["Shard(0)"]}]))
    return tmp_path / "seq.json", tmp_path / "dist.json"


def test_a_tensor_of_constants_alone_is_its_own_relation(tmp_path: Path) -> None:
    from refine.check import check_files

    assert check_files(*_positions_case(tmp_path / "right", 1)).verdict == "REFINES"
    wrong = check_files(*_positions_case(tmp_path / "wrong", 2.0))
    assert wrong.verdict == "DOES NOT REFINE", str(wrong)
