"""The walk: every sequential node related to the rank program, in topological order.

Each node's term (its op over its inputs' relations) is given to a list of named
strategies, tried in order until one gives a clean relation (refine.prove.policy.STRATEGIES):

- `replay`: an earlier clean step of the same shape, its premises checked here (refine.prove.reuse);
- `near`, `wide`: a step over the rank tensors within Policy.near_hops, then wide_hops, uses
  of the inputs' tensors;
- `deep`: instead of `wide` over a fused op's term, a step Policy.deep_hops uses deep;
- `carried`: instead of `wide` over a carried term (an unclean node's, small: a mask, an
  intermediate the ranks only hold fused into its users), a step Policy.carry_hops deep,
  with side chains;
- `write_back`: where the ranks write the inputs' tensors back into a buffer, a step over
  the structural chain (refine.prove.frontier.frontier's `structural`);
- `relayout`: where the ranks send the inputs' tensors through an all_to_all (a re-layout,
  with chunks, concats and views around it), a step over the structural chain;
- `side`: where a use's other operand is computed from available tensors by a few ops, a
  step with that chain along (refine.prove.frontier.frontier's `side`).

A clean relation that sums rank tensors the ranks exchange in pieces (a reduce-scatter, an
all-gather) is then restated, when the e-graph proves it, as the concat of those pieces
(`_pieces`): the relations of a sequence-parallel residual stream stay one piece per rank.

Which strategies apply to a node is decided by the node alone (`_plan`); the policy can only
leave some out. What the walk learns (tensors found equal, opaque leaves for unclean nodes)
is kept in its own view of the program (DistProgram.walk_view), not in the program the
pre-walk pass froze.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from refine.ir.graph import Graph, Node
from refine.ir.term import OPAQUE, Term, cat, depth, opaque
from refine.ops.registry import COMPUTE, Registry
from refine.prove.engine import Engine
from refine.prove.frontier import (
    ancestry,
    counterparts,
    exchanges_near,
    frontier,
    scatters_near,
    structural_ancestry,
    users_of_class,
    with_replicas,
    writes_back_near,
)
from refine.prove.policy import STRATEGIES, Policy
from refine.prove.reuse import Replayer, StepResult
from refine.relate.program import DistProgram, join_congruent

# ---------------------------------------------------------------------------------------
# What facts about parts of rank inputs make equal (part of the pre-walk pass)


def join_fact_consequences(prog: DistProgram, engine: Engine, registry: Registry) -> int:
    """Rank tensors the facts (refine.ir.layout: a replicated slice of two ranks' fused
    weights) make equal as whole tensors: a slice, on two ranks, of what each computes from
    its own copy (a TP4 rank's key columns of its QKV product, equal to its neighbour's).
    Candidates are the same program position on the two ranks of a fact, a slice within
    `Policy.fact_depth` uses; each is proven by an e-graph over both definitions back to the
    facts' leaves, and joins `prog.same`. Returns how many joined."""
    fact_depth = engine.policy.fact_depth
    pairs: set[tuple[str, str]] = set()
    for a, b in prog.facts:
        for x in a.leaves():
            for y in b.leaves():
                if x.rpartition("@")[0] == y.rpartition("@")[0] and x != y:
                    pairs.add((x, y))
    joined = 0
    layer = sorted(pairs)
    seen = set(layer)
    for _ in range(fact_depth):
        nxt: list[tuple[str, str]] = []
        for x, y in layer:
            ry = y.rpartition("@")[2]
            for u in prog.users.get(x, ()):
                v = f"{u.rpartition('@')[0]}@{ry}"
                if (u, v) in seen or v not in prog.users.get(y, ()) and v not in users_of_class(prog, y):
                    continue
                if prog.types.get(v) != prog.types[u]:
                    continue
                seen.add((u, v))
                nxt.append((u, v))
                du = prog.defs[u]
                if du is not None and du.op == "slice" and prog.same.find(u) != prog.same.find(v):
                    tensors = ancestry(prog, [u, v], fact_depth + 2)
                    res = engine.step(Term("D", (), (u,)), prog, registry, tensors, checks=[Term("D", (), (v,))])
                    if res.checks[0]:
                        prog.same.union(u, v)
                        joined += 1
        layer = sorted(nxt)
    if joined:
        join_congruent(prog)
    return joined


