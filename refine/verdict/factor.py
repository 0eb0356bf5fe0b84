"""Localizing a wrong constant factor by counterfactual evaluation.

When every failing output holds `c` times what its expectation wants (the report's relation
reads `2 * fc1.weight.grad@0`), the rank program computes the right thing up to a constant:
somewhere it scales by a wrong literal (a loss divided twice, a mean over the wrong count).
The symbolic relations cannot say where, since every scale is exact and clean. This module
tries edits of the rank program instead: each *constant factor* a rank program line applies
(a `mul`/`div` by a number literal, a `full` constant such as autograd's seed of `loss / M`,
the 1/n of an AVG reduction) is multiplied by `c` at every node that line makes on every rank
(a source line's literal is one constant however often it runs: each rank, each unrolled
micro-batch, forward and backward), and the rank programs are evaluated on random inputs
consistent with the input relations. The nearest such line to the failing outputs whose
edit makes every output right is the culprit.

How `c` is read: on those random inputs, as a least-squares ratio between each failing
output and what its expectation wants, read as a rational with denominator up to 10^6 and
checked elementwise; a failing output right on the draw to within the counterexample
search's precision (gradients clipped by a norm `c` times too large, wrong only through the
norm's epsilon) gives no ratio, though the edit must keep it right. When the outputs are no multiple of what the ranks hold but some of
their terms are (the relation and the rank output are weighted sums of the same tensors, and
the terms weighted differently are all off by one `c`: micro-batch means added where the
sequential mean halves each, next to a term that is right), the checker reads `c` off the
relations instead (`wrong_factor(factor=...)`).

Candidate lines, besides the literals above: a `full` constant other than 1, a `mean` (1 / its
element count), a SUM/AVG reduction whose flip multiplies by exactly `c`, or a division by one
computed number (a loss over a token count: the edit scales its quotient by `c`); and a line
making several of these (a loss's forward mean and its backward's scale) with all of them
edited at once. Order: lines the
edit turns into a scale by exactly 1 first (a division the program should not do at all: an
AVG reduction could always absorb the same factor), then by distance in ops from the failing
outputs. A line with a node the relations prove equal to a sequential tensor is never
blamed: its value is right. At most `MAX_TRIES` edits, each one evaluation of the rank
programs; a repair must hold on a second draw (seed 1) as well; deterministic. When no single
line's edit repairs every output, the culprit stays as localization found it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from fractions import Fraction

import torch

from refine.ir.graph import Dist, Graph, Node, case_symbols
from refine.ir.term import Term
from refine.ops.interp import (
    EvalError,
    close,
    eval_graph,
    eval_ranks,
    eval_term,
    instantiate,
    random_inputs,
    valuation,
)
from refine.ops.lower import rational
from refine.ops.registry import Registry
from refine.verdict.counterexample import significant
from refine.verdict.expect import expectation_options

MAX_TRIES = 16  # edits evaluated at most (each one evaluation of the rank programs)
REDUCTIONS = ("all_reduce", "reduce_scatter")


@dataclass
class WrongFactor:
    rank: int
    node: str  # the rank program's (user-level) node nearest the failing outputs on that line
    source: str
    factor: Fraction  # the output's sequential value over what the rank outputs hold
    edit: str  # what the counterfactual changed, for the report
    outputs: list[str]  # the failing outputs
    # failing outputs right on the draw (wrong by less than the counterexample search sees),
    # which say nothing of the factor
    right: list[str] = field(default_factory=list)


def _rational(v: float) -> Fraction:
    """A measured ratio (computed from values, so off by rounding) as the nearby simple
    rational; a literal is read exactly as the prover reads it (`rational`)."""
    r = Fraction(v).limit_denominator(10**6)
    return r if math.isclose(float(r), v, rel_tol=1e-9, abs_tol=0.0) else Fraction(v)


def _ratio(want: torch.Tensor, got: torch.Tensor) -> Fraction | None:
    """The constant c with want == c * got, if there is one (and got is not all zero)."""
    if want.shape != got.shape or not want.is_floating_point():
        return None
    w, g = want.flatten(), got.flatten()
    gg = float(g @ g)
    if gg == 0.0 or not math.isfinite(gg):
        return None
    c = _rational(float(w @ g) / gg)
    return c if c != 0 and close(want, float(c) * got) else None


def _literal_factor(n: Node) -> tuple[Fraction, int] | None:
    """The factor a node scales by and the position of its literal: `mul` by a number, `div`
    by a number (position -1: the value of a `full`)."""
    nums = [(i, a) for i, a in enumerate(n.args) if not isinstance(a, str)]
    if n.op == "full":
        v = float(n.attrs.get("value", 0.0))
        return (rational(v), -1) if v != 0.0 and math.isfinite(v) else None
    if len(nums) != 1 or len(n.tensor_args()) != 1 or isinstance(nums[0][1], bool):
        return None
    i, k = nums[0]
    if not math.isfinite(float(k)) or float(k) == 0.0:
        return None
    # the literal as the prover reads it (refine.ops.lower.rational), so an edit's constant
    # is the number the proof was about
    if n.op == "mul":
        return rational(k), i
    if n.op == "div" and i == 1:
        return 1 / rational(k), i
    return None


def _mean_factor(n: Node, g: Graph) -> Fraction | None:
    """A mean scales the sum it takes by 1/(the number of elements averaged): a constant
    factor like a division's literal (a loss averaged over a micro-batch, not the batch)."""
    if n.op != "mean" or len(n.tensor_args()) != 1:
        return None
    x = g.type_of(n.tensor_args()[0])
    if not all(isinstance(d, int) for d in (*x.shape, *n.type.shape)):
        return None
    k = math.prod(x.shape) // max(math.prod(n.type.shape), 1)
    return Fraction(1, k) if k > 1 else None


