"""Casts that widen a tensor's value class: bool or integer to floating point, bool to integer.

refine reasons about real-valued semantics, so a cast within one dtype class (float32 to
bfloat16, int32 to int64) is an identity (`identity.py`). A cast from bool or an integer
type to a floating type (or from bool to an integer type) keeps every value as a real
number (False/True become 0/1), but it is not an identity: a bool tensor's `+` is a logical
or, so `cast(a + b)` is not `cast(a) + cast(b)` when a and b are masks. The core op
`cast_float_t` is therefore a unary op that passes through concats and slices (the unary
templates of `elementwise.py`, always sound: a cast acts on each element alone) and has no
rule over `Sum`. Casts that narrow the class lose values (float to int truncates, to bool
binarizes; int to bool) and are refused: here, for every op that takes a `dtype`
(identity.py), and for a node whose dtype narrows its op's (refine.frontends.graphfile).
"""

from __future__ import annotations

from typing import Any

from refine.ir.graph import Arg, TensorType, narrowing, value_class
from refine.ir.lazy import torch
from refine.ops.lower import Builder
from refine.ops.registry import Op, Sample, ShapeError


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
RULES: list = []  # cast_float_t gets the unary templates (over cat, into slice); no Sum rule


# The soundness harness's seeds: bool masks and small integers, as the casts it stands for
SAMPLES = {"cast_float_t": Sample(lambda gen, x: ([(x, gen.rng.choice(["b", "i"]), 7)], ()))}
