"""refine.copies: KV heads a define copies once per local query head (aws_llama TP6, in
small) are found, proven and joined, so the scores relate; a wrong copy does not.

6 query heads over 2 KV heads (groups of 3) on 3 ranks of 2 query heads: rank 0 holds
KV head 0 twice, rank 1 heads 0 and 1, rank 2 head 1 twice. The layout reads KV head 0
from rank 0 and head 1 from rank 1, so no relation names rank 2's key (TP6's rank 5), and
the ranks' 2-head blocks cut the sequential repeat's 3-copy groups (rank 1: one copy of
each)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

from refine.build import GraphBuilder, dist_doc, seq_doc, write_case
from refine.check import check_files
from refine.evaluate import differential
from refine.format import load_dist, load_seq
from refine.opset import load_registry
from refine.relate import build_program, seq_input_relations

REG = load_registry()
HD, T, H = 4, 8, 4  # head dim, tokens, model width
Q, KV, RANKS = 6, 2, 3
HOLDS = {0: (0, 0), 1: (0, 1), 2: (1, 1)}  # each rank's KV head per local query head


def _k(h: int) -> str:
    return f"slice(wk, 1, {h * HD}, {(h + 1) * HD})"


def _proj(g: GraphBuilder, heads: int, kv: int, rotary: bool) -> tuple[str, str]:
    """q (heads first) and k ([T, kv, HD]) of x, rotated with `rotary` (Neuron's halves
    times a cos and sin broadcast over the heads)."""
    x = g.input("x", [T, H])
    wq, wk = g.input("wq", [H, heads * HD], role="parameter"), g.input("wk", [H, kv * HD], role="parameter")
    c = g.input("c", [T, 1, HD // 2])
    q = g.op("view", g.op("matmul", x, wq, name="qp"), name="qv", shape=[T, heads, HD])
    k = g.op("view", g.op("matmul", x, wk, name="kp"), name="kv", shape=[T, kv, HD])
    if rotary:
        q, k = _rotate(g, q, heads, c, "q"), _rotate(g, k, kv, c, "k")
    return g.op("transpose", q, name="qt", dim0=0, dim1=1), k


def _rotate(g: GraphBuilder, x: str, heads: int, c: str, tag: str) -> str:
    cb = g.op("expand", c, name=f"cb{tag}", shape=[T, heads, HD // 2])
    a = g.op("slice", x, name=f"a{tag}", dim=2, start=0, end=HD // 2)
    b = g.op("slice", x, name=f"b{tag}", dim=2, start=HD // 2, end=HD)
    lo = g.op("sub", g.op("mul_t", cb, a, name=f"m1{tag}"), b, name=f"lo{tag}")
    hi = g.op("add", g.op("mul_t", cb, b, name=f"m2{tag}"), a, name=f"hi{tag}")
    return g.op("cat", lo, hi, name=f"r{tag}", dim=2)


def _case(tmp_path: Path, holds: dict[int, tuple[int, ...]] = HOLDS, rotary: bool = True) -> tuple[Path, Path]:
    s = GraphBuilder()
    q, k = _proj(s, Q, KV, rotary)
    n = Q // KV
    k = s.op("view", k, name="k1", shape=[T, KV, 1, HD])
    k = s.op("view", s.op("expand", k, name="ke", shape=[T, KV, n, HD]), name="krep", shape=[T, Q, HD])
    k = s.op("transpose", s.op("transpose", k, name="kt", dim0=0, dim1=1), name="ktt", dim0=1, dim1=2)
    s.output("sc", s.op("matmul", q, k, name="sc"))
    ranks = {}
    per = Q // RANKS
    for r in range(RANKS):
        d = GraphBuilder()
        q, k = _proj(d, per, per, rotary)
        k = d.op("transpose", d.op("transpose", k, name="kt", dim0=0, dim1=1), name="ktt", dim0=1, dim1=2)
        d.output("sc", d.op("matmul", q, k, name="sc"))
        ranks[r] = d
    rel: list[dict[str, Any]] = [
        {"from": "x", "placements": ["Replicate"]},
        {"from": "c", "placements": ["Replicate"]},
        {"from": "wq", "layout": f"cat({', '.join(f'wq@{r}' for r in range(RANKS))}, dim=1)"},
        {"from": "wk", "layout": f"cat(slice(wk@0, 1, 0, {HD}), slice(wk@1, 1, {HD}, {2 * HD}), dim=1)"},
        *({"define": f"wk@{r}", "as": f"cat({', '.join(_k(h) for h in hs)}, dim=1)"} for r, hs in holds.items()),
    ]
    exp = [{"output": "sc", "layout": [f"cat({', '.join(f'sc@{r}' for r in range(RANKS))}, dim=0)"]}]
    write_case(tmp_path, seq_doc(s), dist_doc({"tp": RANKS}, ranks, rel, exp))
    return tmp_path / "seq.json", tmp_path / "dist.json"


def _load(seq_path: Path, dist_path: Path) -> tuple[Any, Any]:
    seq = load_seq(seq_path, REG)
    return seq, load_dist(dist_path, REG, seq)


@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_copied_kv_heads_refine(tmp_path: Path, rotary: bool) -> None:
    seq_path, dist_path = _case(tmp_path, rotary=rotary)
    report = check_files(seq_path, dist_path)
    assert report.refines, str(report)
    assert [r.ok for r in differential(*_load(seq_path, dist_path), REG, seed=0)] == [True]


def test_the_copies_are_needed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the joined copies the scores do not relate (rank 2's key is named by no
    relation): the case tests refine.copies, not something else."""
    seq_path, dist_path = _case(tmp_path)
    check_module = importlib.import_module("refine.check")  # the package exports a function of that name

    monkeypatch.setattr(check_module, "join_copies", lambda *a, **k: 0)
    assert not check_files(seq_path, dist_path).refines


