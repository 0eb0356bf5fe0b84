"""Symbolic sizes: canonical form, sound comparisons, exact division, parsing, safe pickling."""

from __future__ import annotations

import base64
import pickle
import random
from collections.abc import Callable
from fractions import Fraction

import pytest
from egglog import bindings

from refine.ir import sizes
from refine.ir.sizes import (
    Dim,
    Sym,
    add,
    atoms_of,
    div,
    dumps,
    exact_div,
    ge,
    gt,
    integral,
    is_concrete,
    le,
    loads,
    lt,
    mul,
    ne,
    parse,
    sub,
    substitute,
    sym,
)

S = sym("S")
B = sym("B")


# --- random polynomials ------------------------------------------------------------------------


def _random_atoms(rng: random.Random) -> dict[str, Sym]:
    names = rng.sample(["S", "B", "H", "K"], rng.randint(2, 3))
    return {n: sym(n, rng.randint(0, 3), rng.choice([1, 1, 2, 4])) for n in names}


def _random_expr(rng: random.Random, atoms: dict[str, Sym], depth: int,
                 floors: bool = False) -> Dim:
    if depth == 0 or rng.random() < 0.25:
        return rng.choice(list(atoms.values())) if rng.random() < 0.6 else rng.randint(-3, 5)
    a = _random_expr(rng, atoms, depth - 1, floors)
    if floors and rng.random() < 0.2:
        return div(a, rng.choice([2, 3, -2]))  # may be opaque, may be negative
    b = _random_expr(rng, atoms, depth - 1, floors)
    return rng.choice([add, sub, mul])(a, b)


