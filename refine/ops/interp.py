"""A torch interpreter for graphs, distributed programs and relation terms.

Everything runs in float64 (floating dtypes), int64 (integer dtypes) or bool, on CPU, with
each op's torch reference (`Op.ref`). Collectives are simulated across ranks, matched the way
`refine.relate.program` matches them: the k-th collective of a group on each member, and sends
and receives between a pair of ranks in program order; they run in an order the ranks' program
order allows (`refine.ops.schedule`), and a program that deadlocks is an `EvalError`. An `Arith`
passed to `eval_graph` / `eval_ranks` decides how floating values are held and how collectives
reduce them: exactly by default, rounded to a low-precision format by `refine.oracle.precision`.

On top of the interpreter:

- `random_inputs(seq, dist, seed)`: random sequential inputs and rank inputs consistent with
  the dist's input relations;
- `define_conflict(seq, dist, registry)`: a define that contradicts the relations, which the
  loader refuses.

Symbolic sizes are evaluated at a valuation of their symbols (`instantiate`). The oracles
that run both programs and compare them are in `refine.oracle.differential`.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from refine.ir import sizes
from refine.ir.graph import (
    Define,
    Dist,
    Graph,
    Mesh,
    Placement,
    Relation,
    TensorType,
    tensor_name,
)
from refine.ir.layout import join_replicas, placed_terms
from refine.ir.sexp import Sym, head, parse_cached
from refine.ir.term import LEAF_OPS, OPAQUE, Term
from refine.ops import schedule
from refine.ops.lower import lower, normalize_attrs
from refine.ops.registry import Registry, load_registry
from refine.ops.special import Mix, index_limits

Tensor = torch.Tensor
DEFAULT_INT_BOUND = 8
RTOL = 1e-7
ATOL = 1e-9


class EvalError(RuntimeError):
    """A program that cannot be evaluated (a deadlock, a missing input, a bad op)."""


# ---------------------------------------------------------------------------------------
# dtypes and values


def torch_dtype(dtype: str) -> torch.dtype:
    if dtype == "bool":
        return torch.bool
    if dtype.startswith(("int", "uint")):
        return torch.int64
    return torch.float64


def canon(value: Any, dtype: str | None = None) -> Tensor:
    """A tensor in the interpreter's dtypes: float64, int64 or bool."""
    t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    if dtype is not None:
        want = torch_dtype(dtype)
        if t.dtype != want:
            t = t.to(want)
        return t
    if t.is_floating_point() and t.dtype != torch.float64:
        return t.to(torch.float64)
    if not t.is_floating_point() and t.dtype not in (torch.bool, torch.int64):
        return t.to(torch.int64)
    return t


def close(a: Tensor, b: Tensor, rtol: float = RTOL, atol: float = ATOL) -> bool:
    if tuple(a.shape) != tuple(b.shape):
        return False
    if a.dtype == torch.bool or b.dtype == torch.bool:
        return bool(torch.equal(a.bool(), b.bool()))
    return bool(torch.allclose(a.to(torch.float64), b.to(torch.float64), rtol=rtol, atol=atol, equal_nan=True))


def max_err(a: Tensor, b: Tensor) -> float:
    if tuple(a.shape) != tuple(b.shape):
        return math.inf
    if a.numel() == 0:
        return 0.0
    d = (a.to(torch.float64) - b.to(torch.float64)).abs()
    d = torch.where(torch.isnan(a.to(torch.float64)) & torch.isnan(b.to(torch.float64)), torch.zeros_like(d), d)
    return float(torch.nan_to_num(d, nan=math.inf).max())


# ---------------------------------------------------------------------------------------
# Helper constructors that rule files declare (`refine.ops.registry.Helper`, a family's
# HELPERS): their meaning, for terms that hold them and for the rule checker.


def helper_semantics(registry: Registry) -> dict[str, Callable[..., Tensor]]:
    """Helper constructor name -> python function of its egglog arguments, in declaration
    order (tensors and plain values)."""

    def op(name: str) -> Callable[..., Tensor]:
        return lambda *a, **k: apply_op(registry, name, list(a), k)

    return {name: partial(h.meaning, op) for name, h in registry.helpers.items()}


_HELPER_SORTS: dict[int, tuple[Registry, dict[str, tuple[str, ...]]]] = {}


