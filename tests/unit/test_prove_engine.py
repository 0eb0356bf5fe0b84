"""The engine proves a repeated layer once: steps whose e-graph programs differ only in
tensor names reuse the first result, renamed (and refine/prove/reuse.py replays a step whose
premises, renamed, hold: tests/unit/test_prove_reuse.py, tests/corpus/test_reuse.py)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

from refine.check import check_files, engine_for
from refine.frontends.build import GraphBuilder, dist_doc, seq_doc, write_case
from refine.ops.registry import load_registry
from refine.prove import engine as prove
from refine.prove import walk
from refine.prove.policy import DEFAULT


def _stacked_tp_mlp(tmp_path: Path, layers: int, world: int = 2, bug_layer: int | None = None) -> tuple[Path, Path]:
    T, H, F = 4, 8, 16
    s = GraphBuilder()
    x = s.input("x", [T, H])
    ws = [(s.input(f"w1_{i}", [H, F], role="parameter"), s.input(f"w2_{i}", [F, H], role="parameter"))
          for i in range(layers)]
    for i, (w1, w2) in enumerate(ws):
        h = s.op("gelu", s.op("matmul", x, w1, name=f"fc1_{i}"), name=f"act_{i}", approximate="none")
        x = s.op("matmul", h, w2, name=f"fc2_{i}")
    s.output("y", x)
    ranks = {}
    for r in range(world):
        d = GraphBuilder()
        x_ = d.input("x", [T, H])
        for i in range(layers):
            w1 = d.input(f"w1_{i}", [H, F // world], role="parameter")
            w2 = d.input(f"w2_{i}", [F // world, H], role="parameter")
            h = d.op("gelu", d.op("matmul", x_, w1, name=f"fc1_{i}"), name=f"act_{i}", approximate="none")
            p = d.op("matmul", h, w2, name=f"fc2_{i}")
            x_ = p if i == bug_layer else d.op("all_reduce", p, name=f"sum_{i}", reduce_op="sum", group=list(range(world)))
        d.output("y", x_)
        ranks[r] = d
    rel = [{"from": "x", "placements": ["Replicate"]}]
    for i in range(layers):
        rel += [{"from": f"w1_{i}", "placements": ["Shard(1)"]}, {"from": f"w2_{i}", "placements": ["Shard(0)"]}]
    write_case(tmp_path, seq_doc(s), dist_doc({"tp": world}, ranks, rel, [{"output": "y", "placements": ["Replicate"]}]))
    return tmp_path / "seq.json", tmp_path / "dist.json"


def test_repeated_layers_are_proven_once(tmp_path: Path) -> None:
    engine = engine_for(load_registry())
    before = engine.stats["reused"] + engine.stats["replayed"]
    report = check_files(*_stacked_tp_mlp(tmp_path, layers=4))
    assert report.refines, str(report)
    # layers 2..4 repeat layer 1's steps (the first layer's input is a sequential input,
    # later ones a rank all_reduce, so layer 2 is new too; from layer 3 on all is reused:
    # from the step cache, or replayed without an e-graph, refine/prove/reuse.py)
    assert engine.stats["reused"] + engine.stats["replayed"] - before >= 2 * 3


def test_a_bug_in_a_repeated_layer_is_still_found(tmp_path: Path) -> None:
    report = check_files(*_stacked_tp_mlp(tmp_path, layers=4, bug_layer=2))
    assert not report.refines
    assert report.culprit is not None and report.culprit.node == "fc1_3", str(report)


def test_early_stop_keeps_the_relations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step stopped early (Policy.patience: a plain best term that no longer gets cheaper)
    proves what the whole iteration bound proves, with fewer rule matches: over 8 ranks
    (balanced concats of 8 pieces) the relations and the verdict are the same."""
    seq, dist = _stacked_tp_mlp(tmp_path, layers=2, world=8)
    registry = load_registry()
    seen = {}
    for early in (False, True):
        engine = prove.Engine(registry)  # its own step cache: nothing reused across the modes
        if not early:  # every step runs the whole iteration bound
            saturate = engine._saturate
            monkeypatch.setattr(engine, "_saturate", lambda iterations, early, eg, s=saturate: s(iterations, False, eg))
        monkeypatch.setattr(sys.modules["refine.check"], "engine_for", lambda reg, symbolic=False, features=frozenset(), policy=DEFAULT, e=engine: e)
        report = check_files(seq, dist)
        assert report.refines, str(report)
        seen[early] = ([(o.name, o.relation) for o in report.outputs], sum(engine.fired.values()))
    assert seen[True][0] == seen[False][0]
    assert seen[True][1] < seen[False][1]


def test_counterparts_are_offered_within_their_depth() -> None:
    """A rank counterpart found at one node is offered to the nodes up to Policy.counterpart_depth
    uses downstream (through any input, at the nearest distance) and to none further: kept
    for every later step, each layer's made every later frontier larger."""
    from refine.ir.graph import Node, TensorType

    t = TensorType([2], "float32")
    chain = [Node(f"n{i}", "exp", [f"n{i - 1}"] if i else ["x"], {}, t) for i in range(DEFAULT.counterpart_depth + 2)]
    offered: dict[str, dict[str, int]] = {"n0": {"c@0": DEFAULT.counterpart_depth}}
    for n in chain[1:]:
        offered[n.name] = walk._offered_to(n, offered)
    reached = [n.name for n in chain[1:] if "c@0" in offered[n.name]]
    assert reached == [f"n{i}" for i in range(1, DEFAULT.counterpart_depth + 1)]
    # a node with a near and a far input gets the nearer one's distance
    join = Node("j", "add", ["n1", f"n{DEFAULT.counterpart_depth}"], {}, t)
    assert walk._offered_to(join, offered) == {"c@0": DEFAULT.counterpart_depth - 2}


def test_shape_audit_finds_a_class_with_two_shapes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`shape` keeps its first value when two classes are joined (:merge old), so a join of
    tensors of different shapes (a false equality or a wrong shape rule) passed silently;
    the audit (REFINE_SHAPE_AUDIT=1) raises on one, and stays quiet on a sound check."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the conflicting program is written
    registry = load_registry()
    engine = prove.Engine(registry, audit_shapes=True)
    program = "\n".join(['(set (shape (D "a")) (vec-of 2 3))', '(set (shape (D "b")) (vec-of 3 2))',
                         '(let $__seq (transpose (D "a") 0 1))', "(let $__mark (Mark $__seq))",
                         '(union (D "b") (D "a"))'])
    with pytest.raises(prove.ShapeConflict, match="two shapes"):
        engine._solve(program, [])
    engine._solve(program.replace("(vec-of 3 2)", "(vec-of 2 3)"), [])  # equal shapes: quiet
    monkeypatch.setattr(sys.modules["refine.check"], "engine_for", lambda reg, symbolic=False, features=frozenset(), policy=DEFAULT, e=engine: e)
    assert check_files(*_stacked_tp_mlp(tmp_path, layers=2)).refines
