"""Shape reduction (refine.verdict.reduce): a case too large to evaluate is searched for a
counterexample at small sizes, the same programs with every size mapped consistently. Buggy
programs at large sizes get a counterexample there (DOES NOT REFINE, the reduced sizes in
the report); correct ones reduced still agree on every draw (a reduction that changed
meaning would show as a counterexample here), and a REFINES never runs the search."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from refine.check import check_files
from refine.frontends.build import GraphBuilder, dist_doc, seq_doc, write_case
from refine.frontends.graphfile import load_dist, load_seq
from refine.ir.graph import Dist, Graph, Mesh
from refine.ops.interp import eval_budget, eval_elements, random_inputs
from refine.ops.registry import load_registry
from refine.verdict import counterexample, reduce
from tests.helpers import CORPUS, RELATIONS

REG = load_registry()
# the tests' evaluation budget: every case below is far above it, its reduction far below
BUDGET = 1_000_000

Doc = dict[str, Any]
Case = Callable[[str | None], tuple[Doc, Doc]]


def tp_mlp(bug: str | None, T: int = 1024, H: int = 4096, F: int = 16384, world: int = 2) -> tuple[Doc, Doc]:
    """Megatron MLP: column-parallel fc1, gelu, row-parallel fc2, all_reduce, bias."""
    s = GraphBuilder()
    x, w1, b1 = s.input("x", [T, H]), s.input("w1", [H, F], role="parameter"), s.input("b1", [F], role="parameter")
    w2, b2 = s.input("w2", [F, H], role="parameter"), s.input("b2", [H], role="parameter")
    g = s.op("gelu", s.op("add", s.op("matmul", x, w1), b1), approximate="none")
    s.output("y", s.op("add", s.op("matmul", g, w2), b2))
    group, ranks = list(range(world)), {}
    for r in range(world):
        d = GraphBuilder()
        x_, w1_ = d.input("x", [T, H]), d.input("w1", [H, F // world], role="parameter")
        b1_, w2_ = d.input("b1", [F // world], role="parameter"), d.input("w2", [F // world, H], role="parameter")
        b2_ = d.input("b2", [H], role="parameter")
        g = d.op("gelu", d.op("add", d.op("matmul", x_, w1_), b1_), approximate="none")
        p = d.op("matmul", g, w2_)
        if bug == "bias_before_sum":
            y = d.op("all_reduce", d.op("add", p, b2_), reduce_op="sum", group=group)
        elif bug == "missing_all_reduce":
            y = d.op("add", p, b2_)
        else:
            y = d.op("add", d.op("all_reduce", p, reduce_op="sum", group=group), b2_)
        d.output("y", y)
        ranks[r] = d
    rel = [{"from": "x", "placements": ["Replicate"]}, {"from": "w1", "placements": ["Shard(1)"]},
           {"from": "b1", "placements": ["Shard(0)"]}, {"from": "w2", "placements": ["Shard(0)"]},
           {"from": "b2", "placements": ["Replicate"]}]
    return seq_doc(s), dist_doc({"tp": world}, ranks, rel, [{"output": "y", "placements": ["Replicate"]}])


def sp_mlp(bug: str | None, T: int = 2048, H: int = 1536, F: int = 6144, world: int = 4) -> tuple[Doc, Doc]:
    """Sequence-parallel MLP: tokens sharded, layer_norm, all_gather, fc1, gelu, fc2,
    reduce_scatter, bias."""
    s = GraphBuilder()
    x, ln_w, ln_b = s.input("x", [T, H]), s.input("ln_w", [H], role="parameter"), s.input("ln_b", [H], role="parameter")
    w1, w2 = s.input("w1", [H, F], role="parameter"), s.input("w2", [F, H], role="parameter")
    b2 = s.input("b2", [H], role="parameter")
    n = s.op("layer_norm", x, ln_w, ln_b, normalized_shape=[H])
    s.output("y", s.op("add", s.op("matmul", s.op("gelu", s.op("matmul", n, w1), approximate="none"), w2), b2))
    group, ranks = list(range(world)), {}
    for r in range(world):
        d = GraphBuilder()
        x_, ln_w_ = d.input("x", [T // world, H]), d.input("ln_w", [H], role="parameter")
        ln_b_, w1_ = d.input("ln_b", [H], role="parameter"), d.input("w1", [H, F // world], role="parameter")
        w2_, b2_ = d.input("w2", [F // world, H], role="parameter"), d.input("b2", [H], role="parameter")
        n = d.op("layer_norm", x_, ln_w_, ln_b_, normalized_shape=[H])
        if bug == "gather_wrong_dim":  # gathered along the hidden dim, viewed back: tokens interleave
            n = d.op("reshape", d.op("all_gather", n, dim=1, group=group), shape=[T, H])
        else:
            n = d.op("all_gather", n, dim=0, group=group)
        p = d.op("matmul", d.op("gelu", d.op("matmul", n, w1_), approximate="none"), w2_)
        if bug == "bias_before_reduce_scatter":
            y = d.op("reduce_scatter", d.op("add", p, b2_), dim=0, reduce_op="sum", group=group)
        else:
            y = d.op("add", d.op("reduce_scatter", p, dim=0, reduce_op="sum", group=group), b2_)
        d.output("y", y)
        ranks[r] = d
    rel = [{"from": "x", "placements": ["Shard(0)"]}, {"from": "ln_w", "placements": ["Replicate"]},
           {"from": "ln_b", "placements": ["Replicate"]}, {"from": "w1", "placements": ["Shard(1)"]},
           {"from": "w2", "placements": ["Shard(0)"]}, {"from": "b2", "placements": ["Replicate"]}]
    return seq_doc(s), dist_doc({"tp": world}, ranks, rel, [{"output": "y", "placements": ["Shard(0)"]}])


def tp_attention(bug: str | None, T: int = 512, NH: int = 32, HD: int = 128, world: int = 2) -> tuple[Doc, Doc]:
    """Heads split across ranks: q/k/v column-parallel, softmax(q k^T / sqrt(HD)) v per head
    (the scale a literal on both sides), output projection row-parallel, all_reduce."""
    H, nh = NH * HD, NH // world
    scale = HD ** -0.5

    def attention(g: GraphBuilder, x: str, wq: str, wk: str, wv: str, heads: int) -> str:
        def split(t: str) -> str:
            return g.op("transpose", g.op("reshape", t, shape=[T, heads, HD]), dim0=0, dim1=1)

        q, k, v = (split(g.op("matmul", x, w)) for w in (wq, wk, wv))
        a = g.op("mul", g.op("matmul", q, g.op("transpose", k, dim0=1, dim1=2)), scale)
        o = g.op("transpose", g.op("matmul", g.op("softmax", a, dim=-1), v), dim0=0, dim1=1)
        return g.op("reshape", o, shape=[T, heads * HD])

    s = GraphBuilder()
    x = s.input("x", [T, H])
    ws = [s.input(n, [H, H], role="parameter") for n in ("wq", "wk", "wv", "wo")]
    s.output("y", s.op("matmul", attention(s, x, *ws[:3], NH), ws[3]))
    group, ranks = list(range(world)), {}
    for r in range(world):
        d = GraphBuilder()
        x_ = d.input("x", [T, H])
        wq_, wk_, wv_ = (d.input(n, [H, H // world], role="parameter") for n in ("wq", "wk", "wv"))
        wo_ = d.input("wo", [H // world, H], role="parameter")
        p = d.op("matmul", attention(d, x_, wq_, wk_, wv_, nh), wo_)
        d.output("y", p if bug == "missing_all_reduce" else d.op("all_reduce", p, reduce_op="sum", group=group))
        ranks[r] = d
    rel = [{"from": "x", "placements": ["Replicate"]}, *({"from": n, "placements": ["Shard(1)"]} for n in ("wq", "wk", "wv")),
           {"from": "wo", "placements": ["Shard(0)"]}]
    return seq_doc(s), dist_doc({"tp": world}, ranks, rel, [{"output": "y", "placements": ["Replicate"]}])


def vocab_embedding(bug: str | None, V: int = 50000, H: int = 1024, T: int = 4096, world: int = 4) -> tuple[Doc, Doc]:
    """Vocabulary-parallel embedding: rows sharded, each rank looks up the ids in its range
    (integer offsets r * V/world, index arithmetic the reduction rewrites), zeroes the others,
    all_reduce."""
    n = V // world
    s = GraphBuilder()
    ids, wte = s.input("ids", [T], dtype="int64"), s.input("wte", [V, H], role="parameter")
    s.output("h", s.op("embedding", wte, ids))
    group, ranks = list(range(world)), {}
    for r in range(world):
        d = GraphBuilder()
        ids_, wte_ = d.input("ids", [T], dtype="int64"), d.input("wte", [n, H], role="parameter")
        start = (r + 1) % world * n if bug == "wrong_offset" else r * n
        mask = d.op("logical_or", d.op("lt", ids_, start), d.op("ge", ids_, start + n))
        local = d.op("masked_fill", d.op("sub", ids_, start), mask, value=0)
        e = d.op("embedding", wte_, local)
        if bug != "missing_output_mask":
            e = d.op("masked_fill", e, d.op("unsqueeze", mask, dim=-1), value=0.0)
        d.output("h", d.op("all_reduce", e, reduce_op="sum", group=group))
        ranks[r] = d
    rel = [{"from": "ids", "placements": ["Replicate"]}, {"from": "wte", "placements": ["Shard(0)"]}]
    return seq_doc(s), dist_doc({"tp": world}, ranks, rel, [{"output": "h", "placements": ["Replicate"]}])


def padded(bug: str | None, T: int = 262144, D: int = 64, u: int = 32) -> tuple[Doc, Doc]:
    """y = sigmoid(x @ w1) @ w2 with a hidden size of 3u over 2 ranks of 2u: rank 1 holds the
    last u columns and u of zero padding, which relations (layouts) and defines (zeros)
    say; their slice bounds and zeros shapes are sizes too. `reads_padding`: rank 1 swaps
    its halves, so the padded columns (sigmoid(0) = 1/2) meet real rows of w2. Many tokens,
    small weights: the loader's check of the defines draws the weights alone, within the
    tests' budget."""
    s = GraphBuilder()
    x, w1, w2 = s.input("x", [T, D]), s.input("w1", [D, 3 * u], role="parameter"), s.input("w2", [3 * u, D], role="parameter")
    s.output("y", s.op("matmul", s.op("sigmoid_t", s.op("matmul", x, w1)), w2))
    ranks = {}
    for r in range(2):
        d = GraphBuilder()
        x_, w1_, w2_ = d.input("x", [T, D]), d.input("w1", [D, 2 * u], role="parameter"), \
            d.input("w2", [2 * u, D], role="parameter")
        a = d.op("sigmoid_t", d.op("matmul", x_, w1_))
        if bug == "reads_padding" and r == 1:
            a = d.op("cat", d.op("slice", a, dim=1, start=u, end=2 * u), d.op("slice", a, dim=1, start=0, end=u), dim=1)
        d.output("y", d.op("all_reduce", d.op("matmul", a, w2_), group=[0, 1], reduce_op="sum"))
        ranks[r] = d
    rel: list[Doc] = [
        {"from": "x", "placements": ["Replicate"]},
        {"from": "w1", "layout": f"cat(w1@0, slice(w1@1, 1, 0, {u}), dim=1)"},
        {"from": "w2", "layout": f"cat(w2@0, slice(w2@1, 0, 0, {u}), dim=0)"},
        {"define": "w1@1", "as": f"cat(slice(w1, 1, {2 * u}, {3 * u}), zeros([{D}, {u}]), dim=1)"},
        {"define": "w2@1", "as": f"cat(slice(w2, 0, {2 * u}, {3 * u}), zeros([{u}, {D}]), dim=0)"},
    ]
    return seq_doc(s), dist_doc({"tp": 2}, ranks, rel, [{"output": "y", "placements": ["Replicate"]}])


