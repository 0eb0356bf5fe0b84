"""Counterexamples: concrete inputs on which the distributed program computes something else.

When the proof stops, `search` draws inputs consistent with the input relations
(`refine.ops.interp.random_inputs`; symbolic sizes instantiated small, a new valuation per
try), runs the sequential graph and the rank programs (collectives simulated in an order the
ranks' schedule allows) in float64, and compares every sequential output with what its
expectation reads from the rank outputs (`refine.verdict.expect.expectation_options`: an
output with no expectation may match any standard placement). The first draw on which one
output matches none of its options is the counterexample: the verdict is DOES NOT REFINE.
When every draw agrees the verdict is UNPROVEN: neither a proof nor a counterexample.

A counterexample is evidence, not a proof obligation: a float64 difference far above
rounding (`significant`) on concrete inputs that satisfy the relations. `write` stores its
inputs (raw little-endian bytes and a JSON manifest, no pickle) where `load` and `replay`
read them back.

    search = counterexample.search(seq, dist, registry)
    if search.found:
        print(search.found.outputs[0])      # output, max abs and rel error
        counterexample.write(search.found, "cex/")
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from refine.ir.graph import Dist, Graph, case_symbols
from refine.ir.term import Term
from refine.ops.interp import (
    EvalError,
    Tensor,
    eval_graph,
    eval_ranks,
    eval_term,
    instantiate,
    random_inputs,
    valuation,
)
from refine.ops.registry import Registry
from refine.verdict.expect import expectation_options

# Random draws before the search gives up. Two programs that differ over the reals differ
# on almost every real input (their difference, a composition of analytic ops, vanishes on
# a set of measure zero unless it is zero everywhere), so one draw of the float inputs
# finds a bug; the further draws are for what one draw can miss: integer inputs (ids,
# labels, masks) drawn from a few small values, and symbolic sizes at other valuations.
TRIES = 4

# A difference is significant when it exceeds this fraction of the output's magnitude
# (and of 1, for outputs near zero). float64 rounds at 2^-53 ~ 1.1e-16: sums reordered
# across ranks differ by about n * 2^-53 relative to their terms' magnitude (terms are drawn
# of order 1), so 1e-6 leaves room for reductions over 10^9 terms, while a bug (a missing
# reduction, a wrong factor, a wrong slice) moves values by a sizable fraction of them.
SIGNIFICANT = 1e-6


@dataclass
class OutputError:
    """How far what the rank outputs make is from one sequential output."""

    output: str
    expectation: str  # the option compared (the closest, when none holds)
    abs_err: float  # max over elements
    rel_err: float  # abs_err over the output's largest magnitude
    ok: bool


@dataclass
class Counterexample:
    seed: int  # the draw: random_inputs(seq, dist, seed) at `sizes`
    sizes: dict[str, int]  # the symbols' values (symbolic cases)
    outputs: list[OutputError]  # the failing outputs first
    seq_inputs: dict[str, Tensor] = field(repr=False, default_factory=dict)
    rank_inputs: dict[int, dict[str, Tensor]] = field(repr=False, default_factory=dict)

    def failing(self) -> list[OutputError]:
        return [o for o in self.outputs if not o.ok]

    def to_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "sizes": self.sizes,
                "outputs": [o.__dict__ for o in self.outputs]}


@dataclass
class Search:
    """What the search did: the counterexample, or how many draws agreed (and why it could
    not run, when it could not)."""

    tries: int
    agreed: int
    found: Counterexample | None = None
    skipped: str | None = None  # why no draw could be evaluated
    unchecked: list[str] = field(default_factory=list)  # outputs with nothing to compare with

    def to_dict(self) -> dict[str, Any]:
        return {"tries": self.tries, "agreed": self.agreed, "skipped": self.skipped, "unchecked": self.unchecked,
                "counterexample": self.found.to_dict() if self.found else None}


def significant(got: Tensor, want: Tensor) -> tuple[bool, float, float]:
    """Whether `got` differs from `want` beyond float64 rounding, and the max absolute and
    relative error."""
    if tuple(got.shape) != tuple(want.shape):
        return True, math.inf, math.inf
    if want.numel() == 0:
        return False, 0.0, 0.0
    if got.dtype == torch.bool or want.dtype == torch.bool:
        diff = int((got.bool() != want.bool()).sum())
        return diff > 0, float(diff > 0), float(diff > 0)
    a, b = got.to(torch.float64), want.to(torch.float64)
    both_nan = torch.isnan(a) & torch.isnan(b)
    same_inf = torch.isinf(a) & (a == b)
    d = torch.where(both_nan | same_inf, torch.zeros_like(a), (a - b).abs())
    d = torch.nan_to_num(d, nan=math.inf)
    err = float(d.max())
    finite = b[torch.isfinite(b)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    rel = err / scale if scale > 0 else err
    return err > SIGNIFICANT * max(scale, 1.0), err, rel


def compare(seq: Graph, dist: Dist, registry: Registry, seq_vals: Mapping[str, Tensor],
            rank_vals: Mapping[int, Mapping[str, Tensor]]) -> tuple[list[OutputError], list[str]]:
    """Each sequential output against its expectation's options on evaluated values; and the
    outputs with nothing to compare with."""
    outs: dict[str, Tensor] = {}
    for r, g in dist.ranks.items():
        for o in g.outputs:
            outs[f"{o.name}@{r}"] = rank_vals[r][o.ref]
    errors, unchecked = [], []
    for o in seq.outputs:
        want = seq_vals[o.ref]
        options = expectation_options(dist, o.name, want.dim(), set(outs))
        if options is None:
            unchecked.append(o.name)
            continue
        best: OutputError | None = None
        for _, terms in options:
            worst = OutputError(o.name, " and ".join(map(str, terms)), 0.0, 0.0, True)
            for t in terms:
                bad, err, rel = _against(t, registry, outs, want)
                if bad or err > worst.abs_err:
                    worst = OutputError(o.name, worst.expectation, max(err, worst.abs_err), max(rel, worst.rel_err),
                                        worst.ok and not bad)
            if best is None or (worst.ok, -worst.abs_err) > (best.ok, -best.abs_err):
                best = worst
            if best.ok:
                break
        assert best is not None
        errors.append(best)
    errors.sort(key=lambda e: e.ok)
    return errors, unchecked


def _against(t: Term, registry: Registry, outs: Mapping[str, Tensor], want: Tensor) -> tuple[bool, float, float]:
    try:
        got = eval_term(t, registry, outs)
    except (EvalError, RuntimeError, KeyError, ValueError):  # an ill-shaped placement makes no such tensor
        return True, math.inf, math.inf
    return significant(got, want)


def search(seq: Graph, dist: Dist, registry: Registry, tries: int = TRIES) -> Search:
    """Draw up to `tries` inputs consistent with the relations; the first on which an output
    differs is the counterexample."""
    symbols = case_symbols(seq, dist)
    agreed, unchecked = 0, []
    for seed in range(tries):
        s, d, values = seq, dist, {}
        if symbols:
            values = valuation(symbols, seed)
            s, d = instantiate(seq, dist, values)
        try:
            seq_in, rank_in = random_inputs(s, d, seed, registry)
            seq_vals = eval_graph(s, registry, seq_in)
            rank_vals = eval_ranks(d.ranks, registry, rank_in)
        except EvalError as e:
            return Search(tries, agreed, skipped=str(e))
        errors, unchecked = compare(s, d, registry, seq_vals, rank_vals)
        if errors and not errors[0].ok:
            return Search(seed + 1, agreed, Counterexample(seed, values, errors, seq_in, rank_in), unchecked=unchecked)
        agreed += 1
    return Search(tries, agreed, unchecked=unchecked)


# ---------------------------------------------------------------------------------------
# On disk: counterexample.json (the draw, the errors, a manifest of tensors) and one raw
# file per tensor (little-endian, C order), named by its position: tensor names are the
# user's and may be anything.

_DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
           "uint8": torch.uint8, "bool": torch.bool}


def write(cex: Counterexample, directory: str | Path) -> Path:
    """Write the counterexample's inputs and errors under `directory`; returns the manifest."""
    assert sys.byteorder == "little", "counterexample files are little-endian"
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    tensors: list[dict[str, Any]] = []

    def put(side: str, rank: int | None, name: str, x: Tensor) -> None:
        file = f"t{len(tensors)}.bin"
        (root / file).write_bytes(x.detach().contiguous().flatten().view(torch.uint8).numpy().tobytes())
        tensors.append({"side": side, "rank": rank, "name": name, "dtype": str(x.dtype).removeprefix("torch."),
                        "shape": list(x.shape), "file": file})

    for name, x in cex.seq_inputs.items():
        put("seq", None, name, x)
    for r, vals in cex.rank_inputs.items():
        for name, x in vals.items():
            put("rank", r, name, x)
    manifest = root / "counterexample.json"
    manifest.write_text(json.dumps({**cex.to_dict(), "tensors": tensors}, indent=2))
    return manifest


