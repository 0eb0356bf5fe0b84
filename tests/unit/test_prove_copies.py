"""refine.prove.copies: KV heads a define copies once per local query head (aws_llama TP6, in
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

from refine.check import check_files
from refine.frontends.build import GraphBuilder, dist_doc, seq_doc, write_case
from refine.frontends.graphfile import load_dist, load_seq
from refine.ops.registry import load_registry
from refine.oracle.differential import differential
from refine.relate.program import build_program, seq_input_relations

REG = load_registry()
HD, T, H = 4, 8, 4  # head dim, tokens, model width
Q, KV, RANKS = 6, 2, 3
HOLDS = {0: (0, 0), 1: (0, 1), 2: (1, 1)}  # each rank's KV head per local query head


def _k(h: int, layer: str = "") -> str:
    return f"slice(wk{layer}, 1, {h * HD}, {(h + 1) * HD})"


def _proj(g: GraphBuilder, heads: int, kv: int, rotary: bool, layer: str = "") -> tuple[str, str]:
    """q (heads first) and k ([T, kv, HD]) of x, rotated with `rotary` (Neuron's halves
    times a cos and sin broadcast over the heads); `layer` suffixes the weights and nodes."""
    x = g.input("x", [T, H]) if layer in ("", "0") else "x"
    c = g.input("c", [T, 1, HD // 2]) if layer in ("", "0") else "c"
    wq = g.input(f"wq{layer}", [H, heads * HD], role="parameter")
    wk = g.input(f"wk{layer}", [H, kv * HD], role="parameter")
    q = g.op("view", g.op("matmul", x, wq, name=f"qp{layer}"), name=f"qv{layer}", shape=[T, heads, HD])
    k = g.op("view", g.op("matmul", x, wk, name=f"kp{layer}"), name=f"kv{layer}", shape=[T, kv, HD])
    if rotary:
        q, k = _rotate(g, q, heads, c, f"q{layer}"), _rotate(g, k, kv, c, f"k{layer}")
    return g.op("transpose", q, name=f"qt{layer}", dim0=0, dim1=1), k


def _rotate(g: GraphBuilder, x: str, heads: int, c: str, tag: str) -> str:
    cb = g.op("expand", c, name=f"cb{tag}", shape=[T, heads, HD // 2])
    a = g.op("slice", x, name=f"a{tag}", dim=2, start=0, end=HD // 2)
    b = g.op("slice", x, name=f"b{tag}", dim=2, start=HD // 2, end=HD)
    lo = g.op("sub", g.op("mul_t", cb, a, name=f"m1{tag}"), b, name=f"lo{tag}")
    hi = g.op("add", g.op("mul_t", cb, b, name=f"m2{tag}"), a, name=f"hi{tag}")
    return g.op("cat", lo, hi, name=f"r{tag}", dim=2)


def _case(tmp_path: Path, holds: dict[int, tuple[int, ...]] = HOLDS, rotary: bool = True,
          layers: int = 1, last: dict[int, tuple[int, ...]] | None = None) -> tuple[Path, Path]:
    """`layers` > 1: that many attention score blocks over one x, each with its own weights
    (names suffixed 0, 1, ...); the last one's KV heads are held as `last` says (default `holds`)."""
    tags = [""] if layers == 1 else [str(i) for i in range(layers)]
    s = GraphBuilder()
    n = Q // KV
    for t in tags:
        q, k = _proj(s, Q, KV, rotary, t)
        k = s.op("view", k, name=f"k1{t}", shape=[T, KV, 1, HD])
        k = s.op("view", s.op("expand", k, name=f"ke{t}", shape=[T, KV, n, HD]), name=f"krep{t}", shape=[T, Q, HD])
        k = s.op("transpose", s.op("transpose", k, name=f"kt{t}", dim0=0, dim1=1), name=f"ktt{t}", dim0=1, dim1=2)
        s.output(f"sc{t}", s.op("matmul", q, k, name=f"sc{t}"))
    ranks = {}
    per = Q // RANKS
    for r in range(RANKS):
        d = GraphBuilder()
        for t in tags:
            q, k = _proj(d, per, per, rotary, t)
            k = d.op("transpose", d.op("transpose", k, name=f"kt{t}", dim0=0, dim1=1), name=f"ktt{t}", dim0=1, dim1=2)
            d.output(f"sc{t}", d.op("matmul", q, k, name=f"sc{t}"))
        ranks[r] = d
    rel: list[dict[str, Any]] = [{"from": "x", "placements": ["Replicate"]}, {"from": "c", "placements": ["Replicate"]}]
    exp = []
    for t in tags:
        held = last if last is not None and t == tags[-1] else holds
        rel += [
            {"from": f"wq{t}", "layout": f"cat({', '.join(f'wq{t}@{r}' for r in range(RANKS))}, dim=1)"},
            {"from": f"wk{t}", "layout": f"cat(slice(wk{t}@0, 1, 0, {HD}), slice(wk{t}@1, 1, {HD}, {2 * HD}), dim=1)"},
            *({"define": f"wk{t}@{r}", "as": f"cat({', '.join(_k(h, t) for h in hs)}, dim=1)"} for r, hs in held.items()),
        ]
        exp.append({"output": f"sc{t}", "layout": [f"cat({', '.join(f'sc{t}@{r}' for r in range(RANKS))}, dim=0)"]})
    write_case(tmp_path, seq_doc(s), dist_doc({"tp": RANKS}, ranks, rel, exp))
    return tmp_path / "seq.json", tmp_path / "dist.json"


