"""Mutation testing: small, realistic distributed-training bugs injected into a correct case.

Each operator edits the rank graphs of a distributed document (the JSON of graph format v1)
at one node, on one rank or on every rank, the way a silent bug would: a collective dropped
or with the wrong reduction or dim, the operands of a non-commutative op swapped, a slice at
a neighbouring shard's offset, a tensor scaled by a constant (a loss divided twice), a
replicated tensor added before a sum (a bias or residual added on every rank), one rank
using another rank's shard (a broadcast from the wrong rank), an input replaced by another
of the same shape. A mutant that does not load (shapes, collective matching) is skipped.

More operators aim at the checker's own blind spots: a value-changing cast (to an integer
or bool dtype and back), two communications of different groups (or a send and a recv)
swapped in one rank's program order (a deadlock, when the partners run them the other way),
a relation whose layout reads one rank tensor twice (or an overlapping slice of it, or one
that another relation reads), and hostile names (quotes, parens, newlines, egglog text) on a
correct case or on top of another bug. A mutant refused at load for its planted defect
(the same edit with a harmless value, its control, loads) is *refused*: fail-closed, sound.

`run` checks every mutant and evaluates it (`refine.ops.interp`, both sides in torch with
simulated collectives on random consistent inputs; program order by `refine.ops.schedule`) and
sorts it:

- caught: DOES NOT REFINE (the check's own counterexample shows it wrong);
- refused: exit 2 (refused at load or by the check), not a correct program refused;
- neutral: REFINES and numerically equal;
- incomplete: UNPROVEN (or exit 2) but numerically equal (the prover missed an equality);
- missed: UNPROVEN while numerically wrong (the check's counterexample search missed what
  the sweep's draws found);
- UNSOUND: REFINES while numerically wrong, the one outcome that must never happen;
- crashed: the check raised something other than a clean input error (a defect);
- timeout: no verdict within the CPU time given to each check (`run(check_limit=...)`);
- unjudged: a verdict only, the case being above the evaluation budget (REFINE_EVAL_BUDGET)
  or run with `--no-eval`; a mutated node that reaches no rank output is neutral (or
  incomplete) all the same, by construction.

"Numerically equal" means equal on `DRAWS` (4) draws of random inputs: one draw can hide a
bug (a query scaled by 0.5 can leave some draws unchanged).

Deterministic given the seed. From the command line: `refine mutate SEQ DIST --count N
--seed S [--operator OP]... [--no-eval]`. It prints a note for every output without an
expectation: the check only asks that such an output be placed in some standard way, so a
bug the placement cannot tell (a loss scaled into a partial sum) can REFINE. The sweep over
the bundled, captured and corpus cases is refine.bench.mutate (in `make bench`).
"""

from __future__ import annotations

import copy
import json
import math
import random
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refine.frontends.graphfile import load_dist, read_json
from refine.ir import sizes
from refine.ir.errors import InputError
from refine.ir.graph import Dist, Graph, Mesh, Relation, TensorType, case_symbols, tensor_name
from refine.ir.layout import placed_terms
from refine.ir.term import LEAF_OPS, Term, cat, cat_parts, parse_layout
from refine.ops.interp import (
    EvalError,
    Tensor,
    close,
    eval_graph,
    eval_ranks,
    eval_term,
    max_err,
    random_inputs,
)
from refine.ops.lower import normalize_attrs
from refine.ops.registry import Registry, load_registry
from refine.ops.schedule import ScheduleError, deadlock
from refine.oracle.differential import differential
from refine.verdict.expect import expected_terms

Doc = dict[str, Any]
REDUCING = ("all_reduce", "reduce_scatter")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
NONCOMMUTATIVE = ("sub", "div", "matmul", "mm", "bmm", "hlo_dot")
SHAPE_OPS = ("reshape", "view")
P2P = ("send", "recv")
DRAWS = 4  # sets of random inputs a mutant must be right on to count as numerically equal


@dataclass
class Mutant:
    operator: str
    node: str  # the rank node the bug is at
    scope: str  # "rank R" or "all ranks"
    detail: str
    doc: Doc = field(repr=False)
    ranks: tuple[int, ...] = ()
    # renamed mutants: the sequential graph the check reads, and the same program under the
    # case's own names, which the evaluation runs (a renaming changes no value)
    seq: Graph | None = field(default=None, repr=False)
    twin: Dist | None = field(default=None, repr=False)
    seq_doc: Doc | None = field(default=None, repr=False)
    fresh_inputs: bool = False  # the relations changed: inputs are drawn from the mutant's own
    refused: str = ""  # the loader's reason, when it refused the mutant (its control loads)
    crash: str = ""  # the loader raised something other than InputError

    @property
    def name(self) -> str:
        if self.operator == "none":
            return "none: the case as given"
        return f"{self.operator} {self.node} ({self.scope}): {self.detail}"


@dataclass
class Outcome:
    mutant: Mutant
    verdict: str  # REFINES | DOES NOT REFINE | UNPROVEN | exit 2 | crash | timeout
    wrong: bool | None  # numerically wrong on some output; None: not evaluated
    culprit: str = ""
    error: float = math.nan
    dead: bool = False  # the mutated site reaches no rank output, or only names changed: no value can

    @property
    def kind(self) -> str:
        if self.verdict in ("crash", "timeout"):
            return {"crash": "crashed", "timeout": "timeout"}[self.verdict]
        if self.verdict == "exit 2":  # fail-closed, unless the program was right all along
            return "incomplete" if self.wrong is False or (self.wrong is None and self.dead) else "refused"
        if self.verdict == "DOES NOT REFINE":  # only ever with the check's own counterexample
            return "caught"
        if self.verdict == "UNPROVEN" and self.wrong:
            return "missed"  # the sweep's draws show it wrong; the check's search did not
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
    return str(v) if isinstance(v, sizes.Sym) else v


