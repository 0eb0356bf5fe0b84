"""`flip(x, dims)`: x with the order of its elements reversed along each of dims (autograd's
backward of a `cumsum` flips the gradient, runs a cumsum and flips it back).

It lowers to core ops only, one dim at a time: a matmul with the exchange matrix
(`J[j, i] = j + i == n - 1`, built from two ranges), the dim moved last and back. Like
rules/scan.py's cumsum it needs no rule of its own along a dim no rank splits.
"""

from __future__ import annotations

from typing import Any

from refine.ir.graph import Arg, TensorType
from refine.ir.lazy import torch
from refine.ops.lower import Builder
from refine.ops.registry import Op, ShapeError


def _flip_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    if any(not 0 <= d < max(x.ndim, 1) for d in attrs["dims"]):
        raise ShapeError(f"flip over dims {list(attrs['dims'])} of {list(x.shape)}")
    return x


def _flip(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    (x,) = args
    assert isinstance(x, str)
    shape = b.type(x).shape
    last = len(shape) - 1
    y = x
    for d in sorted(set(attrs["dims"])):
        n = shape[d]
        idx = b.emit("arange_c", [], {"start": 0, "end": n, "step": 1}, TensorType((n,), "int64"))
        rows = b.emit("expand", [b.view(idx, (n, 1))], {"shape": (n, n)})
        cols = b.emit("expand", [b.view(idx, (1, n))], {"shape": (n, n)})
        anti = b.emit("eq_t", [b.emit("Sum", [rows, cols], {}, TensorType((n, n), "int64")),
                               b.const(n - 1, (n, n), "int64")], {})
        exchange = b.cast(anti, out.dtype)
        if d != last:
            y = b.emit("transpose", [y], {"dim0": d, "dim1": last})
        y = b.emit("matmul", [y, exchange], {}, TensorType(b.type(y).shape, out.dtype))
        if d != last:
            y = b.emit("transpose", [y], {"dim0": d, "dim1": last})
    return y


OPS = [
    Op("flip", 1, _flip_shape, (("dims", "dims"),), ref=lambda x, dims: torch.flip(x, tuple(dims)), decompose=_flip,
       doc="x reversed along each of dims"),
]
