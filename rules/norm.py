"""Softmax and normalisation: they act along some dims and commute with a concat on any
other dim. (Normalising over a sharded dim needs a statistics all-reduce; that decomposes.)"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from refine.ir import Arg, TensorType
from refine.normalize import Builder
from refine.opset import Op, Rule, ShapeError, rewrite


def _along(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x = ins[0]
    if not 0 <= attrs["dim"] < x.ndim:
        raise ShapeError(f"dim {attrs['dim']} of {list(x.shape)}")
    return x


def _norm_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, *params = ins
    k = attrs["normalized_ndim"]
    if not 1 <= k <= x.ndim:
        raise ShapeError(f"normalising {k} trailing dims of {list(x.shape)}")
    for p in params:
        if p.shape != x.shape[x.ndim - k:]:
            raise ShapeError(f"norm parameter {list(p.shape)} for input {list(x.shape)}")
    return x


def _user_norm_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    ns = tuple(attrs["normalized_shape"])
    x = ins[0]
    if x.shape[x.ndim - len(ns):] != ns:
        raise ShapeError(f"normalized_shape {list(ns)} does not end {list(x.shape)}")
    return _norm_shape(ins, {"normalized_ndim": len(ns)})


def _layer_norm(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    x, *params = args
    ns = tuple(attrs["normalized_shape"])
    w = params[0] if len(params) > 0 and params[0] is not None else b.const(1.0, ns)
    bias = params[1] if len(params) > 1 and params[1] is not None else b.const(0.0, ns)
    return b.emit("layer_norm_c", [x, w, bias], {"normalized_ndim": len(ns), "eps": float(attrs.get("eps", 1e-5))}, out)


def _rms_norm(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    x, *params = args
    ns = tuple(attrs["normalized_shape"])
    w = params[0] if params and params[0] is not None else b.const(1.0, ns)
    return b.emit("rms_norm_c", [x, w], {"normalized_ndim": len(ns), "eps": float(attrs.get("eps", 1e-6))}, out)


def _ln_ref(x, w, b, normalized_ndim, eps):
    return F.layer_norm(x, x.shape[x.ndim - normalized_ndim:], w, b, eps)


def _rms_ref(x, w, normalized_ndim, eps):
    dims = tuple(range(x.ndim - normalized_ndim, x.ndim))
    return x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps) * w


NORM_ATTRS = (("normalized_ndim", "int"), ("eps", "float"))
SAME_EGG = "(rule ((= e (OP x ARGS)) (= s (shape x))) ((set (shape e) s)))"

OPS = [
    Op("softmax", 1, _along, (("dim", "dim"),), ref=lambda x, dim: torch.softmax(x, dim), core=True,
       egglog_shape=SAME_EGG.replace("OP", "softmax").replace("ARGS", "d")),
    Op("log_softmax", 1, _along, (("dim", "dim"),), ref=lambda x, dim: torch.log_softmax(x, dim),
       core=True, egglog_shape=SAME_EGG.replace("OP", "log_softmax").replace("ARGS", "d")),
    Op("layer_norm_c", 3, _norm_shape, NORM_ATTRS, ref=_ln_ref, core=True,
       egglog_shape=SAME_EGG.replace("OP", "layer_norm_c").replace("ARGS", "w b k eps"),
       doc="layer norm over the trailing normalized_ndim dims, with weight and bias"),
    Op("rms_norm_c", 2, _norm_shape, NORM_ATTRS, ref=_rms_ref, core=True,
       egglog_shape=SAME_EGG.replace("OP", "rms_norm_c").replace("ARGS", "w k eps")),
    Op("layer_norm", -1, _user_norm_shape, (("normalized_shape", "ints"), ("eps", "float?")),
       ref=lambda x, w=None, b=None, normalized_shape=(), eps=1e-5: F.layer_norm(x, normalized_shape, w, b, eps),
       decompose=_layer_norm, doc="args: x[, weight[, bias]]"),
    Op("rms_norm", -1, _user_norm_shape, (("normalized_shape", "ints"), ("eps", "float?")),
       ref=lambda x, w=None, normalized_shape=(), eps=1e-6: _rms_ref(x, w if w is not None else torch.ones(normalized_shape, dtype=x.dtype), len(normalized_shape), eps),
       decompose=_rms_norm, doc="args: x[, weight]"),
]


def RULES(reg: Any) -> list[Rule]:  # noqa: N802 - a rule file's export
    out = []
    for op in ("softmax", "log_softmax"):
        out += [
            rewrite(f"{op}-over-cat", f"({op} (cat a b d) d2)", f"(cat ({op} a d2) ({op} b d2) d)",
                    "(!= d d2)"),
            rewrite(f"slice-into-{op}", f"(slice ({op} x d2) d s e)", f"({op} (slice x d s e) d2)",
                    "(!= d d2)"),
        ]
    # a concat on a dim the norm does not normalise (d < ndim - k) passes through it
    out += [
        rewrite("layer_norm-over-cat", "(layer_norm_c (cat a b d) w c k eps)",
                "(cat (layer_norm_c a w c k eps) (layer_norm_c b w c k eps) d)",
                "(< d (- (ndim a) k))"),
        rewrite("slice-into-layer_norm", "(slice (layer_norm_c x w c k eps) d s e)",
                "(layer_norm_c (slice x d s e) w c k eps)", "(< d (- (ndim x) k))"),
        rewrite("rms_norm-over-cat", "(rms_norm_c (cat a b d) w k eps)",
                "(cat (rms_norm_c a w k eps) (rms_norm_c b w k eps) d)", "(< d (- (ndim a) k))"),
        rewrite("slice-into-rms_norm", "(slice (rms_norm_c x w k eps) d s e)",
                "(rms_norm_c (slice x d s e) w k eps)", "(< d (- (ndim x) k))"),
    ]
    return out
