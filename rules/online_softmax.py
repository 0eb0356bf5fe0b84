"""Online softmax with a running max: how ring attention's unnormalised accumulation (flash
attention's forward) relates to softmax attention over the whole row.

A rank holding a block of queries sees the key blocks one at a time and keeps, per query
row, a running max `m`, an unnormalised output `out = exp(s - m) @ v` and a sum
`total = rowsum(exp(s - m))` over the blocks seen so far. When block j comes with scores
`s_j` and row max `m_j`, both are moved to the new max `new = max(m, m_j)`:

    out   = out * exp(m - new)   + (exp(s_j - m_j) @ v_j) * exp(m_j - new)
    total = total * exp(m - new) + rowsum(exp(s_j - m_j)) * exp(m_j - new)

and the result is `out / total` (its log-sum-exp `m + log(total)` feeds a flash-style
backward). The family names the two shifted quantities

    expmv_c(s, m, v) = exp(s - m) @ v          expsum_c(s, m) = rowsum(exp(s - m))

(m a row constant [..., n, 1], broadcast along the keys) and says:

    exp(s - m) @ v, rowsum(exp(s - m))          are expmv_c(s, m, v), expsum_c(s, m)
    expmv_c(s, m, v) * exp(m - m2)              = expmv_c(s, m2, v)            (a shift moved)
    expmv_c(a, m, va) + expmv_c(b, m, vb)       = expmv_c(cat(a, b), m, cat(va, vb))
    expmv_c(s, m, v) / expsum_c(s, m)           = softmax(s) @ v = attn_c(s, v)  (rules/lse.py)
    m + log(expsum_c(s, m))                     = lse_c(s)

(the same for expsum_c), identities over the reals for every finite m and m2: they hold
whatever the running max is, so they need no reasoning about `maximum`. A merge needs both
terms at the same shift: a block added without moving the running sums to the new max
(ring_no_rescale in models/zoo/context_parallel.py) holds two shifts and stays unrelated to
attention. The products name the factor on either side (no commutativity in saturation).

Limits: the rules assume finite shifts (a row whose every score is masked has max -inf, and
exp(s - m) is NaN there, as is the sequential softmax of that row).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from refine.ir.graph import TensorType
from refine.ir.lazy import torch
from refine.ir.term import Term
from refine.ops.registry import Op, Rule, ShapeError, rule

NEG = "(bigrat (bigint -1) (bigint 1))"


def _row_shift(s: TensorType, m: TensorType) -> None:
    if s.ndim < 2 or m.shape != s.shape[:-1] + (1,):
        raise ShapeError(f"shift {list(m.shape)} is no row constant of scores {list(s.shape)}")


def _expmv_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    s, m, v = ins
    _row_shift(s, m)
    if v.ndim != s.ndim or s.shape[:-2] != v.shape[:-2] or s.shape[-1] != v.shape[-2]:
        raise ShapeError(f"scores {list(s.shape)} and values {list(v.shape)}")
    return TensorType(s.shape[:-1] + v.shape[-1:], s.dtype)


def _expsum_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    s, m = ins
    _row_shift(s, m)
    return TensorType(s.shape[:-1] + (1,), s.dtype)


OPS = [
    Op("expmv_c", 3, _expmv_shape, ref=lambda s, m, v: torch.exp(s - m) @ v, core=True,
       egglog_shape="(rule ((= e (expmv_c s m v)) (= ss (shape s)) (= sv (shape v))) "
       "((set (shape e) (vec-set ss (- (vec-length ss) 1) (vec-get sv (- (vec-length sv) 1))))))",
       doc="exp(s - m) @ v: attention's numerator at the row shift m [..., n, 1]"),
    Op("expsum_c", 2, _expsum_shape, ref=lambda s, m: torch.exp(s - m).sum(-1, keepdim=True), core=True,
       egglog_shape="(rule ((= e (expsum_c s m)) (= ss (shape s))) "
       "((set (shape e) (vec-set ss (- (vec-length ss) 1) (dim 1)))))",
       doc="rowsum(exp(s - m)), kept: softmax's denominator at the row shift m [..., n, 1]"),
]

# `exp(s - m)` with m a row constant broadcast along the last dim: binds s, m, sh and d
_SHIFTED = ["(= p (exp_t s2))", "(SumHas s2 neg)", "(= neg (Scale (expand m sh) r))", f"(= r {NEG})",
            "(= s2 (Sum ms))", "(= (multiset-length ms) 2)", "(multiset-contains ms neg)",
            "(= s (multiset-pick (multiset-remove ms neg)))", "(= d (- (ndim s) 1))",
            "(= (shape m) (vec-set sh d (dim 1)))"]
# `exp(m - m2)`, given m: binds m2 (the Sum's other term is m2 negated)
_MOVE = ["(SumHas df m)", "(= df (Sum mf))", "(= (multiset-length mf) 2)", "(multiset-contains mf m)",
         "(= nm (multiset-pick (multiset-remove mf m)))", "(= nm (Scale m2 r2))", f"(= r2 {NEG})"]


def _merge(op: str, values: bool) -> Rule:
    """Two blocks at the same shift, summed, are the concatenated block (joined on the sum
    index: rules/structure.py)."""
    a, b = ("(expmv_c a m va)", "(expmv_c b m vb)") if values else ("(expsum_c a m)", "(expsum_c b m)")
    merged = "(expmv_c (cat a b d) m (cat va vb (- d 1)))" if values else "(expsum_c (cat a b d) m)"
    return rule(f"{op}-merge",
                [f"(= ta {a})", "(SumHas e ta)", "(= e (Sum ms))", "(= (multiset-length ms) 2)",
                 "(multiset-contains ms ta)", "(= tb (multiset-pick (multiset-remove ms ta)))", f"(= tb {b})",
                 "(= d (- (ndim a) 1))"],
                [f"(union e {merged})"])


RULES: list[Rule] = [
    rule("expmv-def", ["(= e (matmul p v))", *_SHIFTED, "(= (ndim v) (ndim s))"], ["(union e (expmv_c s m v))"]),
    rule("expsum-def", ["(= e (rsum p d))", *_SHIFTED], ["(union e (expsum_c s m))"]),
    # moving the shift: the numerator's factor is broadcast along the value columns
    rule("expmv-shift", ["(= e (mul_t o (expand (exp_t df) sh)))", "(= o (expmv_c s m v))", *_MOVE],
         ["(union e (expmv_c s m2 v))"]),
    rule("expmv-shift-left", ["(= e (mul_t (expand (exp_t df) sh) o))", "(= o (expmv_c s m v))", *_MOVE],
         ["(union e (expmv_c s m2 v))"]),
    rule("expsum-shift", ["(= e (mul_t o (exp_t df)))", "(= o (expsum_c s m))", *_MOVE],
         ["(union e (expsum_c s m2))"]),
    rule("expsum-shift-left", ["(= e (mul_t (exp_t df) o))", "(= o (expsum_c s m))", *_MOVE],
         ["(union e (expsum_c s m2))"]),
    _merge("expmv", values=True),
    _merge("expsum", values=False),
    # normalised: the shift cancels
    rule("expmv-normalize", ["(= e (div_t o (expand t sh)))", "(= o (expmv_c s m v))", "(= t (expsum_c s m))"],
         ["(union e (attn_c s v))"]),
    rule("lse-of-expsum", ["(= lg (log_t t))", "(= t (expsum_c s m))", "(SumHas e lg)", "(= e (Sum ms))",
                           "(= (multiset-length ms) 2)", "(multiset-contains ms lg)",
                           "(= m (multiset-pick (multiset-remove ms lg)))"],
         ["(union e (lse_c s (- (ndim s) 1)))"]),
]


def SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """Each formula the rules recognise, on random leaves, 2-D and batched (the harness
    checks both sides); a shift a row constant, and one broadcast along rows instead (a
    [1, k] shift varies along the keys: expmv-def must not fire on it)."""
    r = gen.rng
    out: list[Term] = []
    neg = (Fraction(-1),)

    def minus(x: Term, y: Term) -> Term:
        return Term("Sum", (x, Term("Scale", (y,), neg)))

    for _ in range(gen.instances):
        batch = r.choice([(), (2,)])
        n, ka, kb, e = r.choice([1, 2, 3]), r.choice([1, 2]), r.choice([1, 3]), r.choice([1, 2])
        row = (*batch, n, 1)
        sa, sb = gen.leaf((*batch, n, ka)), gen.leaf((*batch, n, kb))
        va, vb = gen.leaf((*batch, ka, e)), gen.leaf((*batch, kb, e))
        m, m2 = gen.leaf(row), gen.leaf(row)
        # the definitions: a row shift, and a column one (not a row constant)
        for shift in (m, gen.leaf((*batch, 1, ka))):
            p = Term("exp_t", (minus(sa, Term("expand", (shift,), ((*batch, n, ka),))),))
            out += [Term("matmul", (p, va)), Term("rsum", (p,), (len(batch) + 1,))]
        oa, ta = Term("expmv_c", (sa, m, va)), Term("expsum_c", (sa, m))
        ob, tb = Term("expmv_c", (sb, m, vb)), Term("expsum_c", (sb, m))
        move = Term("exp_t", (minus(m, m2),))
        wide = Term("expand", (move,), ((*batch, n, e),))
        out += [Term("mul_t", (oa, wide)), Term("mul_t", (wide, oa)),
                Term("mul_t", (ta, move)), Term("mul_t", (move, ta)),
                Term("Sum", (oa, ob)), Term("Sum", (ta, tb)),
                Term("div_t", (oa, Term("expand", (ta,), ((*batch, n, e),)))),
                Term("Sum", (m, Term("log_t", (ta,))))]
        # two shifts summed: no merge (the harness evaluates whatever fires)
        out.append(Term("Sum", (oa, Term("expmv_c", (sb, m2, vb)))))
    return out
