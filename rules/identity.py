"""Ops that return their input's value: copies, layout changes, waits on collectives, and
casts between floating dtypes (refine reasons about real-valued semantics)."""

from __future__ import annotations

from typing import Any

from refine.ir import TensorType
from refine.opset import Op


def _same(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    return TensorType(ins[0].shape, attrs.get("dtype") or ins[0].dtype)


OPS = [
    Op(name, 1, _same, (("dtype", "str?"), ("memory_format", "str?")), ref=lambda x, **_: x, kind="identity")
    for name in ("clone", "contiguous", "detach", "alias", "wait_tensor", "to_copy", "lift_fresh_copy")
]
RULES: list = []
