"""Low-precision numerics: does the distributed program lose more precision than the
sequential one would, in bf16, fp16 or fp8 (`refine check --numeric`)?

A program can refine over the reals, which is what the verdict proves, and still be worse in
floating point: a reduction regrouped so that bf16 partial sums cancel, an fp8 cast (or its
scale) moved to the other side of a collective. `numeric_check` runs both sides on random
inputs consistent with the relations (the differential oracle's inputs, seed by seed) four
ways, the sequential and the rank programs each exactly and each in the format, and compares,
for every sequential output, the error of what the rank outputs make in the format (read
through the output's expectation) with the error of the sequential output in the format,
both against the exact sequential value. The result is a warning or not, never a verdict.

What is emulated (`LowPrecision`): every floating tensor a program holds, each input, each
op's result and each collective's, is rounded to the format (round to nearest even, torch's
cast; fp8 e4m3 saturates at +-448 as that cast does). An op computes in float64 from values
the format holds and rounds once: a kernel that accumulates in float32 and stores in the
format, as bf16/fp16 matmuls and reductions run on GPUs (the float32 accumulator's own error,
2^-24, is left out). A tensor the graph declares in a narrower format (a cast to
float8_e4m3fn, float16 or bfloat16) is rounded to that one first, so a program's own casts
count. A reducing collective adds its members' values one at a time in group order and
rounds each partial sum to the format, as a ring or tree all-reduce in that dtype does.
`fp8e4m3`/`fp8e5m2` store every tensor in fp8 (u = 2^-4, 2^-3), far harsher than an fp8
recipe, which keeps fp8 for matmul inputs: use them on the part of a program that runs in fp8.

The tolerance (per output o, per seed; `tolerance`):

    E_seq  = max |seq_fmt(o) - seq_exact(o)|          what the sequential loses in the format
    E_dist = max |expect(ranks_fmt)(o) - seq_exact(o)|
    tol    = (C + D_o) * max(E_seq, u * max |seq_exact(o)|),   C = 2
    warn when E_dist > tol on some seed

This follows first-order rounding error analysis: an output's error is a sum, over the
places that round, of each rounding (at most u relative to the value rounded) times how much
the rest of the program amplifies it. The distributed program rounds where the sequential
one does, each op computing the same values on a slice (the same errors, elementwise), except
at its reducing collectives: an all-reduce of k terms adds k roundings the sequential program
does not make (each partial rounded on its rank, then k-1 rounded partial sums), at most
k u sum_r |x_r| (Higham, Accuracy and Stability of Numerical Algorithms, section 4.2). Counted
condition-free, relative to the reduced value (k u where the partials do not cancel), and
amplified downstream no more than the sequential program's own roundings are (E_seq measures
that amplification, TTrace's choice of the reference's own low-precision error as the scale),
each such collective on the way to o may add up to k E_seq. D_o is the largest sum of group
sizes k over a chain of reducing collectives that o depends on, across ranks (`reduction_depth`).
C = 2 covers that the largest of many random rounding errors varies between two runs of equal
rounding count, and differences of rounding order inside a rank's ops. u * max |o| is the
least error any output held in the format has (its own rounding), for outputs the sequential
program happens to compute exactly. Nothing is fitted to a program: C and the k per collective
are the constants above, u is the format's.

What is deliberately not covered by the tolerance, and so warns: partial sums whose
magnitudes cancel (sum_r |x_r| far above |sum_r x_r|: the distributed grouping is
genuinely worse than one reduction), a rank rounding to a narrower format than the
sequential program at the same point, and a regrouping whose intermediate value is
ill-conditioned downstream (a one-pass variance). An output whose float64 values already
differ is a verdict matter and is skipped here; so is one the sequential program cannot
hold in the format (it overflows). A warning is evidence, on the drawn inputs, of lost
precision; no warning proves nothing about other inputs.

    from refine.oracle.precision import numeric_check
    for r in numeric_check(seq, dist, registry, "bf16"):
        print(r.output, r.status, r.abs_error, r.tolerance)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from refine.ir.graph import Dist, Graph, Node, case_symbols
from refine.ops.interp import (
    EXACT,
    Arith,
    EvalError,
    Tensor,
    canon,
    close,
    eval_budget,
    eval_elements,
    eval_graph,
    eval_ranks,
    eval_term,
    instantiate,
    max_err,
    random_inputs,
    run_order,
    valuation,
)
from refine.ops.registry import Registry, load_registry
from refine.verdict.expect import expected_terms


@dataclass(frozen=True)
class Format:
    name: str
    dtype: torch.dtype
    u: float  # unit roundoff: half the spacing of the format's numbers in [1, 2)


FORMATS = {
    "bf16": Format("bf16", torch.bfloat16, 2.0 ** -8),
    "fp16": Format("fp16", torch.float16, 2.0 ** -11),
    "fp8e4m3": Format("fp8e4m3", torch.float8_e4m3fn, 2.0 ** -4),
    "fp8e5m2": Format("fp8e5m2", torch.float8_e5m2, 2.0 ** -3),
}
ALIASES = {"fp8": "fp8e4m3", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8e4m3",
           "float8_e5m2": "fp8e5m2"}
CHOICES = (*FORMATS, "fp8")  # what `refine check --numeric` accepts

# graph dtypes narrower than float32: a tensor declared in one is rounded to it as well
NARROW = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float8_e4m3fn": torch.float8_e4m3fn,
          "float8_e5m2": torch.float8_e5m2}
C = 2.0  # see the module docstring
SEEDS = (0, 1, 2)
DIFFER = "the programs differ in float64"


def format_named(name: str) -> Format:
    key = ALIASES.get(name, name)
    if key not in FORMATS:
        raise ValueError(f"unknown format {name!r} (known: {', '.join(CHOICES)})")
    return FORMATS[key]


def rounded(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t's values as `dtype` holds them (round to nearest even), back in float64."""
    return t.to(dtype).to(torch.float64)