def _new_node(registry: Registry, name: str, op: str, args: list[Any], attrs: dict[str, Any],
              types: dict[str, TensorType]) -> Doc:
    spec = registry.ops[op]
    ins = [types[a] for a in args if isinstance(a, str)]
    typ = spec.shape(ins, normalize_attrs(spec, attrs, ins))
    node = {"name": name, "op": op, "args": args, "shape": _jsonable(list(typ.shape)), "dtype": typ.dtype,
            "source": "refine.oracle.mutate"}
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


# ---------------------------------------------------------------------------------------
# value-changing casts: a `.long()` left in a float computation

INT_DTYPES = ("int64", "int32", "bool")


def _dtype_ops(reg: Registry) -> list[str]:
    """The identity-like ops that take a dtype (to_copy, clone, contiguous, ...): the
    registry's, so that an op added to that family is mutated too."""
    return sorted(n for n, o in reg.ops.items() if o.kind == "identity" and "dtype" in o.attr_kinds())


def _cast_node(name: str, op: str, x: str, shape: list[Any], dtype: str) -> Doc:
    """A cast written out whole, not through the op's shape rule: a loader that refuses
    the cast must be the one to say so."""
    return {"name": name, "op": op, "args": [x], "attrs": {"dtype": dtype}, "shape": shape, "dtype": dtype,
            "source": "refine.oracle.mutate"}


def _float_dtype_other_than(dtype: str) -> str:
    """The control of a value-changing cast casts within the float class instead."""
    return "float64" if dtype != "float64" else "float32"


def _int_cast(reg: Registry, doc: Doc, dist: Dist, r: int, name: str, rng: random.Random,
              control: bool = False) -> str | None:
    """`x` cast to int64, int32 or bool by one of the dtype-taking identity ops, then back to
    its float dtype (by the same op or `cast`): its values truncated (or made 0/1)."""
    g, ir = _graphs(doc)[r], dist.ranks[r]
    x = ir.index().get(name)
    if x is None or not _floating(x.type):
        return None
    op, dtype = rng.choice(_dtype_ops(reg)), rng.choice(INT_DTYPES)
    back = rng.choice([op, "cast"])
    if control:
        dtype = _float_dtype_other_than(x.type.dtype)
    at = _position(g, name) + 1 if _node(g, name) is not None else 0
    shape = _jsonable(list(x.type.shape))
    g["nodes"].insert(at, _cast_node(_fresh(g, name), op, name, shape, dtype))
    down = g["nodes"][at]["name"]
    g["nodes"].insert(at + 1, _cast_node(_fresh(g, name), back, down, shape, x.type.dtype))
    _reroute(g, name, g["nodes"][at + 1]["name"], at + 2)
    return f"{name} cast to {dtype} by {op}, back to {x.type.dtype} by {back}"


def _int_dtype(reg: Registry, doc: Doc, dist: Dist, r: int, name: str, rng: random.Random,
               control: bool = False) -> str | None:
    """An existing cast of a float tensor to a float dtype (`to_copy(dtype=float32)`, `cast`)
    made a cast to an integer or bool dtype, its result cast back to the dtype it had."""
    g, ir = _graphs(doc)[r], dist.ranks[r]
    n = _node(g, name)
    if n is None or n["op"] not in (*_dtype_ops(reg), "cast"):
        return None
    old = (n.get("attrs") or {}).get("dtype")
    src = [a for a in n["args"] if isinstance(a, str)]
    if not isinstance(old, str) or not _floating(TensorType((), old)) or len(src) != 1 \
            or not _floating(ir.type_of(src[0])):
        return None
    dtype = rng.choice(INT_DTYPES)
    back = "cast" if n["op"] == "cast" else rng.choice([n["op"], "cast"])
    if control:
        dtype = _float_dtype_other_than(old)
    n["attrs"]["dtype"] = n["dtype"] = dtype
    at = _position(g, name) + 1
    g["nodes"].insert(at, _cast_node(_fresh(g, name), back, name, n["shape"], ir.type_of(name).dtype))
    _reroute(g, name, g["nodes"][at]["name"], at + 1)
    return f"{name} ({n['op']}) casts to {dtype} instead of {old}, back by {back}"


# ---------------------------------------------------------------------------------------
# program order: two communications of different groups swapped on a rank


def _channel(n: Doc) -> tuple[Any, ...]:
    """What a communication waits on: its group, or its peer and direction."""
    a = n.get("attrs") or {}
    if n["op"] in P2P:
        return (n["op"], a.get("peer"))
    return ("group", tuple(a.get("group") or ()))


def _comm_label(n: Doc) -> str:
    a = n.get("attrs") or {}
    return f"{n['op']} peer {a.get('peer')}" if n["op"] in P2P else f"{n['op']} {list(a.get('group') or [])}"


