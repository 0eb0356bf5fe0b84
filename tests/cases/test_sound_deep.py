"""Long programs: correct chains of thousands of ops are proven, buggy ones refuted, and
nothing dies of Python's recursion limit (real programs chain thousands of ops).

Each case is a TP2 pair built here: x sharded by rows, every rank runs the same chain on
its rows, an all_gather makes the output. Four shapes of chain: elementwise ops, views
between elementwise ops, matmuls (a weight per layer), and a long sum of terms. The
buggy twin changes one op on rank 1 near the end, so the whole chain lies behind it.
Sizes are chosen so each check takes about a second; `make bench` runs 10^4 ops.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from refine.check import check_files
from refine.frontends.graphfile import load_seq
from refine.ir import graph
from refine.ops.registry import load_registry
from refine.prove.policy import DEFAULT

Doc = dict[str, Any]
KINDS = ("elementwise", "views", "matmuls", "sum")
BUG = {"exp": "relu", "neg": "relu", "add": "sub", "matmul": "mul"}


def _op(kind: str, i: int, rows: int) -> tuple[str, list[str], dict[str, Any], list[int]]:
    """Node i of a chain of `kind` over x[rows, 4]: op, args, attrs, shape."""
    prev = f"n{i - 1}" if i else "x"
    if kind == "elementwise":
        return ("neg" if i % 2 else "exp"), [prev], {}, [rows, 4]
    if kind == "views":  # a view every other op: [rows, 4] <-> [rows/2, 8]
        wide = [rows // 2, 8]
        if i % 2:  # exp and neg in turn, as above: exps alone overflow, and inf on both sides witnesses no bug
            return ("exp" if i % 4 == 1 else "neg"), [prev], {}, wide if i % 4 == 1 else [rows, 4]
        shape = wide if i % 4 == 0 else [rows, 4]
        return "view", [prev], {"shape": shape}, shape
    if kind == "matmuls":  # by a constant matrix (a fixed projection): nothing but the chain is a tensor
        return "matmul", [prev, "w"], {}, [rows, 4]
    # sum: a residual stream, acc + exp(acc) at every other op: a sum of n/2 terms
    if i % 2 == 0:
        return "exp", [prev], {}, [rows, 4]
    return "add", [f"n{i - 2}" if i > 1 else "x", prev], {}, [rows, 4]


def _chain(kind: str, n: int, rows: int, bug_at: int | None = None) -> dict[str, Any]:
    inputs: list[Doc] = [{"name": "x", "shape": [rows, 4]}]
    nodes: list[Doc] = []
    if kind == "matmuls":
        nodes.append({"name": "w", "op": "full", "args": [], "shape": [4, 4], "attrs": {"value": 0.25, "shape": [4, 4]}})
    for i in range(n):
        op, args, attrs, shape = _op(kind, i, rows)
        if bug_at is not None and i >= bug_at and op in BUG:
            op, bug_at = BUG[op], None
            args = [args[0], args[0]] if op == "mul" else args
        nodes.append({"name": f"n{i}", "op": op, "args": args, "shape": shape} | ({"attrs": attrs} if attrs else {}))
    return {"inputs": inputs, "nodes": nodes, "outputs": [{"name": "y", "ref": f"n{n - 1}"}]}


def chain_pair(kind: str, n: int, bug: bool = False) -> tuple[Doc, Doc]:
    head = {"format": "refine-graph", "version": 1}
    seq = head | {"kind": "sequential", "graph": _chain(kind, n, 8)}
    rows, cols = _op(kind, n - 1, 4)[3]
    ranks = []
    for r in range(2):
        g = _chain(kind, n, 4, n - 5 if bug and r == 1 else None)
        g["nodes"].append({"name": "y", "op": "all_gather", "args": [f"n{n - 1}"], "shape": [2 * rows, cols],
                           "attrs": {"dim": 0, "group": [0, 1]}})
        g["outputs"] = [{"name": "y", "ref": "y"}]
        ranks.append({"rank": r, "graph": g})
    relations = [{"from": "x", "placements": ["Shard(0)"]}]
    dist = head | {"kind": "distributed", "mesh": {"axes": [{"name": "tp", "size": 2}]}, "ranks": ranks,
                   "relations": relations, "expectations": [{"output": "y", "placements": ["Replicate"]}]}
    return seq, dist


def _write(tmp_path: Path, seq: Doc, dist: Doc) -> tuple[Path, Path]:
    s, d = tmp_path / "seq.json", tmp_path / "dist.json"
    s.write_text(json.dumps(seq))
    d.write_text(json.dumps(dist))
    return s, d


# 400 elementwise ops: the size the recursion first died at
@pytest.mark.slow
@pytest.mark.parametrize("kind,n", [("elementwise", 400), *((k, 2000) for k in KINDS)])
def test_long_correct_chain_refines(tmp_path: Path, kind: str, n: int) -> None:
    report = check_files(*_write(tmp_path, *chain_pair(kind, n)))
    assert report.refines, str(report)
    assert report.stats["seq_nodes"] >= n


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_long_buggy_chain_does_not_refine(tmp_path: Path, kind: str) -> None:
    n = 2000
    report = check_files(*_write(tmp_path, *chain_pair(kind, n, bug=True)))
    assert not report.refines and report.exit_code == 1
    # the culprit is at the changed op or after it, never in the correct chain before it
    assert report.culprit is not None and int(report.culprit.node[1:]) >= n - 5, str(report)


def test_loading_indexes_each_graph_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's arguments are looked up as it is read: the name index is kept up to date,
    not rebuilt after each node (10^5 nodes took 9 minutes)."""
    rebuilt = []
    reindex = graph.Graph._reindex

    def counted(g: graph.Graph) -> None:
        rebuilt.append(len(g.nodes))
        reindex(g)

    monkeypatch.setattr(graph.Graph, "_reindex", counted)
    s, _ = _write(tmp_path, *chain_pair("elementwise", 3000))
    g = load_seq(s, load_registry())
    assert len(g.nodes) == 3000 and len(rebuilt) <= 1