def helper_sorts(registry: Registry) -> dict[str, tuple[str, ...]]:
    """Argument sorts of the helper constructors rule files declare (`DECLS`)."""
    hit = _HELPER_SORTS.get(id(registry))
    if hit is not None and hit[0] is registry:
        return hit[1]
    out: dict[str, tuple[str, ...]] = {}
    for d in registry.decls:
        for x in parse_cached(d):
            # (constructor NAME (SORT...) T ...): a helper over tensors
            if head(x) == "constructor" and len(x) >= 4 and isinstance(x[2], tuple) and x[3] == Sym("T") \
                    and all(isinstance(s, Sym) for s in x[2]):
                out[x[1].name] = tuple(s.name for s in x[2])
    _HELPER_SORTS[id(registry)] = (registry, out)
    return out


def helper_args(sorts: tuple[str, ...], tensors: list[Any], attrs: tuple[Any, ...]) -> list[Any]:
    """A helper term's arguments in declaration order: tensors where the sort is T."""
    ts, rest = iter(tensors), iter(attrs)
    return [next(ts) if s == "T" else next(rest) for s in sorts]


def apply_op(registry: Registry, name: str, tensors: list[Any], attrs: Mapping[str, Any]) -> Tensor:
    op = registry.ops[name]
    if op.ref is None:
        raise EvalError(f"op {name!r} has no torch reference")
    return canon(op.ref(*tensors, **dict(attrs)))


# ---------------------------------------------------------------------------------------
# Graphs


class Arith:
    """How the interpreter holds floating values and reduces them across ranks. This base is
    exact (float64 values, a collective's sum taken at once); a subclass that rounds every
    stored value emulates a low-precision run with the same interpreter."""

    def store(self, value: Tensor, dtype: str) -> Tensor:
        """A tensor the program holds (an input, an op's or a collective's result), declared
        `dtype` in the graph: here unchanged."""
        return value

    def reduce(self, xs: list[Tensor], op: str, dtype: str) -> Tensor:
        """What a reducing collective (`reduce_op` op, result declared `dtype`) makes of its
        members' values, in group order."""
        return _reduce(xs, op)


EXACT = Arith()


def eval_graph(graph: Graph, registry: Registry, inputs: Mapping[str, Tensor],
               arith: Arith = EXACT) -> dict[str, Tensor]:
    """Every tensor of a single-device graph (user-level or core): name -> value."""
    env: dict[str, Tensor] = {}
    for i in graph.inputs:
        if i.name not in inputs:
            raise EvalError(f"no value for input {i.name!r}")
        env[i.name] = arith.store(canon(inputs[i.name], i.type.dtype), i.type.dtype)
    for n in graph.nodes:
        if registry.ops[n.op].kind == "collective":
            raise EvalError(f"node {n.name!r}: a collective ({n.op}) needs eval_ranks")
        env[n.name] = arith.store(_eval_node(n, env, registry), n.type.dtype)
    return env


def _node_attrs(n: Any, env: Mapping[str, Tensor], registry: Registry) -> dict[str, Any]:
    op = registry.ops[n.op]
    ins = [TensorType(tuple(env[a].shape)) for a in n.tensor_args()]
    return normalize_attrs(op, n.attrs, ins)


def _eval_node(n: Any, env: Mapping[str, Tensor], registry: Registry) -> Tensor:
    op = registry.ops[n.op]
    args = [env[a] if isinstance(a, str) else a for a in n.args]
    if op.kind == "identity":
        return canon(args[0], n.type.dtype)
    attrs = _node_attrs(n, env, registry)
    try:
        out = op.ref(*args, **attrs)  # type: ignore[misc]
    except Exception as e:  # noqa: BLE001 - reported with the node
        raise EvalError(f"node {n.name!r} ({n.op}): {e}") from e
    return canon(out, n.type.dtype)


def run_order(graphs: Mapping[int, Graph], registry: Registry) -> schedule.Schedule:
    """The order the ranks' communication ops fire in (refine.ops.schedule), or an
    EvalError: a program that cannot be matched or deadlocks cannot be run."""
    try:
        sched = schedule.simulate(graphs, registry)
    except schedule.ScheduleError as e:
        raise EvalError(str(e)) from None
    if sched.stuck:
        raise EvalError(f"deadlock: {sched}")
    return sched


