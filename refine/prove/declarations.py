"""The engine's declarations as statements, and what each rule reads and writes
(`Declarations.closure`: the rules that can fire in a step's e-graph), read from their
trees (refine.ir.sexp); a step's program over canonical leaf names (`canonical`); the
statements of the shape audit (`record_shapes`)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from refine.ir.sexp import Sexp, Str, Sym, emit, head, names, parse, show, symbols, with_option
from refine.ir.term import LEAF_OPS, OPAQUE, Term, quote, unquote

_RULE_HEADS = ("rule", "rewrite", "birewrite")


@dataclass(frozen=True)
class Direction:
    rule: int
    needs: frozenset[str]  # the tables a match reads: a rule never fires while one is empty
    makes: frozenset[str]  # the tables its actions may add to


@dataclass(frozen=True)
class Need:
    """What a step's e-graph must declare: the rules that can fire in it and every table
    the program, those rules and the engine's own commands name."""

    rules: frozenset[int]
    tables: frozenset[str]

    def within(self, other: Need) -> bool:
        return self.rules <= other.rules and self.tables <= other.tables

    @property
    def size(self) -> int:
        return len(self.rules) + len(self.tables)


ENGINE_TABLES = frozenset({"Found", "Same", "Mark", "D", "Out", OPAQUE, "shape", "ShapeConflict"})  # named by Engine itself


@dataclass
class Declarations:
    """The engine's declarations, cut into statements, and what each rule reads and
    writes, to run a step with only the rules that can fire in it.

    Why that changes nothing: a rule's query looks up every table at the head of one of
    its atoms, so it has no match while one of them is empty; the tables a step's e-graph
    can ever fill are those its program names and those the actions of rules that can
    match write, a least fixpoint (`closure`). Every other rule never fires, and every
    other table stays empty, in that e-graph as in one declaring everything; what is
    declared keeps its order. Tables a declaration names (a merge calling another) count
    as written with it, and tables other top-level statements name as always written."""

    statements: list[tuple[str, int | None, str | None]]  # (text, its rule's index, the table it declares)
    rules: list[str]
    tables: frozenset[str]  # every constructor, function and relation
    directions: list[Direction]
    named: list[frozenset[str]]  # per rule, every table it names
    waiting: dict[str, list[int]] = field(default_factory=dict)  # table -> directions that need it
    deps: dict[str, frozenset[str]] = field(default_factory=dict)  # table -> other tables its declaration names
    always: frozenset[str] = frozenset()  # tables named by top-level statements other than rules and declarations
    closures: dict[frozenset[str], Need] = field(default_factory=dict)

    @classmethod
    def of(cls, program: str | Iterable[Sexp], py: bool = False) -> Declarations:
        """From the declarations as text or as parsed statements (size macros expanded
        for PyObject sizes when `py`)."""
        cut: list[tuple[str, int | None, str | None]] = []  # (text, its rule's index, the table it declares)
        rules: list[str] = []
        parsed: list[tuple[Sexp, ...]] = []
        tables: set[str] = set()
        others: list[Sexp] = []
        declared: list[tuple[str, Sexp]] = []
        for sx in parse(program) if isinstance(program, str) else program:
            st = emit(sx, py)
            h = head(sx)
            if h in _RULE_HEADS:
                assert isinstance(sx, tuple)
                cut.append((st, len(rules), None))
                rules.append(st)
                parsed.append(sx)
            elif h in ("constructor", "function", "relation"):
                assert isinstance(sx, tuple) and isinstance(sx[1], Sym), st
                cut.append((st, None, sx[1].name))
                tables.add(sx[1].name)
                declared.append((sx[1].name, sx))
            else:
                cut.append((st, None, None))
                others.append(sx)
        deps = {t: frozenset(symbols(sx) & tables) - {t} for t, sx in declared}
        always = frozenset(x for sx in others for x in symbols(sx) & tables)
        dirs = [d for i, sx in enumerate(parsed) for d in directions(i, sx, tables)]
        named = [frozenset(symbols(sx) & tables) for sx in parsed]
        waiting: dict[str, list[int]] = {}
        for k, d in enumerate(dirs):
            for t in d.needs:
                waiting.setdefault(t, []).append(k)
        return cls(cut, rules, frozenset(tables), dirs, named, waiting,
                   {t: d for t, d in deps.items() if d}, always)

    def everything(self) -> Need:
        return Need(frozenset(range(len(self.rules))), self.tables)

    def program(self, need: Need) -> list[str]:
        return [st for st, i, t in self.statements if (i is None or i in need.rules) and (t is None or t in need.tables)]

    def closure(self, program: str) -> Need:
        """The rules that can fire on an e-graph holding `program` and the tables they and
        it name."""
        have = frozenset(names(program) & self.tables)
        hit = self.closures.get(have)
        if hit is not None:
            return hit
        # a worklist: each table, once known, counts down the needs of the rules waiting on it
        known = set(have | self.always)
        todo = list(known)
        left = [len(d.needs) for d in self.directions]
        ready = [k for k, n in enumerate(left) if n == 0]
        on: set[int] = set()
        while ready or todo:
            while ready:
                d = self.directions[ready.pop()]
                on.add(d.rule)
                for t in d.makes - known:
                    known.add(t)
                    todo.append(t)
            if todo:
                t = todo.pop()
                for u in self.deps.get(t, frozenset()) - known:
                    known.add(u)
                    todo.append(u)
                for k in self.waiting.get(t, ()):
                    left[k] -= 1
                    if left[k] == 0:
                        ready.append(k)
        for i in on:
            known |= self.named[i]
        known |= ENGINE_TABLES & self.tables
        todo = list(known)
        while todo:  # what the declared tables' declarations name
            for u in self.deps.get(todo.pop(), frozenset()) - known:
                known.add(u)
                todo.append(u)
        need = Need(frozenset(on), frozenset(known))
        self.closures[have] = need
        return need


