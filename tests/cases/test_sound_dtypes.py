"""Relations equate values, so both sides hold one value class (issue 20).

A float sequential input related to an int64 rank input is refused, wherever the relation
is stated: placements on `local`, every leaf of a layout, its replicas, a define's terms,
a relation guessed by name, and expectations on outputs (placed, as a layout, or the default
when none is given). Each refusal is exit 2 naming the JSON path, the rank tensor and both
dtypes. Float precisions may differ: bfloat16 ranks of a float32 model still REFINE.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from refine.cli import main

SHAPE = [4, 6]
HALF = [2, 6]
Doc = dict[str, Any]


def graph(x: str, out: str, shape: list[int] = SHAPE) -> Doc:
    """relu of input x (dtype `x`), declared `out`: relu of an int64 declared float32 widens."""
    return {"inputs": [{"name": "x", "shape": shape, "dtype": x}],
            "nodes": [{"name": "z", "op": "relu", "args": ["x"], "shape": shape, "dtype": out}],
            "outputs": [{"name": "z"}]}


def write(tmp: Path, ranks: list[Doc], relations: list[Doc] | None, expectations: list[Doc] | None = None,
          axes: dict[str, int] | None = None, seq: Doc | None = None) -> Path:
    head = {"format": "refine-graph", "version": 1}
    d: Doc = head | {"kind": "distributed",
                     "mesh": {"axes": [{"name": k, "size": v} for k, v in (axes or {"tp": 2}).items()]},
                     "ranks": [{"rank": r, "graph": g} for r, g in enumerate(ranks)]}
    if relations is not None:
        d["relations"] = relations
    if expectations is not None:
        d["expectations"] = expectations
    (tmp / "seq.json").write_text(json.dumps(head | {"kind": "sequential", "graph": seq or graph("float32", "float32")}))
    (tmp / "dist.json").write_text(json.dumps(d))
    return tmp


def check(tmp: Path) -> Any:
    return CliRunner().invoke(main, ["check", str(tmp / "seq.json"), str(tmp / "dist.json")])


def refused(tmp: Path, where: str, tensor: str, *dtypes: str) -> None:
    r = check(tmp)
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert f"dist.json: {where}:" in text and tensor in text, text
    for d in dtypes:
        assert d in text, (d, text)


REPLICATE = [{"from": "x", "placements": ["Replicate"]}]
EXPECT = [{"output": "z", "placements": ["Replicate"]}]


@pytest.mark.parametrize("dtype", ["int64", "int32", "bool"])
def test_placements_on_a_rank_input_of_another_class(tmp_path: Path, dtype: str) -> None:
    """The rank's relu of its int64 x is declared float32 (a widening the loader allows):
    only the relation equates the classes. Before the check this REFINED."""
    write(tmp_path, [graph(dtype, "float32")] * 2, REPLICATE, EXPECT)
    refused(tmp_path, "$.relations[0]", "x@0", "float32", dtype)


def test_one_rank_of_another_class(tmp_path: Path) -> None:
    write(tmp_path, [graph("float32", "float32"), graph("int64", "float32")], REPLICATE, EXPECT)
    refused(tmp_path, "$.relations[0]", "x@1", "float32", "int64")


def test_a_layout_leaf_of_another_class(tmp_path: Path) -> None:
    rel = [{"from": "x", "layout": "cat(x@0, x@1, dim=0)"}]
    write(tmp_path, [graph("float32", "float32", HALF), graph("int64", "float32", HALF)], rel,
          [{"output": "z", "placements": ["Shard(0)"]}])
    refused(tmp_path, "$.relations[0].layout", "x@1", "float32", "int64")


def test_a_replica_of_another_class(tmp_path: Path) -> None:
    """dp x tp: the second replica (ranks 2 and 3) holds int64."""
    rel = [{"from": "x", "layout": ["cat(x@0, x@1, dim=0)", "cat(x@2, x@3, dim=0)"]}]
    ranks = [graph("float32", "float32", HALF)] * 2 + [graph("int64", "float32", HALF)] * 2
    write(tmp_path, ranks, rel, [{"output": "z", "placements": ["Replicate", "Shard(0)"]}], {"dp": 2, "tp": 2})
    refused(tmp_path, "$.relations[0].layout[1]", "x@2", "float32", "int64")


def test_a_define_of_another_class(tmp_path: Path) -> None:
    """A rank input defined from a float sequential input, but declared int64."""
    seq = {"inputs": [{"name": "x", "shape": SHAPE}, {"name": "w", "shape": [3]}],
           "nodes": [{"name": "z", "op": "relu", "args": ["x"], "shape": SHAPE}], "outputs": [{"name": "z"}]}
    rank = {"inputs": [{"name": "x", "shape": SHAPE}, {"name": "w", "shape": [3]},
                       {"name": "p", "shape": [4], "dtype": "int64"}],
            "nodes": [{"name": "z", "op": "relu", "args": ["x"], "shape": SHAPE}], "outputs": [{"name": "z"}]}
    rel = [*REPLICATE, {"from": "w", "placements": ["Replicate"]},
           {"define": "p@1", "as": "cat(w, zeros([1]), dim=0)"}]
    write(tmp_path, [rank] * 2, rel, EXPECT, seq=seq)
    refused(tmp_path, "$.relations[2].as", "p@1", "float32", "int64")


def test_a_guessed_relation_of_another_class(tmp_path: Path) -> None:
    """No relation for x: the same name and shape on every rank would be read as replicated."""
    write(tmp_path, [graph("int64", "float32")] * 2, None, EXPECT)
    refused(tmp_path, "$.relations", "x@0", "float32", "int64")


def test_an_expected_output_of_another_class(tmp_path: Path) -> None:
    """An int output expected equal to a float one."""
    write(tmp_path, [graph("float32", "int64")] * 2, REPLICATE, EXPECT,
          seq=graph("float32", "float32"))
    r = check(tmp_path)
    # the ranks' relu of a float declared int64 narrows: refused at the node first
    assert r.exit_code == 2 and "$.ranks[0].graph.nodes[0].dtype" in r.output, r.output
    ints = {"inputs": [{"name": "x", "shape": SHAPE}, {"name": "i", "shape": SHAPE, "dtype": "int64"}],
            "nodes": [{"name": "z", "op": "relu", "args": ["i"], "shape": SHAPE, "dtype": "int64"}],
            "outputs": [{"name": "z"}]}
    seq = {"inputs": [{"name": "x", "shape": SHAPE}, {"name": "i", "shape": SHAPE, "dtype": "int64"}],
           "nodes": [{"name": "z", "op": "relu", "args": ["x"], "shape": SHAPE}], "outputs": [{"name": "z"}]}
    rels = [*REPLICATE, {"from": "i", "placements": ["Replicate"]}]
    write(tmp_path, [ints] * 2, rels, EXPECT, seq=seq)
    refused(tmp_path, "$.expectations[0]", "z@0", "float32", "int64")
    write(tmp_path, [ints] * 2, rels, [{"output": "z", "layout": "z@0"}], seq=seq)
    refused(tmp_path, "$.expectations[0].layout", "z@0", "float32", "int64")
    write(tmp_path, [ints] * 2, rels, None, seq=seq)
    refused(tmp_path, "$.expectations", "z@0", "float32", "int64")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_float_precisions_may_differ(tmp_path: Path, dtype: str) -> None:
    """Mixed precision: bfloat16 ranks of a float32 model relate (refine's values are real)."""
    write(tmp_path, [graph(dtype, dtype)] * 2, REPLICATE, EXPECT)
    r = check(tmp_path)
    assert r.exit_code == 0, r.output
    write(tmp_path, [graph(dtype, dtype)] * 2, None, None)
    r = check(tmp_path)
    assert r.exit_code == 0, r.output


def test_int_relations_of_one_class_still_refine(tmp_path: Path) -> None:
    """int32 ranks of an int64 sequential input (ids, say): one class."""
    write(tmp_path, [graph("int32", "int32")] * 2, REPLICATE, EXPECT, seq=graph("int64", "int64"))
    r = check(tmp_path)
    assert r.exit_code == 0, r.output
