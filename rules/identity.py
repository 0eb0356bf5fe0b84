"""Ops that return their input's value: copies, layout changes, waits on collectives, and
casts between floating dtypes (refine reasons about real-valued semantics). Given a `dtype`
of a wider value class they are that cast (rules/cast.py, lowered by refine.normalize); of
a narrower one (float to int or bool, int to bool) they would change values and are refused."""

from __future__ import annotations

from typing import Any

from refine.ir import TensorType, narrowing
from refine.opset import Op, ShapeError


def _same(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    dtype = attrs.get("dtype") or ins[0].dtype
    problem = narrowing(ins[0].dtype, dtype)
    if problem:
        raise ShapeError(problem)
    return TensorType(ins[0].shape, dtype)


OPS = [
    Op(name, 1, _same, (("dtype", "str?"), ("memory_format", "str?")), ref=lambda x, **_: x, kind="identity")
    for name in ("clone", "contiguous", "detach", "alias", "wait_tensor", "to_copy", "lift_fresh_copy")
]
RULES: list = []
