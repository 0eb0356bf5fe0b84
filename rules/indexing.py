"""Indexing: gather, scatter of a value, and accumulating index_put (the embedding and
cross-entropy backwards).

`gather(x, index, dim)` and `scatter_value(x, index, dim, value)` move data along `dim` only,
position by position along every other dim: a concat or slice of x and index on another dim
passes through (x may be larger than index there; the rules line them up).

`index_put_acc(index, values, shape)` is zeros(shape) with values[j] added at row index[j],
for every position j of index (values has index's shape followed by shape[1:]). Sums over
positions split any way: a concat of (index, values) on an indexed dim is the Sum of the
pieces' accumulations (data parallelism: the embedding grad is the Sum of the ranks'). It is
linear in the values. The user op `index_put(self, index, values, accumulate=True)` lowers to
`self + index_put_acc(...)` (only the accumulation when self is the constant 0), so duplicate
indices and a non-zero base are exact by construction.
"""

from __future__ import annotations

from typing import Any

from refine.ir import sizes
from refine.ir.graph import Arg, Node, TensorType
from refine.ir.lazy import torch
from refine.ir.term import Term
from refine.ops.lower import Builder, UnsupportedOp
from refine.ops.registry import (
    ArgSpec,
    Helper,
    Op,
    Rule,
    Sample,
    ShapeError,
    broadcast_shapes,
    index_within,
    rewrite,
    rule,
)

INT_DTYPES = ("int64", "int32", "int8", "uint8")


def _check_index(x: TensorType, idx: TensorType, d: int, what: str) -> None:
    if x.ndim < 1 or idx.ndim != x.ndim or not 0 <= d < x.ndim:
        raise ShapeError(f"{what} of {list(x.shape)} on dim {d} with index {list(idx.shape)}: "
                         "index needs the input's rank")
    if idx.dtype not in INT_DTYPES[:2]:
        raise ShapeError(f"{what} index must be an integer tensor, got {idx.dtype}")
    for i in range(x.ndim):
        if i != d and not sizes.le(idx.shape[i], x.shape[i]):
            raise ShapeError(f"{what}: index {list(idx.shape)} is larger than input {list(x.shape)} on dim {i}")


def _gather_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, idx = ins
    _check_index(x, idx, attrs["dim"], "gather")
    return TensorType(idx.shape, x.dtype)


def _scatter_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, idx = ins
    _check_index(x, idx, attrs["dim"], "scatter")
    return x


def _acc_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    idx, v = ins
    shape = tuple(attrs["shape"])
    if idx.dtype not in INT_DTYPES[:2]:
        raise ShapeError(f"index_put index must be an integer tensor, got {idx.dtype}")
    if not shape or v.shape != idx.shape + shape[1:]:
        raise ShapeError(f"index_put_acc of values {list(v.shape)} at index {list(idx.shape)} into {list(shape)}: "
                         "values must have the index's shape followed by the target's trailing dims")
    return TensorType(shape, v.dtype)


def _index_put_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    if len(ins) != 3:
        raise ShapeError(f"index_put takes (self, index, values) with one index tensor, got {len(ins)} tensors")
    x, idx, v = ins
    if x.ndim < 1 or idx.dtype not in INT_DTYPES[:2]:
        raise ShapeError(f"index_put into {list(x.shape)} with a {idx.dtype} index: need an integer index "
                         "(a bool mask is not supported)")
    want = idx.shape + x.shape[1:]
    if broadcast_shapes(v.shape, want) != want:
        raise ShapeError(f"index_put values {list(v.shape)} do not broadcast to {list(want)}")
    return x