class LowPrecision(Arith):
    """The interpreter's arithmetic in a format: every floating tensor stored rounded to it
    (and first to a narrower format the graph declares), collectives reducing one member at a
    time with each partial sum rounded."""

    def __init__(self, fmt: Format) -> None:
        self.fmt = fmt

    def store(self, value: Tensor, dtype: str) -> Tensor:
        if not value.is_floating_point():
            return value
        narrow = NARROW.get(dtype)
        if narrow is not None and narrow != self.fmt.dtype:
            value = rounded(value, narrow)
        return rounded(value, self.fmt.dtype)

    def reduce(self, xs: list[Tensor], op: str, dtype: str) -> Tensor:
        if op not in ("sum", "avg"):  # max: exact in any format
            return super().reduce(xs, op, dtype)
        acc = xs[0]
        for x in xs[1:]:
            acc = self.store(acc + x, dtype)
        return acc / len(xs) if op == "avg" else acc  # the caller stores the mean


def dataflow(graphs: Mapping[int, Graph], registry: Registry) -> list[tuple[int, Node, list[tuple[int, str]], int]]:
    """Every rank node in an order `eval_ranks` can run them (`refine.ops.schedule`), with
    the rank tensors (rank, name) it reads, a communication op its partners' too, and the
    number of values it sums: the group size of a sum or mean all_reduce or reduce_scatter,
    else 0."""
    sched = run_order(graphs, registry)
    out: list[tuple[int, Node, list[tuple[int, str]], int]] = []
    pos = {r: 0 for r in graphs}

    def run_to(r: int, index: int) -> None:
        while pos[r] < index:
            n = graphs[r].nodes[pos[r]]
            if registry.ops[n.op].kind != "collective":
                out.append((r, n, [(r, a) for a in n.tensor_args()], 0))
            pos[r] += 1

    for event in sched.order:
        for c in event:
            run_to(c.rank, c.index)
        reads = [(c.rank, a) for c in event for a in c.node.tensor_args()]
        first = event[0].node
        summed = first.op in ("all_reduce", "reduce_scatter") and (first.attrs.get("reduce_op") or "sum") != "max"
        for c in event:
            out.append((c.rank, c.node, reads, len(c.members) if summed else 0))
    for r, g in graphs.items():
        run_to(r, len(g.nodes))
    return out