def heads(sx: Sexp, tables: frozenset[str] | set[str], strings: bool = False) -> set[str]:
    """The tables `sx` looks up: the heads of its lists that are tables; with `strings`,
    also those a string literal spells."""
    out: set[str] = set()
    todo = [sx]
    while todo:
        x = todo.pop()
        if isinstance(x, tuple):
            h = head(x)
            if h is not None and h in tables:
                out.add(h)
            todo.extend(x)
        elif strings and isinstance(x, Str) and x.text in tables:
            out.add(x.text)
    return out


def directions(i: int, sx: tuple[Sexp, ...], tables: set[str]) -> list[Direction]:
    """A rule's query/actions, a rewrite's left side (and conditions)/right side, and a
    birewrite's both ways. What a side writes counts every table it names at all."""
    kind, *rest = sx
    opts = {rest[k].name: rest[k + 1] for k in range(2, len(rest) - 1)
            if isinstance(rest[k], Sym) and rest[k].name.startswith(":")}
    when = opts.get(":when", ())

    def writes(x: Sexp) -> frozenset[str]:
        return frozenset(symbols(x) & tables)

    if kind == Sym("rule"):
        return [Direction(i, frozenset(heads(rest[0], tables)), writes(rest[1]))]
    lhs, rhs = rest[0], rest[1]
    cond = heads(when, tables)
    out = [Direction(i, frozenset(heads(lhs, tables) | cond), writes(rhs))]
    if kind == Sym("birewrite"):
        out.append(Direction(i, frozenset(heads(rhs, tables) | cond), writes(lhs)))
    return out


PLAIN_HEADS = frozenset({"D", "Out", "cat", "Sum", "multiset-of"})  # of a plain term (Engine._plain)


# A step's program is text the engine printed (refine.prove.engine._Emitter), its leaf names
# written by `quote`: they are renamed in that text, where the cache key is taken, rather
# than by printing the program again from a tree at every step.
_LEAF = re.compile(r'\((D|Out|Opq) ("[^"]*")\)')  # strings made by `quote` hold no quote
_PREFIX = {"D": "t", "Out": "o", OPAQUE: "u"}


def canonical(text: str) -> tuple[str, dict[tuple[str, str], str]]:
    """`text` with each leaf name replaced by its order of first appearance (per leaf kind)."""
    names: dict[tuple[str, str], str] = {}

    def sub(m: re.Match[str]) -> str:
        key = (m.group(1), unquote(m.group(2)))
        if key not in names:
            names[key] = f"{_PREFIX[key[0]]}{len(names)}"
        return f"({key[0]} {quote(names[key])})"

    return _LEAF.sub(sub, text), names


def rename(t: Term, back: dict[str, tuple[str, str]]) -> Term:
    if t.op in LEAF_OPS or t.op == OPAQUE:
        return Term(t.op, (), (back[t.attrs[0]][1],))
    return Term(t.op, tuple(rename(a, back) for a in t.args), t.attrs)


def record_shapes(statements: Iterable[Sexp]) -> list[Sexp]:
    """Each `(set (shape X) S)`, at the top or in a rule's actions, followed by
    `(ShapeSeen X S)` (SHAPE_AUDIT)."""

    def walk(xs: Iterable[Sexp]) -> list[Sexp]:
        out: list[Sexp] = []
        for x in xs:
            if not isinstance(x, tuple):
                out.append(x)
                continue
            if head(x) == "set" and len(x) == 3 and head(x[1]) == "shape":
                out += [x, (Sym("ShapeSeen"), x[1][1], x[2])]  # type: ignore[index]
            else:
                out.append(tuple(walk(x)))
        return out

    return walk(statements)


def record_shapes_text(text: str) -> str:
    """`record_shapes` of egglog text the engine emits, a statement a line."""
    return "\n".join(show(x) for x in record_shapes(parse(text)))


def in_ruleset(x: Sexp, ruleset: str) -> Sexp:
    return with_option(x, ":ruleset", Sym(ruleset))
