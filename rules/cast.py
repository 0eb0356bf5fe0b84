"""Casts that change a tensor's dtype class: bool or integer to floating point.

refine reasons about real-valued semantics, so a cast within one dtype class (float32 to
bfloat16, int32 to int64) is an identity (`identity.py`). A cast from bool or an integer
type to a floating type keeps every value as a real number (False/True become 0/1), but it
is not an identity: a bool tensor's `+` is a logical or, so `cast(a + b)` is not
`cast(a) + cast(b)` when a and b are masks. The core op `cast_float_t` is therefore a unary
op that passes through concats and slices (the unary templates of `elementwise.py`, always
sound: a cast acts on each element alone) and has no rule over `Sum`. Casts that lose
values (float to int or bool, int to bool) are refused.
"""

from __future__ import annotations

from typing import Any

from refine.ir import Arg, TensorType
from refine.lazy import torch
from refine.normalize import Builder
from refine.opset import Op, ShapeError


def _class(dtype: str) -> str:
    if dtype == "bool":
        return "bool"
    return "int" if dtype.startswith(("int", "uint")) else "float"


def _cast_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    want = attrs["dtype"]
    src, dst = _class(x.dtype), _class(want)
    if src != dst and dst != "float":
        raise ShapeError(f"a cast from {x.dtype} to {want} changes values: refine supports casts within one dtype "
                         "class and from bool or integer to floating point")
    return TensorType(x.shape, want)


def _cast(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    (x,) = args
    assert isinstance(x, str)
    if _class(b.type(x).dtype) == _class(out.dtype):
        return x  # within one dtype class: the same real values
    return b.emit("cast_float_t", [x], {}, TensorType(out.shape, out.dtype))


def _cast_ref(x: torch.Tensor, dtype: str = "float32") -> torch.Tensor:
    if _class(dtype) == "float":
        return x.to(torch.float64)
    return x.to(torch.bool if dtype == "bool" else torch.int64)


def _float_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    return TensorType(x.shape, "float32")


OPS = [
    Op("cast_float_t", 1, _float_shape, ref=lambda x: x.to(torch.float64), core=True, kind="unary",
       doc="a bool or integer tensor as floating point (False/True: 0/1)"),
    Op("cast", 1, _cast_shape, (("dtype", "str"),), ref=_cast_ref, decompose=_cast,
       doc="a dtype cast: within one dtype class an identity, bool/int to float a cast_float_t"),
]
RULES: list = []  # cast_float_t gets the unary templates (over cat, into slice); no Sum rule
