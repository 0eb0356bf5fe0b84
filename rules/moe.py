"""Mixture-of-experts routing: top-k, sort, scatter with a tensor of values, accumulating scatter.

Routing is data dependent, so refine never looks inside it: `topk_values`/`topk_indices` and
`sort_values`/`sort_indices` are opaque functions of their input, and the only facts given are
those that hold for any such function that treats the rows along `dim` independently:

- **consistency**: the same input gives the same output (an e-graph gives this for free: two
  equal inputs are one class, so their top-k is one class);
- **independence of the other dims**: a concat or slice along a dim other than `dim` passes
  through (top-k of a token-sharded score matrix over the expert dim is the concat of the
  shards' top-k). Nothing ever relates values across `dim` itself.

`argmax` (GShard's top-1 and top-2 gating) is the same kind of opaque row function: the core
`argmax_k` keeps the reduced dim (torch returns the first largest value's position, so ties
are specified); the user op views it.

Ties: refine's `topk_*` are torch.topk (largest, sorted) and `sort_*` a stable ascending sort;
a row's result is assumed to depend on the row only (true of torch's kernels on one device).
Capture maps only `sort(stable=True)`: an unstable sort leaves the order of ties unspecified.

Permute/unpermute:

- `scatter_src(x, index, src, dim)`: x with src written at index along dim (torch.scatter with
  a tensor of values; index and src of one shape). It is the backward of top-k and builds the
  dense gate-weight matrix from the top-k values. Concats and slices on other dims pass through.
- `scatter_acc(index, src, dim, shape)`: zeros(shape) with src added at index along dim
  (duplicates add up, so it is exact for any index). The user op `scatter_add(x, index, src,
  dim)` (combine / unpermute, and the backward of `gather`) lowers to `x + scatter_acc(...)`,
  only the accumulation when x is the constant 0. Positions split any way: a concat of (index,
  src) on the scattered dim is the Sum of the pieces' accumulations; on another dim, the concat
  of them. Linear in src (a Scale passes through; a Sum of srcs is not split: no model has
  needed it).

`gather` (the permute, and the backward of scatter_acc) lives in rules/indexing.py;
`index_select` (a permute along one dim by a 1-d index) lowers to it. `index_add` arrives as
an accumulating `index_put` (rules/indexing.py) from aten's decompositions.
"""

from __future__ import annotations

from typing import Any

from refine.ir import sizes
from refine.ir.graph import Arg, Node, TensorType
from refine.ir.lazy import torch
from refine.ops.lower import Builder
from refine.ops.registry import ArgSpec, Op, Rule, Sample, ShapeError, index_within, rewrite, rule

INDEX_DTYPES = ("int64", "int32")


def _dim_ok(x: TensorType, d: int, what: str) -> None:
    if not 0 <= d < x.ndim:
        raise ShapeError(f"{what} over dim {d} of a {x.ndim}-d tensor")


def _topk_shape(index: bool) -> Any:
    def shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
        (x,) = ins
        d, k = attrs["dim"], attrs["k"]
        _dim_ok(x, d, "topk")
        if not (sizes.le(1, k) and sizes.le(k, x.shape[d])):
            raise ShapeError(f"topk of {k} along dim {d} of {list(x.shape)}")
        s = list(x.shape)
        s[d] = k
        return TensorType(tuple(s), "int64" if index else x.dtype)
    return shape


def _sort_shape(index: bool) -> Any:
    def shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
        (x,) = ins
        _dim_ok(x, attrs["dim"], "sort")
        return TensorType(x.shape, "int64" if index else x.dtype)
    return shape


def _check_scatter(idx: TensorType, src: TensorType, target: tuple[Any, ...], d: int, what: str) -> None:
    if idx.dtype not in INDEX_DTYPES:
        raise ShapeError(f"{what} index must be an integer tensor, got {idx.dtype}")
    if idx.shape != src.shape:
        raise ShapeError(f"{what}: index {list(idx.shape)} and src {list(src.shape)} must have one shape")
    if len(target) != idx.ndim or not 0 <= d < idx.ndim:
        raise ShapeError(f"{what} into {list(target)} on dim {d} with index {list(idx.shape)}")
    for i in range(idx.ndim):
        if i != d and not sizes.le(idx.shape[i], target[i]):
            raise ShapeError(f"{what}: index {list(idx.shape)} is larger than the target {list(target)} on dim {i}")


