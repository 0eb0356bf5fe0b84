"""Low-precision numerics (`refine check --numeric`, refine.oracle.precision).

Two families. Correct programs (the bundled cases, captured training steps, and the correct
twins below) get no warning in bf16 or fp16: the distributed program loses about what the
sequential one does. Programs that refine over the reals (their float64 outputs agree, most
even REFINE) but lose precision in the format get a warning, and the loss is real: their
error against float64 is several times the correct twin's on the same inputs:

- `row_parallel(fp8_partials)`: each rank casts its partial product to fp8 before the
  all-reduce, where the sequential program keeps the full product;
- `quantized_grad(scale_after_collective)`: a gradient averaged over many tokens (values near
  1e-3, in e4m3's subnormal range) is quantized to fp8 with a scale that brings it into
  range; the ranks cast their partials unscaled and apply the scale after the all-reduce;
- `sharded_layer_norm(one_pass)`: a LayerNorm over a hidden dim the ranks split, its variance
  all-reduced as E[h^2] - E[h]^2 where the activations have a large mean: it cancels.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from refine import capture
from refine.check import check
from refine.cli import NUMERIC_FORMATS, main
from refine.frontends.build import GraphBuilder, dist_doc, seq_doc
from refine.frontends.capture import Case
from refine.frontends.graphfile import load_dist, load_seq
from refine.ir.graph import Dist, Graph
from refine.ops.interp import EXACT, eval_ranks, random_inputs
from refine.ops.registry import Registry
from refine.oracle.differential import differential
from refine.oracle.precision import (
    CHOICES,
    C,
    LowPrecision,
    PrecisionResult,
    dataflow,
    format_named,
    numeric_check,
    reduction_depth,
    tolerance,
)
from tests.helpers import MODELS, write_pair
from tests.helpers.capture import MODELS as CAPTURE_MODELS
from tests.helpers.capture import line_of, load_model

Pair = tuple[dict[str, Any], dict[str, Any]]
FP8 = "float8_e4m3fn"
FORMATS = ("bf16", "fp16")

# ---------------------------------------------------------------------------------------
# programs


def _quantized(g: GraphBuilder, x: str, name: str, scale: float | None = None) -> str:
    """x cast to fp8 and read back, multiplied by `scale` before and divided after."""
    if scale is not None:
        x = g.op("mul", x, scale, name=f"{name}_scale")
    x = g.op("cast", g.op("cast", x, name=f"{name}_fp8", dtype=FP8), name=f"{name}_dequant", dtype="float32")
    if scale is not None:
        x = g.op("mul", x, 1.0 / scale, name=f"{name}_unscale")
    return x


def row_parallel(world: int, variant: str, T: int = 16, K: int = 64, N: int = 32) -> Pair:
    """y = x @ w + b with w split by rows: each rank's partial product, all-reduced.
    "fp8_partials": the partials are cast to fp8 before the all-reduce; "fp8_after": the sum
    is cast to fp8 after it, as the sequential program casts its product."""
    s = GraphBuilder()
    x, w, b = s.input("x", [T, K]), s.input("w", [K, N], role="parameter"), s.input("b", [N], role="parameter")
    y = s.op("matmul", x, w, name="proj")
    if variant == "fp8_after":
        y = _quantized(s, y, "proj")
    s.output("y", s.op("add", y, b, name="bias"))
    ranks = {}
    for r in range(world):
        d = GraphBuilder()
        x_, w_ = d.input("x", [T, K // world]), d.input("w", [K // world, N], role="parameter")
        b_ = d.input("b", [N], role="parameter")
        p = d.op("matmul", x_, w_, name="proj")
        if variant == "fp8_partials":
            p = _quantized(d, p, "partial")
        y = d.op("all_reduce", p, name="proj_sum", reduce_op="sum", group=list(range(world)))
        if variant == "fp8_after":
            y = _quantized(d, y, "proj")
        d.output("y", d.op("add", y, b_, name="bias"))
        ranks[r] = d
    rel = [{"from": "x", "placements": ["Shard(1)"]}, {"from": "w", "placements": ["Shard(0)"]},
           {"from": "b", "placements": ["Replicate"]}]
    return seq_doc(s), dist_doc({"tp": world}, ranks, rel, [{"output": "y", "placements": ["Replicate"]}])


TOKENS = 4096.0  # the gradient is a mean over this many tokens: values near 1e-3
SCALE = 1024.0  # the fp8 scale that brings them into e4m3's normal range


def quantized_grad(world: int, variant: str, T: int = 16, K: int = 64, N: int = 32) -> Pair:
    """g = fp8(x @ w / TOKENS * SCALE) / SCALE, the product reduced over ranks. "correct":
    all-reduce, then scale and cast, as the sequential program; "scaled_partials": each rank
    scales, casts and unscales its partial, then the all-reduce (quantized communication,
    losing about what one cast does); "scale_after_collective": each rank casts its partial
    unscaled and the scale is applied after the all-reduce."""
    s = GraphBuilder()
    x, w = s.input("x", [T, K]), s.input("w", [K, N], role="parameter")
    g = s.op("mul", s.op("matmul", x, w, name="grad"), 1.0 / TOKENS, name="grad_mean")
    s.output("g", _quantized(s, g, "grad", SCALE))
    ranks = {}
    group = list(range(world))
    for r in range(world):
        d = GraphBuilder()
        x_, w_ = d.input("x", [T, K // world]), d.input("w", [K // world, N], role="parameter")
        p = d.op("mul", d.op("matmul", x_, w_, name="grad"), 1.0 / TOKENS, name="grad_mean")
        if variant == "correct":
            g = _quantized(d, d.op("all_reduce", p, name="grad_sum", reduce_op="sum", group=group), "grad", SCALE)
        elif variant == "scaled_partials":
            g = d.op("all_reduce", _quantized(d, p, "grad", SCALE), name="grad_sum", reduce_op="sum", group=group)
        else:
            assert variant == "scale_after_collective"
            g = d.op("all_reduce", _quantized(d, p, "grad"), name="grad_sum", reduce_op="sum", group=group)
            g = d.op("mul", d.op("mul", g, SCALE, name="grad_scale"), 1.0 / SCALE, name="grad_unscale")
        d.output("g", g)
        ranks[r] = d
    rel = [{"from": "x", "placements": ["Shard(1)"]}, {"from": "w", "placements": ["Shard(0)"]}]
    return seq_doc(s), dist_doc({"tp": world}, ranks, rel, [{"output": "g", "placements": ["Replicate"]}])


OFFSET = 16.0  # the activations' mean, large against their spread (1)


def sharded_layer_norm(world: int, variant: str, T: int = 16, H: int = 64) -> Pair:
    """LayerNorm of h = x + OFFSET over a hidden dim the ranks split; the statistics are
    all-reduced. "two_pass": the mean first, then the squared deviations from it;
    "one_pass": the sums of h and of h^2 together, var = E[h^2] - E[h]^2."""
    s = GraphBuilder()
    h = s.op("add", s.input("x", [T, H]), OFFSET, name="resid")
    s.output("y", s.op("layer_norm", h, name="ln", normalized_shape=[H], eps=1e-5))
    ranks = {}
    group = list(range(world))

    def summed(d: GraphBuilder, x: str, name: str) -> str:
        return d.op("all_reduce", d.op("sum", x, name=name, dim=[-1], keepdim=True), name=f"{name}_all",
                    reduce_op="sum", group=group)

    for r in range(world):
        d = GraphBuilder()
        h = d.op("add", d.input("x", [T, H // world]), OFFSET, name="resid")
        mean = d.op("mul", summed(d, h, "ln_sum"), 1.0 / H, name="ln_mean")
        dev = d.op("sub", h, mean, name="ln_dev")
        if variant == "two_pass":
            var = d.op("mul", summed(d, d.op("square", dev, name="ln_dev2"), "ln_sumsq"), 1.0 / H, name="ln_var")
        else:
            assert variant == "one_pass"
            meansq = d.op("mul", summed(d, d.op("square", h, name="ln_sq"), "ln_sumsq"), 1.0 / H, name="ln_meansq")
            var = d.op("sub", meansq, d.op("square", mean, name="ln_mean2"), name="ln_var")
        rstd = d.op("rsqrt", d.op("add", var, 1e-5, name="ln_var_eps"), name="ln_rstd")
        d.output("y", d.op("mul", dev, rstd, name="ln"))
        ranks[r] = d
    rel = [{"from": "x", "placements": ["Shard(1)"]}]
    return seq_doc(s), dist_doc({"tp": world}, ranks, rel, [{"output": "y", "placements": ["Shard(1)"]}])


Builder = Callable[[int, str], Pair]
CORRECT: list[tuple[Builder, str]] = [(row_parallel, "correct"), (row_parallel, "fp8_after"),
                                      (quantized_grad, "correct"), (quantized_grad, "scaled_partials"),
                                      (sharded_layer_norm, "two_pass")]
# each lossy variant with the correct twin it is compared with
LOSSY: list[tuple[Builder, str, str]] = [(row_parallel, "fp8_partials", "correct"),
                                         (quantized_grad, "scale_after_collective", "correct"),
                                         (sharded_layer_norm, "one_pass", "two_pass")]


def load(tmp: Path, pair: Pair, registry: Registry) -> tuple[Graph, Dist]:
    seq_path, dist_path = write_pair(tmp, *pair)
    seq = load_seq(seq_path, registry)
    return seq, load_dist(dist_path, registry, seq)


def statuses(results: list[PrecisionResult]) -> dict[str, str]:
    return {r.output: r.status for r in results}


# ---------------------------------------------------------------------------------------
# correct programs: no warning


BUNDLED = ["tp_mlp", "tp_mlp_symbolic", "sp_mlp", "sp_mlp_4ranks", "sp_mlp_symbolic", "tp_attention",
           "tp_attention_4ranks", "tp_attention_symbolic", "vocab_embedding", "vocab_embedding_4ranks"]


@pytest.mark.slow  # a family over many cases: the whole suite runs it
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", BUNDLED)
def test_bundled_correct_cases_get_no_warning(case: str, fmt: str, registry: Registry) -> None:
    seq = load_seq(MODELS / case / "seq.json", registry)
    dist = load_dist(MODELS / case / "dist.json", registry, seq)
    results = numeric_check(seq, dist, registry, fmt)
    assert results and all(r.status == "ok" for r in results), [(r.output, r.status, r.detail) for r in results]
    # the format really loses something, on both sides: the check compares errors, not zeros
    assert all(r.seq_abs_error > 0 and r.abs_error > 0 for r in results)


@functools.cache
def captured(name: str) -> Case:
    return capture(load_model(name).make_case())


# correct captured training steps (tensor, sequence, data, expert and pipeline parallel)
CAPTURED = ["tp_mlp", "megatron_mlp", "ddp_mlp", "fsdp_mlp", "dtensor_mlp", "gqa_tp", "moe_ep", "pp_tied",
            "vocab_ce"]


@pytest.mark.slow  # a family over many cases: the whole suite runs it
@pytest.mark.parametrize("name", CAPTURED)
def test_captured_correct_steps_get_no_warning_in_bf16(name: str) -> None:
    case = captured(name)
    results = numeric_check(case.seq, case.dist, case.registry, "bf16")
    assert all(r.status == "ok" for r in results), [(r.output, r.status, r.detail) for r in results]


@pytest.mark.slow  # a family over many cases: the whole suite runs it (the lossy twins below stay quick)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("make", "variant"), CORRECT, ids=[f"{m.__name__}-{v}" for m, v in CORRECT])
def test_correct_twins_get_no_warning(make: Builder, variant: str, world: int, fmt: str, registry: Registry,
                                      tmp_path: Path) -> None:
    seq, dist = load(tmp_path, make(world, variant), registry)
    results = numeric_check(seq, dist, registry, fmt)
    assert statuses(results) == {o.name: "ok" for o in seq.outputs}, [r.detail for r in results]


# ---------------------------------------------------------------------------------------
# programs that refine over the reals but lose precision: a warning, for a real loss


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("make", "variant", "twin"), LOSSY, ids=[f"{m.__name__}-{v}" for m, v, _ in LOSSY])
def test_precision_losses_warn(make: Builder, variant: str, twin: str, world: int, fmt: str, registry: Registry,
                               tmp_path: Path) -> None:
    seq, dist = load(tmp_path / "lossy", make(world, variant), registry)
    # the same function over the reals: float64 runs agree
    assert all(c.ok for c in differential(seq, dist, registry))
    (result,) = numeric_check(seq, dist, registry, fmt)
    assert result.status == "warn", result
    assert result.abs_error > result.tolerance
    # the loss is real: against float64, several times what the correct twin loses on the
    # same inputs, and several times the sequential program's own error
    seq2, dist2 = load(tmp_path / "twin", make(world, twin), registry)
    assert result.seed is not None
    (good,) = numeric_check(seq2, dist2, registry, fmt, seeds=[result.seed])
    assert good.status == "ok"
    assert result.abs_error > 4 * good.abs_error
    assert result.abs_error > 4 * result.seq_abs_error


@pytest.mark.parametrize("world", [2, 4])
def test_fp8_casts_that_refine_warn_apart_from_the_verdict(world: int, registry: Registry, tmp_path: Path) -> None:
    """Casts between floating formats are identities to the prover: the lossy fp8 programs
    REFINE, and only the numerics say what the cast costs."""
    for make, variant, _ in LOSSY[:2]:
        seq, dist = load(tmp_path / variant, make(world, variant), registry)
        assert check(seq, dist, registry).refines
        assert statuses(numeric_check(seq, dist, registry, "bf16")) == {o.name: "warn" for o in seq.outputs}


def test_a_nan_is_traced_to_the_rank_node_that_made_it(registry: Registry, tmp_path: Path) -> None:
    """The one-pass variance goes negative in bf16: its rsqrt is NaN, named with its line."""
    seq, dist = load(tmp_path, sharded_layer_norm(2, "one_pass"), registry)
    (result,) = numeric_check(seq, dist, registry, "bf16")
    assert result.status == "warn"
    rstd = next(n for n in dist.ranks[0].nodes if n.name == "ln_rstd")
    assert "not finite in bf16" in result.detail and "ln_rstd (rsqrt)" in result.detail
    assert rstd.source is not None and rstd.source in result.detail


def test_the_tolerance_is_relative_to_the_format(registry: Registry, tmp_path: Path) -> None:
    """In fp8 the sequential program loses as much as an fp8 cast of the partials does: no
    warning where bf16 and fp16 warn."""
    seq, dist = load(tmp_path, row_parallel(2, "fp8_partials"), registry)
    assert statuses(numeric_check(seq, dist, registry, "fp8")) == {"y": "ok"}
    assert statuses(numeric_check(seq, dist, registry, "fp16")) == {"y": "warn"}


@pytest.mark.slow  # a family over many cases: the whole suite runs it
@pytest.mark.parametrize(("name", "output", "snippet"), [
    # the gradient norm squared before its all-reduce (Megatron's get_grad_norm_fp32, run in fp16)
    ("clip_norm", "fc1.weight.grad", "total_norm = grad_norm ** 2"),
    # the sum of squared errors all-reduced before the division by the token count
    ("megatron_mlp", "loss", 'reduction="sum"'),
])
def test_fp16_overflows_of_captured_steps_warn_with_their_line(name: str, output: str, snippet: str) -> None:
    """Correct steps whose distributed form holds a value fp16 cannot (above 65504) where the
    sequential one does not: they REFINE, warn in fp16, name the line, and pass in bf16."""
    case = captured(name)
    assert case.check().refines
    by_output = {r.output: r for r in numeric_check(case.seq, case.dist, case.registry, "fp16")}
    assert by_output[output].status == "warn"
    assert "not finite in fp16" in by_output[output].detail
    assert line_of(CAPTURE_MODELS / f"{name}.py", snippet) in by_output[output].detail


def test_programs_that_differ_in_float64_are_left_to_the_verdict(registry: Registry) -> None:
    seq = load_seq(MODELS / "tp_mlp_bug_bias_before_sum" / "seq.json", registry)
    dist = load_dist(MODELS / "tp_mlp_bug_bias_before_sum" / "dist.json", registry, seq)
    (result,) = numeric_check(seq, dist, registry, "bf16")
    assert result.status == "skip" and "differ in float64" in result.detail


# ---------------------------------------------------------------------------------------
# the emulation and the tolerance's parts


def test_low_precision_rounds_each_value_and_each_partial_sum() -> None:
    bf16 = LowPrecision(format_named("bf16"))
    x = torch.tensor([1.0 + 2.0 ** -10, 3.0], dtype=torch.float64)
    assert bf16.store(x, "float32").tolist() == [1.0, 3.0]
    # a tensor the graph declares in fp8 is held in fp8: 1.1 is 1.125 in e4m3, 1.1015625 in bf16
    assert bf16.store(torch.tensor([1.1], dtype=torch.float64), FP8).tolist() == [1.125]
    assert bf16.store(torch.tensor([1.1], dtype=torch.float64), "float32").tolist() == [1.1015625]
    ids = torch.tensor([3, 5])
    assert bf16.store(ids, "int64") is ids
    # bf16 spaces numbers near 1 by 2^-7: each addend below half of that is lost one at a
    # time, while their exact sum, rounded once, is not
    small = 0.75 * 2.0 ** -8
    xs = [torch.tensor([v], dtype=torch.float64) for v in (1.0, small, small)]
    assert bf16.reduce(xs, "sum", "float32").item() == 1.0
    assert bf16.store(torch.stack(xs).sum(0), "float32").item() == 1.0 + 2.0 ** -7


def test_every_value_of_a_low_precision_run_is_one_the_format_holds(registry: Registry, tmp_path: Path) -> None:
    """Inputs, op results and collectives' results (a mean over 3 ranks divides by 3) alike."""
    s = GraphBuilder()
    s.output("y", s.op("mul", s.input("x", [6, 4]), 1.0 / 3, name="third"))
    ranks = {}
    for r in range(3):
        d = GraphBuilder()
        x = d.op("mul", d.input("x", [2, 4]), 1.0, name="local")
        mean = d.op("all_reduce", x, name="mean", reduce_op="avg", group=[0, 1, 2])
        d.output("y", d.op("all_gather", mean, name="gathered", dim=0, group=[0, 1, 2]))
        ranks[r] = d
    pair = seq_doc(s), dist_doc({"dp": 3}, ranks, [{"from": "x", "placements": ["Shard(0)"]}])
    seq, dist = load(tmp_path, pair, registry)
    _, rank_in = random_inputs(seq, dist, 0, registry)
    bf16 = LowPrecision(format_named("bf16"))
    values = eval_ranks(dist.ranks, registry, rank_in, bf16)
    for r, vals in values.items():
        for name, v in vals.items():
            assert torch.equal(v, v.to(torch.bfloat16).to(torch.float64)), (r, name)