def eval_ranks(graphs: Mapping[int, Graph], registry: Registry,
               inputs: Mapping[int, Mapping[str, Tensor]], arith: Arith = EXACT,
               override: Mapping[tuple[int, str], Tensor] | None = None) -> dict[int, dict[str, Tensor]]:
    """Every tensor of every rank, collectives simulated across ranks in an order the ranks'
    program order allows (refine.ops.schedule): a collective or a recv reads its partners'
    tensors only once each partner has reached the matching op. A program whose order
    deadlocks is an EvalError naming where each rank waits. `override`: values (rank, node)
    takes instead of what its op computes (a counterfactual run)."""
    override = override or {}
    env: dict[int, dict[str, Tensor]] = {}
    for r, g in graphs.items():
        env[r] = {}
        for i in g.inputs:
            if i.name not in inputs.get(r, {}):
                raise EvalError(f"rank {r}: no value for input {i.name!r}")
            env[r][i.name] = arith.store(canon(inputs[r][i.name], i.type.dtype), i.type.dtype)
    sched = run_order(graphs, registry)
    pos = {r: 0 for r in graphs}

    def run_to(r: int, index: int) -> None:
        """Rank r's compute nodes before node `index` (its communication ops are set when
        they fire)."""
        g = graphs[r]
        while pos[r] < index:
            n = g.nodes[pos[r]]
            if registry.ops[n.op].kind != "collective":
                missing = next((a for a in n.tensor_args() if a not in env[r]), None)
                if missing is not None:
                    raise EvalError(f"rank {r}: node {n.name!r} reads {missing!r} before the op making it completes")
                hit = override.get((r, n.name))
                env[r][n.name] = arith.store(_eval_node(n, env[r], registry), n.type.dtype) if hit is None else hit
            pos[r] += 1

    for event in sched.order:
        for c in event:
            run_to(c.rank, c.index)
        _fire(event, env, registry, arith)
        for c in event:
            hit = override.get((c.rank, c.node.name))
            if hit is not None:
                env[c.rank][c.node.name] = hit
    for r, g in graphs.items():
        run_to(r, len(g.nodes))
    return env


def _fire(event: list[schedule.Comm], env: dict[int, dict[str, Tensor]], registry: Registry,
          arith: Arith = EXACT) -> None:
    """Every member's output of one matched collective, or of a send and its recv."""
    def value(c: schedule.Comm) -> Tensor:
        a = c.node.tensor_args()[0]
        if a not in env[c.rank]:
            raise EvalError(f"rank {c.rank}: {c.node.name!r} reads {a!r} before the op making it completes")
        return env[c.rank][a]

    if event[0].node.op in ("send", "recv"):
        by_op = {c.node.op: c for c in event}
        if set(by_op) != {"send", "recv"}:
            raise EvalError(f"{' and '.join(c.describe() for c in event)} are not a send and its recv")
        send, recv = by_op["send"], by_op["recv"]
        x = value(send)
        env[send.rank][send.node.name] = x
        env[recv.rank][recv.node.name] = arith.store(canon(x.clone(), recv.node.type.dtype), recv.node.type.dtype)
        return
    by_rank = {c.rank: c for c in event}
    group = list(event[0].members)
    first = by_rank[group[0]].node
    for c in event:
        if c.node.op != first.op:
            raise EvalError(f"rank {c.rank}: {c.describe()} is matched with {first.op} {first.name!r}")
    xs = [value(by_rank[q]) for q in group]
    for i, q in enumerate(group):
        n = by_rank[q].node
        attrs = _node_attrs(n, env[q], registry)
        out = simulate(n.op, xs, i, attrs, partial(_reduce_with, arith, n.type.dtype))
        env[q][n.name] = arith.store(canon(out, n.type.dtype), n.type.dtype)


def _reduce_with(arith: Arith, dtype: str, xs: list[Tensor], op: str) -> Tensor:
    return arith.reduce(xs, op, dtype)


def _reduce(xs: list[Tensor], op: str) -> Tensor:
    if op == "max":
        return torch.stack(xs).amax(0)
    s = torch.stack(xs).sum(0)
    return s / len(xs) if op == "avg" else s


def simulate(op: str, xs: list[Tensor], i: int, attrs: Mapping[str, Any],
             reduce: Callable[[list[Tensor], str], Tensor] = _reduce) -> Tensor:
    """Member i's output of a collective over the members' inputs xs (group order); `reduce`
    combines them for a reducing collective."""
    n = len(xs)
    if op == "all_reduce":
        return reduce(xs, attrs.get("reduce_op") or "sum")
    if op == "all_gather":
        return torch.cat(xs, attrs["dim"])
    if op == "reduce_scatter":
        d = attrs["dim"]
        c = xs[0].shape[d] // n
        return reduce(xs, attrs.get("reduce_op") or "sum").narrow(d, i * c, c)
    if op == "all_to_all":
        sd, cd = attrs["split_dim"], attrs["concat_dim"]
        c = xs[0].shape[sd] // n
        return torch.cat([x.narrow(sd, i * c, c) for x in xs], cd)
    if op == "broadcast":
        return xs[list(attrs["group"]).index(attrs["src"])].clone()
    raise EvalError(f"unknown collective {op!r}")


