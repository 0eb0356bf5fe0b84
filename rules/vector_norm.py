"""Vector norms (torch.linalg.vector_norm, clip_grad_norm_'s per-gradient norms and their
norm) and the non-negativity analysis they need.

A 2-norm over every dim lowers to `norm_root_c(sumsq_c(x))`: the root of the sum of the
squares of all elements. Over a concat (a sharded gradient) the sum of squares is the Sum of
the pieces' (`sumsq-over-cat`), so the norm of a whole tensor is the root of the Sum of the
ranks' squared norms. A norm of norms (clip_grad_norm_'s `vector_norm(stack(norms))`)
lowers to the root of the Sum of the stacked norms' squares, and each squared norm
sqrt(s_i)^2 is s_i again. That last step holds only where s_i is not negative, so this
family keeps an analysis: `(NonNeg e)`, no element of e is negative (a NaN is not
negative: sqrt of a negative number is NaN, never below 0). It is derived bottom-up from
squares, sums of squares, absolute values, exps, square roots, sums, scales and views of
non-negative tensors. The soundness harness evaluates every NonNeg fact of its e-graphs
(FACTS below).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from refine.ir.graph import Arg, TensorType
from refine.ir.lazy import torch
from refine.ir.term import Term
from refine.ops.lower import Builder
from refine.ops.registry import (
    DEMAND,
    Fact,
    Op,
    Rule,
    ShapeError,
    every_term,
    rewrite,
    rule,
    wanted_through,
)


def _dims(attrs: dict[str, Any], ndim: int) -> tuple[int, ...]:
    dims = attrs.get("dim")
    if dims is None or dims == ():
        return tuple(range(ndim))
    return tuple(sorted({d % max(ndim, 1) for d in dims}))


def _norm_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    ord_ = float(attrs.get("ord", 2.0))
    if ord_ not in (1.0, 2.0, math.inf):
        raise ShapeError(f"vector norm of order {ord_}: refine lowers orders 1, 2 and inf only")
    dims = _dims(attrs, x.ndim)
    if any(not 0 <= d < max(x.ndim, 1) for d in dims):
        raise ShapeError(f"vector norm over dims {list(dims)} of {list(x.shape)}")
    keep = attrs.get("keepdim", False)
    shape = tuple(1 if i in dims else s for i, s in enumerate(x.shape)) if keep else tuple(
        s for i, s in enumerate(x.shape) if i not in dims)
    dtype = attrs.get("dtype") or x.dtype
    if not dtype.startswith(("float", "bfloat")):
        raise ShapeError(f"vector norm of dtype {dtype}")
    return TensorType(shape, dtype)


def _pieces(b: Builder, x: str) -> list[str]:
    """The pieces of x when it is a concat (nested, along any dims), else [x]."""
    node = b.graph.index().get(x)
    if node is None or getattr(node, "op", None) != "cat":
        return [x]
    return [p for a in node.tensor_args() for p in _pieces(b, a)]


def _vector_norm(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    """Order 2 over every dim: the root of the sum of squares, a concat's (torch.stack of
    norms, say) written as the Sum of its pieces' sums of squares (the same value: every
    element is in one piece). Order 2 over some dims: squares, sums, root; 1: the sum of
    absolute values; inf: their max."""
    (x,) = args
    assert isinstance(x, str)
    ord_ = float(attrs.get("ord", 2.0))
    ndim = len(b.type(x).shape)
    dims = _dims(attrs, ndim)
    if ord_ == 2.0 and len(dims) == ndim:
        parts = [b.emit("sumsq_c", [p], {}) for p in _pieces(b, x)]
        total = parts[0] if len(parts) == 1 else b.emit("Sum", parts, {})
        return b.view(b.emit("norm_root_c", [total], {}), out.shape)
    y = b.emit("square_t" if ord_ == 2.0 else "abs_t", [x], {})
    for d in dims:
        y = b.emit("rmax" if ord_ == math.inf else "rsum", [y], {"dim": d})
    if ord_ == 2.0:
        y = b.emit("norm_root_c", [y], {})
    return b.view(y, out.shape)


def _ref(x: torch.Tensor, ord: float = 2.0, dim: Any = None, keepdim: bool = False,  # noqa: A002
         dtype: str | None = None) -> torch.Tensor:
    return torch.linalg.vector_norm(x, ord, dim=dim or None, keepdim=keepdim)


OPS = [
    # fused (Op.fuse): a sum of squares no rank holds (a replicated gradient's squared norm,
    # or that of a stack of norms) is seen by its users as the formula, and the Sum of them
    # meets the ranks' all-reduced squared norm further down
    Op("sumsq_c", 1, lambda ins, attrs: TensorType((), ins[0].dtype), ref=lambda x: (x * x).sum(),
       core=True, fuse=True, linear="", egglog_shape="(rule ((= e (sumsq_c x))) ((set (shape e) (vec-empty))))",
       doc="the sum of the squares of every element (a squared 2-norm), rank 0"),
    # sqrt_t, but fused (Op.fuse): clip_grad_norm_ stacks per-gradient norms no rank holds
    # (sqrt of a sum over ranks), so their users see the root over the sum's relation, and
    # the square of the stacked norms meets the ranks' squared norms again
    Op("norm_root_c", 1, lambda ins, attrs: ins[0], ref=torch.sqrt, core=True, fuse=True,
       egglog_shape="(rule ((= e (norm_root_c x)) (= s (shape x))) ((set (shape e) s)))",
       doc="the square root that ends a 2-norm: sqrt_t (rule norm-root), fused"),
    Op("linalg_vector_norm", 1, _norm_shape,
       (("ord", "float?"), ("dim", "dims?"), ("keepdim", "bool?"), ("dtype", "str?")), ref=_ref,
       decompose=_vector_norm, doc="torch.linalg.vector_norm of order 1, 2 or inf (aten's; _foreach_norm's "
       "per-tensor norms at capture)"),
]

ZERO = "(bigrat (bigint 0) (bigint 1))"

# Ops whose result is non-negative where their first operand is (their other arguments after it)
PASSING = (("rsum", "d"), ("rmax", "d"), ("rmean", "d"), ("view", "s"), ("expand", "s"), ("slice", "d st en"),
           ("transpose", "i j"))

# (NonNeg e): no element of e is negative. Analysis rules: they run with the shape rules,
# to saturation before each iteration, so every rewrite below sees the facts complete.
NONNEG = [
    *(rule(f"nonneg-{op}", [f"(= e ({op} x))"], ["(NonNeg e)"], analysis=True)
      for op in ("square_t", "sumsq_c", "abs_t", "exp_t", "sqrt_t", "norm_root_c", "sigmoid_t", "relu_t")),
    rule("nonneg-mul-self", ["(= e (mul_t x x))"], ["(NonNeg e)"], analysis=True),
    rule("nonneg-full", ["(= e (full v s))", "(>= v 0.0)"], ["(NonNeg e)"], analysis=True),
    rule("nonneg-clamp", ["(= e (clamp_t x lo hi))", "(>= lo 0.0)"], ["(NonNeg e)"], analysis=True),
    *(rule(f"nonneg-{op}", [f"(= e ({op} x {args}))", "(NonNeg x)"], ["(NonNeg e)"], analysis=True)
      for op, args in PASSING),
    rule("nonneg-scale", ["(= e (Scale x r))", "(NonNeg x)", f"(>= r {ZERO})"], ["(NonNeg e)"], analysis=True),
    rule("nonneg-mul", ["(= e (mul_t x y))", "(NonNeg x)", "(NonNeg y)"], ["(NonNeg e)"], analysis=True),
    # a sum whose every term is non-negative, asked of what a square root or an abs is over
    *(rule(f"nonneg-want-{op}", [f"(= e ({op} x))"], ["(NNWant x)"], analysis=True) for op in ("sqrt_t", "abs_t")),
    *wanted_through("nonneg", "NNWant", (*PASSING, ("Scale", "r"))),
    rule("nonneg-want-mul", ["(NNWant e)", "(= e (mul_t x y))"], ["(NNWant x)", "(NNWant y)"], analysis=True),
    *every_term("nonneg", "NonNeg", "NNTodo", "NNAll", want="NNWant"),
    rule("nonneg-cat", ["(= e (cat a b d))", "(NonNeg a)", "(NonNeg b)"], ["(NonNeg e)"], analysis=True),
]

RULES: list[Rule] = [
    *NONNEG,
    rewrite("norm-root", "(norm_root_c x)", "(sqrt_t x)"),
    # sums of squares: of a concat (a sharded tensor), a view, a transpose, a scale, one element
    rewrite("sumsq-over-cat", "(sumsq_c (cat a b d))", "(Sum (multiset-of (sumsq_c a) (sumsq_c b)))"),
    rewrite("sumsq-view", "(sumsq_c (view x s))", "(sumsq_c x)"),
    rewrite("sumsq-transpose", "(sumsq_c (transpose x i j))", "(sumsq_c x)"),
    rewrite("sumsq-scale", "(sumsq_c (Scale x r))", "(Scale (sumsq_c x) (* r r))"),
    rewrite("sumsq-scalar", "(sumsq_c x)", "(square_t x)", "(= (ndim x) 0)"),
    # a square root squared is its argument where that is not negative (else NaN)
    rewrite("square-sqrt", "(square_t (sqrt_t x))", "x", "(NonNeg x)"),
    rewrite("mul-sqrt-sqrt", "(mul_t (sqrt_t x) (sqrt_t x))", "x", "(NonNeg x)"),
    rewrite("abs-nonneg", "(abs_t x)", "x", "(NonNeg x)"),
    rewrite("sqrt-square", "(sqrt_t (square_t x))", "(abs_t x)"),
    rewrite("mul-self-square", "(mul_t x x)", "(square_t x)"),
    # x ** 2 and x ** 0.5 (a traced `norm ** 2`, Megatron's `total ** (1 / norm_type)`)
    rewrite("pow-two", "(pow_t x (full 2.0 s))", "(square_t x)"),
    rewrite("pow-half", "(pow_t x (full 0.5 s))", "(sqrt_t x)"),
    # the squares and roots of a norm of norms meet through the views of torch.stack
    rewrite("square-view", "(square_t (view x s))", "(view (square_t x) s)"),
    rewrite("sqrt-view", "(sqrt_t (view x s))", "(view (sqrt_t x) s)"),
    # (a reduction over a size-1 dim keeping every element is rules/reduce.py's rsum-size-one)
]

DECLS = ["(relation NonNeg (T))", "(relation NNWant (T))", "(relation NNTodo (TS))", "(relation NNAll (TS))"]


def _nonneg(v: Any) -> bool:
    return not bool((v < 0).any())  # no element negative (NaN is not negative)


# What the facts say, for the soundness harness: it checks every fact it reads back
FACTS = {
    "NonNeg": Fact("one", _nonneg),
    "NNWant": DEMAND,  # a sum asked about
    "NNAll": Fact("all", _nonneg),  # every term of a sum is non-negative
    "NNTodo": Fact("any", _nonneg),  # the rest of a sum, walked while its terms are non-negative
}


def SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """Non-negative terms of every form the analysis knows, and the patterns the rewrites
    match on them and on random (mostly negative-holding) leaves."""
    r = gen.rng
    out: list[Term] = []
    for _ in range(gen.instances):
        n, k = r.choice([1, 2, 3]), r.choice([1, 2, 3])
        x, y = gen.leaf((n, k)), gen.leaf((n, k))
        sq = Term("square_t", (x,))
        pos = gen.leaf((n, k), "p")
        nonneg = [
            sq, Term("abs_t", (x,)), Term("exp_t", (x,)), Term("sqrt_t", (x,)), Term("sigmoid_t", (x,)),
            Term("relu_t", (x,)), Term("mul_t", (x, x)), Term("full", (), (0.5, (n, k))),
            Term("clamp_t", (x,), (0.0, 1.0)), Term("rsum", (sq,), (1,)), Term("rmax", (sq,), (0,)),
            Term("rmean", (sq,), (1,)), Term("Scale", (sq,), (Fraction(3, 2),)),
            Term("mul_t", (sq, Term("abs_t", (y,)))), Term("Sum", (sq, Term("exp_t", (y,)))),
            Term("view", (sq,), ((n * k,),)), Term("expand", (Term("rsum", (sq,), (1,)),), ((n, k),)),
            Term("slice", (sq,), (1, 0, k)), Term("transpose", (sq,), (0, 1)),
            Term("cat", (sq, Term("abs_t", (y,))), (1,)), Term("sumsq_c", (x,)), Term("norm_root_c", (x,)),
            Term("Sum", (sq, Term("abs_t", (y,)), Term("exp_t", (y,)))),
            Term("Sum", (Term("sumsq_c", (x,)), Term("sumsq_c", (y,)), Term("square_t", (gen.leaf(()),)))),
        ]
        # negative or unknown: the analysis must not claim these
        one = Term("full", (), (1.0, (n, k)))
        minus_one = Term("Sum", (sq, Term("Scale", (Term("Sum", (sq, one)),), (Fraction(-1),))))  # x^2 - (x^2 + 1)
        unknown = [x, Term("Scale", (sq,), (Fraction(-1),)), minus_one, Term("Sum", (sq, x)), Term("Sum", (x, sq)),
                   Term("Sum", (sq, Term("abs_t", (y,)), x)), Term("Sum", (x, sq, Term("abs_t", (y,)))),
                   Term("mul_t", (sq, x)),
                   Term("clamp_t", (x,), (-1.0, 1.0)), Term("full", (), (-0.5, (n, k))), pos]
        for t in nonneg + unknown:
            out += [Term("square_t", (Term("sqrt_t", (t,)),)), Term("abs_t", (t,)),
                    Term("mul_t", (Term("sqrt_t", (t,)), Term("sqrt_t", (t,))))]
        out += [Term("sqrt_t", (sq,)), Term("mul_t", (y, y)),
                Term("pow_t", (x, Term("full", (), (2.0, (n, k))))),
                Term("pow_t", (pos, Term("full", (), (0.5, (n, k))))),
                Term("pow_t", (x, Term("full", (), (0.5, (n, k))))),
                Term("square_t", (Term("view", (x,), ((n * k,),)),)),
                Term("sqrt_t", (Term("view", (pos,), ((k, n),)),)),
                Term("rsum", (gen.leaf((n, 1)),), (1,)), Term("rmax", (gen.leaf((1, k)),), (0,)),
                Term("rsum", (x,), (1,))]
        # sums of squares of a concat, a view, a transpose, a scale, a rank-0 tensor
        a, b = gen.leaf((n, k)), gen.leaf((n, r.choice([1, 2])))
        out += [Term("sumsq_c", (Term("cat", (a, b), (1,)),)), Term("sumsq_c", (Term("cat", (gen.leaf((1, k)), a), (0,)),)),
                Term("sumsq_c", (Term("view", (a,), ((n * k,),)),)), Term("sumsq_c", (Term("transpose", (a,), (0, 1)),)),
                Term("sumsq_c", (Term("Scale", (a,), (Fraction(-3, 2),)),)), Term("sumsq_c", (gen.leaf(()),)),
                Term("norm_root_c", (a,)), Term("norm_root_c", (pos,))]
        # clip_grad_norm_'s norm of norms over two gradients, as linalg_vector_norm lowers it
        na, nb = (Term("norm_root_c", (Term("sumsq_c", (g,)),)) for g in (a, gen.leaf((k,))))
        out.append(Term("norm_root_c", (Term("Sum", tuple(Term("sumsq_c", (Term("view", (v,), ((1,),)),)) for v in (na, nb))),)))
        out.append(Term("square_t", (Term("norm_root_c", (Term("Sum", (Term("sumsq_c", (a,)), Term("sumsq_c", (b,)))),)),)))
    return out