def test_exact_runs_are_the_interpreter_default(registry: Registry) -> None:
    seq = load_seq(MODELS / "tp_mlp" / "seq.json", registry)
    dist = load_dist(MODELS / "tp_mlp" / "dist.json", registry, seq)
    _, rank_in = random_inputs(seq, dist, 0, registry)
    a, b = eval_ranks(dist.ranks, registry, rank_in), eval_ranks(dist.ranks, registry, rank_in, EXACT)
    low = eval_ranks(dist.ranks, registry, rank_in, LowPrecision(format_named("bf16")))
    assert all(torch.equal(a[r][k], b[r][k]) for r in a for k in a[r])
    y = dist.ranks[0].outputs[0].ref
    assert not torch.equal(a[0][y], low[0][y])


def test_reduction_depth_counts_summing_collectives_on_the_longest_chain(registry: Registry, tmp_path: Path) -> None:
    def depth_of(pair: Pair, output: str) -> int:
        seq, dist = load(tmp_path, pair, registry)
        depth = reduction_depth(dataflow(dist.ranks, registry))
        ref = next(o.ref for o in dist.ranks[0].outputs if o.name == output)
        return depth[(0, ref)]

    assert depth_of(row_parallel(4, "correct"), "y") == 4
    assert depth_of(sharded_layer_norm(2, "two_pass"), "y") == 4  # the mean's all-reduce, then the deviations'
    assert depth_of(sharded_layer_norm(2, "one_pass"), "y") == 2  # two all-reduces side by side
    seq = load_seq(MODELS / "sp_mlp" / "seq.json", registry)  # an all_gather moves values: 0; a reduce_scatter: 2
    dist = load_dist(MODELS / "sp_mlp" / "dist.json", registry, seq)
    depth = reduction_depth(dataflow(dist.ranks, registry))
    assert depth[(0, "sp_gather")] == 0
    assert depth[(0, "sp_scatter")] == depth[(1, "fc2_bias")] == 2


