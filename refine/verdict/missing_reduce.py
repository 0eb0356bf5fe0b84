"""Localizing a missing all-reduce by counterfactual evaluation.

A rank that forgets to sum a partial value over its group (each rank clips its gradients by
the norm of its own shards, say) computes a value no relation can name: the relations stop
at the first node over that value, which is a consequence, not the bug. This module edits
the rank programs instead: after the nodes one source line makes (on every rank), it inserts
a SUM all-reduce over the ranks of one mesh axis (or all ranks), and evaluates the rank
programs on random inputs consistent with the input relations. The line nearest the failing
outputs whose edit makes every output right is where the reduction is missing.

`held_apart` takes the pieces from the relations instead: a sequential value the relations
sum from nodes the ranks make on lines of their own (a tied embedding's gradient, from the
lookup's backward on the first pipeline stage and the head's on the last), each piece set to
their sum in a counterfactual run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import product

from refine.ir.graph import Dist, Graph, Node, case_symbols
from refine.ops.interp import (
    EvalError,
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
from refine.verdict.factor import _outputs_ok, _rank_outputs, distances

MAX_TRIES = 12  # lines edited at most (each one evaluation of the rank programs)


@dataclass
class MissingReduce:
    rank: int
    node: str  # the rank program's node (user-level) after which the sum is missing
    source: str
    group: list[int]  # over these ranks


def _groups(dist: Dist) -> list[list[list[int]]]:
    """For each mesh axis (and the whole world), the groups of ranks along it."""
    axes = list(dist.mesh.axes)
    sizes = [s for _, s in axes]
    out: list[list[list[int]]] = []
    for i in range(len(axes)):
        by_rest: dict[tuple[int, ...], list[int]] = {}
        for r in range(dist.mesh.size):
            c = dist.mesh.coords(r)
            by_rest.setdefault(c[:i] + c[i + 1:], []).append(r)
        out.append(sorted(by_rest.values()))
    world = [list(range(math.prod(sizes)))]
    if world not in out:
        out.append(world)
    return out


def _with_reduce(g: Graph, names: set[str], group: list[int]) -> Graph:
    """g with a SUM all-reduce over group after each node of `names`, its users reading it."""
    nodes: list[Node] = []
    renamed: dict[str, str] = {}
    for n in g.nodes:
        if renamed:
            n = replace(n, args=[renamed.get(a, a) if isinstance(a, str) else a for a in n.args])
        nodes.append(n)
        if n.name in names:
            red = f"{n.name}.missing_all_reduce"
            nodes.append(Node(red, "all_reduce", [n.name], {"reduce_op": "sum", "group": list(group)}, n.type,
                              n.source, n.origin))
            renamed[n.name] = red
    outputs = [replace(o, ref=renamed.get(o.ref, o.ref)) for o in g.outputs]
    return replace(g, nodes=nodes, outputs=outputs)


def missing_reduce(seq: Graph, dist: Dist, registry: Registry, failing: list[str], seed: int = 0) -> MissingReduce | None:
    """The rank program line after which a SUM all-reduce over some mesh axis makes every
    output right, nearest the failing outputs first; None if no single line's does."""
    try:
        symbols = case_symbols(seq, dist)
        if symbols:
            seq, dist = instantiate(seq, dist, valuation(symbols, seed))
        seq_in, rank_in = random_inputs(seq, dist, seed, registry)
        seq_vals = eval_graph(seq, registry, seq_in)
    except (EvalError, RuntimeError, ValueError, KeyError):
        return None
    dist_of = distances(dist, {r: [o.ref for o in g.outputs if o.name in failing] for r, g in dist.ranks.items()})
    # candidate lines: the values each line makes on the ranks (its nodes read by another
    # line or returned), computed ones (not collectives)
    lines: dict[str, list[tuple[int, Node]]] = {}
    for r, g in sorted(dist.ranks.items()):
        returned = {o.ref for o in g.outputs}
        idx = g.index()
        read_elsewhere = {a for u in g.nodes for a in u.tensor_args() if u.source != getattr(idx[a], "source", None)}
        for n in g.nodes:
            if n.source and (r, n.name) in dist_of and registry.ops[n.op].kind != "collective" and \
                    n.type.dtype.startswith(("float", "bfloat")) and (n.name in returned or n.name in read_elsewhere):
                lines.setdefault(n.source, []).append((r, n))
    ranked = sorted((min(dist_of[(r, n.name)] for r, n in ms), src) for src, ms in lines.items())
    tries = 0
    for (_, src), axis in product(ranked, _groups(dist)):
        if tries >= MAX_TRIES * len(_groups(dist)):
            break
        tries += 1
        members = lines[src]
        # the nodes of that line on each rank, after which every rank of a group sums
        edit = {r: {n.name for q, n in members if q == r} for r in dist.ranks}
        if any(not edit[r] for grp in axis for r in grp if r in dist.ranks):
            continue  # the line runs on some ranks of a group only: no collective there
        graphs = {}
        for grp in axis:
            for r in grp:
                graphs[r] = _with_reduce(dist.ranks[r], edit[r], grp)
        try:
            vals = eval_ranks(graphs, registry, rank_in)
        except (EvalError, RuntimeError, ValueError, KeyError):
            continue
        if _outputs_ok(seq_vals, seq, dist, _rank_outputs(graphs, vals), registry):
            r, n = min(members, key=lambda m: dist_of[(m[0], m[1].name)])
            grp = next(g for g in axis if r in g)
            return MissingReduce(r, n.name, src, grp)
    return None