def _swap_window(reg: Registry, g: Doc, name: str, p2p: bool) -> tuple[int, int, set[str]] | None:
    """(p, i, moved): node i (`name`, a communication) and the nearest communication before
    it, p, on another channel (both send/recv if `p2p`, else not both); `moved` the nodes
    after p that i needs, which can all go before p (none of them reads p)."""
    nodes = g["nodes"]
    n = _node(g, name)
    if n is None or reg.ops[n["op"]].kind != "collective":
        return None
    i = _position(g, name)
    p = next((k for k in range(i - 1, -1, -1) if reg.ops[nodes[k]["op"]].kind == "collective"), None)
    if p is None or _channel(nodes[p]) == _channel(n) or (nodes[p]["op"] in P2P and n["op"] in P2P) != p2p:
        return None
    need = {name}
    for k in range(i, p, -1):  # backwards: a needed node's arguments are needed too
        if nodes[k]["name"] in need:
            need.update(a for a in nodes[k]["args"] if isinstance(a, str))
    if nodes[p]["name"] in need:
        return None  # it reads p's result: there is no other order
    return p, i, need


def _swap_comms(reg: Registry, doc: Doc, dist: Dist, r: int, name: str, p2p: bool, control: bool) -> str | None:
    """The swap; its control (the order as it was) is the case itself."""
    g = _graphs(doc)[r]
    w = _swap_window(reg, g, name, p2p)
    if w is None:
        return None
    p, i, need = w
    nodes = g["nodes"]
    before, n = nodes[p], nodes[i]
    window = nodes[p:i + 1]
    if not control:
        nodes[p:i + 1] = [m for m in window if m["name"] in need] + [m for m in window if m["name"] not in need]
    return f"{name} ({_comm_label(n)}) moved before {before['name']} ({_comm_label(before)})"


def _swap_collectives(reg: Registry, doc: Doc, dist: Dist, r: int, name: str, rng: random.Random,
                      control: bool = False) -> str | None:
    """A collective moved before the communication of another group (or a send/recv) it
    follows: a deadlock when a partner runs them in the other order (two groups that share
    two ranks), else the same values."""
    return _swap_comms(reg, doc, dist, r, name, False, control)


def _swap_send_recv(reg: Registry, doc: Doc, dist: Dist, r: int, name: str, rng: random.Random,
                    control: bool = False) -> str | None:
    """A send or recv moved before the send/recv of another peer or direction it follows
    (a recv posted before the send its partner waits for: a deadlock)."""
    return _swap_comms(reg, doc, dist, r, name, True, control)


SWAPS = ("swap_collectives", "swap_send_recv")
EXTRA_OPERATORS: dict[str, Edit] = {
    "int_cast": _int_cast,
    "int_dtype": _int_dtype,
    "swap_collectives": _swap_collectives,
    "swap_send_recv": _swap_send_recv,
}


# ---------------------------------------------------------------------------------------
# relations: a layout that reads one rank tensor twice


def _layout_text(t: Term) -> str:
    """A term in the relation language (`refine.ir.term.parse_layout` reads it back)."""
    if t.op in LEAF_OPS:
        return str(t.attrs[0])
    args = [_layout_text(a) for a in t.args]
    if t.op == "cat":
        return f"cat({', '.join(_layout_text(p) for p in cat_parts(t))}, dim={t.attrs[0]})"
    if t.op in ("Sum", "Max"):
        return f"{t.op.lower()}({', '.join(args)})"
    if t.op == "Scale":
        return f"scale({args[0]}, {t.attrs[0]})"
    if t.op == "slice":
        return f"slice({args[0]}, {t.attrs[0]}, {t.attrs[1]}, {t.attrs[2]})"
    if t.op == "view":
        return f"view({args[0]}, [{', '.join(map(str, t.attrs[0]))}])"
    if t.op == "transpose":
        return f"transpose({args[0]}, {t.attrs[0]}, {t.attrs[1]})"
    raise ValueError(f"{t.op} has no relation-language text")


def _relation(dist: Dist, source: str) -> Relation | None:
    return next((x for x in dist.relations if x.source == source), None)


def _relation_terms(rel: Relation, mesh: Mesh) -> list[Term]:
    """The relation as layouts: its first layout and replicas, or its placements written out."""
    if rel.layout is not None:
        return [rel.layout, *rel.replicas]
    assert rel.placements is not None and rel.local is not None
    local = rel.local
    return placed_terms(lambda r: tensor_name(r, local), rel.placements, mesh)


def _set_layout(doc: Doc, source: str, terms: list[Term]) -> None:
    entry = next(e for e in doc.get("relations", []) if "define" not in e and e.get("from") == source)
    texts = [_layout_text(t) for t in terms]
    keep = {k: entry[k] for k in ("from", "guessed") if k in entry}
    entry.clear()
    entry.update(keep, layout=texts if len(texts) > 1 else texts[0])


def _leaf_list(t: Term) -> list[str]:
    """The rank tensors a layout reads, depth first (a replica's in the same order)."""
    if t.op in LEAF_OPS:
        return [t.attrs[0]]
    return [x for a in t.args for x in _leaf_list(a)]


def _with_leaf(t: Term, k: int, new: str) -> Term:
    """The layout with its k-th leaf (depth first) reading `new`."""
    seen = [0]

    def go(u: Term) -> Term:
        if u.op in LEAF_OPS:
            seen[0] += 1
            return Term(u.op, (), (new,)) if seen[0] - 1 == k else u
        return Term(u.op, tuple(go(a) for a in u.args), u.attrs)

    return go(t)