def _scatter_src_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, idx, src = ins
    _check_scatter(idx, src, x.shape, attrs["dim"], "scatter_src")
    return x


def _scatter_acc_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    idx, src = ins
    shape = tuple(attrs["shape"])
    _check_scatter(idx, src, shape, attrs["dim"], "scatter_acc")
    return TensorType(shape, src.dtype)


def _scatter_add_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, idx, src = ins
    _check_scatter(idx, src, x.shape, attrs["dim"], "scatter_add")
    return x


def _ref_scatter_acc(idx: torch.Tensor, src: torch.Tensor, dim: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.zeros(tuple(shape), dtype=src.dtype).scatter_add(dim, idx.long(), src)


def _is_zero(b: Builder, ref: str) -> bool:
    node = b.graph.index().get(ref)
    return isinstance(node, Node) and node.op == "full" and float(node.attrs["value"]) == 0.0


def _scatter_add(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    x, idx, src = args
    assert isinstance(x, str)
    acc = b.emit("scatter_acc", [idx, src], {"dim": attrs["dim"], "shape": b.type(x).shape}, out)
    return acc if _is_zero(b, x) else b.emit("Sum", [x, acc], {}, out)


def _index_select_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, idx = ins
    d = attrs["dim"]
    _dim_ok(x, d, "index_select")
    if idx.ndim != 1 or idx.dtype not in INDEX_DTYPES:
        raise ShapeError(f"index_select index must be a 1-d integer tensor, got {idx.dtype} {list(idx.shape)}")
    s = list(x.shape)
    s[d] = idx.shape[0]
    return TensorType(tuple(s), x.dtype)


def _index_select(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    """x.index_select(dim, idx) is a gather along dim with idx broadcast over the other dims."""
    x, idx = args
    assert isinstance(x, str) and isinstance(idx, str)
    d, n = attrs["dim"], b.type(idx).shape[0]
    line = tuple(n if i == d else 1 for i in range(out.ndim))
    index = b.broadcast(b.view(idx, line), out.shape)
    return b.emit("gather", [x, index], {"dim": d}, out)


def _argmax_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    d, keep = attrs.get("dim"), attrs.get("keepdim") or False
    if d is None:  # over the flattened tensor
        return TensorType((1,) * x.ndim if keep else (), "int64")
    _dim_ok(x, d, "argmax")
    s = list(x.shape)
    if keep:
        s[d] = 1
    else:
        del s[d]
    return TensorType(tuple(s), "int64")


def _argmax_k_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    return _argmax_shape(ins, {"dim": attrs["dim"], "keepdim": True})


def _argmax(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    """argmax(x, dim, keepdim) is the kept-dim core argmax_k, viewed; over the flattened
    tensor, argmax_k of x viewed as one row."""
    (x,) = args
    assert isinstance(x, str)
    d = attrs.get("dim")
    if d is None:
        n: Any = 1
        for k in b.type(x).shape:
            n = sizes.mul(n, k)
        x, d = b.view(x, (n,)), 0
    return b.view(b.emit("argmax_k", [x], {"dim": d}), out.shape)


def _same_shape_egg(op: str, args: str) -> str:
    return f"(rule ((= e ({op} x {args})) (= s (shape x))) ((set (shape e) s)))"


OPS = [
    Op("topk_values", 1, _topk_shape(False), (("k", "size"), ("dim", "dim")),
       ref=lambda x, k, dim: torch.topk(x, k, dim).values, core=True,
       egglog_shape="(rule ((= e (topk_values x k d)) (= s (shape x))) ((set (shape e) (vec-set s d k))))",
       doc="aten.topk output 0: the k largest values along dim, in descending order (opaque)"),
    Op("topk_indices", 1, _topk_shape(True), (("k", "size"), ("dim", "dim")),
       ref=lambda x, k, dim: torch.topk(x, k, dim).indices, core=True,
       egglog_shape="(rule ((= e (topk_indices x k d)) (= s (shape x))) ((set (shape e) (vec-set s d k))))",
       doc="aten.topk output 1: their positions along dim (opaque)"),
    Op("sort_values", 1, _sort_shape(False), (("dim", "dim"),),
       ref=lambda x, dim: torch.sort(x, dim=dim, stable=True).values, core=True,
       egglog_shape=_same_shape_egg("sort_values", "d"),
       doc="aten.sort(stable=True) output 0: values along dim in ascending order (opaque)"),
    Op("sort_indices", 1, _sort_shape(True), (("dim", "dim"),),
       ref=lambda x, dim: torch.sort(x, dim=dim, stable=True).indices, core=True,
       egglog_shape=_same_shape_egg("sort_indices", "d"),
       doc="aten.sort(stable=True) output 1: the stable sorting permutation along dim (opaque)"),
    Op("argmax_k", 1, _argmax_k_shape, (("dim", "dim"),),
       ref=lambda x, dim: torch.argmax(x, dim, keepdim=True), core=True,
       egglog_shape="(rule ((= e (argmax_k x d)) (= s (shape x))) ((set (shape e) (vec-set s d (dim 1)))))",
       doc="the position of the first largest value along dim, kept (opaque)"),
    Op("argmax", 1, _argmax_shape, (("dim", "dim?"), ("keepdim", "bool?")),
       ref=lambda x, dim=None, keepdim=False: torch.argmax(x, dim, keepdim=keepdim), decompose=_argmax,
       doc="aten.argmax: the first largest value's position along dim (or in the flattened tensor)"),
    Op("scatter_src", 3, _scatter_src_shape, (("dim", "dim"),),
       ref=lambda x, idx, src, dim: torch.scatter(x, dim, idx.long(), src), core=True,
       egglog_shape=_same_shape_egg("scatter_src", "i v g"),
       doc="aten.scatter.src: args self, index, src (index and src of one shape); src written at index"),
    Op("scatter_acc", 2, _scatter_acc_shape, (("dim", "dim"), ("shape", "shape")), ref=_ref_scatter_acc,
       core=True, egglog_shape="(rule ((= e (scatter_acc i v g s))) ((set (shape e) s)))",
       doc="zeros(shape) with src added at index along dim (duplicates add up; linear in src)"),
    Op("scatter_add", 3, _scatter_add_shape, (("dim", "dim"),),
       ref=lambda x, idx, src, dim: torch.scatter_add(x, dim, idx.long(), src), decompose=_scatter_add,
       doc="aten.scatter_add: args self, index, src; lowers to self + scatter_acc"),
    Op("index_select", 2, _index_select_shape, (("dim", "dim"),),
       ref=lambda x, idx, dim: torch.index_select(x, dim, idx.long()), decompose=_index_select,
       doc="aten.index_select: args self, index (1-d); a gather with the index broadcast"),
]

_OPAQUE = (("topk_values", "k g"), ("topk_indices", "k g"), ("sort_values", "g"), ("sort_indices", "g"),
           ("argmax_k", "g"))


def _opaque_rules() -> list[Rule]:
    out = []
    for op, attrs in _OPAQUE:
        out += [
            rewrite(f"{op}-over-cat", f"({op} (cat a b d) {attrs})", f"(cat ({op} a {attrs}) ({op} b {attrs}) d)",
                    "(!= d g)"),
            rewrite(f"slice-into-{op}", f"(slice ({op} x {attrs}) d s e)", f"({op} (slice x d s e) {attrs})",
                    "(!= d g)"),
        ]
    return out


def RULES(reg: Any) -> list[Rule]:  # noqa: N802 - a rule file's export
    return [
        *_opaque_rules(),
        # scatter_src: one of x, index, src split on a dim other than the scattered one splits
        # the others alike (index and src have one shape, no larger than x there)
        rule("scatter_src-cat-index", ["(= e (scatter_src x (cat p q d) v g))", "(!= d g)", "(= k (size p d))",
                                       "(= m (size v d))", "(= n (size x d))"],
             ["(union e (cat (scatter_src (slice x d (dim 0) k) p (slice v d (dim 0) k) g) "
              "(scatter_src (slice x d k n) q (slice v d k m) g) d))"]),
        rule("scatter_src-cat-src", ["(= e (scatter_src x i (cat p q d) g))", "(!= d g)", "(= k (size p d))",
                                     "(= m (size i d))", "(= n (size x d))"],
             ["(union e (cat (scatter_src (slice x d (dim 0) k) (slice i d (dim 0) k) p g) "
              "(scatter_src (slice x d k n) (slice i d k m) q g) d))"]),
        rule("scatter_src-cat-self", ["(= c (cat a b d))", "(= e (scatter_src c i v g))", "(!= d g)",
                                      "(= (size i d) (size c d))", "(= k (size a d))", "(= n (size i d))"],
             ["(union e (cat (scatter_src a (slice i d (dim 0) k) (slice v d (dim 0) k) g) "
              "(scatter_src b (slice i d k n) (slice v d k n) g) d))"]),
        rule("slice-into-scatter_src", ["(= e (slice (scatter_src x i v g) d s f))", "(!= d g)",
                                        "(= (size i d) (size x d))"],
             ["(union e (scatter_src (slice x d s f) (slice i d s f) (slice v d s f) g))"]),
        # scatter_acc: positions along the scattered dim split into a Sum, other dims into a concat
        rule("scatter_acc-index-cat-dim", ["(= e (scatter_acc (cat p q g) v g sh))", "(= k (size p g))",
                                           "(= n (size v g))"],
             ["(union e (Sum (multiset-of (scatter_acc p (slice v g (dim 0) k) g sh) "
              "(scatter_acc q (slice v g k n) g sh))))"]),
        rule("scatter_acc-src-cat-dim", ["(= e (scatter_acc i (cat p q g) g sh))", "(= k (size p g))",
                                         "(= n (size i g))"],
             ["(union e (Sum (multiset-of (scatter_acc (slice i g (dim 0) k) p g sh) "
              "(scatter_acc (slice i g k n) q g sh))))"]),
        rule("scatter_acc-index-cat", ["(= e (scatter_acc (cat p q d) v g sh))", "(!= d g)", "(= k (size p d))",
                                       "(= m (size v d))", "(= n (vec-get sh d))"],
             ["(union e (cat (scatter_acc p (slice v d (dim 0) k) g (vec-set sh d k)) "
              "(scatter_acc q (slice v d k m) g (vec-set sh d (d- n k))) d))"]),
        rule("scatter_acc-src-cat", ["(= e (scatter_acc i (cat p q d) g sh))", "(!= d g)", "(= k (size p d))",
                                     "(= m (size i d))", "(= n (vec-get sh d))"],
             ["(union e (cat (scatter_acc (slice i d (dim 0) k) p g (vec-set sh d k)) "
              "(scatter_acc (slice i d k m) q g (vec-set sh d (d- n k))) d))"]),
        rule("slice-into-scatter_acc", ["(= e (slice (scatter_acc i v g sh) d s f))", "(!= d g)",
                                        "(= (size i d) (vec-get sh d))"],
             ["(union e (scatter_acc (slice i d s f) (slice v d s f) g (vec-set sh d (d- f s))))"]),
        rewrite("scatter_acc-scale", "(scatter_acc i (Scale v r) g sh)", "(Scale (scatter_acc i v g sh) r)"),
    ]


# The soundness harness's seeds: k within the dim; index and src of one shape, no larger
# than the target
def _topk(gen: Any, x: tuple[int, ...]) -> tuple[list[ArgSpec], tuple[Any, ...]]:
    r = gen.rng
    d = r.randrange(len(x))
    return [(x, "f", 0)], (r.randint(1, x[d]), d)


def _scatter(name: str) -> Any:
    def args(gen: Any, x: tuple[int, ...]) -> tuple[list[ArgSpec], tuple[Any, ...]]:
        x, d, idx = index_within(gen)
        specs = [(idx, "i", x[d]), (idx, "f", 0)]
        return ([(x, "f", 0)] + specs, (d,)) if name == "scatter_src" else (specs, (d, x))

    return args


def _argmax_sample(gen: Any, x: tuple[int, ...]) -> tuple[list[ArgSpec], tuple[Any, ...]]:
    return [(x, "f", 0)], (gen.aux.randrange(len(x)),)  # the aux stream (structure.SEEDS says why)


SAMPLES = {"topk_values": Sample(_topk, count=2), "topk_indices": Sample(_topk, count=2),
           "argmax_k": Sample(_argmax_sample, count=2),
           "scatter_src": Sample(_scatter("scatter_src"), count=2),
           "scatter_acc": Sample(_scatter("scatter_acc"), count=3)}
