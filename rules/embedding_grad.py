"""The embedding's gradient, and the vocab-parallel embedding's: rows of the table a window of
ids accumulates into.

`acc_rows(ids, values, start, shape)` is a table of `shape` whose row j is the sum of the
values at every position where ids == start + j; ids outside [start, start + shape[0]) add
nothing. `embedding_dense_backward` lowers to it with start 0 (rules/aten_extra.py): there aten
refuses ids outside the table, and no sequential program holding them runs at all.

A rank holding rows [s, s + n) of a vocab-parallel table (Megatron's VocabParallelEmbedding,
DTensor's row-wise embedding) looks up `ids - s` with the ids outside its rows replaced by 0
and zeroes those positions' output; the backward of that masked lookup accumulates the
masked gradient at the masked ids into its n rows:

    acc_rows(masked_fill(ids - s, out, 0), masked_fill(g, out, 0), 0, [n, h]),  out = ids < s | ids >= s + n

which is `acc_rows(ids, g, s, [n, h])`: a position outside the window adds zeros to row 0
(`acc-rows-masked-first` / `-shifted`). torchtitan's row-wise embedding (DTensor's masked
partial) clamps `ids - s` into [0, n) and multiplies the gradient by the in-range mask as a
number: the same window (`acc-rows-clamped-first` / `-shifted`). Windows meet as concats and slices of rows
(`acc-rows-split-at` at the starts of other windows, `acc-rows-cat`, `slice-acc-rows`), so
the sequential gradient is the concat of the ranks'.
Positions split into a sum and trailing dims into a concat, as for index_put_acc (data
parallelism); it is linear in the values. The mask rules need integral bounds and concrete
sizes (like the forward lookup's rules in rules/embedding.py).
"""

from __future__ import annotations

from typing import Any

from refine.ir.graph import TensorType
from refine.ir.lazy import torch
from refine.ir.term import Term
from refine.ops.registry import ArgSpec, Helper, Op, Rule, Sample, ShapeError, rewrite, rule

INT_DTYPES = ("int64", "int32")


def _shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    idx, v = ins
    shape = tuple(attrs["shape"])
    if idx.dtype not in INT_DTYPES:
        raise ShapeError(f"acc_rows index must be an integer tensor, got {idx.dtype}")
    if not shape or v.shape != idx.shape + shape[1:]:
        raise ShapeError(f"acc_rows of values {list(v.shape)} at index {list(idx.shape)} into {list(shape)}: "
                         "values must have the index's shape followed by the table's trailing dims")
    return TensorType(shape, v.dtype)


def _ref(idx: torch.Tensor, v: torch.Tensor, start: int, shape: tuple[int, ...]) -> torch.Tensor:
    idx = idx.long() - start
    inside = (idx >= 0) & (idx < shape[0])
    out = torch.zeros(tuple(shape), dtype=v.dtype)
    return out.index_put((idx[inside],), v[inside], accumulate=True)


OPS = [
    Op("acc_rows", 2, _shape, (("start", "size"), ("shape", "shape")), ref=_ref, core=True,
       egglog_shape="(rule ((= e (acc_rows i v s sh))) ((set (shape e) sh)))",
       doc="a table of `shape` whose row j sums the values where index == start + j (others add nothing)"),
]

# the window's mask on ids t: outside [lo, lo + n), n the table's rows (float bounds, as the
# capture writes `ids < s` against a constant)
_MASK = "(= m (logical_or_t (lt_t t (full lo si)) (ge_t t (full hi si))))"
_WINDOW = ["(= e (acc_rows q gv (dim 0) sh))", "(= gv (masked_fill_t v (expand (view m (vec-push si 1)) sv) 0.0))",
           _MASK, "(= si (shape t))", "(= sv (shape v))", "(= hi (+ lo (to-f64 (vec-get sh 0))))",
           "(= lo (to-f64 (to-i64 lo)))"]


# the same accumulation as torchtitan's row-wise embedding writes its lookup (DTensor's
# masked partial): the ids shifted and clamped into the window, the gradient times the in-range
# mask as a number
_IN = "(logical_and_t (ge_t t (full lo si)) (lt_t t (full hi si)))"
_CLAMPED = ["(= e (acc_rows q gv (dim 0) sh))", "(= q (clamp_t l 0.0 nm1))", "(= nm1 (to-f64 (- (vec-get sh 0) 1)))",
            f"(= gv (mul_t v (expand (cast_float_t (view {_IN} sm)) sv)))", "(= si (shape t))", "(= sv (shape v))",
            "(= hi (+ lo (to-f64 (vec-get sh 0))))", "(= lo (to-f64 (to-i64 lo)))"]


