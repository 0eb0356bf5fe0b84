"""Backward patterns of distributed training, written with the ops a traced step produces
(mm of permuted tensors, sum over dim lists, native_layer_norm's statistics, index_put,
gather/scatter, ...). Each correct program refines; each one with a collective left out
does not; every relation inferred on either holds numerically (refine.oracle.differential.audit)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from refine.check import check
from refine.frontends.build import GraphBuilder, dist_doc, seq_doc
from refine.frontends.graphfile import load_dist, load_seq
from refine.ir import sizes
from refine.ops.registry import load_registry
from refine.oracle.differential import audit, differential
from refine.verdict.report import Report

REG = load_registry()
Case = tuple[GraphBuilder, dict[int, GraphBuilder], list[dict[str, Any]], list[dict[str, Any]], dict[str, int]]


def _run(tmp_path: Path, case: Case, symbols: list[Any] = (), int_bound: int | None = None) -> Report:  # type: ignore[assignment]
    s, ranks, rel, exp, mesh = case
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "seq.json").write_text(json.dumps(seq_doc(s, list(symbols))))
    (tmp_path / "dist.json").write_text(json.dumps(dist_doc(mesh, ranks, rel, exp)))
    seq = load_seq(tmp_path / "seq.json", REG)
    dist = load_dist(tmp_path / "dist.json", REG, seq)
    report = check(seq, dist, REG)
    bad = audit(seq, dist, REG, seed=1, int_bound=int_bound)
    assert not bad, [f"{m.tensor}: {m.relation} ({m.detail})" for m in bad]
    diff = differential(seq, dist, REG, seed=2, int_bound=int_bound)
    assert all(d.ok == report.refines for d in diff if d.ok is not None) or not report.refines, diff
    return report


def _verdict(tmp_path: Path, make: Callable[[bool], Case], symbols: list[Any] = (),  # type: ignore[assignment]
             int_bound: int | None = None) -> tuple[Report, Report]:
    good = _run(tmp_path / "good", make(False), symbols, int_bound)
    bug = _run(tmp_path / "bug", make(True), symbols, int_bound)
    return good, bug


def _failing(report: Report) -> set[str]:
    return {o.name for o in report.outputs if not o.ok}


# ---------------------------------------------------------------------------------------
# tensor parallelism


def column_parallel(bug: bool) -> Case:
    """y = x @ w.T with w [F, H] split by rows (output features): dw = dy.T @ x is the rank
    pieces' concat, dx = dy @ w a sum over ranks (the all_reduce of the input grad)."""
    T, H, F = 4, 6, 8
    s = GraphBuilder()
    x, w, dy = s.input("x", [T, H]), s.input("w", [F, H], role="parameter"), s.input("dy", [T, F])
    s.output("y", s.op("mm", x, s.op("permute", w, dims=[1, 0])))
    s.output("dw", s.op("mm", s.op("permute", dy, dims=[1, 0]), x), role="gradient", of="w")
    s.output("dx", s.op("mm", dy, w), role="gradient", of="x")
    ranks = {}
    for r in range(2):
        d = GraphBuilder()
        x_, w_, dy_ = d.input("x", [T, H]), d.input("w", [F // 2, H]), d.input("dy", [T, F // 2])
        d.output("y", d.op("mm", x_, d.op("permute", w_, dims=[1, 0])))
        d.output("dw", d.op("mm", d.op("permute", dy_, dims=[1, 0]), x_))
        dx = d.op("mm", dy_, w_)
        d.output("dx", dx if bug else d.op("all_reduce", dx, reduce_op="sum", group=[0, 1]))
        ranks[r] = d
    rel = [{"from": "x", "placements": ["Replicate"]}, {"from": "w", "placements": ["Shard(0)"]},
           {"from": "dy", "placements": ["Shard(1)"]}]
    exp = [{"output": "y", "placements": ["Shard(1)"]}, {"output": "dw", "placements": ["Shard(0)"]},
           {"output": "dx", "placements": ["Replicate"]}]
    return s, ranks, rel, exp, {"tp": 2}


@pytest.mark.slow
def test_column_parallel_grads(tmp_path: Path) -> None:
    good, bug = _verdict(tmp_path, column_parallel)
    assert good.refines, str(good)
    assert _failing(bug) == {"dx"}, str(bug)


def row_parallel_dp(bug: bool, permuted_on_ranks: bool = False) -> Case:
    """A row-parallel linear (w [H, F] split by input features) on a dp x tp mesh, tokens
    split over dp: the weight grad dy.T @ x sums over the tokens, so each tp piece is the
    Sum over the dp ranks (all_reduce over the dp group); the input grad needs nothing.
    The upstream grad also comes in transposed (`dyt` = dy.T, [H, T]); the next test transposes it on the ranks."""
    T, F, H = 4, 4, 3
    s = GraphBuilder()
    x, w = s.input("x", [T, F]), s.input("w", [H, F], role="parameter")
    dy, dyt = s.input("dy", [T, H]), s.input("dyt", [H, T])
    s.output("dw", s.op("mm", s.op("permute", dy, dims=[1, 0]) if permuted_on_ranks else dyt, x),
             role="gradient", of="w")
    s.output("dx", s.op("mm", dy, w), role="gradient", of="x")
    ranks = {}
    for r in range(4):
        dp, tp = divmod(r, 2)
        d = GraphBuilder()
        x_, w_ = d.input("x", [T // 2, F // 2]), d.input("w", [H, F // 2])
        dy_, dyt_ = d.input("dy", [T // 2, H]), d.input("dyt", [H, T // 2])
        dw = d.op("mm", d.op("permute", dy_, dims=[1, 0]) if permuted_on_ranks else dyt_, x_)
        dp_group = [tp, tp + 2]
        d.output("dw", dw if bug else d.op("all_reduce", dw, reduce_op="sum", group=dp_group))
        d.output("dx", d.op("mm", dy_, w_))
        ranks[r] = d
    rel = [{"from": "x", "placements": ["Shard(0)", "Shard(1)"]},
           {"from": "w", "placements": ["Replicate", "Shard(1)"]},
           {"from": "dy", "placements": ["Shard(0)", "Replicate"]},
           {"from": "dyt", "placements": ["Shard(1)", "Replicate"]}]
    exp = [{"output": "dw", "placements": ["Replicate", "Shard(1)"]},
           {"output": "dx", "placements": ["Shard(0)", "Shard(1)"]}]
    return s, ranks, rel, exp, {"dp": 2, "tp": 2}


def test_row_parallel_weight_grad_sums_over_data_parallel_ranks(tmp_path: Path) -> None:
    good, bug = _verdict(tmp_path, row_parallel_dp)
    assert good.refines, str(good)
    assert _failing(bug) == {"dw"}, str(bug)


def test_row_parallel_weight_grad_of_a_replicated_intermediate(tmp_path: Path) -> None:
    good = _run(tmp_path, row_parallel_dp(False, permuted_on_ranks=True))
    assert good.refines, str(good)


# ---------------------------------------------------------------------------------------
# sequence parallelism: sums over the token dim of token-sharded tensors


def bias_grad_sp(bug: bool) -> Case:
    B, T, H = 2, 4, 3
    s = GraphBuilder()
    dy = s.input("dy", [B, T, H])
    s.output("db", s.op("sum", dy, dim=[0, 1]), role="gradient", of="dy")
    ranks = {}
    for r in range(2):
        d = GraphBuilder()
        db = d.op("sum", d.input("dy", [B, T // 2, H]), dim=[0, 1])
        d.output("db", db if bug else d.op("all_reduce", db, reduce_op="sum", group=[0, 1]))
        ranks[r] = d
    rel = [{"from": "dy", "placements": ["Shard(1)"]}]
    return s, ranks, rel, [{"output": "db", "placements": ["Replicate"]}], {"sp": 2}


def test_bias_grad_under_sequence_parallelism(tmp_path: Path) -> None:
    good, bug = _verdict(tmp_path, bias_grad_sp)
    assert good.refines, str(good)
    assert not bug.refines and bug.culprit is not None and bug.culprit.node == "sum", str(bug)


def layer_norm_sp(bug: bool, symbolic: bool = False) -> Case:
    """native_layer_norm on token shards and its decomposed backward: the weight and bias
    grads sum over tokens (all_reduce over the sequence-parallel ranks); the input grad uses
    the saved mean and rstd and stays token-sharded."""
    T, H = (sizes.sym("T", multiple=2), sizes.sym("H")) if symbolic else (4, 5)

    def program(g: GraphBuilder, t: Any, reduce_dw: bool, reduce_db: bool) -> None:
        x, w, dy = g.input("x", [t, H]), g.input("w", [H], role="parameter"), g.input("dy", [t, H])
        mean = g.op("layer_norm_mean", x, normalized_shape=[H], eps=1e-5)
        rstd = g.op("layer_norm_rstd", x, normalized_shape=[H], eps=1e-5)
        xhat = g.op("mul", g.op("sub", x, mean), rstd, name="xhat")
        dw = g.op("sum", g.op("mul", dy, xhat), dim=[0], name="dw")
        db = g.op("sum", dy, dim=[0], name="db")
        if reduce_dw:
            dw = g.op("all_reduce", dw, reduce_op="sum", group=[0, 1], name="dw_sum")
        if reduce_db:
            db = g.op("all_reduce", db, reduce_op="sum", group=[0, 1], name="db_sum")
        g.output("dw", dw, role="gradient", of="w")
        g.output("db", db, role="gradient", of="w")
        if not symbolic:  # aten's input grad: rstd / H * (H * g - sum(g) - xhat * sum(g * xhat))
            gx = g.op("mul", dy, w)
            a = g.op("mul", gx, H)
            b = g.op("sum", gx, dim=[1], keepdim=True)
            c = g.op("mul", xhat, g.op("sum", g.op("mul", gx, xhat), dim=[1], keepdim=True))
            dx = g.op("mul", g.op("div", rstd, H), g.op("sub", g.op("sub", a, b), c))
            g.output("dx", dx, role="gradient", of="x")

    s = GraphBuilder()
    program(s, T, False, False)
    ranks = {}
    for r in range(2):
        ranks[r] = GraphBuilder()
        program(ranks[r], T // 2, reduce_dw=not bug, reduce_db=True)  # the bug: dw is not reduced
    rel = [{"from": "x", "placements": ["Shard(0)"]}, {"from": "dy", "placements": ["Shard(0)"]},
           {"from": "w", "placements": ["Replicate"]}]
    exp = [{"output": "dw", "placements": ["Replicate"]}, {"output": "db", "placements": ["Replicate"]}]
    if not symbolic:
        exp.append({"output": "dx", "placements": ["Shard(0)"]})
    return s, ranks, rel, exp, {"sp": 2}


@pytest.mark.slow
def test_layer_norm_grads_under_sequence_parallelism(tmp_path: Path) -> None:
    good, bug = _verdict(tmp_path, layer_norm_sp)
    assert good.refines, str(good)
    assert _failing(bug) == {"dw"}, str(bug)
    assert bug.culprit is not None and bug.culprit.node == "dw", str(bug)


@pytest.mark.slow
def test_layer_norm_weight_grad_symbolic(tmp_path: Path) -> None:
    T, H = sizes.sym("T", multiple=2), sizes.sym("H")
    good, bug = _verdict(tmp_path, lambda bug: layer_norm_sp(bug, symbolic=True), [T, H])
    assert good.refines and good.symbols, str(good)
    assert _failing(bug) == {"dw"}, str(bug)


def positions_sp(bug: bool, symbolic: bool = False) -> Case:
    """Position embeddings with each sequence-parallel rank building its own position ids."""
    T, H = (sizes.sym("T", multiple=2), 3) if symbolic else (6, 3)
    s = GraphBuilder()
    wpe = s.input("wpe", [T, H], role="parameter")
    s.output("pe", s.op("embedding", wpe, s.op("arange", end=T)))
    ranks = {}
    for r in range(2):
        d = GraphBuilder()
        start = 0 if bug else r * (T // 2)
        pos = d.op("arange", start=start, end=start + T // 2)
        d.output("pe", d.op("embedding", d.input("wpe", [T, H]), pos))
        ranks[r] = d
    return s, ranks, [{"from": "wpe", "placements": ["Replicate"]}], [{"output": "pe", "placements": ["Shard(0)"]}], {"sp": 2}


@pytest.mark.slow
@pytest.mark.parametrize("symbolic", [False, True])
def test_sequence_parallel_position_ids(tmp_path: Path, symbolic: bool) -> None:
    syms = [sizes.sym("T", multiple=2)] if symbolic else []
    good, bug = _verdict(tmp_path, lambda bug: positions_sp(bug, symbolic), syms)
    assert good.refines, str(good)
    assert not bug.refines, str(bug)


# ---------------------------------------------------------------------------------------
# data parallelism: the embedding grad and a cross-entropy loss over sharded rows


def embedding_grad_dp(bug: bool, symbolic: bool = False) -> Case:
    """aten's embedding backward: mask padding/out-of-range ids, clamp, accumulate the rows
    into zeros with index_put; each data-parallel rank's grad is a partial sum."""
    B, T, V, H = (sizes.sym("B", multiple=2), sizes.sym("T"), 5, sizes.sym("H")) if symbolic else (4, 3, 5, 2)

    def program(g: GraphBuilder, b: int) -> str:
        ids, dy = g.input("ids", [b, T], "int64"), g.input("dy", [b, T, H])
        ok = g.op("bitwise_and", g.op("bitwise_and", g.op("ge", ids, 0), g.op("lt", ids, V)), g.op("ne", ids, -1))
        masked = g.op("where", g.op("bitwise_not", g.op("unsqueeze", ok, dim=-1)), g.op("scalar_tensor", s=0.0), dy)
        zeros = g.op("full", value=0.0, shape=[V, H])
        return g.op("index_put", zeros, g.op("clamp", ids, min=-V, max=V - 1), masked, accumulate=True,
                    name="grad")

    s = GraphBuilder()
    s.input("w", [V, H], role="parameter")
    s.output("dw", program(s, B), role="gradient", of="w")
    ranks = {}
    for r in range(2):
        d = GraphBuilder()
        d.input("w", [V, H], role="parameter")
        g = program(d, B // 2)
        d.output("dw", g if bug else d.op("all_reduce", g, reduce_op="sum", group=[0, 1]))
        ranks[r] = d
    rel = [{"from": "ids", "placements": ["Shard(0)"]}, {"from": "dy", "placements": ["Shard(0)"]},
           {"from": "w", "placements": ["Replicate"]}]
    return s, ranks, rel, [{"output": "dw", "placements": ["Replicate"]}], {"dp": 2}


@pytest.mark.slow
@pytest.mark.parametrize("symbolic", [False, True])
def test_embedding_grad_under_data_parallelism(tmp_path: Path, symbolic: bool) -> None:
    syms = [sizes.sym("B", multiple=2), sizes.sym("T"), sizes.sym("H")] if symbolic else []
    good, bug = _verdict(tmp_path, lambda bug: embedding_grad_dp(bug, symbolic), syms, int_bound=5)
    assert good.refines, str(good)
    assert not bug.refines and bug.culprit is not None and bug.culprit.node == "grad", str(bug)


def cross_entropy_dp(bug: bool, recompute_mask: bool = False, symbolic: bool = False) -> Case:
    """aten's cross-entropy (ignore_index -100, mean over valid targets) and its logits
    grad, with the logits' rows split over ranks: the loss needs the all_reduced sum and
    count; the grad (one-hot by scatter) stays row-sharded. `recompute_mask`: the count
    recomputes ne(tgt, -100), as the traced decomposition does (see the xfail test)."""
    N, V = (sizes.sym("N", multiple=2), 5) if symbolic else (6, 5)

    def program(g: GraphBuilder, n: Any, reduce: bool, skip_sum: bool = False) -> None:
        logits, tgt = g.input("logits", [n, V]), g.input("tgt", [n], "int64")
        ls = g.op("_log_softmax", logits, dim=1, half_to_float=False)
        valid = g.op("ne", tgt, -100)
        idx = g.op("unsqueeze", g.op("where", valid, tgt, 0), dim=1)
        nll = g.op("neg", g.op("squeeze", g.op("gather", ls, idx, dim=1), dim=[1]))
        total = g.op("sum", g.op("where", valid, nll, 0.0), dim=[], name="total")
        mask = g.op("ne", tgt, -100) if recompute_mask else valid
        count = g.op("to_copy", g.op("sum", mask, dim=[]), dtype="float32", name="count")
        if reduce:
            if not skip_sum:
                total = g.op("all_reduce", total, reduce_op="sum", group=[0, 1])
            count = g.op("all_reduce", count, reduce_op="sum", group=[0, 1])
        loss = g.op("div", total, count, name="loss")
        g.output("loss", loss, role="loss")
        # backward of the loss w.r.t. the logits
        gl = g.op("div", g.op("full_like", loss, fill_value=1.0), count)
        u = g.op("unsqueeze", tgt, dim=1)
        uvalid = g.op("ne", u, -100)
        onehot = g.op("scatter_value", g.op("full_like", ls, fill_value=0.0), g.op("where", uvalid, u, 0), dim=1, value=-1.0)
        dls = g.op("mul", onehot, g.op("where", uvalid, gl, 0.0))
        dlogits = g.op("sub", dls, g.op("mul", g.op("exp", ls), g.op("sum", dls, dim=[1], keepdim=True)))
        g.output("dlogits", dlogits, role="gradient", of="logits")

    s = GraphBuilder()
    program(s, N, reduce=False)
    ranks = {}
    for r in range(2):
        ranks[r] = GraphBuilder()
        program(ranks[r], N // 2, reduce=True, skip_sum=bug)
    rel = [{"from": "logits", "placements": ["Shard(0)"]}, {"from": "tgt", "placements": ["Shard(0)"]}]
    exp = [{"output": "loss", "placements": ["Replicate"]}, {"output": "dlogits", "placements": ["Shard(0)"]}]
    return s, ranks, rel, exp, {"dp": 2}


@pytest.mark.slow
@pytest.mark.parametrize("symbolic", [False, True])
def test_cross_entropy_with_row_sharded_logits(tmp_path: Path, symbolic: bool) -> None:
    syms = [sizes.sym("N", multiple=2)] if symbolic else []
    # targets below the vocab size
    good, bug = _verdict(tmp_path, lambda bug: cross_entropy_dp(bug, symbolic=symbolic), syms, int_bound=5)
    assert good.refines, str(good)
    assert _failing(bug) == {"loss"}, str(bug)
    assert bug.culprit is not None and bug.culprit.node == "loss", str(bug)


def test_cross_entropy_with_a_recomputed_mask(tmp_path: Path) -> None:
    good = _run(tmp_path, cross_entropy_dp(False, recompute_mask=True), int_bound=5)
    assert good.refines, str(good)
