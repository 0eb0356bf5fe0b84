"""Reductions: over a sharded dim they become a sum (or max) of partial reductions; over
any other dim they keep the concat. Core reductions reduce one dim and keep it."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import torch

from refine.ir import Arg, TensorType
from refine.normalize import Builder
from refine.opset import HELPER, Op, Rule, ShapeError, rewrite, rule


def _keep_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    d = attrs["dim"]
    if not 0 <= d < x.ndim:
        raise ShapeError(f"reduction over dim {d} of {list(x.shape)}")
    s = list(x.shape)
    s[d] = 1
    return TensorType(tuple(s), x.dtype)


def _dims(attrs: dict[str, Any], ndim: int) -> tuple[int, ...]:
    dims = attrs.get("dim")
    return tuple(range(ndim)) if dims is None or dims == () else tuple(sorted(set(dims)))


def _user_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    dims = _dims(attrs, x.ndim)
    if any(not 0 <= d < max(x.ndim, 1) for d in dims):
        raise ShapeError(f"reduction over dims {list(dims)} of {list(x.shape)}")
    keep = attrs.get("keepdim", False)
    shape = tuple(1 if i in dims else s for i, s in enumerate(x.shape)) if keep else tuple(
        s for i, s in enumerate(x.shape) if i not in dims)
    return TensorType(shape, x.dtype)


def _reduce(core: str, mean: bool = False):
    def decompose(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
        (x,) = args
        shape = b.type(x).shape
        dims = _dims(attrs, len(shape))
        y, count = x, 1
        for d in dims:
            y = b.emit(core, [y], {"dim": d})
            count *= shape[d]
        if mean:
            y = b.scale(y, Fraction(1, count))
        return b.view(y, out.shape)

    return decompose


def _logsumexp(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    (x,) = args
    shape = b.type(x).shape
    dims = _dims(attrs, len(shape))
    m = x
    for d in dims:
        m = b.emit("rmax", [m], {"dim": d})
    shifted = b.emit("Sum", [x, b.scale(b.broadcast(m, shape), Fraction(-1))], {})
    s = b.emit("exp_t", [shifted], {})
    for d in dims:
        s = b.emit("rsum", [s], {"dim": d})
    y = b.emit("Sum", [b.emit("log_t", [s], {}), m], {})
    return b.view(y, out.shape)


KEEP_SHAPE_EGG = "(rule ((= e (OP x d)) (= s (shape x))) ((set (shape e) (vec-set s d (dim 1)))))"

OPS = [
    Op("rsum", 1, _keep_shape, (("dim", "dim"),), ref=lambda x, dim: x.sum(dim, keepdim=True),
       core=True, egglog_shape=KEEP_SHAPE_EGG.replace("OP", "rsum"), doc="sum over dim, kept"),
    Op("rmax", 1, _keep_shape, (("dim", "dim"),), ref=lambda x, dim: x.amax(dim, keepdim=True),
       core=True, egglog_shape=KEEP_SHAPE_EGG.replace("OP", "rmax"), doc="max over dim, kept"),
    Op("sum", 1, _user_shape, (("dim", "dims?"), ("keepdim", "bool?")),
       ref=lambda x, dim=None, keepdim=False: x.sum(dim=dim or tuple(range(x.ndim)), keepdim=keepdim),
       decompose=_reduce("rsum")),
    Op("mean", 1, _user_shape, (("dim", "dims?"), ("keepdim", "bool?")),
       ref=lambda x, dim=None, keepdim=False: x.mean(dim=dim or tuple(range(x.ndim)), keepdim=keepdim),
       decompose=_reduce("rsum", mean=True)),
    Op("amax", 1, _user_shape, (("dim", "dims?"), ("keepdim", "bool?")),
       ref=lambda x, dim=None, keepdim=False: x.amax(dim=dim or tuple(range(x.ndim)), keepdim=keepdim),
       decompose=_reduce("rmax")),
    Op("logsumexp", 1, _user_shape, (("dim", "dims?"), ("keepdim", "bool?")),
       ref=lambda x, dim=None, keepdim=False: torch.logsumexp(x, dim=dim or tuple(range(x.ndim)), keepdim=keepdim),
       decompose=_logsumexp),
]


def RULES(reg: Any) -> list[Rule]:  # noqa: N802 - a rule file's export
    out = []
    for op, nary in (("rsum", "Sum"), ("rmax", "Max")):
        out += [
            rewrite(f"{op}-over-cat-same-dim", f"({op} (cat a b d) d)",
                    f"({nary} (multiset-of ({op} a d) ({op} b d)))"),
            rewrite(f"{op}-over-cat-other-dim", f"({op} (cat a b d) d2)",
                    f"(cat ({op} a d2) ({op} b d2) d)", "(!= d d2)"),
            rewrite(f"slice-into-{op}", f"(slice ({op} x d2) d s e)",
                    f"({op} (slice x d s e) d2)", "(!= d d2)"),
        ]
    out += [
        rule("rsum-sum", ["(= e (rsum (Sum ms) d))"],
             ["(union e (Sum (unstable-multiset-map (unstable-fn \"RsumBy\" d) ms)))"]),
        rewrite("rsum-by", "(RsumBy d x)", "(rsum x d)"),
        rewrite("rsum-scale", "(rsum (Scale x r) d)", "(Scale (rsum x d) r)"),
        rule("rmax-max", ["(= e (rmax (Max ms) d))"],
             ["(union e (Max (unstable-multiset-map (unstable-fn \"RmaxBy\" d) ms)))"]),
        rewrite("rmax-by", "(RmaxBy d x)", "(rmax x d)"),
    ]
    return out


DECLS = [f"(constructor RsumBy (i64 T) T :cost {HELPER})", f"(constructor RmaxBy (i64 T) T :cost {HELPER})"]