def _random_valuation(rng: random.Random, *ds: Dim) -> dict[str, int]:
    out: dict[str, int] = {}
    for n, a in {k: v for d in ds for k, v in atoms_of(d).items()}.items():
        if a.floor is None:
            lo = -(-a.min // a.multiple)
            out[n] = a.multiple * rng.randint(lo, lo + 6)
    return out


# --- canonical form ----------------------------------------------------------------------------


def test_equal_polynomials_are_equal_objects() -> None:
    p = (S + 1) * (S - 1)
    assert p == S * S - 1 and hash(p) == hash(S * S - 1)
    assert (S + B) * 2 == 2 * B + S + S
    assert S - S == 0 and type(S - S) is int
    assert type((S + 1) - S) is int
    assert 2 * S // 2 == S and (S * B) // S == B
    assert S != S + 1 and S != 1 and (S == 1) is False
    assert is_concrete(3) and not is_concrete(S)
    # A cancelled atom must not linger in `atoms`, or equal values would compare unequal.
    assert (S + B) - B == S and (S + B - B).atoms == S.atoms


def test_same_name_with_different_constraints_is_rejected() -> None:
    with pytest.raises(ValueError, match="defined twice"):
        S + sym("S", multiple=2)


def test_random_polynomials_agree_with_numeric_evaluation() -> None:
    rng = random.Random(0)
    for _ in range(200):
        atoms = _random_atoms(rng)
        x, y, z = (_random_expr(rng, atoms, 3) for _ in range(3))
        assert add(x, y) == add(y, x) and hash(add(x, y)) == hash(add(y, x))
        assert mul(x, y) == mul(y, x)
        assert add(add(x, y), z) == add(x, add(y, z))
        assert mul(mul(x, y), z) == mul(x, mul(y, z))
        assert mul(x, add(y, z)) == add(mul(x, y), mul(x, z))
        assert sub(x, x) == 0
        e = sub(mul(add(x, y), z), x)
        for _ in range(5):
            v = _random_valuation(rng, x, y, z)
            sx, sy, sz = (substitute(t, v) for t in (x, y, z))
            assert substitute(e, v) == (sx + sy) * sz - sx
        if isinstance(e, Sym):
            assert parse(str(e), atoms) == e


def test_str_is_canonical_and_readable() -> None:
    s4 = sym("S", multiple=2)
    assert str(2 * s4 * B + exact_div(s4, 2) + 1) == "2*B*S + S/2 + 1"
    assert str(1 - S) == "-S + 1"
    assert repr(S * S - 3 * S) == "S*S - 3*S"  # messages print shapes as users write them


def test_sym_is_not_a_concrete_int() -> None:
    with pytest.raises(TypeError, match="S"):
        range(S)  # type: ignore[call-overload]
    with pytest.raises(TypeError):
        int(S)
    with pytest.raises(TypeError):
        bool(S)
    with pytest.raises(TypeError):
        S % 2  # noqa: B018
    with pytest.raises(AttributeError):
        S.terms = ()  # type: ignore[misc]


def test_sym_validates_name_and_bounds() -> None:
    for bad in [("1S", 1, 1), ("S", -1, 1), ("S", 1, 0), ("a b", 1, 1)]:
        with pytest.raises(ValueError):
            sym(*bad)


# --- comparisons -------------------------------------------------------------------------------


def test_proven_comparisons() -> None:
    assert le(S, 2 * S) and lt(S, S + 1) and ge(S * S, S) and gt(S + 1, 0)
    assert S < S + 1 and S <= S and 2 * S >= S and 1 <= S
    assert not le(S + B, S * B)  # S = B = 1 gives 2 > 1
    assert le(S + B, S * B + 1)
    assert not lt(S, S) and not le(2 * S, S) and not ge(S, 2)
    # S >= 2 and B >= 2 makes S + B <= S*B true.
    s2, b2 = sym("S", min=2), sym("B", min=2)
    assert le(s2 + b2, s2 * b2)
    # Neither order is provable: `not (a < b)` must not turn into a >= b.
    assert not lt(S, B) and not ge(S, B)
    assert ne(S, S + 1) and not ne(S, B) and not ne(S, S)


def test_comparisons_that_need_z3() -> None:
    # S*S - 3*S + 2 = (S-1)(S-2) >= 0 on integers, but the shifted polynomial t*t - t is
    # negative at t = 1/2, so the coefficient check alone cannot prove it.
    p = S * S - 3 * S + 2
    assert isinstance(p, Sym) and not sizes._fast_nonneg(p, False)
    assert le(3 * S - 2, S * S)
    assert not le(4 * S - 3, S * S)  # S = 2: 5 > 4
    # Parity: 2*S is never 3; a square is never 2.
    assert ne(2 * S, 3) and ne(S * S, 2) and not ne(S * S, 4)


def test_comparisons_with_multiples() -> None:
    s4 = sym("S", min=1, multiple=4)  # S in {4, 8, ...}
    assert le(4, s4) and lt(3, s4) and not lt(4, s4)
    assert ne(s4, 6) and not ne(s4, 8)


def _check(rel: Callable[[Dim, Dim], bool], num: Callable[[int, int], bool],
           p: Dim, q: Dim, rng: random.Random) -> int:
    if not rel(p, q):
        return 0
    for _ in range(50):
        v = _random_valuation(rng, p, q)
        assert num(substitute(p, v), substitute(q, v)), (rel.__name__, p, q, v)
    return 1


def test_comparisons_are_sound_on_random_polynomials() -> None:
    rng = random.Random(1)
    proven = 0
    rels = [(le, int.__le__), (lt, int.__lt__), (ge, int.__ge__), (gt, int.__gt__),
            (ne, int.__ne__)]
    for _ in range(150):
        atoms = _random_atoms(rng)
        p = _random_expr(rng, atoms, 2, floors=True)
        r = _random_expr(rng, atoms, 2, floors=True)
        q = add(p, r) if rng.random() < 0.5 else r
        for rel, num in rels:
            proven += _check(rel, num, p, q, rng)
    assert proven > 50  # the property is not vacuous


# --- division ----------------------------------------------------------------------------------


def test_exact_division_respects_multiples() -> None:
    s4 = sym("S", multiple=4)
    assert integral(exact_div(s4, 2)) and integral(3) and integral(div(S, 2))
    assert not integral(Sym((((("S", 1),), Fraction(1, 2)),), (sizes.Atom("S"),)))
    half = exact_div(s4, 2)
    assert isinstance(half, Sym) and half.terms[0][1] == Fraction(1, 2)
    assert mul(half, 2) == s4 and substitute(half, {"S": 12}) == 6
    assert exact_div(3 * s4 * B, s4) == 3 * B
    with pytest.raises(ValueError, match="not provably divisible"):
        exact_div(s4, 8)
    with pytest.raises(ValueError, match="not provably divisible"):
        exact_div(S, 2)
    with pytest.raises(ValueError):
        exact_div(7, 2)
    with pytest.raises(ZeroDivisionError):
        div(S, 0)
    assert div(7, 2) == 3 and exact_div(8, 2) == 4


def test_opaque_floor_atoms() -> None:
    f = div(S, 2)
    assert isinstance(f, Sym) and f != S and str(f) == "⌊(S)/(2)⌋"
    assert div(S, 2) == f and div(2 * S, 4) == f  # common factors do not split names
    (atom,) = f.atoms
    assert atom.floor == (S, 2) and atom.min == 0
    for s in range(1, 9):
        assert substitute(f, {"S": s}) == s // 2
        assert substitute(div(S - 5, 3) + S, {"S": s}) == (s - 5) // 3 + s
    assert le(0, f) and le(f, S) and lt(f, S)
    # S - 5 can be negative: the floor must not be assumed >= 0.
    g = div(S - 5, 3)
    assert not le(0, g) and le(g, S) and ge(g, -2)
    with pytest.raises(KeyError, match="S"):
        substitute(f, {})


# --- parsing -----------------------------------------------------------------------------------


def test_parse() -> None:
    s4 = sym("S", multiple=4)
    syms = {"S": s4, "B": B}
    assert parse("2*S + B/1", syms) == 2 * s4 + B
    assert parse(" -(S - 1) * (B + 2) ", syms) == (1 - s4) * (B + 2)
    assert parse("S/2 + 3", syms) == exact_div(s4, 2) + 3
    assert parse("12 / 4", {}) == 3 and parse("--3", {}) == 3


@pytest.mark.parametrize("text,msg", [
    ("2*X", "unknown symbol 'X' at 2"),
    ("S $ 2", "unexpected character '\\$' at 2"),
    ("(S + 1", "expected '\\)' but got end of input at 6"),
    ("S + 1)", "unexpected '\\)' at 5"),
    ("S B", "unexpected 'B' at 2"),
    ("", "unexpected end of input at 0"),
    ("S +", "unexpected end of input at 3"),
    ("B/2", "not provably divisible"),
    ("S/0", "division by zero at 1"),
    ("__import__('os')", "unexpected character \"'\" at 11"),
    ("__import__", "unknown symbol '__import__' at 0"),
    ("S.__class__", "unexpected character '\\.' at 1"),
    ("(" * 500 + "S" + ")" * 500, "nested too deeply"),
])
def test_parse_errors(text: str, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        parse(text, {"S": S, "B": B})


# --- serialization -----------------------------------------------------------------------------


def test_dumps_loads_round_trip() -> None:
    s4 = sym("S", min=2, multiple=4)
    for d in [0, -7, 2**80, S, s4 * B - 3, exact_div(s4, 4) + 1, div(S + 1, 2) * B,
              div(div(S, B) + 1, 3)]:
        text = dumps(d)
        assert text.isascii()
        back = loads(text)
        assert back == d and type(back) is type(d) and hash(back) == hash(d)


class _Evil:
    def __reduce__(self) -> tuple[object, ...]:
        import os

        return (os.system, ("true",))


def test_loads_rejects_foreign_globals() -> None:
    evil = base64.standard_b64encode(pickle.dumps(_Evil(), protocol=5)).decode()
    with pytest.raises(pickle.UnpicklingError, match="system"):
        loads(evil)


def test_loads_rejects_non_sizes_and_non_canonical_syms() -> None:
    def b64(obj: object) -> str:
        return base64.standard_b64encode(pickle.dumps(obj, protocol=5)).decode()

    with pytest.raises(ValueError, match="list"):
        loads(b64([1, 2]))
    with pytest.raises(ValueError):
        loads(b64(True))
    # Hand-built Sym pickles bypassing the arithmetic: constant, unsorted, zero coefficient.
    a = sizes.Atom("S")
    one = Fraction(1)
    for terms in [(((), one),), ((((("S", 1),), one)), ((), one)),
                  (((("S", 1),), Fraction(0)),)]:
        forged = object.__new__(Sym)
        for k, v in (("terms", terms), ("atoms", (a,)), ("_hash", 0), ("_str", None)):
            object.__setattr__(forged, k, v)
        with pytest.raises(ValueError):
            loads(b64(forged))


# --- egglog ------------------------------------------------------------------------------------


def test_egglog_sees_equal_syms_as_equal() -> None:
    eg = bindings.EGraph()
    prog = f"""
    (sort T)
    (constructor L (PyObject) T)
    (let $dadd (py-eval "__import__('refine.ir.sizes', fromlist=['add']).add" (py-dict) (py-dict)))
    (let $x (L (py-call $dadd (py-object "{dumps(S)}") (py-object "{dumps(S)}"))))
    (check (= $x (L (py-object "{dumps(2 * S)}"))))
    """
    eg.run_program(*eg.parse_program(prog))
    with pytest.raises(bindings.EggSmolError):
        eg.run_program(*eg.parse_program(f'(check (= $x (L (py-object "{dumps(3 * S)}"))))'))


def test_divides() -> None:
    s = sizes.sym("S", multiple=4)
    t = sizes.sym("T")
    assert sizes.divides(2, s) and sizes.divides(4, 3 * s) and not sizes.divides(8, s)
    assert not sizes.divides(2, t) and sizes.divides(t, t * s) and not sizes.divides(0, 0)
    assert sizes.divides(3, 12) and not sizes.divides(5, 12)
