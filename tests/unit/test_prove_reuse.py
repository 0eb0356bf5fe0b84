"""Replay of a repeated layer's steps (refine/prove/reuse.py): it fires on identical layers, never
changes a verdict or a culprit, and what decides it is the check of every renamed premise,
not how the renaming was found."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from refine.check import check_files, engine_for
from refine.frontends.build import GraphBuilder, dist_doc, seq_doc, write_case
from refine.ir.term import Term, leaf
from refine.ops.registry import load_registry
from refine.prove.reuse import Replayer, canon
from refine.verdict.report import Report

T, H, F = 4, 8, 16


def _stack(tmp_path: Path, layers: int = 3, world: int = 2, bug_layer: int | None = None) -> tuple[Path, Path]:
    """Megatron MLP blocks with a residual: column-parallel fc1 (+ bias, gelu), row-parallel
    fc2, all_reduce, bias, times a gain every layer shares (as a rotary table is shared).
    `bug_layer`: that layer adds its fc2 bias on every rank before the all_reduce."""
    s = GraphBuilder()
    x = s.input("x", [T, H])
    gain = s.input("gain", [T, H])
    for i in range(layers):
        w1, b1 = s.input(f"w1_{i}", [H, F], role="parameter"), s.input(f"b1_{i}", [F], role="parameter")
        w2, b2 = s.input(f"w2_{i}", [F, H], role="parameter"), s.input(f"b2_{i}", [H], role="parameter")
        h = s.op("gelu", s.op("add", s.op("matmul", x, w1, name=f"fc1_{i}"), b1, name=f"fc1_bias_{i}"),
                 name=f"act_{i}", approximate="none")
        y = s.op("add", s.op("matmul", h, w2, name=f"fc2_{i}"), b2, name=f"fc2_bias_{i}")
        x = s.op("add", x, s.op("mul", y, gain, name=f"gain_{i}"), name=f"res_{i}")
    s.output("y", x)
    ranks = {}
    for r in range(world):
        d = GraphBuilder()
        x_ = d.input("x", [T, H])
        gain_ = d.input("gain", [T, H])
        for i in range(layers):
            w1, b1 = d.input(f"w1_{i}", [H, F // world], role="parameter"), d.input(f"b1_{i}", [F // world], role="parameter")
            w2, b2 = d.input(f"w2_{i}", [F // world, H], role="parameter"), d.input(f"b2_{i}", [H], role="parameter")
            h = d.op("gelu", d.op("add", d.op("matmul", x_, w1, name=f"fc1_{i}"), b1, name=f"fc1_bias_{i}"),
                     name=f"act_{i}", approximate="none")
            p = d.op("matmul", h, w2, name=f"fc2_{i}")
            if i == bug_layer:
                y = d.op("all_reduce", d.op("add", p, b2, name=f"fc2_bias_{i}"), name=f"fc2_sum_{i}",
                         reduce_op="sum", group=list(range(world)))
            else:
                y = d.op("add", d.op("all_reduce", p, name=f"fc2_sum_{i}", reduce_op="sum", group=list(range(world))),
                         b2, name=f"fc2_bias_{i}")
            x_ = d.op("add", x_, d.op("mul", y, gain_, name=f"gain_{i}"), name=f"res_{i}")
        d.output("y", x_)
        ranks[r] = d
    rel: list[dict[str, Any]] = [{"from": "x", "placements": ["Replicate"]}, {"from": "gain", "placements": ["Replicate"]}]
    for i in range(layers):
        rel += [{"from": f"w1_{i}", "placements": ["Shard(1)"]}, {"from": f"b1_{i}", "placements": ["Shard(0)"]},
                {"from": f"w2_{i}", "placements": ["Shard(0)"]}, {"from": f"b2_{i}", "placements": ["Replicate"]}]
    write_case(tmp_path, seq_doc(s), dist_doc({"tp": world}, ranks, rel, [{"output": "y", "placements": ["Replicate"]}]))
    return tmp_path / "seq.json", tmp_path / "dist.json"


def _check(paths: tuple[Path, Path]) -> tuple[Report, float, float]:
    """The report, and how many steps were replayed and proven by an e-graph for it."""
    stats = engine_for(load_registry()).stats
    replayed, steps = stats["replayed"], stats["steps"]
    report = check_files(*paths)
    return report, stats["replayed"] - replayed, stats["steps"] - steps


def _no_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Replayer, "replay", lambda self, term: None)


@pytest.mark.slow
def test_identical_layers_are_replayed_and_the_verdict_is_unchanged(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _stack(tmp_path / "a")
    report, replayed, steps = _check(paths)
    assert report.refines, str(report)
    # each layer has 8 sequential nodes (lowered: matmul, Sum, gelu, ...); layer 3 at least
    # is replayed whole (layer 2's input is already a rank all_reduce, as layer 3's is)
    assert replayed >= 8, (replayed, steps)
    with monkeypatch.context() as m:
        _no_replay(m)
        again, replayed_off, steps_off = _check(_stack(tmp_path / "b"))
    assert replayed_off == 0 and again.refines
    assert steps < steps_off  # replayed steps run no e-graph
    assert [(o.name, o.ok) for o in report.outputs] == [(o.name, o.ok) for o in again.outputs]


@pytest.mark.slow
@pytest.mark.parametrize("bug_layer", [1, 2])
def test_a_bug_in_one_layer_is_found_in_that_layer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     bug_layer: int) -> None:
    report, replayed, _ = _check(_stack(tmp_path / "a", bug_layer=bug_layer))
    assert not report.refines
    assert report.culprit is not None and report.culprit.node == f"fc2_bias_{bug_layer}", str(report)
    if bug_layer == 2:
        assert replayed > 0  # layer 2 (index 1) is correct and was replayed, layer 3 was not
    with monkeypatch.context() as m:
        _no_replay(m)
        again, _, _ = _check(_stack(tmp_path / "b", bug_layer=bug_layer))
    assert again.culprit is not None and (again.culprit.node, again.culprit.rank_node) == \
        (report.culprit.node, report.culprit.rank_node)


@pytest.mark.slow
def test_every_term_colliding_falls_back_to_proving(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With one key for every term, every earlier step is a candidate for every node: the
    premise check turns the wrong ones down, so the verdicts and the culprit stand."""
    monkeypatch.setattr(Replayer, "key", lambda self, term: "same")
    monkeypatch.setattr("refine.prove.reuse.CANDIDATES", 50)
    report, replayed, _ = _check(_stack(tmp_path / "a"))
    assert report.refines, str(report)
    bad, _, _ = _check(_stack(tmp_path / "b", bug_layer=1))
    assert not bad.refines and bad.culprit is not None and bad.culprit.node == "fc2_bias_1", str(bad)


