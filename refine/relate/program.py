"""From graphs to equations: the distributed program as definitions over rank tensors, and
each sequential input as a relation expression over rank inputs.

Collectives are matched across ranks (the k-th collective of a group on each member) and
lowered to `cat`/`slice`/`Sum` over the members' inputs; after this step there is no
communication left, only equalities between rank tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from refine.ir.errors import InputError
from refine.ir.graph import (
    Dist,
    Graph,
    Mesh,
    Node,
    Placement,
    Relation,
    TensorType,
    tensor_name,
    value_class,
)
from refine.ir.layout import join_replicas, placed_terms
from refine.ir.term import OPAQUE, Term, cat, cat_parts, leaf, nary
from refine.ops.lower import lower
from refine.ops.registry import Registry, ShapeError
from refine.relate.overlap import Read, conflict, reads, show_box


class UnionFind:
    def __init__(self) -> None:
        self.parent: dict[str, str] = {}
        self.members: dict[str, list[str]] = {}  # representative -> every name in its class
        self.frozen = False  # no more unions (DistProgram.freeze)

    def copy(self) -> UnionFind:
        """The same classes, in a union-find of its own (not frozen)."""
        out = UnionFind()
        out.parent, out.members = dict(self.parent), dict(self.members)  # a union replaces a class's list
        return out

    def group(self, x: str) -> list[str]:
        return self.members.get(self.find(x), [x])

    def find(self, x: str) -> str:
        if x not in self.parent:  # a class's representative, or a tensor in no union: most calls
            return x
        root = x
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        while self.parent.get(x, x) != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: str, b: str) -> None:
        if self.frozen:
            raise RuntimeError(f"union of {a} and {b} after the program's equalities were frozen")
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            # keep the smaller rank's name as the representative: stable, readable output
            if _rank_key(rb) < _rank_key(ra):
                ra, rb = rb, ra
            self.parent[rb] = ra
            self.members[ra] = self.members.pop(ra, [ra]) + self.members.pop(rb, [rb])


def _rank_key(name: str) -> tuple[int, str]:
    base, _, r = name.rpartition("@")
    return (int(r) if r.isdigit() else 0, base)


@dataclass
class DistProgram:
    """Every rank tensor: its type, its definition (None for rank inputs), its node."""

    types: dict[str, TensorType] = field(default_factory=dict)
    defs: dict[str, Term | None] = field(default_factory=dict)
    nodes: dict[str, Node] = field(default_factory=dict)
    users: dict[str, list[str]] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)  # "name@r" of a rank output -> tensor
    same: UnionFind = field(default_factory=UnionFind)
    # unrelated sequential tensors (refine.ir.term.OPAQUE)
    opaque: dict[str, TensorType] = field(default_factory=dict)
    constant: dict[str, bool] = field(default_factory=dict)  # memo of refine.prove.frontier.is_constant
    # equalities of terms over rank inputs that hold of parts only (refine.ir.layout): a slice
    # of one rank's fused weight equal to the same slice of another's. A step whose e-graph
    # names a leaf of one is told it (refine.prove.engine)
    facts: list[tuple[Term, Term]] = field(default_factory=list)
    fact_index: dict[str, list[int]] = field(default_factory=dict)  # leaf -> facts naming it
    # synthetic tensors `x#copies@r` that refine.prove.copies joined to x: x as a concat of
    # broadcasts of the heads it copies (its own or another rank's)
    copies: set[str] = field(default_factory=set)
    # the pre-walk pass (relate, refine.prove.copies, refine.prove.walk.settle) is over: the
    # tensors and facts no longer change, nor do the equalities but in a walk's own view
    # (walk_view), where the walk keeps what it learns
    frozen: bool = False

    def freeze(self) -> None:
        self.frozen = True
        self.same.frozen = True

    def walk_view(self) -> DistProgram:
        """This program's tensors, definitions and facts (shared, read only) with equalities
        and opaque leaves of its own: where a walk keeps what it learns, so the frozen
        program says the same to whoever reads it, in any order."""
        assert self.frozen, "a walk starts from a frozen program (refine.prove.walk.settle)"
        return replace(self, same=self.same.copy(), opaque=dict(self.opaque))

    def add_fact(self, a: Term, b: Term) -> None:
        if self.frozen:
            raise RuntimeError("a fact added after the program was frozen")
        i = len(self.facts)
        self.facts.append((a, b))
        for x in sorted(a.leaves() | b.leaves()):
            self.fact_index.setdefault(x, []).append(i)

    def add(self, name: str, typ: TensorType, definition: Term | None, node: Node | None) -> None:
        if self.frozen:
            raise RuntimeError(f"tensor {name} added after the program was frozen")
        self.types[name] = typ
        self.defs[name] = definition
        if node is not None:
            self.nodes[name] = node
        self.users.setdefault(name, [])
        if definition is not None:
            for dep in definition.leaves():
                self.users.setdefault(dep, []).append(name)


def _node_term(n: Node, rank: int, registry: Registry) -> Term:
    op = registry.ops[n.op]
    args = tuple(leaf(tensor_name(rank, a)) for a in n.tensor_args())
    if op.kind == "nary":
        return nary(n.op, list(args))
    attrs = tuple(n.attrs[k] for k, _ in op.attrs if k in n.attrs)
    return Term(n.op, args, attrs)


def build_program(dist: Dist, registry: Registry, file: str) -> tuple[DistProgram, dict[int, Graph]]:
    prog = DistProgram()
    cores: dict[int, Graph] = {}
    for r, g in sorted(dist.ranks.items()):
        try:
            core, rename = lower(g, registry)
        except ShapeError as e:
            raise InputError(file, "$.ranks", f"rank {r}: {e}") from None
        cores[r] = core
        for i in core.inputs:
            prog.add(tensor_name(r, i.name), i.type, None, None)
        for o in core.outputs:
            prog.outputs[tensor_name(r, o.name)] = tensor_name(r, o.ref)
    collectives = _match_collectives(cores, registry, file)
    for r, core in sorted(cores.items()):
        for n in core.nodes:
            name = tensor_name(r, n.name)
            op = registry.ops[n.op]
            if op.kind == "collective":
                prog.add(name, n.type, collectives.get(name), n)
            else:
                prog.add(name, n.type, _node_term(n, r, registry), n)
    return prog, cores


def _match_collectives(cores: dict[int, Graph], registry: Registry, file: str) -> dict[str, Term]:
    """The k-th collective of a group on each member are one collective.

    The loader (refine.frontends.graphfile) already checks all of this with exact JSON paths; these checks
    are a backstop for programs built in Python, so they name the rank, not a path."""
    by_group: dict[tuple[tuple[int, ...], int], dict[int, Node]] = {}
    sends: dict[tuple[int, int], list[str]] = {}
    recvs: dict[tuple[int, int], list[tuple[str, Node]]] = {}
    for r, g in sorted(cores.items()):
        seen: dict[tuple[int, ...], int] = {}
        for n in g.nodes:
            if registry.ops[n.op].kind != "collective":
                continue
            if n.op == "send":
                sends.setdefault((r, n.attrs["peer"]), []).append(tensor_name(r, n.tensor_args()[0]))
                continue
            if n.op == "recv":
                recvs.setdefault((n.attrs["peer"], r), []).append((tensor_name(r, n.name), n))
                continue
            group = tuple(n.attrs["group"])
            k = seen.get(group, 0)
            seen[group] = k + 1
            by_group.setdefault((group, k), {})[r] = n
    out: dict[str, Term] = {}
    for (group, k), members in sorted(by_group.items()):
        some = next(iter(members.values()))
        for r in group:
            if r not in members:
                raise InputError(file, "$.ranks",
                                 f"collective #{k} of group {list(group)} ({some.op} {some.name!r}) has no partner on rank {r}")
        first = members[group[0]]
        for r, n in members.items():
            if n.op != first.op or {a: v for a, v in n.attrs.items()} != first.attrs:
                raise InputError(file, "$.ranks",
                                 f"rank {r}: collective #{k} of group {list(group)} is {n.op} {n.attrs} (node {n.name!r}) "
                                 f"but {first.op} {first.attrs} on rank {group[0]} (node {first.name!r})")
        xs = [leaf(tensor_name(r, members[r].tensor_args()[0])) for r in group]
        in_size = cores[group[0]].type_of(first.tensor_args()[0]).shape
        lower = registry.ops[first.op].lower
        assert lower is not None, first.op
        for i, r in enumerate(group):
            dim = first.attrs.get("dim", first.attrs.get("split_dim", 0))
            size = in_size[dim] if in_size else 0
            out[tensor_name(r, members[r].name)] = lower(xs, i, first.attrs, size)
    for pair, recv_list in recvs.items():
        send_list = sends.get(pair, [])
        if len(send_list) != len(recv_list):
            raise InputError(file, "$.ranks",
                             f"rank {pair[1]} receives {len(recv_list)} tensor(s) from rank {pair[0]}, which sends {len(send_list)}")
        for src, (dst, _node) in zip(send_list, recv_list, strict=True):
            out[dst] = leaf(src)
    for pair in sends:
        if pair not in recvs:
            raise InputError(file, "$.ranks", f"rank {pair[0]} sends to rank {pair[1]}, which never receives")
    return out


def seq_input_relations(dist: Dist, seq: Graph, prog: DistProgram, registry: Registry,
                        file: str) -> dict[str, Term]:
    """Each sequential input as a term over rank inputs; replicas join `prog.same`."""
    out: dict[str, Term] = {}
    claims: list[tuple[Relation, list[Term]]] = []  # each relation's terms, all equal to its input
    for rel in dist.relations:
        if rel.source in out:
            raise InputError(file, rel.where, f"a second relation for sequential input {rel.source!r}")
        if rel.layout is not None:
            term = rel.layout
            claims.append((rel, [term, *rel.replicas]))
            for t in (term, *rel.replicas):
                _check_shape(t, seq.type_of(rel.source), prog, registry, file, rel)
            for t in rel.replicas:  # copies of the same tensor (a pipeline's tied weight on two stages)
                replica_equalities(prog, term, t, registry)
        else:
            # every replica must make the sequential input, not only the first one
            assert rel.placements is not None and rel.local is not None
            local = rel.local
            placed = placed_terms(lambda r, local=local: tensor_name(r, local), rel.placements, dist.mesh)
            for t in placed:
                _check_shape(t, seq.type_of(rel.source), prog, registry, file, rel)
            claims.append((rel, placed))
            term = _placed(rel, dist.mesh, prog)
        out[rel.source] = term
    for inp in seq.inputs:
        if inp.name in out:
            continue
        # no relation given: the same name and shape on every rank is read as replicated
        guess = Relation(inp.name, inp.name, tuple(Placement("replicate") for _ in dist.mesh.axes), guessed=True)
        if all(tensor_name(r, inp.name) in prog.types and prog.types[tensor_name(r, inp.name)].shape == inp.type.shape
               for r in dist.ranks):
            for r in sorted(dist.ranks):
                got = prog.types[tensor_name(r, inp.name)].dtype
                if value_class(got) != value_class(inp.type.dtype):
                    raise InputError(file, "$.relations", f"no relation for sequential input {inp.name!r}, which is "
                                     f"{inp.type.dtype}, and rank tensor {tensor_name(r, inp.name)} of that name is "
                                     f"{got}: a relation equates values of one class (float, int or bool)")
            out[inp.name] = _placed(guess, dist.mesh, prog)
            dist.relations.append(guess)
            claims.append((guess, placed_terms(lambda r, x=inp.name: tensor_name(r, x), guess.placements, dist.mesh)))
        else:
            raise InputError(file, "$.relations", f"no relation for sequential input {inp.name!r}, and no rank input of that name and shape")
    _disjoint_claims(claims, prog, registry, file)
    for d in dist.defines:
        # the defined rank input equals its define over the sequential inputs' relations: a
        # fact (refine.ir.layout's kind), told to every step whose e-graph names one of its
        # leaves (a padded shard is its real part, a slice of itself, and zeros)
        prog.add_fact(leaf(tensor_name(d.rank, d.input)), _structural(_substitute(d.term, out), prog, registry))
    join_congruent(prog)
    return out


def _disjoint_claims(claims: list[tuple[Relation, list[Term]]], prog: DistProgram, registry: Registry,
                     file: str) -> None:
    """No rank element stands for two sequential elements (refine.relate.overlap): relations that
    read one twice would hold only for sequential inputs equal there."""
    shapes: dict[Term, tuple[Any, ...]] = {}

    def shape_of(t: Term) -> tuple[Any, ...]:
        if t not in shapes:
            shapes[t] = term_type(t, prog, registry).shape
        return shapes[t]

    found: list[Read] = []
    for i, (rel, terms) in enumerate(claims):
        for j, t in enumerate(terms):
            try:
                found += reads(t, shape_of, i, j)
            except ValueError as e:
                raise InputError(file, rel.where or "$.relations", f"the relation for {rel.source!r}: {e}") from None
    hit = conflict(found)
    if hit is None:
        return
    a, b = sorted(hit, key=lambda r: (r.claim, r.term))
    ra, rb = claims[a.claim][0], claims[b.claim][0]

    def named(rel: Relation) -> str:
        at = f"at {rel.where}" if rel.where else "(guessed from the name: no relation names it)"
        return f"the relation for {rel.source!r} {at}"

    def part(r: Read) -> str:
        return "its first term" if r.term == 0 else f"its replica {r.term}"

    if ra is not rb:
        stands = f"elements of both {ra.source!r} and {rb.source!r}"
        why = f"{named(rb)} reads {show_box(b)}, and {named(ra)} reads {show_box(a)}"
    elif a.term == b.term:
        stands = f"two elements of {rb.source!r}"
        why = f"{named(rb)} reads {show_box(a)} and again {show_box(b)}"
    else:
        stands = f"two elements of {rb.source!r}"
        why = f"{named(rb)} reads {show_box(a)} in {part(a)} and {show_box(b)} in {part(b)}, at another place"
    raise InputError(file, rb.where or "$.relations",
                     f"{why}: they overlap, so one rank element would stand for {stands}, and a verdict would hold "
                     "only for inputs equal there. A rank element may be read for one sequential element only "
                     "(replicas at the same place, and defines, may repeat it)")


def _structural(t: Term, prog: DistProgram, registry: Registry) -> Term:
    """`t` with slices of concats and of slices resolved (exact: they only pick elements),
    so a define's fact names the rank pieces it reads, not every rank's piece of the whole."""
    t = Term(t.op, tuple(_structural(a, prog, registry) for a in t.args), t.attrs)
    if t.op != "slice" or not all(isinstance(v, int) for v in t.attrs):
        return t
    dim, start, end = t.attrs
    x = t.args[0]
    if end - start == term_type(x, prog, registry).shape[dim]:
        return x
    if x.op == "slice" and x.attrs[0] == dim and isinstance(x.attrs[1], int):
        return _structural(Term("slice", x.args, (dim, x.attrs[1] + start, x.attrs[1] + end)), prog, registry)
    if x.op == "full":
        shape = list(x.attrs[1])
        shape[dim] = end - start
        return Term("full", (), (x.attrs[0], tuple(shape)))
    if x.op == "cat" and x.attrs[0] == dim:
        pieces, at = [], 0
        for p in cat_parts(x):
            size = term_type(p, prog, registry).shape[dim]
            lo, hi = max(start, at), min(end, at + size)
            if lo < hi:
                pieces.append(_structural(Term("slice", (p,), (dim, lo - at, hi - at)), prog, registry))
            at += size
        return cat(pieces, dim)
    return t


def _substitute(t: Term, inputs: dict[str, Term]) -> Term:
    """A define's expression with each sequential input replaced by its relation."""
    if t.op == "D":
        return inputs[t.attrs[0]]
    return Term(t.op, tuple(_substitute(a, inputs) for a in t.args), t.attrs)


