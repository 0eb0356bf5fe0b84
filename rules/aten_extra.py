"""ATen ops that graphs captured by other tools contain (the external corpus: Megatron GPT
joint forward/backward graphs, vLLM Qwen2), but that refine's own capture never produces
(its decompositions expand them first), but for embedding_dense_backward, which it keeps
(its decomposition's clamp and masks would hide the rows a vocab shard accumulates). Each op is named as its aten base name, so
refine/frontends/capture/aten.py's generic mapping reaches it; semantics are the aten ops' (their
torch references below call the aten op itself where one exists).
"""

from __future__ import annotations

import math
from typing import Any

from refine.ir.graph import Arg, TensorType
from refine.ir.lazy import torch
from refine.ops.lower import Builder, UnsupportedOp
from refine.ops.registry import Op, ShapeError

INT64_MAX = 2**63 - 1


def _same(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    a, b = ins
    if a.shape != b.shape:
        raise ShapeError(f"operands {list(a.shape)} and {list(b.shape)} differ")
    return b


def _softmax_backward(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    """grad_input = y * (g - sum(g * y, dim)), y the softmax output."""
    g, y = args
    assert isinstance(g, str) and isinstance(y, str)
    shape = b.type(y).shape
    s = b.broadcast(b.emit("rsum", [b.emit("mul_t", [g, y], {})], {"dim": attrs["dim"]}), shape)
    return b.emit("mul_t", [y, b.emit("Sum", [g, b.scale(s, -1)], {})], {}, out)


def _gelu_backward(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    """g * (Phi(x) + x * phi(x)) for the exact gelu x * Phi(x)."""
    g, x = args
    assert isinstance(g, str) and isinstance(x, str)
    if attrs.get("approximate", "none") != "none":
        raise UnsupportedOp("gelu_backward with the tanh approximation is not supported")
    shape = b.type(x).shape

    def times(t: str, c: float) -> str:
        return b.emit("mul_t", [t, b.const(c, shape)], {})

    cdf = times(b.emit("Sum", [b.const(1.0, shape), b.emit("erf_t", [times(x, 1 / math.sqrt(2))], {})], {}), 0.5)
    pdf = times(b.emit("exp_t", [times(b.emit("mul_t", [x, x], {}), -0.5)], {}), 1 / math.sqrt(2 * math.pi))
    return b.emit("mul_t", [g, b.emit("Sum", [cdf, b.emit("mul_t", [x, pdf], {})], {})], {}, out)


def _emb_bwd_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    g, idx = ins
    if g.shape[:idx.ndim] != idx.shape or g.ndim != idx.ndim + 1 or not idx.dtype.startswith(("int", "uint")):
        raise ShapeError(f"embedding_dense_backward of grad {list(g.shape)} and indices {idx.dtype} {list(idx.shape)}")
    return TensorType((attrs["num_weights"], g.shape[-1]), g.dtype)


def _emb_bwd(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    """Every row of grad added at its index (acc_rows from row 0, rules/embedding_grad.py);
    rows at padding_idx dropped."""
    g, idx = args
    assert isinstance(g, str) and isinstance(idx, str)
    if attrs.get("scale_grad_by_freq"):
        raise UnsupportedOp("embedding_dense_backward with scale_grad_by_freq is not supported")
    pad = attrs.get("padding_idx", -1)
    if pad is not None and pad >= 0:
        it, gt = b.type(idx), b.type(g)
        hit = b.emit("eq_t", [idx, b.const(float(pad), it.shape, it.dtype)], {})
        g = b.emit("masked_fill_t", [g, b.broadcast(b.view(hit, it.shape + (1,)), gt.shape, "bool")], {"value": 0.0},
                   gt)
    return b.emit("acc_rows", [idx, g], {"start": 0, "shape": out.shape}, out)


def _emb_bwd_ref(g, idx, num_weights, padding_idx=-1, scale_grad_by_freq=False):
    return torch.ops.aten.embedding_dense_backward(g, idx.long(), num_weights, padding_idx, scale_grad_by_freq)


def _bounds(n: Any, attrs: dict[str, Any]) -> tuple[Any, Any]:
    """slice_scatter's [start, end), clamped as aten clamps them (only concrete sizes)."""
    start, end = attrs.get("start"), attrs.get("end")
    start = 0 if start is None else start
    end = n if end is None or end == INT64_MAX else end
    if (attrs.get("step") or 1) != 1:
        raise ShapeError(f"slice_scatter with step {attrs['step']}: only step 1 is supported")
    if start == 0 and end == n:
        return 0, n
    if not isinstance(n, int):
        raise ShapeError("slice_scatter with explicit bounds over a symbolic size")
    start = max(0, min(n, start + n if start < 0 else start))
    end = max(start, min(n, end + n if end < 0 else end))
    return start, end


def _slice_scatter_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, src = ins
    d = attrs.get("dim") or 0
    if not 0 <= d < x.ndim:
        raise ShapeError(f"slice_scatter dim {d} of {list(x.shape)}")
    s, e = _bounds(x.shape[d], attrs)
    want = x.shape[:d] + (e - s,) + x.shape[d + 1:] if (s, e) != (0, x.shape[d]) else x.shape
    if src.shape != want:
        raise ShapeError(f"slice_scatter of {list(src.shape)} into {list(x.shape)} at dim {d} [{s}, {e})")
    return x


def _slice_scatter(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    x, src = args
    assert isinstance(x, str) and isinstance(src, str)
    d = attrs.get("dim") or 0
    n = b.type(x).shape[d]
    s, e = _bounds(n, attrs)
    pieces = []
    if s != 0:
        pieces.append(b.emit("slice", [x], {"dim": d, "start": 0, "end": s}))
    pieces.append(src)
    if e != n:
        pieces.append(b.emit("slice", [x], {"dim": d, "start": e, "end": n}))
    y = pieces[-1]
    for p in reversed(pieces[:-1]):
        y = b.emit("cat", [p, y], {"dim": d})
    return y


def _slice_scatter_ref(x, src, dim=0, start=None, end=None, step=1):
    return torch.slice_scatter(x, src, dim, start, None if end == INT64_MAX else end, step or 1)


def _index_rows_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, idx = ins
    if x.ndim < 1 or not idx.dtype.startswith(("int", "uint")):
        raise ShapeError(f"index of {list(x.shape)} by {idx.dtype} indices")
    return TensorType(idx.shape + x.shape[1:], x.dtype)


def _index_rows(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    """x[idx]: rows of x (dims after the first merged) picked like an embedding lookup."""
    x, idx = args
    assert isinstance(x, str) and isinstance(idx, str)
    xt = b.type(x)
    table = b.view(x, (xt.shape[0], math.prod(xt.shape[1:])))
    return b.view(b.emit("embedding", [table, idx], {}), out.shape)


OPS = [
    # corpus: (grad [32, 16, 1024, 1024], softmax output, dim -1, input_dtype float16)
    Op("_softmax_backward_data", 2, _same, (("dim", "dim"), ("input_dtype", "str?")),
       ref=lambda g, y, dim, input_dtype=None: torch.ops.aten._softmax_backward_data(g, y, dim, y.dtype),
       decompose=_softmax_backward, doc="args grad_output, output (the softmax's)"),
    Op("gelu_backward", 2, _same, (("approximate", "str?"),),
       ref=lambda g, x, approximate="none": torch.ops.aten.gelu_backward(g, x, approximate=approximate),
       decompose=_gelu_backward, doc="args grad_output, self (the gelu's input); exact gelu only"),
    # corpus: grad [32, 1024, 1536], indices [32, 1024] int64, num_weights 2048, padding -1
    Op("embedding_dense_backward", 2, _emb_bwd_shape,
       (("num_weights", "size"), ("padding_idx", "int?"), ("scale_grad_by_freq", "bool?")),
       ref=_emb_bwd_ref, decompose=_emb_bwd, doc="args grad_output, indices"),
    # corpus: Megatron's vocab-parallel cross entropy and vLLM's fused qkv buffers
    Op("slice_scatter", 2, _slice_scatter_shape,
       (("dim", "dim?"), ("start", "int?"), ("end", "int?"), ("step", "int?")),
       ref=_slice_scatter_ref, decompose=_slice_scatter, doc="self with [start, end) along dim replaced by src"),
    Op("index_rows", 2, _index_rows_shape, ref=lambda x, idx: x[idx.long()], decompose=_index_rows,
       doc="aten.index.Tensor with one index tensor, over dim 0: x[idx]"),
]
