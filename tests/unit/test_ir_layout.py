"""Replicas of a layout equal the layout in value, which makes two rank tensors equal only
where each is read whole (refine/ir/layout.py). A replicated slice of a fused weight (a KV
head two ranks hold next to their own query heads) says nothing of the rest: reading it as
the whole tensor gave a false REFINES."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from refine.check import check_files
from refine.frontends.build import GraphBuilder, dist_doc, seq_doc, write_case
from refine.frontends.graphfile import load_dist, load_seq
from refine.ir.layout import join_replicas
from refine.ir.term import Term, leaf
from refine.ops.interp import random_inputs
from refine.ops.registry import load_registry
from refine.oracle.differential import differential
from refine.prove import engine as prove
from refine.prove import frontier
from refine.relate.program import build_program, seq_input_relations

REG = load_registry()


def _case(tmp_path: Path, bug: bool) -> tuple[Path, Path]:
    """W is rows 0:2 of every rank's w (replicated), Z rows 2:4 of rank 0's only. y = W + Z
    when buggy (rank 1's rows 2:4 are its own, not Z), y = W + W otherwise."""
    s = GraphBuilder()
    w_, z_ = s.input("W", [2, 4], role="parameter"), s.input("Z", [2, 4], role="parameter")
    s.output("y", s.op("add", w_, z_ if bug else w_, name="y"))
    ranks = {}
    for r in range(2):
        d = GraphBuilder()
        w = d.input("w", [4, 4], role="parameter")
        a = d.op("slice", w, name="a", dim=0, start=0, end=2)
        b = d.op("slice", w, name="b", dim=0, start=2, end=4)
        d.output("y", d.op("add", a, b if bug else a, name="y"))
        ranks[r] = d
    rel = [{"from": "W", "layout": ["slice(w@0, 0, 0, 2)", "slice(w@1, 0, 0, 2)"]},
           {"from": "Z", "layout": "slice(w@0, 0, 2, 4)"}]
    write_case(tmp_path, seq_doc(s), dist_doc({"tp": 2}, ranks, rel, [{"output": "y", "placements": ["Replicate"]}]))
    return tmp_path / "seq.json", tmp_path / "dist.json"


@pytest.mark.parametrize("bug", [True, False])
def test_a_replicated_slice_is_not_the_whole_tensor(tmp_path: Path, bug: bool) -> None:
    seq_path, dist_path = _case(tmp_path, bug)
    report = check_files(seq_path, dist_path)
    # rank 1 adds rows 2:4 of its own w, which no relation ties to Z: was REFINES
    assert report.refines is (not bug), str(report)
    if bug:
        assert report.culprit is not None and report.culprit.node == "y", str(report)
    seq = load_seq(seq_path, REG)
    dist = load_dist(dist_path, REG, seq)
    results = differential(seq, dist, REG, seed=0)
    assert [r.ok for r in results] == [not bug], results


def test_random_inputs_copy_only_the_replicated_region(tmp_path: Path) -> None:
    seq_path, dist_path = _case(tmp_path, bug=True)
    seq = load_seq(seq_path, REG)
    dist = load_dist(dist_path, REG, seq)
    seq_in, rank_in = random_inputs(seq, dist, seed=0, registry=REG)
    w0, w1 = rank_in[0]["w"], rank_in[1]["w"]
    assert torch.equal(w0[:2], w1[:2]) and torch.equal(w0[:2], seq_in["W"])
    assert not torch.equal(w0[2:], w1[2:])  # drawn independently: nothing says they agree


def test_join_replicas_unions_whole_pieces_only() -> None:
    shapes = {"a@0": (2, 3), "a@1": (2, 3), "b@0": (4, 3), "b@1": (4, 3)}

    def shape_of(t: Term) -> tuple[int, ...]:
        if t.op == "D":
            return shapes[t.attrs[0]]
        if t.op == "slice":
            s = list(shape_of(t.args[0]))
            s[t.attrs[0]] = t.attrs[2] - t.attrs[1]
            return tuple(s)
        raise AssertionError(t.op)

    x = Term("cat", (leaf("a@0"), Term("slice", (leaf("b@0"),), (0, 0, 2))), (0,))
    y = Term("cat", (leaf("a@1"), Term("slice", (leaf("b@1"),), (0, 0, 2))), (0,))
    leaves, facts = join_replicas(x, y, shape_of)
    assert leaves == [("a@0", "a@1")]
    assert facts == [(x.args[1], y.args[1])]


def _bias_case(tmp_path: Path) -> tuple[Path, Path]:
    """y = M + B; each rank adds a broadcast of its b (rows 0:2 replicated) to its m."""
    s = GraphBuilder()
    b_, m_ = s.input("B", [2], role="parameter"), s.input("M", [3, 2])
    s.output("y", s.op("add", m_, b_, name="y"))
    ranks = {}
    for r in range(2):
        d = GraphBuilder()
        b, m = d.input("b", [4], role="parameter"), d.input("m", [3, 4])
        t = d.op("add", d.op("expand", b, name="e", shape=[3, 4]), m, name="s")
        d.output("y", d.op("slice", t, name="v", dim=1, start=0, end=2))
        ranks[r] = d
    rel = [{"from": "B", "layout": ["slice(b@0, 0, 0, 2)", "slice(b@1, 0, 0, 2)"]},
           {"from": "M", "layout": ["slice(m@0, 1, 0, 2)", "slice(m@1, 1, 0, 2)"]}]
    write_case(tmp_path, seq_doc(s), dist_doc({"tp": 2}, ranks, rel, [{"output": "y", "placements": ["Replicate"]}]))
    return tmp_path / "seq.json", tmp_path / "dist.json"


@pytest.mark.parametrize("chains", [True, False])
def test_a_fact_reaches_a_tensor_computed_from_its_leaf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        chains: bool) -> None:
    """A relation naming rank 1's broadcast bias next to rank 0's own m (qwen2 TP4's v: an
    earlier step's best term) is rank 0's v only through rank 0's broadcast of its own b,
    a tensor the frontier finds available but the e-graph named without its definition: the
    fact about b's rows never reached it (refine.prove.frontier._fact_chains states it).
    Without that, the same step does not prove it (what the `chains=False` case shows)."""
    if not chains:
        monkeypatch.setattr(frontier, "_fact_chains", lambda *args: None)
    seq_path, dist_path = _bias_case(tmp_path)
    seq = load_seq(seq_path, REG)
    dist = load_dist(dist_path, REG, seq)
    prog, _ = build_program(dist, REG, str(dist_path))
    seq_input_relations(dist, seq, prog, REG, str(dist_path))  # states the replicas' facts
    assert prog.facts
    term = Term("Sum", (Term("slice", (leaf("e@1"),), (1, 0, 2)), Term("slice", (leaf("m@0"),), (1, 0, 2))))
    tensors = frontier.frontier(prog, {"e@1", "m@0"}, {"b@0", "b@1", "m@0", "m@1", "e@0"}, 3)
    assert ("e@0" in tensors) is chains
    res = prove.Engine(REG).step(term, prog, REG, tensors, checks=[leaf("v@0")])
    assert res.checks == [chains]
    assert check_files(seq_path, dist_path).refines
