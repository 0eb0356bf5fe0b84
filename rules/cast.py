"""Casts that widen a tensor's value class: bool or integer to floating point, bool to integer.

refine reasons about real-valued semantics, so a cast within one dtype class (float32 to
bfloat16, int32 to int64) is an identity (`identity.py`). A cast from bool or an integer
type to a floating type (or from bool to an integer type) keeps every value as a real
number (False/True become 0/1), but it is not an identity: a bool tensor's `+` is a logical
or, so `cast(a + b)` is not `cast(a) + cast(b)` when a and b are masks. The core op
`cast_float_t` is therefore a unary op that passes through concats and slices (the unary
templates of `elementwise.py`, always sound: a cast acts on each element alone), and over a
`Sum` only where every term is known to hold numbers (the `Numeric` analysis below). Casts that narrow the class lose values (float to int truncates, to bool
binarizes; int to bool) and are refused: here, for every op that takes a `dtype`
(identity.py), and for a node whose dtype narrows its op's (refine.frontends.graphfile).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from refine.ir.graph import Arg, TensorType, narrowing, value_class
from refine.ir.lazy import torch
from refine.ir.term import Term
from refine.ops.lower import Builder
from refine.ops.registry import (
    DEMAND,
    Fact,
    Op,
    Rule,
    Sample,
    ShapeError,
    every_term,
    rule,
    wanted_through,
)


def _cast_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    want = attrs["dtype"]
    problem = narrowing(x.dtype, want)
    if problem:
        raise ShapeError(problem)
    return TensorType(x.shape, want)


def _cast(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    (x,) = args
    assert isinstance(x, str)
    src = b.type(x).dtype
    if value_class(src) == value_class(out.dtype):
        return x  # within one dtype class: the same real values
    problem = narrowing(src, out.dtype)
    if problem:  # the loader refuses these first; a graph built in Python meets this
        raise ShapeError(problem)
    return b.emit("cast_float_t", [x], {}, TensorType(out.shape, out.dtype))


def _cast_ref(x: torch.Tensor, dtype: str = "float32") -> torch.Tensor:
    if value_class(dtype) == "float":
        return x.to(torch.float64)
    return x.to(torch.bool if dtype == "bool" else torch.int64)


def _float_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    return TensorType(x.shape, "float32")


OPS = [
    Op("cast_float_t", 1, _float_shape, ref=lambda x: x.to(torch.float64), core=True, kind="unary",
       doc="a bool or integer tensor as numbers (False/True: 0/1), in a floating or an integer dtype"),
    Op("cast", 1, _cast_shape, (("dtype", "str"),), ref=_cast_ref, decompose=_cast,
       doc="a dtype cast: within one dtype class an identity, to a wider class (bool/int to float, bool to "
           "int) a cast_float_t; to a narrower one refused"),
]
# (Numeric e): e holds numbers, not booleans, so its `+` is arithmetic (a sum of bools is an
# or). What a cast's operand is made of decides whether the cast passes over a Sum: a count
# of tokens cast to float before its all-reduce (cast(n@0) + cast(n@1)) is the cast of the
# summed count. Analysis rules (run with the shape rules, to saturation), walking a sum's
# terms as rules/vector_norm.py's NonNeg does (`every_term`), only the sums a cast is over
# (NumWant: most sums of a training step are sums of numbers, and walking them all is costly).
PASSING = (("Scale", "r"), ("view", "s"), ("expand", "s"), ("slice", "d st en"), ("transpose", "i j"))
NUMERIC = [
    rule("numeric-cast", ["(= e (cast_float_t x))"], ["(Numeric e)"], analysis=True),
    rule("numeric-rsum", ["(= e (rsum x d))"], ["(Numeric e)"], analysis=True),  # torch counts bools as int64
    *(rule(f"numeric-{op}", [f"(= e ({op} x {args}))", "(Numeric x)"], ["(Numeric e)"], analysis=True)
      for op, args in PASSING),
    rule("numeric-cat", ["(= e (cat a b d))", "(Numeric a)", "(Numeric b)"], ["(Numeric e)"], analysis=True),
    rule("numeric-want-cast", ["(= e (cast_float_t x))"], ["(NumWant x)"], analysis=True),
    *wanted_through("numeric", "NumWant", PASSING),
    *every_term("numeric", "Numeric", "NumTodo", "NumAll", want="NumWant"),
]

# cast_float_t also gets the unary templates (over cat, into slice); over a Sum only of numbers
RULES: list[Rule] = [
    *NUMERIC,
    rule("cast-over-numeric-sum", ["(= e (cast_float_t (Sum ms)))", "(NumAll ms)"],
         ["(union e (Sum (unstable-multiset-map (unstable-fn \"cast_float_t\") ms)))"]),
]

DECLS = ["(relation Numeric (T))", "(relation NumWant (T))", "(relation NumTodo (TS))", "(relation NumAll (TS))"]


def _numeric(v: Any) -> bool:
    return v.dtype != torch.bool


# What the facts say, for the soundness harness: it checks every fact it reads back
FACTS = {"Numeric": Fact("one", _numeric), "NumWant": DEMAND, "NumAll": Fact("all", _numeric), "NumTodo": Fact("any", _numeric)}


# The soundness harness's seeds: bool masks and small integers, as the casts it stands for
SAMPLES = {"cast_float_t": Sample(lambda gen, x: ([(x, gen.rng.choice(["b", "i"]), 7)], ()))}


def SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """Casts of sums whose terms hold numbers (counts of masks, casts, their views and
    concats) and of sums of masks (an or: the cast must not pass over those)."""
    r = gen.rng
    out: list[Term] = []
    for _ in range(gen.instances):
        n, k = r.choice([1, 2, 3]), r.choice([1, 2, 3])
        b1, b2, b3 = (gen.leaf((n, k), "b") for _ in range(3))
        i1 = gen.leaf((n, k), "i", 7)

        def cast(x: Term) -> Term:
            return Term("cast_float_t", (x,))

        def count(x: Term) -> Term:
            return Term("rsum", (x,), (1,))

        numbers = [count(b1), count(i1), cast(b1), Term("Scale", (cast(b2),), (Fraction(3, 2),)),
                   Term("view", (count(b1),), ((n,),)), Term("expand", (count(b2),), ((n, k),)),
                   Term("slice", (cast(b1),), (1, 0, 1)), Term("transpose", (cast(b3),), (0, 1)),
                   Term("cat", (cast(b1), cast(b2)), (1,))]
        out += numbers
        out += [cast(Term("Sum", (count(b1), count(b2)))), cast(Term("Sum", (count(b1), count(b2), count(i1)))),
                cast(Term("Sum", (cast(b1), Term("expand", (count(b2),), ((n, k),))))),
                cast(Term("Sum", (Term("Sum", (count(b1), count(b2))), count(b3)))),
                # masks or-ed: not numbers, the cast stays outside
                cast(Term("Sum", (b1, b2))), cast(Term("Sum", (count(b1), Term("slice", (b2,), (1, 0, 1))))),
                cast(Term("Sum", (b1, b2, b3)))]
    return out
