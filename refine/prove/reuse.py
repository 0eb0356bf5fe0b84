"""Prove a repeated layer once: a step's proof, renamed, is the proof of the same step in
another layer.

A step (`refine.prove.engine.Engine.step`) tells an e-graph a set of facts, its *premises*, and
extracts a term equal to the sequential one:

- the sequential term: the node's op over its inputs' relations (terms over rank tensors, or
  opaque leaves standing for sequential tensors with no clean relation);
- for each rank tensor it names, its shape;
- for some of them, their definition: `x = op(a, b)`, over the names of the classes of
  equal rank tensors (`DistProgram.same`);
- the facts about parts of rank inputs (`DistProgram.facts`) that name a tensor it holds.

Its conclusion, `seq term = best` (and `seq term = f` for each rank tensor f in `found`), is
derived from these premises by the rules alone, and no rule looks at a tensor's name: a
name is only a free variable. So for any renaming `pi` that is one-to-one on the names, the
renamed premises derive the renamed conclusion. If every renamed premise is a true fact of
the rank program (each renamed tensor is a class representative with the same shape, each
renamed definition is the definition of some member of the renamed tensor's class, each
renamed fact is a fact of the program, each renamed opaque leaf is an opaque sequential
tensor of the same shape) and the renamed sequential term is exactly the term of the node
being related, then the renamed conclusion is a true relation for that node, without
running the e-graph. That is the whole soundness argument: `Replayer.replay` checks every
premise (`_valid`) before it uses a result, and how
`pi` was found (`_map`, matching the layer's definitions against an earlier layer's) plays no
part in it. A mismatch anywhere, a hash collision of the candidate key, or a step that
related rank outputs (`Out` leaves, not renamed here) is no replay: the node is proven as
usual. Only clean results are replayed; a node with no clean relation is always proven, so
a bug in one layer is found and localized as if no other layer were there.

Layers are never cut out explicitly: the key of a sequential term is its shape up to
renaming (ops, attributes, leaf shapes), and the candidates are earlier steps with that
key. In a stack of identical layers, layer k's nodes find layer 1's steps, whose premises
name layer 1's rank tensors; `_map` follows the definitions to layer k's counterparts, and
leaves a name it cannot follow as it is (a tensor shared by every layer, or one of layer 1's
that layer k's proof may keep as a premise, since it is still true).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from refine.ir.term import OPAQUE, Term
from refine.ops.registry import COMPUTE

if TYPE_CHECKING:
    from refine.relate.program import DistProgram

CANDIDATES = 4  # earlier steps tried per key, most recent first
Name = tuple[str, str]  # ("D", rank tensor) or (OPAQUE, sequential tensor)


@dataclass(frozen=True)
class Premises:
    """What a step's e-graph was told, over class representatives (see the module doc)."""

    seq: Term
    shapes: tuple[tuple[str, Any], ...]  # rank tensor -> shape
    opaque: tuple[tuple[str, Any], ...]  # opaque sequential tensor -> shape
    defs: tuple[tuple[str, Term], ...]  # rank tensor -> its definition
    outputs: bool  # rank outputs were related too (never replayed)
    fired: Counter[str]  # rule matches of the proof, counted again when it is replayed
    facts: tuple[tuple[Term, Term], ...] = ()  # equalities of parts of rank inputs

    @staticmethod
    def of(seq: Term, prog: DistProgram, defined: Iterable[str], shaped: Iterable[str], opaque: Iterable[str],
           outputs: bool, fired: Counter[str], facts: Iterable[tuple[Term, Term]] = ()) -> Premises:
        find = prog.same.find
        defs = []
        for x in defined:
            d = prog.defs[x]
            assert d is not None
            defs.append((find(x), canon(d, find)))
        return Premises(canon(seq, find), tuple((r, prog.types[r].shape) for r in sorted(shaped)),
                        tuple((u, prog.opaque[u].shape) for u in sorted(opaque)), tuple(defs), outputs, fired,
                        tuple((canon(a, find), canon(b, find)) for a, b in facts))


def canon(t: Term, find: Callable[[str], str]) -> Term:
    """`t` over class representatives, its concats flattened (`_flat_cats`)."""
    if t.op == "D":
        return Term("D", (), (find(t.attrs[0]),))
    if not t.args:
        return t
    args = tuple(canon(a, find) for a in t.args)
    return Term(t.op, _flat_cats(args, t.attrs[0]) if t.op == "cat" else args, t.attrs)