def settle(prog: DistProgram, engine: Engine, registry: Registry) -> None:
    """The end of the pre-walk pass: the facts' consequences joined, then the program's facts
    and equalities frozen (DistProgram.freeze). Whoever builds a program and walks it calls
    this after every other pre-walk join (refine.prove.copies.join_copies)."""
    if prog.facts:
        join_fact_consequences(prog, engine, registry)
    prog.freeze()


# ---------------------------------------------------------------------------------------
# The walk


@dataclass
class Inference:
    relations: dict[str, Term]  # sequential core tensor -> relation over rank tensors
    clean: dict[str, bool]
    steps: dict[str, StepResult]
    # the walk's view of the program: the frozen facts and what the walk learned (tensors
    # found equal, opaque leaves); what follows the walk (expectations, localization) reads it
    program: DistProgram
    # strategy -> how many nodes it ran on, and how many times its result was the relation kept
    ran: Counter[str] = field(default_factory=Counter)
    kept: Counter[str] = field(default_factory=Counter)
    # unclean nodes whose users saw their term rather than an opaque leaf (Policy.carry_ops)
    carried: set[str] = field(default_factory=set)


def node_term(n: Node, rel: dict[str, Term], registry: Registry) -> Term:
    op = registry.ops[n.op]
    args = tuple(rel[a] for a in n.tensor_args())
    if op.kind == "nary":
        return Term(n.op, args)
    return Term(n.op, args, tuple(n.attrs[k] for k, _ in op.attrs if k in n.attrs))


_STRUCTURAL = frozenset({"view", "slice", "cat", "Sum", "Scale", "transpose"})
# ops whose result over a fused term stays a term (infer): views and concats of it, and a
# product with it or its scale (softmax backward's -P * D: flash-style ranks distribute
# P_j * (dP_j - D), so the product alone is no rank tensor, only its difference with P * dP is)
_PASS_FUSED = frozenset({"view", "cat", "mul_t", "Scale"})


@dataclass
class _Search:
    """One node's search: what its strategies read."""

    walk: _Walk
    node: Node
    term: Term
    ops: set[str]
    leaves: set[str]
    known: set[str]  # available tensors: those earlier steps named, and the offered counterparts
    offered: set[str]  # counterparts offered to this node (refine.prove.frontier.counterparts)
    hops: tuple[int, ...]  # the reach of the node's hop tries, in order

    @cached_property
    def near(self) -> set[str]:
        """The leaves with their replicas (computed only when a step runs: a replay needs none)."""
        return with_replicas(self.walk.prog, self.leaves)

    def frontier(self, hops: int, structural: bool = False, side: bool = False) -> list[str]:
        w = self.walk
        return frontier(w.prog, self.near, self.known, hops, self.offered, structural=structural, policy=w.policy,
                        side=side)

    def step(self, tensors: list[str], iterations: int = 0) -> StepResult:
        w = self.walk
        return w.engine.step(self.term, w.prog, w.registry, tensors, iterations=iterations)


# A strategy gives the tensors it searched and its result, or None where it does not apply.
Found = tuple[list[str], StepResult]


@dataclass(frozen=True)
class Strategy:
    name: str
    run: Callable[[_Search], Found | None]


def _hop(reach: Callable[[Policy], int], iterations: Callable[[Policy], int] = lambda p: 0, side: bool = False) -> \
        Callable[[_Search], Found | None]:
    def run(s: _Search) -> Found:
        tensors = s.frontier(reach(s.walk.policy), side=side)
        return tensors, s.step(tensors, iterations=iterations(s.walk.policy))
    return run


def _replay(s: _Search) -> Found | None:
    """An earlier step's proof renamed onto this node, when its premises hold here. Counted
    as run only where it gives a result (a replay only ever gives a clean one): the nodes
    it was offered but could not prove are proven by the strategies after it."""
    replayer = s.walk.replayer
    res = replayer.replay(s.term) if replayer is not None else None
    return None if res is None else ([], res)