def join_congruent(prog: DistProgram) -> None:
    """Rank tensors defined by the same op over tensors known to be equal are equal: e.g.
    permute(dy) on every rank of a replicated dy. Repeats until nothing new joins (a
    collective's definition reads other ranks' tensors, defined later in program order)."""
    changed = True
    while changed:
        changed = False
        seen: dict[Term, str] = {}
        for name, d in prog.defs.items():
            if d is None:
                continue
            key = _canon(d, prog.same.find)
            other = seen.setdefault(key, name)
            if other != name and prog.same.find(other) != prog.same.find(name):
                prog.same.union(other, name)
                changed = True


def _canon(t: Term, find: Callable[[str], str]) -> Term:
    if t.op == "D":
        return Term("D", (), (find(t.attrs[0]),))
    return Term(t.op, tuple(_canon(a, find) for a in t.args), t.attrs)


def _placed(rel: Relation, mesh: Mesh, prog: DistProgram) -> Term:
    assert rel.placements is not None and rel.local is not None
    terms = placed_terms(lambda r: tensor_name(r, rel.local), rel.placements, mesh)  # type: ignore[arg-type]
    for t in terms[1:]:
        _join(prog, terms[0], t)
    return terms[0]


def replica_equalities(prog: DistProgram, a: Term, b: Term, registry: Registry) -> None:
    """A layout equals its replica: whole rank tensors that must be equal join `prog.same`,
    equalities that hold of parts only (under a slice) become `prog.facts`."""
    leaves, facts = join_replicas(a, b, lambda t: term_type(t, prog, registry).shape)
    for x, y in leaves:
        prog.same.union(x, y)
    for x, y in facts:
        prog.add_fact(x, y)


