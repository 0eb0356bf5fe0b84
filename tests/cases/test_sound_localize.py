"""Localizing a wrong output that is a sequential input passed through. An output that is an
input, or lowers to one (x + 0.0, x * 1.0, a copy), has no core node: localization took the
input for a node and crashed (AttributeError, no verdict, exit 2). Now it is DOES NOT REFINE
(exit 1), the culprit the user's node the output refers to (or the input itself), with the
rank nodes that make the wrong output.

Precedence with "nothing to check" (test_sound_vacuous.py): that applies only to a REFINES.
A pass-through output the ranks do not hold is a wrong output, found by comparing the rank
program with the model: DOES NOT REFINE, even when no output computes anything."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from refine.check import check_files
from refine.cli import main
from tests.cases.test_sound_vacuous import node, passthrough
from tests.helpers import write_pair

KINDS = ["input", "clone", "add0", "mul1", "detach_clone", "view"]


def case(kind: str, wrong_pass: bool, wrong_computed: bool, computed: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """x [4, 4] sharded by rows over 2 ranks. Output `o` passes x through (`kind`), output `c` is
    relu(x) (`computed`). `wrong_pass`: rank 1 doubles its `o`; `wrong_computed`: its `c`."""
    def graph(shape: list[int], rank: int | None) -> dict[str, Any]:
        nodes, ref = passthrough(kind, "x", "x", shape)
        nodes = list(nodes)
        if wrong_pass and rank == 1:
            out_shape = [shape[0] * shape[1]] if kind == "view" else shape
            nodes.append(node("bad", "mul", [ref, 2.0], out_shape))
            ref = "bad"
        outputs = [{"name": "o", "ref": ref}]
        if computed:
            nodes.append(node("r", "relu", ["x"], shape))
            c = "r"
            if wrong_computed and rank == 1:
                nodes.append(node("bad_r", "mul", ["r", 2.0], shape))
                c = "bad_r"
            outputs.append({"name": "c", "ref": c})
        return {"inputs": [{"name": "x", "shape": shape}], "nodes": nodes, "outputs": outputs}

    seq = {"format": "refine-graph", "version": 1, "kind": "sequential", "graph": graph([4, 4], None)}
    for n in seq["graph"]["nodes"]:
        n["source"] = f"model.py:{n['name']}"
    dist = {"format": "refine-graph", "version": 1, "kind": "distributed",
            "mesh": {"axes": [{"name": "dp", "size": 2}]},
            "ranks": [{"rank": r, "graph": graph([2, 4], r)} for r in range(2)],
            "relations": [{"from": "x", "placements": ["Shard(0)"]}],
            "expectations": [{"output": "o", "placements": ["Shard(0)"]}]
            + ([{"output": "c", "placements": ["Shard(0)"]}] if computed else [])}
    return seq, dist


@pytest.mark.parametrize("kind", KINDS)
def test_a_wrong_pass_through_output_is_localized(tmp_path: Path, kind: str) -> None:
    s, d = write_pair(tmp_path, *case(kind, wrong_pass=True, wrong_computed=False))
    rep = check_files(s, d)
    assert not rep.refines
    by = {o.name: o for o in rep.outputs}
    assert not by["o"].ok and by["c"].ok
    c = rep.culprit
    assert c is not None and c.output == "o"
    if kind == "input":
        assert (c.node, c.op, c.source) == ("x", "input", None)
    else:  # the user's node the output refers to, at its line
        assert c.node == "p" and c.source == "model.py:p"
    # the rank node that makes the wrong output is shown
    assert any("bad" in x and "computes o@1" in x for x in c.rank_nodes), c.rank_nodes
    r = CliRunner().invoke(main, ["check", str(s), str(d), "--format", "json"])
    assert r.exit_code == 1, r.output
    assert json.loads(r.output)["culprit"]["output"] == "o"


@pytest.mark.parametrize("kind", KINDS)
def test_both_wrong(tmp_path: Path, kind: str) -> None:
    s, d = write_pair(tmp_path, *case(kind, wrong_pass=True, wrong_computed=True))
    rep = check_files(s, d)
    assert not rep.refines and not any(o.ok for o in rep.outputs)
    assert rep.culprit is not None and rep.culprit.output in ("o", "c")
    assert CliRunner().invoke(main, ["check", str(s), str(d)]).exit_code == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_wrong_pass_through_alone_does_not_refine(tmp_path: Path, kind: str) -> None:
    """No output computes anything in the model, and the ranks' one is wrong: exit 1, not
    "nothing to check"."""
    s, d = write_pair(tmp_path, *case(kind, wrong_pass=True, wrong_computed=False, computed=False))
    rep = check_files(s, d)
    assert not rep.refines and rep.culprit is not None and rep.culprit.output == "o"
    r = CliRunner().invoke(main, ["check", str(s), str(d)])
    assert r.exit_code == 1 and "DOES NOT REFINE" in r.output, r.output
