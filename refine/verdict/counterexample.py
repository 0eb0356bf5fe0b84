"""Counterexamples: concrete inputs on which the distributed program computes something else.

When the proof stops, `search` draws inputs consistent with the input relations
(`refine.ops.interp.random_inputs`; symbolic sizes instantiated small, a new valuation per
try), runs the sequential graph and the rank programs (collectives simulated in an order the
ranks' schedule allows) in float64, and compares every sequential output with what its
expectation reads from the rank outputs (`refine.verdict.expect.expectation_options`: an
output with no expectation may match any standard placement). The first draw on which one
output matches none of its options is the counterexample: the verdict is DOES NOT REFINE.
A case too large to evaluate is searched at reduced sizes (`refine.verdict.reduce`: every
size mapped small consistently, by role); the counterexample records the map (`reduced`).
When every draw agrees the verdict is UNPROVEN: neither a proof nor a counterexample.
Integer inputs: the first draw (`PLAIN`) draws them below a bound; the later ones mix in the
values the programs compare them with (`refine.ops.special`: an ignore_index, a padding id,
a shard's range ends), before the values are split over the ranks. A draw the programs
cannot evaluate on with those values is drawn again with fewer, then none: never a verdict.

A counterexample is evidence, not a proof obligation: a float64 difference far above
rounding (`significant`) on concrete inputs that satisfy the relations. `write` stores its
inputs where `load` and `replay` read them back (`refine check --counterexample DIR`):
`DIR/counterexample.json`, a manifest with the seed, the sizes (and any reduction map) and
the errors, and one raw little-endian file per tensor, C order; no pickle.
`replay(seq, dist, registry, load(DIR))` runs both sides on them again.

    search = counterexample.search(seq, dist, registry)
    if search.found:
        print(search.found.outputs[0])      # output, max abs and rel error
        counterexample.write(search.found, "cex/")
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from refine.ir.graph import Dist, Graph, Node, Placement, case_symbols
from refine.ir.layout import placed_terms
from refine.ir.term import Term
from refine.ops.interp import (
    EvalError,
    Tensor,
    canon,
    eval_budget,
    eval_elements,
    eval_graph,
    eval_ranks,
    eval_term,
    instantiate,
    int_bounds,
    random_inputs,
    split_placed,
    valuation,
)
from refine.ops.registry import Registry
from refine.ops.special import Mix, Specials, special_values
from refine.verdict.expect import expectation_options
from refine.verdict.reduce import Sizes, try_reduce
from refine.verdict.reduce import apply as reduced_programs

# Random draws before the search gives up. Two programs that differ over the reals differ
# on almost every real input (their difference, a composition of analytic ops, vanishes on
# a set of measure zero unless it is zero everywhere), so one draw of the float inputs
# finds a bug; the further draws are for what one draw can miss: integer inputs (ids,
# labels, masks) drawn from a few small values and then from the values the programs single
# out, and symbolic sizes at other valuations.
TRIES = 4

# Draws with plain random integers before the search mixes in the special values.
PLAIN = 1

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
    # a case too large to evaluate is searched at reduced sizes (refine.verdict.reduce): each
    # size it changed, original -> reduced (a list where the size's roles reduce apart: one
    # per role, `refine.verdict.reduce.Sizes`); the inputs are the reduced programs'
    reduced: Sizes = field(default_factory=dict)
    # integer inputs the draw mixed special values into (refine.ops.special): input -> values
    mixed: dict[str, list[int]] = field(default_factory=dict)

    def failing(self) -> list[OutputError]:
        return [o for o in self.outputs if not o.ok]

    def to_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "sizes": self.sizes, "reduced": {str(k): v for k, v in self.reduced.items()},
                "mixed": self.mixed, "outputs": [o.__dict__ for o in self.outputs]}


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


def search(seq: Graph, dist: Dist, registry: Registry, tries: int = TRIES, plain: int = PLAIN) -> Search:
    """Draw up to `tries` inputs consistent with the relations; the first on which an output
    differs is the counterexample. Draws after the first `plain` ones mix into the integer
    inputs the values the programs single out (`refine.ops.special`); a draw the programs
    cannot evaluate with them is drawn again with fewer (the sure ones), then with none."""
    symbols = case_symbols(seq, dist)
    agreed, unchecked = 0, []
    reduced: Sizes = {}
    if not symbols and eval_elements(seq, dist) > eval_budget():  # too large: the same programs at small sizes
        got = try_reduce(seq, dist, registry, eval_budget())
        if isinstance(got, str):
            return Search(tries, agreed, skipped=f"too large to evaluate ({eval_elements(seq, dist):.3g} tensor "
                                                 f"elements, above the budget of {eval_budget():.3g}) and no "
                                                 f"reduction of its sizes: {got}")
        seq, dist, reduced = got
    table: dict[str, Specials] | None = None
    for seed in range(tries):
        s, d, values = seq, dist, {}
        if symbols:
            values = valuation(symbols, seed)
            s, d = instantiate(seq, dist, values)
        mixes: list[dict[str, Mix]] = [{}]
        if seed >= plain:
            if table is None or symbols:  # literals and sizes change with the valuation
                table = special_values(s, d, registry, int_bounds(s, registry))
            mixes = _mixes(table)
        for mix in mixes:
            try:
                seq_in, rank_in = random_inputs(s, d, seed, registry, specials=mix)
                seq_vals = eval_graph(s, registry, seq_in)
                rank_vals = eval_ranks(d.ranks, registry, rank_in)
            except EvalError as e:
                if mix:  # a special value the programs cannot evaluate on: no evidence, draw with fewer
                    continue
                return Search(tries, agreed, skipped=str(e))
            break
        errors, unchecked = compare(s, d, registry, seq_vals, rank_vals)
        if errors and not errors[0].ok:
            mixed = {k: sorted({*m.first, *m.rest}) for k, m in mix.items() if m}
            return Search(seed + 1, agreed, Counterexample(seed, values, errors, seq_in, rank_in, reduced, mixed),
                          unchecked=unchecked)
        agreed += 1
    return Search(tries, agreed, unchecked=unchecked)


def _mixes(table: Mapping[str, Specials]) -> list[dict[str, Mix]]:
    """The special values to draw with, most first: all of them, the sure ones, none."""
    out: list[dict[str, Mix]] = []
    for unsure in (True, False):
        mix = {k: m for k, sp in table.items() if (m := sp.mix(unsure))}
        if mix and mix not in out:
            out.append(mix)
    return [*out, {}]


# ---------------------------------------------------------------------------------------
# Where the ranks go wrong, on the counterexample (TTrace-style, with no annotation): walk the
# rank programs in program order; a rank node (the same name on the ranks that have it) is
# explained when its values are a standard placement of some sequential tensor's value. The
# first unexplained node that, set to such a placement of a sequential tensor, makes every
# output right is where the ranks diverge: had it held that, the program would be right. A
# repair sets the node's recomputations (the same op on the same arguments) too, and, when its
# nearest value alone does not do, the other nodes its line makes with its op (a line run for
# keys and for values). A node explained as a partial sum that, held whole, makes every
# output right is where a collective is missing (also reached through an unexplained node's
# input, which the ranks may make on lines of their own); the search then walks back through
# the nodes that carry the value in pieces to the first that made it: where it belongs.

# Counterfactual runs the divergence search makes at most. Each re-runs every rank program;
# past this the search stops and the report says the divergence was not found (the verdict
# and the prover's culprit stand).
REPAIRS = 256
# Counterfactual runs per rank node, its candidate values nearest first (`_distance`): a
# value the ranks compute right but that is no placement of a sequential tensor (one block
# of a ring's keys, a score block) cannot be repaired by any candidate, and trying each of
# its dozens would spend REPAIRS before the search reaches the node that is wrong; the
# wrong node's own value, a near miss of the value it should hold, ranks among the first.
PER_NODE = 8


@dataclass
class Divergence:
    """The first rank node whose value the counterexample shows wrong."""

    rank_node: str  # its name, on `ranks`
    ranks: list[int]
    op: str
    source: str | None
    seq_node: str  # the sequential tensor it should hold ...
    placement: str  # ... placed this way
    seq_source: str | None
    # the rank nodes it is computed from that hold no sequential value (masks, local ids,
    # layout changes), back to explained tensors: where a wrong constant or op may sit
    chain: list[tuple[str, str | None]]
    repairs: int  # counterfactual runs made
    # set when the node holds `seq_node` in another placement than the program needs (a
    # partial sum never reduced): that placement; `rank_node` is then rank ranks[0]'s
    # node, and `names` each rank's (the ranks may compute the value on different lines)
    held: str | None = None
    names: dict[int, str] = field(default_factory=dict)
    also: list[str] = field(default_factory=list)  # nodes of the same line and op repaired with it


def diverge(seq: Graph, dist: Dist, registry: Registry, cex: Counterexample, max_repairs: int = REPAIRS
            ) -> Divergence | None:
    """The first rank node (program order) whose value on the counterexample is no placement
    of a sequential tensor and whose replacement by one makes every output right (or an
    input of it whose value, a placement of a sequential tensor, in another placement does:
    see `_Repairs.placement`); None when there is none within `max_repairs` counterfactual
    runs."""
    seq, dist = _at_sizes(seq, dist, registry, cex)
    rp = _Repairs(seq, dist, registry, cex, max_repairs)
    seq_nodes = {n.name: n for n in seq.nodes}
    everyone = sorted(dist.ranks)
    holders: dict[str, list[int]] = {}
    first: dict[str, tuple[int, int]] = {}
    nodes: dict[str, Any] = {}
    for r in everyone:
        for i, n in enumerate(dist.ranks[r].nodes):
            holders.setdefault(n.name, []).append(r)
            first[n.name] = min(first.get(n.name, (i, r)), (i, r))
            nodes.setdefault(n.name, n)
    needed = _feeds_outputs(dist)
    explained: set[str] = {i.name for g in dist.ranks.values() for i in g.inputs}
    done: set[str] = set()  # a recomputation of a value already tried (its repair was theirs)
    for name in sorted(first, key=first.__getitem__):
        if name not in needed or name in done:
            continue
        ranks = holders[name]
        done |= {d for r in ranks for d in rp.dups.get((r, name), ())}
        vals = {r: rp.rank_vals[r][name] for r in ranks}
        options = [(sn, sv, pl) for sn, sv in rp.seq_tensors if _same_class(sv, vals[ranks[0]])
                   for pl in _placements(dist, sv, ranks) if _fits(sv, pl, dist, vals)]
        # the first placement that holds (a search, short-circuited: a long program has as
        # many candidates per node as it has sequential tensors of its shape)
        held = next((pl for _, sv, pl in options if _holds(vals, sv, pl, dist, registry)), None)
        if held is not None:
            explained.add(name)
            whole = not _partial(held) or any(not _partial(pl) and _holds(vals, sv, pl, dist, registry)
                                              for _, sv, pl in options)
            if len(ranks) == len(everyone) and not whole:
                # right values in pieces where the program needs them whole: a collective missing
                step = rp.reheld({r: name for r in ranks})
                if step is None:
                    return None
                if step:
                    return rp.walk_back(step)
            continue
        if len(ranks) == len(everyone):  # an input right in the wrong placement: a collective missing
            step = rp.placement({r: name for r in ranks})
            if step is None:
                return None
            if step:
                return rp.walk_back(step)
        nearest = sorted(range(len(options)), key=lambda i: (_distance(vals, options[i][1], options[i][2], dist,
                                                                       registry), i))
        # the other nodes its line makes with the same op on the same ranks (the line runs
        # twice, for keys and for values, say): a bug on the line is in each of them
        line = [m for m in sorted(first, key=first.__getitem__) if m != name and m in needed and m not in done
                and nodes[m].source and nodes[m].source == nodes[name].source and nodes[m].op == nodes[name].op
                and holders[m] == ranks]
        for first_try, (sn, sv, pl) in zip([True] + [False] * PER_NODE, (options[i] for i in nearest[:PER_NODE]),
                                          strict=False):
            pieces = split_placed(sv, pl, dist.mesh, rp.gen) if pl else {r: sv for r in ranks}
            override = {(r, name): canon(pieces[r], nodes[name].type.dtype) for r in ranks}
            ok = rp.fixes(override)
            also: list[str] = []
            if ok is False and line and sn in seq_nodes and first_try:  # with the nearest value only
                also = rp.siblings(line, ranks, seq_nodes[sn], pl, override)
                ok = rp.fixes(override) if also else False
            if ok is None:
                return None
            if ok:
                src = seq_nodes[sn].source if sn in seq_nodes else None
                return Divergence(name, ranks, nodes[name].op, nodes[name].source, sn, _where(pl), src,
                                  _chain(dist.ranks[ranks[0]], name, explained), rp.repairs, also=also)
    return None


def _where(pl: tuple[Placement, ...]) -> str:
    return "on every rank" if not pl else f"placed [{', '.join(map(str, pl))}]"


class _Repairs:
    """The counterfactual runs of one divergence search, within its budget."""

    def __init__(self, seq: Graph, dist: Dist, registry: Registry, cex: Counterexample, max_repairs: int) -> None:
        self.seq, self.dist, self.registry, self.cex, self.max_repairs = seq, dist, registry, cex, max_repairs
        self.seq_vals = eval_graph(seq, registry, cex.seq_inputs)
        self.rank_vals = eval_ranks(dist.ranks, registry, cex.rank_inputs)
        self.seq_tensors = [(x.name, self.seq_vals[x.name]) for x in (*seq.inputs, *seq.nodes)]
        self.gen = torch.Generator().manual_seed(cex.seed)
        self.index = {r: g.index() for r, g in dist.ranks.items()}
        self.repairs = 0
        # the nodes of a rank computing the same op on the same arguments (a loss's difference
        # made once forward and again for its backward): a repair sets them all
        self.dups: dict[tuple[int, str], list[str]] = {}
        for r, g in dist.ranks.items():
            same: dict[str, list[str]] = {}
            for n in g.nodes:
                if self.registry.ops[n.op].kind != "collective":
                    same.setdefault(f"{n.op}{n.args!r}{sorted(n.attrs.items())!r}", []).append(n.name)
            for names in same.values():
                for x in names:
                    self.dups[(r, x)] = [y for y in names if y != x]

    def fixes(self, override: dict[tuple[int, str], Tensor]) -> bool | None:
        """Whether the rank programs, with these values for these nodes (and their
        recomputations), make every output right; None when the budget is spent."""
        if self.repairs >= self.max_repairs:
            return None
        self.repairs += 1
        full = dict(override)
        for (r, x), v in override.items():
            full.update({(r, y): v for y in self.dups.get((r, x), ())})
        try:
            fixed = eval_ranks(self.dist.ranks, self.registry, self.cex.rank_inputs, override=full)
        except EvalError:
            return False
        errors, _ = compare(self.seq, self.dist, self.registry, self.seq_vals, fixed)
        return bool(errors) and all(e.ok for e in errors)

    def siblings(self, line: list[str], ranks: list[int], made: Node, pl: tuple[Placement, ...],
                 override: dict[tuple[int, str], Tensor]) -> list[str]:
        """Add to `override` a value for each of `line`, rank nodes of the same line and op as
        one whose candidate is sequential node `made` placed `pl`: a line computed more than
        once corresponds to a sequential line computed as often, each time another value, so
        each takes the nearest placement `pl` of a value `made`'s line makes with `made`'s op
        that no node of the line took yet. The nodes given one."""
        same = [(x.name, self.seq_vals[x.name]) for x in self.seq.nodes
                if x.source == made.source and x.op == made.op]
        used = [self.seq_vals[made.name]]
        out = []
        for m in line:
            vals = {r: self.rank_vals[r][m] for r in ranks}
            near = [(_distance(vals, sv, pl, self.dist, self.registry), i, sv) for i, (_, sv) in enumerate(same)
                    if _same_class(sv, vals[ranks[0]]) and pl in _placements(self.dist, sv, ranks)
                    and _fits(sv, pl, self.dist, vals)
                    and not any(u.shape == sv.shape and torch.equal(u, sv) for u in used)]
            if not near:
                continue
            sv = min(near, key=lambda t: t[:2])[2]
            used.append(sv)
            pieces = split_placed(sv, pl, self.dist.mesh, self.gen) if pl else {r: sv for r in ranks}
            override.update({(r, m): canon(pieces[r], self.index[r][m].type.dtype) for r in ranks})  # type: ignore[union-attr]
            out.append(m)
        return out

    def placement(self, at: dict[int, str]) -> Divergence | bool | None:
        """An input of node `at` (rank -> its name there; the same argument on every rank,
        which may make it on a line of its own) that holds a sequential value in one
        placement (a partial sum), while the same value in another (a replicated copy) makes
        every output right (`reheld`). False when there is none; None when the budget is spent."""
        everyone = sorted(at)
        args = {r: self.index[r][at[r]].tensor_args() for r in everyone}  # type: ignore[union-attr]
        if len({len(a) for a in args.values()}) != 1:
            return False
        for k in range(len(args[everyone[0]])):
            arg = {r: args[r][k] for r in everyone}
            if not all(isinstance(self.index[r].get(arg[r]), Node) for r in everyone):
                continue  # an input: the draw, not a rank's computation
            step = self.reheld(arg)
            if step is not False:
                return step
        return False

    def reheld(self, at: dict[int, str]) -> Divergence | bool | None:
        """Whether the nodes `at` (rank -> name) hold a sequential value in a placement with a
        partial sum in it, while the same value in another placement (a replicated copy)
        makes every output right: the values are right, the collective that should follow
        them is missing (a norm's partial sums of squares never all-reduced). False when
        not; None when the budget is spent."""
        everyone = sorted(at)
        vals = {r: self.rank_vals[r][at[r]] for r in everyone}
        tried: list[Tensor] = []  # sequential values already tried (tensors equal to them repair alike)
        for sn, sv in self.seq_tensors:
            if not _same_class(sv, vals[everyone[0]]) or any(t.shape == sv.shape and torch.equal(t, sv) for t in tried):
                continue
            pls = [pl for pl in _placements(self.dist, sv, everyone) if _fits(sv, pl, self.dist, vals)]
            held = next((pl for pl in pls if any(p.kind == "partial" for p in pl)
                         and _holds(vals, sv, pl, self.dist, self.registry)), None)
            if held is None:
                continue
            tried.append(sv)
            for pl in sorted((q for q in pls if q != held), key=lambda q: [p.kind != "replicate" for p in q]):
                pieces = split_placed(sv, pl, self.dist.mesh, self.gen)
                ok = self.fixes({(r, at[r]): canon(pieces[r], self.index[r][at[r]].type.dtype)  # type: ignore[union-attr]
                                 for r in everyone})
                if ok is None:
                    return None
                if ok:
                    n = self.index[everyone[0]][at[everyone[0]]]
                    s = next((x for x in self.seq.nodes if x.name == sn), None)
                    return Divergence(n.name, everyone, n.op, n.source, sn, _where(pl),  # type: ignore[union-attr]
                                      s.source if s else None, [], self.repairs, _where(held),
                                      dict(at) if len(set(at.values())) > 1 else {})
        return False

    def walk_back(self, found: Divergence) -> Divergence:
        """From an input found in the wrong placement, back through the nodes that carry the
        value in that placement (the linear ops after a partial sum) to the first that made
        it: where the collective belongs."""
        while True:
            at = found.names or {r: found.rank_node for r in found.ranks}
            step = self.placement(at)
            if not step:
                return replace(found, repairs=self.repairs)
            found = step


def _feeds_outputs(dist: Dist) -> set[str]:
    """Rank node names some rank output depends on."""
    return {x for g in dist.ranks.values() for x in g.ancestors(*(o.ref for o in g.outputs))
            if isinstance(g.index().get(x), Node)}


def _chain(g: Graph, name: str, explained: set[str]) -> list[tuple[str, str | None]]:
    """The unexplained rank nodes `name` is computed from, nearest first."""
    index = g.index()
    out: list[tuple[str, str | None]] = []
    todo, seen = list(reversed(index[name].tensor_args())), {name}  # type: ignore[union-attr]
    while todo:
        x = todo.pop(0)
        n = index.get(x)
        if x in seen or x in explained or not isinstance(n, Node):
            continue
        seen.add(x)
        out.append((x, n.source))
        todo.extend(n.tensor_args())
    return out


def _same_class(a: Tensor, b: Tensor) -> bool:
    def cls(x: Tensor) -> str:
        return "b" if x.dtype == torch.bool else "f" if x.is_floating_point() else "i"

    return cls(a) == cls(b)


def _placements(dist: Dist, sv: Tensor, ranks: list[int]) -> list[tuple[Placement, ...]]:
    """The standard placements of a sequential value over the mesh (each axis Replicate,
    Shard(d) or Partial sum); only replicated copies () when some ranks lack the node."""
    if len(ranks) != len(dist.ranks):
        return [()]
    kinds = [Placement("replicate"), *(Placement("shard", d) for d in range(sv.dim()))]
    if sv.dtype != torch.bool:
        kinds.append(Placement("partial"))
    return list(itertools.product(kinds, repeat=len(dist.mesh.axes)))


def _fits(sv: Tensor, pl: tuple[Placement, ...], dist: Dist, vals: Mapping[int, Tensor]) -> bool:
    shape = list(sv.shape)
    for (_, n), p in zip(dist.mesh.axes, pl, strict=False):  # () : whole copies on some ranks
        if p.kind == "shard":
            if p.dim >= len(shape) or shape[p.dim] % n:  # type: ignore[operator, index]
                return False
            shape[p.dim] //= n  # type: ignore[index]
    return all(list(v.shape) == shape for v in vals.values())


def _distance(vals: Mapping[int, Tensor], sv: Tensor, pl: tuple[Placement, ...], dist: Dist,
              registry: Registry) -> float:
    """How far the ranks' values are from holding `sv` placed `pl`: 1 - |cosine| between `sv`
    and what the placement reads from them (each copy, the concat of the shards, the sum of
    the partials), the largest over what it reads. A wrong value is most often correlated
    with the right one (twice it, a term short, some rows shifted), while unrelated tensors
    are near orthogonal whatever their scale."""
    leaves = {str(r): v for r, v in vals.items()}
    try:
        got = [v for v in vals.values()] if not pl else \
            [eval_term(t, registry, leaves) for t in placed_terms(lambda r: str(r), pl, dist.mesh)]
    except (EvalError, RuntimeError):
        return math.inf
    worst = 0.0
    b = sv.to(torch.float64).flatten()
    for g in got:
        a = g.to(torch.float64).flatten()
        if a.shape != b.shape:
            return math.inf
        norm = float(a.norm() * b.norm())
        cos = float(torch.dot(a, b)) / norm if norm > 0 and math.isfinite(norm) else 0.0
        worst = max(worst, 1.0 - abs(cos))
    return worst


def _partial(pl: tuple[Placement, ...]) -> bool:
    return any(p.kind == "partial" for p in pl)


def _holds(vals: Mapping[int, Tensor], sv: Tensor, pl: tuple[Placement, ...], dist: Dist, registry: Registry) -> bool:
    if not pl:
        return all(not significant(v, sv)[0] for v in vals.values())
    terms = placed_terms(lambda r: str(r), pl, dist.mesh)
    leaves = {str(r): v for r, v in vals.items()}
    for t in terms:
        try:
            if significant(eval_term(t, registry, leaves), sv)[0]:
                return False
        except (EvalError, RuntimeError):
            return False
    return True


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
                         [OutputError(**o) for o in doc["outputs"]],
                         reduced={int(k): [int(x) for x in v] if isinstance(v, list) else int(v)
                                  for k, v in doc.get("reduced", {}).items()},
                         mixed={k: [int(x) for x in v] for k, v in doc.get("mixed", {}).items()})
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
    seq, dist = _at_sizes(seq, dist, registry, cex)
    seq_vals = eval_graph(seq, registry, cex.seq_inputs)
    rank_vals = eval_ranks(dist.ranks, registry, cex.rank_inputs)
    return compare(seq, dist, registry, seq_vals, rank_vals)[0]


def _at_sizes(seq: Graph, dist: Dist, registry: Registry, cex: Counterexample) -> tuple[Graph, Dist]:
    """The programs at the sizes a counterexample was drawn at: symbols instantiated, or the
    sizes the search reduced rewritten the same way."""
    if cex.sizes:
        seq, dist = instantiate(seq, dist, cex.sizes)
    if cex.reduced:
        seq, dist = reduced_programs(seq, dist, registry, cex.reduced)
    return seq, dist