# ---------------------------------------------------------------------------------------
# Terms


def eval_term(t: Term, registry: Registry, leaves: Mapping[str, Tensor] | Callable[[str], Tensor],
              cache: dict[Term, Tensor] | None = None, opaque: Mapping[str, Tensor] | None = None) -> Tensor:
    """A relation term's value; `leaves` gives each `D`/`Out` leaf's value by name, and
    `opaque` each opaque leaf's (a sequential tensor's) value."""
    get = leaves if callable(leaves) else leaves.__getitem__
    helpers = helper_semantics(registry)
    hsorts = helper_sorts(registry)
    memo: dict[Term, Tensor] = {} if cache is None else cache

    def go(t: Term) -> Tensor:
        if t in memo:
            return memo[t]
        if t.op in ("D", "Out"):
            v = canon(get(t.attrs[0]))
        elif t.op == OPAQUE:
            if opaque is None or t.attrs[0] not in opaque:
                raise EvalError(f"no value for the sequential tensor {t.attrs[0]!r}")
            v = canon(opaque[t.attrs[0]])
        elif t.op in helpers and t.op in hsorts:
            args = helper_args(hsorts[t.op], [go(a) for a in t.args], t.attrs)
            v = canon(helpers[t.op](*args))
        else:
            op = registry.ops.get(t.op)
            if op is None:
                raise EvalError(f"no meaning for {t.op!r}")
            args = [go(a) for a in t.args]
            attrs = {name: v for (name, _), v in zip(op.attrs, t.attrs, strict=False)}
            v = apply_op(registry, t.op, args, attrs)
        memo[t] = v
        return v

    try:
        return go(t)
    finally:
        # `go` refers to itself, a cycle only the collector frees: the values it holds (its
        # memo, the leaves) would outlive the call, gigabytes on a vocab-sized layout
        go = None  # type: ignore[assignment]  # noqa: F841


# ---------------------------------------------------------------------------------------
# Random inputs consistent with the input relations


def _random(typ: TensorType, gen: torch.Generator, bound: int) -> Tensor:
    shape = tuple(typ.shape)
    dt = torch_dtype(typ.dtype)
    if dt == torch.bool:
        return torch.rand(shape, generator=gen, dtype=torch.float64) < 0.5
    if dt == torch.int64:
        return torch.randint(0, max(bound, 1), shape, generator=gen, dtype=torch.int64)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def int_bounds(seq: Graph, registry: Registry) -> dict[str, int]:
    """For each sequential input read as embedding ids: the table's row count."""
    return _embedding_rows(lower(seq, registry)[0])


def _embedding_rows(core: Graph) -> dict[str, int]:
    idx = core.index()
    out: dict[str, int] = {}

    def sources(ref: str) -> set[str]:
        """The inputs ref moves the elements of (a walk: views chain as deep as the graph)."""
        out: set[str] = set()
        seen, todo = {ref}, [ref]
        while todo:
            node = idx.get(x := todo.pop())
            if node is None or not hasattr(node, "op"):
                out.add(x)
            # moved, not combined: a sum of ids (a flat index i * n + j) is bounded by no one table
            elif node.op in ("view", "slice", "transpose", "expand", "cat"):  # type: ignore[union-attr]
                for a in node.tensor_args():  # type: ignore[union-attr]
                    if a not in seen:
                        seen.add(a)
                        todo.append(a)
        return out

    for n in core.nodes:
        if n.op == "embedding":
            w, ids = n.tensor_args()
            rows = core.type_of(w).shape[0]
            for s in sources(ids):
                out[s] = min(out.get(s, rows), rows)
    return out