def test_index_follows_changes_made_elsewhere() -> None:
    t = graph.TensorType((2,))
    g = graph.Graph()
    g.add_input(graph.Input("x", t))
    g.add(graph.Node("a", "neg", ["x"], {}, t))
    assert set(g.index()) == {"x", "a"}
    g.nodes.append(graph.Node("b", "neg", ["a"], {}, t))  # appended without add
    assert g.type_of("b") == t
    g.nodes = [graph.Node("c", "neg", ["x"], {}, t)]  # the list replaced
    assert set(g.index()) == {"x", "c"}
    g.inputs.pop()  # cut
    assert set(g.index()) == {"c"}


def test_term_passed_down_stays_shallow(tmp_path: Path) -> None:
    """Views of a fused value no rank holds pass its term on one op deeper at every node;
    past Policy.term_depth a node's users see an opaque leaf instead, so no later walk over terms
    meets an arbitrarily deep one. A small bound here (64 in use: a chain of over a
    thousand views crashed, and takes a quarter of an hour)."""
    n = 16

    def graph(rows: int) -> Doc:
        nodes = [{"name": "s", "op": "softmax", "args": ["x"], "shape": [rows, 4], "attrs": {"dim": 0}}]
        for i in range(n):
            shape = [rows // 2, 8] if i % 2 == 0 else [rows, 4]
            nodes.append({"name": f"v{i}", "op": "view", "args": [nodes[-1]["name"]], "shape": shape,
                          "attrs": {"shape": shape}})
        return {"inputs": [{"name": "x", "shape": [rows, 4]}], "nodes": nodes,
                "outputs": [{"name": "y", "ref": f"v{n - 1}"}]}

    seq = {"format": "refine-graph", "version": 1, "kind": "sequential", "graph": graph(8)}
    ranks = []
    for r in range(2):  # a softmax over each rank's rows: not the softmax over all rows
        g = graph(4)
        g["nodes"].append({"name": "y", "op": "all_gather", "args": [f"v{n - 1}"], "shape": [8, 4],
                           "attrs": {"dim": 0, "group": [0, 1]}})
        g["outputs"] = [{"name": "y", "ref": "y"}]
        ranks.append({"rank": r, "graph": g})
    dist = {"format": "refine-graph", "version": 1, "kind": "distributed",
            "mesh": {"axes": [{"name": "tp", "size": 2}]}, "ranks": ranks,
            "relations": [{"from": "x", "placements": ["Shard(0)"]}],
            "expectations": [{"output": "y", "placements": ["Replicate"]}]}
    report = check_files(*_write(tmp_path, seq, dist), policy=replace(DEFAULT, term_depth=6))
    assert not report.refines
    # softmax(cat(x@0, x@1)) is 3 deep: v0, v1, v2 pass terms 4, 5, 6 deep on; v3's would be 7
    assert report.culprit is not None and report.culprit.node == "v3", str(report)
