"""A term one rank sums into its piece of a reduction over ranks that it should not, found by
dropping terms and running the rank programs (refine.verdict.terms): a family of small
tensor-parallel gradient norms written by hand. The sequential step scales x by the 2-norm of
(w, b); w is sharded by rows over 2 ranks, b replicated. Each rank takes the norm of its
shard of w (f.py:1), rank 0 also b's (f.py:2), stacks them and sums their squares (f.py:3),
the ranks all-reduce the sums (f.py:4) and scale x by the root (f.py:5); the sequence scales x by the norm of the stacked norms,
as clip_grad_norm_ does.
Captured programs of the family: models/capture/clip_norm.py's twins (shard_listed_twice,
bias_counted_on_two_ranks, shard_left_out; tests/cases/test_capture_twins.py) and the zoo's
pipeline tied_norm_counted_twice (tests/cases/test_zoo.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from refine.check import check_files
from refine.frontends.graphfile import load_dist, load_seq
from refine.ir.graph import Dist, Graph
from refine.ops.registry import load_registry
from refine.verdict.terms import wrong_term
from tests.helpers import graph_node as _node

REG = load_registry()


def _norm_of(names: list[str], source: str, total: str = "t") -> list[dict[str, Any]]:
    """The squared 2-norm of the norms `names` (scalars), as get_total_norm(...) ** 2 makes it."""
    ups = [_node(f"u{i}", "unsqueeze", [x], [1], source, dim=0) for i, x in enumerate(names)]
    return [*ups, _node("cat", "concat", [u["name"] for u in ups], [len(ups)], source, dim=0),
            _node("n", "linalg_vector_norm", ["cat"], [], source),
            _node(total, "pow", ["n", 2], [], source)]


def _case(tmp: Path, ranks: dict[int, list[str]], lines: dict[int, str] | None = None) -> tuple[Path, Path]:
    """Rank r sums the squares of the norms `ranks[r]` (of "nw": its shard of w, "nb": b's),
    on line `lines[r]` (default f.py:3)."""
    seq = {"format": "refine-graph", "version": 1, "kind": "sequential", "graph": {
        "inputs": [{"name": "w", "shape": [4, 3], "role": "parameter"}, {"name": "b", "shape": [3], "role": "parameter"},
                   {"name": "x", "shape": [3], "role": "data"}],
        "nodes": [_node("nw", "linalg_vector_norm", ["w"], []), _node("nb", "linalg_vector_norm", ["b"], []),
                  *_norm_of(["nw", "nb"], "g.py:1")[:-1], _node("y", "mul", ["x", "n"], [3])],
        "outputs": [{"name": "y", "ref": "y", "role": "activation"}]}}

    def rank(r: int) -> dict[str, Any]:
        return {"inputs": [{"name": "w", "shape": [2, 3], "role": "parameter"},
                           {"name": "b", "shape": [3], "role": "parameter"}, {"name": "x", "shape": [3], "role": "data"}],
                "nodes": [_node("nw", "linalg_vector_norm", ["w"], [], "f.py:1"),
                          _node("nb", "linalg_vector_norm", ["b"], [], "f.py:2"),
                          *_norm_of(ranks[r], (lines or {}).get(r, "f.py:3")),
                          _node("s", "all_reduce", ["t"], [], "f.py:4", reduce_op="sum", group=[0, 1]),
                          _node("root", "pow", ["s", 0.5], [], "f.py:5"), _node("y", "mul", ["x", "root"], [3], "f.py:5")],
                "outputs": [{"name": "y", "ref": "y", "role": "activation"}]}

    dist = {"format": "refine-graph", "version": 1, "kind": "distributed", "mesh": {"axes": [{"name": "tp", "size": 2}]},
            "ranks": [{"rank": r, "graph": rank(r)} for r in (0, 1)],
            "relations": [{"from": "w", "placements": ["Shard(0)"]}, {"from": "b", "placements": ["Replicate"]},
                          {"from": "x", "placements": ["Replicate"]}],
            "expectations": [{"output": "y", "local": "y", "placements": ["Replicate"]}]}
    (tmp / "seq.json").write_text(json.dumps(seq))
    (tmp / "dist.json").write_text(json.dumps(dist))
    return tmp / "seq.json", tmp / "dist.json"


def _loaded(paths: tuple[Path, Path]) -> tuple[Graph, Dist]:
    seq = load_seq(paths[0], REG)
    return seq, load_dist(paths[1], REG, seq)


RIGHT = {0: ["nw", "nb"], 1: ["nw"]}


def test_the_right_norm_refines_and_no_term_is_blamed(tmp_path: Path) -> None:
    paths = _case(tmp_path, RIGHT)
    assert check_files(*paths).verdict == "REFINES"
    assert wrong_term(*_loaded(paths), REG, ["y"]) is None  # dropping any term breaks it


def test_a_replicated_term_counted_on_two_ranks_is_named_at_its_sum(tmp_path: Path) -> None:
    """b's squares summed on both ranks (Megatron-LM #7227's kind): either copy dropped makes
    the output right, and both are summed on one line, which is named."""
    paths = _case(tmp_path, {0: ["nw", "nb"], 1: ["nw", "nb"]})
    found = wrong_term(*_loaded(paths), REG, ["y"])
    assert found is not None and found.source == "f.py:3" and found.twin is not None, found
    assert found.reduction_source == "f.py:4", found
    report = check_files(*paths)  # (localize's partial-sum rule names that line first)
    assert report.verdict == "DOES NOT REFINE" and report.culprit is not None, report
    assert report.culprit.rank_source == "f.py:3", report


def test_a_term_summed_twice_on_one_rank_is_named(tmp_path: Path) -> None:
    paths = _case(tmp_path, {0: ["nw", "nb"], 1: ["nw", "nw"]})
    found = wrong_term(*_loaded(paths), REG, ["y"])
    assert found is not None and (found.rank, found.source) == (1, "f.py:3"), found
    assert found.twin == (1, found.term), found
    report = check_files(*paths)
    assert report.verdict == "DOES NOT REFINE" and report.culprit is not None, report
    assert report.culprit.rank_source == "f.py:3" and "counted twice" in report.culprit.reason, report


def test_two_copies_summed_on_two_lines_name_nothing(tmp_path: Path) -> None:
    """Rank 1 sums b's squares on its own line (f.py:6): either copy's line may be the bug, so
    neither is named."""
    paths = _case(tmp_path, {0: ["nw", "nb"], 1: ["nw", "nb"]}, lines={1: "f.py:6"})
    assert wrong_term(*_loaded(paths), REG, ["y"]) is None


def test_a_term_counted_three_times_names_nothing(tmp_path: Path) -> None:
    """b's squares summed once on rank 0 and twice on rank 1: no single term dropped repairs
    the norm (two copies stay), so the search names nothing."""
    paths = _case(tmp_path, {0: ["nw", "nb"], 1: ["nw", "nb", "nb"]})
    assert wrong_term(*_loaded(paths), REG, ["y"]) is None


def test_a_wrong_or_left_out_term_is_not_named_by_dropping(tmp_path: Path) -> None:
    """Nothing to drop repairs a wrong term (rank 1 sums b's squares instead of its shard's) or
    one missing from every sum (b left out): the search names nothing."""
    assert wrong_term(*_loaded(_case(tmp_path, {0: ["nw", "nb"], 1: ["nb"]})), REG, ["y"]) is None
    (tmp_path / "b").mkdir()
    assert wrong_term(*_loaded(_case(tmp_path / "b", {0: ["nw"], 1: ["nw"]})), REG, ["y"]) is None