def _join(prog: DistProgram, a: Term, b: Term) -> None:
    """Record that two structurally parallel terms over replicas are equal leaf by leaf."""
    if a.op == "D" and b.op == "D":
        prog.same.union(a.attrs[0], b.attrs[0])
        return
    for x, y in zip(a.args, b.args, strict=True):
        _join(prog, x, y)


def term_type(t: Term, prog: DistProgram, registry: Registry) -> TensorType:
    if t.op == "D":
        return prog.types[t.attrs[0]]
    if t.op == "Out":  # a rank output, named "output@rank": the type of the tensor it names
        return prog.types[prog.outputs[t.attrs[0]]]
    if t.op == OPAQUE:
        return prog.opaque[t.attrs[0]]
    ins = [term_type(a, prog, registry) for a in t.args]
    op = registry.ops[t.op]
    if op.kind == "elementwise":
        ins = _constant_dtypes(t, ins)
    attrs = {k: v for (k, _), v in zip(op.attrs, t.attrs, strict=False)}
    return op.shape(ins, attrs)


def _constant_dtypes(t: Term, ins: list[TensorType]) -> list[TensorType]:
    """A `full` term holds no dtype (the e-graph's constants are dtype-less) and alone reads
    as float32; beside a typed operand of an elementwise op it has that operand's dtype, as
    the lowering made it (rules/elementwise.py `_operand`): `where_t(c, ids, full(0))` over
    integer ids is integer. The operands that share a dtype: where_t's two branches,
    masked_fill_t's none (its mask is boolean), every other elementwise op's all."""
    group = (1, 2) if t.op == "where_t" else () if t.op == "masked_fill_t" else range(len(ins))
    typed = [ins[i].dtype for i in group if t.args[i].op != "full"]
    if not typed:
        return ins
    return [replace(x, dtype=typed[0]) if i in group and t.args[i].op == "full" else x for i, x in enumerate(ins)]


def _check_shape(term: Term, want: TensorType, prog: DistProgram, registry: Registry, file: str,
                 rel: Relation) -> None:
    try:
        got = term_type(term, prog, registry)
    except ShapeError as e:
        raise InputError(file, rel.where, f"the relation for {rel.source!r} is ill-shaped: {e}") from None
    except KeyError as e:
        raise InputError(file, rel.where, f"the relation for {rel.source!r} names {e}, which is not a rank input") from None
    except Exception as e:  # a shape rule meeting a term it cannot take
        raise InputError(file, rel.where,
                         f"the relation for {rel.source!r} is ill-shaped ({type(e).__name__}: {e})") from None
    if got.shape != want.shape:
        raise InputError(file, rel.where,
                         f"the ranks' pieces of {rel.source!r} make shape {list(got.shape)}, "
                         f"but the sequential input has {list(want.shape)}")
