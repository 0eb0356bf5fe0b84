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

from typing import Any

from refine.expr import Term
from refine.opset import Rule, rule

_MASK = "(= m (logical_or_t (lt_t t (full lo sh)) (ge_t t (full hi sh))))"
# the outer masked_fill over the view of a gather whose index is the inner masked target,
# viewed with a trailing 1 and x's leading dims (row-major: the target's order)
_LOOKUP = ["(= e (masked_fill_t v m 0.0))", "(= v (view gg sh))", "(= gg (gather x iv g))", "(= iv (view q si))",
           _MASK, "(= sh (shape t))", "(= sx (shape x))", "(= g (- (vec-length sx) 1))",
           "(= (vec-length si) (vec-length sx))", "(= (vec-get si g) 1)", "(= (vec-pop si) (vec-pop sx))",
           "(= hi (+ lo (to-f64 (vec-get sx g))))", "(= lo (to-f64 (to-i64 lo)))"]


def RULES(reg: Any) -> list[Rule]:  # noqa: N802 - a rule file's export
    return [
        rule("masked-lookup-first", [*_LOOKUP, "(= q (masked_fill_t t m 0.0))", "(= lo 0.0)"],
             ["(union e (view (GatherOff x (view t si) g 0) sh))"], symbolic=False),
        rule("masked-lookup-shifted", [*_LOOKUP, "(= q (masked_fill_t l m 0.0))", "(= l (Sum (multiset-of t f)))",
                                       "(= f (full nlo sh))", "(= nlo (neg lo))", "(> lo 0.0)"],
             ["(union e (view (GatherOff x (view t si) g (to-i64 lo)) sh))"], symbolic=False),
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
    return out
