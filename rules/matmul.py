"""Matrix products: split rows, columns, batch or the contraction dim (which gives a sum).

Core `matmul(a, b)` takes a of shape [..., m, k] and b of shape [k, n] or [..., k, n] with
a's batch dims; user ops (mm, bmm, matmul, linear, addmm, baddbmm) lower to it.
"""

from __future__ import annotations

from typing import Any

from refine.ir.graph import Arg, TensorType
from refine.ir.lazy import torch
from refine.ir.term import Term
from refine.ops.lower import Builder, rational
from refine.ops.registry import (
    ArgSpec,
    Helper,
    Op,
    Rule,
    Sample,
    ShapeError,
    broadcast_shapes,
    matmul_shape,
    rewrite,
    rule,
)


def _user_matmul_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    a, b = ins
    return TensorType(matmul_shape(a.shape, b.shape), a.dtype)


def _lower_matmul(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    x, w = args
    sx, sw = b.type(x).shape, b.type(w).shape
    if len(sx) == 1:
        x, sx = b.view(x, (1,) + sx), (1,) + sx
    squeeze_n = len(sw) == 1
    if squeeze_n:
        w, sw = b.view(w, sw + (1,)), sw + (1,)
    if len(sw) > 2:
        batch = broadcast_shapes(sx[:-2], sw[:-2])
        x = b.broadcast(x, batch + sx[-2:])
        w = b.broadcast(w, batch + sw[-2:])
    y = b.emit("matmul", [x, w], {})
    return b.view(y, out.shape)


def _linear(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    x, w, *bias = args
    y = b.emit("matmul", [x, b.transpose(w, 0, 1)], {})
    if bias:
        y = b.emit("Sum", [y, b.broadcast(bias[0], out.shape)], {}, out)
    return y


def _addmm(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    bias, x, w = args
    y = b.scale(_lower_matmul(b, [x, w], {}, out), rational(attrs.get("alpha", 1), "alpha"))
    beta = rational(attrs.get("beta", 1), "beta")
    if beta == 0:
        return y
    return b.emit("Sum", [y, b.scale(b.broadcast(bias, out.shape), beta)], {}, out)


def _linear_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, w = ins[0], ins[1]
    if w.ndim != 2 or x.shape[-1] != w.shape[1]:
        raise ShapeError(f"linear of {list(x.shape)} with weight {list(w.shape)}")
    if len(ins) == 3 and ins[2].shape not in ((w.shape[0],), ()):
        raise ShapeError(f"linear bias {list(ins[2].shape)} for weight {list(w.shape)}")
    return TensorType(x.shape[:-1] + (w.shape[0],), x.dtype)


def _addmm_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    out = _user_matmul_shape(ins[1:], attrs)
    if broadcast_shapes(ins[0].shape, out.shape) != out.shape:
        raise ShapeError(f"bias {list(ins[0].shape)} does not broadcast to {list(out.shape)}")
    return out


def _linear_ref(x, w, b=None):
    return torch.nn.functional.linear(x, w, b)


OPS = [
    # the core op; a user's torch.matmul (1-d operands, broadcast batches) lowers to it
    Op("matmul", 2, _user_matmul_shape, ref=torch.matmul, core=True, kind="compute",
       decompose=_lower_matmul,
       egglog_shape="(rule ((= e (matmul a b)) (= sa (shape a)) (= sb (shape b))) "
       "((set (shape e) (vec-set sa (- (vec-length sa) 1) (vec-get sb (- (vec-length sb) 1))))))", linear="each"),
    Op("mm", 2, _user_matmul_shape, ref=torch.mm, decompose=_lower_matmul),
    Op("bmm", 2, _user_matmul_shape, ref=torch.bmm, decompose=_lower_matmul),
    Op("linear", -1, _linear_shape, ref=_linear_ref, decompose=_linear,
       doc="x @ w.T (+ bias); args: x, w[, bias]"),
    Op("addmm", 3, _addmm_shape, (("beta", "float?"), ("alpha", "float?")),
       ref=lambda c, a, b, beta=1, alpha=1: torch.addmm(c, a, b, beta=beta, alpha=alpha),
       decompose=_addmm),
    Op("baddbmm", 3, _addmm_shape, (("beta", "float?"), ("alpha", "float?")),
       ref=lambda c, a, b, beta=1, alpha=1: torch.baddbmm(c, a, b, beta=beta, alpha=alpha),
       decompose=_addmm),
]


def RULES(reg: Any) -> list[Rule]:  # noqa: N802 - a rule file's export
    last = "(- (ndim p) 1)"
    return [
        # rows of a (any non-contraction dim of a when b is shared)
        rule("matmul-rows", ["(= e (matmul (cat p q d) b))", "(= (ndim b) 2)", f"(< d {last})"],
             ["(union e (cat (matmul p b) (matmul q b) d))"]),
        rule("matmul-rows-batched", ["(= e (matmul (cat p q d) b))", "(> (ndim b) 2)",
                                     "(= d (- (ndim p) 2))"],
             ["(union e (cat (matmul p b) (matmul q b) d))"]),
        rule("matmul-batch-left", ["(= e (matmul (cat p q d) b))", "(> (ndim b) 2)",
                                   "(< d (- (ndim p) 2))", "(= k (size p d))", "(= n (size e d))"],
             ["(union e (cat (matmul p (slice b d (dim 0) k)) (matmul q (slice b d k n)) d))"]),
        # columns of b
        rule("matmul-cols", ["(= e (matmul a (cat p q d)))", f"(= d {last})"],
             ["(union e (cat (matmul a p) (matmul a q) (- (ndim e) 1)))"]),
        rule("matmul-batch-right", ["(= e (matmul a (cat p q d)))", "(< d (- (ndim p) 2))",
                                    "(= k (size p d))", "(= n (size e d))"],
             ["(union e (cat (matmul (slice a d (dim 0) k) p) (matmul (slice a d k n) q) d))"]),
        # the contraction dim: a sum of partial products
        rule("matmul-contract-left", ["(= e (matmul (cat p q d) b))", f"(= d {last})",
                                      "(= k (size p d))", "(= nb (ndim b))"],
             ["(union e (Sum (multiset-of (matmul p (slice b (- nb 2) (dim 0) k)) "
              "(matmul q (slice b (- nb 2) k (size b (- nb 2)))))))"]),
        rule("matmul-contract-right", ["(= e (matmul a (cat p q d)))", "(= d (- (ndim p) 2))",
                                       "(= k (size p d))", "(= na (ndim a))"],
             ["(union e (Sum (multiset-of (matmul (slice a (- na 1) (dim 0) k) p) "
              "(matmul (slice a (- na 1) k (size a (- na 1))) q))))"]),
        # linearity
        rule("matmul-sum-left", ["(= e (matmul (Sum ms) b))"],
             ["(union e (Sum (unstable-multiset-map (unstable-fn \"MatmulBy\" b) ms)))"]),
        rule("matmul-sum-right", ["(= e (matmul a (Sum ms)))"],
             ["(union e (Sum (unstable-multiset-map (unstable-fn \"matmul\" a) ms)))"]),
        rewrite("matmul-by", "(MatmulBy b a)", "(matmul a b)"),
        rewrite("matmul-scale-left", "(matmul (Scale a r) b)", "(Scale (matmul a b) r)"),
        rewrite("matmul-scale-right", "(matmul a (Scale b r))", "(Scale (matmul a b) r)"),
        # a slice of a product is a product of slices
        rule("slice-matmul-rows", ["(= e (slice (matmul a b) d s f))", "(< d (- (ndim a) 1))",
                                   "(= (ndim b) 2)"],
             ["(union e (matmul (slice a d s f) b))"]),
        rule("slice-matmul-cols", ["(= e (slice (matmul a b) d s f))", "(= d (- (ndim a) 1))"],
             ["(union e (matmul a (slice b (- (ndim b) 1) s f)))"]),
        # a batch dim is sliced on both sides; the row dim of a batched product only on a
        rule("slice-matmul-batched", ["(= e (slice (matmul a b) d s f))", "(> (ndim b) 2)",
                                      "(< d (- (ndim a) 2))"],
             ["(union e (matmul (slice a d s f) (slice b d s f)))"]),
        rule("slice-matmul-batched-rows", ["(= e (slice (matmul a b) d s f))", "(> (ndim b) 2)",
                                           "(= d (- (ndim a) 2))"],
             ["(union e (matmul (slice a d s f) b))"]),
        # the converse of the row rules, kept to products that exist (no slice term is made):
        # rows of a product are the product of those rows. A sequence laid out in permuted
        # chunks (head-tail context parallelism) meets the sequential product as one over a
        # concat of slices of the ranks' inputs, whose products the ranks hold only whole.
        rule("matmul-of-row-slice-existing", ["(= e (matmul (slice a d s f) b))", "(= u (matmul a b))",
                                              "(< d (- (ndim a) 1))", "(= (ndim b) 2)"],
             ["(union e (slice u d s f))"]),
        rule("matmul-of-batched-row-slice-existing", ["(= e (matmul (slice a d s f) b))", "(= u (matmul a b))",
                                                      "(> (ndim b) 2)", "(= d (- (ndim a) 2))"],
             ["(union e (slice u d s f))"]),
        # a^T b is the transpose of b^T a, when that product exists (no term is made): a
        # batched product's backward forms a^T b (bmm's gradient of its transposed operand)
        # where the ranks compute b^T a (a flash-style backward's dK_j = dS_j^T Q)
        rule("matmul-transposed-existing", ["(= e (matmul (transpose a i j) b))", "(= f (matmul (transpose b i j) a))",
                                            "(= j (- (ndim a) 1))", "(= i (- j 1))"],
             ["(union e (transpose f i j))"]),
    ]


HELPERS = [Helper("MatmulBy", ("T", "T"), lambda op, b, a: op("matmul")(a, b))]


# The soundness harness's seeds: matrix products, batched on one side or both
def _matmul(gen: Any, x: tuple[int, ...]) -> tuple[list[ArgSpec], tuple[Any, ...]]:
    r = gen.rng
    m, k, n = gen.dims(3)
    batch = gen.dims(r.choice([0, 1, 1, 2]))
    b = batch + (k, n) if batch and r.random() < 0.5 else (k, n)
    return [(batch + (m, k), "f", 0), (b, "f", 0)], ()


SAMPLES = {"matmul": Sample(_matmul, count=4)}


def SHARED_SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """Batched products with a concat or a slice on each dim, and the helper constructor
    applied directly."""
    out: list[Term] = []
    for _ in range(gen.instances):
        ab, bb = gen.leaf((2, 3, 2)), gen.leaf((2, 2, 4))
        for d in range(3):
            out.append(Term("slice", (Term("matmul", (ab, bb)),), (d, 1, 2)))
        out.append(Term("matmul", (Term("cat", (gen.leaf((1, 3, 2)), gen.leaf((1, 3, 2))), (0,)), bb)))
        out.append(Term("matmul", (ab, Term("cat", (gen.leaf((1, 2, 4)), gen.leaf((1, 2, 4))), (0,)))))
        out.append(Term("matmul", (Term("cat", (gen.leaf((2, 1, 2)), gen.leaf((2, 2, 2))), (1,)), bb)))
        out.append(Term("MatmulBy", (gen.leaf((3, 4)), gen.leaf((2, 3)))))
    return out


def SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """Products a^T b next to b^T a, 2-D and batched (the transposed-product rule joins them)."""
    out: list[Term] = []
    for _ in range(gen.instances):
        for batch in ((), (2,)):
            a, b = gen.leaf((*batch, 3, 2)), gen.leaf((*batch, 3, 4))
            i, j = len(batch), len(batch) + 1
            out += [Term("matmul", (Term("transpose", (a,), (i, j)), b)),
                    Term("matmul", (Term("transpose", (b,), (i, j)), a))]
        # a product of some rows next to the product of all (one term, the rows stacked)
        for batch in ((), (2,)):
            a, b, d = gen.leaf((*batch, 3, 2)), gen.leaf((*batch, 2, 4)), len(batch)  # d: the row dim
            rows = Term("matmul", (Term("slice", (a,), (d, 1, 3)), b))
            out.append(Term("cat", (Term("matmul", (a, b)), rows), (d,)))
    return out