def test_the_joined_forms(tmp_path: Path) -> None:
    """Each rank's key (the rotary's concat) is the concat of broadcasts of the first
    holders' unit heads: rank 2's both heads are rank 1's head 1."""
    from refine.check import engine_for
    from refine.copies import join_copies

    seq, dist = _load(*_case(tmp_path))
    prog, _ = build_program(dist, REG, "dist")
    seq_input_relations(dist, seq, prog, REG, "dist")
    assert join_copies(seq, dist, prog, engine_for(REG), REG) > 0
    forms = {x: str(prog.defs[x]) for x in prog.copies if x.startswith("rk#")}
    assert forms["rk#copies@0"] == f"expand(slice(rk@0, dim=1, 0:1), [{T}, 2, {HD}])"
    assert forms["rk#copies@1"] == "cat(slice(rk@0, dim=1, 0:1), slice(rk@1, dim=1, 1:2), dim=1)"
    assert forms["rk#copies@2"] == f"expand(slice(rk@1, dim=1, 1:2), [{T}, 2, {HD}])"
    for x in forms:  # each joined its tensor
        assert prog.same.find(x) == prog.same.find(x.replace("#copies", ""))


@pytest.mark.parametrize("holds", [{0: (0, 0), 1: (0, 1), 2: (1, 0)}, {0: (0, 1), 1: (0, 1), 2: (1, 1)}],
                         ids=["rank2-swapped", "rank0-second-head"])
def test_a_wrong_copy_does_not_refine(tmp_path: Path, holds: dict[int, tuple[int, ...]]) -> None:
    """A rank holding another KV head where its query head needs a copy: the defines
    load (no layout reads that copy) and the scores are wrong, found numerically and by
    the check."""
    seq_path, dist_path = _case(tmp_path, holds)
    report = check_files(seq_path, dist_path)
    assert not report.refines, str(report)
    assert [r.ok for r in differential(*_load(seq_path, dist_path), REG, seed=0)] == [False]
