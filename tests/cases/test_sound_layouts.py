"""A rank element stands for one sequential element only (issue 20, refine.relate.overlap).

A layout that reads one rank tensor twice (`cat(w@0, w@0)`) holds only for sequential
inputs whose halves are equal, and two relations that read one rank tensor take two
independent sequential inputs as equal. Refused with exit 2 naming the relation's JSON path:
a repeated leaf, overlapping slices, a slice and the whole tensor, two relations sharing a
rank tensor (stated, or one of them guessed by name), replicas that swap places, and the
same with symbolic sizes. Allowed: replicas (the same tensor held by other ranks, or read
again at the same place) and defines that repeat a region (copies of a KV head).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from refine.cli import main

Doc = dict[str, Any]


def g(inputs: dict[str, list[Any]], out_of: str) -> Doc:
    """A graph of float inputs and z = relu(out_of)."""
    shape = inputs[out_of]
    return {"inputs": [{"name": k, "shape": v} for k, v in inputs.items()],
            "nodes": [{"name": "z", "op": "relu", "args": [out_of], "shape": shape}], "outputs": [{"name": "z"}]}


def write(tmp: Path, seq: Doc, ranks: list[Doc], relations: list[Doc], expectations: list[Doc] | None = None,
          axes: dict[str, int] | None = None, symbols: dict[str, Any] | None = None) -> None:
    head: Doc = {"format": "refine-graph", "version": 1}
    if symbols:
        head["symbols"] = symbols
    d = head | {"kind": "distributed",
                "mesh": {"axes": [{"name": k, "size": v} for k, v in (axes or {"tp": 2}).items()]},
                "ranks": [{"rank": r, "graph": x} for r, x in enumerate(ranks)], "relations": relations}
    if expectations is not None:
        d["expectations"] = expectations
    (tmp / "seq.json").write_text(json.dumps(head | {"kind": "sequential", "graph": seq}))
    (tmp / "dist.json").write_text(json.dumps(d))


def check(tmp: Path) -> Any:
    return CliRunner().invoke(main, ["check", str(tmp / "seq.json"), str(tmp / "dist.json")])


def refused(tmp: Path, where: str, *words: str) -> str:
    r = check(tmp)
    text = " ".join(r.output.split())
    assert r.exit_code == 2, text
    assert f"dist.json: {where}:" in text and "overlap" in text, text
    for w in words:
        assert w in text, (w, text)
    return text


def one_layout(tmp: Path, layout: str, seq_shape: list[int], w_shape: list[int]) -> None:
    seq = g({"x": seq_shape}, "x")
    rank = {"inputs": [{"name": "w", "shape": w_shape}, {"name": "x", "shape": seq_shape}],
            "nodes": [{"name": "z", "op": "relu", "args": ["x"], "shape": seq_shape}], "outputs": [{"name": "z"}]}
    write(tmp, seq, [rank, rank], [{"from": "x", "layout": layout}])


@pytest.mark.parametrize("layout,seq_shape,w_shape,read", [
    ("cat(w@0, w@0, dim=0)", [8, 6], [4, 6], "w@0[0:4, 0:6]"),  # a repeated leaf
    ("cat(slice(w@0, 0, 0, 4), slice(w@0, 0, 2, 6), dim=0)", [8, 6], [6, 6], "w@0[2:6, 0:6]"),  # overlapping slices
    ("cat(w@0, slice(w@0, 0, 0, 2), dim=0)", [6, 6], [4, 6], "w@0[0:2, 0:6]"),  # a slice and the whole
    ("cat(slice(w@0, 1, 0, 4), transpose(slice(w@0, 0, 0, 6), 0, 1), dim=1)", [6, 10], [6, 6], "w@0"),  # a transpose
    ("cat(w@0, view(w@0, [4, 6]), dim=0)", [8, 6], [4, 6], "w@0"),  # under a view
    ("sum(w@0, w@0)", [4, 6], [4, 6], "w@0"),  # twice in one sum
])
def test_a_layout_that_reads_an_element_twice_is_refused(tmp_path: Path, layout: str, seq_shape: list[int],
                                                         w_shape: list[int], read: str) -> None:
    one_layout(tmp_path, layout, seq_shape, w_shape)
    refused(tmp_path, "$.relations[0]", read, "'x'")


def test_disjoint_slices_of_one_tensor_are_allowed(tmp_path: Path) -> None:
    """Two sequential halves from the two halves of one rank tensor, swapped: fine."""
    one_layout(tmp_path, "cat(slice(w@0, 0, 4, 8), slice(w@0, 0, 0, 4), dim=0)", [8, 6], [8, 6])
    d = json.loads((tmp_path / "dist.json").read_text())
    for rank in d["ranks"]:  # the ranks compute z from their w, swapping its halves back
        rank["graph"]["nodes"] = [
            {"name": "lo", "op": "slice", "args": ["w"], "shape": [4, 6], "attrs": {"dim": 0, "start": 4, "end": 8}},
            {"name": "hi", "op": "slice", "args": ["w"], "shape": [4, 6], "attrs": {"dim": 0, "start": 0, "end": 4}},
            {"name": "c", "op": "cat", "args": ["lo", "hi"], "shape": [8, 6], "attrs": {"dim": 0}},
            {"name": "z", "op": "relu", "args": ["c"], "shape": [8, 6]}]
    d["expectations"] = [{"output": "z", "layout": "z@0"}]  # rank 0's (rank 1's w is not related)
    (tmp_path / "dist.json").write_text(json.dumps(d))
    r = check(tmp_path)
    assert r.exit_code == 0, r.output


def two_relations(tmp: Path, a: Doc, b: Doc, w_shape: list[int] | None = None) -> None:
    seq = g({"a": [4, 6], "b": [4, 6]}, "a")
    rank = g({"a": [4, 6], "w": w_shape or [4, 6]}, "a")
    write(tmp, seq, [rank, rank], [a, b])


@pytest.mark.parametrize("a,b,read", [
    ({"from": "a", "placements": ["Replicate"], "input": "w"}, {"from": "b", "placements": ["Replicate"], "input": "w"},
     "w@0"),
    ({"from": "a", "layout": "w@0"}, {"from": "b", "layout": "w@0"}, "w@0"),
    ({"from": "a", "layout": "slice(w@0, 0, 0, 4)"}, {"from": "b", "layout": "slice(w@0, 0, 2, 6)"}, "w@0[2:6"),
    ({"from": "a", "layout": "w@1"}, {"from": "b", "placements": ["Replicate"], "input": "w"}, "w@1"),
])
def test_two_relations_sharing_a_rank_tensor_are_refused(tmp_path: Path, a: Doc, b: Doc, read: str) -> None:
    """b = w and a = w would take the independent inputs a and b as equal."""
    two_relations(tmp_path, a, b, [6, 6] if "slice" in json.dumps(a) else None)
    refused(tmp_path, "$.relations[1]", read, "'a'", "'b'", "$.relations[0]")


def test_a_guessed_relation_sharing_a_rank_tensor_is_refused(tmp_path: Path) -> None:
    """b is stated to be the ranks' `a`; a has no relation, so it is guessed as the ranks' `a` too."""
    seq = g({"a": [4, 6], "b": [4, 6]}, "a")
    rank = g({"a": [4, 6]}, "a")
    write(tmp_path, seq, [rank, rank], [{"from": "b", "placements": ["Replicate"], "input": "a"}])
    refused(tmp_path, "$.relations", "a@0", "guessed", "'a'", "'b'")


def dp_tp(tmp: Path, layout: list[str], w: str = "w", v: bool = False) -> None:
    """x [8, 6] on a dp x tp mesh, its halves held by the tp ranks (w), z = relu(x)."""
    seq = g({"x": [8, 6]}, "x")
    inputs = {"w": [4, 6]} | ({"v": [4, 6]} if v else {})
    write(tmp, seq, [g(inputs, w)] * 4, [{"from": "x", "layout": layout}],
          [{"output": "z", "placements": ["Replicate", "Shard(0)"]}], {"dp": 2, "tp": 2})


def test_replicas_may_read_a_rank_tensor_again(tmp_path: Path) -> None:
    """The same tensor held by other ranks: a statement about rank tensors, allowed."""
    dp_tp(tmp_path, ["cat(w@0, w@1, dim=0)", "cat(w@2, w@3, dim=0)"])
    r = check(tmp_path)
    assert r.exit_code == 0, r.output
    # a replica reading one of the first's tensors again, at the same place
    dp_tp(tmp_path, ["cat(w@0, w@1, dim=0)", "cat(w@0, w@3, dim=0)"])
    r = check(tmp_path)
    assert r.exit_code != 2, r.output


def test_a_replica_that_moves_a_piece_is_refused(tmp_path: Path) -> None:
    """x = cat(w@0, w@1) = cat(w@1, w@0) would make x's halves equal."""
    dp_tp(tmp_path, ["cat(w@0, w@1, dim=0)", "cat(w@1, w@0, dim=0)"])
    refused(tmp_path, "$.relations[0]", "w@0[0:4, 0:6]", "replica 1", "two elements of 'x'")


