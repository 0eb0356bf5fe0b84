"""Reductions: over a sharded dim they become a sum (or max) of partial reductions; over
any other dim they keep the concat. Core reductions reduce one dim and keep it."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from refine.ir.graph import Arg, TensorType
from refine.ir.lazy import torch
from refine.ir.term import Term
from refine.ops.lower import Builder
from refine.ops.registry import (
    ArgSpec,
    Helper,
    Op,
    Rule,
    Sample,
    ShapeError,
    ShapeFn,
    rewrite,
    rule,
)


def _keep_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    d = attrs["dim"]
    if not 0 <= d < x.ndim:
        raise ShapeError(f"reduction over dim {d} of {list(x.shape)}")
    s = list(x.shape)
    s[d] = 1
    return TensorType(tuple(s), x.dtype)


def _summed(shape: ShapeFn) -> ShapeFn:
    """torch sums bool tensors as int64 (a count of the true elements)."""

    def rule(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
        t = shape(ins, attrs)
        return TensorType(t.shape, "int64") if t.dtype == "bool" else t

    return rule


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


def _mean_over(b: Builder, x: str, dims: tuple[int, ...]) -> str:
    """The mean of x over dims, kept: a sum scaled by the exact 1/count over the concrete
    dims (so sharded partial sums stay a Sum), a core `rmean` over each symbolic one (1/T
    is no rational)."""
    shape = b.type(x).shape
    y, count = x, 1
    for d in dims:
        if isinstance(shape[d], int):
            y = b.emit("rsum", [y], {"dim": d})
            count *= shape[d]
        else:
            y = b.emit("rmean", [y], {"dim": d})
    if count == 0:
        raise ShapeError("mean over an empty dim")
    return b.scale(y, Fraction(1, count))


def _reduce(core: str, mean: bool = False):
    def decompose(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
        (x,) = args
        assert isinstance(x, str)
        dims = _dims(attrs, len(b.type(x).shape))
        if mean:
            return b.view(_mean_over(b, x, dims), out.shape)
        y = x
        for d in dims:
            y = b.emit(core, [y], {"dim": d})
        return b.view(y, out.shape)

    return decompose


def _any(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    """Whether any element over dims is nonzero: the max over them of x != 0 (a boolean
    max is an or), so it splits over shards as amax does."""
    (x,) = args
    assert isinstance(x, str)
    typ = b.type(x)
    y = x if typ.dtype == "bool" else b.emit("ne_t", [x, b.const(0, typ.shape, typ.dtype)], {})
    for d in _dims(attrs, len(typ.shape)):
        y = b.emit("rmax", [y], {"dim": d})
    return b.view(y, out.shape)


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
    Op("rsum", 1, _summed(_keep_shape), (("dim", "dim"),), ref=lambda x, dim: x.sum(dim, keepdim=True),
       core=True, egglog_shape=KEEP_SHAPE_EGG.replace("OP", "rsum"), doc="sum over dim, kept", linear="first"),
    Op("rmax", 1, _keep_shape, (("dim", "dim"),), ref=lambda x, dim: x.amax(dim, keepdim=True),
       core=True, egglog_shape=KEEP_SHAPE_EGG.replace("OP", "rmax"), doc="max over dim, kept"),
    Op("rmean", 1, _keep_shape, (("dim", "dim"),), ref=lambda x, dim: x.mean(dim, keepdim=True),
       core=True, egglog_shape=KEEP_SHAPE_EGG.replace("OP", "rmean"),
       doc="mean over dim, kept (means over a symbolic size; concrete ones are scaled sums)", linear="first"),
    Op("sum", 1, _summed(_user_shape), (("dim", "dims?"), ("keepdim", "bool?")),
       ref=lambda x, dim=None, keepdim=False: x.sum(dim=dim or tuple(range(x.ndim)), keepdim=keepdim),
       decompose=_reduce("rsum")),
    Op("mean", 1, _user_shape, (("dim", "dims?"), ("keepdim", "bool?")),
       ref=lambda x, dim=None, keepdim=False: x.mean(dim=dim or tuple(range(x.ndim)), keepdim=keepdim),
       decompose=_reduce("rsum", mean=True)),
    Op("amax", 1, _user_shape, (("dim", "dims?"), ("keepdim", "bool?")),
       ref=lambda x, dim=None, keepdim=False: x.amax(dim=dim or tuple(range(x.ndim)), keepdim=keepdim),
       decompose=_reduce("rmax")),
    Op("any", 1, lambda ins, a: TensorType(_user_shape(ins, a).shape, "bool"), (("dim", "dims?"), ("keepdim", "bool?")),
       ref=lambda x, dim=None, keepdim=False: x.bool().amax(dim=dim or tuple(range(x.ndim)), keepdim=keepdim),
       decompose=_any, doc="whether any element over dims is nonzero"),
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
    # a reduction over a dim of size 1 keeps the tensor (a GQA rank holding one query head
    # per kv head: its repeat_kv's backward sums over a size-1 dim, the sequential one's does not)
    out += [rewrite(f"{op}-size-one", f"({op} x d)", "x", "(= (size x d) (dim 1))") for op in ("rsum", "rmax", "rmean")]
    out += [
        rule("rsum-sum", ["(= e (rsum (Sum ms) d))"],
             ["(union e (Sum (unstable-multiset-map (unstable-fn \"RsumBy\" d) ms)))"]),
        rewrite("rsum-by", "(RsumBy d x)", "(rsum x d)"),
        rewrite("rsum-scale", "(rsum (Scale x r) d)", "(Scale (rsum x d) r)"),
        rule("rmax-max", ["(= e (rmax (Max ms) d))"],
             ["(union e (Max (unstable-multiset-map (unstable-fn \"RmaxBy\" d) ms)))"]),
        rewrite("rmax-by", "(RmaxBy d x)", "(rmax x d)"),
        # a mean over a dim keeps a concat on any other dim and is linear; over the
        # concat's own dim it would need size ratios as rationals (no rule: no relation)
        rewrite("rmean-over-cat-other-dim", "(rmean (cat a b d) d2)", "(cat (rmean a d2) (rmean b d2) d)",
                "(!= d d2)"),
        rewrite("slice-into-rmean", "(slice (rmean x d2) d s e)", "(rmean (slice x d s e) d2)", "(!= d d2)"),
        rule("rmean-sum", ["(= e (rmean (Sum ms) d))"],
             ["(union e (Sum (unstable-multiset-map (unstable-fn \"RmeanBy\" d) ms)))"]),
        rewrite("rmean-by", "(RmeanBy d x)", "(rmean x d)"),
        rewrite("rmean-scale", "(rmean (Scale x r) d)", "(Scale (rmean x d) r)"),
    ]
    # a sum over the first dim of a view that merged x's first two dims is the sum over
    # both (a 3-d Linear's bias gradient: its [s*b, h] view summed over the tokens; a count
    # over a flattened [b, t] mask, k = 0)
    for k in range(0, 4):
        rest = [f"(= (vec-get s {i}) (vec-get (shape x) {i + 1}))" for i in range(1, k + 1)]
        out.append(rewrite(f"rsum-merged-view-{k}", "(rsum (view x s) 0)",
                           "(view (rsum (rsum x 0) 1) (vec-set s 0 (dim 1)))",
                           f"(= (ndim x) {k + 2})", f"(= (vec-length s) {k + 1})",
                           "(= (vec-get s 0) (d* (vec-get (shape x) 0) (vec-get (shape x) 1)))", *rest))
    out += [
        # with concrete sizes a mean is the scaled sum, so a split dim gives partial sums
        rule("rmean-as-sum", ["(= e (rmean x d))", "(= n (size x d))", "(> n 0)"],
             ["(union e (Scale (rsum x d) (bigrat (bigint 1) (bigint n))))"], symbolic=False),
    ]
    return out


HELPERS = [Helper("RsumBy", ("i64", "T"), lambda op, d, x: op("rsum")(x, dim=d)),
           Helper("RmaxBy", ("i64", "T"), lambda op, d, x: op("rmax")(x, dim=d)),
           Helper("RmeanBy", ("i64", "T"), lambda op, d, x: op("rmean")(x, dim=d))]


def SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """Reductions over a dim of size 1 (rarely drawn by the generic seeds in symbolic mode)."""
    out: list[Term] = []
    for _ in range(gen.instances):
        shape = list(gen.dims(3))
        d = gen.rng.randrange(3)
        shape[d] = 1
        x = gen.leaf(tuple(shape))
        out += [Term(op, (x,), (d,)) for op in ("rsum", "rmax", "rmean")]
    return out


def SHARED_SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """Sums over a merged first dim, and the helper constructors applied directly."""
    out: list[Term] = []
    for _ in range(gen.instances):
        for src, v in (((2, 3), (6,)), ((2, 3, 4), (6, 4)), ((3, 2, 2, 5), (6, 2, 5)), ((2, 2, 1, 2, 3), (4, 1, 2, 3)),
                       ((2, 3, 4), (3, 2, 4))):
            out.append(Term("rsum", (Term("view", (gen.leaf(src),), (v,)),), (0,)))
        t = gen.leaf((2, 3))
        out += [Term(h, (t,), (gen.rng.randrange(2),)) for h in ("RsumBy", "RmaxBy", "RmeanBy")]
    return out


# The soundness harness's seeds: a dim to reduce over
def _over_dim(gen: Any, x: tuple[int, ...]) -> tuple[list[ArgSpec], tuple[Any, ...]]:
    return [(x, "f", 0)], (gen.rng.randrange(len(x)),)


SAMPLES = {"rsum": Sample(_over_dim, count=2), "rmax": Sample(_over_dim, count=2), "rmean": Sample(_over_dim)}
