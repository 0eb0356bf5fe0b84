"""Bad input: every kind fails closed with `file: json-path: reason` (exit 2), never a
traceback and never a verdict.

Each test starts from the valid pair models/tp_mlp/{seq,dist}.json, breaks one thing and
checks the exact JSON path and the reason. Most run in-process (`check_files` must raise
`InputError` before any e-graph work); a few go through the CLI for the exit code and stderr.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from refine.check import check_files
from refine.frontends.graphfile import load_dist, load_seq
from refine.ir.errors import InputError
from refine.ops.registry import Registry
from tests.helpers import ROOT

CASE = ROOT / "models" / "tp_mlp"
SEQ = json.loads((CASE / "seq.json").read_text())
DIST = json.loads((CASE / "dist.json").read_text())

Doc = dict[str, Any]


@pytest.fixture
def seq() -> Doc:
    return copy.deepcopy(SEQ)


@pytest.fixture
def dist() -> Doc:
    return copy.deepcopy(DIST)


def write(tmp_path: Path, seq: Doc | str, dist: Doc | str) -> tuple[Path, Path]:
    s, d = tmp_path / "seq.json", tmp_path / "dist.json"
    s.write_text(seq if isinstance(seq, str) else json.dumps(seq, indent=1))
    d.write_text(dist if isinstance(dist, str) else json.dumps(dist, indent=1))
    return s, d


def fails(tmp_path: Path, seq: Doc | str, dist: Doc | str, file: str, where: str, *reason: str,
          rules: tuple[Path, ...] = ()) -> InputError:
    """check_files raises InputError naming `file` (seq/dist), `where` and every `reason` part."""
    s, d = write(tmp_path, seq, dist)
    with pytest.raises(InputError) as info:
        check_files(s, d, rules)
    e = info.value
    assert e.file == str(s if file == "seq" else d), str(e)
    assert e.where == where, str(e)
    for part in reason:
        assert part in e.reason, str(e)
    assert str(e) == f"{e.file}: {e.where}: {e.reason}"
    return e


def rank_node(dist: Doc, rank: int, name: str) -> Doc:
    return next(n for n in dist["ranks"][rank]["graph"]["nodes"] if n["name"] == name)


def seq_node(seq: Doc, name: str) -> Doc:
    return next(n for n in seq["graph"]["nodes"] if n["name"] == name)


# ---------------------------------------------------------------------------------------
# files and JSON


def test_valid_pair_loads(tmp_path: Path, seq: Doc, dist: Doc, registry: Registry) -> None:
    s, d = write(tmp_path, seq, dist)
    g = load_seq(s, registry)
    dd = load_dist(d, registry, g)
    assert sorted(dd.ranks) == [0, 1] and len(dd.relations) == 5


def test_file_does_not_exist(tmp_path: Path, dist: Doc) -> None:
    _, d = write(tmp_path, "{}", dist)
    missing = tmp_path / "nope.json"
    with pytest.raises(InputError) as info:
        check_files(missing, d)
    assert info.value.file == str(missing) and info.value.where == "$"
    assert "cannot read" in info.value.reason and "No such file" in info.value.reason


def test_directory(tmp_path: Path, seq: Doc) -> None:
    s, _ = write(tmp_path, seq, "{}")
    with pytest.raises(InputError) as info:
        check_files(s, tmp_path)
    assert info.value.file == str(tmp_path) and info.value.where == "$"
    assert "cannot read" in info.value.reason and "directory" in info.value.reason


def test_malformed_json_has_line_and_column(tmp_path: Path, dist: Doc) -> None:
    text = '{\n "format": "refine-graph",\n "version": 1,\n "kind": "sequential"\n "graph": {}\n}\n'
    fails(tmp_path, text, dist, "seq", "line 5 column 2", "malformed JSON", "Expecting ',' delimiter")


def test_duplicate_key(tmp_path: Path, seq: Doc) -> None:
    text = json.dumps(DIST, indent=1).replace('"from": "w1",', '"from": "w1", "placements": ["Replicate"],')
    fails(tmp_path, seq, text, "dist", "$.relations[1]", "key 'placements' appears twice")


def test_empty_file(tmp_path: Path, dist: Doc) -> None:
    fails(tmp_path, "", dist, "seq", "line 1 column 1", "malformed JSON")


def test_binary_file(tmp_path: Path, seq: Doc) -> None:
    s, d = write(tmp_path, seq, "{}")
    d.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(InputError) as info:
        check_files(s, d)
    assert info.value.where == "$" and "not UTF-8" in info.value.reason


@pytest.mark.parametrize("doc,got", [("[1, 2]", "array"), ('"seq"', "string"), ("null", "null")])
def test_not_an_object(tmp_path: Path, dist: Doc, doc: str, got: str) -> None:
    fails(tmp_path, doc, dist, "seq", "$", "must be a JSON object", got)


# ---------------------------------------------------------------------------------------
# header


def test_wrong_format(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    seq["format"] = "onnx"
    fails(tmp_path, seq, dist, "seq", "$.format", "expected 'refine-graph'", "'onnx'")


@pytest.mark.parametrize("version", [2, "1", True, None])
def test_wrong_version(tmp_path: Path, seq: Doc, dist: Doc, version: Any) -> None:
    dist["version"] = version
    fails(tmp_path, seq, dist, "dist", "$.version", "unsupported version", repr(version))


def test_files_swapped(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    fails(tmp_path, dist, seq, "seq", "$.kind", "expected 'sequential', got 'distributed'", "swapped")


def test_unknown_kind(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    dist["kind"] = "pipeline"
    fails(tmp_path, seq, dist, "dist", "$.kind", "expected 'distributed', got 'pipeline'")


def test_missing_header_field(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    del seq["version"]
    fails(tmp_path, seq, dist, "seq", "$", "missing field 'version'")


def test_unknown_top_level_field_is_a_typo(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    dist["expectation"] = dist.pop("expectations")
    fails(tmp_path, seq, dist, "dist", "$.expectation", "unknown field 'expectation'", "expectations")


# ---------------------------------------------------------------------------------------
# missing fields, wrong types


@pytest.mark.parametrize("which,mutate,where,reason", [
    ("seq", lambda s, d: s.pop("graph"), "$", "missing field 'graph'"),
    ("seq", lambda s, d: s["graph"].pop("outputs"), "$.graph", "missing field 'outputs'"),
    ("seq", lambda s, d: s["graph"]["inputs"][1].pop("shape"), "$.graph.inputs[1]", "missing field 'shape'"),
    ("seq", lambda s, d: s["graph"]["nodes"][2].pop("op"), "$.graph.nodes[2]", "missing field 'op'"),
    ("seq", lambda s, d: s["graph"]["nodes"][0].pop("name"), "$.graph.nodes[0]", "missing field 'name'"),
    ("dist", lambda s, d: d.pop("mesh"), "$", "missing field 'mesh'"),
    ("dist", lambda s, d: d.pop("ranks"), "$", "missing field 'ranks'"),
    ("dist", lambda s, d: d["mesh"]["axes"][0].pop("size"), "$.mesh.axes[0]", "missing field 'size'"),
    ("dist", lambda s, d: d["ranks"][1].pop("graph"), "$.ranks[1]", "missing field 'graph'"),
    ("dist", lambda s, d: d["ranks"][1].pop("rank"), "$.ranks[1]", "missing field 'rank'"),
    ("dist", lambda s, d: d["relations"][2].pop("from"), "$.relations[2]", "missing field 'from'"),
    ("dist", lambda s, d: d["expectations"][0].pop("output"), "$.expectations[0]", "missing field 'output'"),
    ("dist", lambda s, d: rank_node(d, 1, "fc2_sum")["attrs"].pop("group"),
     "$.ranks[1].graph.nodes[4].attrs", "needs attribute 'group'"),
])
def test_missing_field(tmp_path: Path, seq: Doc, dist: Doc, which: str, mutate: Callable[[Doc, Doc], Any],
                       where: str, reason: str) -> None:
    mutate(seq, dist)
    fails(tmp_path, seq, dist, which, where, reason)


@pytest.mark.parametrize("which,mutate,where,reason", [
    ("seq", lambda s, d: s.update(graph=[]), "$.graph", "expected object, got array"),
    ("seq", lambda s, d: s["graph"].update(nodes={}), "$.graph.nodes", "expected array, got object"),
    ("seq", lambda s, d: s["graph"]["nodes"].__setitem__(1, "fc1_bias"), "$.graph.nodes[1]",
     "expected an object, got string"),
    ("seq", lambda s, d: s["graph"]["inputs"][0].update(shape="8x16"), "$.graph.inputs[0].shape",
     "expected array, got string"),
    ("seq", lambda s, d: s["graph"]["inputs"][0].update(name=7), "$.graph.inputs[0].name",
     "expected string, got integer"),
    ("seq", lambda s, d: s["graph"]["nodes"][0].update(args="x"), "$.graph.nodes[0].args",
     "expected array, got string"),
    ("seq", lambda s, d: s["graph"]["nodes"][2].update(attrs=["approximate"]), "$.graph.nodes[2].attrs",
     "expected object, got array"),
    ("seq", lambda s, d: s["graph"]["nodes"][0].update(dtype=32), "$.graph.nodes[0].dtype",
     "expected string, got integer"),
    ("seq", lambda s, d: s["graph"]["nodes"][0].update(source=26), "$.graph.nodes[0].source",
     "expected string, got integer"),
    ("seq", lambda s, d: s["graph"]["inputs"][0].update(role="weights"), "$.graph.inputs[0].role",
     "role must be one of"),
    ("seq", lambda s, d: s["graph"]["outputs"][0].update(role="logits"), "$.graph.outputs[0].role",
     "role must be one of"),
    ("seq", lambda s, d: s["graph"]["nodes"][0].update(shapes=[8, 32]), "$.graph.nodes[0].shapes",
     "unknown field 'shapes'"),
    ("dist", lambda s, d: d["ranks"][1].update(rank="1"), "$.ranks[1].rank", "expected integer, got string"),
    ("dist", lambda s, d: d["ranks"][1].update(rank=True), "$.ranks[1].rank", "expected integer, got boolean"),
    ("dist", lambda s, d: d["mesh"]["axes"][0].update(size=2.0), "$.mesh.axes[0].size",
     "expected integer, got number"),
    ("dist", lambda s, d: d.update(relations={"x": "Replicate"}), "$.relations", "expected array, got object"),
    ("dist", lambda s, d: d["relations"][0].update(placements="Replicate"), "$.relations[0].placements",
     "expected a list"),
])
def test_wrong_field_type(tmp_path: Path, seq: Doc, dist: Doc, which: str, mutate: Callable[[Doc, Doc], Any],
                          where: str, reason: str) -> None:
    mutate(seq, dist)
    fails(tmp_path, seq, dist, which, where, reason)


@pytest.mark.parametrize("dim", [-8, 8.0, None, True, [8]])
def test_bad_dim(tmp_path: Path, seq: Doc, dist: Doc, dim: Any) -> None:
    seq["graph"]["inputs"][0]["shape"] = [dim, 16]
    fails(tmp_path, seq, dist, "seq", "$.graph.inputs[0].shape[0]", "a dim must be a non-negative integer")


def test_negative_dim_on_a_rank_node(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    rank_node(dist, 1, "fc1")["shape"] = [8, -16]
    fails(tmp_path, seq, dist, "dist", "$.ranks[1].graph.nodes[0].shape[1]", "non-negative integer, got -16")


def test_unknown_dtype(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    dist["ranks"][0]["graph"]["inputs"][2]["dtype"] = "float8"
    fails(tmp_path, seq, dist, "dist", "$.ranks[0].graph.inputs[2].dtype", "unknown dtype 'float8'", "float32")


def test_unknown_dtype_attribute(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    seq["graph"]["nodes"].insert(1, {"name": "x16", "op": "to_copy", "args": ["fc1"], "attrs": {"dtype": "half"},
                                     "shape": [8, 32], "dtype": "float16"})
    fails(tmp_path, seq, dist, "seq", "$.graph.nodes[1].attrs.dtype", "unknown dtype 'half'")


# ---------------------------------------------------------------------------------------
# references, order, names


def test_dangling_argument(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    rank_node(dist, 1, "fc2")["args"] = ["act", "w3"]
    fails(tmp_path, seq, dist, "dist", "$.ranks[1].graph.nodes[3].args[1]", "'fc2' refers to 'w3'", "not defined")


def test_dangling_output(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    seq["graph"]["outputs"][0]["ref"] = "fc3_bias"
    fails(tmp_path, seq, dist, "seq", "$.graph.outputs[0].ref", "refers to 'fc3_bias'", "not defined")


def test_gradient_of_unknown_parameter(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    seq["graph"]["outputs"].append({"name": "g", "ref": "fc1", "role": "gradient", "of": "w9"})
    fails(tmp_path, seq, dist, "seq", "$.graph.outputs[1].of", "gradient of 'w9'", "not an input")


def test_node_uses_itself(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    seq_node(seq, "act")["args"] = ["act"]
    fails(tmp_path, seq, dist, "seq", "$.graph.nodes[2].args[0]", "'act' uses 'act'", "a cycle", "topological order")


def test_node_uses_a_later_node(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    seq_node(seq, "fc1_bias")["args"] = ["fc2", "b1"]
    fails(tmp_path, seq, dist, "seq", "$.graph.nodes[1].args[0]", "'fc1_bias' uses 'fc2', defined later", "a cycle")


@pytest.mark.parametrize("mutate,where,reason", [
    (lambda s: s["graph"]["inputs"][1].update(name="x"), "$.graph.inputs[1].name",
     "name 'x' is already defined at $.graph.inputs[0]"),
    (lambda s: s["graph"]["nodes"][0].update(name="w1"), "$.graph.nodes[0].name",
     "name 'w1' is already defined at $.graph.inputs[1]"),
    (lambda s: s["graph"]["outputs"].append({"name": "y", "ref": "fc1"}), "$.graph.outputs[1].name",
     "output name 'y' is used twice"),
])
def test_duplicate_names(tmp_path: Path, seq: Doc, dist: Doc, mutate: Callable[[Doc], Any], where: str,
                         reason: str) -> None:
    mutate(seq)
    fails(tmp_path, seq, dist, "seq", where, reason)


@pytest.mark.parametrize("name,reason", [("", "must not be empty"), ("x@0", "must not contain '@'")])
def test_bad_names(tmp_path: Path, seq: Doc, dist: Doc, name: str, reason: str) -> None:
    dist["ranks"][0]["graph"]["inputs"][0]["name"] = name
    fails(tmp_path, seq, dist, "dist", "$.ranks[0].graph.inputs[0].name", reason)


def test_no_outputs(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    seq["graph"]["outputs"] = []
    fails(tmp_path, seq, dist, "seq", "$.graph.outputs", "at least one output")


# ---------------------------------------------------------------------------------------
# ops: shapes, attributes, arguments


def test_shape_disagrees_with_shape_rule(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    seq_node(seq, "fc1")["shape"] = [8, 16]
    fails(tmp_path, seq, dist, "seq", "$.graph.nodes[0].shape", "'fc1' (matmul) has shape [8, 16]",
          "its inputs give [8, 32]")


def test_shape_rule_rejects_inputs(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    seq_node(seq, "fc1")["args"] = ["x", "w2"]  # [8, 16] @ [32, 16]
    fails(tmp_path, seq, dist, "seq", "$.graph.nodes[0]", "node 'fc1' (matmul)")


def test_unknown_op_names_op_and_node(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    seq_node(seq, "act")["op"] = "swiglu"
    fails(tmp_path, seq, dist, "seq", "$.graph.nodes[2].op", "unknown op 'swiglu'", "node 'act'", "no rule family")


def test_op_with_no_lowering(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    """An op a rule file declares but can neither put in the e-graph nor decompose."""
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "opaque.py").write_text(
        "from refine.ops.registry import Op\n"
        "OPS = [Op('opaque_act', 1, lambda ins, a: ins[0])]\n"
        "RULES = []\n")
    seq_node(seq, "act").update(op="opaque_act", attrs={})
    fails(tmp_path, seq, dist, "seq", "$.graph.nodes[2].op", "'opaque_act'", "node 'act'", "no decomposition",
          rules=(rules,))


def test_collective_in_sequential_graph(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    seq["graph"]["nodes"].insert(1, {"name": "s", "op": "all_reduce", "args": ["fc1"], "shape": [8, 32],
                                     "attrs": {"group": [0]}})
    fails(tmp_path, seq, dist, "seq", "$.graph.nodes[1].op", "the sequential graph has a collective (all_reduce)")


def test_attribute_the_op_does_not_have(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    seq_node(seq, "fc1")["attrs"] = {"transpose_b": True}
    fails(tmp_path, seq, dist, "seq", "$.graph.nodes[0].attrs.transpose_b", "op 'matmul' has no attribute 'transpose_b'")


@pytest.mark.parametrize("attrs,where,reason", [
    ({"reduce_op": 1, "group": [0, 1]}, "attrs.reduce_op", "must be a string, got integer"),
    ({"reduce_op": "sum", "group": "01"}, "attrs.group", "must be a list of integers"),
    ({"reduce_op": "sum", "group": [0, True]}, "attrs.group", "must be a list of integers"),
    ({"reduce_op": "prod", "group": [0, 1]}, "", "reduce_op 'prod' is not one of"),
    ({"reduce_op": "sum", "group": [0, 0, 1]}, "", "distinct ranks"),
])
def test_bad_attribute_value(tmp_path: Path, seq: Doc, dist: Doc, attrs: Doc, where: str, reason: str) -> None:
    rank_node(dist, 0, "fc2_sum")["attrs"] = attrs
    fails(tmp_path, seq, dist, "dist", "$.ranks[0].graph.nodes[4]" + ("." + where if where else ""), reason)


@pytest.mark.parametrize("args,where,reason", [
    (["x"], "$.graph.nodes[0].args", "takes 2 argument(s), got 1"),
    (["x", True], "$.graph.nodes[0].args[1]", "a name or a number, got boolean"),
    (["x", None], "$.graph.nodes[0].args[1]", "a name or a number, got null"),
    (["x", ["w1"]], "$.graph.nodes[0].args[1]", "a name or a number, got array"),
    (["x", 2.0], "$.graph.nodes[0].args[1]", "op 'matmul' does not take the number literal 2.0"),
])
def test_bad_arguments(tmp_path: Path, seq: Doc, dist: Doc, args: list[Any], where: str, reason: str) -> None:
    seq_node(seq, "fc1")["args"] = args
    fails(tmp_path, seq, dist, "seq", where, reason)


# ---------------------------------------------------------------------------------------
# mesh and ranks


def test_missing_rank_graph(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    del dist["ranks"][1]
    fails(tmp_path, seq, dist, "dist", "$.ranks", "no graph for rank 1", "2 ranks")


def test_rank_twice(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    dist["ranks"][1]["rank"] = 0
    fails(tmp_path, seq, dist, "dist", "$.ranks[1].rank", "rank 0 appears twice", "$.ranks[0]")


def test_rank_outside_mesh(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    dist["ranks"][1]["rank"] = 2
    fails(tmp_path, seq, dist, "dist", "$.ranks[1].rank", "rank 2 is outside the mesh of 2 ranks")


@pytest.mark.parametrize("axes,where,reason", [
    ([], "$.mesh.axes", "at least one axis"),
    ([{"name": "tp", "size": 0}], "$.mesh.axes[0].size", "at least 1"),
    ([{"name": "tp", "size": 2}, {"name": "tp", "size": 1}], "$.mesh.axes[1].name", "'tp' is named twice"),
])
def test_bad_mesh(tmp_path: Path, seq: Doc, dist: Doc, axes: list[Doc], where: str, reason: str) -> None:
    dist["mesh"]["axes"] = axes
    fails(tmp_path, seq, dist, "dist", where, reason)


# ---------------------------------------------------------------------------------------
# collectives across ranks


def test_rank_missing_its_partner_collective(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    nodes = dist["ranks"][1]["graph"]["nodes"]
    nodes.remove(rank_node(dist, 1, "fc2_sum"))
    rank_node(dist, 1, "fc2_bias")["args"] = ["fc2", "b2"]
    fails(tmp_path, seq, dist, "dist", "$.ranks[0].graph.nodes[4]", "collective #0 of group [0, 1]",
          "all_reduce 'fc2_sum'", "no partner on rank 1")


def test_partner_collective_with_other_group_order(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    rank_node(dist, 1, "fc2_sum")["attrs"]["group"] = [1, 0]
    fails(tmp_path, seq, dist, "dist", "$.ranks[0].graph.nodes[4]", "no partner on rank 1")


def test_partner_collective_with_other_attrs(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    rank_node(dist, 1, "fc2_sum")["attrs"]["reduce_op"] = "max"
    fails(tmp_path, seq, dist, "dist", "$.ranks[1].graph.nodes[4]", "collective #0 of group [0, 1]",
          '"reduce_op": "max"', '"reduce_op": "sum"', "on rank 0")


def test_partner_collective_with_other_op(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    rank_node(dist, 1, "fc2_sum").update(op="broadcast", attrs={"src": 0, "group": [0, 1]})
    fails(tmp_path, seq, dist, "dist", "$.ranks[1].graph.nodes[4]", "is broadcast", "but all_reduce")


def test_partner_collectives_on_different_shapes(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    for r, arg, shape in ((0, "x", [8, 16]), (1, "b2", [16])):
        dist["ranks"][r]["graph"]["nodes"].append(
            {"name": "extra", "op": "all_reduce", "args": [arg], "shape": shape, "attrs": {"group": [0, 1]}})
    fails(tmp_path, seq, dist, "dist", "$.ranks[1].graph.nodes[6].args[0]", "collective #1 of group [0, 1]",
          "float32[16] on rank 1", "float32[8, 16] on rank 0")


def test_rank_not_in_its_own_group(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    rank_node(dist, 1, "fc2_sum")["attrs"]["group"] = [0]
    fails(tmp_path, seq, dist, "dist", "$.ranks[1].graph.nodes[4].attrs.group",
          "rank 1 runs a collective of group [0] it is not in")


def test_group_names_rank_outside_mesh(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    rank_node(dist, 0, "fc2_sum")["attrs"]["group"] = [0, 1, 2]
    fails(tmp_path, seq, dist, "dist", "$.ranks[0].graph.nodes[4].attrs.group", "rank 2 is not in the mesh")


def _send_recv(dist: Doc, send_to: int | None = 1, recv_from: int | None = 0, recv_shape: list[int] | None = None
               ) -> None:
    if send_to is not None:
        dist["ranks"][0]["graph"]["nodes"].append(
            {"name": "tx", "op": "send", "args": ["x"], "shape": [8, 16], "attrs": {"peer": send_to}})
    if recv_from is not None:
        dist["ranks"][1]["graph"]["nodes"].append(
            {"name": "rx", "op": "recv", "args": [], "shape": recv_shape or [8, 16],
             "attrs": {"peer": recv_from, "shape": recv_shape or [8, 16]}})


def test_send_recv_pair_loads(tmp_path: Path, seq: Doc, dist: Doc, registry: Registry) -> None:
    _send_recv(dist)
    s, d = write(tmp_path, seq, dist)
    load_dist(d, registry, load_seq(s, registry))


def test_send_without_recv(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    _send_recv(dist, recv_from=None)
    fails(tmp_path, seq, dist, "dist", "$.ranks[0].graph.nodes[6]", "rank 0 sends 'x'", "rank 1 has 0 matching recv")


def test_recv_without_send(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    _send_recv(dist, send_to=None)
    fails(tmp_path, seq, dist, "dist", "$.ranks[1].graph.nodes[6]", "rank 1 receives 'rx'", "0 matching send")


def test_recv_shape_differs_from_send(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    _send_recv(dist, recv_shape=[16, 8])
    fails(tmp_path, seq, dist, "dist", "$.ranks[1].graph.nodes[6]", "expects float32[16, 8]", "sends float32[8, 16]")


@pytest.mark.parametrize("peer,reason", [(0, "cannot send to itself"), (5, "peer rank 5 is not in the mesh")])
def test_bad_peer(tmp_path: Path, seq: Doc, dist: Doc, peer: int, reason: str) -> None:
    _send_recv(dist, send_to=peer, recv_from=None)
    fails(tmp_path, seq, dist, "dist", "$.ranks[0].graph.nodes[6].attrs.peer", reason)


# ---------------------------------------------------------------------------------------
# relations


def test_relation_to_unknown_seq_input(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    dist["relations"][1]["from"] = "w_1"
    fails(tmp_path, seq, dist, "dist", "$.relations[1].from", "'w_1' is not an input of the sequential graph")


def test_relation_to_unknown_rank_input(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    dist["relations"][1]["input"] = "w1_shard"
    fails(tmp_path, seq, dist, "dist", "$.relations[1].input", "'w1_shard' is not an input of rank 0")


def test_relation_twice(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    dist["relations"].append({"from": "x", "placements": ["Replicate"]})
    fails(tmp_path, seq, dist, "dist", "$.relations[5].from", "a second relation for sequential input 'x'",
          "$.relations[0]")


def test_relation_without_placements_or_layout(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    del dist["relations"][0]["placements"]
    fails(tmp_path, seq, dist, "dist", "$.relations[0]", "needs 'placements' or 'layout'")


def test_guessed_must_be_a_bool_on_a_placed_relation(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    dist["relations"][0]["guessed"] = "yes"
    fails(tmp_path, seq, dist, "dist", "$.relations[0].guessed", "expected")
    dist["relations"][0] = {"from": dist["relations"][0]["from"], "layout": "x@0", "guessed": "yes"}
    fails(tmp_path, seq, dist, "dist", "$.relations[0].guessed", "expected")  # a layout may be a guess too


def test_relation_with_placements_and_layout(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    dist["relations"][0]["layout"] = "x@0"
    fails(tmp_path, seq, dist, "dist", "$.relations[0].placements", "either 'layout' or 'input'/'placements'")


def test_no_relation_and_no_rank_input_of_that_shape(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    del dist["relations"][1]  # w1 is sharded: the replicated guess does not fit
    fails(tmp_path, seq, dist, "dist", "$.relations", "no relation for sequential input 'w1'")


@pytest.mark.parametrize("placements,where,reason", [
    ([], "$.relations[1].placements", "one placement per mesh axis (1: tp), got 0"),
    (["Shard(1)", "Replicate"], "$.relations[1].placements", "one placement per mesh axis (1: tp), got 2"),
    (["Shard(one)"], "$.relations[1].placements[0]", "unknown placement 'Shard(one)'"),
    (["Sharded(1)"], "$.relations[1].placements[0]", "unknown placement 'Sharded(1)'"),
    ([1], "$.relations[1].placements[0]", "a placement is a string"),
    (["Shard(2)"], "$.relations[1].placements[0]", "Shard(2) is out of range for sequential input 'w1'"),
    ({"dp": "Shard(1)"}, "$.relations[1].placements.dp", "unknown mesh axis 'dp'"),
])
def test_bad_placements(tmp_path: Path, seq: Doc, dist: Doc, placements: Any, where: str, reason: str) -> None:
    dist["relations"][1]["placements"] = placements
    fails(tmp_path, seq, dist, "dist", where, reason)


def test_placements_by_axis_name_and_negative_dim_load(tmp_path: Path, seq: Doc, dist: Doc, registry: Registry) -> None:
    dist["relations"][1]["placements"] = {"tp": "Shard(-1)"}
    s, d = write(tmp_path, seq, dist)
    rel = load_dist(d, registry, load_seq(s, registry)).relations[1]
    assert str(rel.placements[0]) == "Shard(1)"


def test_pieces_do_not_make_the_seq_shape(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    dist["relations"][1]["placements"] = ["Shard(0)"]  # w1 is [16, 16] per rank: Shard(0) makes [32, 16]
    fails(tmp_path, seq, dist, "dist", "$.relations[1].placements", "pieces of 'w1'", "make shape [32, 16]",
          "sequential input has [16, 32]")


def test_replicas_of_different_shapes(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    seq["graph"]["inputs"].append({"name": "z", "shape": [4]})
    for r, shape in ((0, [4]), (1, [2])):
        dist["ranks"][r]["graph"]["inputs"].append({"name": "z", "shape": shape})
    dist["relations"].append({"from": "z", "placements": ["Replicate"]})
    fails(tmp_path, seq, dist, "dist", "$.relations[5].placements", "rank 0 holds shape [4] but rank 1 holds [2]",
          "replicas")


@pytest.mark.parametrize("layout,reason", [
    ("cat(w1@0, w1@1, dim=1", "unexpected end"),
    ("cat(w1@0, , dim=1)", "syntax error"),
    ("cat(w1@0, w1@1)", "cat needs dim="),
    ("slice(w1@0)", "syntax error"),
    ("view(w1@0, [4, x])", "syntax error"),
    ("concat(w1@0, w1@1, dim=1)", "'concat' is not in the relation language"),
    ("w1 @ 0 $", "unexpected character"),
    ("scale(cat(w1@0, w1@1, dim=1), w1@0)", "scale takes 1 tensor(s), got 2"),
    ("scale(cat(w1@0, w1@1, dim=1))", "scale takes 1 number argument(s)"),
    ("scale(cat(w1@0, w1@1, dim=1), 1/0)", "division by zero"),
    ("cat(w1@0, w1@1, dim=1/2)", "dim must be an integer"),
    ("transpose(transpose(cat(w1@0, w1@1, dim=1), 0, 1), 0, 1, 2)", "transpose takes 2 number argument(s)"),
    ("sum(cat(w1@0, w1@1, dim=1), 0)", "sum takes tensors only"),
])
def test_layout_syntax_error(tmp_path: Path, seq: Doc, dist: Doc, layout: str, reason: str) -> None:
    dist["relations"][1] = {"from": "w1", "layout": layout}
    fails(tmp_path, seq, dist, "dist", "$.relations[1].layout", reason)


@pytest.mark.parametrize("layout,reason", [
    ("cat(w1@0, w9@1, dim=1)", "'w9@1' is not an input of rank 1"),
    ("cat(w1@0, fc1@1, dim=1)", "'fc1@1' is not an input of rank 1"),
    ("cat(w1@0, w1@2, dim=1)", "there is no rank 2"),
    ("cat(w1@0, w1@1, dim=0)", "makes shape [32, 16], but the sequential input has [16, 32]"),
    ("cat(w1@0, b1@1, dim=1)", "ill-shaped"),
    ("slice(w1@0, 0, 0, 99)", "out of bounds"),
])
def test_layout_names_and_shapes(tmp_path: Path, seq: Doc, dist: Doc, layout: str, reason: str) -> None:
    dist["relations"][1] = {"from": "w1", "layout": layout}
    fails(tmp_path, seq, dist, "dist", "$.relations[1].layout", reason)


def test_good_layout_loads(tmp_path: Path, seq: Doc, dist: Doc, registry: Registry) -> None:
    dist["relations"][1] = {"from": "w1", "layout": "cat(w1@0, w1@1, dim=1)"}
    s, d = write(tmp_path, seq, dist)
    assert load_dist(d, registry, load_seq(s, registry)).relations[1].layout is not None


# ---------------------------------------------------------------------------------------
# expectations


def test_expectation_names_unknown_output(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    dist["expectations"][0]["output"] = "loss"
    fails(tmp_path, seq, dist, "dist", "$.expectations[0].output", "'loss' is not an output of the sequential graph")


def test_expectation_names_unknown_rank_output(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    dist["expectations"][0]["local"] = "y_local"
    fails(tmp_path, seq, dist, "dist", "$.expectations[0].local", "'y_local' is not an output of rank 0")


def test_expectation_twice(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    dist["expectations"].append({"output": "y"})
    fails(tmp_path, seq, dist, "dist", "$.expectations[1].output", "a second expectation for output 'y'")


def test_expectation_placements_make_wrong_shape(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    dist["expectations"][0]["placements"] = ["Shard(0)"]
    fails(tmp_path, seq, dist, "dist", "$.expectations[0].placements", "makes shape [16, 16]",
          "sequential output 'y' has [8, 16]")


def test_expectation_wrong_number_of_placements(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    dist["expectations"][0]["placements"] = ["Replicate", "Replicate"]
    fails(tmp_path, seq, dist, "dist", "$.expectations[0].placements", "one placement per mesh axis")


# ---------------------------------------------------------------------------------------
# through the CLI: exit code 2, `file: json-path: reason` on stderr, no traceback


def run_cli(seq: Path, dist: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "refine.cli", "check", str(seq), str(dist), *extra],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def assert_bad_input(p: subprocess.CompletedProcess[str], message: str) -> None:
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    assert message in p.stderr, p.stderr


def test_cli_malformed_json(tmp_path: Path, dist: Doc) -> None:
    s, d = write(tmp_path, '{"format": "refine-graph",\n  "version": 1,,\n}', dist)
    assert_bad_input(run_cli(s, d), f"error: {s}: line 2 column 16: malformed JSON: Expecting property name")


def test_cli_unpartnered_collective_and_json_format(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    rank_node(dist, 1, "fc2_sum")["attrs"]["group"] = [1, 0]
    s, d = write(tmp_path, seq, dist)
    assert_bad_input(run_cli(s, d), f"error: {d}: $.ranks[0].graph.nodes[4]: collective #0 of group [0, 1]")
    p = run_cli(s, d, "--format", "json")
    assert p.returncode == 2
    out = json.loads(p.stdout)
    assert out["verdict"] == "BAD INPUT" and out["error"].startswith(f"{d}: $.ranks[0].graph.nodes[4]: ")


def test_cli_unknown_op(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    rank_node(dist, 1, "act")["op"] = "fast_gelu"
    s, d = write(tmp_path, seq, dist)
    assert_bad_input(run_cli(s, d), f"{d}: $.ranks[1].graph.nodes[2].op: unknown op 'fast_gelu' in node 'act'")


def test_cli_missing_file(tmp_path: Path, seq: Doc) -> None:
    s, _ = write(tmp_path, seq, "{}")
    missing = tmp_path / "missing" / "dist.json"
    assert_bad_input(run_cli(s, missing), f"{missing}: $: cannot read: No such file or directory")


def test_cli_directory(tmp_path: Path, seq: Doc) -> None:
    s, _ = write(tmp_path, seq, "{}")
    p = run_cli(s, tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert str(tmp_path) in p.stderr and "directory" in p.stderr


# ---------------------------------------------------------------------------------------
# symbolic sizes

SYM_CASE = ROOT / "models" / "sp_mlp_symbolic"


@pytest.fixture
def sym_seq() -> Doc:
    return json.loads((SYM_CASE / "seq.json").read_text())


@pytest.fixture
def sym_dist() -> Doc:
    return json.loads((SYM_CASE / "dist.json").read_text())


def test_undeclared_symbol(tmp_path: Path, seq: Doc, dist: Doc) -> None:
    seq["graph"]["inputs"][0]["shape"] = ["T", 16]
    fails(tmp_path, seq, dist, "seq", "$.graph.inputs[0].shape[0]", "cannot read size 'T'", "symbols: none declared")


@pytest.mark.parametrize("spec, where, reason", [
    ({"T": {"min": -1}}, "$.symbols.T.min", "at least 0"),
    ({"T": {"multiple_of": 0}}, "$.symbols.T.multiple_of", "at least 1"),
    ({"T": {"max": 9}}, "$.symbols.T.max", "unknown field 'max'"),
    ({"T": {"min": "1"}}, "$.symbols.T.min", "expected integer"),
    ({"1T": {}}, "$.symbols.1T", "identifier"),
    ({"T": 4}, "$.symbols.T", "expected an object"),
])
def test_bad_symbol_declaration(tmp_path: Path, seq: Doc, dist: Doc, spec: Doc, where: str, reason: str) -> None:
    seq["symbols"] = spec
    fails(tmp_path, seq, dist, "seq", where, reason)


@pytest.mark.parametrize("text, reason", [
    ("T/3", "not provably divisible by 3"),  # T is a multiple of 2, not of 3
    ("T-4", "not provably non-negative"),
    ("T+", "cannot read size"),
    ("H*(T", "cannot read size"),
    ("__import__('os')", "cannot read size"),
])
def test_bad_size_expression(tmp_path: Path, sym_seq: Doc, sym_dist: Doc, text: str, reason: str) -> None:
    sym_seq["graph"]["inputs"][0]["shape"][0] = text
    fails(tmp_path, sym_seq, sym_dist, "seq", "$.graph.inputs[0].shape[0]", reason)


def test_dist_redeclares_a_symbol_differently(tmp_path: Path, sym_seq: Doc, sym_dist: Doc) -> None:
    sym_dist["symbols"] = {"T": {"min": 1, "multiple_of": 4}}
    fails(tmp_path, sym_seq, sym_dist, "dist", "$.symbols.T", "multiple_of 4 here", "multiple_of 2 in the sequential file")


def test_symbolic_rank_shape_disagrees_with_its_op(tmp_path: Path, sym_seq: Doc, sym_dist: Doc) -> None:
    for r in sym_dist["ranks"]:
        r["graph"]["inputs"][0]["shape"][0] = "T"  # every rank holds all T tokens
    fails(tmp_path, sym_seq, sym_dist, "dist", "$.ranks[0].graph.nodes[0].shape",
          "has shape [T/2, H] but its inputs give [T, H]")


def test_symbolic_node_shape_disagrees_with_its_op(tmp_path: Path, sym_seq: Doc, sym_dist: Doc) -> None:
    node = sym_seq["graph"]["nodes"][1]  # fc1: [T, H] @ [H, 32]
    node["shape"] = ["T", "2*H"]
    fails(tmp_path, sym_seq, sym_dist, "seq", "$.graph.nodes[1].shape", "has shape [T, 2*H] but its inputs give [T, 32]")


def test_symbolic_reduce_scatter_needs_provable_divisibility(tmp_path: Path, sym_seq: Doc, sym_dist: Doc) -> None:
    sym_seq["symbols"]["T"]["multiple_of"] = 1
    fails(tmp_path, sym_seq, sym_dist, "dist", "$.ranks[0].graph.inputs[0].shape[0]", "not provably divisible by 2")


def test_a_crash_is_exit_2_not_a_verdict(tmp_path: Path, seq: Doc, dist: Doc,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An unexpected exception inside the check is no verdict: exit 2 naming it, never
    Python's exit 1, which would read as "does not refine"."""
    from click.testing import CliRunner

    from refine.cli import main

    def boom(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("something broke")

    monkeypatch.setattr(sys.modules["refine.check"], "check_files", boom)
    s, d = write(tmp_path, seq, dist)
    r = CliRunner().invoke(main, ["check", str(s), str(d)])
    assert r.exit_code == 2
    assert "internal error" in r.output and "something broke" in r.output