def reduction_depth(flow: list[tuple[int, Node, list[tuple[int, str]], int]]) -> dict[tuple[int, str], int]:
    """For every rank tensor (rank, name) a node makes: the largest sum of group sizes over a
    chain of reducing collectives it depends on (the D of the tolerance); inputs are 0."""
    depth: dict[tuple[int, str], int] = {}
    for r, n, reads, k in flow:
        depth[(r, n.name)] = max((depth.get(x, 0) for x in reads), default=0) + k
    return depth


def first_nonfinite(flow: list[tuple[int, Node, list[tuple[int, str]], int]], exact: Mapping[int, Mapping[str, Tensor]],
                    low: Mapping[int, Mapping[str, Tensor]]) -> dict[tuple[int, str], tuple[int, Node]]:
    """For every rank tensor: the first node it depends on (or itself) whose value in the
    format holds an infinity or a NaN where the exact one is finite (an overflow, a square
    root of a negative), when there is one."""
    origin: dict[tuple[int, str], tuple[int, Node]] = {}
    for r, n, reads, _ in flow:
        hit = next((origin[x] for x in reads if x in origin), None)
        if hit is None:
            a, b = low[r].get(n.name), exact[r].get(n.name)
            if a is not None and b is not None and a.is_floating_point() and \
                    bool((~torch.isfinite(a) & torch.isfinite(b)).any()):
                hit = (r, n)
        if hit is not None:
            origin[(r, n.name)] = hit
    return origin


@dataclass
class PrecisionResult:
    """One sequential output in one format, at the seed where it came nearest its tolerance."""

    output: str
    status: str  # "ok", "warn", or "skip" (not compared: see detail)
    abs_error: float = math.nan  # max |what the rank outputs make in the format - exact value|
    rel_error: float = math.nan  # abs_error / max |exact value| (normwise)
    seq_abs_error: float = math.nan  # the sequential program's own, same seed
    seq_rel_error: float = math.nan
    tolerance: float = math.nan  # on abs_error
    depth: int = 0  # D: reducing collectives' group sizes on the longest chain into the output
    seed: int | None = None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def numeric_check(seq: Graph, dist: Dist, registry: Registry | None = None, dtype: str = "bf16",
                  seeds: Sequence[int] = SEEDS, int_bound: int | None = None) -> list[PrecisionResult]:
    """Per sequential output: the distributed program's error in the format `dtype` (see
    FORMATS and ALIASES) against its tolerance, on the inputs of each seed (symbolic sizes at
    that seed's valuation, as `refine.oracle.differential` draws them). Raises EvalError for
    a case the interpreter cannot run (too large, deadlocked, an op without a reference)."""
    registry = registry or load_registry()
    fmt = format_named(dtype)
    runs: dict[str, list[PrecisionResult]] = {o.name: [] for o in seq.outputs}
    for seed in seeds:
        for r in _one_seed(seq, dist, registry, fmt, seed, int_bound):
            runs[r.output].append(r)
    return [_worst(name, rs) for name, rs in runs.items()]