def _flat_cats(args: tuple[Term, ...], dim: Any) -> tuple[Term, ...]:
    """The parts of a concat along `dim` whose arguments are `args`: a part that is itself
    a concat along `dim` is replaced by its parts. Concatenation along one dim is
    associative, so every nesting of the same parts (right-nested, balanced, as a step's
    extraction happens to build it) is one n-ary term, of the same value: layer k's relation
    matches layer 1's however either was nested. Only compared, never sent to an e-graph."""
    out: list[Term] = []
    for a in args:
        out.extend(a.args if a.op == "cat" and a.attrs == (dim,) else (a,))
    return tuple(out)


_NAMED = frozenset({"D", OPAQUE})


def _name(t: Term) -> Name | None:
    return (t.op, t.attrs[0]) if t.op in _NAMED else None


def rename(t: Term, pi: dict[Name, str]) -> Term:
    """`t` with its rank tensors and opaque leaves renamed (KeyError: a name pi lacks)."""
    op = t.op
    if op in _NAMED:
        return Term(op, (), (pi[(op, t.attrs[0])],))
    return Term(op, tuple([rename(a, pi) for a in t.args]), t.attrs) if t.args else t


def _match(a: Term, b: Term, pi: dict[Name, str], ext: dict[Name, str]) -> bool:
    """Extend `ext` (over `pi`) so that `a` renamed is `b`."""
    op = a.op
    if op != b.op:  # a name against anything but a name of its kind too
        return False
    if op in _NAMED:
        na = (op, a.attrs[0])
        have = pi.get(na)
        if have is None:
            have = ext.get(na)
            if have is None:
                ext[na] = b.attrs[0]
                return True
        return have == b.attrs[0]
    if a.attrs != b.attrs or len(a.args) != len(b.args):
        return False
    for x, y in zip(a.args, b.args):  # noqa: B905 - the lengths are equal
        if not _match(x, y, pi, ext):
            return False
    return True


@dataclass
class StepResult:
    """What one step proved (`refine.prove.engine.Engine.step`): its cheapest term, the
    rank tensors found equal to it and each check's outcome. Defined here, beside the
    premises it keeps, because a replay makes one too."""

    best: Term
    cost: int
    found: list[str]
    checks: list[bool]
    seconds: float
    premises: Premises | None = None  # what the step's e-graph was told (what a replay checks)
    # rank tensors the step proved equal to a tensor its best term names: the ranks' own
    # name for a piece may be another than the one extracted (a rank recomputing a mask)
    same: list[tuple[str, str]] = field(default_factory=list)
    # its e-graph stopped at the engine's NODE_BUDGET / MATCH_BUDGET: a proof may be missing
    bounded: bool = False

    @property
    def clean(self) -> bool:
        return self.cost < COMPUTE


