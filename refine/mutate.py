"""Mutation testing: small, realistic distributed-training bugs injected into a correct case.

Each operator edits the rank graphs of a distributed document (the JSON of graph format v1)
at one node, on one rank or on every rank, the way a silent bug would: a collective dropped
or with the wrong reduction or dim, the operands of a non-commutative op swapped, a slice at
a neighbouring shard's offset, a tensor scaled by a constant (a loss divided twice), a
replicated tensor added before a sum (a bias or residual added on every rank), one rank
using another rank's shard (a broadcast from the wrong rank), an input replaced by another
of the same shape. A mutant that does not load (shapes, collective matching) is skipped.

`run` checks every mutant and evaluates it (`refine.evaluate`, both sides in torch with
simulated collectives on random consistent inputs) and sorts it:

- caught: DOES NOT REFINE and numerically wrong;
- neutral: REFINES and numerically equal;
- incomplete: DOES NOT REFINE but numerically equal (the prover missed an equality);
- UNSOUND: REFINES while numerically wrong, the one outcome that must never happen.

Deterministic given the seed. From the command line: `refine mutate SEQ DIST --count N --seed S`.
"""

from __future__ import annotations

import copy
import json
import math
import random
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refine import dims
from refine.evaluate import (
    EvalError,
    Tensor,
    close,
    differential,
    eval_graph,
    eval_ranks,
    eval_term,
    expected_terms,
    max_err,
    random_inputs,
)
from refine.format import InputError, load_dist, read_json
from refine.ir import Dist, Graph, TensorType, case_symbols
from refine.normalize import normalize_attrs
from refine.opset import Registry

Doc = dict[str, Any]
REDUCING = ("all_reduce", "reduce_scatter")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
NONCOMMUTATIVE = ("sub", "div", "matmul", "mm", "bmm", "hlo_dot")
SHAPE_OPS = ("reshape", "view")
DRAWS = 4  # sets of random inputs a mutant must be right on to count as numerically equal


@dataclass
class Mutant:
    operator: str
    node: str  # the rank node the bug is at
    scope: str  # "rank R" or "all ranks"
    detail: str
    doc: Doc = field(repr=False)
    ranks: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        if self.operator == "none":
            return "none: the case as given"
        return f"{self.operator} {self.node} ({self.scope}): {self.detail}"


@dataclass
class Outcome:
    mutant: Mutant
    verdict: str  # REFINES | DOES NOT REFINE | exit 2
    wrong: bool | None  # numerically wrong on some output; None: not evaluated
    culprit: str = ""
    error: float = math.nan
    dead: bool = False  # the mutated site reaches no rank output: it cannot change a value

    @property
    def kind(self) -> str:
        if self.wrong is None and self.dead:
            return "neutral" if self.verdict == "REFINES" else "incomplete"
        if self.wrong is None:
            return "unjudged"
        if self.verdict == "REFINES":
            return "UNSOUND" if self.wrong else "neutral"
        return "caught" if self.wrong else "incomplete"


# ---------------------------------------------------------------------------------------
# editing a rank graph (the JSON object)


def _graphs(doc: Doc) -> dict[int, Doc]:
    return {r["rank"]: r["graph"] for r in doc["ranks"]}


def _position(g: Doc, name: str) -> int:
    for i, n in enumerate(g["nodes"]):
        if n["name"] == name:
            return i
    raise KeyError(name)


def _node(g: Doc, name: str) -> Doc | None:
    return next((n for n in g["nodes"] if n["name"] == name), None)


def _fresh(g: Doc, base: str) -> str:
    taken = {x["name"] for x in g["inputs"]} | {n["name"] for n in g["nodes"]}
    k = 0
    while f"{base}_m{k}" in taken:
        k += 1
    return f"{base}_m{k}"


def _reroute(g: Doc, old: str, new: str, after: int) -> None:
    """Every use of `old` by nodes from position `after` on, and by outputs, now reads `new`."""
    for n in g["nodes"][after:]:
        if n["name"] == new:
            continue
        n["args"] = [new if a == old else a for a in n["args"]]
    for o in g["outputs"]:
        if o.get("ref", o["name"]) == old:
            o["ref"] = new