def _leaf_type(dist: Dist, leaf_name: str) -> TensorType | None:
    name, _, r = leaf_name.rpartition("@")
    g = dist.ranks.get(int(r))
    x = None if g is None else g.index().get(name)
    return None if x is None else x.type


DocEdit = Callable[[Registry, Doc, Dist, str, random.Random, bool], str | None]


def _repeat_piece(reg: Registry, doc: Doc, dist: Dist, source: str, rng: random.Random,
                  control: bool = False) -> str | None:
    """The relation, written as a layout, reads one rank tensor where another of the same
    type was (`cat(w@0, w@0, dim=0)` for `Shard(0)`): one tensor read twice, one by none."""
    rel = _relation(dist, source)
    if rel is None:
        return None
    terms = _relation_terms(rel, dist.mesh)
    leaves = _leaf_list(terms[0])
    pairs = [(k, j) for k, a in enumerate(leaves) for j, b in enumerate(leaves)
             if a != b and _leaf_type(dist, a) is not None and _leaf_type(dist, a) == _leaf_type(dist, b)]
    if not pairs:
        return None
    k, j = rng.choice(pairs)
    if not control:
        terms = [_with_leaf(t, k, _leaf_list(t)[j]) for t in terms]
    _set_layout(doc, source, terms)
    return f"the layout of {source} reads {leaves[j]} twice and {leaves[k]} not at all"