def load(directory: str | Path) -> Counterexample:
    """A counterexample `write` stored: its draw and inputs (errors as recorded)."""
    root = Path(directory)
    doc = json.loads((root / "counterexample.json").read_text())
    cex = Counterexample(int(doc["seed"]), {k: int(v) for k, v in doc["sizes"].items()},
                         [OutputError(**o) for o in doc["outputs"]])
    for t in doc["tensors"]:
        dtype = _DTYPES[t["dtype"]]
        data = (root / Path(t["file"]).name).read_bytes()  # a bare file name: never outside the directory
        x = torch.frombuffer(bytearray(data), dtype=dtype).reshape(t["shape"]) if data else \
            torch.empty(t["shape"], dtype=dtype)
        if t["side"] == "seq":
            cex.seq_inputs[t["name"]] = x
        else:
            cex.rank_inputs.setdefault(int(t["rank"]), {})[t["name"]] = x
    return cex


def replay(seq: Graph, dist: Dist, registry: Registry, cex: Counterexample) -> list[OutputError]:
    """Run both sides again on a counterexample's inputs: the output errors it shows."""
    if cex.sizes:
        seq, dist = instantiate(seq, dist, cex.sizes)
    seq_vals = eval_graph(seq, registry, cex.seq_inputs)
    rank_vals = eval_ranks(dist.ranks, registry, cex.rank_inputs)
    return compare(seq, dist, registry, seq_vals, rank_vals)[0]