def _write_back(s: _Search) -> Found | None:
    """The ranks write what the inputs relate to back into a buffer and read it out again:
    retried once over the structural chain (only there, so a step that fails elsewhere
    keeps the search, and the culprit, it had)."""
    w = s.walk
    if OPAQUE in s.ops or not writes_back_near(w.prog, s.near, w.policy.write_back_hops):
        return None
    tensors = s.frontier(s.hops[0], structural=True)
    return tensors, s.step(tensors)


def _relayout(s: _Search) -> Found | None:
    """The ranks exchange what the inputs relate to by an all_to_all, with chunks, stacks,
    concats and views around it (Ulysses' heads for sequence and back, an expert dispatch):
    retried once over the structural chain, where those ops cost no hop (only there, as for
    a write-back)."""
    w = s.walk
    if OPAQUE in s.ops or not exchanges_near(w.prog, s.near, w.policy.wide_hops):
        return None
    tensors = s.frontier(s.hops[0], structural=True)
    return tensors, s.step(tensors)


def _side(s: _Search) -> Found | None:
    """A use whose other operand the ranks compute from available tensors by a few ops (a
    mask a rank makes from its labels per micro-batch, beside the value it masks): retried
    once with those chains along. Only there: a step proven without them keeps its search,
    its replays and its culprit (a larger step relates a mask to another rank's piece)."""
    if OPAQUE in s.ops or not s.walk.policy.side_depth:
        return None
    tensors = s.frontier(s.hops[0], side=True)
    if tensors == s.frontier(s.hops[0]):
        return None  # no chain to take along
    return tensors, s.step(tensors)


def _pieces(s: _Search, partial: StepResult) -> StepResult | None:
    """A clean relation with a sum in it (rank tensors concatenated and summed), where the
    ranks exchange its terms in pieces (a reduce-scatter, an all-gather, an all-to-all), as
    the concat of one rank tensor per member of that group along one dim, when that holds.
    Both are clean, but a user of the sum carries every rank's partial term (a
    sequence-parallel residual stream after two layers is a sum of 5 terms per rank, 20 at
    TP 4; its gradient a concat of per-rank sums), and a nonlinear user (a norm's square)
    must find the pieces anyway, from ever more terms, until its e-graph outgrows the step;
    extraction alone does not prefer the pieces (they cost as much as the sum's terms).
    Each candidate, a same-named tensor on the ranks of a group reached, tiling the node's
    shape along one dim, is a check in one e-graph over the structural chain (both sides
    rewritten): only a proven equality replaces the relation."""
    w = s.walk
    leaves = partial.best.leaves()
    # a concat of one piece per member is as small as a relation over the group gets
    groups = [g for g in scatters_near(w.prog, leaves, w.policy.wide_hops) if len(leaves) > len(g)]
    if not groups:
        return None
    tensors = frontier(w.prog, with_replicas(w.prog, leaves), s.known, s.hops[0], s.offered, structural=True,
                       policy=w.policy)
    shape = s.node.type.shape
    by_base: dict[str, set[int]] = {}
    for x in tensors:
        base, _, r = x.rpartition("@")
        if r.isdigit():
            by_base.setdefault(base, set()).add(int(r))
    checks: list[Term] = []
    for base, ranks in sorted(by_base.items()):
        for g in groups:
            if not set(g) <= ranks:
                continue
            t = w.prog.types.get(f"{base}@{g[0]}")
            if t is None or len(t.shape) != len(shape) or any(w.prog.types[f"{base}@{r}"] != t for r in g):
                continue
            for d in range(len(shape)):
                # concrete sizes only: a symbolic one (refine.ir.sizes) compares to no bool
                tiles = all(isinstance(x, int) and isinstance(y, int) and (x * len(g) == y if i == d else x == y)
                            for i, (x, y) in enumerate(zip(t.shape, shape, strict=True)))
                if tiles:
                    checks.append(cat([Term("D", (), (f"{base}@{r}",)) for r in g], d))
    if not checks:
        return None
    # how the sum's own terms are built by the relation language's ops (a gathered gradient
    # is a concat of what each rank gathered), and the candidates' terms rewritten too
    have = set(tensors)
    tensors += [x for x in structural_ancestry(w.prog, sorted(leaves), w.policy.expect_hops) if x not in have]
    res = w.engine.step(partial.best, w.prog, w.registry, tensors, checks=checks, both=True)
    held = [c for c, ok in zip(checks, res.checks, strict=True) if ok]
    if not held:
        return None
    return StepResult(held[0], res.cost, [], [], res.seconds)


