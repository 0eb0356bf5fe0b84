"""XLA HLO ops, as AWS transformers-neuronx graphs lowered from HLO name them (`hlo.*`).

Semantics from the XLA operation semantics reference (openxla.org/xla/operation_semantics)
and, for the Neuron custom call, torch-neuronx's `RmsNorm` (a CustomCall to
`AwsNeuronRmsNorm` with operands input, weight, eps and the normalised dim in its backend
config). The corpus call shapes are noted per op. Every op decomposes into core ops, so the
existing rules (matmul contraction -> Sum, norms over a non-normalised concat, ...) apply.

Importer mapping (positional arguments as the corpus stores them):
  hlo.AwsNeuronRmsNorm(x, w, eps)      -> hlo_rms_norm(x, w, eps=eps, dim=d). The backend
      config (d) is not stored in the corpus: d is the dim of x whose size is w's, which must
      be unique (corpus: x [2048, 64, 4] hidden-first, w [2048] -> d = 0)
  hlo.broadcast(x, dims, shape)        -> hlo_broadcast(x, broadcast_dimensions=dims, shape=shape)
  hlo.dot(l, r, lc, rc, lb, rb)        -> hlo_dot(l, r, lhs_contracting_dims=lc, rhs_contracting_dims=rc,
                                                   lhs_batch_dims=lb, rhs_batch_dims=rb)
  hlo.gather(x, i, offset, collapsed, start_map, ivd, sizes) -> hlo_gather(x, i, offset_dims=...,
      collapsed_slice_dims=..., start_index_map=..., index_vector_dim=..., slice_sizes=...)
  hlo.logistic(x)                      -> hlo_logistic(x)
  hlo.reduce_max(x, d)                 -> hlo_reduce_max(x, dims=d)
  hlo.select(p, t, f)                  -> hlo_select(p, t, f)
"""

from __future__ import annotations

import math
import string
from typing import Any

from refine.ir.graph import Arg, TensorType
from refine.ir.lazy import torch
from refine.ops.lower import Builder, UnsupportedOp
from refine.ops.registry import Op, ShapeError

# --- AwsNeuronRmsNorm: x * rsqrt(mean(x^2 over dim) + eps) * w, w laid along dim


def _rms_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, w = ins
    d = attrs["dim"]
    if not 0 <= d < x.ndim or w.shape != (x.shape[d],):
        raise ShapeError(f"rms norm weight {list(w.shape)} along dim {d} of {list(x.shape)}")
    return x


def _rms_ref(x, w, eps, dim):
    shape = [1] * x.ndim
    shape[dim] = -1
    return x * torch.rsqrt(x.pow(2).mean(dim, keepdim=True) + eps) * w.reshape(shape)


