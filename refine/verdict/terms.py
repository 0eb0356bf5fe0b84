"""Localizing a wrong term of a sum over ranks by counterfactual evaluation.

A value fused over every rank's pieces (a global gradient norm: each rank sums the squares
of its gradients, then the ranks all-reduce the sums) is held by no rank before the
reduction, so when one rank adds a term it should not (the tied embedding's squares counted
on the first and on the last pipeline stage, Megatron-LM #7227; a replicated bias counted on
two tensor-parallel ranks; one gradient listed twice), the relations stop at the first
sequential node over the fused value, which names no rank line. This module evaluates the
terms instead: the rank programs are lowered to core ops, where a norm's sum of squares is a
`Sum` of one term per gradient; for each SUM reduction over ranks (all_reduce,
reduce_scatter) feeding a failing output, the terms each rank sums into its piece (the
arguments of the first `Sum`s reached from the piece through ops of one computed input: a
norm's root, its square, a scale; a `Sum` of `Sum`s is one sum) are evaluated on random inputs
consistent with the input relations. Each term is then dropped from its `Sum` alone, the
terms whose value another summed term also has (a term counted twice) first, then by
distance from the failing outputs, and the rank programs are run again: a term whose
removal makes every output right, on this draw and a second one, is counted where it should
not be, and the line of the `Sum` that adds it is the culprit.

What it does not name (reported as before, never guessed): a term missing from every rank's
sum (nothing to drop), a term with a wrong value (a zeroed gradient), a wrong term that a
reduction of another kind takes in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from refine.ir.graph import Dist, Graph, Node, case_symbols
from refine.ops.interp import (
    EvalError,
    close,
    eval_budget,
    eval_elements,
    eval_graph,
    eval_ranks,
    instantiate,
    random_inputs,
    valuation,
)
from refine.ops.lower import lower
from refine.ops.registry import Registry
from refine.verdict.factor import REDUCTIONS, _outputs_ok, _rank_outputs, distances

MAX_TRIES = 16  # terms dropped at most (each one evaluation of the rank programs)


@dataclass
class WrongTerm:
    rank: int
    sum: str  # the rank's core `Sum` node that adds the term
    term: str  # the term's core node
    source: str  # the `Sum`'s line
    term_source: str | None  # the line making the term
    reduction: str  # the core node of the reduction over ranks the sum feeds
    reduction_source: str | None
    # another summed term of the same value whose removal repairs every output too (the value
    # is counted twice, and either copy is the extra one): its rank and core node
    twin: tuple[int, str] | None


@dataclass(frozen=True)
class _Term:
    rank: int
    sum: str
    position: int  # the argument of the Sum
    node: str
    reduction: str


def _summed(g: Graph, start: str, registry: Registry) -> list[tuple[str, int, str]]:
    """The terms summed into `start` on one rank: (Sum node, argument position, term) for the
    arguments of the first `Sum`s reached from `start` through compute ops with one input
    that is not a constant (a Sum argument that is a Sum itself is expanded)."""
    idx = g.index()
    out: list[tuple[str, int, str]] = []
    seen: set[str] = set()
    todo = [start]
    while todo:
        x = todo.pop()
        n = idx.get(x)
        if x in seen or not isinstance(n, Node) or registry.ops[n.op].kind == "collective":
            continue
        seen.add(x)
        if n.op == "Sum":
            for i, a in enumerate(n.args):
                if not isinstance(a, str):
                    continue
                m = idx.get(a)
                if isinstance(m, Node) and m.op == "Sum":
                    todo.append(a)
                else:
                    out.append((n.name, i, a))
        else:  # through an op of one computed input (a root, a power by a constant, a scale)
            computed = [a for a in n.tensor_args() if not (isinstance(m := idx.get(a), Node) and m.op == "full")]
            if len(computed) == 1:
                todo.append(computed[0])
    return out


def _without(g: Graph, name: str, position: int) -> Graph:
    """g with argument `position` of Sum node `name` left out."""
    nodes = [replace(n, args=[a for i, a in enumerate(n.args) if i != position]) if n.name == name else n
             for n in g.nodes]
    return replace(g, nodes=nodes)


def wrong_term(seq: Graph, dist: Dist, registry: Registry, failing: list[str], seed: int = 0) -> WrongTerm | None:
    """The term one rank sums into its piece of a SUM reduction over ranks whose removal
    makes every output right on two draws, those counted twice first; None when no single
    term's does (or none feeds a failing output)."""
    try:
        symbols = case_symbols(seq, dist)
        if symbols:
            seq, dist = instantiate(seq, dist, valuation(symbols, seed))
        if eval_elements(seq, dist) > eval_budget():  # too large to run (the counterexample search reduces it)
            return None
        cores = {r: lower(g, registry)[0] for r, g in sorted(dist.ranks.items())}
        seq_in, rank_in = random_inputs(seq, dist, seed, registry)
        seq_vals = eval_graph(seq, registry, seq_in)
        rank_vals = eval_ranks(cores, registry, rank_in)
    except (EvalError, RuntimeError, ValueError, KeyError):
        return None
    if _outputs_ok(seq_vals, seq, dist, _rank_outputs(cores, rank_vals), registry):
        return None  # right as it is (an UNPROVEN program): nothing to repair
    dist_of = distances(replace(dist, ranks=cores),
                        {r: [o.ref for o in g.outputs if o.name in failing] for r, g in cores.items()})
    terms: list[_Term] = []
    for r, g in cores.items():
        for n in g.nodes:
            if (n.op in REDUCTIONS and n.attrs.get("reduce_op") == "sum" and (r, n.name) in dist_of
                    and n.tensor_args()):
                terms += [_Term(r, s, i, t, n.name) for s, i, t in _summed(g, n.tensor_args()[0], registry)]
    if not terms:
        return None

    def twin(t: _Term) -> tuple[int, str] | None:
        """Another summed term of the same (nonzero) value: t may be counted twice."""
        v = rank_vals[t.rank][t.node]
        if not v.is_floating_point() or not bool(v.abs().gt(0).any()):
            return None
        for u in terms:
            if u == t:
                continue
            w = rank_vals[u.rank][u.node]
            if w.shape == v.shape and close(w, v):
                return u.rank, u.node
        return None

    twins = {t: twin(t) for t in terms}
    ranked = sorted(set(terms), key=lambda t: (twins[t] is None, dist_of.get((t.rank, t.sum), 1 << 30),
                                               t.rank, t.sum, t.position))
    again: list[tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]] = []

    def repairs(t: _Term) -> bool:
        """Whether the programs without term t make every output right, on this draw and a
        second, independent one."""
        graphs = {**cores, t.rank: _without(cores[t.rank], t.sum, t.position)}
        try:
            if not _outputs_ok(seq_vals, seq, dist, _rank_outputs(graphs, eval_ranks(graphs, registry, rank_in)),
                               registry):
                return False
            if not again:
                s_in, r_in = random_inputs(seq, dist, seed + 1, registry)
                again.append((eval_graph(seq, registry, s_in), r_in))
            return _outputs_ok(again[0][0], seq, dist,
                               _rank_outputs(graphs, eval_ranks(graphs, registry, again[0][1])), registry)
        except (EvalError, RuntimeError, ValueError, KeyError):
            return False

    for t in ranked[:MAX_TRIES]:
        if not repairs(t):
            continue
        idx = cores[t.rank].index()
        s, term, red = idx[t.sum], idx[t.node], idx[t.reduction]
        assert isinstance(s, Node) and isinstance(red, Node)
        other = None
        if twins[t] is not None:  # counted twice: either copy may be the extra one
            u = next(u for u in ranked if (u.rank, u.node) == twins[t] and u != t)
            if repairs(u):
                other = cores[u.rank].index()[u.sum]
                assert isinstance(other, Node)
        if not s.source or (other is not None and other.source != s.source):
            return None  # no line to name, or two copies summed on two lines: either may be the bug
        return WrongTerm(t.rank, t.sum, t.node, s.source, term.source if isinstance(term, Node) else None,
                         t.reduction, red.source, twins[t] if other is not None else None)
    return None