def test_a_define_may_repeat_a_region(tmp_path: Path) -> None:
    """Each rank holds two copies of its half of k (a KV head per local query head, say),
    given by defines; the layout reads one copy of each: allowed, and it refines."""
    seq = g({"k": [4, 3]}, "k")
    rank = g({"kk": [4, 3]}, "kk")
    rel = [{"from": "k", "layout": "cat(slice(kk@0, 0, 0, 2), slice(kk@1, 0, 2, 4), dim=0)"},
           {"define": "kk@0", "as": "cat(slice(k, 0, 0, 2), slice(k, 0, 0, 2), dim=0)"},
           {"define": "kk@1", "as": "cat(slice(k, 0, 2, 4), slice(k, 0, 2, 4), dim=0)"}]
    write(tmp_path, seq, [rank, rank], rel,
          [{"output": "z", "layout": "cat(slice(z@0, 0, 0, 2), slice(z@1, 0, 2, 4), dim=0)"}])
    r = check(tmp_path)
    assert r.exit_code == 0, r.output


S = {"S": {"min": 4}}


def test_symbolic_overlap_is_refused(tmp_path: Path) -> None:
    """A slice and the whole of a tensor of symbolic size S >= 4: [0, 4) and [0, S) overlap."""
    seq = g({"a": [4, 6], "b": ["S", 6]}, "a")
    rank = g({"a": [4, 6], "w": ["S", 6]}, "a")
    write(tmp_path, seq, [rank, rank], [{"from": "a", "layout": "slice(w@0, 0, 0, 4)"}, {"from": "b", "layout": "w@0"}],
          symbols=S)
    refused(tmp_path, "$.relations[1]", "w@0[0:S, 0:6]", "w@0[0:4, 0:6]")


