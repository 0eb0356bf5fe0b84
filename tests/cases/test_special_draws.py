"""Special-value draws (refine.ops.special): bugs that show only on an integer value the
programs single out (an ignore_index, a padding id, a threshold, a shard's range boundary)
are found by the counterexample search, which mixes those values into its later draws;
their correct twins are not false-alarmed; the draws stay consistent with the relations.

Each program's integer input is drawn below a bound (a table's row count, or 8) that makes
a plain draw hit the special value rarely or never: without the special draws every buggy
twin here is UNPROVEN (the outputs agree on every draw)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from refine.check import check_files
from refine.frontends.build import GraphBuilder, dist_doc, seq_doc, write_case
from refine.frontends.graphfile import load_dist, load_seq
from refine.ops.interp import eval_graph, eval_ranks, int_bounds, random_inputs
from refine.ops.registry import load_registry
from refine.ops.special import Mix, special_values
from refine.verdict import counterexample

IGNORE = -100
Case = tuple[dict[str, Any], dict[str, Any]]


def _nll(g: GraphBuilder, logp: str, t: str) -> tuple[str, str]:
    """The summed nll of the targets not ignored, and their count (float)."""
    valid = g.op("ne", t, IGNORE)
    safe = g.op("where", valid, t, 0)
    picked = g.op("squeeze", g.op("gather", logp, g.op("unsqueeze", safe, dim=1), dim=1), dim=[1])
    total = g.op("sum", g.op("where", valid, g.op("neg", picked), 0.0))
    return total, g.op("sum", g.op("cast", valid, dtype="float32"))


def ignore_index_mean(bug: bool, c: int = 8) -> Case:
    """The mean nll over the targets that are not ignore_index (`c` classes), data parallel:
    each rank sums its tokens' nll and counts its valid tokens, both all-reduced. Bug: the
    rank divides by every token, ignored ones included."""
    n = 8
    s = GraphBuilder()
    total, count = _nll(s, s.input("logp", [n, c]), s.input("t", [n], dtype="int64"))
    s.output("loss", s.op("div", total, count), role="loss")
    ranks = {}
    for r in range(2):
        d = GraphBuilder()
        total, count = _nll(d, d.input("logp", [n // 2, c]), d.input("t", [n // 2], dtype="int64"))
        total = d.op("all_reduce", total, reduce_op="sum", group=[0, 1])
        count = d.op("all_reduce", count, reduce_op="sum", group=[0, 1])
        d.output("loss", d.op("div", total, float(n)) if bug else d.op("div", total, count), role="loss")
        ranks[r] = d
    rel = [{"from": "logp", "placements": ["Shard(0)"]}, {"from": "t", "placements": ["Shard(0)"]}]
    return seq_doc(s), dist_doc({"dp": 2}, ranks, rel, [{"output": "loss", "placements": ["Replicate"]}])


def padding_id_masked(bug: bool) -> Case:
    """Token embeddings with the padding id's rows zeroed, data parallel. Bug: the ranks do
    not mask the padding id."""
    v, h, n, pad = 1024, 4, 8, 0

    def body(g: GraphBuilder, tokens: int, masked: bool) -> None:
        ids, w = g.input("ids", [tokens], dtype="int64"), g.input("w", [v, h], role="parameter")
        e = g.op("embedding", w, ids)
        if masked:
            e = g.op("masked_fill", e, g.op("unsqueeze", g.op("eq", ids, pad), dim=-1), value=0.0)
        g.output("y", e)

    s = GraphBuilder()
    body(s, n, True)
    ranks = {r: GraphBuilder() for r in range(2)}
    for d in ranks.values():
        body(d, n // 2, not bug)
    rel = [{"from": "ids", "placements": ["Shard(0)"]}, {"from": "w", "placements": ["Replicate"]}]
    return seq_doc(s), dist_doc({"dp": 2}, ranks, rel, [{"output": "y", "placements": ["Shard(0)"]}])


def threshold_boundary(bug: bool) -> Case:
    """Ids below k look up a table, the others get zeros, data parallel. Bug: the ranks
    compare `ids <= k`."""
    v, h, n, k = 1024, 4, 8, 500

    def body(g: GraphBuilder, tokens: int, op: str) -> None:
        ids, w = g.input("ids", [tokens], dtype="int64"), g.input("w", [v, h], role="parameter")
        keep = g.op("unsqueeze", g.op(op, ids, k), dim=-1)
        g.output("y", g.op("where", keep, g.op("embedding", w, ids), 0.0))

    s = GraphBuilder()
    body(s, n, "lt")
    ranks = {r: GraphBuilder() for r in range(2)}
    for d in ranks.values():
        body(d, n // 2, "le" if bug else "lt")
    rel = [{"from": "ids", "placements": ["Shard(0)"]}, {"from": "w", "placements": ["Replicate"]}]
    return seq_doc(s), dist_doc({"dp": 2}, ranks, rel, [{"output": "y", "placements": ["Shard(0)"]}])


def shard_range_boundary(bug: bool) -> Case:
    """Megatron's vocab-parallel embedding (rows [start, end) per rank, ids outside masked,
    the ranks' rows summed). Bug: the lower end of the range is compared `ids <= start`, so
    the id at each rank's start is masked on every rank. The boundaries are literals of the
    rank programs only."""
    v, h, n, world = 1024, 4, 6, 2
    part = v // world
    s = GraphBuilder()
    s.output("y", s.op("embedding", s.input("w", [v, h], role="parameter"), s.input("ids", [n], dtype="int64")))
    ranks = {}
    for r in range(world):
        d = GraphBuilder()
        ids, w = d.input("ids", [n], dtype="int64"), d.input("w", [part, h], role="parameter")
        start, end = r * part, (r + 1) * part
        mask = d.op("logical_or", d.op("le" if bug else "lt", ids, start), d.op("ge", ids, end))
        local = d.op("masked_fill", d.op("sub", ids, start), mask, value=0)
        e = d.op("masked_fill", d.op("embedding", w, local), d.op("unsqueeze", mask, dim=-1), value=0.0)
        d.output("y", d.op("all_reduce", e, reduce_op="sum", group=list(range(world))))
        ranks[r] = d
    rel = [{"from": "ids", "placements": ["Replicate"]}, {"from": "w", "placements": ["Shard(0)"]}]
    return seq_doc(s), dist_doc({"tp": world}, ranks, rel, [{"output": "y", "placements": ["Replicate"]}])


FAMILY: dict[str, Callable[[bool], Case]] = {
    "ignore_index_mean": ignore_index_mean,
    "padding_id_masked": padding_id_masked,
    "threshold_boundary": threshold_boundary,
    "shard_range_boundary": shard_range_boundary,
}


def _files(tmp: Path, case: Case) -> tuple[Path, Path]:
    write_case(tmp, *case)
    return tmp / "seq.json", tmp / "dist.json"


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_a_bug_on_a_compared_value_has_a_counterexample(tmp_path: Path, name: str) -> None:
    report = check_files(*_files(tmp_path, FAMILY[name](True)))
    assert report.verdict == "DOES NOT REFINE", str(report)
    found = report.search.found if report.search else None
    assert found is not None and found.mixed, str(report)
    assert found.seed >= counterexample.PLAIN  # a draw with special values, not a plain one
    assert "compare them with" in str(report)
    # written and read back, it shows the difference again and says what was mixed in
    counterexample.write(found, tmp_path / "cex")
    loaded = counterexample.load(tmp_path / "cex")
    assert loaded.mixed == found.mixed
    reg = load_registry()
    seq = load_seq(tmp_path / "seq.json", reg)
    assert any(not o.ok for o in counterexample.replay(seq, load_dist(tmp_path / "dist.json", reg, seq), reg, loaded))


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_the_correct_twin_refines(tmp_path: Path, name: str) -> None:
    # the suite's self-check runs the REFINES on a draw with the special values too
    report = check_files(*_files(tmp_path, FAMILY[name](False)), self_check=True)
    assert report.verdict == "REFINES", str(report)


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_the_correct_twin_agrees_on_every_special_draw(tmp_path: Path, name: str) -> None:
    """The search run on the correct twin (as after a stopped proof): no draw differs."""
    reg = load_registry()
    seq_file, dist_file = _files(tmp_path, FAMILY[name](False))
    seq = load_seq(seq_file, reg)
    dist = load_dist(dist_file, reg, seq)
    s = counterexample.search(seq, dist, reg, tries=6)
    assert s.found is None and s.skipped is None and s.agreed == 6, s


# ---------------------------------------------------------------------------------------
# what is singled out, and what may be drawn


def _loaded(tmp: Path, case: Case) -> tuple[Any, Any, Any]:
    reg = load_registry()
    seq_file, dist_file = _files(tmp, case)
    seq = load_seq(seq_file, reg)
    return seq, load_dist(dist_file, reg, seq), reg


def test_specials_come_from_both_sides_and_stay_evaluable(tmp_path: Path) -> None:
    seq, dist, reg = _loaded(tmp_path, shard_range_boundary(False))
    sp = special_values(seq, dist, reg, int_bounds(seq, reg))["ids"]
    # the rank programs' range ends 0, 512, 1024 and their neighbours, within the table:
    # 1024 and -1 index no row of the sequential table, so they are never drawn
    assert sp.guarded == () and sp.unsure == ()
    assert set(sp.sure) == {0, 1, 511, 512, 513, 1023}


def test_a_guarded_literal_outside_the_index_range_is_drawn(tmp_path: Path) -> None:
    seq, dist, reg = _loaded(tmp_path, ignore_index_mean(False))
    sp = special_values(seq, dist, reg, int_bounds(seq, reg))
    assert sp == {"t": sp["t"]} and sp["t"].guarded == (IGNORE,) and sp["t"].sure == sp["t"].unsure == ()


def test_arithmetic_ends_the_walk(tmp_path: Path) -> None:
    """`ids - 3 == 5` compares a value derived by arithmetic: 5 is not singled out for ids;
    `where(ids > 2, ids, 0) == 4` passes a where branch: 4 (and 2's neighbours) are."""
    s = GraphBuilder()
    ids = s.input("ids", [4], dtype="int64")
    a = s.op("eq", s.op("sub", ids, 3), 5)
    b = s.op("eq", s.op("where", s.op("gt", ids, 2), ids, 0), 4)
    s.output("y", s.op("logical_or", a, b))
    d = GraphBuilder()
    ids = d.input("ids", [4], dtype="int64")
    a = d.op("eq", d.op("sub", ids, 3), 5)
    b = d.op("eq", d.op("where", d.op("gt", ids, 2), ids, 0), 4)
    d.output("y", d.op("logical_or", a, b))
    seq, dist, reg = _loaded(tmp_path, (seq_doc(s), dist_doc({"dp": 1}, {0: d}, [])))
    sp = special_values(seq, dist, reg, int_bounds(seq, reg))["ids"]
    # no index use bounds ids: the sequential program's literals are guarded, the neighbours unsure
    assert sp.guarded == (2, 4) and sp.sure == () and sp.unsure == (1, 3)


def test_a_draw_the_programs_cannot_evaluate_is_no_evidence(tmp_path: Path) -> None:
    """The sequential program compares ids with -1 but looks them up unguarded: -1 fails to
    evaluate; the search draws again without it and the correct program is not reported."""
    def body(g: GraphBuilder, n: int) -> None:
        ids, w = g.input("ids", [n], dtype="int64"), g.input("w", [16, 2], role="parameter")
        hit = g.op("unsqueeze", g.op("ne", ids, -1), dim=-1)
        g.output("y", g.op("where", hit, g.op("embedding", w, ids), 0.0))

    s = GraphBuilder()
    body(s, 8)
    ranks = {r: GraphBuilder() for r in range(2)}
    for d in ranks.values():
        body(d, 4)
    rel = [{"from": "ids", "placements": ["Shard(0)"]}, {"from": "w", "placements": ["Replicate"]}]
    seq, dist, reg = _loaded(tmp_path, (seq_doc(s), dist_doc({"dp": 2}, ranks, rel,
                                                             [{"output": "y", "placements": ["Shard(0)"]}])))
    assert special_values(seq, dist, reg, int_bounds(seq, reg))["ids"].guarded == (-1,)
    found = counterexample.search(seq, dist, reg, tries=4)
    assert found.found is None and found.skipped is None and found.agreed == 4, found


def test_indices_are_drawn_below_the_size_they_index(tmp_path: Path) -> None:
    """Targets gathered from 6 classes: drawn below 6, not below the default bound 8 (a plain
    draw that fails the sequential lookup leaves no search at all)."""
    seq, dist, reg = _loaded(tmp_path, ignore_index_mean(True, c=6))
    for seed in range(4):
        seq_in, _ = random_inputs(seq, dist, seed, reg)
        assert 0 <= int(seq_in["t"].min()) and int(seq_in["t"].max()) < 6
    s = counterexample.search(seq, dist, reg)
    assert s.skipped is None and s.found is not None and s.found.mixed == {"t": [IGNORE]}, s


# ---------------------------------------------------------------------------------------
# draws consistent with the relations


def test_special_draws_are_consistent_with_the_relations(tmp_path: Path) -> None:
    """Integer inputs sharded, replicated and laid out over a 2 x 2 mesh: the special values
    are mixed into the sequential value before it is split, so every rank's piece is the
    piece of the value with the specials (and the other values are the plain draw's)."""
    n = 8
    s = GraphBuilder()
    ids, lab = s.input("ids", [n], dtype="int64"), s.input("lab", [n], dtype="int64")
    s.output("y", s.op("logical_and", s.op("ne", ids, IGNORE), s.op("lt", lab, 5)))
    ranks = {}
    for r in range(4):
        d = GraphBuilder()
        ids_, lab_ = d.input("ids", [n // 2], dtype="int64"), d.input("lab", [n // 2], dtype="int64")
        d.output("y", d.op("logical_and", d.op("ne", ids_, IGNORE), d.op("lt", lab_, 5)))
        ranks[r] = d
    rel = [{"from": "ids", "placements": ["Shard(0)", "Replicate"]},  # dp shards, tp replicates
           {"from": "lab", "layout": "cat(lab@0, lab@3, dim=0)"}]
    seq, dist, reg = _loaded(tmp_path, (seq_doc(s), dist_doc({"dp": 2, "tp": 2}, ranks, rel)))
    table = special_values(seq, dist, reg, int_bounds(seq, reg))
    assert table["ids"].guarded == (IGNORE,) and table["lab"].guarded == (5,)
    mix = {k: Mix(v.guarded, v.sure + v.unsure) for k, v in table.items()}
    plain_seq, _ = random_inputs(seq, dist, 1, reg)
    for seed in range(4):
        seq_in, rank_in = random_inputs(seq, dist, seed, reg, specials=mix)
        x = seq_in["ids"]
        assert (x == IGNORE).any() and (x != IGNORE).any()
        # mesh rank = dp * 2 + tp: dp halves, tp replicas
        for r in range(4):
            assert torch.equal(rank_in[r]["ids"], x[(r // 2) * (n // 2):(r // 2 + 1) * (n // 2)])
        assert torch.equal(seq_in["lab"], torch.cat([rank_in[0]["lab"], rank_in[3]["lab"]]))
        assert (seq_in["lab"] == 5).any()
        got_seq = eval_graph(seq, reg, seq_in)
        got_ranks = eval_ranks(dist.ranks, reg, rank_in)
        assert got_seq and got_ranks
    seq_in, _ = random_inputs(seq, dist, 1, reg, specials=mix)
    plain = plain_seq["ids"]
    kept = seq_in["ids"] == plain
    assert kept.sum() >= n // 2  # the elements not replaced are the plain draw's