def _rms(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    x, w = args
    assert isinstance(x, str)
    last, d = b.type(x).ndim - 1, attrs["dim"]
    y = b.emit("rms_norm_c", [b.transpose(x, d, last), w], {"normalized_ndim": 1, "eps": float(attrs["eps"])})
    return b.transpose(y, d, last)


# --- broadcast (BroadcastInDim): operand dim i becomes output dim broadcast_dimensions[i]


def _bcast_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    bd, shape = tuple(attrs["broadcast_dimensions"]), tuple(attrs["shape"])
    if len(bd) != x.ndim or len(set(bd)) != len(bd) or any(not 0 <= d < len(shape) for d in bd):
        raise ShapeError(f"broadcast_dimensions {list(bd)} for {list(x.shape)} -> {list(shape)}")
    if any(not (x.shape[i] == 1 or x.shape[i] == shape[d]) for i, d in enumerate(bd)):
        raise ShapeError(f"cannot broadcast {list(x.shape)} into {list(shape)} along {list(bd)}")
    return TensorType(shape, x.dtype)


def _bcast_ref(x, broadcast_dimensions, shape):
    order = sorted(range(x.ndim), key=lambda i: broadcast_dimensions[i])
    kept = [1] * len(shape)
    for i in order:
        kept[broadcast_dimensions[i]] = x.shape[i]
    return x.permute(order).reshape(kept).expand(tuple(shape))


def _bcast(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    (x,) = args
    assert isinstance(x, str)
    bd = attrs["broadcast_dimensions"]
    order = sorted(range(len(bd)), key=lambda i: bd[i])  # operand dims in output order
    y = b.registry.ops["permute"].decompose(b, [x], {"dims": tuple(order)}, None)
    kept = [1] * len(out.shape)
    for i in order:
        kept[bd[i]] = b.type(x).shape[i]
    return b.broadcast(b.view(y, tuple(kept)), out.shape)


# --- dot (DotGeneral): batch dims, then lhs free dims, then rhs free dims


def _dot_dims(ins: list[TensorType], attrs: dict[str, Any]) -> tuple[list[int], ...]:
    lhs, rhs = ins
    lc, rc = list(attrs["lhs_contracting_dims"]), list(attrs["rhs_contracting_dims"])
    lb, rb = list(attrs["lhs_batch_dims"]), list(attrs["rhs_batch_dims"])
    for ds, t in ((lc + lb, lhs), (rc + rb, rhs)):
        if len(set(ds)) != len(ds) or any(not 0 <= d < t.ndim for d in ds):
            raise ShapeError(f"dot dims {ds} for a {t.ndim}-d operand")
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ShapeError("dot: contracting/batch dim lists differ in length")
    for i, j in zip(lc + lb, rc + rb, strict=True):
        if lhs.shape[i] != rhs.shape[j]:
            raise ShapeError(f"dot pairs lhs dim {i} ({lhs.shape[i]}) with rhs dim {j} ({rhs.shape[j]})")
    lf = [d for d in range(lhs.ndim) if d not in lc + lb]
    rf = [d for d in range(rhs.ndim) if d not in rc + rb]
    return lc, rc, lb, rb, lf, rf


def _dot_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    lhs, rhs = ins
    _, _, lb, _, lf, rf = _dot_dims(ins, attrs)
    return TensorType(tuple(lhs.shape[d] for d in lb + lf) + tuple(rhs.shape[d] for d in rf), lhs.dtype)


def _dot_ref(lhs, rhs, lhs_contracting_dims, rhs_contracting_dims, lhs_batch_dims, rhs_batch_dims):
    # an einsum written from the dimension numbers: an independent statement of DotGeneral
    letters = iter(string.ascii_letters)
    ls = [next(letters) for _ in range(lhs.ndim)]
    rs = [next(letters) for _ in range(rhs.ndim)]
    for i, j in zip(list(lhs_contracting_dims) + list(lhs_batch_dims),
                    list(rhs_contracting_dims) + list(rhs_batch_dims), strict=True):
        rs[j] = ls[i]
    out = [ls[d] for d in lhs_batch_dims]
    out += [ls[d] for d in range(lhs.ndim) if d not in lhs_contracting_dims and d not in lhs_batch_dims]
    out += [rs[d] for d in range(rhs.ndim) if d not in rhs_contracting_dims and d not in rhs_batch_dims]
    return torch.einsum(f"{''.join(ls)},{''.join(rs)}->{''.join(out)}", lhs, rhs)


def _dot(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    lhs, rhs = args
    assert isinstance(lhs, str) and isinstance(rhs, str)
    lt, rt = b.type(lhs), b.type(rhs)
    lc, rc, lb, rb, lf, rf = _dot_dims([lt, rt], attrs)
    permute = b.registry.ops["permute"].decompose
    batch = tuple(lt.shape[d] for d in lb)
    m, k = math.prod(lt.shape[d] for d in lf), math.prod(lt.shape[d] for d in lc)
    n = math.prod(rt.shape[d] for d in rf)
    a = b.view(permute(b, [lhs], {"dims": tuple(lb + lf + lc)}, None), batch + (m, k))
    c = b.view(permute(b, [rhs], {"dims": tuple(rb + rc + rf)}, None), batch + (k, n))
    return b.view(b.emit("matmul", [a, c], {}), out.shape)


# --- gather: the form that takes whole slices at scalar indices along one dim


def _gather_form(ins: list[TensorType], attrs: dict[str, Any]) -> int:
    """The gathered dim, when the call takes full slices of x at scalar indices along one
    dim (x[idx] along it, as the corpus does); anything else is refused."""
    x, idx = ins
    smap, collapsed = tuple(attrs["start_index_map"]), tuple(attrs["collapsed_slice_dims"])
    sizes, offset = tuple(attrs["slice_sizes"]), tuple(attrs["offset_dims"])
    if len(smap) != 1 or collapsed != smap or attrs["index_vector_dim"] != idx.ndim:
        raise ShapeError("hlo gather: only scalar indices along one collapsed dim are supported")
    d = smap[0]
    if not 0 <= d < x.ndim or sizes != tuple(1 if i == d else s for i, s in enumerate(x.shape)):
        raise ShapeError(f"hlo gather: slice_sizes {list(sizes)} are not whole slices of {list(x.shape)} at dim {d}")
    out_ndim = idx.ndim + x.ndim - 1
    if len(offset) != x.ndim - 1 or list(offset) != sorted(offset) or any(not 0 <= o < out_ndim for o in offset):
        raise ShapeError(f"hlo gather: offset_dims {list(offset)}")
    if not idx.dtype.startswith(("int", "uint")):
        raise ShapeError(f"hlo gather: {idx.dtype} indices")
    return d


def _gather_order(ndim_idx: int, ndim_rest: int, offset: tuple[int, ...]) -> list[int]:
    """Positions of the output dims in (idx dims + remaining x dims) order."""
    it, rest, out = iter(range(ndim_idx)), iter(range(ndim_idx, ndim_idx + ndim_rest)), []
    for p in range(ndim_idx + ndim_rest):
        out.append(next(rest) if p in offset else next(it))
    return out


def _gather_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, idx = ins
    d = _gather_form(ins, attrs)
    flat = idx.shape + tuple(s for i, s in enumerate(x.shape) if i != d)
    order = _gather_order(idx.ndim, x.ndim - 1, tuple(attrs["offset_dims"]))
    return TensorType(tuple(flat[i] for i in order), x.dtype)


def _gather_ref(x, idx, offset_dims, collapsed_slice_dims, start_index_map, index_vector_dim, slice_sizes):
    d = start_index_map[0]
    i = idx.long().clamp(0, x.shape[d] - 1)  # XLA clamps start indices into range
    taken = x.movedim(d, 0)[i]  # idx dims + remaining x dims
    return taken.permute(_gather_order(idx.ndim, x.ndim - 1, tuple(offset_dims)))


def _gather(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    x, idx = args
    assert isinstance(x, str) and isinstance(idx, str)
    xt, it = b.type(x), b.type(idx)
    d = _gather_form([xt, it], attrs)
    n = xt.shape[d]
    if not isinstance(n, int):
        raise UnsupportedOp("hlo gather along a symbolic size: the index clamp needs a concrete bound")
    rest = tuple(s for i, s in enumerate(xt.shape) if i != d)
    perm = (d,) + tuple(i for i in range(xt.ndim) if i != d)
    table = b.view(b.registry.ops["permute"].decompose(b, [x], {"dims": perm}, None), (n, math.prod(rest)))
    clamped = b.emit("clamp_t", [idx], {"min": 0.0, "max": float(n - 1)})
    taken = b.view(b.emit("embedding", [table, clamped], {}), it.shape + rest)
    order = _gather_order(it.ndim, xt.ndim - 1, tuple(attrs["offset_dims"]))
    return b.registry.ops["permute"].decompose(b, [taken], {"dims": tuple(order)}, None)


# --- elementwise and reductions


def _same(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    return ins[0]


def _select_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    p, t, f = ins
    if not (p.shape == t.shape == f.shape) or p.dtype != "bool":
        raise ShapeError(f"select of {p.dtype} {list(p.shape)}, {list(t.shape)}, {list(f.shape)}")
    return TensorType(t.shape, t.dtype)


def _reduce_max_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    ds = attrs["dims"]
    if not ds or any(not 0 <= d < x.ndim for d in ds):
        raise ShapeError(f"reduce_max over {list(ds)} of {list(x.shape)}")
    return TensorType(tuple(s for i, s in enumerate(x.shape) if i not in ds), x.dtype)


def _reduce_max(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    (y,) = args
    assert isinstance(y, str)
    for d in attrs["dims"]:
        y = b.emit("rmax", [y], {"dim": d})
    return b.view(y, out.shape)


def _unary(core: str):
    return lambda b, args, attrs, out: b.emit(core, list(args), {}, out)


OPS = [
    # corpus: x [2048, S, 4] float32 (hidden first), w [2048], eps 1e-5 -> float16
    Op("hlo_rms_norm", 2, _rms_shape, (("eps", "float"), ("dim", "dim")), ref=_rms_ref, decompose=_rms,
       doc="AwsNeuronRmsNorm: x * rsqrt(mean(x^2 over dim) + eps) * w; args x, w"),
    # corpus: [64, 32] -> [64, 4, 4, 32] along [0, 3]; [64] int -> [64, 64] along [1], ...
    Op("hlo_broadcast", 1, _bcast_shape, (("broadcast_dimensions", "ints"), ("shape", "ints")), ref=_bcast_ref,
       decompose=_bcast, doc="BroadcastInDim: operand dim i is output dim broadcast_dimensions[i]"),
    # corpus: [2048, 256] x [2048, 1536] contracting 0/0; [4, 16, 64, 64] x [64, 4, 16, 64]
    # contracting 3/0 with batch [0, 1]/[1, 2]; ...
    Op("hlo_dot", 2, _dot_shape, (("lhs_contracting_dims", "ints"), ("rhs_contracting_dims", "ints"),
                                  ("lhs_batch_dims", "ints"), ("rhs_batch_dims", "ints")),
       ref=_dot_ref, decompose=_dot, doc="DotGeneral: batch dims, then lhs free dims, then rhs free dims"),
    # corpus: x [64, 2048, 4], idx [1] int32, offset [1, 2], collapsed [0], map [0], ivd 1,
    # sizes [1, 2048, 4] -> [1, 2048, 4] (the last token's hidden state)
    Op("hlo_gather", 2, _gather_shape, (("offset_dims", "ints"), ("collapsed_slice_dims", "ints"),
                                        ("start_index_map", "ints"), ("index_vector_dim", "int"),
                                        ("slice_sizes", "ints")),
       ref=_gather_ref, decompose=_gather, doc="Gather of whole slices at scalar indices along one dim"),
    Op("hlo_logistic", 1, _same, ref=torch.sigmoid, decompose=_unary("sigmoid_t"), doc="1 / (1 + exp(-x))"),
    # corpus: [4, 16, 64, 64] over 3 -> [4, 16, 64] (the softmax max)
    Op("hlo_reduce_max", 1, _reduce_max_shape, (("dims", "dims"),),
       ref=lambda x, dims: x.amax(tuple(dims)), decompose=_reduce_max, doc="max over dims, dropped"),
    Op("hlo_select", 3, _select_shape, ref=lambda p, t, f: torch.where(p.bool(), t, f),
       decompose=lambda b, args, attrs, out: b.emit("where_t", list(args), {}, out),
       doc="elementwise p ? t : f, operands of one shape"),
]
