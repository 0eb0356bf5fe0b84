"""Relation terms: literals reach egglog exactly, and printing/parsing round-trips."""

from __future__ import annotations

from fractions import Fraction

from egglog import bindings

from refine.expr import _read_lit, leaf, lit, parse_layout, show


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
        assert _read_lit(lit(v, "f64"), "f64") == v


def test_rationals_round_trip_exactly() -> None:
    text = lit(Fraction(1, 6), "BigRat")
    assert text == "(bigrat (bigint 1) (bigint 6))"


def test_layout_parses_to_right_nested_concat() -> None:
    t = parse_layout("cat(slice(qkv@0, 0, 0, 4), slice(qkv@1, 0, 0, 4), dim=0)")
    assert t.op == "cat" and t.attrs == (0,)
    assert t.leaves() == {"qkv@0", "qkv@1"}
    assert show(t) == "cat(slice(qkv@0, dim=0, 0:4), slice(qkv@1, dim=0, 0:4), dim=0)"
    assert show(leaf("x@1")) == "x@1"
