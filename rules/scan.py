"""Scans: `cumsum(x, dim)`, the running sum along a dim (HF transformers' masks find packed
sequences as the cumsum of position-id breaks).

It lowers to core ops only: a matmul with the upper-triangular matrix of ones, built from
two ranges compared (`tri[j, i] = j <= i`), so `cumsum(x)_i = sum_j x_j tri[j, i]`. A cumsum
of replicated tensors, or along a dim no rank splits, is the same term on every rank and
needs no rule of its own. A scan over a split dim (each rank's chunk plus the totals of the
chunks before it) is computed right but not yet proven: UNPROVEN, with no counterexample
(tests/cases/test_capture_scan.py). Integer and boolean inputs sum as int64, as torch's do
(refine's values are real numbers, exact for integers to 2^53).
"""

from __future__ import annotations

from typing import Any

from refine.ir.graph import Arg, TensorType, narrowing, value_class
from refine.ir.lazy import torch
from refine.ops.lower import Builder, normalize_dim
from refine.ops.registry import Op, ShapeError


def _cumsum_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    d = attrs["dim"]
    if not 0 <= d < max(x.ndim, 1):
        raise ShapeError(f"cumsum over dim {d} of {list(x.shape)}")
    integral = value_class(x.dtype) in ("bool", "int")
    dtype = attrs.get("dtype") or ("int64" if integral else x.dtype)
    problem = narrowing(x.dtype, dtype)  # torch casts the input to `dtype` first
    if problem:
        raise ShapeError(f"cumsum with dtype {dtype}: {problem}")
    return TensorType(x.shape, dtype)


def _cumsum(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    (x,) = args
    assert isinstance(x, str)
    shape = b.type(x).shape
    if not shape:  # a 0-d tensor is its own running sum
        return b.cast(x, out.dtype)
    d, last = normalize_dim(attrs["dim"], len(shape)), len(shape) - 1
    n = shape[d]
    idx = b.emit("arange_c", [], {"start": 0, "end": n, "step": 1}, TensorType((n,), "int64"))
    rows = b.emit("expand", [b.view(idx, (n, 1))], {"shape": (n, n)})
    cols = b.emit("expand", [b.view(idx, (1, n))], {"shape": (n, n)})
    tri = b.cast(b.emit("le_t", [rows, cols], {}), out.dtype)
    y = b.cast(x, out.dtype)
    if d != last:
        y = b.emit("transpose", [y], {"dim0": d, "dim1": last})
    moved = b.type(y).shape
    y = b.emit("matmul", [y, tri], {}, TensorType(moved, out.dtype))
    if d != last:
        y = b.emit("transpose", [y], {"dim0": d, "dim1": last})
    return y


def _ref_cumsum(x: torch.Tensor, dim: int, dtype: str | None = None) -> torch.Tensor:
    # refine's values are real numbers: a floating dtype is float64, an integer one int64
    if dtype is not None and value_class(dtype) != "float":
        x = x.to(torch.int64)
    return torch.cumsum(x, dim)


OPS = [
    Op("cumsum", 1, _cumsum_shape, (("dim", "dim"), ("dtype", "str?")), ref=_ref_cumsum, decompose=_cumsum,
       doc="the running sum along dim"),
]
