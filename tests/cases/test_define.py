"""The `define` relation form: a rank input given in full by an expression over sequential
inputs (a zero-padded shard). A hidden size of 6 split over 2 ranks of 4 columns each: rank
1 holds columns 4:6 and two columns of padding. Its padded columns compute sigmoid(0) = 1/2,
which vanishes only through the zero rows of its second weight, so the proof needs to know
that the padding is zero; nothing but a define says so."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from refine.check import check_files
from refine.frontends.build import GraphBuilder, dist_doc, seq_doc, write_case
from refine.frontends.graphfile import load_dist, load_seq
from refine.ir.errors import InputError
from refine.ir.term import LayoutSyntaxError, Term, leaf, parse_layout
from refine.ops.interp import random_inputs
from refine.ops.registry import load_registry
from refine.oracle.differential import differential

REG = load_registry()

W1_PAD = "cat(slice(w1, 1, 4, 6), zeros([4, 2]), dim=1)"
W2_PAD = "cat(slice(w2, 0, 4, 6), zeros([2, 4]), dim=0)"


def _case(tmp_path: Path, defines: dict[str, str], reads_padding: bool = False) -> tuple[Path, Path]:
    """y = sigmoid(x @ w1) @ w2, hidden 6 padded to 2 x 4. With `reads_padding`, rank 1's
    second product reads its padded columns (sigmoid(0) = 1/2) as if they were data."""
    s = GraphBuilder()
    x, w1, w2 = s.input("x", [8, 4]), s.input("w1", [4, 6], role="parameter"), s.input("w2", [6, 4], role="parameter")
    s.output("y", s.op("matmul", s.op("sigmoid_t", s.op("matmul", x, w1, name="h"), name="a"), w2, name="y"))
    ranks = {}
    for r in range(2):
        d = GraphBuilder()
        x, w1, w2 = d.input("x", [8, 4]), d.input("w1", [4, 4], role="parameter"), d.input("w2", [4, 4], role="parameter")
        a = d.op("sigmoid_t", d.op("matmul", x, w1, name="h"), name="a")
        if reads_padding and r == 1:
            # rank 1 swaps its halves: the padded columns meet w2's real rows
            a = d.op("cat", d.op("slice", a, name="pad", dim=1, start=2, end=4),
                     d.op("slice", a, name="real", dim=1, start=0, end=2), name="swapped", dim=1)
        p = d.op("matmul", a, w2, name="p")
        d.output("y", d.op("all_reduce", p, name="y", group=[0, 1], reduce_op="sum"))
        ranks[r] = d
    rel: list[dict[str, Any]] = [
        {"from": "x", "placements": ["Replicate"]},
        {"from": "w1", "layout": "cat(w1@0, slice(w1@1, 1, 0, 2), dim=1)"},
        {"from": "w2", "layout": "cat(w2@0, slice(w2@1, 0, 0, 2), dim=0)"},
        *({"define": k, "as": v} for k, v in defines.items()),
    ]
    write_case(tmp_path, seq_doc(s), dist_doc({"tp": 2}, ranks, rel, [{"output": "y", "placements": ["Replicate"]}]))
    return tmp_path / "seq.json", tmp_path / "dist.json"


def _load(seq_path: Path, dist_path: Path) -> tuple[Any, Any]:
    seq = load_seq(seq_path, REG)
    return seq, load_dist(dist_path, REG, seq)


def test_parse_define_reads_sequential_inputs_and_zeros() -> None:
    t = parse_layout(W1_PAD, sequential=True)
    assert t == Term("cat", (Term("slice", (leaf("w1"),), (1, 4, 6)), Term("full", (), (0.0, (4, 2)))), (1,))
    with pytest.raises(LayoutSyntaxError, match="sequential inputs"):
        parse_layout("cat(slice(w1@1, 1, 0, 2), zeros([4, 2]), dim=1)", sequential=True)
    with pytest.raises(LayoutSyntaxError, match="not in the relation language"):
        parse_layout("cat(w1@0, zeros([4, 2]), dim=1)")  # no zeros in a layout: it says what ranks hold


def test_padding_defined_zero_refines(tmp_path: Path) -> None:
    seq_path, dist_path = _case(tmp_path, {"w1@1": W1_PAD, "w2@1": W2_PAD})
    report = check_files(seq_path, dist_path)
    assert report.refines, str(report)
    seq, dist = _load(seq_path, dist_path)
    assert [r.ok for r in differential(seq, dist, REG, seed=0)] == [True]


def test_random_inputs_satisfy_the_defines(tmp_path: Path) -> None:
    seq, dist = _load(*_case(tmp_path, {"w1@1": W1_PAD, "w2@1": W2_PAD}))
    seq_in, rank_in = random_inputs(seq, dist, seed=3, registry=REG)
    w1 = rank_in[1]["w1"]
    assert torch.equal(w1[:, 2:], torch.zeros(4, 2, dtype=w1.dtype))
    assert torch.allclose(w1[:, :2].double(), seq_in["w1"][:, 4:].double())
    assert torch.equal(rank_in[1]["w2"][2:], torch.zeros(2, 4, dtype=rank_in[1]["w2"].dtype))


@pytest.mark.parametrize("defines", [{}, {"w1@1": W1_PAD}], ids=["no-define", "w2-padding-free"])
def test_undefined_padding_does_not_refine(tmp_path: Path, defines: dict[str, str]) -> None:
    """Without the define of w2's padding its rows are free: sigmoid(0) = 1/2 times them
    is garbage on rank 1 (the differential test shows it, and the prover must not say
    REFINES)."""
    seq_path, dist_path = _case(tmp_path, defines)
    report = check_files(seq_path, dist_path)
    assert not report.refines, str(report)
    seq, dist = _load(seq_path, dist_path)
    assert [r.ok for r in differential(seq, dist, REG, seed=0)] == [False]


def test_padding_defined_nonzero_does_not_refine(tmp_path: Path) -> None:
    """A consistent define that makes the padding something else (a copy of real rows)."""
    seq_path, dist_path = _case(tmp_path, {"w1@1": W1_PAD, "w2@1": "cat(slice(w2, 0, 4, 6), slice(w2, 0, 0, 2), dim=0)"})
    report = check_files(seq_path, dist_path)
    assert not report.refines, str(report)
    seq, dist = _load(seq_path, dist_path)
    assert [r.ok for r in differential(seq, dist, REG, seed=0)] == [False]


def test_a_rank_reading_padding_as_data_does_not_refine(tmp_path: Path) -> None:
    seq_path, dist_path = _case(tmp_path, {"w1@1": W1_PAD, "w2@1": W2_PAD}, reads_padding=True)
    report = check_files(seq_path, dist_path)
    assert not report.refines, str(report)
    seq, dist = _load(seq_path, dist_path)
    assert [r.ok for r in differential(seq, dist, REG, seed=0)] == [False]


@pytest.mark.parametrize(("define", "where", "message"), [
    # the layout reads w1@1's columns 0:2 as w1's 4:6; this define puts w1's 2:4 there
    ({"w1@1": "cat(slice(w1, 1, 2, 4), zeros([4, 2]), dim=1)"}, "$.relations[3].as", "contradicts the relations"),
    ({"w1@1": "cat(slice(w1, 1, 4, 6), zeros([4, 3]), dim=1)"}, "$.relations[3].as", "makes shape [4, 5]"),
    ({"w1@1": "cat(slice(w9, 1, 4, 6), zeros([4, 2]), dim=1)"}, "$.relations[3].as", "not an input of the sequential"),
    ({"w1@7": W1_PAD}, "$.relations[3].define", "no rank 7"),
    ({"v@1": W1_PAD}, "$.relations[3].define", "not an input of rank 1"),
    ({"w1@1": "cat(slice(w1@1, 1, 0, 2), zeros([4, 2]), dim=1)"}, "$.relations[3].as", "syntax error"),
])
def test_a_bad_define_is_refused(tmp_path: Path, define: dict[str, str], where: str, message: str) -> None:
    seq_path, dist_path = _case(tmp_path, define)
    with pytest.raises(InputError, match=re.escape(message)) as e:
        _load(seq_path, dist_path)
    assert e.value.where == where


def test_a_define_twice_is_refused(tmp_path: Path) -> None:
    seq_path, dist_path = _case(tmp_path, {"w1@1": W1_PAD})
    import json
    doc = json.loads(dist_path.read_text())
    doc["relations"].append({"define": "w1@1", "as": W1_PAD})
    dist_path.write_text(json.dumps(doc))
    with pytest.raises(InputError, match="defined twice") as e:
        _load(seq_path, dist_path)
    assert e.value.where == "$.relations[4].define"


def test_cli_exit_2_on_a_contradicting_define(tmp_path: Path) -> None:
    import subprocess
    import sys
    seq_path, dist_path = _case(tmp_path, {"w1@1": "cat(slice(w1, 1, 2, 4), zeros([4, 2]), dim=1)"})
    cli = Path(sys.executable).parent / "refine"
    out = subprocess.run([str(cli), "check", str(seq_path), str(dist_path)],
                         capture_output=True, text=True)
    assert out.returncode == 2, out
    assert "$.relations[3].as" in out.stderr and "contradicts" in out.stderr



def test_defines_are_checked_a_group_at_a_time(tmp_path: Path) -> None:
    """The load check draws one group of defines and relations at a time (those sharing an
    input: one layer's weight), so its memory is one group's; every group is still checked,
    and a contradiction in the second group is found at its define."""
    from refine.ops.interp import _define_groups

    ok = {"w1@1": W1_PAD, "w2@1": W2_PAD}
    _, dist = _load(*_case(tmp_path, ok))
    groups = sorted(([d.input for d in ds], [r.source for r in rs]) for ds, rs in _define_groups(dist))
    assert groups == [(["w1"], ["w1"]), (["w2"], ["w2"])]
    (tmp_path / "bad").mkdir()
    bad = dict(ok, **{"w2@1": "cat(slice(w2, 0, 2, 4), zeros([2, 4]), dim=0)"})  # rows 2:4 where 4:6 are read
    with pytest.raises(InputError, match="contradicts") as e:
        _load(*_case(tmp_path / "bad", bad))
    assert e.value.where == "$.relations[4].as"


def _layers_case(tmp_path: Path, defines: list[str]) -> tuple[Path, Path]:
    """One padded weight per layer (w1's layout and define, once per layer): the layers'
    define groups are one group up to the weights' names."""
    s = GraphBuilder()
    x = s.input("x", [8, 4])
    ranks = {r: GraphBuilder() for r in range(2)}
    xs = {r: g.input("x", [8, 4]) for r, g in ranks.items()}
    rel: list[dict[str, Any]] = [{"from": "x", "placements": ["Replicate"]}]
    for i, define in enumerate(defines):
        w = s.input(f"w{i}", [4, 6], role="parameter")
        s.output(f"y{i}", s.op("matmul", x, w, name=f"y{i}"))
        for r, g in ranks.items():
            g.output(f"y{i}", g.op("matmul", xs[r], g.input(f"w{i}", [4, 4], role="parameter"), name=f"y{i}"))
        rel += [{"from": f"w{i}", "layout": f"cat(w{i}@0, slice(w{i}@1, 1, 0, 2), dim=1)"},
                {"define": f"w{i}@1", "as": define.replace("w1", f"w{i}")}]
    write_case(tmp_path, seq_doc(s), dist_doc({"tp": 2}, ranks, rel, []))
    return tmp_path / "seq.json", tmp_path / "dist.json"


def test_a_repeated_define_group_is_checked_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three layers whose define groups are one up to names: the contradiction check runs
    once (TP6 eight layers: 40 groups of 5 kinds, 40 s to load); a layer whose define
    differs is a group of its own, checked, and its contradiction is found at its define."""
    import refine.ops.interp as ev

    calls: list[list[str]] = []
    check = ev._define_conflict

    def counted(seq: Any, dist: Any, *a: Any) -> Any:
        calls.append(sorted(d.input for d in dist.defines))
        return check(seq, dist, *a)

    monkeypatch.setattr(ev, "_define_conflict", counted)
    _load(*_case_dir(tmp_path / "ok", [W1_PAD] * 3))
    assert calls == [["w0"]]
    calls.clear()
    wrong = "cat(slice(w1, 1, 2, 4), zeros([4, 2]), dim=1)"  # columns 2:4 where the layout reads 4:6
    with pytest.raises(InputError, match="contradicts") as e:
        _load(*_case_dir(tmp_path / "bad", [W1_PAD, W1_PAD, wrong]))
    assert calls == [["w0"], ["w2"]]
    assert e.value.where == "$.relations[6].as"


def _case_dir(path: Path, defines: list[str]) -> tuple[Path, Path]:
    path.mkdir()
    return _layers_case(path, defines)


def _rotary_case(tmp_path: Path, swap: bool = False) -> tuple[Path, Path]:
    """y = (x @ wq) * expand(c): six one-column heads over 2 ranks of 4, rank 1's last two
    padding (aws_llama TP6's rotary, small: a padded rank's query heads times the
    replicated cos broadcast to its head count). The sequential product reads rank 1's real
    heads, `slice(y@1, 1, 0, 2)`, which only the rank's own product over all its heads
    names. With `swap`, rank 1 multiplies the cos with its heads reversed (padding first)."""
    s = GraphBuilder()
    x, wq, c = s.input("x", [8, 4]), s.input("wq", [4, 6], role="parameter"), s.input("c", [8, 1])
    q = s.op("matmul", x, wq, name="q")
    s.output("y", s.op("mul_t", s.op("expand", c, name="cb", shape=[8, 6]), q, name="y"))
    ranks = {}
    for r in range(2):
        d = GraphBuilder()
        x, wq, c = d.input("x", [8, 4]), d.input("wq", [4, 4], role="parameter"), d.input("c", [8, 1])
        q = d.op("matmul", x, wq, name="q")
        if swap and r == 1:
            q = d.op("cat", d.op("slice", q, name="pad", dim=1, start=2, end=4),
                     d.op("slice", q, name="real", dim=1, start=0, end=2), name="swapped", dim=1)
        d.output("y", d.op("mul_t", d.op("expand", c, name="cb", shape=[8, 4]), q, name="y"))
        ranks[r] = d
    rel: list[dict[str, Any]] = [
        {"from": "x", "placements": ["Replicate"]},
        {"from": "c", "placements": ["Replicate"]},
        {"from": "wq", "layout": "cat(wq@0, slice(wq@1, 1, 0, 2), dim=1)"},
        {"define": "wq@1", "as": "cat(slice(wq, 1, 4, 6), zeros([4, 2]), dim=1)"},
    ]
    exp = [{"output": "y", "layout": ["cat(y@0, slice(y@1, 1, 0, 2), dim=1)"]}]
    write_case(tmp_path, seq_doc(s), dist_doc({"tp": 2}, ranks, rel, exp))
    return tmp_path / "seq.json", tmp_path / "dist.json"


def test_padded_heads_times_a_replicated_broadcast_refine(tmp_path: Path) -> None:
    """rules/fused.py's mul_t-of-slices: the product of rank 1's real heads with the cos is
    the slice of its whole product (without the rule no term names that slice)."""
    seq_path, dist_path = _rotary_case(tmp_path)
    report = check_files(seq_path, dist_path)
    assert report.refines, str(report)


def test_padded_heads_in_the_wrong_order_do_not_refine(tmp_path: Path) -> None:
    seq_path, dist_path = _rotary_case(tmp_path, swap=True)
    report = check_files(seq_path, dist_path)
    assert not report.refines, str(report)
    seq, dist = _load(seq_path, dist_path)
    assert [r.ok for r in differential(seq, dist, REG, seed=0)] == [False]


HD = 4  # head size


def _k(i: int) -> str:
    return f"slice(wk, 1, {i * HD}, {(i + 1) * HD})"


WK0 = f"cat({_k(0)}, {_k(0)}, {_k(1)}, dim=1)"


def _rotary(g: GraphBuilder, x: str, heads: int, c: str, s_: str, tag: str) -> str:
    """Neuron's rotary over [tokens, heads, HD]: halves times the cos and sin broadcast to
    the heads, recombined and concatenated."""
    t = 8
    cb = g.op("expand", c, name=f"cb{tag}", shape=[t, heads, HD // 2])
    sb = g.op("expand", s_, name=f"sb{tag}", shape=[t, heads, HD // 2])
    a = g.op("slice", x, name=f"a{tag}", dim=2, start=0, end=HD // 2)
    b = g.op("slice", x, name=f"b{tag}", dim=2, start=HD // 2, end=HD)
    lo = g.op("sub", g.op("mul_t", cb, a, name=f"m1{tag}"), g.op("mul_t", sb, b, name=f"m2{tag}"), name=f"lo{tag}")
    hi = g.op("add", g.op("mul_t", cb, b, name=f"m3{tag}"), g.op("mul_t", sb, a, name=f"m4{tag}"), name=f"hi{tag}")
    return g.op("cat", lo, hi, name=f"r{tag}", dim=2)


def _gqa_qk(g: GraphBuilder, t: int, h: int, heads: int, rotary: bool) -> tuple[str, str]:
    """The query projection of `heads` heads (transposed to heads first) and the key
    projection of 3 heads (the sequential KV heads, or a rank's 3 copies), rotated with
    `rotary`; both sides of _gqa_case build them alike."""
    x = g.input("x", [t, h])
    wq, wk = g.input("wq", [h, heads * HD], role="parameter"), g.input("wk", [h, 3 * HD], role="parameter")
    c, sn = g.input("c", [t, 1, HD // 2]), g.input("s", [t, 1, HD // 2])
    q = g.op("view", g.op("matmul", x, wq, name="qp"), name="qv", shape=[t, heads, HD])
    k = g.op("view", g.op("matmul", x, wk, name="kp"), name="kv", shape=[t, 3, HD])
    if rotary:
        q, k = _rotary(g, q, heads, c, sn, "q"), _rotary(g, k, 3, c, sn, "k")
    return g.op("transpose", q, name="qt", dim0=0, dim1=1), k


def _gqa_case(tmp_path: Path, wk0: str = WK0, rotary: bool = False) -> tuple[Path, Path]:
    """Scores q @ k^T of 6 query heads over 3 KV heads (groups of 2) on 2 ranks of 3 query
    heads (aws_llama TP6's copies, small): each rank's key weight holds one copy of the KV
    head of each local query head (rank 0: 0, 0, 1; rank 1: 1, 2, 2), stated by defines;
    the layout reads each KV head from its first holder. KV head 1 straddles the ranks, and
    head 0's second copy on rank 0 is read by no layout. With `rotary`, q and k are rotated
    first (the copies then meet the scores only through the rotary's products)."""
    t, h = 8, 4
    s = GraphBuilder()
    q, k = _gqa_qk(s, t, h, 6, rotary)
    k = s.op("view", k, name="k1", shape=[t, 3, 1, HD])
    k = s.op("view", s.op("expand", k, name="ke", shape=[t, 3, 2, HD]), name="kv2", shape=[t, 6, HD])
    k = s.op("transpose", s.op("transpose", k, name="kt", dim0=0, dim1=1), name="ktt", dim0=1, dim1=2)
    s.output("sc", s.op("matmul", q, k, name="sc"))
    ranks = {}
    for r in range(2):
        d = GraphBuilder()
        q, k = _gqa_qk(d, t, h, 3, rotary)
        k = d.op("transpose", d.op("transpose", k, name="kt", dim0=0, dim1=1), name="ktt", dim0=1, dim1=2)
        d.output("sc", d.op("matmul", q, k, name="sc"))
        ranks[r] = d
    rel: list[dict[str, Any]] = [
        {"from": "x", "placements": ["Replicate"]},
        {"from": "c", "placements": ["Replicate"]},
        {"from": "s", "placements": ["Replicate"]},
        {"from": "wq", "layout": "cat(wq@0, wq@1, dim=1)"},
        {"from": "wk", "layout": f"cat(slice(wk@0, 1, 0, {HD}), slice(wk@0, 1, {2 * HD}, {3 * HD}), "
                                 f"slice(wk@1, 1, {HD}, {2 * HD}), dim=1)"},
        {"define": "wk@0", "as": wk0},
        {"define": "wk@1", "as": f"cat({_k(1)}, {_k(2)}, {_k(2)}, dim=1)"},
    ]
    exp = [{"output": "sc", "layout": ["cat(sc@0, sc@1, dim=0)"]}]
    write_case(tmp_path, seq_doc(s), dist_doc({"tp": 2}, ranks, rel, exp))
    return tmp_path / "seq.json", tmp_path / "dist.json"


@pytest.mark.slow
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_copied_kv_heads_over_uneven_ranks_refine(tmp_path: Path, rotary: bool) -> None:
    """With the rotary too, every node within the near try: the copied heads' forms
    (refine.prove.copies, before the walk) reach the scores through the projection and the rotary."""
    seq_path, dist_path = _gqa_case(tmp_path, rotary=rotary)
    report = check_files(seq_path, dist_path)
    assert report.refines, str(report)
    seq, dist = _load(seq_path, dist_path)
    assert [r.ok for r in differential(seq, dist, REG, seed=0)] == [True]


@pytest.mark.slow
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_a_kv_copy_of_the_wrong_head_does_not_refine(tmp_path: Path, rotary: bool) -> None:
    """Rank 0's second local head holds KV head 1 instead of a copy of 0: no layout reads
    that copy, so the defines load, and the scores are wrong."""
    seq_path, dist_path = _gqa_case(tmp_path, f"cat({_k(0)}, {_k(1)}, {_k(1)}, dim=1)", rotary=rotary)
    report = check_files(seq_path, dist_path)
    assert not report.refines, str(report)
    seq, dist = _load(seq_path, dist_path)
    assert [r.ok for r in differential(seq, dist, REG, seed=0)] == [False]
