"""Exact constants on both sides (issue 22, item 4): a float literal stands for the simplest
rational that rounds to it (`refine.ops.lower.rational`), the same reading wherever a
constant enters the prover, so a mean over N elements (an exact 1/N) on one side and a
literal 1/N, k/N, a `full(1/N)` or a product of such on the other are one number.

The family: a mean over N rows (N in 3, 6, 12, 36, 96, 21 = 7 * 3) of x sharded by rows,
written four ways on the ranks and two on the sequential side, both directions. The
soundness side: a literal that is not the float of k/N (0.0104 for 1/96, or the float next
to it) stays another number, so the check does not refine.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction
from pathlib import Path

import pytest

from refine.check import check_files
from refine.frontends.build import GraphBuilder, dist_doc, seq_doc, write_case
from refine.ops.lower import float_rational, rational, simplest_rational

H = 4
NS = (3, 6, 12, 36, 96, 7 * 3)


def _world(n: int) -> int:
    return 2 if n % 2 == 0 else 3


def _seq(form: str, n: int, k: int, literal: float | None) -> GraphBuilder:
    """y = k * (the mean of x's n rows), as `form` writes it."""
    s = GraphBuilder()
    x = s.input("x", [n, H])
    if form == "mean":  # the exact 1/n of a mean, times the integer k
        y = s.op("mean", x, dim=[0])
        y = s.op("mul", y, k) if k != 1 else y
    elif form == "literal":  # the row sum times the float literal k/n
        y = s.op("mul", s.op("sum", x, dim=[0]), k / n if literal is None else literal)
    else:  # the row sum divided by the integer n, times k
        y = s.op("div", s.op("sum", x, dim=[0]), n)
        y = s.op("mul", y, k) if k != 1 else y
    s.output("y", y)
    return s


def _rank(form: str, n: int, k: int, world: int, literal: float | None) -> GraphBuilder:
    """One rank's part of y from its n / world rows, as `form` writes it."""
    d = GraphBuilder()
    x = d.input("x", [n // world, H])
    group = list(range(world))
    if form == "mean":  # the local mean (exact 1/(n/world)), averaged over the ranks (1/world), times k
        y = d.op("all_reduce", d.op("mean", x, dim=[0]), reduce_op="avg", group=group)
        y = d.op("mul", y, k) if k != 1 else y
    elif form == "literal":  # the local sum times the float literal k/n, summed over the ranks
        y = d.op("all_reduce", d.op("mul", d.op("sum", x, dim=[0]), k / n if literal is None else literal),
                 reduce_op="sum", group=group)
    elif form == "full":  # the local sum times a full(1/n) constant, times k, summed over the ranks
        one_over = d.op("full", value=1 / n if literal is None else literal, shape=[])
        y = d.op("mul", d.op("sum", x, dim=[0]), one_over)
        y = d.op("all_reduce", d.op("mul", y, k) if k != 1 else y, reduce_op="sum", group=group)
    else:  # "split": k/(n/world) as a float literal times full(1/world), as gradient accumulation scales
        y = d.op("mul", d.op("sum", x, dim=[0]), k / (n // world))
        y = d.op("mul", y, d.op("full", value=1 / world, shape=[]))
        y = d.op("all_reduce", y, reduce_op="sum", group=group)
    d.output("y", y)
    return d


def _check(tmp_path: Path, seq_form: str, rank_form: str, n: int, k: int = 1, seq_literal: float | None = None,
           rank_literal: float | None = None) -> bool:
    world = _world(n)
    ranks = {r: _rank(rank_form, n, k, world, rank_literal) for r in range(world)}
    write_case(tmp_path, seq_doc(_seq(seq_form, n, k, seq_literal)),
               dist_doc({"dp": world}, ranks, [{"from": "x", "placements": ["Shard(0)"]}],
                        [{"output": "y", "placements": ["Replicate"]}]))
    report = check_files(tmp_path / "seq.json", tmp_path / "dist.json")
    return report.refines


# ---------------------------------------------------------------------------------------
# the reading


@pytest.mark.parametrize("x,q", [(1 / 3, Fraction(1, 3)), (2 / 96, Fraction(1, 48)), (1 / 96, Fraction(1, 96)),
                                 (0.010416666666666666, Fraction(1, 96)), (0.0625, Fraction(1, 16)),
                                 (0.1, Fraction(1, 10)), (-1 / 7, Fraction(-1, 7)), (0.0104, Fraction(13, 1250)),
                                 (5.0, Fraction(5)), (0.0, Fraction(0)), (1 / 30000000, Fraction(1, 30000000))])
def test_a_float_reads_as_the_simplest_rational_rounding_to_it(x: float, q: Fraction) -> None:
    assert rational(x) == q
    assert float(q) == x


def test_integers_fractions_and_strings_are_exact() -> None:
    assert rational(3) == 3 and rational(True) == 1
    assert rational(Fraction(2 ** 60 + 1, 2 ** 60)) == Fraction(2 ** 60 + 1, 2 ** 60)
    assert rational("1/3") == Fraction(1, 3) and rational("0.1") == Fraction(1, 10)


@pytest.mark.parametrize("v", [math.inf, -math.inf, math.nan])
def test_a_non_finite_float_has_no_rational(v: float) -> None:
    with pytest.raises(ValueError, match="not a finite number"):
        rational(v)


def test_the_reading_rounds_back_and_keeps_distinct_floats_distinct() -> None:
    """float(rational(x)) == x for any float, so the numeric oracle runs the same constants
    and two different floats are never one number; simplest_rational(x) has no rational of
    smaller denominator rounding to x (checked by brute force)."""
    rng = random.Random(0)
    xs = [rng.uniform(-2, 2) for _ in range(300)] + [rng.randint(1, 999) / rng.randint(1, 999) for _ in range(300)]
    xs += [2.0 ** -e for e in range(1, 60)] + [math.nextafter(1 / 96, 1), math.nextafter(1 / 96, 0), 5e-324,
                                               1.7976931348623157e308]
    for x in xs:
        assert float(float_rational(x)) == x, x
        q = simplest_rational(x)
        assert float(q) == x, x
        if q.denominator <= 1000:
            assert not any(float(Fraction(round(x * d), d)) == x for d in range(1, q.denominator)), x
    for a, b in zip(xs, xs[1:], strict=False):
        assert (rational(a) == rational(b)) == (a == b)


# ---------------------------------------------------------------------------------------
# the family: means over N elements, as literals on one side and rationals on the other


def test_a_mean_over_96_meets_its_literal_both_ways(tmp_path: Path) -> None:
    """The family below in the quick run: 2/96 as a literal against a mean, both ways."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert _check(tmp_path / "a", "mean", "literal", 96, 2) and _check(tmp_path / "b", "literal", "mean", 96, 2)


@pytest.mark.slow  # a family over many cases: the whole suite runs it
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("seq_form,rank_form", [
    ("mean", "literal"), ("mean", "full"), ("mean", "split"),    # the literal on the ranks
    ("literal", "mean"), ("div", "literal"), ("literal", "full"),  # the literal in the sequential program
    ("literal", "split"), ("literal", "literal"),
])
@pytest.mark.parametrize("k", [1, 2])
def test_a_mean_over_n_meets_its_literals(tmp_path: Path, seq_form: str, rank_form: str, n: int, k: int) -> None:
    assert _check(tmp_path, seq_form, rank_form, n, k), (seq_form, rank_form, n, k)


@pytest.mark.parametrize("n", [12, 96, 21])
@pytest.mark.parametrize("seq_form,rank_form,side", [("mean", "literal", "rank"), ("mean", "full", "rank"),
                                                     ("literal", "mean", "seq"), ("literal", "full", "seq")])
@pytest.mark.parametrize("wrong", ["rounded_by_hand", "next_float"])
def test_a_literal_that_is_not_the_number_does_not_refine(tmp_path: Path, seq_form: str, rank_form: str, side: str,
                                                          n: int, wrong: str) -> None:
    """0.0104 is not 1/96, nor is the float next to 1/96's: each stands for another rational
    (a wrong constant the numeric oracle could not see at float tolerance must still not be
    proven equal)."""
    lit = round(1 / n, 4) if wrong == "rounded_by_hand" else math.nextafter(1 / n, 1)
    assert lit != 1 / n
    kw = {"seq_literal": lit} if side == "seq" else {"rank_literal": lit}
    assert not _check(tmp_path, seq_form, rank_form, n, **kw)


# ---------------------------------------------------------------------------------------
# constants no simple rational rounds to: the binary reading's exactness under halving kept


def _halved(tmp_path: Path, c: float, world: int) -> bool:
    """y = x * c; each rank holds x whole and scales it by c / world (a float: exact, world a
    power of two), then the ranks sum."""
    s = GraphBuilder()
    s.output("y", s.op("mul", s.input("x", [4, H]), c))
    ranks = {}
    for r in range(world):
        d = GraphBuilder()
        d.output("y", d.op("all_reduce", d.op("mul", d.input("x", [4, H]), c / world), reduce_op="sum",
                           group=list(range(world))))
        ranks[r] = d
    write_case(tmp_path, seq_doc(s), dist_doc({"dp": world}, ranks, [{"from": "x", "placements": ["Replicate"]}],
                                              [{"output": "y", "placements": ["Replicate"]}]))
    return check_files(tmp_path / "seq.json", tmp_path / "dist.json").refines


IRRATIONAL = (1 / math.sqrt(2), 1 / math.sqrt(128), math.pi, math.sqrt(2 / math.pi), math.e, 1e-30, 1e300)


@pytest.mark.parametrize("c", IRRATIONAL)
def test_the_reading_commutes_with_powers_of_two(c: float) -> None:
    """Exactly as the binary reading does, but for an integral float, which is its integer
    (c * 2^51 is one: such a scale of an irrational constant is the price)."""
    checked = 0
    for k in range(-60, 61):
        x = c * 2.0 ** k
        if math.isfinite(x) and not x.is_integer() and not c.is_integer():
            assert rational(x) == rational(c) * Fraction(2) ** k, (c, k)
            checked += 1
    assert checked >= 40 or c.is_integer()


@pytest.mark.parametrize("c", IRRATIONAL)
@pytest.mark.parametrize("world", [2, 4])
def test_a_literal_split_over_a_power_of_two_ranks_meets_it(tmp_path: Path, c: float, world: int) -> None:
    """Irrational-like constants (an attention scale, gelu's sqrt(2/pi)) and ones whose
    rational is longer than 64 bits (1e-30, 1e300: egglog reads those from strings)."""
    assert _halved(tmp_path, c, world), c


@pytest.mark.parametrize("c", [1e-5, 1e-30, 1e300, 1 / 3])
def test_a_factor_of_any_size_is_proven(tmp_path: Path, c: float) -> None:
    """x * c sharded by rows: the factor reaches the e-graph whatever its size (1e-5 as a
    binary fraction has a 70-bit denominator; egglog's (bigint n) takes 64 bits)."""
    s = GraphBuilder()
    s.output("y", s.op("mul", s.input("x", [4, H]), c))
    ranks = {}
    for r in range(2):
        d = GraphBuilder()
        d.output("y", d.op("mul", d.input("x", [2, H]), c))
        ranks[r] = d
    write_case(tmp_path, seq_doc(s), dist_doc({"dp": 2}, ranks, [{"from": "x", "placements": ["Shard(0)"]}],
                                              [{"output": "y", "placements": ["Shard(0)"]}]))
    assert check_files(tmp_path / "seq.json", tmp_path / "dist.json").refines