def test_symbolic_offsets_of_a_concat(tmp_path: Path) -> None:
    """slice(cat(u@0, w@0), 0, 0, 4) reads u only when S >= 4 is proven: w is free for b.
    Reading the first S + 2 rows reaches into w: refused."""
    rank = g({"a": [4, 6], "u": ["S", 6], "w": ["S", 6]}, "a")
    rank["nodes"] = [{"name": "s", "op": "slice", "args": ["u"], "shape": [4, 6], "attrs": {"dim": 0, "start": 0, "end": 4}},
                     {"name": "z", "op": "relu", "args": ["s"], "shape": [4, 6]}]
    rel = [{"from": "a", "layout": "slice(cat(u@0, w@0, dim=0), 0, 0, 4)"}, {"from": "b", "layout": "w@0"}]
    write(tmp_path, g({"a": [4, 6], "b": ["S", 6]}, "a"), [rank, rank], rel, [{"output": "z", "layout": "z@0"}],
          symbols=S)
    r = check(tmp_path)
    assert r.exit_code == 0, r.output
    # u and the first two rows of w, next to b's whole w: overlap at w@0[0:2]
    rel = [{"from": "a", "layout": "slice(cat(u@0, w@0, dim=0), 0, 0, 4)"}, {"from": "b", "layout": "w@0"},
           {"from": "c", "layout": "cat(u@1, slice(w@0, 0, 0, 2), dim=0)"}]
    write(tmp_path, g({"a": [4, 6], "b": ["S", 6], "c": ["S+2", 6]}, "a"), [rank, rank], rel, symbols=S)
    refused(tmp_path, "$.relations[2]", "w@0[0:2, 0:6]", "w@0[0:S, 0:6]", "'b'", "'c'")


def test_a_scale_by_zero_is_refused(tmp_path: Path) -> None:
    """x = 0 * w@0 would hold only for a zero x."""
    one_layout(tmp_path, "scale(w@0, 0)", [4, 6], [4, 6])
    r = check(tmp_path)
    assert r.exit_code == 2 and "dist.json: $.relations[0]:" in r.output and "scale by 0" in r.output, r.output
