"""NVIDIA apex's fused layer norm (as Megatron-LM calls it), one refine op per output.

Semantics (apex `fused_layer_norm_cuda.forward_affine` / `backward_affine`, which Megatron's
`fused_layer_norm.py` registers as the custom ops `apex::fused_layer_norm_affine_fwd(input,
weight, bias, normalized_shape, eps) -> (output, mean, invvar)` and
`apex::fused_layer_norm_affine_bwd(grad_output, mean, invvar, input, normalized_shape,
weight, bias, eps) -> (grad_input, grad_weight, grad_bias)`): the input is seen as n1 rows of
n2 = prod(normalized_shape) elements; `mean` and `invvar = 1/sqrt(biased variance + eps)` are
per-row statistics, returned flat with shape [n1] (float32 even for half inputs: the corpus
shows e.g. input [512, 32, 1536] -> mean [16384]). The backward reads the statistics it is
given (it does not recompute them), so its ops take them as tensor arguments.

How an importer maps a captured call (getitem k of the multi-output node):
  fwd getitem 0 -> `apex_layer_norm(input, weight, bias, normalized_shape, eps)`
  fwd getitem 1 -> `apex_layer_norm_mean(input, normalized_shape, eps)`
  fwd getitem 2 -> `apex_layer_norm_invvar(input, normalized_shape, eps)`
  bwd getitem 0 -> `apex_layer_norm_grad_input(grad_output, mean, invvar, input, weight, normalized_shape)`
  bwd getitem 1 -> `apex_layer_norm_grad_weight(grad_output, mean, invvar, input, normalized_shape)`
  bwd getitem 2 -> `apex_layer_norm_grad_bias(grad_output, normalized_shape)`
`bias` (and `eps`, the statistics being given) enters none of the three gradients, so the
backward ops do not take it. The ops decompose into core ops (layer_norm_c and the
layer-norm statistics of norm.py, Sum, Scale, mul_t, rsum, rmean, views), so every rule of
those families applies and no new rewrite rule is needed.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from refine.ir.graph import Arg, TensorType
from refine.ir.lazy import F, torch
from refine.ops.lower import Builder
from refine.ops.registry import Op, ShapeError


def _split(x: TensorType, ns: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any, Any]:
    """(leading dims, n1, n2) of x normalised over its trailing dims `ns`."""
    k = len(ns)
    if not 1 <= k <= x.ndim or x.shape[x.ndim - k:] != tuple(ns):
        raise ShapeError(f"normalized_shape {list(ns)} does not end {list(x.shape)}")
    lead = x.shape[:x.ndim - k]
    return lead, math.prod(lead), math.prod(ns)


def _fwd_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, *params = ins
    ns = tuple(attrs["normalized_shape"])
    _split(x, ns)
    if len(params) > 2 or any(p.shape != ns for p in params):
        raise ShapeError(f"apex layer norm parameters {[list(p.shape) for p in params]} for {list(ns)}")
    return x


def _stat_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    _, n1, _ = _split(x, tuple(attrs["normalized_shape"]))
    return TensorType((n1,), "float32")


def _bwd_check(ins: list[TensorType], attrs: dict[str, Any]) -> tuple[TensorType, TensorType]:
    """(grad_output, input) after checking grad_output, mean, invvar, input[, weight]."""
    dy, mean, invvar, x, *w = ins
    ns = tuple(attrs["normalized_shape"])
    _, n1, _ = _split(x, ns)
    if dy.shape != x.shape:
        raise ShapeError(f"grad_output {list(dy.shape)} for input {list(x.shape)}")
    if mean.shape != (n1,) or invvar.shape != (n1,):
        raise ShapeError(f"statistics {list(mean.shape)}, {list(invvar.shape)} for {n1} rows")
    if w and w[0].shape != ns:
        raise ShapeError(f"weight {list(w[0].shape)} for normalized_shape {list(ns)}")
    return dy, x


def _grad_input_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    if len(ins) != 5:
        raise ShapeError("apex_layer_norm_grad_input takes grad_output, mean, invvar, input, weight")
    dy, _ = _bwd_check(ins, attrs)
    return dy


def _grad_weight_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    dy, _ = _bwd_check(ins, attrs)
    return TensorType(tuple(attrs["normalized_shape"]), dy.dtype)


def _grad_bias_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (dy,) = ins
    ns = tuple(attrs["normalized_shape"])
    _split(dy, ns)
    return TensorType(ns, dy.dtype)


# --- torch references: the formulas of apex's kernels, in float64 on the evaluator's tensors


def _rows(x: torch.Tensor, ns: tuple[int, ...]) -> torch.Tensor:
    return x.reshape(-1, math.prod(ns))


def _ref_fwd(x, w=None, b=None, normalized_shape=(), eps=1e-5):
    return F.layer_norm(x, tuple(normalized_shape), w, b, eps)


def _ref_mean(x, normalized_shape=(), eps=1e-5):
    return _rows(x, tuple(normalized_shape)).mean(1)


def _ref_invvar(x, normalized_shape=(), eps=1e-5):
    return torch.rsqrt(_rows(x, tuple(normalized_shape)).var(1, unbiased=False) + eps)


def _ref_xhat(mean, invvar, x, ns):
    return (_rows(x, ns) - mean[:, None]) * invvar[:, None]


def _ref_grad_input(dy, mean, invvar, x, w, normalized_shape=()):
    ns = tuple(normalized_shape)
    xhat = _ref_xhat(mean, invvar, x, ns)
    g = _rows(dy, ns) * w.reshape(1, -1)
    dx = invvar[:, None] * (g - g.mean(1, keepdim=True) - xhat * (g * xhat).mean(1, keepdim=True))
    return dx.reshape(x.shape)


def _ref_grad_weight(dy, mean, invvar, x, normalized_shape=()):
    ns = tuple(normalized_shape)
    return (_rows(dy, ns) * _ref_xhat(mean, invvar, x, ns)).sum(0).reshape(ns)


def _ref_grad_bias(dy, normalized_shape=()):
    ns = tuple(normalized_shape)
    return _rows(dy, ns).sum(0).reshape(ns)


# --- decompositions


def _fwd(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    x, *params = args
    ns = tuple(attrs["normalized_shape"])
    w = params[0] if len(params) > 0 else b.const(1.0, ns)
    bias = params[1] if len(params) > 1 else b.const(0.0, ns)
    return b.emit("layer_norm_c", [x, w, bias], {"normalized_ndim": len(ns), "eps": float(attrs["eps"])}, out)


def _stat(which: str):
    """norm.py's statistic (kept dims), flattened to the [n1] apex returns."""

    def decompose(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
        (x,) = args
        assert isinstance(x, str)
        ns = tuple(attrs["normalized_shape"])
        lead = b.type(x).shape[:len(b.type(x).shape) - len(ns)]
        kept = TensorType(lead + (1,) * len(ns), out.dtype)
        s = b.registry.ops[which].decompose(b, [x], {"normalized_shape": ns, "eps": float(attrs.get("eps", 1e-5))}, kept)
        return b.view(s, out.shape)

    return decompose


# The backward works in the input's own shape, the flat [n1] statistics viewed as its rows
# with the normalised dims kept: flattening the rows would merge a sharded dim that is not
# the outer one (a per-head norm of q/k with the heads split across ranks) into one dim that
# no concat describes.


def _trailing(x: TensorType, ns: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[int, ...]]:
    """(x's shape with the normalised dims kept at size 1, the normalised dims' indices)."""
    lead, _, _ = _split(x, ns)
    return lead + (1,) * len(ns), tuple(range(len(lead), x.ndim))


def _row_stat(b: Builder, t: str, x: TensorType, ns: tuple[Any, ...]) -> str:
    """A flat [n1] statistic broadcast over x's shape."""
    kept, _ = _trailing(x, ns)
    return b.broadcast(b.view(t, kept), x.shape)


def _mean_rows(b: Builder, t: str, ns: tuple[Any, ...]) -> str:
    """The mean of t over its normalised dims, kept and broadcast back: an exact 1/n2 scale
    of sums when n2 is concrete (partial sums stay a Sum), core rmeans otherwise."""
    tt = b.type(t)
    _, dims = _trailing(tt, ns)
    n2 = math.prod(ns)
    m = t
    for d in dims:
        m = b.emit("rsum" if isinstance(n2, int) else "rmean", [m], {"dim": d})
    if isinstance(n2, int):
        m = b.scale(m, Fraction(1, n2))
    return b.broadcast(m, tt.shape)


def _sum_rows(b: Builder, t: str, ns: tuple[Any, ...], out: TensorType) -> str:
    """t summed over its leading (row) dims, as the normalised shape."""
    tt = b.type(t)
    for d in range(tt.ndim - len(ns)):
        t = b.emit("rsum", [t], {"dim": d})
    return b.view(t, out.shape)


def _xhat(b: Builder, mean: str, invvar: str, x: str, ns: tuple[Any, ...]) -> str:
    """(x - mean) * invvar, in x's shape."""
    xt = b.type(x)
    centred = b.emit("Sum", [x, b.scale(_row_stat(b, mean, xt, ns), Fraction(-1))], {})
    return b.emit("mul_t", [centred, _row_stat(b, invvar, xt, ns)], {})


def _grad_input(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    dy, mean, invvar, x, w = args
    assert all(isinstance(a, str) for a in args)
    ns = tuple(attrs["normalized_shape"])
    xt = b.type(x)  # type: ignore[arg-type]
    xhat = _xhat(b, mean, invvar, x, ns)  # type: ignore[arg-type]
    g = b.emit("mul_t", [dy, b.broadcast(w, xt.shape)], {})
    proj = b.emit("mul_t", [xhat, _mean_rows(b, b.emit("mul_t", [g, xhat], {}), ns)], {})
    inner = b.emit("Sum", [g, b.scale(_mean_rows(b, g, ns), Fraction(-1)), b.scale(proj, Fraction(-1))], {})
    return b.emit("mul_t", [_row_stat(b, invvar, xt, ns), inner], {}, out)  # type: ignore[arg-type]


def _grad_weight(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    dy, mean, invvar, x = args
    ns = tuple(attrs["normalized_shape"])
    xhat = _xhat(b, mean, invvar, x, ns)  # type: ignore[arg-type]
    return _sum_rows(b, b.emit("mul_t", [dy, xhat], {}), ns, out)


def _grad_bias(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    (dy,) = args
    assert isinstance(dy, str)
    return _sum_rows(b, dy, tuple(attrs["normalized_shape"]), out)


NS = ("normalized_shape", "ints")
OPS = [
    Op("apex_layer_norm", -1, _fwd_shape, (NS, ("eps", "float")), ref=_ref_fwd, decompose=_fwd,
       doc="apex fused_layer_norm_affine_fwd output 0; args: input[, weight[, bias]]"),
    Op("apex_layer_norm_mean", 1, _stat_shape, (NS, ("eps", "float?")), ref=_ref_mean,
       decompose=_stat("layer_norm_mean"), doc="fwd output 1: per-row mean, flat [n1]"),
    Op("apex_layer_norm_invvar", 1, _stat_shape, (NS, ("eps", "float")), ref=_ref_invvar,
       decompose=_stat("layer_norm_rstd"), doc="fwd output 2: per-row 1/sqrt(biased var + eps), flat [n1]"),
    Op("apex_layer_norm_grad_input", 5, _grad_input_shape, (NS,), ref=_ref_grad_input, decompose=_grad_input,
       doc="bwd output 0; args: grad_output, mean, invvar, input, weight"),
    Op("apex_layer_norm_grad_weight", 4, _grad_weight_shape, (NS,), ref=_ref_grad_weight,
       decompose=_grad_weight, doc="bwd output 1; args: grad_output, mean, invvar, input"),
    Op("apex_layer_norm_grad_bias", 1, _grad_bias_shape, (NS,), ref=_ref_grad_bias, decompose=_grad_bias,
       doc="bwd output 2; args: grad_output"),
]