def split_placed(x: Tensor, placements: tuple[Placement, ...], mesh: Mesh, gen: torch.Generator) -> dict[int, Tensor]:
    """Rank pieces of x: along each mesh axis in order, replicate, chunk (torch.chunk) or
    split into random parts that reduce to it."""
    out: dict[int, Tensor] = {}

    def go(axis: int, coords: tuple[int, ...], piece: Tensor) -> None:
        if axis == len(mesh.axes):
            out[mesh.rank(coords)] = piece
            return
        n = mesh.axes[axis][1]
        p = placements[axis]
        if p.kind == "replicate":
            parts = [piece.clone() for _ in range(n)]
        elif p.kind == "shard":
            parts = list(torch.chunk(piece, n, p.dim))
            if len(parts) != n:
                raise EvalError(f"cannot chunk a dim of size {piece.shape[p.dim]} into {n} pieces")
        elif p.reduce == "max":
            if piece.dtype == torch.bool:
                raise EvalError("Partial(max) of a bool tensor")
            noise = torch.rand((n, *piece.shape), generator=gen, dtype=torch.float64) + 0.5
            keep = torch.randint(0, n, tuple(piece.shape), generator=gen)
            parts = [torch.where(keep == c, piece, (piece - noise[c]).to(piece.dtype)) for c in range(n)]
        else:
            if piece.dtype == torch.int64:
                rnd = [torch.randint(-3, 4, tuple(piece.shape), generator=gen) for _ in range(n - 1)]
            else:
                rnd = [torch.randn(tuple(piece.shape), generator=gen, dtype=torch.float64) for _ in range(n - 1)]
            last = piece - sum(rnd, torch.zeros_like(piece))
            parts = [*rnd, last]
        for c, part in enumerate(parts):
            go(axis + 1, coords + (c,), part)

    go(0, (), x)
    go = None  # type: ignore[assignment]  # noqa: F841 - the cycle through `go` would keep `out` alive (eval_term)
    return out


def _leaf_list(t: Term) -> list[str]:
    """A term's leaves in order (structurally parallel terms pair up leaf by leaf)."""
    return [t.attrs[0]] if t.op in LEAF_OPS else [x for a in t.args for x in _leaf_list(a)]


def _rank_leaf(name: str) -> tuple[str, int]:
    base, _, r = name.rpartition("@")
    return base, int(r)


def _assign(t: Term, v: Tensor, registry: Registry, value: Callable[[str], Tensor],
            rank_vals: dict[int, dict[str, Tensor]]) -> None:
    """Make the rank inputs `t` reads hold `v` where `t` reads them (a slice writes its
    region only)."""
    if t.op == "D":
        base, r = _rank_leaf(t.attrs[0])
        rank_vals[r][base] = v.to(rank_vals[r][base].dtype).clone()
    elif t.op == "slice":
        dim, start, end = (int(a) for a in t.attrs)
        whole = eval_term(t.args[0], registry, value).clone()
        whole.narrow(dim, start, end - start).copy_(v)
        _assign(t.args[0], whole, registry, value, rank_vals)
    elif t.op == "cat":
        a = eval_term(t.args[0], registry, value)
        dim = int(t.attrs[0])
        _assign(t.args[0], v.narrow(dim, 0, a.shape[dim]), registry, value, rank_vals)
        _assign(t.args[1], v.narrow(dim, a.shape[dim], v.shape[dim] - a.shape[dim]), registry, value, rank_vals)
    elif t.op == "transpose":
        _assign(t.args[0], v.transpose(int(t.attrs[0]), int(t.attrs[1])), registry, value, rank_vals)
    elif t.op == "view":
        _assign(t.args[0], v.reshape(eval_term(t.args[0], registry, value).shape), registry, value, rank_vals)
    else:
        raise EvalError(f"cannot draw rank inputs making a replica's {t.op} equal to its layout")


def eval_elements(seq: Graph, dist: Dist) -> int:
    """Elements of every tensor both sides compute (the interpreter keeps them all)."""
    total = 0
    for g in (seq, *dist.ranks.values()):
        for x in (*g.inputs, *g.nodes):
            if all(isinstance(d, int) for d in x.type.shape):  # symbolic sizes: instantiated by the callers
                total += math.prod(x.type.shape)
    return total


def eval_budget() -> int:
    """Elements an evaluation may hold (float64: 8 bytes each), REFINE_EVAL_BUDGET or 1e9."""
    return int(float(os.environ.get("REFINE_EVAL_BUDGET", "1e9")))