def test_a_wrong_renaming_is_never_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The renaming search is only a guess: when it maps a tensor to another one of the same
    shape (here: every layer's fc1 to the next layer's), a renamed premise is false and the
    node is proven instead."""
    found = Replayer._map

    def skewed(self: Replayer, prem: Any, target: Any) -> Any:
        pi = found(self, prem, target)
        if pi is None:
            return None
        for k, v in pi.items():
            pi[k] = re.sub(r"^fc1_(\d+)", lambda m: f"fc1_{int(m.group(1)) + 1}", v)
        return pi

    monkeypatch.setattr(Replayer, "_map", skewed)
    calls: list[bool] = []
    valid = Replayer._valid
    monkeypatch.setattr(Replayer, "_valid", lambda self, *a: calls.append(valid(self, *a)) or calls[-1])
    report, replayed, _ = _check(_stack(tmp_path))
    assert report.refines, str(report)
    assert False in calls  # some skewed renamings were tried and turned down
    assert replayed <= calls.count(True)


def _right_nested(t: Term) -> Term:
    """t with every concat chain along one dim rebuilt as a right-nested chain (the same
    parts, in order): not the balanced tree `refine.ir.term.cat` builds past three parts, the nesting
    another extraction or relation builder may produce."""
    if not t.args:
        return t
    if t.op != "cat":
        return Term(t.op, tuple(_right_nested(a) for a in t.args), t.attrs)
    parts: list[Term] = []
    todo = [t]
    while todo:  # the chain's parts, left to right
        x = todo.pop()
        if x.op == "cat" and x.attrs == t.attrs:
            todo += reversed(x.args)
        else:
            parts.append(_right_nested(x))

    def build(ps: list[Term]) -> Term:
        return ps[0] if len(ps) == 1 else Term("cat", (ps[0], build(ps[1:])), t.attrs)

    return build(parts)


def test_concat_nesting_is_one_canonical_form() -> None:
    a, b, c, d = (leaf(x) for x in "abcd")
    balanced = Term("cat", (Term("cat", (a, b), (1,)), Term("cat", (c, d), (1,))), (1,))
    right = _right_nested(balanced)
    assert right != balanced and right.args[1].op == "cat" and right.args[0] == a
    assert canon(balanced, str) == canon(right, str) == Term("cat", (a, b, c, d), (1,))
    # a concat along another dim is a part, not flattened into it
    mixed = Term("cat", (Term("cat", (a, b), (0,)), Term("cat", (c, d), (1,))), (1,))
    assert canon(mixed, str) == Term("cat", (Term("cat", (a, b), (0,)), c, d), (1,))


@pytest.mark.slow
def test_a_differently_nested_concat_is_still_replayed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four ranks: fc1's relation is a concat of four parts. Offered to the replayer nested
    as a right chain (not the balanced tree an earlier layer's steps were told), the later layers'
    nodes are replayed all the same; with concats compared as nested, they are not."""
    base, _, _ = _check(_stack(tmp_path / "a", world=4))
    replayed_base = base.stats["replayed"]
    original = Replayer.replay
    offered: list[bool] = []

    def renested(self: Replayer, term: Term) -> Any:
        offered.append(_right_nested(term) != term)
        return original(self, _right_nested(term))

    monkeypatch.setattr(Replayer, "replay", renested)
    report, replayed, _ = _check(_stack(tmp_path / "b", world=4))
    assert report.refines, str(report)
    assert any(offered)  # some terms were renested
    assert replayed == replayed_base > 0
    monkeypatch.setattr("refine.prove.reuse._flat_cats", lambda args, dim: args)
    nested, replayed_nested, _ = _check(_stack(tmp_path / "c", world=4))
    assert nested.refines and replayed_nested < replayed