def test_the_tolerance_formula() -> None:
    u = format_named("bf16").u
    assert u == 2.0 ** -8 and format_named("fp16").u == 2.0 ** -11
    assert format_named("fp8").name == "fp8e4m3" and format_named("fp8e5m2").u == 2.0 ** -3
    assert tolerance(0.1, 10.0, u, 2) == (C + 2) * 0.1
    assert tolerance(0.0, 10.0, u, 0) == C * u * 10.0  # an output the sequential program computes exactly
    with pytest.raises(ValueError, match="unknown format"):
        format_named("fp4")


# ---------------------------------------------------------------------------------------
# the command line


def test_cli_formats_are_the_modules() -> None:
    assert set(NUMERIC_FORMATS) == set(CHOICES)


def test_cli_prints_numerics_after_the_verdict_without_changing_it(tmp_path: Path) -> None:
    seq, dist = write_pair(tmp_path, *row_parallel(2, "fp8_partials"))
    runner = CliRunner()
    text = runner.invoke(main, ["check", str(seq), str(dist), "--numeric", "bf16"])
    assert text.exit_code == 0, text.output
    assert text.output.index("REFINES") < text.output.index("numerics in bf16")
    assert "WARN y" in text.output and "1 numeric warning" in text.output
    out = runner.invoke(main, ["check", str(seq), str(dist), "--numeric", "fp8", "--format", "json"])
    assert out.exit_code == 0
    report = json.loads(out.output)
    assert report["verdict"] == "REFINES"
    assert report["numerics"]["format"] == "fp8e4m3" and report["numerics"]["warnings"] == 0
    plain = json.loads(runner.invoke(main, ["check", str(seq), str(dist), "--format", "json"]).output)
    assert plain["numerics"] is None


def test_cli_numerics_of_a_buggy_twin_keep_its_exit_code() -> None:
    pair = [str(MODELS / "tp_mlp_bug_bias_before_sum" / f) for f in ("seq.json", "dist.json")]
    out = CliRunner().invoke(main, ["check", *pair, "--numeric", "fp16", "--format", "json"])
    assert out.exit_code == 1
    (result,) = json.loads(out.output)["numerics"]["outputs"]
    assert result["status"] == "skip" and result["abs_error"] is None


def test_cli_numerics_too_large_to_run_are_skipped_not_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seq, dist = write_pair(tmp_path, *row_parallel(2, "correct"))
    monkeypatch.setenv("REFINE_EVAL_BUDGET", "100")
    runner = CliRunner()
    text = runner.invoke(main, ["check", str(seq), str(dist), "--numeric", "bf16"])
    assert text.exit_code == 0 and "REFINES" in text.output
    assert "not run" in text.output and "too large" in text.output
    report = json.loads(runner.invoke(main, ["check", str(seq), str(dist), "--numeric", "bf16", "--format", "json"]).output)
    assert "too large" in report["numerics"]["skipped"] and "outputs" not in report["numerics"]
