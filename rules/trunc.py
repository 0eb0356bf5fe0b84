"""A cast from floating point to an integer dtype: truncation toward zero.

Unlike the casts of `cast.py` it changes values, so refine's capture refuses it; the
GraphGuard/Entangle importer maps it here (Megatron's loss divides by
`total_tokens.to(torch.int)`, a count held as a float). `cast_trunc_t` is elementwise, so
it gets the unary templates of `elementwise.py` (through a concat, into a slice), always
sound since it acts on each element alone; it has no rule over `Sum` or `Scale`
(truncation is not linear).
"""

from __future__ import annotations

from typing import Any

from refine.ir.graph import TensorType
from refine.ir.lazy import torch
from refine.ops.registry import Op, ShapeError


def _shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    if not x.dtype.startswith(("float", "bfloat")):
        raise ShapeError(f"cast_trunc_t casts a floating tensor, not {x.dtype}")
    return TensorType(x.shape, "int64")  # the node states its own integer dtype


OPS = [
    Op("cast_trunc_t", 1, _shape, ref=lambda x: torch.trunc(x.to(torch.float64)),
       core=True, kind="unary", doc="a floating tensor cast to an integer dtype: each value truncated toward zero"),
]
RULES: list = []