_PLAIN = frozenset({"D", "cat", "Sum"})  # rank tensors, concatenated and summed


_BY_NAME: dict[str, Strategy] = {s.name: s for s in (
    Strategy("replay", _replay),
    Strategy("near", _hop(lambda p: p.near_hops)),
    Strategy("wide", _hop(lambda p: p.wide_hops)),
    Strategy("deep", _hop(lambda p: p.deep_hops, lambda p: p.deep_iterations)),
    # with side chains: the ranks' fused value also reads what they computed from tensors
    # known already (Megatron's per-token mix of the nll with the smoothing term)
    Strategy("carried", _hop(lambda p: p.carry_hops, side=True)),
    Strategy("write_back", _write_back),
    Strategy("relayout", _relayout),
    Strategy("side", _side),
)}
assert tuple(_BY_NAME) == STRATEGIES


def _plan(n: Node, ops: set[str], over_fused: bool, over_carried: bool, fusing: set[str],
          policy: Policy) -> tuple[list[str], tuple[int, ...]]:
    """The node's hop tries (names and reaches, in order). A node over an opaque input gets
    no wider retry: it cannot become clean by finding more rank tensors for the inputs that
    are clean. A fused op's own relation is searched near its inputs only (if there is one
    further away, it is its users' business: they search deep)."""
    tries = ["near"] if OPAQUE in ops or n.op in fusing else ["near", "wide"]
    if OPAQUE not in ops and over_fused:
        tries = ["near", "deep"]  # over a fused term: its rank counterpart lies far downstream
    elif OPAQUE not in ops and over_carried:
        # the ranks' counterpart of a carried term is as far as its chain; a view or scale of
        # one (the rank holds no more of it than of the term) is searched near only, a sum or
        # concat deeper (it combines the term with others, as the ranks may have done first)
        tries = ["near"] if n.op in _STRUCTURAL - {"Sum", "cat"} else ["near", "carried"]
    reach = {"near": policy.near_hops, "wide": policy.wide_hops, "deep": policy.deep_hops,
             "carried": policy.carry_hops}
    return tries, tuple(reach[t] for t in tries)


@dataclass
class _Walk:
    prog: DistProgram  # the walk's view (DistProgram.walk_view)
    engine: Engine
    registry: Registry
    policy: Policy
    fusing: set[str]
    replayer: Replayer | None
    ran: Counter[str] = field(default_factory=Counter)
    kept: Counter[str] = field(default_factory=Counter)

    def search(self, s: _Search, tries: list[str], retries: bool = True) -> Found:
        """The strategies for the node, in order, until one gives a clean relation
        (`retries`: the structural and side retries after `tries`)."""
        found: Found | None = None
        by = ""
        for name in ["replay", *tries, *(("write_back", "relayout", "side") if retries else ())]:
            if found is not None and found[1].clean:
                break
            if not self.policy.uses(name):
                continue
            got = _BY_NAME[name].run(s)
            if got is None:
                continue
            self.ran[name] += 1
            # the last one run is the node's result: clean, or its best term for the report
            found, by = got, name
        if found is not None and found[1].clean and by != "replay" and "Sum" in (ops := found[1].best.ops()) \
                and ops <= _PLAIN:
            pieces = _pieces(s, found[1])
            if pieces is not None:
                found = (found[0], pieces)
        if found is None:  # every strategy that applies left out by the policy: nothing proven
            return [], StepResult(s.term, COMPUTE, [], [], 0.0)
        if found[1].clean:
            self.kept[by] += 1
            if by != "replay" and self.replayer is not None:
                self.replayer.record(s.term, found[1])
        return found