def random_inputs(seq: Graph, dist: Dist, seed: int = 0, registry: Registry | None = None,
                  int_bound: int | None = None, specials: Mapping[str, Mix] | None = None
                  ) -> tuple[dict[str, Tensor], dict[int, dict[str, Tensor]]]:
    """Random sequential inputs and rank inputs that satisfy the dist's input relations.

    Integer inputs read as embedding ids are drawn below the table's row count (or
    `int_bound`, or 8), and never at or above a size the sequential program indexes with
    them (a gather over 6 classes: below 6). `specials` (sequential input -> values, `refine.ops.special`) are
    mixed into those inputs' values before they are split over the ranks (into a layout's
    rank leaves as they are drawn), so the draw stays consistent with the relations; the
    other values are the plain draw's of the same seed. Raises EvalError for a case too large to evaluate (`eval_budget`):
    the callers (localization's counterfactual edits, audits) then do without, where
    evaluating a gpt-sized graph would take tens of GB and be killed."""
    n = eval_elements(seq, dist)
    if n > eval_budget():
        raise EvalError(f"too large to evaluate: {n:.3g} tensor elements over both sides, above the budget of "
                        f"{eval_budget():.3g} (REFINE_EVAL_BUDGET)")
    registry = registry or load_registry()
    gen = torch.Generator().manual_seed(seed)
    mixing = torch.Generator().manual_seed(seed)  # apart: the plain values stay the same draw's
    specials = specials or {}
    core, _ = lower(seq, registry)
    bounds = _embedding_rows(core)
    ceilings = index_limits(core)  # a value at or above would fail the sequential program's lookup

    def bound_for(name: str) -> int:
        b = bounds.get(name)
        if b is None:
            b = int_bound if int_bound is not None else DEFAULT_INT_BOUND
        elif int_bound is not None:
            b = min(b, int_bound)
        return min(b, ceilings.get(name, b))

    seq_vals: dict[str, Tensor] = {}
    rank_vals: dict[int, dict[str, Tensor]] = {r: {} for r in dist.ranks}
    rank_types = {r: {i.name: i.type for i in g.inputs} for r, g in dist.ranks.items()}
    relations: list[Relation] = [r for r in dist.relations]
    covered = {r.source for r in relations}
    for inp in seq.inputs:
        if inp.name not in covered:  # read as replicated, as refine.relate.program does
            relations.append(Relation(inp.name, inp.name, tuple(Placement("replicate") for _ in dist.mesh.axes)))
    seq_types = {i.name: i.type for i in seq.inputs}
    # layouts first: their rank inputs are drawn freely and fix the sequential input
    for rel in sorted(relations, key=lambda r: r.layout is None):
        typ = seq_types[rel.source]
        if rel.layout is not None:
            def leaf_value(name: str, bound: int = bound_for(rel.source), source: str = rel.source) -> Tensor:
                base, r = _rank_leaf(name)
                if base not in rank_vals[r]:
                    x = _random(rank_types[r][base], gen, bound)
                    mix = specials.get(source)
                    rank_vals[r][base] = mix.apply(x, mixing) if mix and x.dtype == torch.int64 else x
                return rank_vals[r][base]
            eval_term(rel.layout, registry, leaf_value)  # draws the layout's leaves
            for rep in rel.replicas:  # the regions the layout reads, copied where the replica reads them
                for x in sorted(rep.leaves()):
                    leaf_value(x)
                leaves, facts = join_replicas(rel.layout, rep, lambda t: tuple(eval_term(t, registry, leaf_value).shape))
                for a, b in leaves:
                    (base_a, ra), (base_b, rb) = _rank_leaf(a), _rank_leaf(b)
                    rank_vals[rb][base_b] = rank_vals[ra][base_a].clone()
                for a, b in facts:
                    _assign(b, eval_term(a, registry, leaf_value), registry, leaf_value, rank_vals)
            seq_vals[rel.source] = canon(eval_term(rel.layout, registry, leaf_value), typ.dtype)
            for rep in rel.replicas:  # one region written twice with different values: no consistent draw
                if not torch.equal(canon(eval_term(rep, registry, leaf_value), typ.dtype), seq_vals[rel.source]):
                    raise EvalError(f"the replicas of the layout for {rel.source!r} overlap: no inputs satisfy them all")
            continue
        x = _random(typ, gen, bound_for(rel.source))
        if (mix := specials.get(rel.source)) and x.dtype == torch.int64:
            x = mix.apply(x, mixing)
        seq_vals[rel.source] = x
        assert rel.placements is not None
        local = rel.local or rel.source
        for r, piece in split_placed(x, rel.placements, dist.mesh, gen).items():
            want = rank_types[r].get(local)
            if want is None:
                raise EvalError(f"rank {r} has no input {local!r} for sequential input {rel.source!r}")
            if tuple(piece.shape) != tuple(want.shape):
                raise EvalError(f"rank {r}: the piece of {rel.source!r} has shape {list(piece.shape)}, "
                                f"input {local!r} is declared {list(want.shape)}")
            rank_vals[r][local] = canon(piece, want.dtype)
    for d in dist.defines:  # defined rank inputs: from the sequential values just drawn
        want = rank_types[d.rank][d.input]
        rank_vals[d.rank][d.input] = canon(eval_term(d.term, registry, seq_vals), want.dtype)
    for r, types in rank_types.items():  # rank-only inputs
        for name, typ in types.items():
            if name not in rank_vals[r]:
                rank_vals[r][name] = _random(typ, gen, int_bound if int_bound is not None else DEFAULT_INT_BOUND)
    return seq_vals, rank_vals