def _one_seed(seq: Graph, dist: Dist, registry: Registry, fmt: Format, seed: int,
              int_bound: int | None) -> list[PrecisionResult]:
    symbols = case_symbols(seq, dist)
    if symbols:
        seq, dist = instantiate(seq, dist, valuation(symbols, seed))
    n = eval_elements(seq, dist)
    if 2 * n > eval_budget():  # an exact and a low-precision run are held at once
        raise EvalError(f"too large for the numerics: {n:.3g} tensor elements over both sides, held twice, above "
                        f"the budget of {eval_budget():.3g} (REFINE_EVAL_BUDGET)")
    seq_in, rank_in = random_inputs(seq, dist, seed, registry, int_bound)
    # every run starts from values the format holds: the exact runs then measure what the
    # programs compute, not how the drawn inputs round (the same on both sides)
    low = LowPrecision(fmt)
    seq_in = {k: low.store(canon(v), "float64") for k, v in seq_in.items()}
    rank_in = {r: {k: low.store(canon(v), "float64") for k, v in vals.items()} for r, vals in rank_in.items()}
    exact_seq = eval_graph(seq, registry, seq_in, EXACT)
    low_seq = eval_graph(seq, registry, seq_in, low)
    exact_ranks = eval_ranks(dist.ranks, registry, rank_in, EXACT)
    low_ranks = eval_ranks(dist.ranks, registry, rank_in, low)
    flow = dataflow(dist.ranks, registry)
    depth = reduction_depth(flow)
    bad = first_nonfinite(flow, exact_ranks, low_ranks)

    def outputs(vals: dict[int, dict[str, Tensor]]) -> dict[str, Tensor]:
        return {f"{o.name}@{r}": vals[r][o.ref] for r, g in dist.ranks.items() for o in g.outputs}

    exact_outs, low_outs = outputs(exact_ranks), outputs(low_ranks)
    leaf = {f"{o.name}@{r}": (r, o.ref) for r, g in dist.ranks.items() for o in g.outputs}
    results = []
    for o in seq.outputs:
        want = exact_seq[o.ref]
        terms = expected_terms(dist, o.name, set(exact_outs))
        if not want.is_floating_point():
            results.append(PrecisionResult(o.name, "skip", seed=seed, detail="not floating point"))
            continue
        if not terms:
            results.append(PrecisionResult(o.name, "skip", seed=seed, detail="no expectation to compare with"))
            continue
        try:
            exact = [eval_term(t, registry, exact_outs) for t in terms]
            low_vals = [eval_term(t, registry, low_outs) for t in terms]
        except Exception as e:  # noqa: BLE001 - an ill-shaped expectation is the verdict's business
            results.append(PrecisionResult(o.name, "skip", seed=seed, detail=f"cannot read the expectation: {e}"))
            continue
        if not all(close(x, want) for x in exact):
            err = max(max_err(x, want) for x in exact)
            results.append(PrecisionResult(o.name, "skip", seed=seed,
                                           detail=f"{DIFFER} (max error {err:.3g}): see the verdict"))
            continue
        scale = _magnitude(want)
        e_seq = error(low_seq[o.ref], want)
        e_dist = max(error(x, want) for x in low_vals)
        leaves = sorted({leaf[x] for t in terms for x in t.leaves() if x in leaf})
        d = max((depth.get(x, 0) for x in leaves), default=0)
        tol = tolerance(e_seq, scale, fmt.u, d)
        res = PrecisionResult(o.name, "ok", e_dist, _relative(e_dist, scale), e_seq, _relative(e_seq, scale), tol, d,
                              seed)
        if not math.isfinite(e_seq):
            res.status, res.detail = "skip", f"the sequential program overflows {fmt.name} here: no reference error"
        elif e_dist > tol:
            res.status = "warn"
            origin = next((bad[x] for x in leaves if x in bad), None)
            if origin is not None:
                r, n = origin
                res.detail = (f"not finite in {fmt.name} where the exact value is, from rank {r}'s {n.name} ({n.op})"
                              + (f" at {n.source}" if n.source else ""))
            else:
                res.detail = (f"{e_dist / max(e_seq, fmt.u * scale):.3g}x the sequential program's error, "
                              f"above the {C:g} + {d} allowed")
        results.append(res)
    return results


def tolerance(e_seq: float, scale: float, u: float, depth: int) -> float:
    """(C + D) * max(E_seq, u * max|o|): see the module docstring."""
    return (C + depth) * max(e_seq, u * scale)


def error(got: Tensor, want: Tensor) -> float:
    """Max |got - want| over the elements; equal infinities agree, a NaN or an infinity
    where the other is finite is an infinite error."""
    if tuple(got.shape) != tuple(want.shape):
        return math.inf
    if want.numel() == 0:
        return 0.0
    got, want = got.to(torch.float64), want.to(torch.float64)
    d = (got - want).abs()
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    d = torch.where(same, torch.zeros_like(d), torch.nan_to_num(d, nan=math.inf, posinf=math.inf))
    return float(d.max())


def _relative(e: float, scale: float) -> float:
    if scale > 0:
        return e / scale
    return 0.0 if e == 0 else math.inf


