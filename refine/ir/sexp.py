"""S-expressions, the syntax of egglog and of the patterns rule files write: one reader
(`parse`), one printer (`show`, and `emit`, which also expands the size macros for one
mode) and the walks the registry and the engine make over them.

An expression is an atom (`Sym`, `Str`, `Num`) or a tuple of expressions. The reader keeps
what egglog needs to read the printed text back as written: a string's text between its
quotes (escapes as they were), a number's digits. Comments are dropped. Rule text is read
once, when its rule is made (`refine.ops.registry.rewrite`, `rule`) or a declaration first
used (`parse_cached`); everything after works on the tree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypeAlias


@dataclass(frozen=True, slots=True)
class Sym:
    """A symbol: a keyword, a table, a sort, a pattern variable, `true`, `:when`..."""

    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class Str:
    """A string literal; `text` is what stands between its quotes, escapes as written."""

    text: str

    def __str__(self) -> str:
        return f'"{self.text}"'


@dataclass(frozen=True, slots=True)
class Num:
    """An integer or float literal, as written."""

    text: str

    def __str__(self) -> str:
        return self.text


Atom: TypeAlias = Sym | Str | Num
Sexp: TypeAlias = "Sym | Str | Num | tuple[Sexp, ...]"


class SexpError(ValueError):
    """Text that is not a sequence of s-expressions."""


# The one tokenizer: a comment, a parenthesis, a string, an atom, or anything else (an
# unterminated string: an error). Whitespace before a token is skipped.
_TOKEN = re.compile(r'\s*(?:(;[^\n]*)|([()])|("(?:[^"\\]|\\.)*")|([^\s()";]+)|(\S))')


# Atoms are values: each distinct one is made once (rule text repeats a few hundred symbols).
_ATOMS: dict[str, Atom] = {}


def _atom(tok: str) -> Atom:
    x = _ATOMS.get(tok)
    if x is None:
        if tok[0] == '"':
            x = Str(tok[1:-1])
        elif tok[0].isdigit() or tok[0] == "-" and len(tok) > 1 and tok[1].isdigit():
            x = Num(tok)
        else:
            x = Sym(tok)
        _ATOMS[tok] = x
    return x


def parse(text: str) -> list[Sexp]:
    """Every top-level expression of `text`."""
    stack: list[list[Sexp]] = [[]]
    top = stack[0]
    for _, paren, string, atom, bad in _TOKEN.findall(text):
        if atom:
            top.append(_atom(atom))
        elif paren == "(":
            top = []
            stack.append(top)
        elif paren == ")":
            if len(stack) == 1:
                raise SexpError(f"unbalanced ')' in {text[:200]!r}")
            done = tuple(stack.pop())
            top = stack[-1]
            top.append(done)
        elif string:
            top.append(_atom(string))
        elif bad:
            raise SexpError(f"unreadable {bad!r} in {text[:200]!r}")
    if len(stack) != 1:
        raise SexpError(f"unbalanced '(' in {text[:200]!r}")
    return stack[0]


def parse_one(text: str) -> Sexp:
    """The one expression `text` holds."""
    out = parse(text)
    if len(out) != 1:
        raise SexpError(f"expected one expression, got {len(out)}: {text[:200]!r}")
    return out[0]


_PARSED: dict[str, tuple[Sexp, ...]] = {}


def parse_cached(text: str) -> tuple[Sexp, ...]:
    """`parse`, remembered: declarations and shape rules are read once per process."""
    hit = _PARSED.get(text)
    if hit is None:
        hit = _PARSED[text] = tuple(parse(text))
    return hit


def show(x: Sexp) -> str:
    """`x` as egglog text."""
    if isinstance(x, tuple):
        return "(" + " ".join(map(show, x)) + ")"
    return str(x)


def head(x: Sexp) -> str | None:
    """The symbol a list starts with, if it does."""
    if isinstance(x, tuple) and x and isinstance(x[0], Sym):
        return x[0].name
    return None


def atom_name(x: Atom) -> str:
    """What an atom may name: a symbol's name, a string's text (`unstable-fn "Op"` names a
    table), a number's digits."""
    return x.name if isinstance(x, Sym) else x.text


def symbols(x: Sexp) -> set[str]:
    """Every atom of `x`, as `atom_name` reads it."""
    out: set[str] = set()
    todo = [x]
    while todo:
        y = todo.pop()
        if isinstance(y, tuple):
            todo.extend(y)
        else:
            out.add(atom_name(y))
    return out