def define_conflict(seq: Graph, dist: Dist, registry: Registry, seeds: tuple[int, ...] = (0,)
                    ) -> tuple[Define, str] | None:
    """A define that contradicts the relations, and how: the rank inputs it sets, in full,
    from random sequential inputs, must leave every relation's value (every replica of
    it) what it was drawn to be. None when every define agrees."""
    # checked a group at a time: the defines and relations that share an input (one
    # layer's fused weight), so memory is one group's, not every layer's weights at once
    # (aws_llama TP6 eight layers: 1e9 elements, 8 GB, in one draw). A group that is an
    # earlier one up to the names of its inputs (the next layer's weight) is that group's
    # check again: whether a define contradicts a relation depends on the terms and the
    # shapes alone (TP6 eight layers: 40 groups, 40 s; 5 kinds)
    checked: set[str] = set()
    for defines, rels in _define_groups(dist):
        key = _group_key(seq, dist, defines, rels)
        if key in checked:
            continue
        part = Dist(dist.mesh, dist.ranks, rels, [], defines)
        bad = _define_conflict(seq, part, registry, seeds)
        if bad is not None:
            return bad
        checked.add(key)
    return None


def _group_key(seq: Graph, dist: Dist, defines: list[Define], rels: list[Relation]) -> str:
    """The group's defines and relations with the inputs they name numbered by first
    appearance (a sequential input and the rank inputs of the same base name alike), with
    each numbered input's types: equal keys, equal groups up to renaming."""
    names: dict[str, str] = {}
    types: list[str] = []
    seq_types = {i.name: i.type for i in seq.inputs}
    rank_types = {r: {i.name: i.type for i in g.inputs} for r, g in dist.ranks.items()}

    def num(base: str) -> str:
        if base not in names:
            names[base] = f"n{len(names)}"
            ranks = [(r, str(ts[base])) for r, ts in sorted(rank_types.items()) if base in ts]
            types.append(f"{names[base]}: {seq_types.get(base)} {ranks}")
        return names[base]

    def ren(t: Term) -> str:
        if t.op == "D":
            base, at, r = t.attrs[0].rpartition("@")
            return f"D({num(base)}@{r})" if at else f"D({num(t.attrs[0])})"
        return f"{t.op}{t.attrs!r}({', '.join(ren(a) for a in t.args)})"

    parts = [f"define {d.rank} {num(d.input)} = {ren(d.term)}" for d in defines]
    for rel in rels:
        layouts = " | ".join(ren(t) for t in (rel.layout, *rel.replicas)) if rel.layout is not None else ""
        parts.append(f"relation {num(rel.source)} {num(rel.local or rel.source)} {rel.placements} {layouts}")
    return "\n".join(parts + types)


