"""Symbolic tensor sizes.

A size (`Dim`) is a plain `int` or a `Sym`: a canonical polynomial with rational coefficients
over named atoms. Syms live inside egglog as PyObjects, which egglog compares with Python
`__eq__`/`__hash__`, so the representation is canonical (equal polynomials are equal objects)
and a constant is always returned as an `int`, never as a Sym.

Comparisons (`le`, `lt`, ...) are sound: True only when the fact holds for every valuation the
atoms allow (a fast coefficient check, then Z3); anything unproven is False.

Declaring (graph format v1): `"symbols": {"T": {"min": 1, "multiple_of": 2}, "H": {}}`; any
size (a dim of a `shape`, an entry of a shape/reshape attribute, a slice bound) may be an
expression over them with integers, `+ - *`, exact division `/` and parentheses (`"T/2"`).
A verdict then holds for every value the declarations allow, and the report says so (`for
every value of H >= 1; T >= 1, a multiple of 2`).

How comparisons (`<=`, `<`, `!=`, divisibility) are proven: the fast check substitutes each
atom by its least value plus a non-negative variable and asks for all coefficients
non-negative; Z3 gets integer variables, the atoms' constraints and floors bounded exactly,
with a 2 s timeout (`unknown` counts as not proven). The loader checks every shape rule,
placement and collective with them: a slice in bounds for some values only, or a shard of a
size not provably divisible by the ranks, is exit 2 naming the place.

In rules, size arithmetic and tests are macros (`(d+ a b)`, `(d<= a b)`, `(d-divides k n)`,
`(dim 0)`): with concrete shapes they compile to egglog's i64 primitives; with symbolic ones
sizes are egglog PyObjects and the macros call this module, so a rewrite fires only when its
side condition is proven for every value. The same rule text serves both modes.

Limits: layout expressions take integer bounds only; defines need concrete shapes; the
vocab-offset rules (rules/embedding.py, rules/masked_lookup.py) are concrete-only; a symbol
is never assumed to be 1, so a symbolic size broadcasts only against itself or 1. Numeric
checks (audits, differential runs) evaluate at sampled values of the symbols
(`refine.ops.interp.instantiate`).
"""

from __future__ import annotations

import base64
import functools
import io
import math
import pickle
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, TypeAlias

Mono: TypeAlias = tuple[tuple[str, int], ...]
Terms: TypeAlias = tuple[tuple[Mono, Fraction], ...]
Poly: TypeAlias = dict[Mono, Fraction]

_Z3_TIMEOUT_MS = 2000
_CACHE = 1 << 16


def _floor_name(a: Dim, b: Dim) -> str:
    return f"⌊({a})/({b})⌋"


def _is_dim(x: object) -> bool:
    return type(x) is int or type(x) is Sym


