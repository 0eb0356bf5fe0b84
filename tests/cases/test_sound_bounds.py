"""Hostile sizes and numbers: each is refused fast, through the CLI, with exit code 2 and
`file: json-path: reason`, where refine used to hang, allocate without bound, panic in the
e-graph's 64-bit arithmetic or crash on a bare exception. Infinities stay values.

Each case is a small TP2 pair (x sharded by rows, an op on each rank) with one thing made
hostile; the CLI runs with a timeout, so a hang fails the test instead of stalling it.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT

Doc = dict[str, Any]


def pair(node: Doc | None = None, x: list[Any] | None = None, seq_extra: Doc | None = None) -> tuple[Doc, Doc]:
    """seq: y = node(x) over x[8, 4] (neg by default); dist: the same on each rank's rows."""
    node = node or {"op": "neg", "args": ["x"]}

    def graph(rows: int, shape: list[Any]) -> Doc:
        inputs = [{"name": "x", "shape": shape}, {"name": "m", "shape": [rows, 4], "dtype": "bool"}]
        n = {"name": "y", "shape": shape, **copy.deepcopy(node)}
        return {"inputs": inputs, "nodes": [n], "outputs": [{"name": "y", "ref": "y"}]}

    head = {"format": "refine-graph", "version": 1}
    seq = head | {"kind": "sequential", "graph": graph(8, x or [8, 4])} | (seq_extra or {})
    dist = head | {"kind": "distributed", "mesh": {"axes": [{"name": "tp", "size": 2}]},
                   "ranks": [{"rank": r, "graph": graph(4, [4, 4])} for r in range(2)],
                   "relations": [{"from": "x", "placements": ["Shard(0)"]}, {"from": "m", "placements": ["Shard(0)"]}],
                   "expectations": [{"output": "y", "placements": ["Shard(0)"]}]}
    return seq, dist


def write(tmp_path: Path, seq: Doc, dist: Doc) -> tuple[Path, Path]:
    s, d = tmp_path / "seq.json", tmp_path / "dist.json"
    s.write_text(json.dumps(seq))  # NaN and Infinity as Python's json writes (and reads) them
    d.write_text(json.dumps(dist))
    return s, d


def cli(s: Path, d: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "refine.cli", "check", str(s), str(d)],
                          capture_output=True, text=True, timeout=30, cwd=ROOT)


def run(tmp_path: Path, seq: Doc, dist: Doc) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    s, d = write(tmp_path, seq, dist)
    return cli(s, d), s, d


def refused(p: subprocess.CompletedProcess[str], file: Path, where: str, *reason: str) -> None:
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr and "internal error" not in p.stderr, p.stderr
    assert f"error: {file}: {where}: " in p.stderr, p.stderr
    for part in reason:
        assert part in p.stderr, p.stderr


# ---------------------------------------------------------------------------------------
# symbolic sizes: the expanded polynomial is bounded


SYMS = [f"s{i}" for i in range(8)]


@pytest.mark.parametrize("size", [
    "*".join(["(" + "+".join(SYMS) + ")"] * 40),  # 330 bytes, 8^40 terms expanded
    "*".join(f"a{i}" for i in range(40)),  # one term, 2^40 in a comparison
    "*".join(["s0"] * 1000),  # degree 1000
], ids=["product-of-sums", "product-of-symbols", "power"])
def test_symbolic_size_too_complex(tmp_path: Path, size: str) -> None:
    symbols = {name: {} for name in SYMS + [f"a{i}" for i in range(40)]}
    seq, dist = pair(x=[size, 4], seq_extra={"symbols": symbols})
    p, s, _ = run(tmp_path, seq, dist)
    refused(p, s, "$.graph.inputs[0].shape[0]", "cannot read size", "size too complex")


def test_symbolic_size_of_a_few_terms_is_read(tmp_path: Path) -> None:
    """The bound is far above what programs write: (B + S) * H * 2 is a size like any."""
    seq, dist = pair(x=["(B + S) * H * 2", 4], seq_extra={"symbols": {"B": {}, "S": {}, "H": {}}})
    p, s, d = run(tmp_path, seq, dist)
    refused(p, d, "$.relations[0].placements", "make shape [8, 4]")  # read; the ranks' rows are 8


# ---------------------------------------------------------------------------------------
# concrete sizes: within 64-bit products; the mesh within its rank graphs


@pytest.mark.parametrize("shape,where", [
    ([2**62], "$.graph.inputs[0].shape"),
    ([2**31, 2**31], "$.graph.inputs[0].shape"),
    ([0, 2**70], "$.graph.inputs[0].shape"),  # no elements, but its dims' products overflow
])
def test_tensor_too_large(tmp_path: Path, shape: list[int], where: str) -> None:
    seq, dist = pair(x=shape)
    p, s, _ = run(tmp_path, seq, dist)
    refused(p, s, where, "fewer than 2^62 elements")


