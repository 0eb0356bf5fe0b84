"""A REFINES that checks no computation is no proof. When every sequential output is an input
passed through (the input itself, a copy, x + 0.0, x * 1.0, a view or reshape of it: its
value given its shape) and so is every rank output it is compared with, the check has only
compared how the relations and the expectations place the inputs: `refine check` exits 2,
"nothing to check", naming the file. Before, it said REFINES (an Entangle pair imported
without its relation file kept a single output, a logged copy of an input).

What a program can get wrong is something to check, even without arithmetic: a transpose, a
slice, a broadcast, a concat, a gather across ranks, a constant (tests/unit/test_rules_repeat.py proves
a repeat of kv heads, unsqueeze + expand + reshape, split over the ranks). An output passed
through next to a computed one is checked as usual, and the report says which outputs check
a computation. A pass-through the ranks compute (a sum of partial inputs) is a check of the
rank program. A pass-through that does not hold is a wrong output: DOES NOT REFINE, exit 1
(see test_sound_localize.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from refine.check import check, check_files
from refine.cli import main
from refine.frontends.graphfile import load_dist, load_seq
from refine.ir.errors import InputError
from refine.ops.registry import load_registry
from tests.helpers import write_pair

REG = load_registry()


def node(name: str, op: str, args: list[Any], shape: list[int], attrs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"name": name, "op": op, "args": args, "shape": shape, **({"attrs": attrs} if attrs else {})}


def passthrough(kind: str, x: str, y: str, shape: list[int], out: str = "p") -> tuple[list[dict[str, Any]], str]:
    """Nodes making `out` from inputs x (and y) with no computation, and the tensor it is."""
    rows, cols = shape
    return {
        "input": ([], x),
        "clone": ([node(out, "clone", [x], shape)], out),
        "add0": ([node(out, "add", [x, 0.0], shape)], out),
        "mul1": ([node(out, "mul", [x, 1.0], shape)], out),
        "detach_clone": ([node(out + "_d", "detach", [x], shape), node(out, "clone", [out + "_d"], shape)], out),
        "view": ([node(out, "view", [x], [rows * cols], {"shape": [rows * cols]})], out),
        "view_back": ([node(out + "_v", "view", [x], [rows * cols], {"shape": [rows * cols]}),
                       node(out, "view", [out + "_v"], shape, {"shape": shape})], out),
        "unsqueeze_flatten": ([node(out + "_u", "unsqueeze", [x], [1, rows, cols], {"dim": 0}),
                               node(out, "flatten", [out + "_u"], [rows * cols])], out),
        # rearrangements a program can get wrong
        "cat": ([node(out, "cat", [x, y], [2 * rows, cols], {"dim": 0})], out),
        "transpose": ([node(out, "transpose", [x], [cols, rows], {"dim0": 0, "dim1": 1})], out),
        "slice": ([node(out, "slice", [x], [rows, cols // 2], {"dim": 1, "start": 0, "end": cols // 2})], out),
        "expand": ([node(out + "_u", "unsqueeze", [x], [1, rows, cols], {"dim": 0}),
                    node(out, "expand", [out + "_u"], [2, rows, cols], {"shape": [2, rows, cols]})], out),
        # not 0.0: a zero is its own negation (the check below negates a rank's output)
        "constant": ([node(out, "full", [], shape, {"shape": shape, "value": 2.0})], out),
    }[kind]


KINDS = ["input", "clone", "add0", "mul1", "detach_clone", "view", "view_back", "unsqueeze_flatten"]
MOVES = ["cat", "transpose", "slice", "expand", "constant"]


def case(kinds: list[str], computed: bool = False, rank_sum: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Inputs x, y [4, 4], replicated over 2 ranks; one output per kind, passed through on both
    sides; `computed`: one more output, relu(x), computed on both sides. `rank_sum`: x is a
    partial sum over the ranks, and the ranks all-reduce it before passing it on."""
    def graph(shape: list[int], rank: bool) -> dict[str, Any]:
        nodes, outputs = [], []
        x = "x"
        if rank and rank_sum:
            nodes.append(node("xs", "all_reduce", ["x"], shape, {"group": [0, 1]}))
            x = "xs"
        for i, k in enumerate(kinds):
            ns, ref = passthrough(k, x, "y", shape, f"p{i}")
            nodes += ns
            outputs.append({"name": f"o{i}", "ref": ref})
        if computed:
            nodes.append(node("r", "relu", [x], shape))
            outputs.append({"name": "c", "ref": "r"})
        return {"inputs": [{"name": "x", "shape": shape}, {"name": "y", "shape": shape}], "nodes": nodes,
                "outputs": outputs}

    seq = {"format": "refine-graph", "version": 1, "kind": "sequential", "graph": graph([4, 4], False)}
    dist = {"format": "refine-graph", "version": 1, "kind": "distributed",
            "mesh": {"axes": [{"name": "tp", "size": 2}]},
            "ranks": [{"rank": r, "graph": graph([4, 4], True)} for r in range(2)],
            "relations": [{"from": "x", "placements": ["Partial(sum)" if rank_sum else "Replicate"]},
                          {"from": "y", "placements": ["Replicate"]}]}
    return seq, dist


