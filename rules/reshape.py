"""Reshapes and permutations. Every reshape lowers to the core `view`; a permute lowers to
transposes. A view keeps a concat when the concat's blocks stay contiguous blocks of one
output dim: the dims before both have the same element count, and the block size divides."""

from __future__ import annotations

import math
from typing import Any

from refine.ir import sizes
from refine.ir.graph import Arg, TensorType
from refine.ir.term import Term
from refine.ops.lower import Builder, normalize_dim
from refine.ops.registry import Op, Rule, ShapeError, rule


def _resolve(shape: tuple[int, ...], numel: int) -> tuple[int, ...]:
    if list(shape).count(-1) > 1:
        raise ShapeError(f"shape {list(shape)} has more than one -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if known == 0 or not sizes.divides(known, numel):
            raise ShapeError(f"cannot infer -1 in {list(shape)} for {numel} elements")
        shape = tuple(sizes.exact_div(numel, known) if s == -1 else s for s in shape)
    if math.prod(shape) != numel:
        raise ShapeError(f"shape {list(shape)} does not hold {numel} elements")
    return shape


def _view_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    return TensorType(_resolve(tuple(attrs["shape"]), math.prod(x.shape)), x.dtype)


def _view(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    return b.view(args[0], out.shape)  # type: ignore[arg-type]


def _flatten_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    if x.ndim == 0:
        return TensorType((1,), x.dtype)
    s, e = attrs.get("start_dim", 0), attrs.get("end_dim", x.ndim - 1)
    return TensorType(x.shape[:s] + (math.prod(x.shape[s:e + 1]),) + x.shape[e + 1:], x.dtype)


def _unsqueeze_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    d = attrs["dim"]
    d = normalize_dim(d, x.ndim + 1)
    return TensorType(x.shape[:d] + (1,) + x.shape[d:], x.dtype)


def _squeeze_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    dims = attrs.get("dim")
    dims = range(x.ndim) if dims is None else dims
    return TensorType(tuple(s for i, s in enumerate(x.shape) if not (i in dims and s == 1)), x.dtype)


def _permute_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    dims = attrs["dims"]
    if sorted(dims) != list(range(x.ndim)):
        raise ShapeError(f"permute dims {list(dims)} for a {x.ndim}-d tensor")
    return TensorType(tuple(x.shape[d] for d in dims), x.dtype)


def _permute(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    (x,) = args
    at = list(range(len(attrs["dims"])))  # which input dim sits at each position
    for i, want in enumerate(attrs["dims"]):
        j = at.index(want)
        if j != i:
            x = b.transpose(x, i, j)  # type: ignore[arg-type]
            at[i], at[j] = at[j], at[i]
    return x  # type: ignore[return-value]


def _t_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    if x.ndim > 2:
        raise ShapeError(f"t() of a {x.ndim}-d tensor")
    return TensorType(tuple(reversed(x.shape)), x.dtype)


def _t(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    return b.transpose(args[0], 0, 1) if b.type(args[0]).ndim == 2 else args[0]  # type: ignore[arg-type,return-value]


def _expand_user_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    shape = list(attrs["shape"])
    off = len(shape) - x.ndim
    for i in range(x.ndim):
        if shape[i + off] == -1:
            shape[i + off] = x.shape[i]
    if off < 0 or any(x.shape[i] not in (1, shape[i + off]) for i in range(x.ndim)):
        raise ShapeError(f"cannot expand {list(x.shape)} to {list(attrs['shape'])}")
    return TensorType(tuple(shape), x.dtype)


def _expand(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    return b.broadcast(args[0], out.shape)


def _repeat_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    reps = tuple(attrs["repeats"])
    if len(reps) < x.ndim or any(r < 0 for r in reps):
        raise ShapeError(f"repeat of a {x.ndim}-d tensor by {list(reps)}")
    padded = (1,) * (len(reps) - x.ndim) + tuple(x.shape)
    return TensorType(tuple(r * s for r, s in zip(reps, padded, strict=True)), x.dtype)


def _repeat(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    """Tiling: each dim of size s becomes (r, s) with the copies outermost, broadcast, merged."""
    (x,) = args
    reps = tuple(attrs["repeats"])
    padded = (1,) * (len(reps) - b.type(x).ndim) + tuple(b.type(x).shape)  # type: ignore[arg-type]
    split = b.view(x, tuple(d for s in padded for d in (1, s)))  # type: ignore[arg-type]
    tiled = b.broadcast(split, tuple(d for r, s in zip(reps, padded, strict=True) for d in (r, s)))
    return b.view(tiled, out.shape)


def _ref_view(x, shape):
    return x.reshape(shape)


OPS = [
    Op("reshape", 1, _view_shape, (("shape", "ints"),), ref=_ref_view, decompose=_view),
    Op("_unsafe_view", 1, _view_shape, (("shape", "ints"),), ref=_ref_view, decompose=_view),
    Op("flatten", 1, _flatten_shape, (("start_dim", "dim?"), ("end_dim", "dim?")),
       ref=lambda x, start_dim=0, end_dim=-1: x.flatten(start_dim, end_dim), decompose=_view),
    Op("unsqueeze", 1, _unsqueeze_shape, (("dim", "int"),), ref=lambda x, dim: x.unsqueeze(dim),
       decompose=_view),
    Op("squeeze", 1, _squeeze_shape, (("dim", "dims?"),),
       ref=lambda x, dim=None: x.squeeze() if dim is None else x.squeeze(dim), decompose=_view),
    Op("permute", 1, _permute_shape, (("dims", "dims"),), ref=lambda x, dims: x.permute(dims),
       decompose=_permute),
    Op("t", 1, _t_shape, ref=lambda x: x.t(), decompose=_t),
    Op("expand_as_shape", 1, _expand_user_shape, (("shape", "ints"),),
       ref=lambda x, shape: x.expand(shape), decompose=_expand,
       doc="torch's expand, with -1 for kept dims"),
    Op("repeat", 1, _repeat_shape, (("repeats", "ints"),), ref=lambda x, repeats: x.repeat(*repeats),
       decompose=_repeat, doc="torch's repeat (tiling): a broadcast of x between size-1 dims, merged"),
]


MAX_UNIT_SPAN = 4  # transposes of dims up to 4 apart (tensors of up to 5 dims)


def _unit_transpose_rules() -> list[Rule]:
    """A transpose whose spanned dims (its two and those between) hold at most one dim of
    size other than 1 keeps every element at its row-major position: it is a view. A rank
    holding one of the sequential model's blocks moves a size-1 dim where the sequential
    model moves a larger one (`got.view(w, e, C, M).transpose(0, 1)` of a rank's one
    expert, or of its one group), so only as views do the two sides' terms meet."""
    out: list[Rule] = []
    for span in range(1, MAX_UNIT_SPAN + 1):
        for lo, hi in (("i", "j"), ("j", "i")):
            for k in range(span + 1):  # the one spanned position that may have any size
                units = [f"(= (vec-get sx (+ {lo} {q})) (dim 1))" for q in range(span + 1) if q != k]
                out.append(rule(
                    f"transpose-unit-dims-view-{span}-{k}{'' if lo == 'i' else '-rev'}",
                    ["(= e (transpose x i j))", f"(= {hi} (+ {lo} {span}))", "(= sx (shape x))", *units],
                    ["(union e (view x (vec-set (vec-set sx i (vec-get sx j)) j (vec-get sx i))))"]))
    return out


def RULES(reg: Any) -> list[Rule]:  # noqa: N802 - a rule file's export
    return [
        *_unit_transpose_rules(),
        # (pp s i): the product of the first i entries of a shape vector
        rule("prefix-product-start", ["(= s (shape x))"], ["(set (pp s 0) (dim 1))"], analysis=True),
        rule("prefix-product-step", ["(= p (pp s i))", "(< i (vec-length s))"],
             ["(set (pp s (+ i 1)) (d* p (vec-get s i)))"], analysis=True),
        rule("view-over-cat",
             ["(= e (view c s))", "(= c (cat p q d))", "(= si (shape c))", "(= so (shape e))",
              "(= pre (pp si d))", "(= pre (pp so d2))", "(< d2 (vec-length so))",
              "(= n (pp si (vec-length si)))",
              "(= inner-in (d/ n (pp si (+ d 1))))", "(= inner-out (d/ n (pp so (+ d2 1))))",
              "(= k (size p d))", "(d-divides inner-out (d* k inner-in))",
              "(= k2 (d/ (d* k inner-in) inner-out))", "(d> k2 (dim 0))", "(d< k2 (vec-get so d2))"],
             ["(union e (cat (view p (vec-set so d2 k2)) "
              "(view q (vec-set so d2 (d- (vec-get so d2) k2))) d2))"]),
        # a slice along a dim the view keeps (same extent, same elements before it) is a
        # slice of the input along that dim, viewed
        rule("slice-view-kept-dim",
             ["(= e (slice v d2 s t))", "(= v (view x so))", "(= si (shape x))",
              "(= pre (pp si d))", "(= pre (pp so d2))", "(< d (vec-length si))", "(< d2 (vec-length so))",
              "(= (vec-get si d) (vec-get so d2))"],
             ["(union e (view (slice x d s t) (vec-set so d2 (d- t s))))"]),
        # a slice along a dim of the view whose every index is k whole indices of the
        # input's dim d (same elements before both; the view's inner block a multiple k of
        # the input's): the outer factor of a split dim, [W*E, ..] viewed as [W, E, ..]
        # and one rank's block taken, is a slice of k times the range, viewed
        rule("slice-view-outer-dim",
             ["(= e (slice v d2 s t))", "(= v (view x so))", "(= si (shape x))",
              "(= pre (pp si d))", "(= pre (pp so d2))", "(< d (vec-length si))", "(< d2 (vec-length so))",
              "(= n (pp si (vec-length si)))",
              "(= inner-in (d/ n (pp si (+ d 1))))", "(= inner-out (d/ n (pp so (+ d2 1))))",
              "(d-divides inner-in inner-out)", "(= k (d/ inner-out inner-in))", "(d!= k (dim 1))"],
             ["(union e (view (slice x d (d* s k) (d* t k)) (vec-set so d2 (d- t s))))"]),
        # and the other way: a slice along a dim of the view each of whose k indices make one
        # index of the input's dim d (the input's inner block k times the view's), at bounds
        # k divides: [W, E, ..] merged into [W*E, ..] and one rank's E rows taken
        rule("slice-view-merged-dim",
             ["(= e (slice v d2 s t))", "(= v (view x so))", "(= si (shape x))",
              "(= pre (pp si d))", "(= pre (pp so d2))", "(< d (vec-length si))", "(< d2 (vec-length so))",
              "(= n (pp si (vec-length si)))",
              "(= inner-in (d/ n (pp si (+ d 1))))", "(= inner-out (d/ n (pp so (+ d2 1))))",
              "(d-divides inner-out inner-in)", "(= k (d/ inner-in inner-out))", "(d!= k (dim 1))",
              "(d-divides k s)", "(d-divides k t)"],
             ["(union e (view (slice x d (d/ s k) (d/ t k)) (vec-set so d2 (d- t s))))"]),
    ]


DECLS = ["(function pp (IV i64) Dim :merge old)"]


def SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """Transposes over size-1 dims: each span, each position of the one dim of another size,
    either order of the transpose's dims, behind a leading dim or not."""
    out: list[Term] = []
    for span in range(1, MAX_UNIT_SPAN + 1):
        for k in range(span + 1):
            lead = gen.aux.choice([(), (2,)])  # the aux stream (structure.SEEDS says why)
            shape = lead + tuple(3 if q == k else 1 for q in range(span + 1))
            i, j = len(lead), len(lead) + span
            out += [Term("transpose", (gen.leaf(shape),), (i, j)), Term("transpose", (gen.leaf(shape),), (j, i))]
    # slices of the outer factor of a split dim, behind a kept dim or not
    for shape, split, d in (((6, 2), (3, 2, 2), 0), ((2, 4, 3), (2, 2, 2, 3), 1), ((4, 3), (2, 6), 0),
                            ((3, 2, 2), (6, 2), 0), ((2, 2, 2, 3), (2, 4, 3), 1), ((2, 6), (4, 3), 0)):
        k = max(1, split[d] // shape[d])  # a merged dim: slices at multiples of its inner factor
        s = k * gen.aux.randrange(split[d] // k)
        t = k * gen.aux.randint(s // k + 1, split[d] // k)
        out.append(Term("slice", (Term("view", (gen.leaf(shape),), (split,)),), (d, s, t)))
    return out


def SHARED_SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """Views that keep or break a concat: head splits and merges of a concat along either
    dim, and flattened."""
    r = gen.rng
    out: list[Term] = []
    for _ in range(gen.instances):
        a, b = r.choice([(2, 4), (4, 2), (3, 3), (1, 5), (2, 2)])
        h = r.choice([1, 2, 3])
        for d, shp in ((0, (a + b, h)), (1, (h, a + b))):
            c = Term("cat", (gen.leaf(shp[:d] + (a,) + shp[d + 1:]), gen.leaf(shp[:d] + (b,) + shp[d + 1:])), (d,))
            n = a + b
            f = r.choice([f for f in range(1, n + 1) if n % f == 0])
            split = shp[:d] + (f, n // f) + shp[d + 1:]
            out += [Term("view", (c,), (split,)), Term("view", (c,), ((math.prod(shp),),))]
            merged = Term("cat", (gen.leaf((h, a, 2)), gen.leaf((h, b, 2))), (1,))
            out += [Term("view", (merged,), ((h, (a + b) * 2),)), Term("view", (merged,), ((h * (a + b), 2),))]
    return out
