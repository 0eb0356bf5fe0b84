"""A value the ranks make in pieces on lines of their own and never sum, found by setting each
piece to their sum (refine.verdict.missing_reduce.held_apart): a family of small programs
written by hand, a shared weight p whose gradient has one part per rank (a tied embedding's
lookup and head on two pipeline stages). The sequence makes g = u * p + v * p and scales it by
its norm; rank 0 holds u and makes its part on f.py:1, rank 1 holds v and makes its part on
f.py:2 (or both on f.py:1), the ranks all-reduce the parts (f.py:3), then scale by the norm
(f.py:4). Captured: the zoo's pipeline tied_grad_not_reduced (tests/cases/test_zoo.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from refine.check import check_files
from refine.frontends.graphfile import load_dist, load_seq
from refine.ops.registry import load_registry
from refine.verdict.missing_reduce import held_apart
from tests.helpers import graph_node as _node

REG = load_registry()


def _case(tmp: Path, reduced: bool, lines: tuple[str, str] = ("f.py:1", "f.py:2"), scale: float = 1.0
          ) -> tuple[Path, Path]:
    seq = {"format": "refine-graph", "version": 1, "kind": "sequential", "graph": {
        "inputs": [{"name": "p", "shape": [3], "role": "parameter"}, {"name": "u", "shape": [3], "role": "data"},
                   {"name": "v", "shape": [3], "role": "data"}],
        "nodes": [_node("gu", "mul", ["u", "p"], [3]), _node("gv", "mul", ["v", "p"], [3]),
                  _node("g", "add", ["gu", "gv"], [3]), _node("n", "linalg_vector_norm", ["g"], []),
                  _node("y", "mul", ["g", "n"], [3])],
        "outputs": [{"name": "y", "ref": "y", "role": "activation"}]}}

    def rank(r: int) -> dict[str, Any]:
        data = "u" if r == 0 else "v"
        part = [_node("g", "mul", [data, "p"], [3], lines[r])]
        if scale != 1.0:
            part.append(_node("gs", "mul", ["g", scale], [3], lines[r]))
        last = part[-1]["name"]
        if reduced:
            part.append(_node("s", "all_reduce", [last], [3], "f.py:3", reduce_op="sum", group=[0, 1]))
            last = "s"
        return {"inputs": [{"name": "p", "shape": [3], "role": "parameter"},
                           {"name": data, "shape": [3], "role": "data"}],
                "nodes": [*part, _node("n", "linalg_vector_norm", [last], [], "f.py:4"),
                          _node("y", "mul", [last, "n"], [3], "f.py:4")],
                "outputs": [{"name": "y", "ref": "y", "role": "activation"}]}

    dist = {"format": "refine-graph", "version": 1, "kind": "distributed", "mesh": {"axes": [{"name": "pp", "size": 2}]},
            "ranks": [{"rank": r, "graph": rank(r)} for r in (0, 1)],
            "relations": [{"from": "p", "placements": ["Replicate"]}, {"from": "u", "layout": ["u@0"]},
                          {"from": "v", "layout": ["v@1"]}],
            "expectations": [{"output": "y", "local": "y", "placements": ["Replicate"]}]}
    (tmp / "seq.json").write_text(json.dumps(seq))
    (tmp / "dist.json").write_text(json.dumps(dist))
    return tmp / "seq.json", tmp / "dist.json"


def test_the_parts_summed_refine(tmp_path: Path) -> None:
    assert check_files(*_case(tmp_path, reduced=True)).verdict == "REFINES"


def test_parts_made_on_two_lines_and_never_summed_are_named(tmp_path: Path) -> None:
    report = check_files(*_case(tmp_path, reduced=False))
    assert report.verdict == "DOES NOT REFINE" and report.culprit is not None, report
    c = report.culprit
    assert c.rank_source == "f.py:1" and "no collective sums" in c.reason and "f.py:2" in c.reason, report
    seq = load_seq(tmp_path / "seq.json", REG)
    found = held_apart(seq, load_dist(tmp_path / "dist.json", REG, seq), REG, ["y"], {0: "g.mul_t", 1: "g.mul_t"})
    assert found is not None and found.sources == {0: "f.py:1", 1: "f.py:2"}, found


def test_parts_made_on_one_line_are_named_by_the_line_search(tmp_path: Path) -> None:
    """The same line on both ranks: the line-based search (missing_reduce) names it first."""
    report = check_files(*_case(tmp_path, reduced=False, lines=("f.py:1", "f.py:1")))
    assert report.verdict == "DOES NOT REFINE" and report.culprit is not None, report
    assert report.culprit.rank_source == "f.py:1", report


def test_parts_wrong_as_well_are_not_named_by_summing(tmp_path: Path) -> None:
    """Parts never summed and scaled wrong: their sum repairs nothing, so held_apart names
    nothing, and the report does not claim a missing reduction."""
    paths = _case(tmp_path, reduced=False, scale=3.0)
    seq = load_seq(paths[0], REG)
    dist = load_dist(paths[1], REG, seq)
    for piece in ("g.mul_t", "gs.Scale"):  # the core nodes: each part, and each part scaled
        assert held_apart(seq, dist, REG, ["y"], {0: piece, 1: piece}) is None
    report = check_files(*paths)
    assert report.verdict == "DOES NOT REFINE", report
    assert report.culprit is None or "no collective sums" not in report.culprit.reason, report