@dataclass
class HeldApart:
    """A value the ranks hold in pieces, made on lines of their own, that no collective sums."""

    pieces: dict[int, str]  # rank -> the core node holding its piece
    sources: dict[int, str | None]  # rank -> that node's line


def held_apart(seq: Graph, dist: Dist, registry: Registry, failing: list[str], pieces: dict[int, str],
               seed: int = 0) -> HeldApart | None:
    """Whether the rank programs, with each of `pieces` (rank -> a core node of that rank, one
    tensor's pieces: a sequential relation sums them) holding the sum of them all, make every
    output right on two draws: the ranks make the pieces, on lines that need not be the same
    (a tied embedding's gradient: the lookup's backward on the first pipeline stage, the
    head's on the last) and never sum them. The sum is set as each piece's value (an
    all-reduce right after each, with no program order to match). None when not."""
    if len(pieces) < 2 or not set(pieces) <= set(dist.ranks):
        return None
    try:
        symbols = case_symbols(seq, dist)
        if symbols:
            seq, dist = instantiate(seq, dist, valuation(symbols, seed))
        if eval_elements(seq, dist) > eval_budget():
            return None
        cores = {r: lower(g, registry)[0] for r, g in sorted(dist.ranks.items())}
        for s in (seed, seed + 1):  # a second, independent draw the edit must repair too
            seq_in, rank_in = random_inputs(seq, dist, s, registry)
            seq_vals = eval_graph(seq, registry, seq_in)
            vals = eval_ranks(cores, registry, rank_in)
            if s == seed and _outputs_ok(seq_vals, seq, dist, _rank_outputs(cores, vals), registry):
                return None  # right as it is (an UNPROVEN program): nothing to repair
            got = [vals[r][x] for r, x in pieces.items()]
            if len({tuple(v.shape) for v in got}) != 1 or not all(v.is_floating_point() for v in got):
                return None
            total = sum(got[1:], got[0])
            fixed = eval_ranks(cores, registry, rank_in, override={(r, x): total for r, x in pieces.items()})
            if not _outputs_ok(seq_vals, seq, dist, _rank_outputs(cores, fixed), registry):
                return None
    except (EvalError, RuntimeError, ValueError, KeyError):
        return None
    sources = {}
    for r, x in pieces.items():
        n = cores[r].index().get(x)
        sources[r] = n.source if isinstance(n, Node) else None
    return HeldApart(dict(pieces), sources)