def test_node_too_large(tmp_path: Path) -> None:
    seq, dist = pair()
    big = [2**61, 4]
    dist["ranks"][1]["graph"]["inputs"][0]["shape"] = big
    dist["ranks"][1]["graph"]["nodes"][0]["shape"] = big
    p, _, d = run(tmp_path, seq, dist)
    refused(p, d, "$.ranks[1].graph.inputs[0].shape", "2^63.0 elements")


def test_mesh_larger_than_its_rank_graphs(tmp_path: Path) -> None:
    seq, dist = pair()
    dist["mesh"]["axes"][0]["size"] = 10**12
    p, _, d = run(tmp_path, seq, dist)
    refused(p, d, "$.ranks", "no graph for rank 2 (the mesh has 1000000000000 ranks)")


def test_too_many_mesh_axes(tmp_path: Path) -> None:
    seq, dist = pair()
    dist["mesh"]["axes"] += [{"name": f"a{i}", "size": 1} for i in range(40)]
    p, _, d = run(tmp_path, seq, dist)
    refused(p, d, "$.mesh.axes", "41 mesh axes; refine reads up to 16")


# ---------------------------------------------------------------------------------------
# number literals: NaN refused, infinities kept as values


@pytest.mark.parametrize("node,where", [
    ({"op": "add", "args": ["x", float("nan")]}, "$.graph.nodes[0].args[1]"),
    ({"op": "mul", "args": ["x", float("nan")]}, "$.graph.nodes[0].args[1]"),
    ({"op": "masked_fill", "args": ["x", "m"], "attrs": {"value": float("nan")}}, "$.graph.nodes[0].attrs.value"),
    ({"op": "add", "args": ["x", "x"], "attrs": {"alpha": float("nan")}}, "$.graph.nodes[0].attrs.alpha"),
])
def test_nan_literal(tmp_path: Path, node: Doc, where: str) -> None:
    seq, dist = pair(node)
    p, s, _ = run(tmp_path, seq, dist)
    refused(p, s, where, "is NaN")


def test_nan_literal_in_a_rank_graph(tmp_path: Path) -> None:
    seq, dist = pair({"op": "mul", "args": ["x", 2.0]})
    dist["ranks"][1]["graph"]["nodes"][0]["args"][1] = float("nan")
    p, _, d = run(tmp_path, seq, dist)
    refused(p, d, "$.ranks[1].graph.nodes[0].args[1]", "node 'y': the literal is NaN")


def test_integer_literal_beyond_64_bits(tmp_path: Path) -> None:
    seq, dist = pair({"op": "mul", "args": ["x", 10**400]})
    p, s, _ = run(tmp_path, seq, dist)
    refused(p, s, "$.graph.nodes[0].args[1]", "does not fit in 64 bits")


def test_integer_beyond_what_python_reads(tmp_path: Path) -> None:
    s, d = write(tmp_path, *pair({"op": "mul", "args": ["x", 12345]}))
    s.write_text(s.read_text().replace("12345", "9" * 5000))  # json.dumps writes no such number
    refused(cli(s, d), s, "$", "unreadable JSON", "5000 digits")


@pytest.mark.slow
@pytest.mark.parametrize("node", [
    {"op": "masked_fill", "args": ["x", "m"], "attrs": {"value": float("-inf")}},  # attention masks
    {"op": "where", "args": ["m", "x", float("-inf")]},
    {"op": "add", "args": ["x", float("-inf")]},
    {"op": "mul", "args": ["x", float("-inf")]},  # no rational factor: the product with a constant
    {"op": "div", "args": ["x", float("inf")]},
], ids=["masked_fill", "where", "add", "mul", "div"])
def test_infinite_literal_is_a_value(tmp_path: Path, node: Doc) -> None:
    p, _, _ = run(tmp_path, *pair(node))
    assert p.returncode == 0 and "REFINES" in p.stdout, p.stdout + p.stderr


def test_infinite_factor_is_refused(tmp_path: Path) -> None:
    seq, dist = pair({"op": "add", "args": ["x", "x"], "attrs": {"alpha": float("inf")}})
    p, s, _ = run(tmp_path, seq, dist)
    refused(p, s, "$.graph", "node 'y' (add): alpha inf is not a finite number")


# ---------------------------------------------------------------------------------------
# nesting: a layout is a few calls deep


def test_layout_nested_too_deep(tmp_path: Path) -> None:
    seq, dist = pair()
    t = "cat(x@0, x@1, dim=0)"
    for _ in range(40):
        t = f"scale({t}, 1)"
    dist["relations"][0] = {"from": "x", "layout": t}
    p, _, d = run(tmp_path, seq, dist)
    refused(p, d, "$.relations[0].layout", "calls nested deeper than 32")