def lm_head(bug: str | None, B: int = 8, S: int = 2048, H: int = 1024, V: int = 131072, world: int = 8
            ) -> tuple[Doc, Doc]:
    """Sequence-parallel hidden states gathered, then a vocabulary-parallel head: logits
    [B*S, V/world] on each rank. B*S = 16384 tokens is also the vocabulary's shard V/world:
    one value in two roles that scale differently (the tokens with the sequence, the shard
    with the vocabulary; B = world is the mesh's). `gather_wrong_dim`: gathered along the
    hidden dim and viewed back, so tokens interleave."""
    s = GraphBuilder()
    x, w = s.input("x", [B, S, H]), s.input("w", [V, H], role="parameter")
    s.output("logits", s.op("matmul", s.op("reshape", x, shape=[B * S, H]), s.op("transpose", w, dim0=0, dim1=1)))
    ranks = {}
    for r in range(world):
        d = GraphBuilder()
        x_, w_ = d.input("x", [B, S // world, H]), d.input("w", [V // world, H], role="parameter")
        g = d.op("all_gather", x_, dim=2 if bug == "gather_wrong_dim" else 1, group=list(range(world)))
        d.output("logits", d.op("matmul", d.op("reshape", g, shape=[B * S, H]), d.op("transpose", w_, dim0=0, dim1=1)))
        ranks[r] = d
    rel = [{"from": "x", "placements": ["Shard(1)"]}, {"from": "w", "placements": ["Shard(0)"]}]
    return seq_doc(s), dist_doc({"tp": world}, ranks, rel, [{"output": "logits", "placements": ["Shard(1)"]}])


CASES: dict[str, Case] = {"tp_mlp": tp_mlp, "sp_mlp": sp_mlp, "tp_attention": tp_attention,
                          "vocab_embedding": vocab_embedding, "padded": padded, "lm_head": lm_head}
BUGS = [("tp_mlp", "bias_before_sum"), ("tp_mlp", "missing_all_reduce"), ("sp_mlp", "gather_wrong_dim"),
        ("sp_mlp", "bias_before_reduce_scatter"), ("tp_attention", "missing_all_reduce"),
        ("vocab_embedding", "wrong_offset"), ("vocab_embedding", "missing_output_mask"), ("padded", "reads_padding"),
        ("lm_head", "gather_wrong_dim")]


def _smaller(big: int, small: int | list[int]) -> bool:
    """A size reduced: smaller, or (mapped by role) no role larger and some smaller."""
    return small < big if isinstance(small, int) else max(small) <= big and min(small) < big


def _write(tmp: Path, docs: tuple[Doc, Doc]) -> tuple[Path, Path]:
    write_case(tmp, *docs)
    return tmp / "seq.json", tmp / "dist.json"


def _load(paths: tuple[Path, Path]) -> tuple[Graph, Dist]:
    seq = load_seq(paths[0], REG)
    return seq, load_dist(paths[1], REG, seq)


@pytest.fixture
def budget(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setenv("REFINE_EVAL_BUDGET", str(BUDGET))
    return BUDGET


@pytest.mark.parametrize(("case", "bug"), BUGS)
def test_a_bug_at_large_sizes_gets_a_counterexample_at_reduced_sizes(tmp_path: Path, budget: int, case: str,
                                                                      bug: str) -> None:
    paths = _write(tmp_path, CASES[case](bug))
    seq, dist = _load(paths)
    assert eval_elements(seq, dist) > 100 * budget  # too large to evaluate: only a reduction can search it
    report = check_files(*paths)
    assert report.verdict == "DOES NOT REFINE" and report.exit_code == 1, str(report)
    assert report.search is not None and report.search.found is not None, str(report)
    found = report.search.found
    assert found.reduced and all(_smaller(big, small) for big, small in found.reduced.items())
    assert found.failing() and all(o.rel_err > counterexample.SIGNIFICANT for o in found.failing())
    # the counterexample's inputs are the reduced programs', within the budget
    small_seq, small_dist = reduce.apply(seq, dist, REG, found.reduced)
    assert eval_elements(small_seq, small_dist) <= budget
    assert {k: tuple(v.shape) for k, v in found.seq_inputs.items()} == \
        {i.name: i.type.shape for i in small_seq.inputs}
    assert report.to_dict()["search"]["counterexample"]["reduced"] == {str(k): v for k, v in found.reduced.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_correct_programs_reduced_still_agree(budget: int, tmp_path: Path, case: str) -> None:
    """The search run on the correct program (it runs only when the proof stops; here
    directly): every draw at the reduced sizes agrees. A reduction that changed the
    programs' meaning would show as a counterexample here."""
    seq, dist = _load(_write(tmp_path, CASES[case](None)))
    got = reduce.try_reduce(seq, dist, REG, budget)
    assert not isinstance(got, str), got
    assert got[2], "no size was reduced"
    search = counterexample.search(seq, dist, REG)
    assert search.skipped is None and search.found is None, search
    assert search.agreed == counterexample.TRIES and not search.unchecked


@pytest.mark.parametrize("case", sorted(CASES))
def test_correct_programs_at_large_sizes_still_refine_without_a_search(budget: int, tmp_path: Path,
                                                                        case: str) -> None:
    report = check_files(*_write(tmp_path, CASES[case](None)))
    assert report.verdict == "REFINES" and report.search is None, str(report)


@pytest.mark.slow  # 8 ranks and more: the whole suite runs it
def test_other_world_sizes_reduce_too(budget: int, tmp_path: Path) -> None:
    """Eight ranks: the shards (F/8) and the offsets (r * V/8, seven of them no size of any
    tensor) keep dividing."""
    for i, docs in enumerate([tp_mlp(None, world=8), vocab_embedding(None, world=8),
                              vocab_embedding("wrong_offset", world=8)]):
        seq, dist = _load(_write(tmp_path / str(i), docs))
        search = counterexample.search(seq, dist, REG)
        assert search.skipped is None, search.skipped
        assert (search.found is not None) == (i == 2), search


def test_a_size_in_two_roles_reduces_by_role(budget: int, tmp_path: Path) -> None:
    """lm_head: 16384 is the tokens (B*S, with B = 8 the mesh's) and the vocabulary's shard.
    By value one map takes both, and the tokens cannot shrink below 8 times the sequence: no
    such map fits the budget. Per occurrence the two roles reduce apart, and the reduced
    programs still agree on every draw."""
    seq, dist = _load(_write(tmp_path, lm_head(None)))
    got = reduce.try_reduce(seq, dist, REG, budget)
    assert not isinstance(got, str), got
    small_seq, small_dist, mapping = got
    assert isinstance(mapping[16384], list) and len(set(mapping[16384])) == 2, mapping
    assert eval_elements(small_seq, small_dist) <= budget and reduce.validate(small_seq, small_dist, REG) is None
    # the map read back gives the same programs (a counterexample file replays at these sizes)
    again = reduce.apply(seq, dist, REG, mapping)
    assert [i.type for i in again[0].inputs] == [i.type for i in small_seq.inputs]
    assert [n.type for n in again[1].ranks[3].nodes] == [n.type for n in small_dist.ranks[3].nodes]
    search = counterexample.search(seq, dist, REG)
    assert search.skipped is None and search.found is None and search.agreed == counterexample.TRIES


def test_sizes_tie_along_the_shape_rules_not_by_value(tmp_path: Path) -> None:
    """One value, several roles: a matmul's contracted dims are one size, its output's rows
    and columns are its operands'; a view's merged dims make a product; slices of one dim
    that meet are one position; masked_fill's mask is its input's size although its own
    shape rule does not say so (its decomposition does)."""
    n = 4096
    s = GraphBuilder()
    x, w = s.input("x", [n, n]), s.input("w", [n, n])
    y = s.op("matmul", x, w)
    v = s.op("reshape", y, shape=[n, 64, n // 64])
    a, b = s.op("slice", v, dim=1, start=0, end=32), s.op("slice", v, dim=1, start=32, end=64)
    m = s.op("masked_fill", s.op("add", a, b), s.op("gt", s.input("mask", [n // 64]), 0.0), value=0.0)
    s.output("o", m)
    (tmp_path / "seq.json").write_text(json.dumps(seq_doc(s)))
    seq = load_seq(tmp_path / "seq.json", REG)
    sites = reduce.Sites(seq, Dist(Mesh((("tp", 1),)), {}, [], []), REG)

    def same(a: tuple[str, int], b: tuple[str, int]) -> bool:
        return sites.find(("dim", "seq", a[0], a[1])) == sites.find(("dim", "seq", b[0], b[1]))

    assert same(("x", 1), ("w", 0))  # contracted
    assert same(("x", 0), (y, 0)) and same(("w", 1), (y, 1))
    assert not same(("x", 0), ("x", 1)) and not same(("x", 0), ("w", 1))  # 4096 in three roles
    assert same((y, 0), (v, 0)) and not same((y, 1), (v, 0))
    def cls(*dims: tuple[str, int]) -> tuple[Any, ...]:
        return tuple(sites.find(("dim", "seq", t, i)) for t, i in dims)

    assert (cls((y, 1)), cls((v, 1), (v, 2))) in {(cls(*((o[2], o[3]) for o in lhs)), cls(*((o[2], o[3]) for o in rhs)))
                                                  for lhs, rhs in sites.prods}
    start = next(n.name for n in seq.nodes if n.op == "slice" and n.attrs["start"] == 32)
    end = next(n.name for n in seq.nodes if n.op == "slice" and n.attrs["end"] == 32)
    assert sites.find(("attr", "seq", start, "start", None)) == sites.find(("attr", "seq", end, "end", None))
    assert same(("mask", 0), (v, 2))


def test_a_conflict_names_the_places_that_conflict(tmp_path: Path) -> None:
    """A token prepended (cat of 1 and 4095 rows): the sum keeps when its parts scale alike,
    and a part of 1 never scales, so 4095 and 4096 could only stay, which no small writing
    of them does (a size offset by a constant does not reduce). No reduction, and the
    reason names the node and the occurrences."""
    def program() -> GraphBuilder:
        g = GraphBuilder()
        x, bos, w = g.input("x", [4095, 64]), g.input("bos", [1, 64]), g.input("w", [64, 64], role="parameter")
        g.output("y", g.op("matmul", g.op("cat", bos, x, dim=0), w))
        return g

    docs = seq_doc(program()), dist_doc({"tp": 2}, {0: program(), 1: program()},
                                        [{"from": n, "placements": ["Replicate"]} for n in ("x", "bos", "w")],
                                        [{"output": "y", "placements": ["Replicate"]}])
    seq, dist = _load(_write(tmp_path, docs))
    got = reduce.try_reduce(seq, dist, REG, 1000)
    assert isinstance(got, str) and "cannot all scale" in got, got
    assert "seq cat (cat)" in got and "a size that stays" in got and "4095 [seq x dim 0" in got and "4096 [" in got, got


def test_a_size_derived_number_on_one_side_only_blocks_the_reduction(budget: int, tmp_path: Path) -> None:
    """The mean over tokens: the sequential program takes it (its 1/T comes from the shape),
    the ranks sum their shards, all_reduce and multiply by the literal 1/T. Correct at T; at a
    reduced T the literal would be wrong, so there is no reduction and no search (UNPROVEN
    rather than a false counterexample)."""
    T, H, world = 8192, 512, 2
    s = GraphBuilder()
    s.output("m", s.op("mean", s.input("x", [T, H]), dim=[0]))
    ranks = {}
    for r in range(world):
        d = GraphBuilder()
        part = d.op("sum", d.input("x", [T // world, H]), dim=[0])
        d.output("m", d.op("mul", d.op("all_reduce", part, reduce_op="sum", group=[0, 1]), 1 / T))
        ranks[r] = d
    seq, dist = _load(_write(tmp_path, (seq_doc(s), dist_doc({"tp": world}, ranks, [{"from": "x", "placements": ["Shard(0)"]}],
                                                             [{"output": "m", "placements": ["Replicate"]}]))))
    got = reduce.try_reduce(seq, dist, REG, budget)
    assert isinstance(got, str) and "looks derived from a size" in got and "only the rank programs" in got, got
    search = counterexample.search(seq, dist, REG)
    assert search.found is None and search.skipped is not None and "no reduction of its sizes" in search.skipped


def test_every_size_attribute_is_rewritten_and_the_loader_accepts_the_result(budget: int, tmp_path: Path) -> None:
    """The reduced programs are programs the loader reads: written back as documents with
    their sizes mapped, they load (the loader's own shape inference, relations, collectives)."""
    seq, dist = _load(_write(tmp_path, sp_mlp("gather_wrong_dim")))
    got = reduce.try_reduce(seq, dist, REG, budget)
    assert not isinstance(got, str), got
    small_seq, small_dist, mapping = got
    view = next(n for n in small_dist.ranks[0].nodes if n.op == "reshape")
    assert view.attrs["shape"] == [mapping[2048], mapping[1536]]
    ln = next(n for n in small_seq.nodes if n.op == "layer_norm")
    assert ln.attrs["normalized_shape"] == [mapping[1536]]
    assert reduce.validate(small_seq, small_dist, REG) is None
    # a rewrite that missed one size is refused by the validation
    wrong = [n if n is not ln else _with_attrs(n, {"normalized_shape": [1536]}) for n in small_seq.nodes]
    problem = reduce.validate(Graph(small_seq.inputs, wrong, small_seq.outputs), small_dist, REG)
    assert problem is not None and "layer_norm" in problem


def _with_attrs(n: Any, attrs: dict[str, Any]) -> Any:
    from dataclasses import replace

    return replace(n, attrs={**n.attrs, **attrs})


@pytest.mark.parametrize(("case", "bug"), [("tp_mlp", "bias_before_sum"), ("lm_head", "gather_wrong_dim")])
def test_a_reduced_counterexample_is_written_read_back_and_replayed(budget: int, tmp_path: Path, case: str,
                                                                    bug: str) -> None:
    """lm_head's map lists 16384's reduced sizes by role: read back, it rewrites alike."""
    paths = _write(tmp_path / "case", CASES[case](bug))
    seq, dist = _load(paths)
    search = counterexample.search(seq, dist, REG)
    assert search.found is not None
    assert (case == "lm_head") == any(isinstance(v, list) for v in search.found.reduced.values())
    counterexample.write(search.found, tmp_path / "cex")
    doc = json.loads((tmp_path / "cex" / "counterexample.json").read_text())
    assert doc["reduced"] == {str(k): v for k, v in search.found.reduced.items()}
    cex = counterexample.load(tmp_path / "cex")
    assert cex.reduced == search.found.reduced
    replayed = counterexample.replay(seq, dist, REG, cex)
    assert [(o.output, o.ok, o.abs_err) for o in replayed] == \
        [(o.output, o.ok, o.abs_err) for o in search.found.outputs]
    d = counterexample.diverge(seq, dist, REG, cex)
    assert d is not None and d.ranks == sorted(dist.ranks)  # every rank goes wrong


def test_sizes_are_written_over_bases_with_small_constants() -> None:
    values = [1, 2, 16, 32, 48, 144, 1024, 1536, 98304]
    bases = reduce.choose_bases(values)
    assert bases is not None and len(bases) == 1
    maps = list(reduce.candidate_maps(values))
    assert maps
    m = maps[0]
    assert m[1] == 1 and all(m[v] >= 2 for v in values if v > 1) and all(m[v] <= v for v in values)
    # products (32 * 48 = 1536, 32 * 32 = 1024), sums (3 * 48 = 144) and halves (32 / 2) keep
    assert m[32] * m[48] == m[1536] and m[32] * m[32] == m[1024] and 3 * m[48] == m[144] and 2 * m[16] == m[32]


def test_small_cases_are_not_reduced(tmp_path: Path) -> None:
    """Within the budget the search runs at the given sizes (no reduction recorded)."""
    seq, dist = _load(_write(tmp_path, tp_mlp("bias_before_sum", T=8, H=16, F=32)))
    search = counterexample.search(seq, dist, REG)
    assert search.found is not None and search.found.reduced == {}
    seq_in, _ = random_inputs(seq, dist, 0, REG)
    assert {k: tuple(v.shape) for k, v in search.found.seq_inputs.items()} == {k: tuple(v.shape) for k, v in seq_in.items()}
    assert torch.equal(search.found.seq_inputs["x"], seq_in["x"])


@pytest.mark.corpus
@pytest.mark.slow
def test_corpus_missing_layernorm_allreduce_gets_a_counterexample(tmp_path: Path) -> None:
    """The Entangle corpus bug (1.2e11 elements, far above the default budget): the layer
    norm weight's gradient is not all-reduced over the sequence-parallel ranks. Reduced
    (hidden 1536 -> 24, vocabulary 98304 -> 192, ...), a draw shows it wrong."""
    from refine.frontends.importer.entangle import import_case

    base = CORPUS / "bug_missing_layernorm_allreduce"
    import_case(base / "tp1", base / "tp2.bug", RELATIONS / "bug_missing_layernorm_allreduce.json").write(tmp_path)
    t0 = time.perf_counter()
    report = check_files(tmp_path / "seq.json", tmp_path / "dist.json")
    seconds = time.perf_counter() - t0
    assert report.verdict == "DOES NOT REFINE" and report.exit_code == 1, str(report)
    assert report.search is not None and report.search.found is not None
    found = report.search.found
    assert found.reduced and [o.output for o in found.failing()] == ["ln_weight_grad"]
    print(f"check with the reduced search: {seconds:.1f} s, search {report.stats['search_seconds']} s")


def _corpus(tmp_path: Path, name: str) -> tuple[Graph, Dist]:
    """A corpus configuration imported and loaded (refine.bench.corpus.matrix names them)."""
    from refine.bench.corpus import matrix
    from refine.frontends.importer.entangle import import_case

    (_, seq_dir, dist_dir, rel), = [row for row in matrix() if row[0] == name]
    import_case(CORPUS / seq_dir, CORPUS / dist_dir, RELATIONS / rel if rel else None).write(tmp_path)
    return _load((tmp_path / "seq.json", tmp_path / "dist.json"))


# aws_llama fits the default budget as imported (7.8e8 elements): searched at 1e7 it is reduced
CORPUS_BUDGETS = {"aws_llama/tp2_layer1": 10_000_000, "aws_llama/tp4_layer1": 10_000_000,
                  "aws_llama/tp8_layer1": 10_000_000}


@pytest.mark.corpus
@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt/paral2_layer1", "qwen2/paral2_layer1", "gpt/paral8_layer1", *CORPUS_BUDGETS])
def test_corpus_correct_cases_reduced_still_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """GPT TP8 and aws_llama reduce by role (a value in two roles): see the test below."""
    if name in CORPUS_BUDGETS:
        monkeypatch.setenv("REFINE_EVAL_BUDGET", str(CORPUS_BUDGETS[name]))
    seq, dist = _corpus(tmp_path, name)
    t0 = time.perf_counter()
    search = counterexample.search(seq, dist, REG)
    assert search.skipped is None and search.found is None, search
    assert search.agreed == counterexample.TRIES and not search.unchecked
    print(f"{name}: the search at reduced sizes in {time.perf_counter() - t0:.1f} s")


def test_numbers_derived_from_sizes_are_recognized_exactly() -> None:
    changed = {96, 128, 1024, 4096}
    derived = reduce._derived_from  # noqa: SLF001 - the rule the literal guard applies
    assert derived(2 / 96, changed) == 96  # a mean's 2/n (item 4 of issue 22)
    assert derived(128 ** -0.5, changed) == 128  # attention's 1/sqrt(d)
    assert derived(1 / 4096, changed) == 4096 and derived(3072.0, changed) is not None  # 3/4 of 4096
    for x in (1e-5, -10000.0, 0.5, 1.0, 0.0, float("inf"), 0.1443):
        assert derived(x, changed) is None, x


def test_which_attributes_hold_sizes() -> None:
    """By kind: every size and shape attribute, the ints lists but ranks and dims; no dim,
    rank, step or flag."""
    holds = {f"{op.name}.{name}": reduce._size_attr(name, kind)  # noqa: SLF001
             for op in REG.ops.values() for name, kind in op.attrs}
    for attr in ("reshape.shape", "view.shape", "full.shape", "expand.shape", "layer_norm.normalized_shape",
                 "hlo_gather.slice_sizes"):
        assert holds[attr] == "list", attr
    for attr in ("slice.start", "slice.end", "arange.end", "slice_scatter.start", "topk_values.k"):
        assert holds[attr] == "one", attr
    for attr in ("all_reduce.group", "hlo_broadcast.broadcast_dimensions", "hlo_dot.lhs_contracting_dims",
                 "hlo_gather.start_index_map", "slice.dim", "transpose.dim0", "broadcast.src", "send.peer",
                 "arange.step", "nll_loss_forward.ignore_index", "sum.dim", "permute.dims"):
        assert holds[attr] is None, attr


def test_views_relate_the_runs_of_dims_whose_products_match() -> None:
    groups = reduce._groups  # noqa: SLF001
    assert groups((1024, 32, 4608), (1024, 32, 32, 144)) == [((4608,), (32, 144))]
    assert groups((32, 32, 1024, 1024), (1024, 1024, 1024)) == [((32, 32), (1024,))]
    assert groups((8, 1, 6), (48,)) == [((6, 8), (48,))]  # dims of 1 left out
    assert groups((4, 6), (4, 6)) == []


@pytest.mark.corpus
@pytest.mark.slow
@pytest.mark.parametrize(("name", "value"), [("gpt/paral8_layer1", 8), ("aws_llama/tp8_layer1", None)])
def test_corpus_a_size_in_two_roles_reduces_by_role(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                                                    value: int | None) -> None:
    """GPT on 8 ranks: the batch is 8 like the mesh, and 8 * 1536 tokens = 12288 is also the
    vocabulary's shard (98304 / 8); aws_llama on 8 ranks: one KV head per rank (its 8 heads
    stay 8) and 4 both GQA's repeat and the query heads per rank. By value no map kept every
    relation (the reduction was refused); per occurrence the roles reduce apart (GPT's batch
    to 2 where the mesh's 8 stays)."""
    if name in CORPUS_BUDGETS:
        monkeypatch.setenv("REFINE_EVAL_BUDGET", str(CORPUS_BUDGETS[name]))
    seq, dist = _corpus(tmp_path, name)
    got = reduce.try_reduce(seq, dist, REG, eval_budget())
    assert not isinstance(got, str), got
    by_role = [v for v, small in got[2].items() if isinstance(small, list) and len(set(small)) > 1]
    assert by_role and (value is None or value in by_role), got[2]


@pytest.mark.corpus
@pytest.mark.slow
@pytest.mark.parametrize(("name", "operator", "site", "ranks"), [
    ("gpt/paral8_layer1", "scale", "transpose_6", None),  # the per-token losses halved on every rank
    ("aws_llama/tp8_layer1", "drop_collective", "all_reduce_127", [0]),
])
def test_corpus_mutants_reduced_by_role_get_counterexamples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                                                            operator: str, site: str, ranks: list[int] | None) -> None:
    """Buggy twins of the cases above: the search at sizes reduced by role shows them wrong."""
    from refine.oracle.mutate import load_case, mutate_one

    if name in CORPUS_BUDGETS:
        monkeypatch.setenv("REFINE_EVAL_BUDGET", str(CORPUS_BUDGETS[name]))
    _corpus(tmp_path, name)
    seq, dist, doc = load_case(tmp_path / "seq.json", tmp_path / "dist.json", REG)
    made = mutate_one(seq, dist, doc, REG, operator, site, ranks, seed=1)
    assert made is not None
    search = counterexample.search(seq, made[1], REG)
    assert search.found is not None and search.found.failing(), search
    assert any(isinstance(v, list) for v in search.found.reduced.values()), search.found.reduced


@pytest.mark.corpus
@pytest.mark.slow
def test_corpus_qwen2_value_read_from_the_key_columns_gets_a_counterexample(tmp_path: Path) -> None:
    """Qwen2 TP4 (6.7e9 elements) with rank 1 reading its key columns where attention wants
    its value columns (tests/corpus/test_import_entangle.py plants it): the slice bounds are
    sizes and map with the rest, so the reduced programs keep the bug and a draw shows it."""
    from refine.frontends.importer.entangle import import_case

    import_case(CORPUS / "qwen2" / "paral1_layer1", CORPUS / "qwen2" / "paral4_layer1", RELATIONS / "qwen2.json").write(tmp_path)
    doc = json.loads((tmp_path / "dist.json").read_text())
    (v,) = [n for n in doc["ranks"][1]["graph"]["nodes"] if n["name"] == "split_with_sizes_6.2"]
    assert v["attrs"] == {"dim": 1, "start": 512, "end": 640}, v
    seq, dist = _load((tmp_path / "seq.json", tmp_path / "dist.json"))
    assert counterexample.search(seq, dist, REG).found is None  # the correct case agrees
    v["attrs"].update(start=384, end=512)
    (tmp_path / "dist.json").write_text(json.dumps(doc))
    report = check_files(tmp_path / "seq.json", tmp_path / "dist.json")
    assert report.verdict == "DOES NOT REFINE", str(report)
    assert report.search is not None and report.search.found is not None and report.search.found.reduced
