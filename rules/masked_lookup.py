"""Megatron's vocab-parallel target lookup, written with masks on the target.

Megatron-LM's `_VocabParallelCrossEntropy` on a rank holding vocab positions [lo, hi):

    mask = (t < lo) | (t >= hi)
    local = t - lo;  local[mask] = 0                       # masked_fill_t(t - lo, mask, 0)
    pred = logits.view(-1, n)[arange, local.view(-1)]      # a gather on flattened rows
    pred = pred.view_as(t);  pred[mask] = 0.0              # masked_fill_t(.., mask, 0)

That is the lookup of t into positions [lo, lo + n) of the last dim, 0 outside: the helper
`GatherOff x i g lo` of `rules/loss.py` (with i = t viewed with a trailing 1), which splits
over a concat of the vocab dim into the sum of the pieces' lookups. The sequential program
(one rank: lo = 0, the whole vocab) has the same form, so its value is the sum of the ranks'.

`masked-lookup-first` / `-shifted`: the pattern above is `view(GatherOff(x, view(t, si), g, lo), sh)`
when the mask's bounds are lo and lo + n (n the size of x's last dim, g), the gather's index
is the masked target viewed as x's leading dims and a 1, and the lookup is viewed back to
the target's shape (so mask, target and lookup meet position by position). Integral float
bounds only, concrete sizes only (like the other vocab-offset rules).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from refine.ir.graph import TensorType
from refine.ir.lazy import torch
from refine.ir.term import Term
from refine.ops.registry import Op, Rule, ShapeError, rule

_MASK = "(= m (logical_or_t (lt_t t (full lo sh)) (ge_t t (full hi sh))))"
# the outer masked_fill over the view of a gather whose index is the inner masked target,
# viewed with a trailing 1 and x's leading dims (row-major: the target's order)
_LOOKUP = ["(= e (masked_fill_t v m 0.0))", "(= v (view gg sh))", "(= gg (gather x iv g))", "(= iv (view q si))",
           _MASK, "(= sh (shape t))", "(= sx (shape x))", "(= g (- (vec-length sx) 1))",
           "(= (vec-length si) (vec-length sx))", "(= (vec-get si g) 1)", "(= (vec-pop si) (vec-pop sx))",
           "(= hi (+ lo (to-f64 (vec-get sx g))))", "(= lo (to-f64 (to-i64 lo)))"]
# DTensor's form (torch's loss_parallel, `_MaskPartial`): the gather's result keeps the index's
# trailing 1 and is masked with the mask viewed the same way (`mask.unsqueeze(-1)`)
_LOOKUP_KEPT = ["(= e (masked_fill_t gg mv 0.0))", "(= mv (view m si))", "(= gg (gather x iv g))",
                "(= iv (view q si))", *_LOOKUP[4:]]

# the same lookup as capture translates Megatron's `logits_2d[arange_1d, masked_target_1d]`:
# x's elements as a table of one column, looked up at the flat index `arange * n + masked`
# (row k's element masked[k] when 0 <= masked[k] < n, which the mask guarantees)
_LOOKUP_FLAT = ["(= e (masked_fill_t v m 0.0))", "(= v (view emb sh))", "(= emb (embedding tab fi))",
                "(= tab (view x st))", "(= (vec-length st) 2)", "(= (vec-get st 1) 1)",
                "(= fi (Sum (multiset-of rows qf)))", "(= rows (Scale (arange_c 0 nr 1) r))", "(= qf (view q sf))",
                "(= (vec-length sf) 1)", _MASK, "(= sh (shape t))", "(= sx (shape x))", "(= g (- (vec-length sx) 1))",
                "(= (vec-pop sx) sh)", "(= r (bigrat (bigint (vec-get sx g)) (bigint 1)))",
                "(= hi (+ lo (to-f64 (vec-get sx g))))", "(= lo (to-f64 (to-i64 lo)))"]


NEG = "(bigrat (bigint -1) (bigint 1))"
# the backward's update of the softmax at each row's local target (Megatron writes
# `grad_2d[arange, masked_target_1d] -= 1.0 - target_mask.view(-1).float()`; the importer's
# index_put is a where over the one-hot of the index): x minus the one-hot of the window
_UPDATE = ["(= e (where_t hit ex x))", "(= hit (eq_t (expand iv sx) (expand (arange_c 0 n 1) sx)))",
           "(= ex (expand vals sx))", "(= vals (view s3 si))", "(= s3 (Sum (multiset-of gv neg)))",
           "(= gv (view (gather x iv g) sn))", f"(= neg (Scale r {NEG}))", "(= r (Sum (multiset-of one negc)))",
           "(= one (full 1.0 sn))", f"(= negc (Scale (cast_float_t (view m sn)) {NEG}))", "(= iv (view q si))",
           _MASK, "(= sh (shape t))", "(= sx (shape x))", "(= g (- (vec-length sx) 1))", "(= n (vec-get sx g))",
           "(= (vec-length si) (vec-length sx))", "(= (vec-get si g) 1)", "(= (vec-pop si) (vec-pop sx))",
           "(= hi (+ lo (to-f64 n)))", "(= lo (to-f64 (to-i64 lo)))"]


def _onehot_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (i,) = ins
    if i.ndim == 0 or i.shape[-1] != 1 or not i.dtype.startswith(("int", "uint")):
        raise ShapeError(f"onehot_window takes an integer index [..., 1], got {i.dtype} {list(i.shape)}")
    return TensorType(i.shape[:-1] + (attrs["size"],), "float32")


def _onehot_ref(i: torch.Tensor, start: int, size: int) -> torch.Tensor:
    return (i.long() - start == torch.arange(size)).to(torch.float64)


OPS = [
    Op("onehot_window", 1, _onehot_shape, (("start", "size"), ("size", "size")), ref=_onehot_ref, core=True,
       egglog_shape="(rule ((= e (onehot_window i s n)) (= si (shape i))) "
       "((set (shape e) (vec-set si (- (vec-length si) 1) n))))",
       doc="1.0 at position i - start of the last dim (size `size`) where start <= i < start + size, else 0"),
]


def RULES(reg: Any) -> list[Rule]:  # noqa: N802 - a rule file's export
    return [
        rule("masked-onehot-update-first", [*_UPDATE, "(= q (masked_fill_t t m 0.0))", "(= lo 0.0)"],
             [f"(union e (Sum (multiset-of x (Scale (onehot_window (view t si) 0 n) {NEG}))))"], symbolic=False),
        rule("masked-onehot-update-shifted", [*_UPDATE, "(= q (masked_fill_t l m 0.0))",
                                              "(= l (Sum (multiset-of t f)))", "(= f (full nlo sh))",
                                              "(= nlo (neg lo))", "(> lo 0.0)"],
             [f"(union e (Sum (multiset-of x (Scale (onehot_window (view t si) (to-i64 lo) n) {NEG}))))"],
             symbolic=False),
        # a window of the window; other dims are rows of the index
        rule("slice-onehot-window", ["(= e (slice (onehot_window i lo n) d a b))", "(= d (- (ndim i) 1))"],
             ["(union e (onehot_window i (d+ lo a) (d- b a)))"]),
        rule("slice-onehot-rows", ["(= e (slice (onehot_window i lo n) d a b))", "(< d (- (ndim i) 1))"],
             ["(union e (onehot_window (slice i d a b) lo n))"]),
        rule("masked-lookup-first", [*_LOOKUP, "(= q (masked_fill_t t m 0.0))", "(= lo 0.0)"],
             ["(union e (view (GatherOff x (view t si) g 0) sh))"], symbolic=False),
        rule("masked-lookup-shifted", [*_LOOKUP, "(= q (masked_fill_t l m 0.0))", "(= l (Sum (multiset-of t f)))",
                                       "(= f (full nlo sh))", "(= nlo (neg lo))", "(> lo 0.0)"],
             ["(union e (view (GatherOff x (view t si) g (to-i64 lo)) sh))"], symbolic=False),
        rule("masked-lookup-kept-first", [*_LOOKUP_KEPT, "(= q (masked_fill_t t m 0.0))", "(= lo 0.0)"],
             ["(union e (GatherOff x (view t si) g 0))"], symbolic=False),
        rule("masked-lookup-kept-shifted", [*_LOOKUP_KEPT, "(= q (masked_fill_t l m 0.0))",
                                            "(= l (Sum (multiset-of t f)))", "(= f (full nlo sh))",
                                            "(= nlo (neg lo))", "(> lo 0.0)"],
             ["(union e (GatherOff x (view t si) g (to-i64 lo)))"], symbolic=False),
        rule("masked-lookup-flat-first", [*_LOOKUP_FLAT, "(= q (masked_fill_t t m 0.0))", "(= lo 0.0)"],
             ["(union e (view (GatherOff x (view t (vec-push sh 1)) g 0) sh))"], symbolic=False),
        rule("masked-lookup-flat-shifted", [*_LOOKUP_FLAT, "(= q (masked_fill_t l m 0.0))",
                                            "(= l (Sum (multiset-of t f)))", "(= f (full nlo sh))",
                                            "(= nlo (neg lo))", "(> lo 0.0)"],
             ["(union e (view (GatherOff x (view t (vec-push sh 1)) g (to-i64 lo)) sh))"], symbolic=False),
        # the lookup along the last dim of a view that keeps it (Megatron's `logits_2d`, the
        # rows of [s, b, v] flattened) is the lookup on the viewed tensor, with the index
        # viewed to its rows alike (row-major: the same flattening)
        rule("gather-off-view-rows", ["(= e (GatherOff (view x sx) (view t si) g lo))", "(= g (- (vec-length sx) 1))",
                                      "(= s0 (shape x))", "(= g0 (- (vec-length s0) 1))",
                                      "(= (vec-get sx g) (vec-get s0 g0))", "(= (vec-length si) (vec-length sx))",
                                      "(= (vec-get si g) (dim 1))", "(= (vec-pop si) (vec-pop sx))"],
             ["(union e (view (GatherOff x (view t (vec-set s0 g0 (dim 1))) g0 lo) si))"]),
    ]


def SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """The masked lookup as Megatron writes it, with the
    target inside and outside the window (ints below 3 * n), at offset 0 and shifted."""
    r = gen.rng
    out: list[Term] = []

    def view(x: Term, s: tuple[int, ...]) -> Term:
        return Term("view", (x,), (s,))

    def full(v: float, s: tuple[int, ...]) -> Term:
        return Term("full", (), (v, s))

    for _ in range(gen.instances):
        a, b, n = r.choice([1, 2]), r.choice([2, 3]), r.choice([2, 3])
        for lo in (0, n):
            t = gen.leaf((a, b), "i", 3 * n)
            sh = (a, b)
            m = Term("logical_or_t", (Term("lt_t", (t, full(float(lo), sh))),
                                      Term("ge_t", (t, full(float(lo + n), sh)))))
            local = t
            if lo:
                # t - lo as an integer rank tensor (a seed's Sum would take the float constant's
                # dtype); the harness unions it with its definition
                local = gen.leaf(sh, "i", 3 * n)
                gen.defined[local.attrs[0]] = Term("Sum", (t, full(float(-lo), sh)))
            q = Term("masked_fill_t", (local, m), (0.0,))
            g = Term("gather", (gen.leaf((a * b, n)), view(q, (a * b, 1))), (1,))
            pred = view(g, sh)
            # (a Sum around each: the harness picks a rule's seeds by the ops they hold, and
            # the shifted rule's Sum sits in the defined leaf)
            out.append(Term("Sum", (Term("masked_fill_t", (pred, m), (0.0,)), gen.leaf(sh))))
            # on 3-d logits
            g3 = Term("gather", (gen.leaf((a, b, n)), view(q, (a, b, 1))), (2,))
            out.append(Term("Sum", (Term("masked_fill_t", (view(g3, sh), m), (0.0,)), gen.leaf(sh))))
            # as capture translates `rows[arange, masked]`: a one-column table at a flat index
            x3 = gen.leaf((a, b, n))
            flat = Term("Sum", (Term("Scale", (Term("arange_c", (), (0, a * b, 1)),), (Fraction(n),)), view(q, (a * b,))))
            emb = Term("embedding", (view(x3, (a * b * n, 1)), flat))
            out.append(Term("Sum", (Term("masked_fill_t", (view(emb, sh), m), (0.0,)), gen.leaf(sh))))
            # DTensor's form: the result [.., 1] masked with the mask viewed alike
            out.append(Term("Sum", (Term("masked_fill_t", (g, view(m, (a * b, 1))), (0.0,)), gen.leaf((a * b, 1)))))
            out.append(Term("Sum", (Term("masked_fill_t", (g3, view(m, (a, b, 1))), (0.0,)), gen.leaf((a, b, 1)))))
            # the backward's update at the local target
            nn = (a * b,)
            x2 = gen.leaf((a * b, n))
            iv = view(q, (a * b, 1))
            hit = Term("eq_t", (Term("expand", (iv,), ((a * b, n),)),
                                Term("expand", (Term("arange_c", (), (0, n, 1)),), ((a * b, n),))))
            keep = Term("Sum", (full(1.0, nn), Term("Scale", (Term("cast_float_t", (view(m, nn),)),), (Fraction(-1),))))
            vals = Term("Sum", (view(Term("gather", (x2, iv), (1,)), nn), Term("Scale", (keep,), (Fraction(-1),))))
            out.append(Term("where_t", (hit, Term("expand", (view(vals, (a * b, 1)),), ((a * b, n),)), x2)))
        # a lookup on the rows of a view keeping the last dim (lo 0 or 2, targets in and out)
        rows = gen.leaf((a, b, 3))
        out.append(Term("GatherOff", (view(rows, (a * b, 3)), view(gen.leaf((b, a), "i", 6), (a * b, 1))),
                        (1, r.choice([0, 2]))))
        out.append(Term("GatherOff", (view(rows, (b, a, 3)), view(gen.leaf((a * b,), "i", 6), (b, a, 1))),
                        (2, r.choice([0, 2]))))
        # windows of one-hots, sliced
        i = gen.leaf((3, 1), "i", 8)
        out += [Term("slice", (Term("onehot_window", (i,), (2, 4)),), (1, 1, 3)),
                Term("slice", (Term("onehot_window", (i,), (0, 3)),), (0, 1, 3))]
    return out
