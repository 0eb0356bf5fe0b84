"""Ops that return their input's value: copies, layout changes, waits on collectives, and
casts between floating dtypes (refine reasons about real-valued semantics), and from an
integer dtype to a floating one (the same real values). A bool given a numeric dtype becomes
`cast_float_t` (rules/cast.py, by refine.ops.lower.Builder.cast); a narrower dtype (float to
int or bool, int to bool) would change values and is refused."""

from __future__ import annotations

from typing import Any

from refine.ir.graph import TensorType, narrowing
from refine.ops.registry import Op, ShapeError


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
