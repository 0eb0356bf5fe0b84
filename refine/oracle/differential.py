"""Numerical oracles: evidence about a case that does not come from the prover.

- `differential(seq, dist)`: run both sides on random inputs consistent with the relations
  and compare each sequential output with what its expectation says the rank outputs make
  (every replica): a TTrace-style differential test;
- `audit(seq, dist)`: infer every sequential core tensor's relation, then check each one
  numerically against the sequential value (`audit_relations`).

Symbolic sizes are evaluated at a random valuation of their symbols.

    from refine.oracle.differential import differential
    for c in differential(seq, dist):       # seq, dist from refine.frontends.graphfile
        print(c.output, c.ok, c.detail)     # ok None: no expectation to compare with

Both sides run in float64 with simulated collectives (refine.ops.interp). An output without an
expectation is compared with each rank's copy of its name when every rank makes one (else `ok`
is None). Use it to tell a real bug from an idiom the rules do not cover yet: a DOES NOT REFINE
whose outputs are numerically right is incompleteness. Random inputs never pick a special value
such as an `ignore_index`; to exercise one, draw inputs yourself
(`refine.ops.interp.random_inputs`), set it, and run `eval_graph` / `eval_ranks`. A case above
REFINE_EVAL_BUDGET is refused (EvalError) rather than run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from refine.check import case_features, engine_for, is_symbolic
from refine.ir.graph import Dist, Graph, case_symbols, tensor_name
from refine.ir.term import Term
from refine.ops.interp import (
    EvalError,
    Tensor,
    close,
    eval_graph,
    eval_ranks,
    eval_term,
    instantiate,
    instantiate_graph,
    instantiate_term,
    max_err,
    random_inputs,
    valuation,
)
from refine.ops.lower import lower
from refine.ops.registry import Registry, load_registry
from refine.prove.walk import infer
from refine.relate.program import build_program, seq_input_relations
from refine.verdict.expect import expectation_options


@dataclass
class OutputCheck:
    output: str
    ok: bool | None  # None: no expectation to compare with
    error: float
    detail: str = ""


def differential(seq: Graph, dist: Dist, registry: Registry | None = None, seed: int = 0,
                 int_bound: int | None = None) -> list[OutputCheck]:
    """Run both sides on random consistent inputs; compare each sequential output with the
    rank outputs its expectation names (every replica)."""
    registry = registry or load_registry()
    symbols = case_symbols(seq, dist)
    if symbols:
        seq, dist = instantiate(seq, dist, valuation(symbols, seed))
    seq_in, rank_in = random_inputs(seq, dist, seed, registry, int_bound)
    seq_vals = eval_graph(seq, registry, seq_in)
    rank_vals = eval_ranks(dist.ranks, registry, rank_in)
    outs: dict[str, Tensor] = {}
    for r, g in dist.ranks.items():
        for o in g.outputs:
            outs[f"{o.name}@{r}"] = rank_vals[r][o.ref]
    results = []
    for o in seq.outputs:
        want = seq_vals[o.ref]
        # its expectation's options (with none stated: the standard placements of the
        # ranks' copies); the output is right when one option's terms all equal it
        options = expectation_options(dist, o.name, want.dim(), set(outs))
        if not options:
            results.append(OutputCheck(o.name, None, math.nan, "no expectation"))
            continue
        scored = []  # (holds, max error) of each option
        for _, terms in options:
            holds, errs = True, []
            for t in terms:
                try:
                    got = eval_term(t, registry, outs)
                except Exception:  # noqa: BLE001 - an ill-shaped placement is a mismatch
                    holds = False
                    errs.append(math.inf)
                    continue
                errs.append(max_err(got, want))
                holds = holds and close(got, want)
            scored.append((holds, max(errs, default=0.0)))
        ok = any(h for h, _ in scored)
        best = min(e for h, e in scored if h == ok)
        results.append(OutputCheck(o.name, ok, best, "" if ok else f"max error {best:.3g}"))
    return results


@dataclass
class Mismatch:
    tensor: str  # sequential core tensor
    relation: str
    error: float
    detail: str = ""


def audit(seq: Graph, dist: Dist, registry: Registry | None = None, seed: int = 0,
          int_bound: int | None = None) -> list[Mismatch]:
    """Infer every sequential core tensor's relation, then check each one numerically
    against the sequential value on random consistent inputs (with symbolic sizes: at a
    random valuation of the symbols, the relations inferred once for all of them)."""
    registry = registry or load_registry()
    seq_core, _ = lower(seq, registry)
    prog, cores = build_program(dist, registry, "dist")
    inputs = seq_input_relations(dist, seq, prog, registry, "dist")
    symbolic = is_symbolic(seq, dist)
    inf = infer(seq_core, inputs, prog, engine_for(registry, symbolic, case_features(dist)), registry)
    relations = inf.relations
    if symbolic:
        # evaluate the very core graphs the relations name, at the valuation (lowering the
        # instantiated graphs may differ: a mean over a symbolic size lowers to `rmean`)
        values = valuation(case_symbols(seq, dist), seed)
        seq_core = instantiate_graph(seq_core, values)
        cores = {r: instantiate_graph(c, values) for r, c in cores.items()}
        seq, dist = instantiate(seq, dist, values)
        relations = {k: instantiate_term(t, values) for k, t in relations.items()}
    return audit_relations(seq, dist, relations, prog, cores, registry, seed, int_bound, seq_core)


def audit_relations(seq: Graph, dist: Dist, relations: Mapping[str, Term], prog: Any, cores: Mapping[int, Graph],
                    registry: Registry, seed: int = 0, int_bound: int | None = None,
                    seq_core: Graph | None = None) -> list[Mismatch]:
    if seq_core is None:
        seq_core, _ = lower(seq, registry)
    seq_in, rank_in = random_inputs(seq, dist, seed, registry, int_bound)
    seq_vals = eval_graph(seq_core, registry, seq_in)
    rank_vals = eval_ranks(cores, registry, rank_in)
    flat = {tensor_name(r, k): v for r, vals in rank_vals.items() for k, v in vals.items()}

    def leaf_value(name: str) -> Tensor:
        if name in flat:
            return flat[name]
        if name in prog.outputs:  # an `Out` leaf
            return flat[prog.outputs[name]]
        raise EvalError(f"no rank tensor {name!r}")

    out = []
    cache: dict[Term, Tensor] = {}
    for name, rel in relations.items():
        want = seq_vals[name]
        try:
            got = eval_term(rel, registry, leaf_value, cache, opaque=seq_vals)
        except Exception as e:  # noqa: BLE001 - an unevaluable relation is a mismatch
            out.append(Mismatch(name, str(rel), math.inf, f"cannot evaluate: {e}"))
            continue
        if not close(got, want):
            out.append(Mismatch(name, str(rel), max_err(got, want),
                                f"shape {list(got.shape)} vs {list(want.shape)}"))
    return out
