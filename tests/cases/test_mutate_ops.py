"""The mutation operators aimed at the checker's blind spots (refine/oracle/mutate.py): value-changing
casts, communications of different groups swapped in program order, relations whose layout
reads a rank tensor twice, hostile names; the order-faithful deadlock oracle; the "refused"
and "crashed" outcomes; the sweep's table (refine/bench/mutate.py).

These tests assert the mutants' shape and what the evaluation (the oracle) says of them, not
the checker's verdict: several of these mutants REFINE today (the holes they were made to
find), and a fix may refuse them at load instead. Where a verdict is asserted, it is one that
holds either way (a correct program renamed: REFINES or refused, never crashed and wrong)."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest

from refine.check import check_files
from refine.frontends.build import GraphBuilder, dist_doc, seq_doc, write_case
from refine.ir.errors import InputError
from refine.ir.term import parse_layout
from refine.ops.registry import load_registry
from refine.ops.schedule import deadlock
from refine.oracle.mutate import (
    ALL_OPERATORS,
    HOSTILE_NAMES,
    INT_DTYPES,
    Judge,
    Mutant,
    Outcome,
    _dtype_ops,
    _int_cast,
    _pinned,
    _sites,
    load_case,
    load_mutant,
    mutants,
    mutate_one,
    read_doc,
)
from tests.helpers import ROOT

MODELS = ROOT / "models"
REG = load_registry()


def _case(path: Path) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
    seq, dist, doc = load_case(path / "seq.json", path / "dist.json", REG)
    return seq, dist, doc, read_doc(path / "seq.json")


def _rank_graph(doc: dict[str, Any], r: int) -> dict[str, Any]:
    return next(x["graph"] for x in doc["ranks"] if x["rank"] == r)


def _names(doc: dict[str, Any], r: int) -> list[str]:
    return [n["name"] for n in _rank_graph(doc, r)["nodes"]]


class Picks(random.Random):
    """An rng whose `choice` returns the given values in turn (the operator's choices, fixed)."""

    def __init__(self, picks: list[Any]) -> None:
        super().__init__(0)
        self.picks = list(picks)

    def choice(self, seq: Any) -> Any:  # type: ignore[override]
        want = self.picks.pop(0)
        assert want in seq, (want, seq)
        return want


def _loads_or_refused(made: tuple[Mutant, Any] | None) -> Mutant:
    """The mutant loaded (a Dist), or was refused at load for its defect (a reason, no Dist)."""
    assert made is not None
    m, d = made
    assert (d is not None and not m.refused) or (d is None and m.refused), m.name
    assert not m.crash, m.crash
    return m


# ---------------------------------------------------------------------------------------
# value-changing casts


@pytest.mark.parametrize("op", _dtype_ops(REG))
@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_int_cast_through_each_dtype_taking_identity_op(op: str, dtype: str) -> None:
    """fc1 on rank 0 goes through `op(dtype=<int>)` and back to float32; its user reads the
    cast back. Loaded, it is numerically wrong (the values truncated)."""
    assert {"to_copy", "clone", "contiguous"} <= set(_dtype_ops(REG))
    seq, dist, doc, _ = _case(MODELS / "tp_mlp")
    new = copy.deepcopy(doc)
    what = _int_cast(REG, new, dist, 0, "fc1", Picks([op, dtype, "cast"]))
    assert what == f"fc1 cast to {dtype} by {op}, back to float32 by cast"
    g = _rank_graph(new, 0)
    at = _names(new, 0).index("fc1")
    down, up = g["nodes"][at + 1], g["nodes"][at + 2]
    assert (down["op"], down["args"], down["attrs"], down["dtype"]) == (op, ["fc1"], {"dtype": dtype}, dtype)
    assert (up["op"], up["args"], up["attrs"], up["dtype"]) == ("cast", [down["name"]], {"dtype": "float32"}, "float32")
    assert next(n for n in g["nodes"] if n["name"] == "fc1_bias")["args"][0] == up["name"]
    assert _rank_graph(new, 1) == _rank_graph(doc, 1)  # the other rank is untouched
    try:
        mutant = load_mutant(new, seq, REG)
    except InputError as e:  # refused at load: where the planted cast is
        assert "ranks[0].graph.nodes" in e.where, e
        return
    assert Judge(seq, dist, REG).wrong(mutant)[0] is True


def test_int_cast_mutants_load_or_are_refused() -> None:
    seq, dist, doc, _ = _case(MODELS / "sp_mlp")
    made = list(mutants(seq, dist, doc, REG, 6, seed=3, operators=["int_cast"]))
    assert len(made) == 6
    for m, d in made:
        _loads_or_refused((m, d))
        assert m.operator == "int_cast" and " cast to " in m.detail
        assert any(x in m.detail for x in INT_DTYPES)


def _with_float_casts(tmp_path: Path) -> Path:
    """tp_mlp with fc1 read through `to_copy(dtype=float32)` and fc2 through `cast(dtype=float32)`
    on every rank (and in the sequential graph, where they are)."""
    seq_d = json.loads((MODELS / "tp_mlp" / "seq.json").read_text())
    dist_d = json.loads((MODELS / "tp_mlp" / "dist.json").read_text())
    for g in [seq_d["graph"], *(r["graph"] for r in dist_d["ranks"])]:
        for src, op, name in (("fc1", "to_copy", "fc1_copy"), ("fc2", "cast", "fc2_cast")):
            at = next(i for i, n in enumerate(g["nodes"]) if n["name"] == src)
            node = {**{k: g["nodes"][at][k] for k in ("shape", "dtype")}, "name": name, "op": op, "args": [src],
                    "attrs": {"dtype": "float32"}}
            for n in g["nodes"][at + 1:]:
                n["args"] = [name if a == src else a for a in n["args"]]
            g["nodes"].insert(at + 1, node)
    write_case(tmp_path, seq_d, dist_d)
    assert check_files(tmp_path / "seq.json", tmp_path / "dist.json").refines
    return tmp_path


@pytest.mark.parametrize("site", ["fc1_copy", "fc2_cast"])
def test_int_dtype_makes_an_existing_float_cast_an_int_one(tmp_path: Path, site: str) -> None:
    seq, dist, doc, _ = _case(_with_float_casts(tmp_path))
    assert set(_sites("int_dtype", dist, REG, doc)) == {"fc1_copy", "fc2_cast"}
    m = _loads_or_refused(mutate_one(seq, dist, doc, REG, "int_dtype", site, [1]))
    g = _rank_graph(m.doc, 1)
    at = _names(m.doc, 1).index(site)
    node, back = g["nodes"][at], g["nodes"][at + 1]
    assert node["attrs"]["dtype"] in INT_DTYPES and node["dtype"] == node["attrs"]["dtype"]
    assert back["args"] == [site] and back["attrs"] == {"dtype": "float32"} and back["dtype"] == "float32"
    assert _rank_graph(m.doc, 0) == _rank_graph(doc, 0)
    if m.refused:  # `cast` refuses a float-to-int cast at load: fail-closed, a sound outcome
        assert Judge(seq, dist, REG).judge(m, None).kind == "refused"


# ---------------------------------------------------------------------------------------
# program order


def _pipeline(tmp_path: Path) -> Path:
    """Two stages: rank 0 computes h = x @ w0 and sends it; rank 1 computes y = h @ w1 and
    sends it back; rank 0 outputs z = 2 * y. Rank 0 sends before it receives."""
    s = GraphBuilder()
    x, w0, w1 = s.input("x", [4, 8]), s.input("w0", [8, 8], role="parameter"), s.input("w1", [8, 8], role="parameter")
    y = s.op("matmul", s.op("matmul", x, w0, name="h"), w1, name="y")
    s.output("y", y)
    s.output("z", s.op("mul", y, 2.0, name="z"))
    r0, r1 = GraphBuilder(), GraphBuilder()
    h = r0.op("matmul", r0.input("x", [4, 8]), r0.input("w0", [8, 8], role="parameter"), name="h")
    r0.op("send", h, name="send_h", peer=1)
    r0.output("z", r0.op("mul", r0.op("recv", name="recv_y", peer=1, shape=[4, 8], dtype="float32"), 2.0, name="z"))
    y1 = r1.op("matmul", r1.op("recv", name="recv_h", peer=0, shape=[4, 8], dtype="float32"),
               r1.input("w1", [8, 8], role="parameter"), name="y")
    r1.op("send", y1, name="send_y", peer=0)
    r1.output("y", y1)
    rel = [{"from": "x", "layout": "x@0"}, {"from": "w0", "layout": "w0@0"}, {"from": "w1", "layout": "w1@1"}]
    ex = [{"output": "y", "layout": "y@1"}, {"output": "z", "layout": "z@0"}]
    write_case(tmp_path, seq_doc(s), dist_doc({"pp": 2}, {0: r0, 1: r1}, rel, ex))
    assert check_files(tmp_path / "seq.json", tmp_path / "dist.json").refines
    return tmp_path


def test_swap_send_recv_posts_a_recv_before_the_send_its_partner_waits_for(tmp_path: Path) -> None:
    seq, dist, doc, _ = _case(_pipeline(tmp_path))
    assert not deadlock(dist.ranks, REG)
    assert _sites("swap_send_recv", dist, REG, doc) == ["recv_y"]
    assert _sites("swap_collectives", dist, REG, doc) == []
    made = mutate_one(seq, dist, doc, REG, "swap_send_recv", "recv_y", [0])
    m = _loads_or_refused(made)
    assert _names(m.doc, 0) == ["h", "recv_y", "send_h", "z"]  # was h, send_h, recv_y, z
    assert _rank_graph(m.doc, 1) == _rank_graph(doc, 1)
    if made[1] is not None:  # loaded (it may be refused at load: a deadlock, fail-closed)
        assert "recv_y" in {s.node for s in deadlock(made[1].ranks, REG)}
        assert Judge(seq, dist, REG).wrong(made[1])[0] is True


def test_swap_collectives_of_two_groups_deadlocks_on_one_rank_only(tmp_path: Path) -> None:
    """dp x tp: the tp all_reduce (group [0, 1]) moved before the world one on rank 0 alone:
    rank 1 waits in the world one for rank 0, which waits in the tp one for rank 1. Moved on
    every rank, the order is consistent: no deadlock, the same values."""
    from refine.bench.mutate import dp_tp_stat

    dp_tp_stat(tmp_path)
    seq, dist, doc, _ = _case(tmp_path)
    assert check_files(tmp_path / "seq.json", tmp_path / "dist.json").refines
    assert _sites("swap_collectives", dist, REG, doc) == ["fc2_sum"]
    judge = Judge(seq, dist, REG)
    made = mutate_one(seq, dist, doc, REG, "swap_collectives", "fc2_sum", [0])
    names = _names(_loads_or_refused(made).doc, 0)
    assert names.index("fc2_sum") < names.index("stat_sum")
    assert names.index("fc2") < names.index("fc2_sum") and names.index("fc1") < names.index("act")
    if made[1] is not None:  # loaded (it may be refused at load: a deadlock, fail-closed)
        assert deadlock(made[1].ranks, REG) and judge.wrong(made[1])[0] is True
    every = _loads_or_refused(mutate_one(seq, dist, doc, REG, "swap_collectives", "fc2_sum", None))
    assert all(_names(every.doc, r).index("fc2_sum") < _names(every.doc, r).index("stat_sum") for r in range(4))
    d = load_mutant(every.doc, seq, REG)  # a consistent order: a correct program
    assert not deadlock(d.ranks, REG) and judge.wrong(d)[0] is False


def test_swaps_keep_data_dependencies_and_different_groups_only() -> None:
    """tp_mlp has one group, tp_attention's collectives read each other's results: no site."""
    for case in ("tp_mlp", "tp_attention", "sp_mlp"):
        seq, dist, doc, _ = _case(MODELS / case)
        assert _sites("swap_collectives", dist, REG, doc) == [] and _sites("swap_send_recv", dist, REG, doc) == []


def _graph(nodes: list[tuple[str, str, list[str], dict[str, Any]]]) -> Any:
    from refine.ir.graph import Graph, Input, Node, TensorType

    t = TensorType((2,))
    return Graph([Input("x", t)], [Node(n, op, args, attrs, t) for n, op, args, attrs in nodes])


def test_judge_reads_program_order_from_the_schedule() -> None:
    a = ("a", "all_reduce", ["x"], {"group": [0, 1]})
    b = ("b", "all_reduce", ["x"], {"group": [0, 1, 2]})
    c = ("c", "all_reduce", ["x"], {"group": [2, 3]})
    fine = {0: _graph([a, b]), 1: _graph([a, b]), 2: _graph([c, b]), 3: _graph([c])}
    assert not deadlock(fine, REG)
    # rank 1 waits in b for rank 0, which waits in a for rank 1
    assert {s.rank: s.node for s in deadlock({**fine, 1: _graph([b, a])}, REG)} == {0: "a", 1: "b", 2: "b"}
    # groups that share one rank only: the order is free
    d = ("d", "all_reduce", ["x"], {"group": [1, 3]})
    assert not deadlock({0: _graph([a]), 1: _graph([d, a]), 2: _graph([]), 3: _graph([d])}, REG)
    # a send and its recv meet (rendezvous, as refine.ops.schedule decides): two ranks that both
    # send first wait for ever, as do two that both receive first
    send, recv = ("s", "send", ["x"], {"peer": 1}), ("r", "recv", [], {"peer": 1, "shape": [2]})
    send1, recv1 = ("s", "send", ["x"], {"peer": 0}), ("r", "recv", [], {"peer": 0, "shape": [2]})
    assert deadlock({0: _graph([send, recv]), 1: _graph([send1, recv1])}, REG)
    assert deadlock({0: _graph([recv, send]), 1: _graph([recv1, send1])}, REG)
    assert not deadlock({0: _graph([recv, send]), 1: _graph([send1, recv1])}, REG)


# ---------------------------------------------------------------------------------------
# relations


def _layout_of(doc: dict[str, Any], source: str) -> list[str]:
    e = next(x for x in doc["relations"] if x.get("from") == source)
    return e["layout"] if isinstance(e["layout"], list) else [e["layout"]]


def _leaves(text: str) -> list[str]:
    from refine.oracle.mutate import _leaf_list

    return _leaf_list(parse_layout(text))


@pytest.mark.parametrize("operator", ["repeat_piece", "overlap_piece", "shared_piece"])
def test_relation_mutants_read_a_rank_tensor_twice(operator: str) -> None:
    seq, dist, doc, _ = _case(MODELS / "tp_mlp")
    made = list(mutants(seq, dist, doc, REG, 3, seed=1, operators=[operator]))
    assert made
    judge = Judge(seq, dist, REG)
    for m, d in made:
        _loads_or_refused((m, d))
        assert m.fresh_inputs and m.doc["ranks"] == doc["ranks"]  # the program is untouched
        source = m.node
        texts = _layout_of(m.doc, source)
        leaves = _leaves(texts[0])
        if operator == "repeat_piece":  # a piece in place of another: one tensor twice
            assert len(set(leaves)) < len(leaves)
        elif operator == "overlap_piece":  # a whole piece and a slice of it
            assert len(set(leaves)) < len(leaves) and "slice(" in texts[0]
        else:  # two relations read one rank tensor
            shared = [e["from"] for e in m.doc["relations"] if e.get("from") != source and "layout" in e
                      and set(_leaves(_layout_of(m.doc, e["from"])[0])) & set(leaves)]
            assert shared, m.name
        if d is not None:  # the rank reading the piece no relation reads any more is free
            assert judge.wrong(d, fresh=True)[0] is True


@pytest.mark.parametrize("operator", ["repeat_piece", "overlap_piece", "shared_piece"])
def test_a_relation_mutants_control_is_the_relation_itself(tmp_path: Path, operator: str) -> None:
    """The control of a relation mutant (written as a layout, nothing repeated) is the same
    relation: the correct case with it still refines and computes the same."""
    from refine.oracle.mutate import RELATION_OPERATORS

    seq, dist, doc, _ = _case(MODELS / "sp_mlp_4ranks")
    for rel in dist.relations:
        new = copy.deepcopy(doc)
        if RELATION_OPERATORS[operator](REG, new, dist, rel.source, random.Random(0), True) is None:
            continue
        (tmp_path / "dist.json").write_text(json.dumps(new))
        (tmp_path / "seq.json").write_text((MODELS / "sp_mlp_4ranks" / "seq.json").read_text())
        assert check_files(tmp_path / "seq.json", tmp_path / "dist.json").refines, new["relations"]
        assert Judge(seq, dist, REG).wrong(load_mutant(new, seq, REG), fresh=True)[0] is False
        return
    pytest.fail(f"{operator} applies to no relation of sp_mlp_4ranks")


# ---------------------------------------------------------------------------------------
# hostile names


def test_rename_renames_every_use_alike() -> None:
    seq, dist, doc, sdoc = _case(MODELS / "tp_mlp")
    m = _loads_or_refused(mutate_one(seq, dist, doc, REG, "rename", "w1", seq_doc=sdoc))
    assert m.seq_doc is not None
    (name,) = {x["name"] for x in m.seq_doc["graph"]["inputs"]} - {x["name"] for x in sdoc["graph"]["inputs"]}
    assert name in HOSTILE_NAMES and m.detail == f"'w1' renamed {name!r}"
    for g in [m.seq_doc["graph"], *(r["graph"] for r in m.doc["ranks"])]:  # type: ignore[index]
        assert name in {x["name"] for x in g["inputs"]} and "w1" not in {x["name"] for x in g["inputs"]}
        assert any(name in n["args"] for n in g["nodes"]) and not any("w1" in n["args"] for n in g["nodes"])
    rel = next(e for e in m.doc["relations"] if e["from"] == name)
    assert rel["input"] == name and rel["placements"] == ["Shard(1)"]
    assert m.twin is dist  # the evaluation runs the case under its own names
    assert m.seq is not None or m.refused  # the check reads the renamed sequential graph


def test_rename_everything_leaves_no_old_name() -> None:
    seq, dist, doc, sdoc = _case(MODELS / "sp_mlp")
    m = _loads_or_refused(mutate_one(seq, dist, doc, REG, "rename", "*", seq_doc=sdoc))
    old = {n["name"] for r in doc["ranks"] for n in r["graph"]["nodes"]}
    new = {n["name"] for r in m.doc["ranks"] for n in r["graph"]["nodes"]}
    assert not old & new and len(new) == len(old)
    assert {e["output"] for e in m.doc["expectations"]} <= {o["name"] for o in m.seq_doc["graph"]["outputs"]}  # type: ignore[index]


def test_names_in_layouts_are_not_renamed(tmp_path: Path) -> None:
    seq, dist, doc, sdoc = _case(_pipeline(tmp_path))
    assert _pinned(doc) == {"x", "w0", "w1", "y", "z"}
    assert "x" not in _sites("rename", dist, REG, doc, sdoc)
    m = _loads_or_refused(mutate_one(seq, dist, doc, REG, "rename", "*", seq_doc=sdoc))
    assert m.doc["relations"] == doc["relations"] and m.doc["expectations"] == doc["expectations"]


@pytest.mark.parametrize("case", ["tp_mlp", "sp_mlp_symbolic", "vocab_embedding"])
def test_a_correct_case_renamed_is_never_wrong(case: str) -> None:
    """Renaming changes no value: the evaluation says equal, so the mutant may only be
    neutral (REFINES), incomplete or crashed (both reported), never UNSOUND."""
    seq, dist, doc, sdoc = _case(MODELS / case)
    judge = Judge(seq, dist, REG)
    for m, d in mutants(seq, dist, doc, REG, 4, seed=2, operators=["rename"], seq_doc=sdoc):
        o = judge.judge(m, d)
        assert o.wrong is False and o.kind in ("neutral", "incomplete", "crashed"), (m.name, o.kind)


def test_rename_bug_renames_a_real_bug() -> None:
    seq, dist, doc, sdoc = _case(MODELS / "tp_mlp")
    made = list(mutants(seq, dist, doc, REG, 6, seed=4, operators=["rename_bug"], seq_doc=sdoc))
    assert len(made) == 6
    judge = Judge(seq, dist, REG)
    for m, d in made:
        _loads_or_refused((m, d))
        base = m.detail.split(":")[0]
        assert base in ALL_OPERATORS and base not in ("rename", "rename_bug")
        assert m.twin is not None and m.twin is not dist  # the bug under the case's own names
        assert any(h in json.dumps(m.doc, ensure_ascii=False) for h in
                   [json.dumps(x, ensure_ascii=False)[1:-1] for x in HOSTILE_NAMES])
        if base in ("scale", "wrong_reduce", "drop_collective", "swap_operands"):
            assert judge.wrong(m.twin)[0] is True


def test_no_seq_document_no_rename() -> None:
    seq, dist, doc, _ = _case(MODELS / "tp_mlp")
    assert mutate_one(seq, dist, doc, REG, "rename", "*") is None
    assert _sites("rename", dist, REG, doc) == [] and _sites("rename_bug", dist, REG, doc) == []


# ---------------------------------------------------------------------------------------
# outcomes


def _outcome(verdict: str, wrong: bool | None, dead: bool = False) -> str:
    return Outcome(Mutant("scale", "n", "all ranks", "", {}), verdict, wrong, dead=dead).kind


def test_outcome_kinds() -> None:
    assert _outcome("REFINES", True) == "UNSOUND"
    assert _outcome("REFINES", False) == "neutral"
    assert _outcome("DOES NOT REFINE", True) == "caught"
    # DOES NOT REFINE comes with the check's own counterexample: wrong, whatever the sweep drew
    assert _outcome("DOES NOT REFINE", False) == "caught"
    assert _outcome("UNPROVEN", False) == "incomplete"
    assert _outcome("UNPROVEN", True) == "missed"
    assert _outcome("UNPROVEN", None, dead=True) == "incomplete"
    assert _outcome("exit 2", None) == "refused"  # refused at load: not evaluated
    assert _outcome("exit 2", True) == "refused"
    assert _outcome("exit 2", False) == "incomplete"  # a correct program refused
    assert _outcome("crash", False) == "crashed" and _outcome("crash", True) == "crashed"
    # not evaluated (too large), but no value changed (a dead site, a renaming only)
    assert _outcome("REFINES", None, dead=True) == "neutral"
    assert _outcome("exit 2", None, dead=True) == "incomplete"
    assert _outcome("REFINES", None) == "unjudged"


def test_a_mutant_refused_at_load_for_its_defect(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loader that refuses casts to an integer dtype (as a fix may): int_cast mutants come
    out refused (their control, the same casts within float, loads) and are judged refused
    without a check; a mutant of another operator that does not load is still skipped."""
    import refine.oracle.mutate as mutate

    real = mutate.load_mutant

    def refusing(doc: dict[str, Any], seq: Any, registry: Any) -> Any:
        for r in doc["ranks"]:
            for j, n in enumerate(r["graph"]["nodes"]):
                if (n.get("attrs") or {}).get("dtype") in INT_DTYPES:
                    raise InputError("dist.json", f"$.ranks[{r['rank']}].graph.nodes[{j}].attrs.dtype", "changes values")
        return real(doc, seq, registry)

    monkeypatch.setattr(mutate, "load_mutant", refusing)
    seq, dist, doc, _ = _case(MODELS / "tp_mlp")
    made = list(mutants(seq, dist, doc, REG, 3, seed=0, operators=["int_cast"]))
    assert len(made) == 3 and all(d is None and "changes values" in m.refused for m, d in made)
    import importlib

    monkeypatch.setattr(importlib.import_module("refine.check"), "check",
                        lambda *a, **k: pytest.fail("a refused mutant is not checked"))
    o = Judge(seq, dist, REG).judge(*made[0])
    assert (o.verdict, o.kind, o.wrong) == ("exit 2", "refused", None)
    # a swap_operands edit that does not type-check is not "refused": it is no mutant
    with pytest.raises(InputError):
        mutate_one(seq, dist, doc, REG, "swap_operands", "fc2", [0])


def test_a_crash_in_the_check_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    seq, dist, doc, _ = _case(MODELS / "tp_mlp")
    made = mutate_one(seq, dist, doc, REG, "scale", "fc2", [0])
    assert made is not None

    def boom(*a: Any, **k: Any) -> None:
        raise RuntimeError("egglog rejected\nthe program")

    monkeypatch.setattr(importlib.import_module("refine.check"), "check", boom)
    o = Judge(seq, dist, REG).judge(*made)
    assert (o.verdict, o.kind, o.culprit) == ("crash", "crashed", "RuntimeError: egglog rejected the program")


def test_a_check_past_its_cpu_limit_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A check that does not end (a prover lost in an e-graph) gives "timeout" once its CPU
    time is spent; the engines it may have left half-run are dropped, and the next check runs."""
    import importlib

    from refine.check import _ENGINES, engine_for

    seq, dist, doc, _ = _case(MODELS / "tp_mlp")
    made = mutate_one(seq, dist, doc, REG, "scale", "fc2", [0])
    assert made is not None
    engine_for(REG)
    assert _ENGINES
    check_module = importlib.import_module("refine.check")
    real = check_module.check

    def spin(*a: Any, **k: Any) -> None:
        while True:
            pass

    monkeypatch.setattr(check_module, "check", spin)
    judge = Judge(seq, dist, REG, check_limit=0.5)
    o = judge.judge(*made)
    assert (o.verdict, o.kind, o.wrong) == ("timeout", "timeout", True) and not _ENGINES
    monkeypatch.setattr(check_module, "check", real)
    assert judge.judge(*made).kind == "caught"


# ---------------------------------------------------------------------------------------
# the sweep


def test_sweep_table_counts_per_operator_and_case() -> None:
    from refine.bench.mutate import CASES, KINDS, one, operator_order, summary, table

    assert {c.name for c in CASES if c.kind == "example"} >= {"tp_mlp", "sp_mlp", "vocab_embedding"}
    assert not any("_bug_" in c.name for c in CASES)
    assert sorted(operator_order()) == sorted(ALL_OPERATORS) and operator_order()[0] == "int_cast"
    res = one("tp_mlp", 4, 0)
    assert res["case"] == "tp_mlp" and [r["operator"] for r in res["rows"]] == \
        ["none", "int_cast", "repeat_piece", "overlap_piece", "shared_piece"]  # the new operators first
    assert res["rows"][0]["kind"] == "neutral" and all(r["kind"] in KINDS for r in res["rows"])
    fake = {"case": "x", "cpu_s": 1.0, "rss_mib": 1.0, "rows": [
        {"operator": "none", "mutant": "none", "verdict": "REFINES", "wrong": False, "kind": "neutral", "culprit": ""},
        {"operator": "rename", "mutant": "rename a: 'a' renamed 'b|c'", "verdict": "crash", "wrong": False,
         "kind": "crashed", "culprit": "RuntimeError"},
        {"operator": "int_cast", "mutant": "int_cast n", "verdict": "exit 2", "wrong": None, "kind": "refused",
         "culprit": ""}]}
    text = table([res, fake])
    assert "| int_cast | 0 | 1 |" in text and "refused" in KINDS
    assert "**crashed** rename a: 'a' renamed 'b\\|c'" in summary([fake])
    assert "timeout" in KINDS
    assert summary([res]).startswith("# Mutation sweep\n\n4 mutants over 1 cases: caught ")