def _ref_acc(idx: torch.Tensor, v: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    out = torch.zeros(tuple(shape), dtype=v.dtype)
    return out.index_put((idx.long(),), v, accumulate=True)


def _ref_index_put(x: torch.Tensor, idx: torch.Tensor, v: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
    return x.index_put((idx.long(),), v.to(x.dtype), accumulate=accumulate)


def _is_zero(b: Builder, ref: str) -> bool:
    node = b.graph.index().get(ref)
    return isinstance(node, Node) and node.op == "full" and float(node.attrs["value"]) == 0.0


def _index_put(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    x, idx, v = args
    assert isinstance(x, str) and isinstance(idx, str)
    if not attrs.get("accumulate"):
        # without accumulation, duplicate indices leave an unspecified winner
        raise UnsupportedOp("index_put with accumulate=False is not supported")
    shape = b.type(x).shape
    vals = b.broadcast(v, b.type(idx).shape + shape[1:], out.dtype)
    acc = b.emit("index_put_acc", [idx, vals], {"shape": shape}, out)
    return acc if _is_zero(b, x) else b.emit("Sum", [x, acc], {}, out)


OPS = [
    Op("gather", 2, _gather_shape, (("dim", "dim"),), ref=lambda x, idx, dim: torch.gather(x, dim, idx.long()),
       core=True,
       egglog_shape="(rule ((= e (gather x i g)) (= si (shape i))) ((set (shape e) si)))",
       doc="aten.gather: args x, index; out[j] = x[j with index[j] at dim]", linear="first"),
    Op("scatter_value", 2, _scatter_shape, (("dim", "dim"), ("value", "float")),
       ref=lambda x, idx, dim, value: torch.scatter(x, dim, idx.long(), value), core=True,
       egglog_shape="(rule ((= e (scatter_value x i g v)) (= s (shape x))) ((set (shape e) s)))",
       doc="aten.scatter.value: args self, index; self with value written at index along dim"),
    Op("scatter", 2, _scatter_shape, (("dim", "dim"), ("value", "float")),
       ref=lambda x, idx, dim, value: torch.scatter(x, dim, idx.long(), value),
       decompose=lambda b, args, attrs, out: b.emit("scatter_value", list(args), attrs, out),
       doc="aten.scatter.value under its base name (scatter.src, with a tensor of values, is not supported)"),
    Op("index_put_acc", 2, _acc_shape, (("shape", "shape"),), ref=_ref_acc, core=True,
       egglog_shape="(rule ((= e (index_put_acc i v s))) ((set (shape e) s)))",
       doc="zeros(shape) with values[j] added at row index[j] for every position j of index"),
    Op("index_put", -1, _index_put_shape, (("accumulate", "bool?"),), ref=_ref_index_put, decompose=_index_put,
       doc="aten.index_put: args self, index (one tensor, over dim 0), values; accumulate=True only"),
]


def RULES(reg: Any) -> list[Rule]:  # noqa: N802 - a rule file's export
    return [
        # gather: x and index split together on a dim other than the gathered one
        rule("gather-cat-x", ["(= c (cat a b d))", "(= e (gather c i g))", "(!= d g)",
                              "(= (size i d) (size c d))", "(= k (size a d))", "(= n (size i d))"],
             ["(union e (cat (gather a (slice i d (dim 0) k) g) (gather b (slice i d k n) g) d))"]),
        rule("gather-cat-index", ["(= e (gather x (cat p q d) g))", "(!= d g)", "(= k (size p d))",
                                  "(= n (size x d))"],
             ["(union e (cat (gather (slice x d (dim 0) k) p g) (gather (slice x d k n) q g) d))"]),
        rewrite("slice-into-gather", "(slice (gather x i g) d s e)", "(gather (slice x d s e) (slice i d s e) g)",
                "(!= d g)"),
        rewrite("slice-gather-dim", "(slice (gather x i g) g s e)", "(gather x (slice i g s e) g)"),
        # a gather is linear in its table (a loss's lookup of log-probs written as a sum of
        # terms); from a broadcast whose gathered dim is 1 it picks the one value there is
        rule("gather-sum", ["(= e (gather (Sum ms) i g))"],
             ["(union e (Sum (unstable-multiset-map (unstable-fn \"GatherBy\" i g) ms)))"]),
        rewrite("gather-by", "(GatherBy i g x)", "(gather x i g)"),
        rewrite("gather-scale", "(gather (Scale x r) i g)", "(Scale (gather x i g) r)"),
        rule("gather-broadcast", ["(= e (gather (expand y s) i g))", "(= si (shape i))",
                                  "(= (shape y) (vec-set si g (dim 1)))"],
             ["(union e (expand y si))"]),
        # scatter of a value: the same, positions past the index's extent are left as they are
        rule("scatter-cat-self", ["(= c (cat a b d))", "(= e (scatter_value c i g v))", "(!= d g)",
                                  "(= (size i d) (size c d))", "(= k (size a d))", "(= n (size i d))"],
             ["(union e (cat (scatter_value a (slice i d (dim 0) k) g v) "
              "(scatter_value b (slice i d k n) g v) d))"]),
        rule("scatter-cat-index", ["(= e (scatter_value x (cat p q d) g v))", "(!= d g)", "(= k (size p d))",
                                   "(= n (size x d))"],
             ["(union e (cat (scatter_value (slice x d (dim 0) k) p g v) "
              "(scatter_value (slice x d k n) q g v) d))"]),
        rule("slice-into-scatter", ["(= e (slice (scatter_value x i g v) d s f))", "(!= d g)",
                                    "(= (size i d) (size x d))"],
             ["(union e (scatter_value (slice x d s f) (slice i d s f) g v))"]),
        # accumulation: positions split into a Sum; trailing dims split into a concat
        rule("index_put_acc-index-cat", ["(= e (index_put_acc (cat p q d) v sh))", "(= k (size p d))",
                                         "(= n (size v d))"],
             ["(union e (Sum (multiset-of (index_put_acc p (slice v d (dim 0) k) sh) "
              "(index_put_acc q (slice v d k n) sh))))"]),
        rule("index_put_acc-values-cat", ["(= e (index_put_acc i (cat p q d) sh))", "(< d (ndim i))",
                                          "(= k (size p d))", "(= n (size i d))"],
             ["(union e (Sum (multiset-of (index_put_acc (slice i d (dim 0) k) p sh) "
              "(index_put_acc (slice i d k n) q sh))))"]),
        rule("index_put_acc-values-cat-trailing", ["(= e (index_put_acc i (cat p q d) sh))", "(>= d (ndim i))",
                                                   "(= j (- d (- (ndim i) 1)))"],
             ["(union e (cat (index_put_acc i p (vec-set sh j (size p d))) "
              "(index_put_acc i q (vec-set sh j (size q d))) j))"]),
        rule("slice-into-index_put_acc", ["(= e (slice (index_put_acc i v sh) d s f))", "(> d 0)"],
             ["(union e (index_put_acc i (slice v (+ d (- (ndim i) 1)) s f) (vec-set sh d (d- f s))))"]),
        rule("index_put_acc-sum", ["(= e (index_put_acc i (Sum ms) sh))"],
             ["(union e (Sum (unstable-multiset-map (unstable-fn \"IndexPutBy\" i sh) ms)))"]),
        rewrite("index-put-by", "(IndexPutBy i sh v)", "(index_put_acc i v sh)"),
        rewrite("index_put_acc-scale", "(index_put_acc i (Scale v r) sh)", "(Scale (index_put_acc i v sh) r)"),
    ]


HELPERS = [Helper("IndexPutBy", ("T", "IV", "T"), lambda op, i, sh, v: op("index_put_acc")(i, v, shape=tuple(sh))),
           Helper("GatherBy", ("T", "i64", "T"), lambda op, i, g, x: op("gather")(x, i, dim=g))]


# The soundness harness's seeds: indices in range, sometimes smaller than x on another dim
def _gather_like(name: str) -> Sample:
    def args(gen: Any, x: tuple[int, ...]) -> tuple[list[ArgSpec], tuple[Any, ...]]:
        x, d, idx = index_within(gen)
        attrs = (d,) if name == "gather" else (d, gen.rng.choice([-1.0, 2.5]))
        return [(x, "f", 0), (idx, "i", x[d])], attrs

    return Sample(args, count=2)


def _index_put(gen: Any, x: tuple[int, ...]) -> tuple[list[ArgSpec], tuple[Any, ...]]:
    r = gen.rng
    idx = gen.dims(r.choice([1, 1, 2]))
    trailing = gen.dims(r.choice([0, 1, 1, 2]))
    rows = r.choice([2, 3, 4, 5])
    return [(idx, "i", rows), (idx + trailing, "f", 0)], ((rows,) + trailing,)


SAMPLES = {"gather": _gather_like("gather"), "scatter_value": _gather_like("scatter_value"),
           "index_put_acc": Sample(_index_put, count=2)}


def SHARED_SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """Inputs and indices lined up: x and the index with the same extent on the concat's
    dim, gathered and scattered along the other; lookups into a broadcast; accumulations of values cut along their
    trailing dim; slices of them; the helper constructor applied directly."""
    r = gen.rng
    out: list[Term] = []
    for _ in range(gen.instances):
        x = Term("cat", (gen.leaf((1, 3)), gen.leaf((2, 3))), (0,))
        idx = gen.leaf((3, r.choice([1, 2])), "i", 3)
        out += [Term("gather", (x, idx), (1,)), Term("scatter_value", (x, idx), (1, -1.0)),
                Term("slice", (Term("scatter_value", (gen.leaf((3, 3)), idx), (1, 2.0)),), (0, 1, 3))]
        rows = r.choice([2, 4])
        i1 = gen.leaf((3,), "i", rows)
        vals = Term("cat", (gen.leaf((3, 1)), gen.leaf((3, 2))), (1,))
        out.append(Term("index_put_acc", (i1, vals), ((rows, 3),)))
        out.append(Term("slice", (Term("index_put_acc", (i1, gen.leaf((3, 3))), ((rows, 3),)),), (1, 1, 3)))
        out.append(Term("IndexPutBy", (i1, gen.leaf((3, 2))), ((rows, 2),)))
        # lookups into a broadcast of a value kept along the gathered dim (k lookups per row)
        k = r.choice([1, 2])
        y = gen.leaf((3, 1))
        out.append(Term("gather", (Term("expand", (y,), ((3, 4),)), gen.leaf((3, k), "i", 4)), (1,)))
        y3 = gen.leaf((2, 1, 3))
        out.append(Term("gather", (Term("expand", (y3,), ((2, 5, 3),)), gen.leaf((2, k, 3), "i", 5)), (1,)))
        out.append(Term("GatherBy", (gen.leaf((3, k), "i", 2), gen.leaf((3, 2))), (1,)))
    return out