def _normalizer(n: Node, g: Graph) -> bool:
    """A division by one computed number (a token count, a batch size read off a tensor): a
    constant factor whose value is data, as a loss normalized by the wrong count is wrong."""
    args = n.tensor_args()
    if n.op != "div" or len(args) != 2 or args[1] != n.args[1]:
        return False
    shape = g.type_of(args[1]).shape
    return all(isinstance(d, int) for d in shape) and math.prod(shape) == 1


def _factor(n: Node, g: Graph) -> Fraction | None:
    """The constant factor a candidate line's node scales by (its literal's, or its mean's)."""
    lit = _literal_factor(n)
    return lit[0] if lit is not None else _mean_factor(n, g)


def _edited(n: Node, c: Fraction) -> list[Node]:
    """The node(s) computing the node's value with its constant factor multiplied by c."""
    if n.op in REDUCTIONS:
        return [replace(n, attrs={**n.attrs, "reduce_op": "sum" if n.attrs.get("reduce_op") == "avg" else "avg"})]
    lit = None if n.op == "mean" else _literal_factor(n)
    if lit is None:  # a mean or a computed divisor: the node, then times c, under the node's name
        inner = replace(n, name=f"{n.name}.unscaled")
        return [inner, Node(n.name, "mul", [inner.name, float(c)], {}, n.type, n.source, n.origin)]
    f, i = lit
    if i < 0:
        return [replace(n, attrs={**n.attrs, "value": float(f * c)})]
    args = list(n.args)
    args[i] = float(f * c) if n.op == "mul" else float(1 / (f * c))
    return [replace(n, args=args)]


def _outputs_ok(seq_vals: Mapping[str, torch.Tensor], seq: Graph, dist: Dist, outs: Mapping[str, torch.Tensor],
                registry: Registry) -> bool:
    """Whether every output holds one of its expectation's options (an output without one,
    any standard placement of the ranks' copies, as the counterexample search compares)."""
    for o in seq.outputs:
        want = seq_vals[o.ref]
        options = expectation_options(dist, o.name, want.dim(), set(outs)) or []
        if not any(_holds(terms, want, outs, registry) for _, terms in options):
            return False
    return True


def _holds(terms: list[Term], want: torch.Tensor, outs: Mapping[str, torch.Tensor], registry: Registry) -> bool:
    try:
        return all(close(eval_term(t, registry, outs), want) for t in terms)
    except Exception:  # noqa: BLE001 - an ill-shaped placement is a mismatch
        return False


