"""Structural ops: the relation language (concat, slice, sum, scale, views) and its algebra.

`cat` is binary; a concat of n pieces is a balanced tree of them (`refine.ir.term.cat`), so a
rule that splits a tensor along a concat recurses on both sides and reaches the pieces in
log2(n) rewrites; the rules work for any nesting and any number of ranks. `Sum` and `Max`
take a multiset, so the order of terms never matters.

One limit: `sum-of-zero-padded` pairs a piece padded after with one padded before, so the
ranks' slice gradients of a dense MoE router add up to the concat of their pieces on 2 ranks;
more ranks (middle pieces padded on both sides) would need the same for nested concats.
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from typing import Any

from refine.ir.graph import Arg, TensorType
from refine.ir.lazy import torch
from refine.ir.term import Term, split_point
from refine.ops.lower import Builder
from refine.ops.registry import ArgSpec, Helper, Op, Sample, ShapeError, rewrite, rule


def _cat_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    d = attrs["dim"]
    a, b = ins
    if a.ndim != b.ndim or not 0 <= d < a.ndim:
        raise ShapeError(f"cat of {a.shape} and {b.shape} on dim {d}")
    if any(x != y for i, (x, y) in enumerate(zip(a.shape, b.shape, strict=True)) if i != d):
        raise ShapeError(f"cat of {a.shape} and {b.shape} on dim {d}: other dims differ")
    s = list(a.shape)
    s[d] += b.shape[d]
    return TensorType(tuple(s), a.dtype)


def _slice_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    d, s, e = attrs["dim"], attrs["start"], attrs["end"]
    if not (0 <= d < x.ndim and 0 <= s <= e <= x.shape[d]):
        raise ShapeError(f"slice {s}:{e} of dim {d} is out of bounds for {x.shape}")
    out = list(x.shape)
    out[d] = e - s
    return TensorType(tuple(out), x.dtype)


def _view_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    shape = tuple(attrs["shape"])
    if _numel(shape) != _numel(x.shape):
        raise ShapeError(f"cannot view {x.shape} as {shape}")
    return TensorType(shape, x.dtype)


def _transpose_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    i, j = attrs["dim0"], attrs["dim1"]
    if not (0 <= i < x.ndim and 0 <= j < x.ndim):
        raise ShapeError(f"transpose of dims {i}, {j} of {x.shape}")
    s = list(x.shape)
    s[i], s[j] = s[j], s[i]
    return TensorType(tuple(s), x.dtype)


def _expand_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    shape = tuple(attrs["shape"])
    off = len(shape) - x.ndim
    if off < 0 or any(x.shape[i] not in (1, shape[i + off]) for i in range(x.ndim)):
        raise ShapeError(f"cannot expand {x.shape} to {shape}")
    return TensorType(shape, x.dtype)


def _full_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    return TensorType(tuple(attrs["shape"]), attrs.get("dtype") or "float32")


def _same(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    return ins[0]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _nary_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    if len({t.shape for t in ins}) != 1:
        raise ShapeError(f"terms of one sum must have one shape, got {[t.shape for t in ins]}")
    return ins[0]


def _concat_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    if not ins:
        raise ShapeError("concat of no tensors")
    out = ins[0]
    for t in ins[1:]:
        out = _cat_shape([out, t], attrs)
    return out


def _concat(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    # binary concats nested as refine.ir.term.cat nests relations (a balanced tree)
    xs = [a for a in args if isinstance(a, str)]
    if len(xs) != len(args):
        raise ShapeError("concat takes tensors only")
    d = attrs["dim"]

    def tree(parts: list[str]) -> str:
        if len(parts) == 1:
            return parts[0]
        k = split_point(len(parts))
        return b.emit("cat", [tree(parts[:k]), tree(parts[k:])], {"dim": d})

    return tree(xs)


def _ref_slice(x: torch.Tensor, dim: int, start: int, end: int) -> torch.Tensor:
    return x.narrow(dim, start, end - start)


def _ref_full(value: float, shape: tuple[int, ...], dtype: str | None = None) -> torch.Tensor:
    return torch.full(tuple(shape), value, dtype=torch.float64)


def _ref_sum(*xs: torch.Tensor) -> torch.Tensor:
    return torch.stack(torch.broadcast_tensors(*xs)).sum(0)


def _ref_max(*xs: torch.Tensor) -> torch.Tensor:
    return torch.stack(torch.broadcast_tensors(*xs)).amax(0)


def _ref_scale(x: torch.Tensor, factor: Fraction) -> torch.Tensor:
    return x * float(factor)


# An index of the terms of sums, kept complete before each iteration (analysis rules run
# with the shape rules). A rule looking for a sum that holds some other term (a scale, a
# concat, a sum) joins on it: with `(multiset-contains ms a)` alone egglog tries every sum
# against every candidate term, and a step of a few thousand sums spent minutes there.
# (SumHas e a): a is a term of a sum of class e; (SumPair x1 x2 u): a sum of class u is
# x1 + x2 (x1 the term egglog picks first).
SUM_INDEX = [
    rule("sum-terms-index", ["(= e (Sum ms))"],
         ["(let __has (unstable-multiset-map (unstable-fn \"SumHas\" e) ms))"], analysis=True),
    rule("sum-pairs-index", ["(= u (Sum ms))", "(= (multiset-length ms) 2)", "(= x1 (multiset-pick ms))",
                             "(= x2 (multiset-pick (multiset-remove ms x1)))"],
         ["(SumPair x1 x2 u)"], analysis=True),
    # (SumStop ms): the rules that expand a sum (scale-sum, sum-flatten) leave the sum of ms
    # alone, because it holds like terms, a multiple of itself or a zero. Such sums make new
    # ones without end: with x = x/3 + a (a rank's x + x + x, related back to x), scaling
    # by r gives x r/3 = x r/9 + ...; flattening x - x (or x + 0) into a sum adds terms that
    # cancel, which the like terms rules then collect in every grouping; and sums of like
    # terms expanded and collected again make every multiple of their terms. A sum of like
    # terms has its collected form in its class (sum-duplicate, sum-like-scales,
    # sum-plain-and-scale, and -cancel), which is expanded instead: nothing is lost there.
    rule("sum-stop-index", ["(= e (Sum ms))"], ["(set (SumStop ms) false)"], analysis=True),
    rule("sum-stop-copies", ["(= e (Sum ms))", "(SumHas e a)", "(multiset-contains ms a)",
                             "(multiset-contains (multiset-remove ms a) a)", "(= s (shape e))", "(= s (shape a))"],
         ["(set (SumStop ms) true)"], analysis=True),
    rule("sum-stop-like-scales", ["(= e (Sum ms))", "(SumHas e a)", "(= a (Scale x r1))", "(multiset-contains ms a)",
                                  "(SumHas e b)", "(= b (Scale x r2))", "(multiset-contains (multiset-remove ms a) b)"],
         ["(set (SumStop ms) true)"], analysis=True),
    rule("sum-stop-plain-and-scale", ["(= e (Sum ms))", "(SumHas e b)", "(= b (Scale a r))", "(SumHas e a)",
                                      "(multiset-contains ms a)", "(multiset-contains (multiset-remove ms a) b)"],
         ["(set (SumStop ms) true)"], analysis=True),
    rule("sum-stop-self-scaled", ["(= e (Sum ms))", "(SumHas e a)", "(= a (Scale e r))", "(multiset-contains ms a)"],
         ["(set (SumStop ms) true)"], analysis=True),
    rule("sum-stop-self", ["(= e (Sum ms))", "(SumHas e e)", "(multiset-contains ms e)"],
         ["(set (SumStop ms) true)"], analysis=True),
    # a zero term (0 times the sum: sum-zero makes the sum without it, in the same class)
    rule("sum-stop-zero-term", ["(= e (Sum ms))", "(SumHas e z)", "(= z (full v sh))", "(= v 0.0)",
                                "(multiset-contains ms z)"],
         ["(set (SumStop ms) true)"], analysis=True),
    # a sum that is zero (the zero constant, or e = r e with r != 1): a multiple of everything
    rule("sum-stop-zero", ["(= e (Sum ms))", "(= e (full v sh))", "(= v 0.0)"], ["(set (SumStop ms) true)"],
         analysis=True),
    rule("sum-stop-zero-multiple", ["(= e (Sum ms))", "(= e (Scale e r))", "(!= r (bigrat (bigint 1) (bigint 1)))"],
         ["(set (SumStop ms) true)"], analysis=True),
]

SHAPE_SAME = "(rule ((= e (OP x ARGS)) (= s (shape x))) ((set (shape e) s)))"

OPS = [
    Op("cat", 2, _cat_shape, (("dim", "int"),), ref=lambda a, b, dim: torch.cat([a, b], dim),
       core=True, clean=True, kind="clean",
       egglog_shape="(rule ((= e (cat a b d)) (= sa (shape a)) (= sb (shape b))) "
       "((set (shape e) (vec-set sa d (d+ (vec-get sa d) (vec-get sb d))))))",
       doc="concatenation of two tensors along dim (lists of more nest as a balanced tree)", linear="joint"),
    Op("slice", 1, _slice_shape, (("dim", "int"), ("start", "size"), ("end", "size")),
       ref=_ref_slice, core=True, clean=True, kind="clean",
       egglog_shape="(rule ((= e (slice x d b f)) (= s (shape x))) ((set (shape e) (vec-set s d (d- f b)))))",
       doc="x[start:end] along dim (step 1)", linear="first"),
    Op("view", 1, _view_shape, (("shape", "shape"),), ref=lambda x, shape: x.reshape(shape),
       core=True, clean=True, kind="clean",
       egglog_shape="(rule ((= e (view x s))) ((set (shape e) s)))",
       doc="row-major reshape", linear="first"),
    Op("transpose", 1, _transpose_shape, (("dim0", "int"), ("dim1", "int")),
       ref=lambda x, dim0, dim1: x.transpose(dim0, dim1), core=True, clean=True, kind="clean",
       egglog_shape="(rule ((= e (transpose x i j)) (= s (shape x))) "
       "((set (shape e) (vec-set (vec-set s i (vec-get s j)) j (vec-get s i)))))", linear="first"),
    Op("expand", 1, _expand_shape, (("shape", "shape"),), ref=lambda x, shape: x.expand(shape),
       core=True, clean=True, kind="clean",
       egglog_shape="(rule ((= e (expand x s))) ((set (shape e) s)))",
       doc="broadcast x (right-aligned) to shape", linear="first"),
    Op("full", 0, _full_shape, (("value", "float"), ("shape", "shape")), ref=_ref_full,
       core=True, clean=True, kind="clean",
       egglog_shape="(rule ((= e (full v s))) ((set (shape e) s)))",
       doc="a constant tensor"),
    Op("concat", -1, _concat_shape, (("dim", "dim"),), ref=lambda *xs, dim: torch.cat(xs, dim),
       decompose=_concat, doc="aten.cat: any number of tensors along dim"),
    Op("Scale", 1, _same, (("factor", "rational"),), ref=_ref_scale, core=True, clean=True,
       kind="unary", egglog_shape=SHAPE_SAME.replace("OP", "Scale").replace(" ARGS", " r"),
       doc="x times an exact rational", linear="first"),
    Op("Sum", -1, _nary_shape, ref=_ref_sum, core=True, clean=True, kind="nary",
       # through the index of terms (see SUM_INDEX): `(shape (multiset-pick ms))` makes egglog
       # pair every new shape with every sum to find the picked term
       egglog_shape="(rule ((= e (Sum ms)) (SumHas e a) (= s (shape a))) ((set (shape e) s)))",
       doc="sum of a multiset of tensors", linear="joint"),
    Op("Max", -1, _nary_shape, ref=_ref_max, core=True, clean=True, kind="nary",
       egglog_shape="(rule ((= e (Max ms)) (= s (shape (multiset-pick ms)))) ((set (shape e) s)))",
       doc="elementwise max of a multiset of tensors"),
]


def RULES(reg: Any) -> list:  # noqa: N802 - a rule file's export
    one = "(bigrat (bigint 1) (bigint 1))"
    zero = "(bigrat (bigint 0) (bigint 1))"
    out = [
        *SUM_INDEX,
        # slices of a concat along its own dim fall into one side, or straddle both
        rewrite("slice-cat-left", "(slice (cat a b d) d s e)", "(slice a d s e)",
                "(d<= e (size a d))"),
        rewrite("slice-cat-right", "(slice (cat a b d) d s e)",
                "(slice b d (d- s (size a d)) (d- e (size a d)))", "(d>= s (size a d))"),
        rewrite("slice-cat-straddle", "(slice (cat a b d) d s e)",
                "(cat (slice a d s (size a d)) (slice b d (dim 0) (d- e (size a d))) d)",
                "(d< s (size a d))", "(d> e (size a d))"),
        rewrite("slice-cat-other-dim", "(slice (cat a b d) d2 s e)",
                "(cat (slice a d2 s e) (slice b d2 s e) d)", "(!= d d2)"),
        rewrite("slice-full", "(slice x d z e)", "x", "(= z (dim 0))", "(= e (size x d))"),
        rewrite("slice-slice", "(slice (slice x d s1 e1) d s2 e2)",
                "(slice x d (d+ s1 s2) (d+ s1 e2))"),
        # adjacent slices of one tensor are a slice of it, and make a concat of it: this is
        # how a scattered replicated tensor is seen as the concat of its rank pieces
        rule("cat-adjacent-slices",
             ["(= p (slice x d s m))", "(= q (slice x d m e))"],
             ["(union (slice x d s e) (cat p q d))"]),
        # no associativity rule: from a balanced tree of n pieces, re-nesting makes every
        # bracketing (Catalan(n - 1): 429 for 8 ranks) and each op split over every one
        # scale
        # A class that holds a multiple of itself other than 1 x is zero (x = r x): every
        # multiple of it is itself, so the rules relating multiples skip it (x != y below);
        # through it they would make a new factor at every match (a/b, then a/b/c, ...)
        rule("scale-scale", ["(= e (Scale y b))", "(= y (Scale x a))", "(!= x y)"], ["(union e (Scale x (* a b)))"]),
        rewrite("scale-one", "(Scale x r)", "x", f"(= r {one})"),
        # a scale by r != 0 is invertible: x is y / r (a rank tensor scaled otherwise than
        # the sequential one, as with a loss divided by a micro-batch count)
        rule("scale-inverse", ["(= y (Scale x r))", "(= y (D n))", f"(!= r {zero})", "(!= x y)"],
             [f"(union x (Scale y (/ {one} r)))"]),
        # not over a sum of copies of one tensor: x = Sum(x/2, x/2) (sum-halves) would let it
        # distribute Scale(x, r) into Sum(x r/2, x r/2), and then Scale(x, r/2), without end
        rule("scale-sum", ["(= e (Scale (Sum ms) r))", "(= a (multiset-pick ms))",
                           "(< (multiset-count ms a) (multiset-length ms))", "(= (SumStop ms) false)"],
             ["(union e (Sum (unstable-multiset-map (unstable-fn \"ScaleBy\" r) ms)))"]),
        rewrite("scale-by", "(ScaleBy r x)", "(Scale x r)"),
        # the inverse for two terms scaled alike, only where their plain sum is a class
        # already (SumPair): r x + r y is r (x + y), a rank's sum met by the sequential one
        # carrying the ranks' 1/W on each term. Kept to existing sums, it makes no new sum
        # (factoring out of any sum would meet scale-sum and make sums without end)
        *(rule(f"sum-common-scale-{o}", ["(= e (Sum ms))", "(= (multiset-length ms) 2)", "(SumHas e a)",
                                         "(= a (Scale x r))", "(SumHas e b)", "(= b (Scale y r))", "(!= a b)",
                                         "(multiset-contains ms a)", "(multiset-contains (multiset-remove ms a) b)",
                                         f"(SumPair {p} u)"],
               ["(union e (Scale u r))"]) for o, p in (("xy", "x y"), ("yx", "y x"))),
        # like terms collect: x + x is 2x, r1 x + r2 x is (r1 + r2) x, x + r x is (1 + r) x (a
        # bias added on every rank, or halved on every rank, then summed). With scale-sum kept
        # off sums of copies, these meet no cycle that makes new factors without end
        rule("sum-duplicate", ["(= e (Sum ms))", "(SumHas e a)", "(= s (shape e))", "(= s (shape a))", "(multiset-contains ms a)",
                                "(!= e a)", "(multiset-contains (multiset-remove ms a) a)"],
             [f"(union e (Sum (multiset-insert (multiset-remove (multiset-remove ms a) a) (Scale a (+ {one} {one})))))"]),
        rule("sum-like-scales", ["(= e (Sum ms))", "(SumHas e a)", "(= a (Scale x r1))", "(multiset-contains ms a)",
                                 "(SumHas e b)", "(= b (Scale x r2))", "(multiset-contains (multiset-remove ms a) b)",
                                 f"(!= (+ r1 r2) {zero})", "(!= a x)", "(!= b x)"],
             ["(union e (Sum (multiset-insert (multiset-remove (multiset-remove ms a) b) (Scale x (+ r1 r2)))))"]),
        rule("sum-plain-and-scale", ["(= e (Sum ms))", "(SumHas e b)", "(= b (Scale a r))", "(SumHas e a)",
                                     "(multiset-contains ms a)", "(multiset-contains (multiset-remove ms a) b)",
                                     f"(!= (+ {one} r) {zero})", "(!= a b)"],
             [f"(union e (Sum (multiset-insert (multiset-remove (multiset-remove ms a) b) (Scale a (+ {one} r)))))"]),
        # terms that cancel (x - x, r x - r x) are the zero constant, which sum-zero drops, as
        # a product by 0.0 lowers to it (over the reals): as a multiple 0 x, a zero is a
        # multiple of every tensor, and the rules relating multiples make every sum of zeros
        # and multiples, without end (scale-zero likewise)
        rule("sum-like-scales-cancel", ["(= e (Sum ms))", "(SumHas e a)", "(= a (Scale x r1))", "(multiset-contains ms a)",
                                        "(SumHas e b)", "(= b (Scale x r2))", "(multiset-contains (multiset-remove ms a) b)",
                                        f"(= (+ r1 r2) {zero})", "(= s (shape a))"],
             ["(union e (Sum (multiset-insert (multiset-remove (multiset-remove ms a) b) (full 0.0 s))))"]),
        rule("sum-plain-and-scale-cancel", ["(= e (Sum ms))", "(SumHas e b)", "(= b (Scale a r))", "(SumHas e a)",
                                            "(multiset-contains ms a)", "(multiset-contains (multiset-remove ms a) b)",
                                            f"(= (+ {one} r) {zero})", "(= s (shape a))"],
             ["(union e (Sum (multiset-insert (multiset-remove (multiset-remove ms a) b) (full 0.0 s))))"]),
        rule("scale-zero", ["(= e (Scale x r))", f"(= r {zero})", "(= s (shape x))"], ["(union e (full 0.0 s))"]),
        rewrite("scale-zero-constant", "(Scale (full v s) r)", "(full v s)", "(= v 0.0)"),
        # These rules make new multiples; each is kept to multiples of rank tensors (D), so the
        # factors they make stay few: unguarded, collecting like terms and relating multiples
        # feed each other new rationals without end.
        # a multiple of x is a multiple of any other non-zero multiple of x: so a relation
        # Scale(x, a) is found as a multiple of the rank tensor holding Scale(x, b) (a
        # gradient averaged where the sequential one is summed, a loss scaled twice)
        rule("scale-factor", ["(= e1 (Scale x a))", "(= e2 (Scale x b))", "(= e2 (D n))", "(!= a b)",
                              "(!= b (bigrat (bigint 0) (bigint 1)))", "(!= e1 e2)"],
             ["(union e1 (Scale e2 (/ a b)))"]),
        # n-ary sums and maxes flatten; a rank-0 constant zero adds nothing. Copies are
        # multiples (sum-duplicate), not flattened: a sum held twice, flattened one copy at
        # a time, makes every mix of flat and nested copies, and with a multiple of it in
        # its class (y = x + x, x = y / 2) new factors without end; a sum of copies inside
        # a sum, flattened, gives each term of k a third form (a, 2b, b + b): 3^k sums
        # nor a sum inside itself (x = x + 0 would take up zeros without end)
        rule("sum-flatten", ["(= e (Sum ms))", "(SumHas e inner)", "(= inner (Sum ms2))", "(multiset-contains ms inner)",
                             "(!= e inner)", "(= (multiset-count ms inner) 1)", "(= p (multiset-pick ms2))",
                             "(< (multiset-count ms2 p) (multiset-length ms2))", "(= (SumStop ms) false)",
                             "(= (SumStop ms2) false)"],
             ["(union e (Sum (multiset-sum (multiset-remove ms inner) ms2)))"]),
        rule("max-flatten", ["(= e (Max ms))", "(= inner (Max ms2))", "(multiset-contains ms inner)"],
             ["(union e (Max (multiset-sum (multiset-remove ms inner) ms2)))"]),
        # adding a zero constant changes nothing (an accumulation into zeros, say)
        rule("sum-zero", ["(= e (Sum ms))", "(SumHas e z)", "(= z (full v sh))", "(multiset-contains ms z)", "(= v 0.0)",
                          "(> (multiset-length ms) 1)"],
             ["(union e (Sum (multiset-remove ms z)))"]),
        # two tensors each zero where the other is not: their sum is the concat of the
        # nonzero pieces (a slice's gradient on each rank, summed: slice_backward pads with zeros)
        rule("sum-of-zero-padded",
             ["(= p (cat a z d))", "(= z (full v sh))", "(= v 0.0)", "(= q (cat z2 b d))", "(= z2 (full v2 sh2))",
              "(= v2 0.0)", "(= (size a d) (size z2 d))", "(= s (shape p))", "(= s (shape q))"],
             ["(union (Sum (multiset-of p q)) (cat a b d))"]),
        # a rank tensor that is the sum of two terms of a longer sum stands for them (each
        # rank's partial, sum of its own terms, inside the flat sum over ranks)
        rule("sum-group-pair",
             ["(SumPair x1 x2 u)", "(SumHas e x1)", "(SumHas e x2)", "(= e (Sum ms))", "(> (multiset-length ms) 2)",
              "(multiset-contains ms x1)", "(multiset-contains (multiset-remove ms x1) x2)"],
             ["(union e (Sum (multiset-insert (multiset-remove (multiset-remove ms x1) x2) u)))"]),
        rule("sum-single", ["(= e (Sum ms))", "(= (multiset-length ms) 1)"],
             ["(union e (multiset-pick ms))"]),
        rule("max-single", ["(= e (Max ms))", "(= (multiset-length ms) 1)"],
             ["(union e (multiset-pick ms))"]),
        rule("sum-cat", ["(= e (Sum ms))", "(SumHas e c)", "(= c (cat a b d))", "(multiset-contains ms c)",
                         "(= k (size a d))"],
             ["(union e (cat (Sum (unstable-multiset-map (unstable-fn \"SliceBy\" d (dim 0) k) ms)) "
              "(Sum (unstable-multiset-map (unstable-fn \"SliceBy\" d k (size e d)) ms)) d))"]),
        rewrite("slice-by", "(SliceBy d s e x)", "(slice x d s e)"),
        rule("slice-sum", ["(= e (slice (Sum ms) d s f))"],
             ["(union e (Sum (unstable-multiset-map (unstable-fn \"SliceBy\" d s f) ms)))"]),
        # views
        rewrite("view-identity", "(view x s)", "x", "(= s (shape x))"),
        rewrite("view-view", "(view (view x s1) s2)", "(view x s2)"),
        rule("view-sum", ["(= e (view (Sum ms) s))"],
             ["(union e (Sum (unstable-multiset-map (unstable-fn \"ViewAs\" s) ms)))"]),
        rewrite("view-as", "(ViewAs s x)", "(view x s)"),
        # and of an elementwise max (a max all-reduce viewed: a row max unsqueezed)
        rule("view-max", ["(= e (view (Max ms) s))"],
             ["(union e (Max (unstable-multiset-map (unstable-fn \"ViewAs\" s) ms)))"]),
        # broadcasting a sum is the sum of the broadcasts (a partial sum stays one)
        rule("expand-sum", ["(= e (expand (Sum ms) sh))"],
             ["(union e (Sum (unstable-multiset-map (unstable-fn \"ExpandTo\" sh) ms)))"]),
        rewrite("expand-to", "(ExpandTo sh x)", "(expand x sh)"),
        rewrite("view-scale", "(view (Scale x r) s)", "(Scale (view x s) r)"),
        # a concat of two pieces scaled alike is the concat scaled (the inverse of the unary
        # Scale-over-cat), only where the plain concat is a class already: a sequential
        # gradient whose pieces carry the ranks' 1/W factor meets a rank's product of the
        # unscaled concat (an expert-parallel all_to_all's). Only in cases with an exchange
        # (Rule.needs): elsewhere it changed the terms extracted for later steps and moved a
        # bundled twin's culprit off its line (megatron_mlp ln_grad_not_all_reduced)
        replace(rule("cat-scale-common", ["(= e (cat (Scale a r) (Scale b r) d))", "(= c (cat a b d))"],
                     ["(union e (Scale c r))"]), needs="exchange"),
        rewrite("expand-scale", "(expand (Scale x r) s)", "(Scale (expand x s) r)"),
        # transposes
        rewrite("transpose-transpose", "(transpose (transpose x i j) i j)", "x"),
        rewrite("transpose-cat-i", "(transpose (cat a b d) d j)",
                "(cat (transpose a d j) (transpose b d j) j)"),
        rewrite("transpose-cat-j", "(transpose (cat a b d) i d)",
                "(cat (transpose a i d) (transpose b i d) i)", "(!= i d)"),
        rewrite("transpose-cat-other", "(transpose (cat a b d) i j)",
                "(cat (transpose a i j) (transpose b i j) d)", "(!= i d)", "(!= j d)"),
        rule("transpose-sum", ["(= e (transpose (Sum ms) i j))"],
             ["(union e (Sum (unstable-multiset-map (unstable-fn \"TransposeBy\" i j) ms)))"]),
        rewrite("transpose-by", "(TransposeBy i j x)", "(transpose x i j)"),
        rewrite("transpose-scale", "(transpose (Scale x r) i j)", "(Scale (transpose x i j) r)"),
        rewrite("slice-transpose", "(slice (transpose x i j) d s e)",
                "(transpose (slice x j s e) i j)", "(= d i)"),
        rewrite("slice-transpose-j", "(slice (transpose x i j) d s e)",
                "(transpose (slice x i s e) i j)", "(= d j)", "(!= i j)"),
        rewrite("slice-transpose-other", "(slice (transpose x i j) d s e)",
                "(transpose (slice x d s e) i j)", "(!= d i)", "(!= d j)"),
        # broadcasts and constants: slicing along a broadcast dim only shrinks the expand
        rewrite("slice-expand-new-dim", "(slice (expand x sh) d s e)",
                "(expand x (vec-set sh d (d- e s)))", "(< d (- (vec-length sh) (ndim x)))"),
        rewrite("slice-expand-size1", "(slice (expand x sh) d s e)",
                "(expand x (vec-set sh d (d- e s)))",
                "(>= d (- (vec-length sh) (ndim x)))",
                "(= (vec-get (shape x) (- d (- (vec-length sh) (ndim x)))) (dim 1))"),
        rewrite("slice-expand-kept-dim", "(slice (expand x sh) d s e)",
                "(expand (slice x (- d (- (vec-length sh) (ndim x))) s e) (vec-set sh d (d- e s)))",
                "(>= d (- (vec-length sh) (ndim x)))",
                "(d!= (vec-get (shape x) (- d (- (vec-length sh) (ndim x)))) (dim 1))"),
        # an expand keeps a concat along a dim it does not broadcast (kept at its size)
        rule("expand-over-cat",
             ["(= c (cat a b d))", "(= e (expand c sh))", "(= off (- (vec-length sh) (ndim c)))",
              "(= (vec-get sh (+ d off)) (size c d))"],
             ["(union e (cat (expand a (vec-set sh (+ d off) (size a d))) "
              "(expand b (vec-set sh (+ d off) (size b d))) (+ d off)))"]),
        rewrite("slice-full-const", "(slice (full v sh) d s e)", "(full v (vec-set sh d (d- e s)))"),
        # an expand to the operand's own shape (what a slice of a broadcast over heads
        # leaves on a rank holding one head) is the operand
        rule("expand-to-own-shape", ["(= e (expand x sh))", "(= sh (shape x))"], ["(union e x)"]),
        # a 2x2 block tensor split the same way along d1 on both sides of a cat along d2
        # (per-head halves concatenated, heads split across ranks): swap the nesting
        rule("cat-interchange", ["(= e (cat (cat a b d1) (cat c f d1) d2))", "(!= d1 d2)",
                                 "(= (size a d1) (size c d1))"],
             ["(union e (cat (cat a c d2) (cat b f d2) d1))"]),
    ]
    # a view that reshapes only the broadcast dims in front of x (x's own dims, the last k,
    # stay as they are) is the expand to the new shape: a bias broadcast over [s*b, h]
    # viewed as [s, b, h], as a 3-d Linear computes it
    for k in range(1, 5):
        tail = [f"(= (vec-get sh (- (vec-length sh) {i})) (vec-get s (- (vec-length s) {i})))"
                for i in range(1, k + 1)]
        out.append(rewrite(f"view-expand-lead-{k}", "(view (expand x sh) s)", "(expand x s)",
                           f"(= (ndim x) {k})", f"(>= (vec-length s) {k})", *tail))
    # split/merge reshapes over a concat (head splits and their inverse) come from view
    # rules in the reshape family
    return out


def SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """Sums that hold a multiple of themselves, which a tree of seed terms cannot make: a
    rank tensor s that is a + b, where a = k s and b = (1 - k) s (relating rank tensors both
    ways makes these from x + x + x). A scale of s, and a sum with it, so that scale-sum and
    the rules collecting like terms meet it (SumStop keeps scale-sum off it). And terms that
    cancel, a scale by 0 and a scaled zero (the zero constant they become)."""
    r = gen.rng
    out: list[Term] = []
    for _ in range(gen.instances):
        shape = gen.dims(2)
        k = Fraction(r.choice([1, 1, 2]), r.choice([2, 3, 4]))
        s = gen.leaf(shape)
        a = gen.defined_leaf(Term("Scale", (s,), (k,)))
        b = gen.defined_leaf(Term("Scale", (s,), (1 - k,)))
        gen.defined[s.attrs[0]] = Term("Sum", (a, b))  # made last: s keeps the value a and b were made from
        out.append(Term("Scale", (s,), (Fraction(r.choice([-1, 2, 3]), r.choice([1, 2])),)))
        out.append(Term("Sum", (Term("Scale", (s,), (Fraction(1, 2),)), gen.leaf(shape))))
        # terms that cancel, and a zero scaled
        u = gen.leaf(shape)
        out.append(Term("Sum", (Term("Scale", (u,), (k,)), Term("Scale", (u,), (-k,)), gen.leaf(shape))))
        out.append(Term("Sum", (u, Term("Scale", (u,), (Fraction(-1),)))))
        out.append(Term("Scale", (u,), (Fraction(0),)))
        out.append(Term("Scale", (Term("full", (), (0.0, shape)),), (k,)))
        # a scale of a scale (scale-scale): one sure match, as the seeds above take room
        # from the random generic ones that held it
        out.append(Term("Scale", (Term("Scale", (gen.leaf(shape),), (k,)),), (Fraction(3, 2),)))
        # a sum of two terms scaled alike beside their plain sum, in one seed (a rule is
        # given the seeds holding its query's constructors)
        x, y = gen.leaf(shape), gen.leaf(shape)
        out.append(Term("cat", (Term("Sum", (Term("Scale", (x,), (k,)), Term("Scale", (y,), (k,)))),
                                Term("Sum", (x, y))), (0,)))
        # a concat of pieces scaled alike
        d = gen.aux.randrange(2)  # the aux stream: the main one's draws stay what other seeds were made with
        a, b = gen.leaf(shape), gen.leaf(shape)
        out.append(Term("Sum", (Term("cat", (Term("Scale", (a,), (k,)), Term("Scale", (b,), (k,))), (d,)),
                                Term("cat", (a, b), (d,)))))
    return out


def SHARED_SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """Shapes of the relation language the generic seeds rarely make (`_rare_shapes`), the
    helper constructors applied directly, and like terms in sums (`_like_terms`)."""
    out: list[Term] = []
    for _ in range(gen.instances):
        out += _rare_shapes(gen)
    for _ in range(gen.instances):
        out += _like_terms(gen)
    # a rank tensor defined as a multiple, next to another multiple of the same tensor
    u = gen.leaf((2, 3))
    k = gen.defined_leaf(Term("Scale", (u,), (Fraction(3, 2),)))
    out.append(Term("Sum", (Term("Scale", (u,), (Fraction(1, 2),)), k)))
    return out


def _rare_shapes(gen: Any) -> list[Term]:
    """Concats of adjacent slices, nested transposes, slices and concats, concats under an
    expand, a transpose or another concat (2x2 blocks), slices and views of broadcasts, and
    the helper constructors applied directly."""
    r = gen.rng
    out: list[Term] = []
    # adjacent slices of one tensor, and one concat of them
    x = gen.leaf(gen.dims(2, lo=1) if r.random() < 0.5 else (4, 3))
    sh = gen.shape(x)
    d = r.randrange(len(sh))
    if sh[d] >= 2:
        m = r.randint(1, sh[d] - 1)
        p, q = Term("slice", (x,), (d, 0, m)), Term("slice", (x,), (d, m, sh[d]))
        out += [Term("cat", (p, q), (d,))]
    # transposes of transposes with the same dims
    y = gen.leaf(gen.dims(3))
    i, j = r.sample(range(3), 2)
    out.append(Term("transpose", (Term("transpose", (y,), (i, j)),), (i, j)))
    # slices of slices on one dim, slices of a concat straddling it
    z = gen.leaf((5, r.choice([1, 3])))
    out.append(Term("slice", (Term("slice", (z,), (0, 1, 5)),), (0, 1, 3)))
    c3 = Term("cat", (gen.leaf((2, 2)), Term("cat", (gen.leaf((1, 2)), gen.leaf((3, 2))), (0,))), (0,))
    s = r.randint(0, 4)
    out.append(Term("slice", (c3,), (0, s, r.randint(s + 1, 6))))
    out.append(Term("cat", (Term("cat", (gen.leaf((2, 2)), gen.leaf((1, 2))), (0,)), gen.leaf((3, 2))), (0,)))
    # concats under an expand: along a kept dim (new leading dims, size-1 dims broadcast)
    kept = Term("cat", (gen.leaf((1, 1, 3)), gen.leaf((2, 1, 3))), (0,))
    out += [Term("expand", (kept,), ((2, 3, 4, 3),)), Term("expand", (kept,), ((3, 2, 3),))]
    # 2x2 blocks: concats along dim 0 under a concat along dim 1, split at the same
    # row on both sides, and at different rows (no interchange there)
    for k in (1, 2):
        left = Term("cat", (gen.leaf((1, 2)), gen.leaf((2, 2))), (0,))
        right = Term("cat", (gen.leaf((k, 3)), gen.leaf((3 - k, 3))), (0,))
        out.append(Term("cat", (left, right), (1,)))
    # a concat under a transpose of two other dims; a slice of broadcast dims
    a3, b3 = gen.leaf((2, 1, 3)), gen.leaf((2, 2, 3))
    for ij in ((0, 2), (0, 1), (1, 2)):  # other dims; the concat dim second; first
        out.append(Term("transpose", (Term("cat", (a3, b3), (1,)),), ij))
    e = Term("expand", (gen.leaf((1, 3)),), ((2, 4, 3),))
    out += [Term("slice", (e,), (0, 1, 2)), Term("slice", (e,), (1, 1, 3)), Term("slice", (e,), (2, 0, 2))]
    # views of broadcast dims in front of an expanded tensor (1 to 4 dims of its own)
    for src, sh, v in (((3,), (4, 2, 3), (8, 3)), ((1, 3), (6, 2, 3), (2, 3, 2, 3)),
                       ((1, 3), (6, 2, 3), (3, 4, 3)), ((2, 1, 3), (4, 2, 5, 3), (2, 2, 2, 5, 3)),
                       ((2, 1, 2, 3), (2, 2, 1, 2, 3), (1, 2, 2, 1, 2, 3))):
        out.append(Term("view", (Term("expand", (gen.leaf(src),), (sh,)),), (v,)))
    # the helper constructors, applied directly
    t = gen.leaf((2, 3))
    out += [Term("ScaleBy", (t,), (Fraction(-3, 2),)), Term("SliceBy", (t,), (1, 1, 3)),
            Term("ViewAs", (t,), ((3, 2),)), Term("TransposeBy", (t,), (0, 1)),
            Term("ExpandTo", (gen.leaf((1, 3)),), ((2, 3),))]
    # rules whose matches the random pool may miss: one sure match each
    out += [
        Term("view", (Term("view", (gen.leaf((2, 3)),), ((3, 2),)),), ((6,),)),
        Term("slice", (Term("cat", (gen.leaf((2, 2)), gen.leaf((1, 2))), (0,)),), (0, 0, 1)),
        Term("Max", (Term("Max", (gen.leaf((2,)), gen.leaf((2,)))), gen.leaf((2,)))),
        Term("slice", (Term("transpose", (gen.leaf((2, 3, 2)),), (0, 2)),), (1, 1, 3)),
        # broadcasts of a concat and of a sum
        Term("expand", (Term("cat", (gen.leaf((1, 3)), gen.leaf((2, 3))), (0,)),), ((2, 3, 3),)),
        Term("expand", (Term("Sum", (gen.leaf((1, 3)), gen.leaf((1, 3)))),), ((2, 3),)),
    ]
    return out


def _like_terms(gen: Any) -> list[Term]:
    """Like terms in sums: multiples of one tensor (negative fractions, zero), a tensor twice,
    a tensor beside a multiple of it; a zero term and zero-padded pieces; a sum of three
    terms beside a sum of two of them; a broadcast of a scale."""
    out: list[Term] = []
    u = gen.leaf((2, 3))
    out += [Term("Sum", (Term("Scale", (u,), (Fraction(1, 2),)), Term("Scale", (u,), (Fraction(-3, 4),)))),
            Term("Sum", (Term("Scale", (u,), (Fraction(0),)), Term("Scale", (u,), (Fraction(5),)))),
            Term("Sum", (u, u, gen.leaf((2, 3)))), Term("Sum", (u, Term("Scale", (u,), (Fraction(2, 3),))))]
    sh = gen.dims(2)
    out.append(Term("Sum", (gen.leaf(sh), Term("full", (), (0.0, sh)))))
    out.append(Term("Sum", (Term("cat", (gen.leaf((2, 3)), Term("full", (), (0.0, (1, 3)))), (0,)),
                            Term("cat", (Term("full", (), (0.0, (2, 3))), gen.leaf((1, 3))), (0,)))))
    y = gen.leaf((2,))
    out.append(Term("Sum", (Term("Scale", (y,), (Fraction(1, 2),)), Term("Scale", (y,), (Fraction(3),)))))
    a, b, c = (gen.leaf((2,)) for _ in range(3))
    out.append(Term("cat", (Term("Sum", (a, b, c)), Term("Sum", (a, c))), (0,)))
    w = gen.leaf((2, 3))
    out += [Term("Sum", (w, w, gen.leaf((2, 3)))), Term("Sum", (w, Term("Scale", (w,), (Fraction(-1, 2),))))]
    # two scales of one tensor (equal factors too), beside another term
    x = gen.leaf((2, 3))
    half = Term("Scale", (x,), (Fraction(1, 2),))
    out += [Term("Sum", (half, Term("Scale", (x,), (Fraction(3, 2),)), gen.leaf((2, 3)))),
            Term("Sum", (half, half)),
            Term("expand", (Term("Scale", (gen.leaf((1, 3)),), (Fraction(1, 2),)),), ((2, 3),))]
    return out


# Helper constructors let a partially applied function map over the terms of a sum.
HELPERS = [
    Helper("ScaleBy", ("BigRat", "T"), lambda op, r, x: op("Scale")(x, factor=Fraction(r))),
    Helper("SliceBy", ("i64", "Dim", "Dim", "T"), lambda op, d, s, e, x: op("slice")(x, dim=d, start=s, end=e)),
    Helper("ViewAs", ("IV", "T"), lambda op, s, x: op("view")(x, shape=tuple(s))),
    Helper("ExpandTo", ("IV", "T"), lambda op, s, x: op("expand")(x, shape=tuple(s))),
    Helper("TransposeBy", ("i64", "i64", "T"), lambda op, i, j, x: op("transpose")(x, dim0=i, dim1=j)),
    # the index of SUM_INDEX: never unioned with anything, never extracted; an entry is
    # named by its term
    Helper("SumHas", ("T", "T"), lambda op, e, a: a),
]
DECLS = [
    "(relation SumPair (T T T))",
    "(function SumStop (TS) bool :merge (or old new))",
]


# The soundness harness's seeds: each op of the relation language on arguments it accepts
def _scale(gen: Any, x: tuple[int, ...]) -> tuple[list[ArgSpec], tuple[Any, ...]]:
    return [(x, "f", 0)], (gen.rng.choice([Fraction(1), Fraction(-1, 2), Fraction(3), Fraction(2, 3)]),)


def _cat(gen: Any, x: tuple[int, ...]) -> tuple[list[ArgSpec], tuple[Any, ...]]:
    r = gen.rng
    d = r.randrange(len(x))
    y = x[:d] + (r.choice([1, 2, 3]),) + x[d + 1:]
    return [(x, "f", 0), (y, "f", 0)], (d,)


def _slice(gen: Any, x: tuple[int, ...]) -> tuple[list[ArgSpec], tuple[Any, ...]]:
    r = gen.rng
    d = r.randrange(len(x))
    s = r.randint(0, x[d] - 1)
    e = x[d] if r.random() < 0.3 else r.randint(s + 1, x[d])
    s = 0 if r.random() < 0.2 else s
    return [(x, "f", 0)], (d, s, e)


def _transpose(gen: Any, x: tuple[int, ...]) -> tuple[list[ArgSpec], tuple[Any, ...]]:
    r = gen.rng
    if len(x) < 2:
        x = gen.dims(2)
    i, j = r.choice([(a, b) for a in range(len(x)) for b in range(len(x))])
    return [(x, "f", 0)], (i, j)


def _expand(gen: Any, x: tuple[int, ...]) -> tuple[list[ArgSpec], tuple[Any, ...]]:
    r = gen.rng
    src = tuple(1 if r.random() < 0.5 else s for s in x)
    new = gen.dims(r.choice([0, 1]))
    return [(src, "f", 0)], (new + tuple(s if s != 1 else r.choice([1, 2, 3]) for s in src),)


def _terms(gen: Any, x: tuple[int, ...]) -> tuple[list[ArgSpec], tuple[Any, ...]]:
    return [(x, "f", 0)] * gen.rng.choice([1, 2, 3]), ()


SAMPLES = {
    "Scale": Sample(_scale),
    # half of the time, an operand cut along the concat's own dim
    "cat": Sample(_cat, concat_dim=lambda gen, i, attrs: attrs[0] if gen.rng.random() < 0.5 else None),
    "slice": Sample(_slice),
    "view": Sample(lambda gen, x: ([(x, "f", 0)], (gen.refactor(x),))),
    "transpose": Sample(_transpose),
    "expand": Sample(_expand),
    "full": Sample(lambda gen, x: ([], (gen.rng.choice([0.0, 1.5]), x))),
    "Sum": Sample(_terms),
    "Max": Sample(_terms),
}