def _define_groups(dist: Dist) -> list[tuple[list[Define], list[Relation]]]:
    """The defines with the relations that read what they define or what they read, joined
    where they share a relation (connected components)."""
    def leaves(rel: Relation) -> set[str]:
        if rel.layout is not None:
            return set().union(*(t.leaves() for t in (rel.layout, *rel.replicas)))
        return {tensor_name(r, rel.local or rel.source) for r in dist.ranks}

    parent = list(range(len(dist.defines)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    touched: dict[int, list[int]] = {}  # relation -> defines it touches
    for k, rel in enumerate(dist.relations):
        ls = leaves(rel)
        for i, d in enumerate(dist.defines):
            if rel.source in d.term.leaves() or tensor_name(d.rank, d.input) in ls:
                touched.setdefault(k, []).append(i)
        ds = touched.get(k, [])
        for i in ds[1:]:
            parent[find(i)] = find(ds[0])
    groups: dict[int, tuple[list[Define], list[Relation]]] = {}
    for i, d in enumerate(dist.defines):
        groups.setdefault(find(i), ([], []))[0].append(d)
    for k, ds in touched.items():
        groups[find(ds[0])][1].append(dist.relations[k])
    return list(groups.values())


def _define_conflict(seq: Graph, dist: Dist, registry: Registry, seeds: tuple[int, ...]
                     ) -> tuple[Define, str] | None:
    by_leaf = {tensor_name(d.rank, d.input): d for d in dist.defines}
    # inputs no relation covers and no rank holds under their name (a KV cache the checked
    # output never reads) need no values here
    # only what the defines touch is drawn: the sequential inputs they read, the relations
    # that read a defined rank input, and those relations' inputs (a vocab-sized weight
    # no define touches would cost gigabytes here)
    read = {x for d in dist.defines for x in d.term.leaves()}
    rels = []
    for rel in dist.relations:
        local = rel.local or rel.source
        leaves = set().union(*(t.leaves() for t in (rel.layout, *rel.replicas))) if rel.layout is not None else \
            {tensor_name(r, local) for r in dist.ranks}
        if rel.source in read or leaves & set(by_leaf):
            rels.append(rel)
    names = {r.source for r in rels} | read
    rank_in: dict[int, set[str]] = {r: {d.input for d in dist.defines if d.rank == r} for r in dist.ranks}
    for rel in rels:
        if rel.layout is not None:
            for x in set().union(*(t.leaves() for t in (rel.layout, *rel.replicas))):
                base, _, r = x.rpartition("@")
                rank_in[int(r)].add(base)
        else:
            for r in dist.ranks:
                rank_in[r].add(rel.local or rel.source)
    seq = Graph([i for i in seq.inputs if i.name in names], [], [], seq.name, dict(seq.symbols))
    ranks = {r: Graph([i for i in g.inputs if i.name in rank_in[r]], [], [], g.name, dict(g.symbols))
             for r, g in dist.ranks.items()}
    dist = Dist(dist.mesh, ranks, rels, [], list(dist.defines))
    for seed in seeds:
        seq_vals, rank_vals = random_inputs(seq, dist, seed, registry)
        flat = {tensor_name(r, k): v for r, vals in rank_vals.items() for k, v in vals.items()}
        for rel in dist.relations:
            if rel.layout is not None:
                terms = [rel.layout, *rel.replicas]
            else:
                assert rel.placements is not None
                local = rel.local or rel.source
                terms = placed_terms(lambda r, local=local: tensor_name(r, local), rel.placements, dist.mesh)
            for t in terms:
                hit = sorted(x for x in t.leaves() if x in by_leaf)
                if not hit:
                    continue
                got, want = eval_term(t, registry, flat), canon(seq_vals[rel.source])
                # layouts and defines mostly move values (cat, slice, zeros): equal bits, the
                # cheap test first (a vocab-sized weight takes seconds to compare closely)
                if tuple(got.shape) != tuple(want.shape) or not (torch.equal(got, want) or close(got, want)):
                    return by_leaf[hit[0]], (f"the relation for {rel.source!r} ({rel.where or 'implicit'}) reads "
                                             f"{', '.join(hit)} where the define gives other values")
    return None


# ---------------------------------------------------------------------------------------
# Symbolic sizes at a valuation


def valuation(symbols: Mapping[str, Any], seed: int = 0, spread: int = 3) -> dict[str, int]:
    """Random values the symbols' declarations allow: the smallest allowed value above 1
    (so no symbol is mistaken for a broadcast 1) plus a few steps of its multiple."""
    rng = random.Random(seed)
    out = {}
    for name in sorted(symbols):
        a = sizes.atoms_of(symbols[name])[name]
        lo = max(a.min, 2)
        base = -(-lo // a.multiple) * a.multiple
        out[name] = base + a.multiple * rng.randint(0, spread)
    return out


def instantiate_value(v: Any, values: Mapping[str, int]) -> Any:
    if isinstance(v, sizes.Sym):
        return sizes.substitute(v, dict(values))
    if isinstance(v, (list, tuple)):
        return type(v)(instantiate_value(x, values) for x in v)
    if isinstance(v, dict):
        return {k: instantiate_value(x, values) for k, x in v.items()}
    return v


def instantiate_term(t: Term, values: Mapping[str, int]) -> Term:
    return Term(t.op, tuple(instantiate_term(a, values) for a in t.args), instantiate_value(t.attrs, values))


def instantiate_graph(g: Graph, values: Mapping[str, int]) -> Graph:
    def typ(t: TensorType) -> TensorType:
        return TensorType(instantiate_value(t.shape, values), t.dtype)

    return Graph([replace(i, type=typ(i.type)) for i in g.inputs],
                 [replace(n, attrs=instantiate_value(n.attrs, values), type=typ(n.type)) for n in g.nodes],
                 list(g.outputs), g.name, {})


def instantiate(seq: Graph, dist: Dist, values: Mapping[str, int]) -> tuple[Graph, Dist]:
    """Both sides with every symbolic size replaced by its value."""
    rels = [replace(r, layout=instantiate_term(r.layout, values)) if r.layout is not None else r
            for r in dist.relations]
    ranks = {r: instantiate_graph(g, values) for r, g in dist.ranks.items()}
    return instantiate_graph(seq, values), Dist(dist.mesh, ranks, rels, list(dist.expectations), list(dist.defines))