def test_a_replayed_fact_must_be_a_fact_here() -> None:
    """A step told a fact (a rank weight equal to copies of its own first head) is replayed
    onto another layer only if the renamed fact is one of that layer's: the renaming comes
    from the definitions and from matching the layer's facts, the check from the facts alone."""
    from collections import Counter

    from refine.ir.graph import TensorType
    from refine.prove.reuse import Premises
    from refine.relate.program import DistProgram

    def head(w: str, j: int) -> Term:
        return Term("slice", (leaf(w),), (1, 2 * j, 2 * j + 2))

    prog = DistProgram()
    for i in (0, 1):
        prog.add(f"x{i}@0", TensorType((4, 4)), None, None)
        prog.add(f"w{i}@0", TensorType((4, 4)), None, None)
        prog.add(f"p{i}@0", TensorType((4, 4)), Term("matmul", (leaf(f"x{i}@0"), leaf(f"w{i}@0"))), None)
    prog.add_fact(leaf("w0@0"), Term("cat", (head("w0@0", 0), head("w0@0", 0)), (1,)))
    # layer 1's weight copies its second head instead
    prog.add_fact(leaf("w1@0"), Term("cat", (head("w1@0", 1), head("w1@0", 1)), (1,)))
    seq0 = Term("view", (leaf("p0@0"),), ((16,),))
    prem = Premises.of(seq0, prog, ["p0@0"], ["p0@0", "x0@0", "w0@0"], [], False, Counter(), [prog.facts[0]])
    rep = Replayer(prog, {"replayed": 0}, Counter())
    seq1 = Term("view", (leaf("p1@0"),), ((16,),))
    pi = rep._map(prem, seq1)
    assert pi is not None and pi[("D", "w0@0")] == "w1@0"
    assert not rep._valid(prem, pi, seq1)  # w1's fact is another one
    prog.add_fact(leaf("w1@0"), Term("cat", (head("w1@0", 0), head("w1@0", 0)), (1,)))
    rep = Replayer(prog, {"replayed": 0}, Counter())
    pi = rep._map(prem, seq1)
    assert pi is not None and rep._valid(prem, pi, seq1)


def test_a_tensor_only_a_fact_names_is_renamed_after_the_facts() -> None:
    """TP6's rank 5 pads its weight and copies rank 4's heads: layer k's fact names layer
    k's rank-4 weight, which no definition of the step reaches; it is renamed by matching
    the layer's facts, so the renamed fact holds."""
    from collections import Counter

    from refine.ir.graph import TensorType
    from refine.prove.reuse import Premises
    from refine.relate.program import DistProgram

    prog = DistProgram()
    for i in (0, 1):
        for t in ("x", "w", "v"):
            prog.add(f"{t}{i}@0", TensorType((4, 4)), None, None)
        prog.add(f"p{i}@0", TensorType((4, 4)), Term("matmul", (leaf(f"x{i}@0"), leaf(f"w{i}@0"))), None)
        prog.add_fact(leaf(f"w{i}@0"), Term("cat", (Term("slice", (leaf(f"v{i}@0"),), (1, 0, 2)),) * 2, (1,)))
    seq0, seq1 = (Term("view", (leaf(f"p{i}@0"),), ((16,),)) for i in (0, 1))
    prem = Premises.of(seq0, prog, ["p0@0"], ["p0@0", "x0@0", "w0@0", "v0@0"], [], False, Counter(), [prog.facts[0]])
    rep = Replayer(prog, {"replayed": 0}, Counter())
    pi = rep._map(prem, seq1)
    assert pi is not None and pi[("D", "v0@0")] == "v1@0"
    assert rep._valid(prem, pi, seq1)