def _load(seq_path: Path, dist_path: Path) -> tuple[Any, Any]:
    seq = load_seq(seq_path, REG)
    return seq, load_dist(dist_path, REG, seq)


@pytest.mark.slow
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_copied_kv_heads_refine(tmp_path: Path, rotary: bool) -> None:
    seq_path, dist_path = _case(tmp_path, rotary=rotary)
    report = check_files(seq_path, dist_path)
    assert report.refines, str(report)
    assert [r.ok for r in differential(*_load(seq_path, dist_path), REG, seed=0)] == [True]


@pytest.mark.slow
def test_the_copies_are_needed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the joined copies the scores do not relate (rank 2's key is named by no
    relation): the case tests refine.prove.copies, not something else."""
    seq_path, dist_path = _case(tmp_path)
    check_module = importlib.import_module("refine.check")  # the package exports a function of that name

    monkeypatch.setattr(check_module, "join_copies", lambda *a, **k: 0)
    assert not check_files(seq_path, dist_path).refines


@pytest.mark.slow
def test_the_joined_forms(tmp_path: Path) -> None:
    """Each rank's key (the rotary's concat) is the concat of broadcasts of the first
    holders' unit heads: rank 2's both heads are rank 1's head 1."""
    from refine.check import engine_for
    from refine.prove.copies import join_copies

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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_second_layer_is_replayed_with_its_facts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two layers: the second's steps told the defines' facts (a rank's key weight is copies
    of its own heads) are replayed from the first's, each renamed fact checked to be a fact
    of the second layer (refine.prove.reuse); a wrong copy in the second layer alone is found there."""
    from refine.prove.reuse import Replayer

    told: list[bool] = []  # per accepted replay: whether its premises held facts
    valid = Replayer._valid

    def counted(self: Replayer, prem: Any, pi: Any, target: Any) -> bool:
        ok = valid(self, prem, pi, target)
        if ok:
            told.append(bool(prem.facts))
        return ok

    monkeypatch.setattr(Replayer, "_valid", counted)
    report = check_files(*_case(tmp_path / "a", layers=2))
    assert report.refines, str(report)
    assert any(told), told  # steps over the facts were replayed, not proven again
    told.clear()
    bad = check_files(*_case(tmp_path / "b", layers=2, last={0: (0, 0), 1: (0, 1), 2: (1, 0)}))
    assert not bad.refines and bad.culprit is not None and bad.culprit.node == "sc1", str(bad)
