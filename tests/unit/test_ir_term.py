"""Relation terms: literals reach egglog exactly, and printing/parsing round-trips."""

from __future__ import annotations

from fractions import Fraction

from egglog import bindings

from refine.ir.sexp import parse_one
from refine.ir.term import _read_lit, cat, cat_parts, leaf, lit, parse_layout, show


def test_non_finite_floats_are_not_conflated_with_large_finite_ones() -> None:
    eg = bindings.EGraph()
    prog = ("(sort T)(constructor F (f64) T)"
            f"(let $__a (F {lit(float('-inf'), 'f64')}))(let $__b (F {lit(-1e308, 'f64')}))")
    eg.run_program(*eg.parse_program(prog))
    try:
        eg.run_program(*eg.parse_program("(check (= $__a $__b))"))
        conflated = True
    except bindings.EggSmolError:
        conflated = False
    assert not conflated
    for v in (float("inf"), float("-inf"), 1e308, -0.5, 3.0):
        assert _read_lit(parse_one(lit(v, "f64")), "f64") == v


def test_rationals_round_trip_exactly() -> None:
    text = lit(Fraction(1, 6), "BigRat")
    assert text == "(bigrat (bigint 1) (bigint 6))"


def test_layout_parses_to_a_concat() -> None:
    t = parse_layout("cat(slice(qkv@0, 0, 0, 4), slice(qkv@1, 0, 0, 4), dim=0)")
    assert t.op == "cat" and t.attrs == (0,)
    assert t.leaves() == {"qkv@0", "qkv@1"}
    assert show(t) == "cat(slice(qkv@0, dim=0, 0:4), slice(qkv@1, dim=0, 0:4), dim=0)"
    assert show(leaf("x@1")) == "x@1"


def _depth(t: object) -> int:
    return 1 + max((_depth(a) for a in t.args if a.op == "cat"), default=0)  # type: ignore[attr-defined]


def test_concats_nest_as_balanced_trees_and_print_flat() -> None:
    """A concat of n pieces is log2(n) cats deep (rules split an op over it level by level),
    up to 3 pieces the right-nested chain, and prints and parses back flat."""
    for n, depth in ((2, 1), (3, 2), (4, 2), (6, 3), (8, 3), (16, 4)):
        parts = [leaf(f"x@{r}") for r in range(n)]
        t = cat(parts, 1)
        assert _depth(t) == depth, n
        assert cat_parts(t) == parts
        text = f"cat({', '.join(f'x@{r}' for r in range(n))}, dim=1)"
        assert show(t) == text and parse_layout(text) == t
    a, b, c = leaf("a@0"), leaf("b@0"), leaf("c@0")
    assert cat([a, b, c], 0) == cat([a, cat([b, c], 0)], 0)
    # a nested concat along another dim is a piece of its own
    mixed = cat([cat([a, b], 1), c], 0)
    assert cat_parts(mixed) == [cat([a, b], 1), c]
    assert show(mixed) == "cat(cat(a@0, b@0, dim=1), c@0, dim=0)"
