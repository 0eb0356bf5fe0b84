"""Masked terms: a `where` against zeros is linear in its kept branch, and a mask and its
complement select the same elements.

A loss that mixes its per-token terms before masking them (Megatron's label smoothing:
`where(valid, (1 - ls) * nll + ls / V * smooth, 0)`) holds neither term masked alone, while
`F.cross_entropy` masks and averages each term apart. These rules let the mixed form be
taken apart term by term:

    where(c, a + b, 0)          = where(c, a, 0) + where(c, b, 0)
    where(c, r * a, 0)          = r * where(c, a, 0)        (both ways)
    where(x == y, a, b)         = where(x != y, b, a)        (and the other way)
    not(x == y)                 = x != y                     (and the other way)
    a / cast_float(n)           = a / n                      (a cast keeps the divisor's values)
    r * (a / b)                 = (r * a) / b
    r * expand(a)               = expand(r * a)
    r * full(1.0)               = full(r)                    (r a simple rational)

The last lets a constant factor the ranks apply as an exact rational (the smoothing weight
`ls / V` times a mask) meet the sequential float constant autograd folded it into. A float
constant stands for the rational `refine.ops.lower.float_rational` reads it as (for
m * 2^e, 1/2 <= m < 1, the simplest rational rounding to m, times 2^e), so full(f) is
r * full(1.0) exactly when r is that reading of f = float(r). That holds when the odd
parts of r's numerator and denominator are under 2^25 (and r is nonzero and within 2^1000
of 1, so f is normal): then r = m' * 2^e with m' = n'/d' in [1/2, 1) and n' * d' < 2^51
(n' * d' < 2 * max(odd parts)^2). Another rational p/q rounding to float(m') with q <= d'
would differ from m' by at least 1/d'^2, yet both lie in its rounding interval, at most
2^-53 wide: so d'^2 >= 2^53 and n' * d' >= d'^2 / 2 >= 2^52, which it is not.

Each is an identity for every value of the leaves (the cast turns a bool or integer divisor
into the same reals), checked by the soundness harness on this file's seeds.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from refine.ir.term import Term
from refine.ops.registry import Helper, Rule, rewrite, rule

ZERO = "(full 0.0 s)"
BIG = "(bigint 1)"
# r = n/d is the reading of its float64 (the module docstring says why): odd parts of n and
# d under 2^25 (n / (n & -n) strips n's factors of two), |r| within 2^1000 of 1
ODD = ["(= no (/ n (& n (- (bigint 0) n))))", "(= do (/ d (& d (- (bigint 0) d))))"]
SIMPLE = ["(= n (numer r))", "(= d (denom r))", "(!= n (bigint 0))", *ODD, f"(< (* no no) (<< {BIG} 50))",
          f"(< (* do do) (<< {BIG} 50))", "(<= (bits n) (bigint 1000))", "(<= (bits d) (bigint 1000))"]

RULES: list[Rule] = [
    rule("where-zero-sum", ["(= e (where_t c (Sum ms) z))", f"(= z {ZERO})"],
         ["(union e (Sum (unstable-multiset-map (unstable-fn \"WhereZero\" c z) ms)))"]),
    rewrite("where-zero-by", "(WhereZero c z x)", "(where_t c x z)"),
    rule("where-zero-scale", ["(= e (where_t c (Scale x r) z))", f"(= z {ZERO})"],
         ["(union e (Scale (where_t c x z) r))"]),
    rule("where-zero-scale-in", ["(= e (Scale (where_t c x z) r))", f"(= z {ZERO})"],
         ["(union e (where_t c (Scale x r) z))"]),
    rewrite("scale-into-div", "(Scale (div_t a b) r)", "(div_t (Scale a r) b)"),
    rewrite("scale-into-expand", "(Scale (expand a s) r)", "(expand (Scale a r) s)"),
    rule("scale-full-one", ["(= e (Scale (full v s) r))", "(= v 1.0)", *SIMPLE],
         ["(union e (full (to-f64 r) s))"]),
    rewrite("where-eq-as-ne", "(where_t (eq_t x y) a b)", "(where_t (ne_t x y) b a)"),
    rewrite("where-ne-as-eq", "(where_t (ne_t x y) a b)", "(where_t (eq_t x y) b a)"),
    rewrite("not-eq", "(logical_not_t (eq_t x y))", "(ne_t x y)"),
    rewrite("not-ne", "(logical_not_t (ne_t x y))", "(eq_t x y)"),
    rewrite("div-by-cast", "(div_t a (cast_float_t n))", "(div_t a n)"),
]

HELPERS = [Helper("WhereZero", ("T", "T", "T"), lambda op, c, z, x: op("where_t")(c, x, z))]


def SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """Masked sums and scales, masks of comparisons and their complements, quotients by a
    cast count, on random leaves (the harness checks both sides of every merge)."""
    r = gen.rng
    out: list[Term] = []
    for _ in range(gen.instances):
        shape = (r.choice([1, 2, 3]), r.choice([1, 2, 4]))
        zero = Term("full", (), (0.0, shape))
        c = gen.leaf(shape, "b")
        a, b, d = gen.leaf(shape), gen.leaf(shape), gen.leaf(shape)
        out.append(Term("where_t", (c, Term("Sum", (a, b, d)), zero)))
        out.append(Term("WhereZero", (c, zero, a)))
        out.append(Term("where_t", (c, Term("Scale", (a,), (Fraction(r.choice([-1, 2, 3])),)), zero)))
        out.append(Term("Scale", (Term("where_t", (c, a, zero)),), (Fraction(r.choice([-1, 2, 3])),)))
        out.append(Term("Scale", (Term("div_t", (a, gen.leaf(shape, "p"))),), (Fraction(r.choice([-3, 1, 5]), 7),)))
        out.append(Term("Scale", (Term("expand", (gen.leaf((1, shape[1])),), (shape,)),), (Fraction(-2, 3),)))
        # simple rationals as factors of a float constant (1/320: the float 0.003125 stands
        # for it), and ones that are not the reading of their float (binary fractions with a
        # long numerator: they must not fire)
        one = Term("full", (), (1.0, shape))
        out += [Term("Scale", (one,), (f,)) for f in (Fraction(1, 320), Fraction(-9, 10), Fraction(1, 3),
                                                      Fraction(3, 2 ** 70), Fraction(0.1), Fraction(2 ** 60 + 1, 2 ** 60))]
        # a comparison of integer targets with a constant, its complement, and wheres over it
        t = gen.leaf(shape, "i", bound=3)
        k = Term("full", (), (float(r.choice([0, 1, 2])), shape))
        eq, ne = Term("eq_t", (t, k)), Term("ne_t", (t, k))
        out += [Term("where_t", (eq, a, b)), Term("where_t", (ne, b, zero)),
                Term("logical_not_t", (eq,)), Term("logical_not_t", (ne,))]
        # a quotient by a count of a mask, cast to float or not
        count = Term("rsum", (ne,), (1,))
        num = gen.leaf((shape[0], 1))
        out.append(Term("div_t", (num, Term("cast_float_t", (count,)))))
        out.append(Term("div_t", (num, Term("cast_float_t", (gen.leaf((shape[0], 1), "i", bound=4),)))))
    return out
