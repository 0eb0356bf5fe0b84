"""Names are data. Every tensor, node, input and output name reaches egglog only through
`refine.ir.term.quote` (and comes back through `unquote`): a name holding a quote, a paren, a
newline or egglog syntax neither crashes the engine nor changes what it proves. Before,
names were pasted into egglog text as they were: a crafted rank output name added a rule
that made every sequential value equal to every concat of rank outputs, and a buggy program
REFINES; a name holding `"` crashed.

The family: hostile names in every place a name can stand (sequential inputs, nodes and
outputs; rank inputs, nodes and outputs; relation sources and locals, layouts; expectation
locals and layouts; defines), on a correct program (REFINES, names intact in the report and
its JSON) and a buggy one (DOES NOT REFINE, the culprit named intact)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from refine.check import check
from refine.cli import main
from refine.frontends.graphfile import load_dist, load_seq
from refine.ir.errors import InputError
from refine.ir.sexp import parse_one
from refine.ir.term import (
    LayoutSyntaxError,
    Term,
    from_egglog,
    leaf,
    parse_layout,
    quote,
    to_egglog,
    unquote,
)
from refine.ops.registry import load_registry
from tests.helpers import write_pair

REG = load_registry()

HOSTILE = [
    'q"uote', "back\\slash", "trail\\", "pa(ren)s", ")", "(", "new\nline", "tab\there", "cr\rlf",
    "uni✓é", "😀", "nul\x00byte", "union", "rule", "let", "run", "; comment", "%41", "%", " ",
    '") (union (D "a") (D "b")) (D "', "$__seq", "t0", "(Out \"y0\")",
]

# A payload aimed at egglog text `(union (D "T") (Out "NAME@r"))`: it closes the string and
# the union, adds a rule putting every concat of two rank outputs in each marked class (the
# sequential value a step proves), and balances the rest. Against the unquoted engine it
# turned the buggy program below into REFINES.
FORGE = ('k")) (rule ((= m (Mark x)) (= a (Out n1)) (= b (Out n2)) (!= n1 n2)) ((union x (cat a b 0)))) '
         '(union (Out "z") (Out "z')
FORGES = [
    FORGE,
    # the same rule against the other shapes of egglog text a name is pasted in
    'k") (rule ((= m (Mark x)) (= a (Out n1)) (= b (Out n2)) (!= n1 n2)) ((union x (cat a b 0)))) (D "k',
    'k")) (rule ((= m (Mark x)) (= a (Out n1))) ((union x a))) (union (Out "z") (Out "z',
    # canonical leaf names (a step's program renames leaves t0, t1, o2...) spelled to dodge the renaming
    'k")) (union ( D "t0") ( Out "o1")) (union ( D "t2") ( Out "o3")) (union (Out "z") (Out "z',
]


def _layout_name(name: str) -> str:
    """`name` quoted in the relation language."""
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _names(n: str) -> dict[str, str]:
    """A distinct name per place, each holding `n` (at the start, middle or end)."""
    return {"x": f"x{n}", "w": f"{n}w", "h": f"h{n}h", "k": n, "m": f"m{n}", "y": f"y{n}",
            "rx": f"rx{n}", "rw": n, "rh": f"rh{n}", "rk": f"{n}rk", "rm": f"rm{n}", "ry": f"{n}ry"}


def pair(names: dict[str, str], bug: bool = False, layouts: bool = False, extra_output: str | None = None
         ) -> tuple[dict[str, Any], dict[str, Any]]:
    """y = -relu(x @ w), x sharded by rows over 2 ranks, w replicated, y sharded. `bug`: rank 1
    doubles its product before the relu (the negation then reads an unclean value: an opaque
    leaf named after the sequential relu). `layouts`: relations, expectation and defines are
    written in the relation language (quoted names) instead of placements. `extra_output`:
    rank 0 also outputs its result under that name (a rank output no expectation reads)."""
    n = names
    seq = {"format": "refine-graph", "version": 1, "kind": "sequential", "graph": {
        "inputs": [{"name": n["x"], "shape": [4, 4]}, {"name": n["w"], "shape": [4, 4], "role": "parameter"}],
        "nodes": [{"name": n["h"], "op": "matmul", "args": [n["x"], n["w"]], "shape": [4, 4], "source": "seq.py:1"},
                  {"name": n["k"], "op": "relu", "args": [n["h"]], "shape": [4, 4], "source": "seq.py:2"},
                  {"name": n["m"], "op": "neg", "args": [n["k"]], "shape": [4, 4], "source": "seq.py:3"}],
        "outputs": [{"name": n["y"], "ref": n["m"], "role": "activation"}]}}
    ranks = []
    for r in range(2):
        nodes = [{"name": n["rh"], "op": "matmul", "args": [n["rx"], n["rw"]], "shape": [2, 4]}]
        last = n["rh"]
        if bug and r == 1:
            nodes.append({"name": n["rh"] + "2", "op": "mul", "args": [last, 2.0], "shape": [2, 4]})
            last = n["rh"] + "2"
        nodes.append({"name": n["rk"], "op": "relu", "args": [last], "shape": [2, 4]})
        nodes.append({"name": n["rm"], "op": "neg", "args": [n["rk"]], "shape": [2, 4]})
        outputs = [{"name": n["ry"], "ref": n["rm"]}]
        if extra_output is not None and r == 0:
            outputs.append({"name": extra_output, "ref": n["rm"]})
        ranks.append({"rank": r, "graph": {
            "inputs": [{"name": n["rx"], "shape": [2, 4]}, {"name": n["rw"], "shape": [4, 4], "role": "parameter"}],
            "nodes": nodes, "outputs": outputs}})
    if layouts:
        rx, rw, ry = (_layout_name(n[k]) for k in ("rx", "rw", "ry"))
        relations: list[dict[str, Any]] = [
            {"from": n["x"], "layout": f"cat({rx}@0, {rx}@1, dim=0)"},
            {"from": n["w"], "layout": [f"{rw}@0", f"{rw}@1"]},
            *({"define": f"{n['rw']}@{r}", "as": _layout_name(n["w"])} for r in range(2))]
        expectations = [{"output": n["y"], "layout": f"cat({ry}@0, {ry}@1, dim=0)"}]
    else:
        relations = [{"from": n["x"], "input": n["rx"], "placements": ["Shard(0)"]},
                     {"from": n["w"], "input": n["rw"], "placements": ["Replicate"]}]
        expectations = [{"output": n["y"], "local": n["ry"], "placements": ["Shard(0)"]}]
    dist = {"format": "refine-graph", "version": 1, "kind": "distributed",
            "mesh": {"axes": [{"name": "dp", "size": 2}]}, "ranks": ranks,
            "relations": relations, "expectations": expectations}
    return seq, dist


def _check(tmp: Path, seq: dict[str, Any], dist: dict[str, Any]) -> Any:
    s, d = write_pair(tmp, seq, dist)
    g = load_seq(s, REG)
    return check(g, load_dist(d, REG, g), REG)


# ---------------------------------------------------------------------------------------
# The quoting itself


def test_quote_round_trips_every_string_in_safe_characters() -> None:
    rng = random.Random(20)
    samples = HOSTILE + FORGES + ["", "plain.name_0", "x#copies@3", "\ud800", "\udfff\ud800", "\U0010ffff"]
    for _ in range(3000):
        samples.append("".join(chr(rng.choice([rng.randrange(0, 128), rng.randrange(0, 0x110000)]))
                               for _ in range(rng.randrange(0, 10))))
    for s in samples:
        q = quote(s)
        assert unquote(q) == s
        assert re.fullmatch(r'"[A-Za-z0-9_.~@#/:+=,\[\]<>%-]*"', q), q
    # ordinary names are written as they are (readable egglog text, unchanged step caches)
    assert quote("layers.0.attn.w@1") == '"layers.0.attn.w@1"'


@pytest.mark.parametrize("name", HOSTILE + FORGES)
def test_term_leaves_round_trip_through_egglog_text(name: str) -> None:
    sorts = {"cat": ("i64",)}
    for op in ("D", "Out", "Opq"):
        t = Term("cat", (Term(op, (), (name + "@0",)), leaf("b@1")), (0,))
        text = to_egglog(t, sorts)
        assert text.count("(") == text.count(")") == 3  # nothing of the name is syntax
        assert from_egglog(parse_one(text), sorts) == t


# ---------------------------------------------------------------------------------------
# The relation language: quoted names


def test_layout_quoted_names() -> None:
    t = parse_layout(r'cat("a b"@0, "say \"hi\"\\"@1, plain@2, dim=0)')
    assert t.leaves() == {"a b@0", 'say "hi"\\@1', "plain@2"}
    assert parse_layout('"new\nline"@3').leaves() == {"new\nline@3"}
    assert parse_layout(r'sum("x)"@0, scale("(y"@1, 1/2))').leaves() == {"x)@0", "(y@1"}
    assert parse_layout('cat("a", zeros([2]), dim=0)', sequential=True).leaves() == {"a"}
    for bad, seq in (('"a"', False), ('"a"@0', True), (r'"a\n"@0', False), ('"a@0', False), ('"a"@', False)):
        with pytest.raises(LayoutSyntaxError):
            parse_layout(bad, sequential=seq)


# ---------------------------------------------------------------------------------------
# Whole checks


@pytest.mark.parametrize("layouts", [False, True], ids=["placements", "layouts"])
@pytest.mark.parametrize("n", HOSTILE)
def test_correct_program_with_hostile_names_refines(tmp_path: Path, n: str, layouts: bool) -> None:
    names = _names(n)
    rep = _check(tmp_path, *pair(names, layouts=layouts))
    assert rep.refines, str(rep)
    (out,) = rep.outputs
    assert out.ok and out.name == names["y"]
    assert out.relation == f"cat({names['ry']}@0, {names['ry']}@1, dim=0)"
    doc = json.loads(rep.to_json())
    assert doc["verdict"] == "REFINES" and doc["outputs"][0]["name"] == names["y"]
    assert "REFINES" in str(rep)


@pytest.mark.parametrize("layouts", [False, True], ids=["placements", "layouts"])
@pytest.mark.parametrize("n", HOSTILE)
def test_buggy_program_with_hostile_names_does_not_refine(tmp_path: Path, n: str, layouts: bool) -> None:
    names = _names(n)
    rep = _check(tmp_path, *pair(names, bug=True, layouts=layouts))
    assert not rep.refines
    assert rep.culprit is not None and rep.culprit.node in (names["h"], names["k"], names["m"])
    assert rep.culprit.output == names["y"]
    assert json.loads(rep.to_json())["culprit"]["node"] == rep.culprit.node


@pytest.mark.parametrize("place", ["extra_output", "ry", "rm", "rk", "rh", "rx", "rw", "k"])
@pytest.mark.parametrize("payload", FORGES, ids=[f"forge{i}" for i in range(len(FORGES))])
def test_forging_names_do_not_make_a_buggy_program_refine(tmp_path: Path, payload: str, place: str) -> None:
    names = {"x": "x", "w": "w", "h": "h", "k": "k", "m": "m", "y": "y",
             "rx": "x", "rw": "w", "rh": "h", "rk": "k", "rm": "m", "ry": "y"}
    extra = None
    if place == "extra_output":
        extra = payload
    else:
        names[place] = payload
    rep = _check(tmp_path, *pair(names, bug=True, extra_output=extra))
    assert not rep.refines, str(rep)
    assert rep.culprit is not None and rep.culprit.node in (names["h"], names["k"], names["m"])
    # and the same names on the correct program: the names change nothing
    rep = _check(tmp_path / "ok", *pair(names, extra_output=extra))
    assert rep.refines, str(rep)


def test_forged_output_name_through_the_cli(tmp_path: Path) -> None:
    """The attack end to end: exit 1, the hostile name intact in the JSON report."""
    names = {"x": "x", "w": "w", "h": "h", "k": "k", "m": "m", "y": "y",
             "rx": "x", "rw": "w", "rh": "h", "rk": "k", "rm": "m", "ry": "y"}
    s, d = write_pair(tmp_path, *pair(names, bug=True, extra_output=FORGE))
    r = CliRunner().invoke(main, ["check", str(s), str(d), "--format", "json"])
    assert r.exit_code == 1, r.output
    doc = json.loads(r.output)
    assert doc["verdict"] == "DOES NOT REFINE"
    s, d = write_pair(tmp_path / "ok", *pair({**names, "ry": FORGE}))
    r = CliRunner().invoke(main, ["check", str(s), str(d), "--format", "json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["outputs"][0]["local"] == FORGE
    assert doc["outputs"][0]["relation"] == f"cat({FORGE}@0, {FORGE}@1, dim=0)"
    r = CliRunner().invoke(main, ["check", str(s), str(d)])
    assert r.exit_code == 0 and "REFINES" in r.output


# ---------------------------------------------------------------------------------------
# The loader: any Unicode text is a name (but '@' and the empty name); half a surrogate pair
# is no text (the report could not print it): exit 2 at load, naming the place


def test_names_with_a_surrogate_pair_escape_load(tmp_path: Path) -> None:
    names = _names("\U0001f600")
    seq, dist = pair(names)
    text = json.dumps(seq)  # ensure_ascii: the emoji is written as the pair \ud83d\ude00
    assert "\\ud83d\\ude00" in text
    (tmp_path / "seq.json").write_text(text)
    assert load_seq(tmp_path / "seq.json", REG).nodes[1].name == names["k"]


@pytest.mark.parametrize("half", ["\\ud800", "\\udfff", "\\uDC00x"])
@pytest.mark.parametrize("where", ["node", "output", "source"])
def test_half_a_surrogate_pair_is_refused_at_load(tmp_path: Path, half: str, where: str) -> None:
    seq, dist = pair(_names("n"))
    marker = "MARK"
    if where == "node":
        seq["graph"]["nodes"][1]["name"] = marker
        seq["graph"]["outputs"][0]["ref"] = marker
        at = "$.graph.nodes[1].name"
    elif where == "output":
        seq["graph"]["outputs"][0]["name"] = marker
        at = "$.graph.outputs[0].name"
    else:
        seq["graph"]["nodes"][0]["source"] = marker
        at = "$.graph.nodes[0].source"
    (tmp_path / "seq.json").write_text(json.dumps(seq).replace(marker, "a" + half))
    with pytest.raises(InputError) as e:
        load_seq(tmp_path / "seq.json", REG)
    assert e.value.where == at and "surrogate" in e.value.reason
    (tmp_path / "dist.json").write_text(json.dumps(dist))
    r = CliRunner().invoke(main, ["check", str(tmp_path / "seq.json"), str(tmp_path / "dist.json")])
    assert r.exit_code == 2 and "seq.json" in r.output and at in r.output


# ---------------------------------------------------------------------------------------
# Names refine makes itself never take a rank tensor's name: refine.prove.copies joins a synthetic
# `x#copies@r` to x; a rank's own tensor of that name had its definition replaced and was
# made equal to x


@pytest.mark.slow
def test_a_rank_tensor_named_like_the_synthetic_copies_keeps_its_definition(tmp_path: Path) -> None:
    from refine.check import engine_for
    from refine.prove.copies import join_copies
    from refine.relate.program import build_program, seq_input_relations
    from tests.unit.test_prove_copies import _case

    s, d = _case(tmp_path)
    doc = json.loads(d.read_text())
    for r in doc["ranks"]:  # each rank's key with its rotary halves swapped, named rk#copies, used for rk
        nodes = r["graph"]["nodes"]
        i = next(k for k, n in enumerate(nodes) if n["name"] == "rk")
        sh = nodes[i]["shape"]
        half = sh[2] // 2
        swap = [node_doc("rk_hi", "slice", ["rk"], sh[:2] + [half], dim=2, start=half, end=sh[2]),
                node_doc("rk_lo", "slice", ["rk"], sh[:2] + [half], dim=2, start=0, end=half),
                node_doc("rk#copies", "cat", ["rk_hi", "rk_lo"], sh, dim=2)]
        for n in nodes[i + 1:]:
            n["args"] = ["rk#copies" if a == "rk" else a for a in n["args"]]
        nodes[i + 1:i + 1] = swap
    d.write_text(json.dumps(doc))
    seq = load_seq(s, REG)
    dist = load_dist(d, REG, seq)
    prog, _ = build_program(dist, REG, "dist")
    seq_input_relations(dist, seq, prog, REG, "dist")
    assert join_copies(seq, dist, prog, engine_for(REG), REG) > 0
    for r in range(3):
        mine = f"rk#copies@{r}"
        assert str(prog.defs[mine]) == f"cat(rk_hi@{r}, rk_lo@{r}, dim=2)" and mine not in prog.copies
        assert prog.same.find(mine) != prog.same.find(f"rk@{r}")
    assert not check(seq, dist, REG).refines


def node_doc(name: str, op: str, args: list[str], shape: list[int], **attrs: Any) -> dict[str, Any]:
    return {"name": name, "op": op, "args": args, "shape": shape, "attrs": attrs}


# Lowering names the core nodes of a user's node after it ("e" = exp(x) becomes "e.exp_t");
# a later node of a core op keeps its own name, and one called "e.exp_t" took the same
# name: its users and e's read one tensor, the later one. A rank program computing
# exp(2x) where the model has exp(x) REFINED behind a dead node "e.exp_t" = exp_t(x).

LOWERED = [("exp", "exp_t"), ("relu", "relu_t"), ("sigmoid", "sigmoid_t"), ("tanh", "tanh_t")]


def _made_up_name(op: str) -> str:
    """The name lowering gives the core node of a node "e" = op(x)."""
    from refine.ir.graph import Graph, Input, Node, TensorType
    from refine.ops.lower import lower

    t = TensorType((2, 4), "float32")
    g = Graph([Input("x", t)], [Node("e", op, ["x"], {}, t)], [])
    return lower(g, REG)[1]["e"]


def _lowered_pair(op: str, core_op: str, rank_wrong: bool, seq_dead: bool, rank_dead: bool
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """y = op(x), x sharded by rows. `rank_wrong`: the ranks compute op(2x). `seq_dead` /
    `rank_dead`: that side also has an unused node named as lowering names e's core node,
    computing core_op(2x) on the model's side and core_op(x) on the ranks'."""
    made = _made_up_name(op)
    assert made != "e"  # lowering makes a name up for e's core node

    def graph(rows: int, side: str) -> dict[str, Any]:
        sh = [rows, 4]
        nodes = [node_doc("x2", "mul", ["x", 2.0], sh)]
        nodes.append(node_doc("e", op, ["x2" if side == "rank" and rank_wrong else "x"], sh))
        if side == "seq" and seq_dead:
            nodes.append(node_doc(made, core_op, ["x2"], sh))
        if side == "rank" and rank_dead:
            nodes.append(node_doc(made, core_op, ["x"], sh))
        for n in nodes:
            if not n["attrs"]:
                del n["attrs"]
        return {"inputs": [{"name": "x", "shape": sh}], "nodes": nodes, "outputs": [{"name": "y", "ref": "e"}]}

    seq = {"format": "refine-graph", "version": 1, "kind": "sequential", "graph": graph(4, "seq")}
    dist = {"format": "refine-graph", "version": 1, "kind": "distributed",
            "mesh": {"axes": [{"name": "dp", "size": 2}]},
            "ranks": [{"rank": r, "graph": graph(2, "rank")} for r in range(2)],
            "relations": [{"from": "x", "placements": ["Shard(0)"]}],
            "expectations": [{"output": "y", "placements": ["Shard(0)"]}]}
    return seq, dist


@pytest.mark.parametrize("op, core_op", LOWERED)
def test_a_node_named_like_a_lowered_one_does_not_hide_a_bug(tmp_path: Path, op: str, core_op: str) -> None:
    rep = _check(tmp_path / "rank", *_lowered_pair(op, core_op, rank_wrong=True, seq_dead=False, rank_dead=True))
    assert not rep.refines and rep.culprit is not None and rep.culprit.node == "e"
    # the model's side: a dead node there made the model's y op(2x), as the wrong ranks compute
    rep = _check(tmp_path / "seq", *_lowered_pair(op, core_op, rank_wrong=True, seq_dead=True, rank_dead=False))
    assert not rep.refines


@pytest.mark.parametrize("op, core_op", LOWERED)
def test_a_node_named_like_a_lowered_one_does_not_break_a_correct_program(tmp_path: Path, op: str,
                                                                          core_op: str) -> None:
    for side, (seq_dead, rank_dead) in {"seq": (True, False), "rank": (False, True), "both": (True, True)}.items():
        rep = _check(tmp_path / side, *_lowered_pair(op, core_op, rank_wrong=False, seq_dead=seq_dead,
                                                      rank_dead=rank_dead))
        assert rep.refines, (side, str(rep))
