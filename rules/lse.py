"""Log-sum-exp and blockwise (online-softmax) attention: how ring / context-parallel
attention's per-block results and their merge relate to softmax over the whole row.

A rank holding a block of queries sees the keys block by block. For each key block j it
computes the block's attention output, normalised by the block's own exp-sum, and the
block's log-sum-exp `lse_j = m + log(sum(exp(s_j - m)))` (m the row max, or any finite
row constant); then it merges blocks: `lse = mx + log(exp(lse_a - mx) + exp(lse_b - mx))`
and `out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)`. The rules recognise each
of these formulas as what it computes (identities for every value of the free row
constants m and mx), and relate the results to the whole row:

    lse_c(cat(a, b, d), d)              = logaddexp(lse_c(a, d), lse_c(b, d))
    softmax(cat(a, b, d), d)            = cat(exp(a - lse), exp(b - lse), d),  lse of the concat
    attn_c(a, va) exp(lse_a - L) + attn_c(b, vb) exp(lse_b - L) = attn_c(cat(a, b), cat(va, vb))

with `attn_c(s, v) = softmax(s, -1) @ v`. The sequential softmax is recognised in
`matmul(softmax(s, -1), v)`, and its blocks in a flash-style backward's recomputed
probabilities `exp(s_j - lse)`.

Limits: non-causal attention only (a causal mask needs fully masked blocks skipped and their
lse treated as -inf). The backward forms `P_j dP_j - P_j D` as torch's softmax backward
decomposition does, or `P_j (dP_j - D)` (the sequential `P * D`, over the fused softmax, is
passed to its users: refine.prove.walk); flash's `D = rowsum(dO * O)` would need one more
rule. Exercised on 2 ranks (models/capture/cp_attention.py; the running-max form,
rules/online_softmax.py, in models/zoo/context_parallel.py); more ranks nest the merge, and
the search for each node's relation grows with it.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from refine.ir.graph import Arg, TensorType
from refine.ir.lazy import torch
from refine.ir.term import Term
from refine.ops.lower import Builder
from refine.ops.registry import Op, Rule, ShapeError, rewrite, rule

NEG = "(bigrat (bigint -1) (bigint 1))"


def _keep_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    d = attrs["dim"]
    if not 0 <= d < x.ndim:
        raise ShapeError(f"log-sum-exp over dim {d} of {list(x.shape)}")
    s = list(x.shape)
    s[d] = 1
    return TensorType(tuple(s), x.dtype)


def _attn_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    s, v = ins
    if s.ndim < 2 or v.ndim != s.ndim or s.shape[:-2] != v.shape[:-2] or s.shape[-1] != v.shape[-2]:
        raise ShapeError(f"attention of scores {list(s.shape)} and values {list(v.shape)}")
    return TensorType(s.shape[:-1] + v.shape[-1:], s.dtype)


def _same(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    a, b = ins
    if a.shape != b.shape:
        raise ShapeError(f"operands {list(a.shape)} and {list(b.shape)} differ")
    return a


def _logaddexp(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    ins = [b.broadcast(a, out.shape) for a in args]
    return b.emit("logaddexp_t", ins, {}, out)


def _broadcast_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    return TensorType(torch.broadcast_shapes(*(t.shape for t in ins)), ins[0].dtype)


OPS = [
    Op("lse_c", 1, _keep_shape, (("dim", "dim"),), ref=lambda x, dim: torch.logsumexp(x, dim, keepdim=True),
       core=True, egglog_shape="(rule ((= e (lse_c x d)) (= s (shape x))) ((set (shape e) (vec-set s d (dim 1)))))",
       doc="log(sum(exp(x))) over dim, kept"),
    Op("logaddexp_t", 2, _same, ref=torch.logaddexp, core=True, kind="elementwise",
       doc="log(exp(a) + exp(b)): two log-sum-exps merged"),
    Op("logaddexp", 2, _broadcast_shape, ref=torch.logaddexp, decompose=_logaddexp),
    Op("attn_c", 2, _attn_shape, ref=lambda s, v: torch.softmax(s, -1) @ v, core=True,
       egglog_shape="(rule ((= e (attn_c s v)) (= ss (shape s)) (= sv (shape v))) "
       "((set (shape e) (vec-set ss (- (vec-length ss) 1) (vec-get sv (- (vec-length sv) 1))))))",
       doc="softmax(s, -1) @ v: attention of scores s over values v"),
]


# Each rule finds one term of a two-term sum with a selective pattern, reaches the sums
# holding it through the sum index (`SumHas`/`SumPair`, rules/structure.py), and binds the
# other term with `multiset-pick` of the rest. Without the index egglog joins every
# candidate sum with every candidate term before testing membership: `logaddexp-def` alone
# spent ~20 s per iteration on a context-parallel step of ~1000 e-nodes and no match.
RULES_DEF: list[Rule] = [
    # m + log(sum(exp(x - m))) over d is the log-sum-exp of x, whatever the finite row
    # constant m (the row max, for stability)
    rule("lse-def",
         ["(= lg (log_t (rsum (exp_t s2) d)))", "(SumHas s2 neg)", "(= neg (Scale (expand m sh) r))", f"(= r {NEG})",
          "(= s2 (Sum ms2))", "(= (multiset-length ms2) 2)", "(multiset-contains ms2 neg)",
          "(= x (multiset-pick (multiset-remove ms2 neg)))", "(= (shape x) sh)",
          "(SumHas e lg)", "(= e (Sum ms))", "(= (multiset-length ms) 2)", "(multiset-contains ms lg)",
          "(= m (multiset-pick (multiset-remove ms lg)))"],
         ["(union e (lse_c x d))"]),
    # mx + log(exp(a - mx) + exp(b - mx)) is log(exp(a) + exp(b)), whatever mx
    rule("logaddexp-def",
         ["(= lg (log_t s2))", "(SumPair ea eb s2)", "(= ea (exp_t sa))", "(= eb (exp_t sb))",
          "(SumHas sa na)", "(= na (Scale mx r))", f"(= r {NEG})", "(SumHas sb na)",
          "(= sa (Sum msa))", "(= (multiset-length msa) 2)", "(multiset-contains msa na)",
          "(= sb (Sum msb))", "(= (multiset-length msb) 2)", "(multiset-contains msb na)",
          "(= a (multiset-pick (multiset-remove msa na)))", "(= b (multiset-pick (multiset-remove msb na)))",
          "(SumHas e lg)", "(= e (Sum ms))", "(= (multiset-length ms) 2)", "(multiset-contains ms lg)",
          "(= mx (multiset-pick (multiset-remove ms lg)))"],
         ["(union e (logaddexp_t a b))"]),
    # a block's output: exp(s - m) @ v divided by the row sum of exp(s - m), any m
    rule("attn-block",
         ["(= e (div_t (matmul p v) (expand (rsum p d) sh)))", "(= p (exp_t s2))", "(SumHas s2 neg)",
          "(= neg (Scale (expand m sh2) r))", f"(= r {NEG})", "(= s2 (Sum ms))",
          "(= (multiset-length ms) 2)", "(multiset-contains ms neg)", "(= s (multiset-pick (multiset-remove ms neg)))",
          "(= d (- (ndim s) 1))", "(= (ndim v) (ndim s))"],
         ["(union e (attn_c s v))"]),
    # the online-softmax merge of two blocks' outputs, each rescaled by exp(its lse - the
    # merged lse), is attention over both blocks
    rule("attn-merge",
         ["(= ta (mul_t oa (expand (exp_t sa) sh)))", "(= oa (attn_c a va))", "(SumHas e ta)",
          "(= e (Sum ms))", "(= (multiset-length ms) 2)", "(multiset-contains ms ta)",
          "(= tb (multiset-pick (multiset-remove ms ta)))",
          "(= tb (mul_t ob (expand (exp_t sb) sh)))", "(= ob (attn_c b vb))", "(= d (- (ndim a) 1))",
          "(= la (lse_c a d))", "(= lb (lse_c b d))", "(= l (logaddexp_t la lb))",
          "(= nl (Scale l r))", f"(= r {NEG})", "(SumHas sa nl)", "(SumHas sb nl)",
          "(= sa (Sum msa))", "(= (multiset-length msa) 2)", "(multiset-contains msa la)", "(multiset-contains msa nl)",
          "(= sb (Sum msb))", "(= (multiset-length msb) 2)", "(multiset-contains msb lb)", "(multiset-contains msb nl)"],
         ["(union e (attn_c (cat a b d) (cat va vb (- d 1))))"]),
]


RULES: list[Rule] = [
    *RULES_DEF,
    rewrite("logaddexp-comm", "(logaddexp_t a b)", "(logaddexp_t b a)"),
    # the log-sum-exp of a concat along its dim merges the pieces'; along another dim it
    # keeps the concat
    rewrite("lse-over-cat-same-dim", "(lse_c (cat a b d) d)", "(logaddexp_t (lse_c a d) (lse_c b d))"),
    rewrite("lse-over-cat-other-dim", "(lse_c (cat a b d) d2)", "(cat (lse_c a d2) (lse_c b d2) d)", "(!= d d2)"),
    rewrite("slice-into-lse", "(slice (lse_c x d2) d s e)", "(lse_c (slice x d s e) d2)", "(!= d d2)"),
    # softmax over a concat along its own dim: each piece is exp(piece - lse of the whole)
    rule("softmax-over-cat-same-dim",
         ["(= e (softmax (cat a b d) d))", "(= sa (shape a))", "(= sb (shape b))"],
         ["(let l (lse_c (cat a b d) d))",
          f"(union e (cat (exp_t (Sum (multiset-of a (Scale (expand l sa) {NEG})))) "
          f"(exp_t (Sum (multiset-of b (Scale (expand l sb) {NEG})))) d))"]),
    # attention: softmax over the last dim, then the product with the values
    rule("attn-def", ["(= e (matmul (softmax s d) v))", "(= d (- (ndim s) 1))", "(= (ndim v) (ndim s))"],
         ["(union e (attn_c s v))"]),
    # rows of the scores are independent queries
    rewrite("attn-over-cat-rows", "(attn_c (cat a b d) v)", "(cat (attn_c a v) (attn_c b v) d)",
            "(= d (- (ndim a) 2))"),
    rewrite("slice-into-attn-rows", "(slice (attn_c s v) d st en)", "(attn_c (slice s d st en) v)",
            "(= d (- (ndim s) 2))"),
]


def SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """Each formula the rules recognise, on random leaves (the harness checks both sides).
    The rules bind a two-term sum's terms by picks, one rule per order; so each formula
    comes with its terms made in either order (a term seeded alone first is made first)."""
    r = gen.rng
    out: list[Term] = []
    neg = (Fraction(-1),)

    def minus(x: Term, y: Term) -> Term:
        return Term("Sum", (x, Term("Scale", (y,), neg)))

    def both(t1: Term, t2: Term) -> list[Term]:
        return [t1, Term("Sum", (t1, t2))]

    for _ in range(gen.instances):
        n, k, e = r.choice([1, 2, 3]), r.choice([1, 2, 3]), r.choice([1, 2])
        for first in (0, 1):
            for wide in (0, 1):
                # x a leaf (made before the shift) or a slice (made after it)
                x = gen.leaf((n, k)) if not wide else Term("slice", (gen.leaf((n, k + 1)),), (1, 1, k + 1))
                m = gen.leaf((n, 1)) if first else Term("rmax", (x,), (1,))
                shifted = minus(x, Term("expand", (m,), ((n, k),)))
                lg = Term("log_t", (Term("rsum", (Term("exp_t", (shifted,)),), (1,)),))
                out += both(lg, m) if first else [Term("Sum", (m, lg))]  # lse-def
                v = gen.leaf((k, e))
                p = Term("exp_t", (shifted,))
                out.append(Term("div_t", (Term("matmul", (p, v)),
                                          Term("expand", (Term("rsum", (p,), (1,)),), ((n, e),)))))
            a, b = gen.leaf((n, 1)), gen.leaf((n, 1))
            mx = gen.leaf((n, 1)) if first else Term("maximum_t", (a, b))
            lg = Term("log_t", (Term("Sum", (Term("exp_t", (minus(a, mx),)), Term("exp_t", (minus(b, mx),)))),))
            out += both(lg, mx) if first else [Term("Sum", (mx, lg))]  # logaddexp-def
        # concats: along the reduced dim and another; slices; softmax over a concat
        a2, b2 = gen.leaf((n, k)), gen.leaf((n, r.choice([1, 2])))
        out += [Term("lse_c", (Term("cat", (a2, b2), (1,)),), (1,)),
                Term("lse_c", (Term("cat", (gen.leaf((1, k)), gen.leaf((n, k))), (0,)),), (1,)),
                Term("slice", (Term("lse_c", (gen.leaf((3, k)),), (1,)),), (0, 1, 3)),
                Term("softmax", (Term("cat", (a2, b2), (1,)),), (1,))]
        # attention, and the merge of two blocks (either block's term made first)
        ka, kb = r.choice([1, 2]), r.choice([1, 3])
        for first in (0, 1):
            sa, sb = gen.leaf((n, ka)), gen.leaf((n, kb))
            va, vb = gen.leaf((ka, e)), gen.leaf((kb, e))
            out.append(Term("matmul", (Term("softmax", (sa,), (1,)), va)))
            la, lb = Term("lse_c", (sa,), (1,)), Term("lse_c", (sb,), (1,))
            lab = Term("logaddexp_t", (la, lb))

            def scaled(o: Term, lj: Term, lab: Term = lab, sh: tuple[int, int] = (n, e)) -> Term:
                return Term("mul_t", (o, Term("expand", (Term("exp_t", (minus(lj, lab),)),), (sh,))))

            ta, tb = scaled(Term("attn_c", (sa, va)), la), scaled(Term("attn_c", (sb, vb)), lb)
            out += both(ta, tb) if first else both(tb, ta)
        out += [Term("attn_c", (Term("cat", (gen.leaf((1, ka)), gen.leaf((n, ka))), (0,)), gen.leaf((ka, e)))),
                Term("slice", (Term("attn_c", (gen.leaf((3, ka)), gen.leaf((ka, e)))),), (0, 1, 3))]
    return out