def _check(tmp: Path, seq: dict[str, Any], dist: dict[str, Any]) -> Any:
    s, d = write_pair(tmp, seq, dist)
    g = load_seq(s, REG)
    return check(g, load_dist(d, REG, g), REG, str(s), str(d))


@pytest.mark.parametrize("kinds", [[k] for k in KINDS] + [KINDS], ids=[*KINDS, "all"])
def test_only_passed_through_outputs_is_nothing_to_check(tmp_path: Path, kinds: list[str]) -> None:
    s, d = write_pair(tmp_path, *case(kinds))
    with pytest.raises(InputError) as e:
        check_files(s, d)
    assert e.value.file == str(s) and e.value.where == "$.graph.outputs"
    assert e.value.reason.startswith("nothing to check")
    r = CliRunner().invoke(main, ["check", str(s), str(d)])
    assert r.exit_code == 2 and "nothing to check" in r.output and str(s) in r.output, r.output
    r = CliRunner().invoke(main, ["check", str(s), str(d), "--format", "json"])
    assert r.exit_code == 2 and json.loads(r.output)["verdict"] == "BAD INPUT"


@pytest.mark.parametrize("kind", MOVES)
def test_a_rearranged_output_is_something_to_check(tmp_path: Path, kind: str) -> None:
    rep = _check(tmp_path, *case([kind]))
    assert rep.refines and rep.outputs[0].computed and "passed through" not in str(rep)
    # and the ranks doing it differently do not refine: it was a check
    seq, dist = case([kind])
    g = dist["ranks"][1]["graph"]
    g["nodes"].append(node("neg", "neg", [g["outputs"][0]["ref"]], g["nodes"][-1]["shape"]))
    g["outputs"][0]["ref"] = "neg"
    assert not _check(tmp_path / "wrong", seq, dist).refines


@pytest.mark.parametrize("kind", KINDS)
def test_a_passed_through_output_next_to_a_computed_one_is_checked(tmp_path: Path, kind: str) -> None:
    rep = _check(tmp_path, *case([kind], computed=True))
    assert rep.refines and rep.exit_code == 0
    by = {o.name: o for o in rep.outputs}
    assert not by["o0"].computed and by["o0"].ok and by["c"].computed
    doc = json.loads(rep.to_json())
    assert [o["computed"] for o in doc["outputs"]] == [False, True]
    assert "passed through o0" in " ".join(str(rep).split()) and "1 of 2 outputs check a computation" in \
        " ".join(str(rep).split())


def test_every_output_computed_says_nothing_more(tmp_path: Path) -> None:
    seq, dist = case([], computed=True)
    rep = _check(tmp_path, seq, dist)
    assert rep.refines and all(o.computed for o in rep.outputs) and "passed through" not in str(rep)


@pytest.mark.parametrize("kind", ["input", "clone", "view", "unsqueeze_flatten"])
def test_a_pass_through_the_ranks_compute_is_a_check_of_the_rank_program(tmp_path: Path, kind: str) -> None:
    """x is a partial sum over the ranks: the sequential output x is each rank's all-reduce."""
    seq, dist = case([kind], rank_sum=True)
    dist["expectations"] = [{"output": "o0", "placements": ["Replicate"]}]
    rep = _check(tmp_path, seq, dist)
    assert rep.refines and rep.outputs[0].computed


def test_a_pass_through_the_ranks_gather_is_something_to_check(tmp_path: Path) -> None:
    """The ranks assemble the sequential input from their shards: a gather is program."""
    seq, dist = case(["input"])
    dist["relations"][0]["placements"] = ["Shard(0)"]
    for r in dist["ranks"]:
        g = r["graph"]
        g["inputs"][0]["shape"] = [2, 4]
        g["nodes"] = [node("g", "all_gather", ["x"], [4, 4], {"dim": 0, "group": [0, 1]})]
        g["outputs"] = [{"name": "o0", "ref": "g"}]
    dist["expectations"] = [{"output": "o0", "placements": ["Replicate"]}]
    rep = _check(tmp_path, seq, dist)
    assert rep.refines and rep.outputs[0].computed
    for r in dist["ranks"]:  # gathered along the other dim: wrong
        r["graph"]["nodes"][0]["attrs"]["dim"] = 1
        r["graph"]["nodes"][0]["shape"] = [2, 8]
    seq["graph"]["nodes"] = [node("p", "view", ["x"], [2, 8], {"shape": [2, 8]})]
    seq["graph"]["outputs"] = [{"name": "o0", "ref": "p"}]
    assert not _check(tmp_path / "wrong", seq, dist).refines


def test_a_wrong_pass_through_does_not_refine(tmp_path: Path) -> None:
    """Every output passed through, but the ranks output y where the model outputs x: a wrong
    output is found, not "nothing to check" (exit 1)."""
    seq, dist = case(["input"])
    for r in dist["ranks"]:
        r["graph"]["outputs"] = [{"name": "o0", "ref": "y"}]
    s, d = write_pair(tmp_path, seq, dist)
    rep = check_files(s, d)
    assert not rep.refines and rep.culprit is not None and rep.culprit.output == "o0"
    r = CliRunner().invoke(main, ["check", str(s), str(d)])
    assert r.exit_code == 1 and "DOES NOT REFINE" in r.output