def RULES(reg: Any) -> list[Rule]:  # noqa: N802 - a rule file's export
    return [
        rule("acc-rows-clamped-first", [*_CLAMPED, "(= l t)", "(= lo 0.0)"], ["(union e (acc_rows t v 0 sh))"],
             symbolic=False),
        rule("acc-rows-clamped-shifted", [*_CLAMPED, "(= l (Sum (multiset-of t f)))", "(= f (full nlo si))",
                                          "(= nlo (neg lo))", "(> lo 0.0)"],
             ["(union e (acc_rows t v (to-i64 lo) sh))"], symbolic=False),
        rule("acc-rows-masked-first", [*_WINDOW, "(= q (masked_fill_t t m 0.0))", "(= lo 0.0)"],
             ["(union e (acc_rows t v 0 sh))"], symbolic=False),
        rule("acc-rows-masked-shifted", [*_WINDOW, "(= q (masked_fill_t l m 0.0))", "(= l (Sum (multiset-of t f)))",
                                         "(= f (full nlo si))", "(= nlo (neg lo))", "(> lo 0.0)"],
             ["(union e (acc_rows t v (to-i64 lo) sh))"], symbolic=False),
        # windows of rows: a window splits where another window over the same ids and values
        # starts inside it (the sequential table at each rank's first row; only starts that
        # occur, so finitely many pieces); adjacent ones concatenate; a slice of rows is one
        rule("acc-rows-split-at", ["(= e (acc_rows i v lo sh))", "(= w (acc_rows i v lo2 sh2))", "(d< lo lo2)",
                                   "(d< lo2 (d+ lo (vec-get sh 0)))"],
             ["(union e (cat (acc_rows i v lo (vec-set sh 0 (d- lo2 lo))) "
              "(acc_rows i v lo2 (vec-set sh 0 (d- (d+ lo (vec-get sh 0)) lo2))) 0))"]),
        rule("acc-rows-cat", ["(= e (cat x y 0))", "(= x (acc_rows i v lo s1))", "(= y (acc_rows i v lo2 s2))",
                              "(= lo2 (d+ lo (vec-get s1 0)))"],
             ["(union e (acc_rows i v lo (vec-set s1 0 (d+ (vec-get s1 0) (vec-get s2 0)))))"]),
        rewrite("slice-acc-rows", "(slice (acc_rows i v lo sh) 0 a b)",
                "(acc_rows i v (d+ lo a) (vec-set sh 0 (d- b a)))"),
        # positions split into a Sum; trailing dims into a concat; linear in the values
        rule("acc-rows-index-cat", ["(= e (acc_rows (cat p q d) v lo sh))", "(= k (size p d))", "(= n (size v d))"],
             ["(union e (Sum (multiset-of (acc_rows p (slice v d (dim 0) k) lo sh) "
              "(acc_rows q (slice v d k n) lo sh))))"]),
        rule("acc-rows-values-cat", ["(= e (acc_rows i (cat p q d) lo sh))", "(< d (ndim i))",
                                     "(= k (size p d))", "(= n (size i d))"],
             ["(union e (Sum (multiset-of (acc_rows (slice i d (dim 0) k) p lo sh) "
              "(acc_rows (slice i d k n) q lo sh))))"]),
        rule("acc-rows-values-cat-trailing", ["(= e (acc_rows i (cat p q d) lo sh))", "(>= d (ndim i))",
                                              "(= j (- d (- (ndim i) 1)))"],
             ["(union e (cat (acc_rows i p lo (vec-set sh j (size p d))) "
              "(acc_rows i q lo (vec-set sh j (size q d))) j))"]),
        rule("slice-into-acc-rows", ["(= e (slice (acc_rows i v lo sh) d s f))", "(> d 0)"],
             ["(union e (acc_rows i (slice v (+ d (- (ndim i) 1)) s f) lo (vec-set sh d (d- f s))))"]),
        rule("acc-rows-sum", ["(= e (acc_rows i (Sum ms) lo sh))"],
             ["(union e (Sum (unstable-multiset-map (unstable-fn \"AccRowsBy\" i lo sh) ms)))"]),
        rewrite("acc-rows-by", "(AccRowsBy i lo sh v)", "(acc_rows i v lo sh)"),
        rewrite("acc-rows-scale", "(acc_rows i (Scale v r) lo sh)", "(Scale (acc_rows i v lo sh) r)"),
    ]


HELPERS = [Helper("AccRowsBy", ("T", "Dim", "IV", "T"),
                  lambda op, i, lo, sh, v: op("acc_rows")(i, v, start=lo, shape=tuple(sh)))]