def with_option(x: Sexp, key: str, value: Sexp) -> Sexp:
    """A command with `:key value` added at its end (`:ruleset shapes`, `:name "r"`)."""
    assert isinstance(x, tuple), x
    return (*x, Sym(key), value)


# ---------------------------------------------------------------------------------------
# Egglog text the engine emits, scanned with the same tokenizer


def names(text: str) -> set[str]:
    """Every atom and string of egglog text (what it may name: a table, also through
    `unstable-fn`)."""
    return {s[1:-1] if s else a for _, _, s, a, _ in _TOKEN.findall(text)}


def heads_in(text: str) -> set[str]:
    """The symbols that open a list in egglog text (the ops of a printed term)."""
    out: set[str] = set()
    opened = False
    for _, paren, _, atom, _ in _TOKEN.findall(text):
        if opened and atom:
            out.add(atom)
        opened = paren == "("
    return out


def statements(text: str) -> list[str]:
    """`text` cut into its top-level parenthesised statements; the whole text as one when
    anything else stands between them or it is unbalanced (egglog then reports it)."""
    out: list[str] = []
    depth, start = 0, 0
    for m in _TOKEN.finditer(text):
        comment, paren, *_ = m.groups()
        if comment is not None:
            continue
        if paren == "(":
            if depth == 0:
                start = m.start(2)
            depth += 1
        elif paren == ")":
            depth -= 1
            if depth == 0:
                out.append(text[start:m.end()])
            elif depth < 0:
                return [text]
        elif depth == 0:
            return [text]
    if depth:
        return [text]
    return out


# ---------------------------------------------------------------------------------------
# Sizes. Rules compute on sizes with (d+ a b) (d- a b) (d* a b) (d/ a b) (exact
# division), test them with (d< a b) (d<= a b) (d> a b) (d>= a b) (d!= a b) and
# (d-divides k n), and write size literals as (dim 3). Equal sizes are equal values, so
# `=` and repeated pattern variables need no macro. With concrete shapes these are i64
# primitives; with symbolic ones, calls into `refine.ir.sizes`, whose tests hold only when
# proven for every value of the symbols (Z3 decides what the fast check cannot). The sort
# `Dim` is i64 or PyObject.

_I64 = {"d+": "+", "d-": "-", "d*": "*", "d/": "/", "d<": "<", "d<=": "<=", "d>": ">", "d>=": ">=", "d!=": "!="}
_PY_VALUE = {"d+": "add", "d-": "sub", "d*": "mul", "d/": "div"}
_PY_TEST = {"d<": "lt", "d<=": "le", "d>": "gt", "d>=": "ge", "d!=": "ne", "d-divides": "divides"}


def dims_prelude() -> list[str]:
    """The egglog globals the symbolic macros call, a statement each."""
    return [f"(let $dims_{n} (py-eval \"__import__('refine.ir.sizes', fromlist=['{n}']).{n}\" (py-dict) (py-dict)))"
            for n in sorted(set(_PY_VALUE.values()) | set(_PY_TEST.values()))]


def emit(x: Sexp, py: bool) -> str:
    """`x` as egglog text with its size macros expanded: for PyObject sizes when `py`,
    else for i64 ones."""
    if not isinstance(x, tuple):
        if isinstance(x, Sym) and x.name == "Dim":
            return "PyObject" if py else "i64"
        return str(x)
    if not x:
        return "()"
    args = [emit(a, py) for a in x[1:]]
    h = head(x)
    if h == "dim":
        (n,) = args
        return f"(py-from-int {n})" if py else n
    if h == "d-divides":
        k, n = args
        return f"(= true (py-to-bool (py-call $dims_divides {k} {n})))" if py else f"(= 0 (% {n} {k}))"
    if h in _PY_VALUE:
        return f"(py-call $dims_{_PY_VALUE[h]} {' '.join(args)})" if py else f"({_I64[h]} {' '.join(args)})"
    if h in _PY_TEST:
        return f"(= true (py-to-bool (py-call $dims_{_PY_TEST[h]} {' '.join(args)})))" if py \
            else f"({_I64[h]} {' '.join(args)})"
    return "(" + " ".join([emit(x[0], py), *args]) + ")"

