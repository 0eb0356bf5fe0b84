"""Terms: expressions over rank tensors, as relations are written, printed and put into egglog.

A `Term` is an op name, tensor arguments and attributes (positional, in the op's order).
Leaves are rank tensors, `D("h@1")`. `Sum` and `Max` are n-ary and unordered; `Scale`
multiplies by an exact rational. Everything else follows the op registry.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from refine.ir import sexp
from refine.ir.sexp import Sexp, atom_name

LEAF_OPS = ("D", "Out")
NARY = ("Sum", "Max")
# A sequential tensor with no clean relation, standing for itself in the relations of the
# nodes that use it: it is never clean (it costs like a compute op) and has no definition,
# so what is proven over it holds whatever its value, and terms no longer grow along a
# buggy chain.
OPAQUE = "Opq"


@dataclass(frozen=True)
class Term:
    op: str
    args: tuple[Term, ...] = ()
    attrs: tuple[Any, ...] = ()

    def leaves(self) -> set[str]:
        if self.op in LEAF_OPS:
            return {self.attrs[0]}
        out: set[str] = set()
        for a in self.args:
            out |= a.leaves()
        return out

    def rename(self, f: Callable[[str], str]) -> Term:
        """This term with every rank tensor name passed through f."""
        if self.op == "D":
            return Term("D", (), (f(self.attrs[0]),))
        return Term(self.op, tuple(a.rename(f) for a in self.args), self.attrs) if self.args else self

    def ops(self) -> set[str]:
        out = {self.op}
        for a in self.args:
            out |= a.ops()
        return out

    def __str__(self) -> str:
        return show(self)


def depth(t: Term) -> int:
    """The number of ops on the longest path from t down to a leaf, plus one."""
    out = 0
    reached: dict[int, int] = {}  # by identity: a shared subterm is walked again only deeper
    stack = [(t, 1)]
    while stack:
        x, d = stack.pop()
        if reached.get(id(x), 0) >= d:
            continue
        reached[id(x)] = d
        out = max(out, d)
        stack.extend((a, d + 1) for a in x.args)
    return out


def leaf(name: str) -> Term:
    return Term("D", (), (name,))


def cat(parts: list[Term], dim: int) -> Term:
    """Binary concat of parts, nested as a balanced tree (see `split_point`)."""
    if len(parts) == 1:
        return parts[0]
    k = split_point(len(parts))
    return Term("cat", (cat(parts[:k], dim), cat(parts[k:], dim)), (dim,))


def split_point(n: int) -> int:
    """Where a concat of n > 1 parts splits: a balanced tree (the first n // 2 parts on the
    left), so a rule that splits an op over a concat reaches the ranks' pieces in log2(n)
    rewrites, not n - 1 (8 vocab shards: 3 levels, not 7). Up to 3 parts this is the
    right-nested chain cat(a0, cat(a1, a2))."""
    return n // 2


def nary(op: str, terms: list[Term]) -> Term:
    flat: list[Term] = []
    for t in terms:
        flat.extend(t.args if t.op == op else [t])
    return flat[0] if len(flat) == 1 else Term(op, tuple(flat))


def scale(t: Term, c: Fraction) -> Term:
    return t if c == 1 else Term("Scale", (t,), (Fraction(c),))


# ---------------------------------------------------------------------------------------
# Printing, the way reports show relations: cat(a@0, a@1, dim=0), a@0 + a@1, 1/2 * x@0.


def cat_parts(t: Term) -> list[Term]:
    """The pieces of a concat, its nested concats along the same dim (either side) flattened."""
    if t.op != "cat":
        return [t]
    return [p for a in t.args for p in (cat_parts(a) if a.op == "cat" and a.attrs == t.attrs else [a])]


def opaque(name: str) -> Term:
    return Term(OPAQUE, (), (name,))


def show(t: Term) -> str:
    if t.op in LEAF_OPS:
        return t.attrs[0]
    if t.op == OPAQUE:
        return f"<{t.attrs[0]}>"
    if t.op == "cat":
        return f"cat({', '.join(show(p) for p in cat_parts(t))}, dim={t.attrs[0]})"
    if t.op == "Sum":
        return "(" + " + ".join(sorted(show(a) for a in t.args)) + ")"
    if t.op == "Max":
        return "max(" + ", ".join(sorted(show(a) for a in t.args)) + ")"
    if t.op == "Scale":
        return f"{t.attrs[0]} * {show(t.args[0])}"
    if t.op == "slice":
        d, s, e = t.attrs
        return f"slice({show(t.args[0])}, dim={d}, {s}:{e})"
    inner = [show(a) for a in t.args] + [_show_attr(a) for a in t.attrs]
    return f"{t.op}({', '.join(inner)})"


def _show_attr(a: Any) -> str:
    if isinstance(a, tuple):
        return "[" + ", ".join(map(str, a)) + "]"
    return str(a)


# ---------------------------------------------------------------------------------------
# egglog text. Attribute sorts come from the registry's signatures.

# Every string put into egglog text: letters, digits and these, all else %XX (UTF-8 bytes).
# egglog's lexer reads \" and \\ in a string but prints the string back raw, so an escaped
# name would not survive extraction; and the engine's own scanners of egglog text (statement
# cutting, leaf renaming, shape recording) only need a string to hold no quote, paren, space
# or newline. A name is data: it never becomes egglog syntax, and it comes back exactly.
_QUOTE_SAFE = "@#/:+=,[]<>"


def quote(name: str) -> str:
    """`name` as an egglog string literal (`unquote` reads it back)."""
    return '"' + urllib.parse.quote(name, safe=_QUOTE_SAFE, errors="surrogatepass") + '"'


def unquote(text: str) -> str:
    """The string an egglog string literal made by `quote` holds."""
    return urllib.parse.unquote(text[1:-1], errors="surrogatepass")


def to_egglog(t: Term, sorts: dict[str, tuple[str, ...]]) -> str:
    if t.op in LEAF_OPS or t.op == OPAQUE:
        return f"({t.op} {quote(t.attrs[0])})"
    if t.op in NARY:
        return f"({t.op} (multiset-of {' '.join(to_egglog(a, sorts) for a in t.args)}))"
    parts = [to_egglog(a, sorts) for a in t.args]
    for a, sort in zip(t.attrs, sorts[t.op], strict=True):
        parts.append(lit(a, sort))
    return f"({t.op} {' '.join(parts)})" if parts else f"({t.op})"


def lit(a: Any, sort: str, py: bool = False) -> str:
    """An attribute as egglog text; `py` when sizes are PyObjects (symbolic shapes)."""
    if sort == "i64":
        return str(int(a))
    if sort == "Dim":
        return _dim_lit(a, py)
    if sort == "IV":
        return f"(vec-of {' '.join(_dim_lit(x, py) for x in a)})" if a else "(vec-empty)"
    if sort == "f64":
        v = float(a)
        if v != v:
            return "NaN"
        if v in (float("inf"), float("-inf")):
            return "inf" if v > 0 else "-inf"  # egglog reads these literally
        text = repr(v)
        return text if ("." in text or "e" in text) else text + ".0"
    if sort == "BigRat":
        f = Fraction(a)
        return f"(bigrat {_bigint(f.numerator)} {_bigint(f.denominator)})"
    if sort == "bool":
        return "true" if a else "false"
    if sort == "String":
        return quote(str(a))
    raise ValueError(f"unknown sort {sort}")


def _bigint(n: int) -> str:
    """An egglog bigint: `(bigint n)` takes an i64, so a longer one (the denominator of a
    factor like 1e-30) is read from its decimal string."""
    return f"(bigint {n})" if -(2 ** 63) <= n < 2 ** 63 else f'(from-string "{n}")'


def _dim_lit(d: Any, py: bool) -> str:
    if not py:
        if not isinstance(d, int):
            raise ValueError(f"symbolic size {d} in a concrete e-graph")
        return str(d)
    if isinstance(d, int):
        return f"(py-from-int {d})"
    from refine.ir import sizes

    return f"(py-object {quote(sizes.dumps(d))})"


def _read_dim(x: Sexp) -> Any:
    if isinstance(x, tuple):  # (py-object "base64 pickle"), made by our own engine
        from refine.ir import sizes

        return sizes.loads(unquote(str(x[1])))
    return int(atom_name(x))


def from_egglog(x: Sexp, sorts: dict[str, tuple[str, ...]]) -> Term:
    """An extracted egglog term (read by refine.ir.sexp) back into a Term."""
    op = sexp.head(x)
    if op is None:
        raise ValueError(f"expected a tensor term, got {sexp.show(x)}")
    rest = x[1:]
    if op in LEAF_OPS or op == OPAQUE:
        return Term(op, (), (unquote(str(rest[0])),))
    if op in NARY:
        ms = rest[0]
        items = ms[1:] if isinstance(ms, tuple) else ()
        return Term(op, tuple(from_egglog(y, sorts) for y in items))
    attr_sorts = sorts[op]
    n_t = len(rest) - len(attr_sorts)
    args = tuple(from_egglog(y, sorts) for y in rest[:n_t])
    attrs = tuple(_read_lit(y, s) for y, s in zip(rest[n_t:], attr_sorts, strict=True))
    return Term(op, args, attrs)


def _read_lit(x: Sexp, sort: str) -> Any:
    if sort == "Dim":
        return _read_dim(x)
    if sort == "IV":
        return tuple(_read_dim(v) for v in x[1:]) if isinstance(x, tuple) else ()
    if sort == "BigRat":
        # (bigrat (from-string "1") (from-string "6")) or (bigrat (bigint 1) (bigint 6))
        assert isinstance(x, tuple)
        num, den = (atom_name(part[1]) for part in x[1:3])  # type: ignore[index]
        return Fraction(int(num), int(den))
    assert not isinstance(x, tuple), (sort, sexp.show(x))
    if sort == "i64":
        return int(atom_name(x))
    if sort == "f64":
        return float(atom_name(x))
    if sort == "bool":
        return atom_name(x) == "true"
    if sort == "String":
        return unquote(str(x))
    raise ValueError(sort)


# ---------------------------------------------------------------------------------------
# The relation language users write for explicit layouts:
#   cat(slice(qkv@0, 0, 0, 4), slice(qkv@1, 0, 0, 4), dim=0)
#   sum(x@0, x@1)    scale(x@0, 1/2)    view(x@0, [4, 2])    transpose(x@0, 0, 1)

# A name the plain form cannot spell is written quoted, JSON style: "a b"@0, "say \"hi\""@1.
_LAYOUT_TOKEN = re.compile(r'\s*("(?:[^"\\]|\\.)*"(?:@\d+)?|[A-Za-z_][\w.]*@\d+|[A-Za-z_]\w*|-?\d+/\d+|-?\d+(?:\.\d+)?'
                           r"|[(),=\[\]])")


class LayoutSyntaxError(ValueError):
    pass


def _quoted_name(tok: str) -> str:
    """A quoted name token, `"..."` and its @rank if any, as the name it spells (a backslash
    escapes a quote or a backslash, nothing else)."""
    end = tok.rindex('"')

    def escape(m: re.Match[str]) -> str:
        if m.group(1) not in '"\\':
            raise LayoutSyntaxError(f"{tok!r}: unknown escape {m.group()!r} in a quoted name (only \\\" and \\\\)")
        return m.group(1)

    return re.sub(r"\\(.)", escape, tok[1:end], flags=re.S) + tok[end + 1:]


# Calls nested in one layout at most: a relation is a few ops deep (a concat of slices of a
# fused weight), and every walk over a term recurses (refine.prove.policy.Policy.term_depth)
LAYOUT_DEPTH = 32


def parse_layout(text: str, sequential: bool = False) -> Term:
    """A relation expression over rank tensors `name@rank`; with `sequential`, a define's
    expression over sequential inputs (bare names) that may also hold `zeros([..])`."""
    toks: list[str] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _LAYOUT_TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise LayoutSyntaxError(f"unexpected character at {pos}: {text[pos:pos + 10]!r}")
        toks.append(m.group(1))
        pos = m.end()
    i = 0
    nested = 0

    def peek() -> str:
        return toks[i] if i < len(toks) else ""

    def take(expect: str | None = None) -> str:
        nonlocal i
        if i >= len(toks):
            raise LayoutSyntaxError("unexpected end of expression")
        tok = toks[i]
        if expect is not None and tok != expect:
            raise LayoutSyntaxError(f"expected {expect!r}, found {tok!r}")
        i += 1
        return tok

    def value() -> Any:
        tok = peek()
        if tok == "[":
            take("[")
            items = []
            while peek() != "]":
                tok = take()
                if not re.fullmatch(r"-?\d+", tok):
                    raise LayoutSyntaxError(f"a list holds integers, found {tok!r}")
                items.append(int(tok))
                if peek() == ",":
                    take(",")
            take("]")
            return tuple(items)
        if re.fullmatch(r"-?\d+/\d+", tok):
            take()
            if re.fullmatch(r"-?\d+/0+", tok):
                raise LayoutSyntaxError(f"division by zero in {tok!r}")
            return Fraction(tok)
        if re.fullmatch(r"-?\d+", tok):
            take()
            return int(tok)
        if re.fullmatch(r"-?\d+\.\d+", tok):
            take()
            return Fraction(tok)
        return expr()

    def expr() -> Term:
        nonlocal nested
        tok = take()
        if tok.startswith('"'):
            name = _quoted_name(tok)
            if sequential and not tok.endswith('"'):
                raise LayoutSyntaxError(f"{tok!r}: a define reads sequential inputs (names without @)")
            if not sequential and tok.endswith('"'):
                raise LayoutSyntaxError(f"{tok!r}: a rank tensor is written name@rank (the rank after the quote)")
            return leaf(name)
        if "@" in tok:
            if sequential:
                raise LayoutSyntaxError(f"{tok!r}: a define reads sequential inputs (names without @)")
            return leaf(tok)
        name = tok
        if sequential and peek() != "(" and re.fullmatch(r"[A-Za-z_]\w*", tok):
            return leaf(tok)
        nested += 1
        if nested > LAYOUT_DEPTH:
            raise LayoutSyntaxError(f"calls nested deeper than {LAYOUT_DEPTH}")
        take("(")
        pos_args: list[Any] = []
        kw: dict[str, Any] = {}
        while peek() != ")":
            if i + 1 < len(toks) and toks[i + 1] == "=":
                key = take()
                take("=")
                kw[key] = value()
            else:
                pos_args.append(value())
            if peek() == ",":
                take(",")
        take(")")
        nested -= 1
        return _layout_term(name, pos_args, kw, sequential)

    t = expr()
    if i != len(toks):
        raise LayoutSyntaxError(f"unexpected {toks[i]!r} after the expression")
    return t


def _layout_term(name: str, args: list[Any], kw: dict[str, Any], sequential: bool = False) -> Term:
    """A relation-language call, with its arguments checked: nothing is dropped silently."""
    terms = [a for a in args if isinstance(a, Term)]
    rest = [a for a in args if not isinstance(a, Term)]
    kw_terms = [k for k, v in kw.items() if isinstance(v, Term)]
    if kw_terms:
        raise LayoutSyntaxError(f"{name}: keyword {kw_terms[0]}= takes a number, not a tensor")

    def need(n_terms: int | None, nums: tuple[str, ...]) -> list[Any]:
        """`n_terms` tensors (None: one or more), then the numbers `nums`, positional or by keyword."""
        if n_terms is None and not terms:
            raise LayoutSyntaxError(f"{name} needs at least one tensor")
        if n_terms is not None and len(terms) != n_terms:
            raise LayoutSyntaxError(f"{name} takes {n_terms} tensor(s), got {len(terms)}")
        if args and any(isinstance(a, Term) for a in args[len(terms):]):
            raise LayoutSyntaxError(f"{name}: tensors come before the other arguments")
        unknown = [k for k in kw if k not in nums]
        if unknown:
            raise LayoutSyntaxError(f"{name} has no argument {unknown[0]}= (it takes: {', '.join(nums) or 'tensors only'})")
        # positional numbers fill the names not given by keyword, in order
        free = [n for n in nums if n not in kw]
        if len(rest) != len(free):
            raise LayoutSyntaxError(f"{name} takes {len(nums)} number argument(s) ({', '.join(nums)}) after its "
                                    f"tensor(s), got {len(rest) + len(kw)}" if nums else
                                    f"{name} takes tensors only, got {rest[0]!r}")
        given = dict(zip(free, rest, strict=True)) | kw
        return [given[n] for n in nums]

    def integer(v: Any, what: str) -> int:
        if not isinstance(v, int):
            raise LayoutSyntaxError(f"{name}: {what} must be an integer, got {v!r}")
        return v

    if name == "cat":
        if not rest and "dim" not in kw:
            raise LayoutSyntaxError("cat needs dim=")
        (dim,) = need(None, ("dim",))
        return cat(terms, integer(dim, "dim"))
    if name == "slice":
        d, s, e = need(1, ("dim", "start", "end"))
        return Term("slice", (terms[0],), (integer(d, "dim"), integer(s, "start"), integer(e, "end")))
    if name in ("sum", "max"):
        need(None, ())
        return nary("Sum" if name == "sum" else "Max", terms)
    if name == "scale":
        (by,) = need(1, ("by",))
        if isinstance(by, tuple):
            raise LayoutSyntaxError(f"scale: the factor must be a number, got {list(by)}")
        return scale(terms[0], Fraction(by))
    if name == "view":
        (shape,) = need(1, ("shape",))
        if not isinstance(shape, tuple):
            raise LayoutSyntaxError(f"view: the shape must be a list like [4, 2], got {shape!r}")
        return Term("view", (terms[0],), (shape,))
    if name == "transpose":
        i, j = need(1, ("dim0", "dim1"))
        return Term("transpose", (terms[0],), (integer(i, "dim0"), integer(j, "dim1")))
    if name == "zeros" and sequential:
        (shape,) = need(0, ("shape",))
        if not isinstance(shape, tuple) or any(d < 0 for d in shape):
            raise LayoutSyntaxError(f"zeros: the shape must be a list like [4, 2], got {shape!r}")
        return Term("full", (), (0.0, shape))
    extra = ", zeros" if sequential else ""
    raise LayoutSyntaxError(f"{name!r} is not in the relation language (cat, slice, sum, max, scale, view, transpose{extra})")