class Replayer:
    """Earlier clean steps by the shape of their sequential term, and their replay."""

    def __init__(self, prog: DistProgram, stats: dict[str, float], fired: Counter[str]) -> None:
        self.prog, self.stats, self.fired = prog, stats, fired
        self.memo: dict[Hashable, list[tuple[Premises, StepResult]]] = {}
        self._defs: dict[str, Term | None] = {}  # rank tensor -> its definition over representatives
        self._facts: list[tuple[Term, Term]] = []  # the program's facts over representatives
        self._fact_set: set[tuple[Term, Term]] = set()  # and each either way round
        self._unions = -1  # how many unions `_defs` and the facts were computed under

    def _def(self, y: str) -> Term | None:
        """`canon` of y's definition, kept until the next union of two classes."""
        self._fresh()
        if y not in self._defs:
            d = self.prog.defs.get(y)
            self._defs[y] = None if d is None else canon(d, self.prog.same.find)
        return self._defs[y]

    def _fresh(self) -> None:
        """Forget what was computed over representatives if two classes were joined since
        (each union adds one entry to the union-find's parent map, and nothing else does)."""
        unions = len(self.prog.same.parent)
        if unions != self._unions:
            self._defs.clear()
            self._facts.clear()
            self._fact_set.clear()
            self._unions = unions

    def _canon_facts(self) -> list[tuple[Term, Term]]:
        """The program's facts (`DistProgram.facts`, same indices) over representatives."""
        self._fresh()
        if not self._facts and self.prog.facts:
            find = self.prog.same.find
            self._facts = [(canon(x, find), canon(y, find)) for x, y in self.prog.facts]
            self._fact_set = {p for x, y in self._facts for p in ((x, y), (y, x))}
        return self._facts

    def _fact(self, a: Term, b: Term) -> bool:
        """Whether a = b is a fact of the program (either way round), over representatives."""
        self._canon_facts()
        return (a, b) in self._fact_set

    def key(self, term: Term) -> Hashable:
        """The term's ops and attributes, its leaves numbered by first appearance, their shapes."""
        order, shapes = {}, []

        def walk(t: Term) -> Term:
            n = _name(t)
            if n is not None:
                if n not in order:
                    order[n] = str(len(order))
                    typ = self.prog.types.get(n[1]) if n[0] == "D" else self.prog.opaque.get(n[1])
                    shapes.append(None if typ is None else typ.shape)
                return Term(t.op, (), (order[n],))
            return Term(t.op, tuple(walk(a) for a in t.args), t.attrs) if t.args else t

        return walk(canon(term, self.prog.same.find)), tuple(shapes)

    def record(self, term: Term, res: StepResult) -> None:
        if res.premises is None or res.premises.outputs or not res.clean:
            return
        cands = self.memo.setdefault(self.key(term), [])
        cands.insert(0, (res.premises, res))
        del cands[CANDIDATES:]

    def replay(self, term: Term) -> StepResult | None:
        """A clean result for `term` renamed from an earlier step whose premises, renamed,
        are true here; None when there is none (the caller proves the node)."""
        cands = self.memo.get(self.key(term))
        if not cands or "D" not in term.ops():
            # a constant term's step finds the rank constants near this node (they join its
            # class and later steps use them); a replay would only find the earlier layer's
            return None
        target = canon(term, self.prog.same.find)
        for prem, res in cands:
            pi = self._map(prem, target)
            if pi is None or not self._valid(prem, pi, target):
                continue
            try:
                best = rename(res.best, pi)
                found = [pi[("D", f)] for f in res.found]
                # the rank tensors the step proved equal to one its best term names were
                # premises too (D leaves of its e-graph): renamed, they are equal here
                same = [(pi[("D", a)], pi[("D", b)]) for a, b in res.same]
            except KeyError:
                continue
            self.stats["replayed"] += 1
            self.fired.update(prem.fired)
            return StepResult(best, res.cost, found + self._congruent(found), [], 0.0, same=same)
        return None

    def _congruent(self, found: list[str]) -> list[str]:
        """Rank tensors with the same definition (op, attributes, input classes) as a found
        one: equal to it by congruence. A fresh step finds them when they are near this node
        (a rank viewing one sum twice); the renamed proof only names the earlier layer's."""
        prog, out = self.prog, []
        for f in found:
            d = self._def(f)
            if d is None or not d.leaves():
                continue
            x = min(d.leaves())
            for m in prog.same.group(x):
                for u in prog.users.get(m, ()):
                    if u not in found and u not in out and self._def(u) == d:
                        out.append(u)
        return out

    def _map(self, prem: Premises, target: Term) -> dict[Name, str] | None:
        """A renaming of the premises' names onto this program: the sequential terms matched,
        then each definition matched against the renamed tensor's (or, when only its inputs
        are renamed yet, looked up among their users). A guess: `_valid` decides."""
        find = self.prog.same.find  # a name kept is renamed to its class's representative now
        pi: dict[Name, str] = {}
        ext: dict[Name, str] = {}
        if not _match(prem.seq, target, pi, ext):
            return None
        pi.update(ext)
        todo = list(prem.defs)
        while todo:
            rest = []
            for r, d in todo:
                if ("D", r) not in pi:
                    y = self._lookup(r, d, pi)
                    if y is None:
                        rest.append((r, d))
                        continue
                    pi[("D", r)] = y
                    if d.leaves():
                        # found by matching d, every input renamed, against a definition in
                        # y's class: _match_def would find that match again and change nothing
                        continue
                if not self._match_def(r, d, pi):
                    return None
            if len(rest) == len(todo):
                # a definition over tensors the node's own do not lead to (the frontier took
                # in another user of a shared tensor): kept as it is, if it still holds
                r, _ = rest[0]
                pi[("D", r)] = find(r)
            todo = rest
        for a, b in prem.facts:
            self._match_fact(a, b, pi)
        for r, _ in prem.shapes:
            pi.setdefault(("D", r), find(r))
        for u, _ in prem.opaque:
            pi.setdefault((OPAQUE, u), u)
        return pi

    def _match_def(self, r: str, d: Term, pi: dict[Name, str]) -> bool:
        """Rename d's inputs after the definition of a member of pi(r)'s class."""
        prog = self.prog
        for y in prog.same.group(pi[("D", r)]):
            dy = self._def(y)
            ext: dict[Name, str] = {}
            if dy is not None and _match(d, dy, pi, ext):
                pi.update(ext)
                return True
        return False

    def _match_fact(self, a: Term, b: Term, pi: dict[Name, str]) -> None:
        """Rename a fact's leaves not renamed yet after a fact of this program that names a
        renamed one (rank 5's padded weight copies rank 4's heads: the fact about layer k's
        names layer k's rank 4 weight, which no definition of the step leads to)."""
        leaves = a.leaves() | b.leaves()
        if all(("D", x) in pi for x in leaves):
            return
        prog, facts = self.prog, self._canon_facts()
        for x in sorted(x for x in leaves if ("D", x) in pi):
            for m in prog.same.group(pi[("D", x)]):
                for i in prog.fact_index.get(m, ()):
                    fa, fb = facts[i]
                    for p, q in ((fa, fb), (fb, fa)):
                        ext: dict[Name, str] = {}
                        if _match(a, p, pi, ext) and _match(b, q, pi | ext, ext):
                            pi.update(ext)
                            return

    def _lookup(self, r: str, d: Term, pi: dict[Name, str]) -> str | None:
        """The class of a tensor defined as d renamed, among the users of the classes its
        renamed inputs are in (a constant with no inputs: r itself); inputs not renamed yet
        are renamed after the first such user that does not reuse a name already taken."""
        prog, find = self.prog, self.prog.same.find
        leaves = d.leaves()
        mapped = sorted(x for x in leaves if ("D", x) in pi)
        if not mapped:
            return find(r) if not leaves else None
        taken = set(pi.values())
        # the users of the renamed input with the fewest (not a tensor every layer reads)
        users = min(([u for m in prog.same.group(pi[("D", x)]) for u in prog.users.get(m, ())] for x in mapped), key=len)
        # first the tensor itself, over the inputs not renamed yet (a user of a tensor every
        # layer shares, kept from the earlier layer), then any user that matches
        same = {("D", x): find(x) for x in leaves if ("D", x) not in pi}
        if len(set(same.values())) == len(same) and not taken & set(same.values()) and find(r) not in taken:
            # renaming keeps the op and attributes: only a definition with d's can be equal
            defs = [dy for y in prog.same.group(r) if (dy := self._def(y)) is not None
                    and dy.op == d.op and dy.attrs == d.attrs]
            if defs:
                want = rename(d, pi | same if same else pi)
                if any(dy == want for dy in defs):
                    pi.update(same)
                    return find(r)
        for u in users:
            du = self._def(u)
            ext: dict[Name, str] = {}
            if du is None or find(u) in taken or not _match(d, du, pi, ext):
                continue
            if len(set(ext.values())) == len(ext) and not taken & set(ext.values()):
                pi.update(ext)
                return find(u)
        return None

    def _valid(self, prem: Premises, pi: dict[Name, str], target: Term) -> bool:
        """Every renamed premise is a fact of this program, pi is one-to-one on the
        premises' names, and the renamed sequential term is the node's: the soundness check."""
        prog, find = self.prog, self.prog.same.find
        if prem.outputs:
            return False
        tensors = [pi[("D", r)] for r, _ in prem.shapes]
        opaques = [pi[(OPAQUE, u)] for u, _ in prem.opaque]
        if len(set(tensors)) != len(tensors) or len(set(opaques)) != len(opaques):
            return False
        for (_, shape), y in zip(prem.shapes, tensors, strict=True):
            if find(y) != y or y not in prog.types or prog.types[y].shape != shape:
                return False
        for (_, shape), v in zip(prem.opaque, opaques, strict=True):
            if v not in prog.opaque or prog.opaque[v].shape != shape:
                return False
        for r, d in prem.defs:
            want = rename(d, pi)
            if not any(self._def(y) == want for y in prog.same.group(pi[("D", r)])):
                return False
        try:
            if not all(self._fact(rename(a, pi), rename(b, pi)) for a, b in prem.facts):
                return False
        except KeyError:  # a fact's leaf the step held without a shape (never: each is shaped)
            return False
        return rename(prem.seq, pi) == target
