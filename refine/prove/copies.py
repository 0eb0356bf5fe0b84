"""Copies of one piece across heads and ranks, found numerically and proven by e-graphs.

A define may name one region of a sequential input twice: AWS Neuron's Llama-3 at TP6
gives each rank one copy of a KV head per local query head, so rank 0's key heads are
kv0, kv0, kv0, kv0, kv1, kv1 and rank 1's kv1, kv1, kv2, ... Everything the ranks compute
from such a weight (the key projection, the rotary's products, the key) holds the same
copies, and the scores pair each query head with its copy. The sequential model reads
each KV head once and repeats it (repeat_kv), so relating the two needs the copies as
equalities: `k@1`'s head 0 is `k@0`'s head 4; `k@0` is
`cat(expand(slice(k@0, 2, 0, 1), 4 heads), expand(slice(k@0, 2, 4, 5), 2 heads))`.

Rewrite rules cannot find these cheaply (which heads are copies is a fact of values, and
an e-graph would need to try every pair), so they are found by evaluating the region on
random inputs consistent with the defines, and each candidate is then proven by an
e-graph over the definitions back to the defines' facts. Only proven unit equalities are
used; a run of proven equal unit slices is the broadcast of one of them (extensionality),
so the joined form is exact. A numeric match the e-graph does not prove is dropped.

Each proven form joins `prog.same` through a synthetic rank tensor `name#copies@r`
(recorded in `prog.copies`): every step that names the tensor gets the form, and the walk
(refine.prove.frontier.frontier) reaches a rank's users through another rank's copy (rank 5's
scores, whose key no relation names, through rank 4's key).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from refine.ir.graph import Dist, Graph, TensorType, tensor_name
from refine.ir.lazy import torch
from refine.ir.term import Term, cat, leaf
from refine.prove.engine import Engine
from refine.prove.frontier import constant_closure, is_constant
from refine.prove.policy import Policy

if TYPE_CHECKING:
    from torch import Tensor

    from refine.ops.registry import Registry
    from refine.relate.program import DistProgram

# The search's reach and bounds are the policy's (refine.prove.policy: copy_region_depth,
# copy_outside, copy_iterations, copy_max_units, max_copies). A product's columns copy block
# by block (a head's 64 columns), which its head dim, after the view, says in a few units:
# proving hundreds of columns one by one costs minutes (max_copies).

Unit = tuple[str, int]  # (rank tensor, index along the dim)


def duplicated_inputs(dist: Dist) -> list[str]:
    """Rank inputs whose define names an element of a sequential input twice."""
    out = []
    for d in dist.defines:
        spans: list[tuple[str, int, int, int]] = []
        _slices(d.term, spans)
        seen: dict[tuple[str, int], list[tuple[int, int]]] = {}
        dup = False
        for name, dim, s, e in spans:
            for s2, e2 in seen.get((name, dim), ()):
                if s < e2 and s2 < e:
                    dup = True
            seen.setdefault((name, dim), []).append((s, e))
        if dup:
            out.append(tensor_name(d.rank, d.input))
    return out


def _slices(t: Term, out: list[tuple[str, int, int, int]]) -> None:
    if t.op == "slice" and t.args[0].op == "D" and all(isinstance(v, int) for v in t.attrs):
        out.append((t.args[0].attrs[0], *t.attrs))
        return
    for a in t.args:
        _slices(a, out)


def join_copies(seq: Graph, dist: Dist, prog: DistProgram, engine: Engine, registry: Registry,
                seed: int = 0) -> int:
    """Find, prove and join the copies behind duplicated inputs; returns how many tensors joined."""
    dup = {x.rpartition("@")[0] for x in duplicated_inputs(dist)}
    if not dup:
        return 0
    # every rank's copy of such an input: a rank holding each head once still holds the
    # first copy of some head (TP6 in small: rank 1's KV heads 0 and 1)
    sources = sorted(x for d in dist.defines if d.input in dup and (x := tensor_name(d.rank, d.input)) in prog.types)
    policy = engine.policy
    region = _region(prog, sources, registry, policy.copy_region_depth)
    values = _Values(prog, registry, seq, dist, set(region), seed, policy.copy_outside)
    by_base: dict[str, list[str]] = {}
    for x in region:
        if prog.defs.get(x) is not None and prog.types[x].dtype.startswith(("float", "bfloat")):
            by_base.setdefault(x.rpartition("@")[0], []).append(x)
    joined = 0
    for base in sorted(by_base, key=lambda b: min(region.index(x) for x in by_base[b])):
        names = sorted(by_base[base], key=_rank_of)
        found = _best_dim(names, prog, values, policy)
        if found is None:
            continue
        dim, cls = found
        proven = _prove(names, dim, cls, prog, engine, registry, set(region))
        for x in names:
            form = _form(x, dim, cls, proven, prog)
            if form is None:
                continue
            name = _fresh(prog, x.rpartition("@")[0] + "#copies", _rank_of(x))
            prog.add(name, prog.types[x], form, None)
            prog.same.union(x, name)
            prog.copies.add(name)
            joined += 1
    return joined


def _fresh(prog: DistProgram, base: str, rank: int) -> str:
    """`base@rank`, or `base<k>@rank` when a rank tensor holds that name already: the ranks'
    own names are any text, and a tensor of theirs must never be taken for the copies."""
    name, k = f"{base}@{rank}", 1
    while name in prog.types:
        name, k = f"{base}{k}@{rank}", k + 1
    return name


def _rank_of(name: str) -> int:
    return int(name.rpartition("@")[2])


def _region(prog: DistProgram, sources: list[str], registry: Registry, depth: int) -> list[str]:
    """Rank tensors computed from the sources within `depth` uses, in program order.
    A product is followed only where it reads a source (the projection): the scores and
    what follows pair copies with other values, and their equal rows are coincidences (a
    causal mask's first row), not copies."""
    order = {x: i for i, x in enumerate(prog.defs)}
    got: set[str] = set(sources)
    layer = set(sources)
    for _ in range(depth):
        nxt = set()
        for x in layer:
            for u in prog.users.get(x, ()):
                d = prog.defs.get(u)
                if u in got or d is None or u in prog.copies:
                    continue
                op = registry.ops.get(d.op)
                if op is not None and op.kind == "collective":
                    continue
                if d.op == "matmul" and not (d.leaves() & set(sources)) and not _reads_view_of(prog, d, sources):
                    continue
                nxt.add(u)
        got |= nxt
        layer = nxt
    return sorted(got, key=lambda x: order.get(x, -1))


def _reads_view_of(prog: DistProgram, d: Term, sources: list[str]) -> bool:
    """A product reading a source through views and transposes (a dot's lowering)."""
    for x in d.leaves():
        y: str | None = x
        for _ in range(4):
            if y in sources:
                return True
            dy = prog.defs.get(y) if y is not None else None
            if dy is None or dy.op not in ("view", "transpose") or len(dy.leaves()) != 1:
                break
            y = next(iter(dy.leaves()))
    return False


class _Values:
    """Values of the region on random inputs: the copied weights from their defines over
    random sequential inputs, every other input of the region random, one value per base
    name (a replicated activation is the same on every rank; where it is not, a candidate
    it makes fails its proof)."""

    def __init__(self, prog: DistProgram, registry: Registry, seq: Graph, dist: Dist, region: set[str],
                 seed: int, outside: int) -> None:
        from refine.ops.interp import eval_term

        self.prog, self.registry = prog, registry
        # the region and what it reads `outside` definitions back are computed (the rotary's
        # cos broadcast over the heads keeps the heads' copies; a random tensor in its place
        # would not), anything further is random
        self.region = set(region)
        layer = set(region)
        for _ in range(outside):
            layer = {y for x in layer if (d := prog.defs.get(x)) is not None for y in d.leaves()} - self.region
            self.region |= layer
        self.gen = torch.Generator().manual_seed(seed)
        self.memo: dict[str, Tensor] = {}
        self.outside: dict[str, Tensor] = {}
        self.eval_term = eval_term
        self.seq = seq
        self.seq_vals: dict[str, Tensor] = {}
        # evaluated when read: every layer's MLP weights are defined too (gigabytes, and
        # seconds of random draws, that no copy search reads)
        self.defines = {name: d.term for d in dist.defines if (name := tensor_name(d.rank, d.input)) in prog.types}

    def _random(self, typ: TensorType) -> Tensor:
        from refine.ops.interp import _random

        return _random(typ, self.gen, 8)

    def __call__(self, name: str) -> Tensor:
        # what a value is computed from first, depth first in argument order (the order of
        # the random draws): a walk, not a recursion, as constants chain as deep as the program
        stack = [(name, False)]
        while stack:
            x, ready = stack.pop()
            if x in self.memo:
                continue
            deps = [y for y in self._reads(x) if y not in self.memo]
            if ready or not deps:
                self.memo[x] = self._value(x)
            else:
                stack.append((x, True))
                stack.extend((y, False) for y in reversed(deps))
        return self.memo[name]

    def _reads(self, name: str) -> list[str]:
        """The rank tensors `_value` reads, in the order it reads them."""
        d = self.prog.defs.get(name)
        if name in self.defines or d is None or not (name in self.region or is_constant(self.prog, name)):
            return []
        out: list[str] = []
        todo = [d]
        while todo:
            t = todo.pop()
            if t.op in ("D", "Out") and t.attrs[0] not in out:
                out.append(t.attrs[0])
            todo.extend(reversed(t.args))
        return out

    def _value(self, name: str) -> Tensor:
        d = self.prog.defs.get(name)
        if name in self.defines:  # a defined rank input: from the random sequential inputs
            term = self.defines[name]
            for x in sorted(term.leaves()):
                if x not in self.seq_vals:
                    self.seq_vals[x] = self._random(self.seq.type_of(x))
            v = self.eval_term(term, self.registry, self.seq_vals).to(torch.float64)
        elif d is not None and (name in self.region or is_constant(self.prog, name)):
            v = self.eval_term(d, self.registry, self)
        else:
            base = name.rpartition("@")[0]
            if base not in self.outside:
                self.outside[base] = self._random(self.prog.types[name])
            v = self.outside[base]
        return v


def _best_dim(names: list[str], prog: DistProgram, values: _Values,
              policy: Policy) -> tuple[int, dict[Unit, Unit]] | None:
    """The dim along which the most unit slices of these tensors (one base name on its
    ranks) equal an earlier one, and for each unit its first equal (all-zero units, a
    padded head, are left out: zeros as proof premises blow the e-graph up);
    units equal to no earlier one are left out."""
    shape = prog.types[names[0]].shape
    if any(prog.types[x].shape != shape for x in names) or not all(isinstance(s, int) for s in shape):
        return None
    vals = {x: values(x) for x in names}
    best: tuple[int, dict[Unit, Unit]] | None = None
    for dim, size in enumerate(shape):
        if size < 2 or size * len(names) > policy.copy_max_units:
            continue
        cls = _classes(names, vals, dim, size)
        if any(sum(1 for (y, _) in cls if y == x) > policy.max_copies for x in names):
            continue
        if cls and (best is None or len(cls) > len(best[1])):
            best = (dim, cls)
    return best


def _classes(names: list[str], vals: Mapping[str, Tensor], dim: int, size: int) -> dict[Unit, Unit]:
    # each tensor's unit slices as the rows of a matrix: one product signs them all
    rows = {x: vals[x].movedim(dim, 0).reshape(size, -1).to(torch.float64) for x in names}
    n = rows[names[0]].shape[1]
    proj = torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    keyed = []
    for x in names:
        m = rows[x]
        sig, mag = (m @ proj).tolist(), m.abs().sum(1).tolist()
        for j in range(size):
            keyed.append((sig[j], mag[j], len(keyed), (x, j), m[j]))
    keyed.sort(key=lambda k: k[0])
    out: dict[Unit, Unit] = {}
    group: list[tuple[float, float, int, Unit, Tensor]] = []

    def close_group() -> None:
        # within a group of near signatures, each unit's first (in rank, index order) equal
        members = sorted(group, key=lambda k: k[2])
        firsts: list[tuple[Unit, Tensor]] = []
        for _, mag, _, u, flat in members:
            if mag == 0.0:  # padding: no copy of anything
                continue
            for f, fv in firsts:
                if torch.allclose(flat, fv, rtol=1e-6, atol=1e-9):
                    out[u] = f
                    break
            else:
                firsts.append((u, flat))

    for k in keyed:
        if group and abs(k[0] - group[-1][0]) > 1e-6 * (1.0 + abs(k[0])):
            close_group()
            group = []
        group.append(k)
    if group:
        close_group()
    return out


def _unit(x: str, dim: int, j: int) -> Term:
    return Term("slice", (leaf(x),), (dim, j, j + 1))


def _prove(names: list[str], dim: int, cls: dict[Unit, Unit], prog: DistProgram, engine: Engine,
           registry: Registry, region: set[str]) -> set[Unit]:
    """The units of `cls` proven equal to their first, one e-graph per rank
    tensor: the concat of its copied units against the concat of what they copy. Equal
    pieces of equal shapes make equal concats and only they do, so one check proves all."""
    proven: set[Unit] = set()
    for x in names:
        mine = sorted(j for (y, j) in cls if y == x)
        if not mine:
            continue
        lhs = cat([_unit(x, dim, j) for j in mine], dim)
        rhs = cat([_unit(cls[(x, j)][0], dim, cls[(x, j)][1]) for j in mine], dim)
        holders = sorted({cls[(x, j)][0] for j in mine} | {x})
        tensors = _proof_tensors(prog, holders, region, engine.policy.copy_outside)
        res = engine.step(lhs, prog, registry, tensors, checks=[rhs], iterations=engine.policy.copy_iterations,
                          early=False, both=True)
        if res.checks[0]:
            proven.update((x, j) for j in mine)
    return proven


def _proof_tensors(prog: DistProgram, names: list[str], region: set[str], outside: int) -> list[str]:
    """Definitions back from `names` through the region, and `outside` more beyond it,
    inputs first; constants with their closure."""
    out: list[str] = []
    seen: set[str] = set()
    # depth first, a tensor after what it reads: a walk (definitions chain deep in a region)
    stack = [(n, outside, False) for n in reversed(names)]
    while stack:
        x, budget, done = stack.pop()
        if done:
            if x not in out:
                out.append(x)
            continue
        if x in seen:
            continue
        seen.add(x)
        stack.append((x, budget, True))
        d = prog.defs.get(x)
        if d is not None and is_constant(prog, x):
            for c in constant_closure(prog, x):
                if c not in seen:
                    seen.add(c)
                    out.append(c)
        elif d is not None and (x in region or budget > 0):
            inner = outside if x in region else budget - 1
            stack.extend((dep, inner, False) for dep in reversed(sorted(d.leaves())))
    return out


def _form(x: str, dim: int, cls: dict[Unit, Unit], proven: set[Unit], prog: DistProgram) -> Term | None:
    """`x` as a concat of runs: its own units, broadcasts of one unit it or another rank
    holds, slices of another tensor's consecutive units. None: no proven copy."""
    shape = list(prog.types[x].shape)
    size = shape[dim]
    keys: list[Unit] = [cls[(x, j)] if (x, j) in proven and (x, j) in cls else (x, j) for j in range(size)]
    if all(k == (x, j) for j, k in enumerate(keys)):
        return None
    pieces: list[Term] = []
    j = 0
    while j < size:
        holder, hj = keys[j]
        k = j + 1
        while k < size and keys[k] == keys[j]:
            k += 1
        sh = list(shape)
        if k - j > 1:  # one unit, copied: its broadcast
            sh[dim] = k - j
            pieces.append(Term("expand", (_unit(holder, dim, hj),), (tuple(sh),)))
        else:  # consecutive units of one holder (each once): one slice
            while k < size and keys[k] == (holder, hj + (k - j)) and (k + 1 >= size or keys[k + 1] != keys[k]):
                k += 1
            pieces.append(Term("slice", (leaf(holder),), (dim, hj, hj + (k - j))))
        j = k
    return cat(pieces, dim)