def _rank_outputs(graphs: Mapping[int, Graph], vals: Mapping[int, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"{o.name}@{r}": vals[r][o.ref] for r, g in graphs.items() for o in g.outputs}


def wrong_factor(seq: Graph, dist: Dist, registry: Registry, failing: list[str],
                 proven: Callable[[int, str], bool] = lambda r, n: False, seed: int = 0,
                 factor: Fraction | None = None) -> WrongFactor | None:
    """The rank program line whose constant factor, multiplied by the one constant `c` every
    failing output that is a multiple of what it should be is off by, makes every output
    right; None when those outputs are not all off by one constant (or there is none), or no
    single line's edit repairs every failing output (those off by `c` and the others, a
    parameter updated with a gradient off by `c`).

    `factor` gives `c` instead, when the outputs are not multiples of what the ranks hold but
    some of the terms they sum are (the checker reads it off the relations: a loss that adds
    micro-batch means where it should add half of each, next to a term that is right); the
    edit must still make every output right.

    `proven(rank, node)` says the checker proved that rank node equal to a sequential tensor:
    a line with such a node computes a right value there, so its constant is not the wrong
    one (scaling the loss's derivative would also repair gradients that the program's
    declared placements double, but that derivative is the sequential one)."""
    try:
        symbols = case_symbols(seq, dist)
        if symbols:
            seq, dist = instantiate(seq, dist, valuation(symbols, seed))
        seq_in, rank_in = random_inputs(seq, dist, seed, registry)
        seq_vals = eval_graph(seq, registry, seq_in)
        rank_vals = eval_ranks(dist.ranks, registry, rank_in)
    except (EvalError, RuntimeError, ValueError, KeyError):
        return None
    outs = _rank_outputs(dist.ranks, rank_vals)
    refs = {o.name: o.ref for o in seq.outputs}
    right: set[str] = set()
    roots: dict[int, set[str]] = {r: set() for r in dist.ranks}  # failing rank outputs' tensors
    held: list[set[Fraction]] = []  # per failing output that is a multiple, the factors it may be off by
    for name in failing:
        want = seq_vals[refs[name]] if name in refs else None
        options = expectation_options(dist, name, want.dim(), set(outs)) if want is not None else None
        if not options:
            return None
        cands: set[Fraction] = set()
        is_right = False
        for _, terms in options:
            for t in terms:
                for leaf in t.leaves():
                    local, _, r = leaf.rpartition("@")
                    roots[int(r)].add(dist.ranks[int(r)].output(local).ref)
            if factor is not None:
                continue
            # an output that is no multiple (a parameter updated with a gradient off by c)
            # gives no c, and one right on the draw (wrong by less than the comparison sees:
            # gradients clipped by a norm twice too large but for its epsilon, as the
            # counterexample search compares) says nothing of c; the edit must still keep
            # each right
            cs: set[Fraction] = set()
            all_right = evaluated = True
            for t in terms:
                try:
                    got = eval_term(t, registry, outs)
                except Exception:  # noqa: BLE001 - an ill-shaped placement: not this option
                    evaluated = False
                    break
                if significant(got, want)[0]:
                    all_right = False
                    if (c := _ratio(want, got)) is not None:
                        cs.add(c)
            if not evaluated:
                continue
            if all_right:
                is_right = True
            elif len(cs) > 1 and len(options) == 1:
                return None  # the terms of its expectation off by different factors
            elif len(cs) == 1:  # (without an expectation: each standard placement it may be)
                cands |= cs
        if is_right:
            right.add(name)
        elif cands:
            held.append(cands)
    factors = set.intersection(*held) if held else set()
    if factor is not None:
        factors = {factor}
    if len(factors) != 1 or Fraction(1) in factors:
        return None
    (c,) = factors

    dist_of = distances(dist, {r: sorted(xs) for r, xs in roots.items()})

    # the candidate lines: (source, what the line scales by) -> its nodes on every rank
    groups: dict[tuple[str, str], list[tuple[int, Node]]] = {}
    for r, g in sorted(dist.ranks.items()):
        for n in g.nodes:
            if not n.source:
                continue
            if n.op in REDUCTIONS and n.attrs.get("reduce_op") in ("sum", "avg"):
                size = len(n.attrs.get("group", ())) or len(dist.ranks)
                flip = Fraction(size) if n.attrs["reduce_op"] == "avg" else Fraction(1, size)
                if flip == c:
                    groups.setdefault((n.source, f"{n.op} {n.attrs['reduce_op']}"), []).append((r, n))
            elif (f := _factor(n, g)) is not None and f != 1:  # a 1 scales nothing (a backward seed)
                groups.setdefault((n.source, str(f)), []).append((r, n))
            elif _normalizer(n, g):
                groups.setdefault((n.source, "a computed divisor"), []).append((r, n))
    # a line making several constants (a loss's forward mean and its backward's scale): the
    # line's whole scaling off by c is one more candidate, all its constants edited at once
    lines: dict[str, list[tuple[str, str]]] = {}
    for key in groups:
        if not key[1].startswith(REDUCTIONS):
            lines.setdefault(key[0], []).append(key)
    for source, keys in lines.items():
        if len(keys) > 1:
            groups[(source, "all its constants")] = [m for k in keys for m in groups[k]]
    ranked = []
    for key, members in groups.items():
        near = [(dist_of[(r, n.name)], r, n.name) for r, n in members if (r, n.name) in dist_of]
        if not near:
            continue  # the line does not feed a failing output
        q, first = members[0]
        f = _factor(first, dist.ranks[q])
        # a factor the fix makes 1 says the line should not scale at all (a second division):
        # the most specific explanation, tried before the lines whose factor is only off
        removes = f is not None and f * c == 1
        ranked.append((not removes, min(near), key, members))
    ranked.sort(key=lambda x: (x[0], x[1], x[2]))
    tries = 0
    again = _SecondDraw(seq, dist, registry, seed + 1)
    for _, (_, r, name), (source, label), members in ranked:
        if tries == MAX_TRIES:
            break
        if any(proven(q, n.name) for q, n in members):
            continue
        tries += 1
        edit = {(q, n.name) for q, n in members}
        graphs = {q: replace(g, nodes=[m for n in g.nodes for m in (_edited(n, c) if (q, n.name) in edit else [n])])
                  for q, g in dist.ranks.items()}
        try:
            vals = eval_ranks(graphs, registry, rank_in)
        except (EvalError, RuntimeError, ValueError):
            continue
        if _outputs_ok(seq_vals, seq, dist, _rank_outputs(graphs, vals), registry) \
                and again.repairs(graphs):
            node = dist.ranks[r].index()[name]
            assert isinstance(node, Node)
            if node.op in REDUCTIONS:
                desc = f"{node.op} with {'SUM' if node.attrs['reduce_op'] == 'avg' else 'AVG'} instead of " \
                       f"{node.attrs['reduce_op'].upper()}"
            elif label == "all its constants":
                desc = f"each constant factor of the line times {c}"
            elif (f := _factor(node, dist.ranks[r])) is not None:
                desc = f"its factor {f} times {c} = {f * c}"
            else:  # a computed divisor
                desc = f"its quotient by {node.args[1]} times {c}: the divisor is {c} times what it should be"
            return WrongFactor(r, name, source, c, f"{desc} at its {len(members)} node(s) on the ranks",
                               sorted(failing), sorted(right))
    return None


class _SecondDraw:
    """A second, independent draw an edit must repair too. `c` is read off one draw, and with
    a single scalar output any two values are in a constant ratio: an edit that merely
    rescales the one loss value there is a coincidence, not a wrong constant. The draw and its
    sequential values are made once, when a first edit passes the first draw."""

    def __init__(self, seq: Graph, dist: Dist, registry: Registry, seed: int) -> None:
        self.seq, self.dist, self.registry, self.seed = seq, dist, registry, seed
        self.drawn: tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]] | None = None

    def repairs(self, graphs: Mapping[int, Graph]) -> bool:
        try:
            if self.drawn is None:
                seq_in, rank_in = random_inputs(self.seq, self.dist, self.seed, self.registry)
                self.drawn = eval_graph(self.seq, self.registry, seq_in), rank_in
            seq_vals, rank_in = self.drawn
            return _outputs_ok(seq_vals, self.seq, self.dist,
                               _rank_outputs(graphs, eval_ranks(graphs, self.registry, rank_in)), self.registry)
        except (EvalError, RuntimeError, ValueError, KeyError):
            return False


def distances(dist: Dist, roots: Mapping[int, list[str]]) -> dict[tuple[int, str], int]:
    """Distance in ops of each rank node from the roots (failing outputs) it feeds, by rank:
    the lines nearest a wrong output are the likeliest culprits."""
    dist_of: dict[tuple[int, str], int] = {}
    for r, g in dist.ranks.items():
        idx = g.index()
        frontier, d = list(roots.get(r, ())), 0
        while frontier:
            nxt = []
            for x in frontier:
                if (r, x) in dist_of:
                    continue
                dist_of[(r, x)] = d
                n = idx.get(x)
                if isinstance(n, Node):
                    nxt.extend(n.tensor_args())
            frontier, d = nxt, d + 1
    return dist_of