def infer(seq: Graph, inputs: dict[str, Term], prog: DistProgram, engine: Engine, registry: Registry) -> Inference:
    """Relate every sequential node, in topological order. A node with no clean relation
    keeps its best term for the report, but the nodes using it see it as an opaque leaf
    (refine.ir.term.OPAQUE): an unclean term carried along would grow with every op after it and
    make each later e-graph larger, while it is already known not to be what the ranks
    hold. The exception is a fused op (`Op.fuse`: softmax, which blockwise attention never
    materialises): with no clean relation near its inputs, its users see it as the op over
    its inputs' relations and search the rank program `Policy.deep_hops` uses deep for
    their own counterpart. So is a small unclean term of any other op (Policy.carry_ops):
    its users see it inlined, and a carried node a clean user takes in is left out of
    `clean` (a sequential output never is).

    A node whose term has the shape of an earlier clean step's is first offered to
    `refine.prove.reuse.Replayer` (the `replay` strategy): that step's premises renamed onto
    this node, each checked against the rank program, give its result renamed (a repeated
    layer is proven once); when they do not hold, the node is proven as usual.

    The program's facts are settled and frozen first (`settle`) if the caller has not."""
    if not prog.frozen:
        settle(prog, engine, registry)
    policy = engine.policy
    view = prog.walk_view()
    down = dict(inputs)  # what later nodes see: the clean relation, or an opaque leaf
    shown = dict(inputs)  # the best term found, for reports and expectations
    clean = {k: True for k in inputs}
    steps: dict[str, StepResult] = {}
    known: set[str] = {n for n, d in view.defs.items() if d is None}
    # see counterparts: available, with their definitions, to the sequential nodes within
    # Policy.counterpart_depth uses of the step that found them
    offered: dict[str, dict[str, int]] = {}  # node -> counterpart -> uses it may still go
    fusing = {name for name, op in registry.ops.items() if op.fuse}
    # a repeated layer's steps are instantiated from an earlier, identical one (refine.prove.reuse)
    replayer = Replayer(view, engine.stats, engine.fired) if policy.uses("replay") else None
    walk = _Walk(view, engine, registry, policy, fusing, replayer)
    carried: set[str] = set()  # unclean nodes whose users see their term (Policy.carry_ops)
    # ... of them, those whose carry began at a floating-point value (not a mask or index):
    # an intermediate the ranks may hold only fused into its users. Their users try near,
    # then the carried step (with side chains), no other; in a wrong program none relates and
    # each such step runs its whole bound, so a term whose step was cut short is not carried
    # further: its users would only search a larger e-graph for the same wrong value
    values: set[str] = set()
    # ... and only along a chain: a value with several users is one the ranks compute once
    # and reuse (they would have to fuse it into each user apart), and carried into every
    # user of every user, a wrong value would be searched for over a whole backward pass.
    # Concrete sizes only: with symbols, a carried wrong value (an all-gather along the wrong
    # dim) meets size arithmetic of the reshape rules that fails on a non-integer size
    n_users = Counter(a for n in seq.nodes for a in set(n.tensor_args()))
    outputs = {o.ref for o in seq.outputs}  # a checked value is never only its users' business
    for n in seq.nodes:
        term = node_term(n, down, registry)
        leaves = term.leaves()
        ops = term.ops()
        over_fused = any(a.ops() & fusing for a in term.args)
        over_carried = any(a in carried for a in n.args if isinstance(a, str))
        over_value = any(a in values for a in n.args if isinstance(a, str))
        tries, hops = _plan(n, ops, over_fused, over_carried, fusing, policy)
        if over_value and not over_fused and OPAQUE not in ops:
            tries, hops = ["near", "carried"], (policy.near_hops, policy.carry_hops)
        offers = _offered_to(n, offered)
        cps = set(offers)
        tensors, res = walk.search(_Search(walk, n, term, ops, leaves, known | cps, cps, hops), tries,
                                   retries=not (over_value and tries == ["near", "carried"]))
        shown[n.name] = res.best
        steps[n.name] = res
        known |= res.best.leaves()
        if res.clean:
            for c in counterparts(view, n.op, leaves, tensors) - known:
                offers[c] = policy.counterpart_depth
        offered[n.name] = offers
        if res.clean and depth(res.best) <= policy.term_depth:
            clean[n.name] = True
            down[n.name] = res.best
        elif not leaves and OPAQUE not in ops and depth(term) <= policy.term_depth:
            # computed from constants alone (a range cast to float for rotary positions, a
            # mask built from ranges): the term is the value itself, the same on every rank,
            # and no rank tensor is needed to state it; its users see it as it is
            clean[n.name] = True
            down[n.name] = term
        elif OPAQUE not in ops and ((n.op in fusing and not over_fused) or (over_fused and n.op in _PASS_FUSED)) \
                and depth(term) <= policy.term_depth:
            # its users see the op over its inputs' relations; left out of `clean`: whether
            # it is right is decided at its users (localization passes over it). Views and
            # concats of a fused term pass it on too (a stack of norms, rules/vector_norm.py)
            down[n.name] = term
        else:
            clean[n.name] = False
            value = over_value or (not over_carried and n.type.dtype.startswith(("float", "bfloat")))
            if OPAQUE not in ops and _dag_size(term) <= policy.carry_ops and depth(term) <= policy.term_depth \
                    and not (value and (res.bounded or n_users[n.name] != 1 or n.name in outputs
                                        or engine.symbolic)):
                # a small unclean term is carried to its users (inlined into their terms), and
                # so is what is computed from it: the ranks may never hold it, only what its
                # users compute, fused. A mask or index: no rank holds the sequential mask over
                # the whole vocab, only what it selects (Megatron's vocab-parallel target
                # lookup); a value: the log-probs, where Megatron computes log(sum_exp) minus
                # the looked-up logit, the nll masked on its own, where it mixes the smoothing
                # term in per token first. The term is the node's value over its inputs'
                # relations, so whatever a user's step proves over it holds
                down[n.name] = term
                carried.add(n.name)
                if value:
                    values.add(n.name)
            else:
                view.opaque[n.name] = n.type
                down[n.name] = opaque(n.name)
        # what a step proved equal feeds every later step (the e-graphs name classes by
        # their representatives): kept in the walk's view
        for f in res.found:
            if f in view.types:
                view.same.union(res.found[0], f)
        if res.clean:
            for a, b in res.same:
                if view.types.get(a) == view.types.get(b) is not None:
                    view.same.union(a, b)
    # a carried node that a clean relation took in (through its users, or carried users of
    # it that were) is, like a fused one, left out of `clean`: what matters about it is
    # proven at that user. One that nothing clean took in stays unclean (a culprit).
    users: dict[str, list[str]] = {}
    for n in seq.nodes:
        for a in n.tensor_args():
            users.setdefault(a, []).append(n.name)
    absorbed: set[str] = set()
    for n in reversed(seq.nodes):
        if n.name in carried and n.name not in outputs and \
                any(clean.get(u) or u in absorbed for u in users.get(n.name, ())):
            absorbed.add(n.name)
            del clean[n.name]
    return Inference(shown, clean, steps, view, walk.ran, walk.kept, carried)


def _dag_size(t: Term) -> int:
    """The number of distinct non-leaf subterms of t, concats not counted: how a tensor is
    laid out over the ranks (a concat of n rank pieces is n - 1 binary cats) is no op of
    the computation, and Policy.carry_ops must not depend on the rank count."""
    seen: set[Term] = set()
    todo = [t]
    while todo:
        x = todo.pop()
        if x in seen or not x.args:
            continue
        seen.add(x)
        todo.extend(x.args)
    return sum(1 for x in seen if x.op != "cat")


def _offered_to(n: Node, offered: dict[str, dict[str, int]]) -> dict[str, int]:
    """The counterparts offered to `n`: its inputs', one use further on, while within depth."""
    out: dict[str, int] = {}
    for a in n.tensor_args():
        for c, left in offered.get(a, {}).items():
            if left > 0 and left - 1 > out.get(c, -1):
                out[c] = left - 1  # offered at 0 too, but passed on no further
    return out
