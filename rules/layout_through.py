"""Ops through a layout change (a transpose, a view): elementwise ops, reductions and
broadcasts computed on a transposed tensor are the transpose of the op computed on the tensor
itself; unary ops computed on views are the view of the op.

A program may hand a tensor back transposed and compute on the transposed view: Megatron's
GPTModel returns its logits as `[b, s, v]`, the transpose of the `[s, b, v]` its output layer
computes, and a loss over that view (a log-softmax along the vocab) runs its max, exp and sum
on the transpose, while each tensor-parallel rank runs its vocab-parallel max, exp and sum on
its own `[s, b, v/tp]` piece. The sequential value is the transpose of what the ranks' pieces
say, so the op moves out of the transpose, towards the tensors the ranks hold:

    f(transpose(x, i, j))                          = transpose(f(x), i, j)        f elementwise
    f(transpose(x, i, j), transpose(y, i, j))      = transpose(f(x, y), i, j)
    red(transpose(x, i, j), d)                     = transpose(red(x, d'), i, j)  rsum, rmax, rmean
    expand(transpose(x, i, j), s)                  = transpose(expand(x, s'), i, j)  (same ndim)
    Scale(transpose(x, i, j), r)                   = transpose(Scale(x, r), i, j)
    gather(transpose(x, i, j), t, g)               = transpose(gather(x, transpose(t, i, j), g'), i, j)

and for views

    f(view(x, s))                                  = view(f(x), s)                f unary

(a rank's log of its all-reduced sum of exps, against the sequential log of the kept sum
viewed), with d' (g') the dim d (g) swapped by i and j (i -> j, j -> i, any other dim kept) and s' the
shape s with entries i and j swapped. The transposed-in direction (`transpose-sum`,
`transpose-scale` in rules/structure.py, `transpose-expand` in rules/repeat.py) exists; these
are the directions a proof needs when the sequential program computes on the transpose.
Not a pair sum out of two transposes: next to `transpose-sum` it grew the e-graph without
end (a DTensor loss twin's check went from 18 s to 390 s; Ulysses' cp2 from 36 s to 803 s),
so the transposed DTensor lookup at TP 2 stays UNPROVEN (tests/cases/test_vocab_lookup.py).
Rules are templates over the unary and elementwise ops of the registry (as the concat rules
of rules/elementwise.py), so an op added later moves through a transpose too.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from refine.ir.term import Term
from refine.ops.registry import Registry, Rule, rewrite, rule

REDUCTIONS = ("rsum", "rmax", "rmean")


def _swapped(s: str, i: str, j: str) -> str:
    """The shape s with its entries i and j swapped."""
    return f"(vec-set (vec-set {s} {i} (vec-get {s} {j})) {j} (vec-get {s} {i}))"


def _vars(n: int, prefix: str) -> list[str]:
    return [f"{prefix}{k}" for k in range(n)]


def RULES(reg: Registry) -> list[Rule]:  # noqa: N802 - a rule file's export
    out: list[Rule] = []
    for op in reg.of_kind("unary"):
        tail = "".join(f" {a}" for a in _vars(len(op.attrs), "u"))
        out.append(rewrite(f"{op.name}-out-of-transpose", f"({op.name} (transpose x i j){tail})",
                           f"(transpose ({op.name} x{tail}) i j)"))
        out.append(rewrite(f"{op.name}-out-of-view", f"({op.name} (view x s){tail})",
                           f"(view ({op.name} x{tail}) s)"))
    for op in reg.of_kind("elementwise"):
        tail = "".join(f" {a}" for a in _vars(len(op.attrs), "u"))
        xs = _vars(op.inputs, "x")
        out.append(rewrite(f"{op.name}-out-of-transpose", f"({op.name} {' '.join(f'(transpose {x} i j)' for x in xs)}{tail})",
                           f"(transpose ({op.name} {' '.join(xs)}{tail}) i j)"))
    for red in REDUCTIONS:
        out += [
            rewrite(f"{red}-out-of-transpose-i", f"({red} (transpose x i j) d)", f"(transpose ({red} x j) i j)",
                    "(= d i)"),
            rewrite(f"{red}-out-of-transpose-j", f"({red} (transpose x i j) d)", f"(transpose ({red} x i) i j)",
                    "(= d j)", "(!= i j)"),
            rewrite(f"{red}-out-of-transpose-other", f"({red} (transpose x i j) d)", f"(transpose ({red} x d) i j)",
                    "(!= d i)", "(!= d j)"),
        ]
    out += [
        rule("expand-out-of-transpose", ["(= e (expand (transpose x i j) s))", "(= (vec-length s) (ndim x))"],
             [f"(union e (transpose (expand x {_swapped('s', 'i', 'j')}) i j))"]),
        rewrite("scale-out-of-transpose", "(Scale (transpose x i j) r)", "(transpose (Scale x r) i j)"),
    ]
    # a lookup along a dim of the transpose: the transposed lookup with the index transposed
    # back (the index is the program's own, so the rule builds its transpose)
    for name, g2 in (("i", "j"), ("j", "i")):
        out.append(rewrite(f"gather-out-of-transpose-{name}", "(gather (transpose x i j) t g)",
                           f"(transpose (gather x (transpose t i j) {g2}) i j)", f"(= g {name})", "(!= i j)"))
    out.append(rewrite("gather-out-of-transpose-other", "(gather (transpose x i j) t g)",
                       "(transpose (gather x (transpose t i j) g) i j)", "(!= g i)", "(!= g j)"))
    return out


def SHARED_SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """Each unary and elementwise op of the registry applied to transposes (its arguments as
    its sampler draws them, each transposed alike); transposes under reductions along each
    dim, a pair sum, a scale, a broadcast of a kept dim, a gather along each dim."""
    out: list[Term] = []

    def tr(x: Term, i: int, j: int) -> Term:
        return Term("transpose", (x,), (i, j))

    ops = [op.name for op in gen.registry.ops.values() if op.core and op.kind in ("unary", "elementwise")]
    for _ in range(gen.instances):
        for name in sorted(ops):
            for _try in range(20):  # arguments of one shape, of 2 dims or more
                inst = gen.instance(name)
                if inst is None:
                    continue
                specs, attrs = inst
                shapes = {tuple(sh) for sh, _, _ in specs}
                if len(shapes) == 1 and len(specs[0][0]) >= 2:
                    nd = len(specs[0][0])
                    i, j = gen.rng.sample(range(nd), 2)
                    args = []
                    for sh, kind, bound in specs:
                        src = list(sh)
                        src[i], src[j] = src[j], src[i]
                        args.append(tr(gen.leaf(tuple(src), kind, bound), i, j))
                    out.append(Term(name, tuple(args), tuple(attrs)))
                    break
        for i, j in ((0, 1), (1, 0), (0, 2), (1, 2)):
            shape = [2, 3, 4]
            shape[i], shape[j] = shape[j], shape[i]
            sh = tuple(shape)
            t = tr(gen.leaf((2, 3, 4)), i, j)
            out += [Term(red, (t,), (d,)) for red in REDUCTIONS for d in range(3)]
            out += [Term("Sum", (t, tr(gen.leaf((2, 3, 4)), i, j))),
                    Term("Scale", (t,), (Fraction(gen.rng.choice([2, -1])),))]
            ks = [2, 3, 1]
            ks[i], ks[j] = ks[j], ks[i]
            ks[ks.index(1)] = 5
            out.append(Term("expand", (tr(gen.leaf((2, 3, 1)), i, j),), (tuple(ks),)))
            for g in range(3):
                ix = list(sh)  # the index: the transposed shape, 2 along g
                ix[g] = 2
                out.append(Term("gather", (t, gen.leaf(tuple(ix), "i", sh[g])), (g,)))
    return out