def _overlap_piece(reg: Registry, doc: Doc, dist: Dist, source: str, rng: random.Random,
                   control: bool = False) -> str | None:
    """Of two neighbouring pieces `a, b` of a concat along d (each c long), the second is read
    as `slice(a, d, c/2, c), slice(b, d, c/2, c)`: a's second half read twice (an overlapping
    slice), b's first half by none."""
    rel = _relation(dist, source)
    if rel is None:
        return None
    terms = _relation_terms(rel, dist.mesh)
    if terms[0].op != "cat":
        return None
    d = terms[0].attrs[0]
    parts = cat_parts(terms[0])
    spots = []
    for i in range(len(parts) - 1):
        a, b = parts[i], parts[i + 1]
        ta, tb = (_leaf_type(dist, x.attrs[0]) if x.op == "D" else None for x in (a, b))
        if ta is not None and ta == tb and isinstance(ta.shape[d], int) and ta.shape[d] >= 2 and ta.shape[d] % 2 == 0:
            spots.append(i)
    if not spots:
        return None
    i = rng.choice(spots)

    def overlap(t: Term) -> Term:
        ps = cat_parts(t)
        a, b = ps[i], ps[i + 1]
        c = _leaf_type(dist, a.attrs[0]).shape[d]  # type: ignore[union-attr]
        mid = [Term("slice", (a,), (d, c // 2, c)), Term("slice", (b,), (d, c // 2, c))]
        return cat(ps[:i + 1] + mid + ps[i + 2:], d)

    if not control:
        terms = [overlap(t) for t in terms]
    _set_layout(doc, source, terms)
    a, b = parts[i].attrs[0], parts[i + 1].attrs[0]
    return f"the layout of {source} reads the second half of {a} twice, the first half of {b} not at all"


def _shared_piece(reg: Registry, doc: Doc, dist: Dist, source: str, rng: random.Random,
                  control: bool = False) -> str | None:
    """The relation reads a rank tensor of the same type that another relation reads (a layout
    written for the wrong input): two relations share it, the relation's own piece is read by none."""
    rel = _relation(dist, source)
    if rel is None:
        return None
    terms = _relation_terms(rel, dist.mesh)
    leaves = _leaf_list(terms[0])
    spots = []
    for other in dist.relations:
        if other.source == source:
            continue
        for x in _leaf_list(_relation_terms(other, dist.mesh)[0]):
            for k, a in enumerate(leaves):
                if x not in leaves and _leaf_type(dist, x) is not None and _leaf_type(dist, x) == _leaf_type(dist, a):
                    spots.append((k, other, x))
    if not spots:
        return None
    k, other, x = rng.choice(spots)
    base = x.rpartition("@")[0]
    new = []
    for t in terms:  # each replica reads the other tensor on the rank its own piece was on
        r = int(_leaf_list(t)[k].rpartition("@")[2])
        if _leaf_type(dist, tensor_name(r, base)) != _leaf_type(dist, x):
            return None
        new.append(_with_leaf(t, k, tensor_name(r, base)))
    _set_layout(doc, source, terms if control else new)
    _set_layout(doc, other.source, _relation_terms(other, dist.mesh))  # drawn once, for both relations
    return f"the layout of {source} reads {x} (which {other.source}'s relation reads) instead of {leaves[k]}"


RELATION_OPERATORS: dict[str, DocEdit] = {
    "repeat_piece": _repeat_piece,
    "overlap_piece": _overlap_piece,
    "shared_piece": _shared_piece,
}
# their planted defect may be refused at load (a value-changing cast, an order that deadlocks,
# a relation reading a tensor twice): each has a control, the same edit made harmless
REFUSABLE = {*EXTRA_OPERATORS, *RELATION_OPERATORS}


# ---------------------------------------------------------------------------------------
# hostile names: a correct case renamed must still refine, a bug renamed must still not

# quotes, backslashes, parens, newlines, unicode, egglog commands and keywords, names the
# checker makes up itself (t0, $__seq), and texts that close a string to inject commands
HOSTILE_NAMES = (
    'a") (union (D "x") (D "y")) ("',
    'z")) (vec-of 1)) (union (D "t0") (D "t1")) (set (shape (D "w',
    '") (panic "injected") ("',
    'q"uote', '""', 'back\\slash', 'trailing\\', '\\"', 'par(en', 'close)', '(let x 1)',
    'new\nline', 'tab\there', ';; comment', 'ünïcødé 名前 🙂', 'let', 'rewrite', 'union', 'rule', 'run',
    'set', 'datatype', 'function', 'D', 'Out', 't0', 't1', '$__seq', ' ', 'a b', '0', '-1',
)
RENAME_OPERATORS = ("rename", "rename_bug")


def _graph_docs(doc: Doc, seq_doc: Doc) -> list[Doc]:
    return [seq_doc["graph"], *(r["graph"] for r in doc["ranks"])]


def _all_names(doc: Doc, seq_doc: Doc) -> set[str]:
    out: set[str] = set()
    for g in _graph_docs(doc, seq_doc):
        out |= {x["name"] for x in g["inputs"]} | {n["name"] for n in g["nodes"]} | {o["name"] for o in g["outputs"]}
    return out


def _pinned(doc: Doc) -> set[str]:
    """Names that layouts and defines read: the relation language cannot spell a hostile name."""
    out: set[str] = set()
    texts = []
    for e in [*doc.get("relations", []), *doc.get("expectations", [])]:
        if "define" in e:
            out.add(str(e["define"]).rpartition("@")[0])
            out |= parse_layout(e["as"], sequential=True).leaves()
        elif "layout" in e:
            texts += e["layout"] if isinstance(e["layout"], list) else [e["layout"]]
    for text in texts:
        out |= {x.rpartition("@")[0] for x in parse_layout(text).leaves()}
    return out


def _rename_docs(doc: Doc, seq_doc: Doc, names: dict[str, str]) -> None:
    """Every use of each name, in every graph, relation and expectation, renamed alike: what
    the names link (an output to its expectation, a rank input to its relation) stays linked."""
    def f(x: Any) -> Any:
        return names.get(x, x) if isinstance(x, str) else x

    for g in _graph_docs(doc, seq_doc):
        for x in g["inputs"]:
            x["name"] = f(x["name"])
        for n in g["nodes"]:
            n["name"], n["args"] = f(n["name"]), [f(a) for a in n["args"]]
        for o in g["outputs"]:
            o["ref"], o["name"] = f(o.get("ref", o["name"])), f(o["name"])
            if "of" in o:
                o["of"] = f(o["of"])
    for e in doc.get("relations", []):
        if "define" in e:
            continue
        src = e["from"]
        e["from"] = f(src)
        if "layout" not in e:
            e["input"] = f(e.get("input", src))
    for e in doc.get("expectations", []):
        out = e["output"]
        e["output"] = f(out)
        if "layout" not in e:
            e["local"] = f(e.get("local", out))


def _rename(doc: Doc, seq_doc: Doc, site: str, rng: random.Random) -> str | None:
    """Rename `site` (or, for "*", every name the layouts leave free) to hostile names."""
    taken, pinned = _all_names(doc, seq_doc), _pinned(doc)
    olds = sorted(taken - pinned) if site == "*" else [site] if site in taken - pinned else []
    if not olds:
        return None
    start = rng.randrange(len(HOSTILE_NAMES))
    names: dict[str, str] = {}
    for k, old in enumerate(olds):
        base = HOSTILE_NAMES[(start + k) % len(HOSTILE_NAMES)]
        new, j = base, 0
        while new in taken or new in names.values():
            j += 1
            new = f"{base} ~{j}"
        names[old] = new
    _rename_docs(doc, seq_doc, names)
    if site == "*":
        return f"all {len(names)} free names renamed (e.g. {olds[0]!r} -> {names[olds[0]]!r})"
    return f"{site!r} renamed {names[site]!r}"


def load_seq_doc(seq_doc: Doc, registry: Registry) -> Graph:
    """Load a sequential document the way `refine check` would (raises InputError if it does not)."""
    from refine.frontends.graphfile import load_seq

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "seq.json"
        p.write_text(json.dumps(seq_doc))
        return load_seq(p, registry)


def _renamed(base: Mutant, base_dist: Dist, seq_doc: Doc, registry: Registry, operator: str, site: str,
             seed: int) -> tuple[Mutant, Dist | None] | None:
    """`base` (a loaded mutant, or the case itself) with hostile names; the check reads it
    renamed, the evaluation runs `base_dist` (the same program under its own names)."""
    new, new_seq = copy.deepcopy(base.doc), copy.deepcopy(seq_doc)
    what = _rename(new, new_seq, site, _site_rng(seed, operator, f"{base.node}:{site}"))
    if what is None:
        return None
    detail = what if base.operator == "none" else f"{base.operator}: {base.detail}; {what}"
    m = Mutant(operator, base.node if base.operator != "none" else site, base.scope if base.operator != "none" else
               "all graphs", detail, new, base.ranks, twin=base_dist, seq_doc=new_seq)
    try:
        m.seq = load_seq_doc(new_seq, registry)
        return m, load_mutant(new, m.seq, registry)
    except InputError as e:
        m.refused = f"{e.where}: {e.reason}"
    except Exception as e:  # noqa: BLE001 - the loader choking on a name is a defect to report, not a skip
        m.crash = f"{type(e).__name__}: {e}"
    return m, None


# ---------------------------------------------------------------------------------------
# choosing sites and making mutants

PROGRAM_OPERATORS = (*OPERATORS, *EXTRA_OPERATORS)  # edits of rank graphs at a node or input
ALL_OPERATORS = (*PROGRAM_OPERATORS, *RELATION_OPERATORS, *RENAME_OPERATORS)


def _sites(op: str, dist: Dist, registry: Registry | None = None, doc: Doc | None = None,
           seq_doc: Doc | None = None) -> list[str]:
    """Node (or input) names of the first rank where the operator may apply (the new
    program operators: of any rank; relation operators: sequential inputs; renames: names)."""
    g = dist.ranks[min(dist.ranks)]
    if op in EXTRA_OPERATORS or op == "rename_bug":
        registry = registry or load_registry()
        if op == "rename_bug":
            return [] if seq_doc is None else \
                sorted({s for o in PROGRAM_OPERATORS for s in _sites(o, dist, registry, doc, seq_doc)})
        return _extra_sites(op, dist, registry, doc)
    if op in RELATION_OPERATORS:
        return [x.source for x in dist.relations]
    if op == "rename":
        return [] if seq_doc is None or doc is None else ["*", *sorted(_all_names(doc, seq_doc) - _pinned(doc))]
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


def _extra_sites(op: str, dist: Dist, registry: Registry, doc: Doc | None) -> list[str]:
    """Sites of the new program operators over every rank (a pipeline's stages differ), in
    rank then program order."""
    out: dict[str, None] = {}
    for r, g in sorted(dist.ranks.items()):
        if op == "int_cast":
            names = [x.name for x in (*g.inputs, *g.nodes) if _floating(x.type)]
        elif op == "int_dtype":
            ops = (*_dtype_ops(registry), "cast")
            names = [n.name for n in g.nodes if n.op in ops and isinstance(n.attrs.get("dtype"), str)]
        elif doc is not None:
            gd = _graphs(doc)[r]
            names = [n["name"] for n in gd["nodes"] if registry.ops[n["op"]].kind == "collective"
                     and _swap_window(registry, gd, n["name"], op == "swap_send_recv") is not None]
        else:
            names = []
        out.update(dict.fromkeys(names))
    return list(out)


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
            operators: list[str] | None = None, seq_doc: Doc | None = None) -> Iterator[tuple[Mutant, Dist | None]]:
    """Up to `count` mutants that load (or that the loader refuses for their planted defect:
    no Dist), taking operators in turn; deterministic for a seed. The renaming operators
    need the sequential document (`seq_doc`), which they rename too."""
    rng = random.Random(seed)
    ops = [o for o in (operators or list(ALL_OPERATORS))]
    ranks = sorted(dist.ranks)
    pending: dict[str, list[tuple[str, list[int] | None]]] = {}
    for o in ops:
        sites = _sites(o, dist, registry, doc, seq_doc)
        if o in SWAPS:  # few sites: each rank that holds one, and every rank, are mutants of their own
            pending[o] = [(s, [r]) for s in sites for r in ranks if s in dist.ranks[r].index()] + \
                [(s, None) for s in sites if len(ranks) > 1 and all(s in g.index() for g in dist.ranks.values())]
        else:
            pending[o] = [(s, None) for s in sites]
        rng.shuffle(pending[o])
    made = 0
    while made < count and any(pending.values()):
        for o in ops:
            if made >= count:
                break
            while pending[o]:
                site, forced = pending[o].pop()
                scope_all = o not in PER_RANK_ONLY and len(ranks) > 1 and rng.random() < 0.5
                scopes: list[list[int] | None] = [None] if scope_all else [[rng.choice(ranks)]]
                if o in SWAPS:
                    scopes = [forced]
                elif o in EXTRA_OPERATORS:  # then each rank that holds the site (a pipeline's stages differ)
                    holders = [[r] for r in ranks if site in dist.ranks[r].index()]
                    rng.shuffle(holders)
                    scopes += [h for h in holders if h not in scopes]
                elif not scope_all and o not in PER_RANK_ONLY and len(ranks) > 1:
                    scopes.append(None)  # a collective's attributes must agree across ranks: then on every rank
                made_here = None
                for on in scopes:
                    try:
                        made_here = mutate_one(seq, dist, doc, registry, o, site, on, seed, seq_doc)
                    except (InputError, KeyError, IndexError, ValueError, TypeError, ZeroDivisionError):
                        continue  # does not type-check here: skipped
                    if made_here is not None:
                        break
                if made_here is not None:
                    yield made_here
                    made += 1
                    break


def mutate_one(seq: Graph, dist: Dist, doc: Doc, registry: Registry, operator: str, site: str,
               ranks: list[int] | None = None, seed: int = 0,
               seq_doc: Doc | None = None) -> tuple[Mutant, Dist | None] | None:
    """One chosen mutation at `site` on `ranks` (default: every rank); None when the operator
    does not apply there. Raises InputError when the mutant does not load, except for a
    mutant whose control loads (the same edit, harmless: a float dtype for an int one, the
    relation without the repeat): that one is refused for its defect (`Mutant.refused`, no Dist)."""
    if operator in RENAME_OPERATORS:
        return _rename_one(seq, dist, doc, registry, operator, site, ranks, seed, seq_doc)
    if operator in RELATION_OPERATORS:
        def edit_relations(control: bool) -> tuple[Doc, str] | None:
            new = copy.deepcopy(doc)
            d = RELATION_OPERATORS[operator](registry, new, dist, site, _site_rng(seed, operator, site), control)
            return None if d is None else (new, d)

        made = edit_relations(False)
        if made is None:
            return None
        m = Mutant(operator, site, "relations", made[1], made[0], fresh_inputs=True)
        return m, _load_or_refuse(m, seq, registry, lambda: edit_relations(True))
    on = sorted(dist.ranks) if ranks is None else ranks

    def edit_ranks(control: bool) -> tuple[Doc, str] | None:
        new = copy.deepcopy(doc)
        details = []
        for r in on:
            rng = _site_rng(seed, operator, site)
            if operator in OPERATORS:
                d = OPERATORS[operator](registry, new, dist, r, site, rng)
            else:
                d = EXTRA_OPERATORS[operator](registry, new, dist, r, site, rng, control)  # type: ignore[call-arg]
            if d is None:
                return None
            details.append(d)
        return new, details[0]

    made = edit_ranks(False)
    if made is None:
        return None
    scope = "all ranks" if len(on) == len(dist.ranks) and len(on) > 1 else ", ".join(f"rank {r}" for r in on)
    m = Mutant(operator, site, scope, made[1], made[0], tuple(on))
    return m, _load_or_refuse(m, seq, registry, lambda: edit_ranks(True))


def _load_or_refuse(m: Mutant, seq: Graph, registry: Registry,
                    control: Callable[[], tuple[Doc, str] | None]) -> Dist | None:
    """The mutant loaded; or, refused at load while its control loads, None (`m.refused`)."""
    try:
        return load_mutant(m.doc, seq, registry)
    except InputError as e:
        if m.operator not in REFUSABLE:
            raise
        c = control()
        if c is None:
            raise
        load_mutant(c[0], seq, registry)  # raises when the control does not load either: the edit is ill-formed
        m.refused = f"{e.where}: {e.reason}"
        return None


def _rename_one(seq: Graph, dist: Dist, doc: Doc, registry: Registry, operator: str, site: str,
                ranks: list[int] | None, seed: int, seq_doc: Doc | None) -> tuple[Mutant, Dist | None] | None:
    """`rename`: the case itself renamed at `site` ("*": every free name). `rename_bug`: a
    program bug made at `site` by the first operator that applies there (in a seeded order),
    then everything renamed, or the bug's site alone."""
    if seq_doc is None:
        return None
    if operator == "rename":
        return _renamed(Mutant("none", "-", "-", "the case as given", doc), dist, seq_doc, registry, operator, site,
                        seed)
    rng = _site_rng(seed, operator, site)
    bases = list(PROGRAM_OPERATORS)
    rng.shuffle(bases)
    for b in bases:
        try:
            made = mutate_one(seq, dist, doc, registry, b, site, ranks, seed)
        except (InputError, KeyError, IndexError, ValueError, TypeError, ZeroDivisionError):
            continue
        if made is None or made[1] is None:
            continue  # does not apply, or refused at load: nothing to rename
        return _renamed(made[0], made[1], seq_doc, registry, operator, rng.choice(["*", site]), seed)
    return None


# ---------------------------------------------------------------------------------------
# judging


class CheckTimeout(BaseException):
    """A check ran out of its CPU time (a BaseException: no `except Exception` in the checker
    may take it for a failure of its own)."""


@contextmanager
def cpu_limit(seconds: float | None) -> Iterator[None]:
    """Raise CheckTimeout in the block once the process has spent `seconds` of CPU time in it
    (CPU, not wall time: the same limit on a loaded machine). No limit off the main thread."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise CheckTimeout

    old = signal.signal(signal.SIGPROF, stop)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, old)


class Judge:
    """Checks mutants and evaluates them against the sequential side, computed once."""

    def __init__(self, seq: Graph, dist: Dist, registry: Registry, seed: int = 0, evaluate: bool = True,
                 check_limit: float | None = None) -> None:
        self.seq, self.dist, self.registry, self.seed, self.evaluate = seq, dist, registry, seed, evaluate
        self.check_limit = check_limit  # CPU seconds a mutant's check may take; None: no limit
        self.symbolic = bool(case_symbols(seq, dist))
        self.inputs: dict[int, tuple[dict[int, dict[str, Tensor]], dict[str, Tensor]]] = {}
        self._same: tuple[bool | None, float] | None = None
        if evaluate and not self.symbolic:
            try:
                self._inputs(seed)
            except EvalError:  # too large to evaluate (refine.ops.interp.eval_budget): verdicts only
                self.evaluate = False

    def _inputs(self, seed: int, dist: Dist | None = None) -> tuple[dict[int, dict[str, Tensor]], dict[str, Tensor]]:
        """Rank inputs and sequential output values for a seed: mutants keep the inputs and
        relations, so the first draw's are shared by all of them (only that one is kept: a
        corpus case's inputs are GBs in float64). A mutant of the relations (`dist`) draws
        its own."""
        if dist is None and seed in self.inputs:
            return self.inputs[seed]
        seq_in, rank_in = random_inputs(self.seq, dist or self.dist, seed, self.registry)
        vals = eval_graph(self.seq, self.registry, seq_in)
        got = (rank_in, {o.ref: vals[o.ref] for o in self.seq.outputs})
        if seed == self.seed and dist is None:
            self.inputs[seed] = got
        return got

    def wrong(self, dist: Dist, fresh: bool = False) -> tuple[bool | None, float]:
        """Is some sequential output numerically different from what the ranks give, on one
        of DRAWS sets of random inputs? One draw can hide a bug: aws_llama's query scaled by
        0.5 changes nothing on the draws of seeds 0 and 1
        but is wrong on seed 3; only mutants equal on the first draw pay for more. Ranks
        that wait for each other for ever (`refine.ops.schedule.deadlock`) compute nothing right. With
        `fresh` (the relations changed) the inputs are drawn to satisfy the mutant's."""
        try:
            if deadlock(dist.ranks, self.registry):
                return True, math.inf
        except ScheduleError:  # not a program (a batch's send reads its own recv): refused at load
            return None, math.nan
        if not self.evaluate:  # too large to run: the verdict alone is reported
            return None, math.nan
        if self.symbolic:
            res = [x for s in range(self.seed, self.seed + 2) for x in differential(self.seq, dist, self.registry, seed=s)]
            known = [x for x in res if x.ok is not None]
            return (any(not x.ok for x in known) if known else None), max((x.error for x in known), default=math.nan)
        verdict, err = self._wrong_at(dist, self.seed, fresh)
        for s in range(1, DRAWS):
            if verdict is not False:
                break
            verdict, e = self._wrong_at(dist, self.seed + s, fresh)
            err = max(err, e)
        return verdict, err

    def _wrong_at(self, dist: Dist, seed: int, fresh: bool = False) -> tuple[bool | None, float]:
        try:
            rank_in, seq_outs = self._inputs(seed, dist if fresh else None)
        except EvalError:  # no inputs satisfy the mutant's relations (replicas that disagree)
            return None, math.nan
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

    def judge(self, m: Mutant, dist: Dist | None) -> Outcome:
        """Check and evaluate a mutant; `dist` is None for one the loader refused or choked on."""
        from refine.check import check

        twin = m.twin if m.twin is not None else dist
        if twin is None:
            wrong, err = None, math.nan
        elif twin is self.dist and not m.fresh_inputs:  # a renamed case: the case's own values
            if self._same is None:
                self._same = self.wrong(twin)
            wrong, err = self._same
        else:
            wrong, err = self.wrong(twin, m.fresh_inputs)
        dead = (bool(m.ranks) and not any(live(self.dist, r, m.node) for r in m.ranks if r in self.dist.ranks)) \
            or (m.operator == "rename" and twin is self.dist)
        if m.refused or m.crash or dist is None:
            return Outcome(m, "crash" if m.crash else "exit 2", wrong, _line(m.crash or m.refused), err, dead)
        try:
            with cpu_limit(self.check_limit):
                report = check(m.seq or self.seq, dist, self.registry, "seq", f"mutant {m.name}")
        except CheckTimeout:
            from refine.check import _ENGINES

            _ENGINES.clear()  # the interrupted engine may hold a half-run e-graph: the next check starts afresh
            return Outcome(m, "timeout", wrong, f"no verdict in {self.check_limit:.0f} s CPU", err, dead)
        except InputError as e:
            return Outcome(m, "exit 2", wrong, _line(e.reason), err, dead)
        except Exception as e:  # noqa: BLE001 - a crash is a defect to report, not the end of the sweep
            return Outcome(m, "crash", wrong, _line(f"{type(e).__name__}: {e}"), err, dead)
        verdict = report.verdict
        c = report.culprit
        culprit = "" if c is None else _line(f"{c.node} ({c.op})" + (f" at {c.rank_node}" if c.rank_node else ""))
        return Outcome(m, verdict, wrong, culprit, err, dead)


def _line(text: str, width: int = 120) -> str:
    """One line of a message for a table row (a hostile name may hold newlines)."""
    return " ".join(text.split())[:width]


def run(seq: Graph, dist: Dist, doc: Doc, registry: Registry, count: int, seed: int = 0,
        operators: list[str] | None = None, on_outcome: Callable[[Outcome], None] | None = None,
        baseline: bool = True, evaluate: bool = True, seq_doc: Doc | None = None,
        check_limit: float | None = None) -> list[Outcome]:
    judge = Judge(seq, dist, registry, seed, evaluate, check_limit)
    out = []
    if baseline:  # the unmutated case: it should refine and be right, or the rest means little
        o = judge.judge(Mutant("none", "-", "-", "the case as given", doc), dist)
        out.append(o)
        if on_outcome:
            on_outcome(o)
    for m, d in mutants(seq, dist, doc, registry, count, seed, operators, seq_doc):
        o = judge.judge(m, d)
        out.append(o)
        if on_outcome:
            on_outcome(o)
    return out


def load_case(seq_path: str | Path, dist_path: str | Path, registry: Registry) -> tuple[Graph, Dist, Doc]:
    from refine.frontends.graphfile import load_seq

    seq = load_seq(seq_path, registry)
    return seq, load_dist(dist_path, registry, seq), json.loads(json.dumps(read_json(dist_path)))


def read_doc(path: str | Path) -> Doc:
    """A document as plain JSON (for the renaming operators: `mutants(..., seq_doc=...)`)."""
    return json.loads(json.dumps(read_json(path)))