@dataclass(frozen=True)
class Atom:
    """A symbol ranging over {min, min+1, ...} ∩ multiples of `multiple`.

    With `floor=(a, b)` the atom is opaque and stands for floor(a / b): its value comes from
    `floor`, and `min`/`multiple` are fixed to 0/1 and not trusted as bounds (a may be negative);
    comparisons derive its bounds from the definition instead.
    """

    name: str
    min: int = 1
    multiple: int = 1
    floor: tuple[Dim, Dim] | None = None

    def __post_init__(self) -> None:
        if type(self.min) is not int or type(self.multiple) is not int:
            raise ValueError(f"atom {self.name!r}: min and multiple must be ints")
        if self.floor is None:
            if type(self.name) is not str or not self.name.isidentifier():
                raise ValueError(f"atom name {self.name!r} is not an identifier")
            if self.min < 0 or self.multiple < 1:
                raise ValueError(f"atom {self.name}: need min >= 0 and multiple >= 1")
            return
        f = self.floor
        if type(f) is not tuple or len(f) != 2 or not all(_is_dim(x) for x in f):
            raise ValueError("floor atom needs floor=(a, b) with Dims a, b")
        a, b = f
        if type(a) is int and type(b) is int:
            raise ValueError("floor atom of two ints must be an int")
        if b == 0:
            raise ValueError("floor atom divides by 0")
        if (self.min, self.multiple) != (0, 1) or self.name != _floor_name(a, b):
            raise ValueError(f"malformed floor atom {self.name!r}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuild through __init__ so unpickled atoms are validated.
        return (Atom, (self.name, self.min, self.multiple, self.floor))


class Sym:
    """A non-constant polynomial over atoms. Immutable, hashable, canonical.

    Build with `sym()` and arithmetic, not directly (the constructor only validates).
    """

    __slots__ = ("terms", "atoms", "_hash", "_str")
    terms: Terms
    atoms: tuple[Atom, ...]

    def __init__(self, terms: Terms, atoms: tuple[Atom, ...]) -> None:
        _validate(terms, atoms)
        object.__setattr__(self, "terms", terms)
        object.__setattr__(self, "atoms", atoms)
        object.__setattr__(self, "_hash", hash((terms, atoms)))
        object.__setattr__(self, "_str", None)

    @staticmethod
    def _raw(terms: Terms, atoms: tuple[Atom, ...]) -> Sym:
        # Internal fast path: the caller guarantees canonical form.
        s = object.__new__(Sym)
        object.__setattr__(s, "terms", terms)
        object.__setattr__(s, "atoms", atoms)
        object.__setattr__(s, "_hash", hash((terms, atoms)))
        object.__setattr__(s, "_str", None)
        return s

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Sym is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Sym is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        return (Sym, (self.terms, self.atoms))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not Sym:
            return False  # constants are ints, so a Sym never equals an int
        return self._hash == other._hash and self.terms == other.terms and self.atoms == other.atoms

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    # Arithmetic: other types get NotImplemented so Python raises its usual TypeError.
    def __add__(self, o: Dim) -> Dim:
        return add(self, o) if _is_int_or_sym(o) else NotImplemented

    __radd__ = __add__

    def __sub__(self, o: Dim) -> Dim:
        return sub(self, o) if _is_int_or_sym(o) else NotImplemented

    def __rsub__(self, o: Dim) -> Dim:
        return sub(o, self) if _is_int_or_sym(o) else NotImplemented

    def __mul__(self, o: Dim) -> Dim:
        return mul(self, o) if _is_int_or_sym(o) else NotImplemented

    __rmul__ = __mul__

    def __floordiv__(self, o: Dim) -> Dim:
        return div(self, o) if _is_int_or_sym(o) else NotImplemented

    def __rfloordiv__(self, o: Dim) -> Dim:
        return div(o, self) if _is_int_or_sym(o) else NotImplemented

    def __mod__(self, o: Dim) -> Dim:
        raise TypeError(f"% is not supported on symbolic size {self}")

    __rmod__ = __mod__

    def __neg__(self) -> Dim:
        return mul(self, -1)

    def __pos__(self) -> Sym:
        return self

    # Ordering answers "proven for all valuations"; unknown is False.
    def __lt__(self, o: Dim) -> bool:
        return lt(self, o) if _is_int_or_sym(o) else NotImplemented

    def __le__(self, o: Dim) -> bool:
        return le(self, o) if _is_int_or_sym(o) else NotImplemented

    def __gt__(self, o: Dim) -> bool:
        return gt(self, o) if _is_int_or_sym(o) else NotImplemented

    def __ge__(self, o: Dim) -> bool:
        return ge(self, o) if _is_int_or_sym(o) else NotImplemented

    # A Sym used where a concrete size is needed must fail loudly.
    def __index__(self) -> int:
        raise TypeError(f"symbolic size {self} used as a concrete integer")

    def __int__(self) -> int:
        raise TypeError(f"symbolic size {self} used as a concrete integer")

    def __bool__(self) -> bool:
        raise TypeError(f"truth value of symbolic size {self} is unknown")

    def __str__(self) -> str:
        if self._str is None:
            object.__setattr__(self, "_str", _show(self.terms))
        return self._str  # type: ignore[return-value]

    def __repr__(self) -> str:
        # the plain text: shapes in messages print as [T/2, H], as users write them
        return str(self)


Dim: TypeAlias = int | Sym


def _is_int_or_sym(x: object) -> bool:
    return isinstance(x, int | Sym)


# --- canonical form -----------------------------------------------------------------------------


def _validate(terms: object, atoms: object) -> None:
    """Reject anything that is not exactly the canonical form (used when unpickling)."""
    if type(terms) is not tuple or type(atoms) is not tuple:
        raise ValueError("Sym terms and atoms must be tuples")
    used: set[str] = set()
    prev: Mono | None = None
    for t in terms:
        if type(t) is not tuple or len(t) != 2:
            raise ValueError("malformed Sym term")
        mono, c = t
        if type(mono) is not tuple or type(c) is not Fraction or c == 0:
            raise ValueError("malformed Sym term")
        if type(c.numerator) is not int or type(c.denominator) is not int:
            raise ValueError("malformed Sym coefficient")
        last = None
        for f in mono:
            if type(f) is not tuple or len(f) != 2:
                raise ValueError("malformed Sym monomial")
            n, p = f
            bad_order = last is not None and n <= last
            if type(n) is not str or type(p) is not int or p < 1 or bad_order:
                raise ValueError("malformed Sym monomial")
            last = n
            used.add(n)
        if prev is not None and mono <= prev:
            raise ValueError("Sym terms are not sorted")
        prev = mono
    if not used:
        raise ValueError("a constant Sym must be an int")
    names: list[str] = []
    for a in atoms:
        if type(a) is not Atom:
            raise ValueError("Sym atoms must be Atoms")
        names.append(a.name)
    if names != sorted(used):
        raise ValueError("Sym atoms do not match the atoms used")


def _to_poly(d: Dim) -> tuple[Poly, dict[str, Atom]]:
    if type(d) is Sym:
        return dict(d.terms), {a.name: a for a in d.atoms}
    if isinstance(d, int):
        n = int(d)
        return ({(): Fraction(n)} if n else {}), {}
    raise TypeError(f"not a size: {d!r}")


def _merge_atoms(x: dict[str, Atom], y: dict[str, Atom]) -> dict[str, Atom]:
    if not y:
        return x
    out = dict(x)
    for n, a in y.items():
        old = out.setdefault(n, a)
        if old != a:
            raise ValueError(f"symbol {n!r} is defined twice differently: {old} vs {a}")
    return out


def _make(poly: Poly, atoms: dict[str, Atom]) -> Dim:
    """Canonicalize: drop zero terms, sort, keep only used atoms; constants become ints."""
    items = sorted((m, c) for m, c in poly.items() if c != 0)
    if not items:
        return 0
    if len(items) == 1 and items[0][0] == ():
        c = items[0][1]
        if c.denominator != 1:
            raise ValueError(f"non-integer constant size {c}")
        return int(c)
    used = sorted({n for m, _ in items for n, _ in m})
    return Sym._raw(tuple(items), tuple(atoms[n] for n in used))


def _mono_mul(a: Mono, b: Mono) -> Mono:
    if not a:
        return b
    if not b:
        return a
    d = dict(a)
    for n, p in b:
        d[n] = d.get(n, 0) + p
    return tuple(sorted(d.items()))


def _poly_mul(a: Poly, b: Poly) -> Poly:
    out: Poly = {}
    for ma, ca in a.items():
        for mb, cb in b.items():
            m = _mono_mul(ma, mb)
            out[m] = out.get(m, Fraction(0)) + ca * cb
    return out


def _poly_add(a: Poly, b: Poly, sign: int) -> Poly:
    out = dict(a)
    for m, c in b.items():
        out[m] = out.get(m, Fraction(0)) + sign * c
    return out


def _show(terms: Terms) -> str:
    # Highest degree first, constant last: deterministic and re-parseable by `parse`.
    order = sorted(terms, key=lambda t: (-sum(p for _, p in t[0]), t[0]))
    out = ""
    for i, (mono, c) in enumerate(order):
        neg = c < 0
        num, den = abs(c.numerator), c.denominator
        body = "*".join(n for n, p in mono for _ in range(p))
        if not body:
            text = str(num) if den == 1 else f"{num}/{den}"
        else:
            text = body if num == 1 else f"{num}*{body}"
            if den != 1:
                text += f"/{den}"
        if i == 0:
            out = ("-" if neg else "") + text
        else:
            out += (" - " if neg else " + ") + text
    return out


# --- public constructors and arithmetic ---------------------------------------------------------


def sym(name: str, min: int = 1, multiple: int = 1) -> Sym:
    """A single atom `name` ranging over {min, ...} ∩ multiples of `multiple`."""
    a = Atom(name, min, multiple)
    return Sym._raw(((((name, 1),), Fraction(1)),), (a,))


def is_concrete(d: Dim) -> bool:
    return type(d) is not Sym


def atoms_of(d: Dim) -> dict[str, Atom]:
    """Every atom in `d`, including those inside opaque floor atoms (filter on `.floor`)."""
    if type(d) is not Sym:
        return {}
    return dict(_all_atoms(d))


@functools.lru_cache(maxsize=_CACHE)
def _all_atoms(d: Sym) -> tuple[tuple[str, Atom], ...]:
    out: dict[str, Atom] = {}
    for a in d.atoms:
        out = _merge_atoms(out, {a.name: a})
        if a.floor is not None:
            for x in a.floor:
                out = _merge_atoms(out, atoms_of(x))
    return tuple(sorted(out.items()))


def add(a: Dim, b: Dim) -> Dim:
    if type(a) is int and type(b) is int:
        return a + b
    return _binop("+", a, b)


def sub(a: Dim, b: Dim) -> Dim:
    if type(a) is int and type(b) is int:
        return a - b
    return _binop("-", a, b)


def mul(a: Dim, b: Dim) -> Dim:
    if type(a) is int and type(b) is int:
        return a * b
    return _binop("*", a, b)


@functools.lru_cache(maxsize=_CACHE)
def _binop(op: str, a: Dim, b: Dim) -> Dim:
    pa, aa = _to_poly(a)
    pb, ab = _to_poly(b)
    atoms = _merge_atoms(aa, ab)
    if op == "+":
        return _make(_poly_add(pa, pb, 1), atoms)
    if op == "-":
        return _make(_poly_add(pa, pb, -1), atoms)
    return _make(_poly_mul(pa, pb), atoms)


def integral(d: Dim) -> bool:
    """Proven integer for all valuations (sufficient: every term is integral on its own)."""
    if type(d) is not Sym:
        return True
    mult = {a.name: a.multiple for a in d.atoms}
    for mono, c in d.terms:
        scale = 1
        for n, p in mono:
            scale *= mult[n] ** p
        if (c * scale).denominator != 1:
            return False
    return True


def _exact_quotient(a: Dim, b: Dim) -> Dim | None:
    """a / b as an integral polynomial when b is a single term dividing every term of a."""
    if type(b) is int:
        if b == 0:
            raise ZeroDivisionError(f"{a} divided by 0")
        if b == 1:
            return a
    pa, aa = _to_poly(a)
    pb, ab = _to_poly(b)
    if len(pb) != 1:
        return None
    ((mb, cb),) = pb.items()
    db = dict(mb)
    q: Poly = {}
    for ma, ca in pa.items():
        rest = dict(ma)
        for n, p in db.items():
            if rest.get(n, 0) < p:
                return None
            rest[n] -= p
        q[tuple(sorted((n, p) for n, p in rest.items() if p))] = ca / cb
    res = _make(q, _merge_atoms(aa, ab))
    return res if integral(res) else None


@functools.lru_cache(maxsize=_CACHE)
def div(a: Dim, b: Dim) -> Dim:
    """floor(a / b): exact when provably divisible, else an opaque floor atom."""
    if type(a) is int and type(b) is int:
        return a // b
    if type(b) is int and b == 0:
        raise ZeroDivisionError(f"{a} divided by 0")
    if a == b:
        return 1  # b's zeros are division by zero anyway
    if type(b) is int:
        # Normalize floor(g*a'/(g*b')) to floor(a'/b') with b' > 0 so equal floors share a name.
        pa, _ = _to_poly(a)
        if all(c.denominator == 1 for c in pa.values()):
            g = math.gcd(b, *(c.numerator for c in pa.values())) * (1 if b > 0 else -1)
            if g != 1:
                return div(exact_div(a, g), b // g)
    q = _exact_quotient(a, b)
    if q is not None:
        return q
    atom = Atom(_floor_name(a, b), 0, 1, (a, b))
    return Sym._raw(((((atom.name, 1),), Fraction(1)),), (atom,))


def exact_div(a: Dim, b: Dim) -> Dim:
    """a / b, which must be provably exact (else ValueError)."""
    if type(a) is int and type(b) is int:
        if b == 0:
            raise ZeroDivisionError(f"{a} divided by 0")
        if a % b:
            raise ValueError(f"{a} is not provably divisible by {b}")
        return a // b
    q = _exact_quotient(a, b)
    if q is None:
        raise ValueError(f"{a} is not provably divisible by {b}")
    return q


def divides(k: Dim, n: Dim) -> bool:
    """k provably divides n (k == 0 never does)."""
    if type(k) is int and type(n) is int:
        return k != 0 and n % k == 0
    if type(k) is int and k == 0:
        return False
    return _exact_quotient(n, k) is not None


def eq(a: Dim, b: Dim) -> bool:
    return a == b


# --- comparisons ---------------------------------------------------------------------------------


def le(a: Dim, b: Dim) -> bool:
    if type(a) is int and type(b) is int:
        return a <= b
    return _le(a, b)


def lt(a: Dim, b: Dim) -> bool:
    if type(a) is int and type(b) is int:
        return a < b
    return _lt(a, b)


def ge(a: Dim, b: Dim) -> bool:
    return le(b, a)


def gt(a: Dim, b: Dim) -> bool:
    return lt(b, a)


def ne(a: Dim, b: Dim) -> bool:
    if type(a) is int and type(b) is int:
        return a != b
    return _ne(a, b)


@functools.lru_cache(maxsize=_CACHE)
def _le(a: Dim, b: Dim) -> bool:
    return _nonneg(sub(b, a), strict=False)


@functools.lru_cache(maxsize=_CACHE)
def _lt(a: Dim, b: Dim) -> bool:
    d = sub(b, a)
    if integral(d):
        # Integer-valued: d > 0 iff d - 1 >= 0, which the fast check handles far more often.
        return _nonneg(sub(d, 1), strict=False)
    return _nonneg(d, strict=True)


@functools.lru_cache(maxsize=_CACHE)
def _ne(a: Dim, b: Dim) -> bool:
    if a == b:
        return False
    if lt(a, b) or gt(a, b):
        return True
    d = sub(a, b)
    return type(d) is int or _z3_prove(d, "ne")


def _nonneg(p: Dim, strict: bool) -> bool:
    if type(p) is int:
        return p > 0 if strict else p >= 0
    return _fast_nonneg(p, strict) or _z3_prove(p, "gt" if strict else "ge")


def _ceil_multiple(lo: int, m: int) -> int:
    return -(-lo // m) * m


@functools.lru_cache(maxsize=_CACHE)
def _floor_sign(atom: Atom) -> int:
    """+1 if the floor atom is proven >= 0, 0 if unknown (floor(a/b) may be negative)."""
    assert atom.floor is not None
    a, b = atom.floor
    if (ge(a, 0) and gt(b, 0)) or (le(a, 0) and lt(b, 0)):
        return 1
    return 0


# A size is a polynomial, and arithmetic multiplies terms: a product of n sums of k symbols
# has k^n terms (a 300-byte size has 8^40), and the fast comparison expands each monomial
# x1^p1 ... xk^pk, one factor at a time, into (p1 + 1) ... (pk + 1) terms (2^40 for a
# product of 40 symbols). Programs write sizes of a few terms of low degree (B*S*H/tp: one
# term, 24 steps), so a size read from a file is refused when those steps pass EXPANSION,
# far above what programs write and far below where the arithmetic stops being instant; a
# product of such sizes (a tensor's elements) beyond it is left to Z3, whose time is bounded.
EXPANSION = 1 << 14


def _expansion(p: Sym) -> int:
    """About the products the fast comparison takes: per monomial, its degree times the terms
    it expands into."""
    return sum(sum(k for _, k in mono) * math.prod(k + 1 for _, k in mono) for mono, _ in p.terms)


@functools.lru_cache(maxsize=_CACHE)
def _fast_nonneg(p: Sym, strict: bool) -> bool:
    """Shift each atom x = m0 + multiple*t (t >= 0 real); all coefficients >= 0 proves p >= 0."""
    if _expansion(p) > EXPANSION:
        return False  # not proven here (Z3 may)
    shifts: dict[str, Poly] = {}
    for a in p.atoms:
        if a.floor is not None:
            if _floor_sign(a) <= 0:
                return False  # no lower bound known for this atom
            m0, m = 0, 1
        else:
            m0, m = _ceil_multiple(a.min, a.multiple), a.multiple
        shifts[a.name] = {(): Fraction(m0), ((a.name, 1),): Fraction(m)}
    total: Poly = {}
    for mono, c in p.terms:
        term: Poly = {(): c}
        for n, k in mono:
            for _ in range(k):
                term = _poly_mul(term, shifts[n])
        total = _poly_add(total, term, 1)
    if any(c < 0 for c in total.values()):
        return False
    return not strict or total.get((), Fraction(0)) > 0


@functools.lru_cache(maxsize=_CACHE)
def _z3_prove(p: Sym, goal: str) -> bool:
    """Z3 over integers: goal ('ge' p >= 0, 'gt' p > 0, 'ne' p != 0) proven iff negation unsat."""
    import z3

    atoms = dict(_all_atoms(p))
    var: dict[str, Any] = {}
    side: list[Any] = []
    for i, (n, a) in enumerate(sorted(atoms.items())):
        if a.floor is None:
            k = z3.Int(f"k{i}")
            var[n] = a.multiple * k
            side.append(k >= _ceil_multiple(a.min, a.multiple) // a.multiple)
        else:
            var[n] = z3.Int(f"f{i}")
    for n, a in atoms.items():
        if a.floor is None:
            continue
        f = var[n]
        num, den_a = _z3_poly(a.floor[0], var)  # a = num / den_a
        bz, den_b = _z3_poly(a.floor[1], var)  # b = bz / den_b
        # Scale by den_a*den_b > 0 to stay in integers: f = floor(a/b).
        lhs, rhs = den_a * bz * f, den_b * num
        b = a.floor[1]
        if gt(b, 0):
            side += [lhs <= rhs, rhs < lhs + den_a * bz]
        elif lt(b, 0):
            side += [lhs >= rhs, rhs > lhs + den_a * bz]
        if _floor_sign(a) > 0:
            side.append(f >= 0)
    e, _ = _z3_poly(p, var)
    neg = {"ge": e < 0, "gt": e <= 0, "ne": e == 0}[goal]
    s = z3.Solver()
    s.set("timeout", _Z3_TIMEOUT_MS)
    s.add(*side, neg)
    return bool(s.check() == z3.unsat)


def _z3_poly(d: Dim, var: dict[str, Any]) -> tuple[Any, int]:
    """(e, D) with d = e / D, e an integer Z3 expression and D > 0."""
    import z3

    poly, _ = _to_poly(d)
    den = math.lcm(*(c.denominator for c in poly.values())) if poly else 1
    parts: list[Any] = []
    for mono, c in poly.items():
        t: Any = z3.IntVal(int(c * den))
        for n, k in mono:
            for _ in range(k):
                t = t * var[n]
        parts.append(t)
    return (z3.Sum(*parts) if parts else z3.IntVal(0)), den


# --- evaluation ----------------------------------------------------------------------------------


def substitute(d: Dim, values: dict[str, int]) -> int:
    """Evaluate at a valuation; values must respect each symbol's min and multiple."""
    if type(d) is not Sym:
        return int(d)
    env: dict[str, int] = {}
    for a in d.atoms:
        if a.floor is not None:
            env[a.name] = substitute(a.floor[0], values) // substitute(a.floor[1], values)
            continue
        if a.name not in values:
            raise KeyError(f"no value for symbol {a.name!r}")
        v = values[a.name]
        if v < a.min or v % a.multiple:
            raise ValueError(f"{a.name}={v} violates min={a.min}, multiple={a.multiple}")
        env[a.name] = v
    total = Fraction(0)
    for mono, c in d.terms:
        t = c
        for n, p in mono:
            t *= env[n] ** p
        total += t
    if total.denominator != 1:
        raise ValueError(f"{d} is not an integer at {values}")
    return int(total)


# --- parsing -------------------------------------------------------------------------------------

_TOKEN = re.compile(r"\s*(?:(?P<int>[0-9]+)|(?P<name>[^\W\d]\w*)|(?P<op>[-+*/()])|(?P<bad>\S))")
_MAX_DEPTH = 200


def _too_complex(d: Dim) -> str | None:
    """Why a size read from a file is refused: see EXPANSION."""
    if type(d) is Sym and (n := _expansion(d)) > EXPANSION:
        return f"comparing it would take {n} steps of expansion; refine reads sizes of at most {EXPANSION}"
    return None


def parse(text: str, symbols: dict[str, Sym]) -> Dim:
    """Parse integers, names from `symbols`, + - * / ( ) and unary minus. Never evaluates code.

    `/` is exact division: ValueError if not provably divisible.
    """
    toks: list[tuple[str, str, int]] = []
    pos = 0
    while True:
        m = _TOKEN.match(text, pos)
        if m is None:
            break  # only trailing whitespace left
        kind = m.lastgroup or "bad"
        if kind == "bad":
            raise ValueError(f"unexpected character {m.group(kind)!r} at {m.start(kind)}")
        toks.append((kind, m.group(kind), m.start(kind)))
        pos = m.end()
    toks.append(("end", "", len(text)))
    i = 0

    def peek() -> tuple[str, str, int]:
        return toks[i]

    def unexpected() -> ValueError:
        kind, s, at = toks[i]
        what = "end of input" if kind == "end" else repr(s)
        return ValueError(f"unexpected {what} at {at}")

    def bounded(d: Dim, at: int) -> Dim:
        problem = _too_complex(d)
        if problem:
            raise ValueError(f"size too complex at {at}: {problem}")
        return d

    def expr(depth: int) -> Dim:
        nonlocal i
        acc = term(depth)
        while peek()[1] in ("+", "-") and peek()[0] == "op":
            op, at = peek()[1], peek()[2]
            i += 1
            rhs = term(depth)
            acc = bounded(add(acc, rhs) if op == "+" else sub(acc, rhs), at)
        return acc

    def term(depth: int) -> Dim:
        nonlocal i
        acc = unary(depth)
        while peek()[0] == "op" and peek()[1] in ("*", "/"):
            op, at = peek()[1], peek()[2]
            i += 1
            rhs = unary(depth)
            if op == "*":
                acc = bounded(mul(acc, rhs), at)
                continue
            try:
                acc = exact_div(acc, rhs)
            except ZeroDivisionError:
                raise ValueError(f"division by zero at {at}") from None
            except ValueError as e:
                raise ValueError(f"{e} (at {at})") from None
        return acc

    def unary(depth: int) -> Dim:
        nonlocal i
        if depth > _MAX_DEPTH:
            raise ValueError(f"expression nested too deeply at {peek()[2]}")
        if peek()[0] == "op" and peek()[1] in ("-", "+"):
            op = peek()[1]
            i += 1
            v = unary(depth + 1)
            return sub(0, v) if op == "-" else v
        return primary(depth)

    def primary(depth: int) -> Dim:
        nonlocal i
        kind, s, at = peek()
        if kind == "int":
            i += 1
            return int(s)
        if kind == "name":
            if s not in symbols:
                raise ValueError(f"unknown symbol {s!r} at {at}")
            v = symbols[s]
            if not _is_dim(v):
                raise ValueError(f"symbol {s!r} is not a size")
            i += 1
            return v
        if kind == "op" and s == "(":
            i += 1
            v = expr(depth + 1)
            if peek()[1] != ")" or peek()[0] != "op":
                k2, s2, at2 = peek()
                got = "end of input" if k2 == "end" else repr(s2)
                raise ValueError(f"expected ')' but got {got} at {at2}")
            i += 1
            return v
        raise unexpected()

    result = expr(0)
    if peek()[0] != "end":
        raise unexpected()
    return result


# --- serialization -------------------------------------------------------------------------------

_ALLOWED = {("refine.ir.sizes", "Sym"): "Sym", ("refine.ir.sizes", "Atom"): "Atom",
            ("fractions", "Fraction"): "Fraction"}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"forbidden global {module}.{name}")
        return {"Sym": Sym, "Atom": Atom, "Fraction": Fraction}[_ALLOWED[(module, name)]]


def dumps(d: Dim) -> str:
    """Base64 text of pickle(d) -- the form egglog's `py-object` takes."""
    if not _is_dim(d):
        raise TypeError(f"not a size: {d!r}")
    return base64.standard_b64encode(pickle.dumps(d, protocol=5)).decode("ascii")


def loads(b64: str) -> Dim:
    """Inverse of `dumps`, with a restricted unpickler and full re-validation."""
    raw = base64.standard_b64decode(b64.encode("ascii") if isinstance(b64, str) else b64)
    try:
        obj = _Unpickler(io.BytesIO(raw)).load()
    except pickle.UnpicklingError:
        raise
    except Exception as e:
        raise ValueError(f"invalid size pickle: {e}") from e
    return _rebuild(obj)


def _rebuild(x: object) -> Dim:
    """Reconstruct through the validating constructors: pickle's NEWOBJ/BUILD opcodes can
    produce objects that never ran __init__."""
    if type(x) is int:
        return x
    if type(x) is not Sym:
        raise ValueError(f"pickle holds {type(x).__name__}, not a size")
    try:
        terms, atoms = x.terms, x.atoms
        # Copy the primitive parts and rebuild the objects; Sym() re-checks canonical form.
        terms = tuple((tuple(mono), _rebuild_frac(c)) for mono, c in terms)
        atoms = tuple(_rebuild_atom(a) for a in atoms)
    except (AttributeError, TypeError) as e:
        raise ValueError(f"malformed size pickle: {e}") from e
    return Sym(terms, atoms)


def _rebuild_frac(c: object) -> Fraction:
    if type(c) is not Fraction or type(c.numerator) is not int or type(c.denominator) is not int:
        raise ValueError("malformed coefficient in size pickle")
    return Fraction(c.numerator, c.denominator)


def _rebuild_atom(a: object) -> Atom:
    if type(a) is not Atom:
        raise ValueError("malformed atom in size pickle")
    f = a.floor
    if f is not None:
        if type(f) is not tuple or len(f) != 2:
            raise ValueError("malformed floor atom in size pickle")
        f = (_rebuild(f[0]), _rebuild(f[1]))
    return Atom(a.name, a.min, a.multiple, f)