def _jsonable(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return str(v) if isinstance(v, dims.Sym) else v


def _new_node(registry: Registry, name: str, op: str, args: list[Any], attrs: dict[str, Any],
              types: dict[str, TensorType]) -> Doc:
    spec = registry.ops[op]
    ins = [types[a] for a in args if isinstance(a, str)]
    typ = spec.shape(ins, normalize_attrs(spec, attrs, ins))
    node = {"name": name, "op": op, "args": args, "shape": _jsonable(list(typ.shape)), "dtype": typ.dtype,
            "source": "refine.mutate"}
    if attrs:
        node["attrs"] = attrs
    types[name] = typ
    return node


def _types(g: Graph) -> dict[str, TensorType]:
    return {name: x.type for name, x in g.index().items()}


def _floating(t: TensorType) -> bool:
    return not (t.dtype == "bool" or t.dtype.startswith(("int", "uint")))


# ---------------------------------------------------------------------------------------
# operators: each takes (doc, rank graph IR, rank, node name, rng) and edits the doc's rank
# graph in place, returning a description, or None when it does not apply there

Edit = Callable[[Registry, Doc, Dist, int, str, random.Random], str | None]


def _drop_collective(reg: Registry, doc: Doc, dist: Dist, r: int, name: str, rng: random.Random) -> str | None:
    """The collective's result is not used: its input (all_reduce), the rank's slice of its
    input (reduce_scatter), or copies of its input (all_gather) take its place."""
    g, ir = _graphs(doc)[r], dist.ranks[r]
    n = _node(g, name)
    if n is None or n["op"] not in COLLECTIVES:
        return None
    x = n["args"][0]
    at = _position(g, name) + 1
    if n["op"] == "all_reduce":
        _reroute(g, name, x, at)
        return f"{name} dropped, its input {x} used"
    group = list(n["attrs"]["group"])
    types = _types(ir)
    d = n["attrs"]["dim"]
    if n["op"] == "all_gather":
        new = _new_node(reg, _fresh(g, name), "concat", [x] * len(group), {"dim": d}, types)
        what = "concat of copies of its input"
    else:
        c = types[x].shape[d] // len(group)
        i = group.index(r)
        new = _new_node(reg, _fresh(g, name), "slice", [x], {"dim": d, "start": i * c, "end": (i + 1) * c}, types)
        what = "the rank's slice of its unreduced input"
    g["nodes"].insert(at, new)
    _reroute(g, name, new["name"], at + 1)
    return f"{name} dropped, {what}"


def _wrong_reduce(reg: Registry, doc: Doc, dist: Dist, r: int, name: str, rng: random.Random) -> str | None:
    """A reduction with the wrong op: avg for sum (a mean taken twice) or sum for avg."""
    n = _node(_graphs(doc)[r], name)
    if n is None or n["op"] not in REDUCING:
        return None
    old = n["attrs"].get("reduce_op") or "sum"
    new = {"sum": "avg", "avg": "sum"}.get(old)
    if new is None:
        return None
    n["attrs"]["reduce_op"] = new
    return f"{name} reduces with {new} instead of {old}"


def _wrong_dim(reg: Registry, doc: Doc, dist: Dist, r: int, name: str, rng: random.Random) -> str | None:
    """An all_gather or reduce_scatter along another dim, its result viewed as the right
    shape (a gather into a flat buffer, then a view)."""
    g, ir = _graphs(doc)[r], dist.ranks[r]
    n = _node(g, name)
    if n is None or n["op"] not in ("all_gather", "reduce_scatter"):
        return None
    nd = ir.type_of(n["args"][0]).ndim
    old = n["attrs"]["dim"] % nd
    others = [d for d in range(nd) if d != old]
    if not others:
        return None
    types = _types(ir)
    d = rng.choice(others)
    changed = _new_node(reg, name, n["op"], n["args"], {**n["attrs"], "dim": d}, types)
    want = ir.type_of(name)
    n.update(attrs=changed["attrs"], shape=changed["shape"])
    if types[name].shape != want.shape:
        at = _position(g, name) + 1
        view = _new_node(reg, _fresh(g, name), "reshape", [name], {"shape": _jsonable(list(want.shape))}, types)
        g["nodes"].insert(at, view)
        _reroute(g, name, view["name"], at + 1)
    return f"{name} along dim {d} instead of {old}, viewed as {list(want.shape)}"


def _wrong_order(reg: Registry, doc: Doc, dist: Dist, r: int, name: str, rng: random.Random) -> str | None:
    """An all_gather or reduce_scatter over its group in another order (shards out of place)."""
    n = _node(_graphs(doc)[r], name)
    if n is None or n["op"] not in ("all_gather", "reduce_scatter") or len(n["attrs"]["group"]) < 2:
        return None
    group = list(n["attrs"]["group"])
    n["attrs"]["group"] = group[1:] + group[:1]
    return f"{name} over group {n['attrs']['group']} instead of {group}"


def _swap_operands(reg: Registry, doc: Doc, dist: Dist, r: int, name: str, rng: random.Random) -> str | None:
    n = _node(_graphs(doc)[r], name)
    if n is None or n["op"] not in NONCOMMUTATIVE or len(n["args"]) != 2 or n["args"][0] == n["args"][1]:
        return None
    n["args"] = [n["args"][1], n["args"][0]]
    return f"{name} ({n['op']}) with its operands swapped"


def _slice_offset(reg: Registry, doc: Doc, dist: Dist, r: int, name: str, rng: random.Random) -> str | None:
    """A slice at a neighbouring shard's offset (a wrong rank offset), else shifted by one."""
    n = _node(_graphs(doc)[r], name)
    if n is None or n["op"] != "slice":
        return None
    a = n["attrs"]
    s, e = a.get("start", 0), a.get("end")
    size = dist.ranks[r].type_of(n["args"][0]).shape[a["dim"]]
    if not all(isinstance(v, int) for v in (s, e, size)):
        return None
    e = min(e, size)
    s = s + size if s < 0 else s
    e = e + size if e < 0 else e
    width = e - s
    shifts = [d for d in (width, -width, 1, -1) if d and 0 <= s + d and e + d <= size]
    if not shifts or width <= 0:
        return None
    d = shifts[0] if rng.random() < 0.7 else rng.choice(shifts)
    a["start"], a["end"] = s + d, e + d
    return f"{name} slices [{s + d}, {e + d}) instead of [{s}, {e})"


def _scale(reg: Registry, doc: Doc, dist: Dist, r: int, name: str, rng: random.Random) -> str | None:
    """The tensor multiplied by a constant (a loss or gradient divided or multiplied twice)."""
    g, ir = _graphs(doc)[r], dist.ranks[r]
    if _node(g, name) is None or not _floating(ir.type_of(name)):
        return None
    c = rng.choice([0.5, 2.0])
    at = _position(g, name) + 1
    new = _new_node(reg, _fresh(g, name), "mul", [name, c], {}, _types(ir))
    g["nodes"].insert(at, new)
    _reroute(g, name, new["name"], at + 1)
    return f"{name} scaled by {c}"


def _add_before_reduce(reg: Registry, doc: Doc, dist: Dist, r: int, name: str, rng: random.Random) -> str | None:
    """`add(u, v)` where u is a sum all_reduce or reduce_scatter (through reshapes): v is
    added before the sum instead, on this rank (on every rank: counted world-size times)."""
    g, ir = _graphs(doc)[r], dist.ranks[r]
    n = _node(g, name)
    if n is None or n["op"] != "add" or len(n["args"]) != 2 or not all(isinstance(a, str) for a in n["args"]):
        return None
    index = ir.index()
    for k in (0, 1):
        u, v = n["args"][k], n["args"][1 - k]
        red = u
        while getattr(index.get(red), "op", None) in SHAPE_OPS:
            red = index[red].args[0]
        rn = index.get(red)
        if getattr(rn, "op", None) not in REDUCING or (rn.attrs.get("reduce_op") or "sum") != "sum":
            continue
        x = rn.args[0]
        types = _types(ir)
        at = _position(g, red)
        if v in {m["name"] for m in g["nodes"][at:]}:
            continue  # v is computed after the sum
        added = [_new_node(reg, _fresh(g, x), "add", [x, v], {}, types)]
        if types[added[0]["name"]].shape != types[x].shape:  # v does not broadcast to x: view it as x
            if red == u or types[v].shape != types[u].shape:
                continue
            view = _new_node(reg, _fresh(g, v), "reshape", [v], {"shape": _jsonable(list(types[x].shape))}, types)
            added = [view, _new_node(reg, added[0]["name"], "add", [x, view["name"]], {}, types)]
        if added[-1]["dtype"] != types[x].dtype:
            continue
        g["nodes"][at:at] = added
        _node(g, red)["args"] = [added[-1]["name"]]
        _reroute(g, name, u, _position(g, name) + 1)
        return f"{v} added before the sum {red} instead of after it"
    return None


def _wrong_shard(reg: Registry, doc: Doc, dist: Dist, r: int, name: str, rng: random.Random) -> str | None:
    """Rank r uses another rank's copy of input `name` (a broadcast from the wrong rank, the
    same collective on every rank so that collectives still match)."""
    if name not in {i.name for i in dist.ranks[r].inputs} or len(dist.ranks) < 2:
        return None
    ranks = sorted(dist.ranks)
    if not all(name in {i.name for i in dist.ranks[q].inputs} for q in ranks):
        return None
    if len({dist.ranks[q].type_of(name) for q in ranks}) != 1:
        return None
    src = rng.choice([q for q in ranks if q != r])
    new = ""
    for q, g in _graphs(doc).items():
        b = _new_node(reg, _fresh(g, name), "broadcast", [name], {"src": src, "group": ranks}, _types(dist.ranks[q]))
        g["nodes"].insert(0, b)
        if q == r:
            new = b["name"]
            _reroute(g, name, new, 1)
    return f"rank {r} uses rank {src}'s {name}"


def _swap_input(reg: Registry, doc: Doc, dist: Dist, r: int, name: str, rng: random.Random) -> str | None:
    """One use of an input reads another input of the same shape and dtype (wq for wk)."""
    g, ir = _graphs(doc)[r], dist.ranks[r]
    n = _node(g, name)
    if n is None:
        return None
    inputs = {i.name: i.type for i in ir.inputs}
    uses = [(k, a) for k, a in enumerate(n["args"]) if isinstance(a, str) and a in inputs]
    rng.shuffle(uses)
    for k, a in uses:
        others = sorted(b for b, t in inputs.items() if b != a and t == inputs[a])
        if others:
            b = rng.choice(others)
            n["args"][k] = b
            return f"{name} reads input {b} instead of {a}"
    return None


OPERATORS: dict[str, Edit] = {
    "drop_collective": _drop_collective,
    "wrong_reduce": _wrong_reduce,
    "wrong_dim": _wrong_dim,
    "wrong_order": _wrong_order,
    "swap_operands": _swap_operands,
    "slice_offset": _slice_offset,
    "scale": _scale,
    "add_before_reduce": _add_before_reduce,
    "wrong_shard": _wrong_shard,
    "swap_input": _swap_input,
}
PER_RANK_ONLY = {"wrong_shard"}  # a bug of one rank by construction


def _sites(op: str, dist: Dist) -> list[str]:
    """Node (or input) names of the first rank where the operator may apply."""
    g = dist.ranks[min(dist.ranks)]
    if op == "wrong_shard":  # inputs the ranks hold different parts of
        sharded = {x.local for x in dist.relations
                   if x.placements and any(p.kind != "replicate" for p in x.placements)}
        return [i.name for i in g.inputs if i.name in sharded and _floating(i.type)]
    want = {"drop_collective": COLLECTIVES, "wrong_reduce": REDUCING, "wrong_dim": ("all_gather", "reduce_scatter"),
            "wrong_order": ("all_gather", "reduce_scatter"),
            "swap_operands": NONCOMMUTATIVE, "slice_offset": ("slice",), "add_before_reduce": ("add",)}.get(op)
    if op == "swap_input":
        ins = {i.name for i in g.inputs}
        return [n.name for n in g.nodes if any(a in ins for a in n.tensor_args())]
    if op == "scale":
        return [n.name for n in g.nodes if _floating(n.type)]
    return [n.name for n in g.nodes if n.op in want]


def _site_rng(seed: int, operator: str, site: str) -> random.Random:
    """The operator's choices at a site (which constant, which shift): the same on every rank,
    as the same line of code runs on every rank."""
    return random.Random(f"{seed}:{operator}:{site}")


def live(dist: Dist, rank: int, site: str) -> bool:
    """Does the site (a node or input of the rank) reach one of the rank's outputs?"""
    g = dist.ranks[rank]
    users = g.users()
    todo, seen = [site], {site}
    outs = {o.ref for o in g.outputs}
    while todo:
        x = todo.pop()
        if x in outs:
            return True
        for u in users.get(x, []):
            if u.name not in seen:
                seen.add(u.name)
                todo.append(u.name)
    return False


def load_mutant(doc: Doc, seq: Graph, registry: Registry) -> Dist:
    """Load a mutated document the way `refine check` would (raises InputError if it does not)."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "dist.json"
        p.write_text(json.dumps(doc))
        return load_dist(p, registry, seq)


def mutants(seq: Graph, dist: Dist, doc: Doc, registry: Registry, count: int, seed: int = 0,
            operators: list[str] | None = None) -> Iterator[tuple[Mutant, Dist]]:
    """Up to `count` mutants that load, taking operators in turn; deterministic for a seed."""
    rng = random.Random(seed)
    ops = [o for o in (operators or list(OPERATORS))]
    pending = {o: _sites(o, dist) for o in ops}
    for o in ops:
        rng.shuffle(pending[o])
    made = 0
    while made < count and any(pending.values()):
        for o in ops:
            if made >= count:
                break
            while pending[o]:
                site = pending[o].pop()
                ranks = sorted(dist.ranks)
                scope_all = o not in PER_RANK_ONLY and len(ranks) > 1 and rng.random() < 0.5
                scopes = [None] if scope_all else [[rng.choice(ranks)]]
                if not scope_all and o not in PER_RANK_ONLY and len(ranks) > 1:
                    scopes.append(None)  # a collective's attributes must agree across ranks: then on every rank
                made_here = None
                for on in scopes:
                    try:
                        made_here = mutate_one(seq, dist, doc, registry, o, site, on, seed)
                    except (InputError, KeyError, IndexError, ValueError, TypeError, ZeroDivisionError):
                        continue  # does not type-check here: skipped
                    break
                if made_here is not None:
                    yield made_here
                    made += 1
                    break


def mutate_one(seq: Graph, dist: Dist, doc: Doc, registry: Registry, operator: str, site: str,
               ranks: list[int] | None = None, seed: int = 0) -> tuple[Mutant, Dist] | None:
    """One chosen mutation at `site` on `ranks` (default: every rank); None when the operator
    does not apply there. Raises InputError when the mutant does not load."""
    on = sorted(dist.ranks) if ranks is None else ranks
    new = copy.deepcopy(doc)
    details = []
    for r in on:
        d = OPERATORS[operator](registry, new, dist, r, site, _site_rng(seed, operator, site))
        if d is None:
            return None
        details.append(d)
    scope = "all ranks" if len(on) == len(dist.ranks) and len(on) > 1 else ", ".join(f"rank {r}" for r in on)
    m = Mutant(operator, site, scope, details[0], new, tuple(on))
    return m, load_mutant(new, seq, registry)


# ---------------------------------------------------------------------------------------
# judging


class Judge:
    """Checks mutants and evaluates them against the sequential side, computed once."""

    def __init__(self, seq: Graph, dist: Dist, registry: Registry, seed: int = 0, evaluate: bool = True) -> None:
        self.seq, self.dist, self.registry, self.seed, self.evaluate = seq, dist, registry, seed, evaluate
        self.symbolic = bool(case_symbols(seq, dist))
        self.inputs: dict[int, tuple[dict[int, dict[str, Tensor]], dict[str, Tensor]]] = {}
        if evaluate and not self.symbolic:
            try:
                self._inputs(seed)
            except EvalError:  # too large to evaluate (refine.evaluate.eval_budget): verdicts only
                self.evaluate = False

    def _inputs(self, seed: int) -> tuple[dict[int, dict[str, Tensor]], dict[str, Tensor]]:
        """Rank inputs and sequential output values for a seed: mutants keep the inputs and
        relations, so the first draw's are shared by all of them (only that one is kept: a
        corpus case's inputs are GBs in float64)."""
        if seed in self.inputs:
            return self.inputs[seed]
        seq_in, rank_in = random_inputs(self.seq, self.dist, seed, self.registry)
        vals = eval_graph(self.seq, self.registry, seq_in)
        got = (rank_in, {o.ref: vals[o.ref] for o in self.seq.outputs})
        if seed == self.seed:
            self.inputs[seed] = got
        return got

    def wrong(self, dist: Dist) -> tuple[bool | None, float]:
        """Is some sequential output numerically different from what the ranks give, on one
        of DRAWS sets of random inputs? One draw can hide a bug: aws_llama's query scaled by
        0.5 changes nothing on the draws of seeds 0 and 1
        but is wrong on seed 3; only mutants equal on the first draw pay for more."""
        if not self.evaluate:  # too large to run: the verdict alone is reported
            return None, math.nan
        if self.symbolic:
            res = [x for s in range(self.seed, self.seed + 2) for x in differential(self.seq, dist, self.registry, seed=s)]
            known = [x for x in res if x.ok is not None]
            return (any(not x.ok for x in known) if known else None), max((x.error for x in known), default=math.nan)
        verdict, err = self._wrong_at(dist, self.seed)
        for s in range(1, DRAWS):
            if verdict is not False:
                break
            verdict, e = self._wrong_at(dist, self.seed + s)
            err = max(err, e)
        return verdict, err

    def _wrong_at(self, dist: Dist, seed: int) -> tuple[bool | None, float]:
        rank_in, seq_outs = self._inputs(seed)
        try:
            rank_vals = eval_ranks(dist.ranks, self.registry, rank_in)
        except Exception:  # noqa: BLE001 - a mutant that cannot run (a deadlock) computes nothing right
            return True, math.inf
        outs = {f"{o.name}@{r}": rank_vals[r][o.ref] for r, g in dist.ranks.items() for o in g.outputs}
        verdict: bool | None = None
        err = 0.0
        for o in self.seq.outputs:
            want = seq_outs[o.ref]
            for t in expected_terms(dist, o.name, set(outs)):
                try:
                    got = eval_term(t, self.registry, outs)
                except Exception:  # noqa: BLE001 - an ill-shaped placement is a mismatch
                    return True, math.inf
                err = max(err, max_err(got, want))
                verdict = bool(verdict) or not close(got, want)
        return verdict, err

    def judge(self, m: Mutant, dist: Dist) -> Outcome:
        from refine.check import check

        wrong, err = self.wrong(dist)
        dead = bool(m.ranks) and not any(live(self.dist, r, m.node) for r in m.ranks)
        try:
            report = check(self.seq, dist, self.registry, "seq", f"mutant {m.name}")
        except InputError as e:
            return Outcome(m, "exit 2", wrong, e.reason[:80], err, dead)
        verdict = "REFINES" if report.refines else "DOES NOT REFINE"
        c = report.culprit
        culprit = "" if c is None else f"{c.node} ({c.op})" + (f" at {c.rank_node}" if c.rank_node else "")
        return Outcome(m, verdict, wrong, culprit, err, dead)


def run(seq: Graph, dist: Dist, doc: Doc, registry: Registry, count: int, seed: int = 0,
        operators: list[str] | None = None, on_outcome: Callable[[Outcome], None] | None = None,
        baseline: bool = True, evaluate: bool = True) -> list[Outcome]:
    judge = Judge(seq, dist, registry, seed, evaluate)
    out = []
    if baseline:  # the unmutated case: it should refine and be right, or the rest means little
        o = judge.judge(Mutant("none", "-", "-", "the case as given", doc), dist)
        out.append(o)
        if on_outcome:
            on_outcome(o)
    for m, d in mutants(seq, dist, doc, registry, count, seed, operators):
        o = judge.judge(m, d)
        out.append(o)
        if on_outcome:
            on_outcome(o)
    return out


def load_case(seq_path: str | Path, dist_path: str | Path, registry: Registry) -> tuple[Graph, Dist, Doc]:
    from refine.format import load_seq

    seq = load_seq(seq_path, registry)
    return seq, load_dist(dist_path, registry, seq), json.loads(json.dumps(read_json(dist_path)))