def _magnitude(t: Tensor) -> float:
    finite = t[torch.isfinite(t)]
    return float(finite.abs().max()) if finite.numel() else 0.0


def _worst(name: str, rs: list[PrecisionResult]) -> PrecisionResult:
    """Over the seeds: one where the programs differ in float64 (the verdict's business, not a
    precision matter), else the seed furthest above its tolerance or nearest below it, else a
    skip (no seed compared)."""
    differ = [r for r in rs if r.status == "skip" and r.detail.startswith(DIFFER)]
    if differ:
        return differ[0]
    compared = [r for r in rs if r.status != "skip"]
    if not compared:
        return rs[0] if rs else PrecisionResult(name, "skip", detail="no seed")

    def ratio(r: PrecisionResult) -> float:
        if r.abs_error == 0:
            return 0.0
        return r.abs_error / r.tolerance if r.tolerance > 0 else math.inf

    return max(compared, key=ratio)


# ---------------------------------------------------------------------------------------
# refine check --numeric


def numeric_check_files(seq_path: str | Path, dist_path: str | Path, rules: Iterable[str | Path] = (),
                        dtype: str = "bf16", seeds: Sequence[int] = SEEDS) -> dict[str, Any]:
    """The report's `numerics` field: the format, its unit roundoff, the seeds and each
    output's result, or `skipped` with the reason the programs could not be run."""
    from refine.frontends.graphfile import load_dist, load_seq

    fmt = format_named(dtype)
    out: dict[str, Any] = {"format": fmt.name, "unit_roundoff": fmt.u, "seeds": list(seeds)}
    try:
        registry = load_registry(rules)
        seq = load_seq(seq_path, registry)
        dist = load_dist(dist_path, registry, seq)
        results = numeric_check(seq, dist, registry, fmt.name, seeds)
    except EvalError as e:
        return out | {"skipped": str(e)}
    except Exception as e:  # noqa: BLE001 - a warning's machinery failing must not change the verdict or exit code
        return out | {"skipped": f"internal error ({type(e).__name__}): {e}"}
    out["outputs"] = [r.to_dict() for r in results]
    out["warnings"] = sum(r.status == "warn" for r in results)
    return out


def print_numerics(numerics: dict[str, Any], console: Console) -> None:
    """The `numerics` field as a table, after the verdict: one row per output, then why each
    output warns or was skipped."""
    title = f"numerics in {numerics['format']} (u = {numerics['unit_roundoff']:.3g}), seeds " \
            f"{', '.join(map(str, numerics['seeds']))}"
    if "skipped" in numerics:
        console.print(f"[yellow]{escape(title)}: not run[/]: {escape(numerics['skipped'])}")
        return
    table = Table(title=title)
    for col in ("output", "max abs error", "max rel error", "sequential's abs error", "tolerance", "D", "numerics"):
        table.add_column(col, overflow="fold")

    def num(v: float | None) -> str:
        return "inf" if v is None else f"{v:.3g}"

    notes = []
    for r in numerics["outputs"]:
        name = escape(r["output"])
        if r["status"] == "skip":
            table.add_row(name, "", "", "", "", "", "skipped")
            notes.append(f"skipped {name}: {escape(r['detail'])}")
            continue
        table.add_row(name, num(r["abs_error"]), num(r["rel_error"]), num(r["seq_abs_error"]), num(r["tolerance"]),
                      str(r["depth"]), "[green]ok[/]" if r["status"] == "ok" else "[bold yellow]WARN[/]")
        if r["status"] == "warn":
            notes.append(f"[bold yellow]WARN[/] {name} (seed {r['seed']}): {escape(r['detail'])}")
    console.print(table)
    for line in notes:
        console.print(line)
    n = numerics["warnings"]
    console.print(f"{n} numeric warning{'s' if n != 1 else ''}: an error against float64 beyond what the "
                  "sequential program loses in this format and the collectives' extra roundings allow "
                  "(evidence on these inputs, not part of the verdict)" if n else
                  "no numeric warning: every compared output is within its tolerance on these inputs "
                  "(evidence, not a proof)", highlight=False)