def _acc_rows(gen: Any, x: tuple[int, ...]) -> tuple[list[ArgSpec], tuple[Any, ...]]:
    r = gen.rng
    idx = gen.dims(r.choice([1, 1, 2]))
    trailing = gen.dims(r.choice([0, 1, 1, 2]))
    rows, start = r.choice([2, 3, 4]), r.choice([0, 0, 1, 2])
    return [(idx, "i", start + rows + 2), (idx + trailing, "f", 0)], (start, (rows,) + trailing)


SAMPLES = {"acc_rows": Sample(_acc_rows, count=2)}


def SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """The masked accumulation as a vocab-parallel rank's backward writes it (ids inside and
    outside the window, at offset 0 and shifted), adjacent windows concatenated, windows
    sliced, accumulations of concats and sums."""
    r = gen.rng
    out: list[Term] = []

    def full(v: float, s: tuple[int, ...]) -> Term:
        return Term("full", (), (v, s))

    for _ in range(gen.instances):
        a, b, n, h = r.choice([1, 2]), r.choice([2, 3]), r.choice([2, 3]), r.choice([1, 2])
        sh = (a, b)
        for lo in (0, n):
            t = gen.leaf(sh, "i", 3 * n)
            m = Term("logical_or_t", (Term("lt_t", (t, full(float(lo), sh))),
                                      Term("ge_t", (t, full(float(lo + n), sh)))))
            local = t
            if lo:
                # t - lo as an integer tensor (a seed's Sum would take the float constant's
                # dtype); the harness unions it with its definition
                local = gen.leaf(sh, "i", 3 * n)
                gen.defined[local.attrs[0]] = Term("Sum", (t, full(float(-lo), sh)))
            q = Term("masked_fill_t", (local, m), (0.0,))
            mask = Term("expand", (Term("view", (m,), (sh + (1,),)),), (sh + (h,),))
            gv = Term("masked_fill_t", (gen.leaf(sh + (h,)), mask), (0.0,))
            # (a Sum around it: the harness picks a rule's seeds by the ops they hold, and the
            # shifted rule's Sum sits in the defined leaf)
            out.append(Term("Sum", (Term("acc_rows", (q, gv), (0, (n, h))), gen.leaf((n, h)))))
            # torchtitan's form: clamped ids, the gradient times the in-range mask
            inside = Term("logical_and_t", (Term("ge_t", (t, full(float(lo), sh))),
                                            Term("lt_t", (t, full(float(lo + n), sh)))))
            num = Term("expand", (Term("cast_float_t", (Term("view", (inside,), (sh + (1,),)),)),), (sh + (h,),))
            clamped = Term("clamp_t", (local,), (0.0, float(n - 1)))
            gm = Term("mul_t", (gen.leaf(sh + (h,)), num))
            out.append(Term("Sum", (Term("acc_rows", (clamped, gm), (0, (n, h))), gen.leaf((n, h)))))
        ids = gen.leaf(sh, "i", 2 * n + 1)
        v = gen.leaf(sh + (h,))
        out.append(Term("cat", (Term("acc_rows", (ids, v), (0, (n, h))), Term("acc_rows", (ids, v), (n, (n + 1, h)))),
                        (0,)))
        out.append(Term("slice", (Term("acc_rows", (ids, v), (1, (2 * n, h))),), (0, 1, n + 1)))
        out.append(Term("cat", (Term("acc_rows", (ids, v), (0, (2 * n, h))), Term("acc_rows", (ids, v), (1, (n, h)))),
                        (0,)))
        out.append(Term("slice", (Term("acc_rows", (ids, gen.leaf(sh + (3,))), (0, (n, 3))),), (1, 1, 3)))
        ids2 = Term("cat", (gen.leaf((1, b), "i", n + 1), gen.leaf((a, b), "i", n + 1)), (0,))
        out.append(Term("acc_rows", (ids2, gen.leaf((a + 1, b, h))), (1, (n, h))))
        vals = Term("cat", (gen.leaf((a, 1, h)), gen.leaf((a, b, h))), (1,))
        out.append(Term("acc_rows", (gen.leaf((a, b + 1), "i", n), vals), (0, (n, h))))
        vals = Term("cat", (gen.leaf(sh + (1,)), gen.leaf(sh + (2,))), (2,))
        out.append(Term("acc_rows", (ids, vals), (0, (n, 3))))
        out.append(Term("acc_rows", (ids, Term("Sum", (v, gen.leaf(sh + (h,))))), (1, (n, h))))
        out.append(Term("AccRowsBy", (ids, gen.leaf(sh + (h,))), (0, (n, h))))
    return out
