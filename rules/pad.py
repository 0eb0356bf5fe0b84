"""Zero padding: a product over a zero-padded contraction dim is the product over its
real part.

A padded shard (a rank's weight whose last columns are zeros, stated by a `define` relation:
refine.frontends.graphfile, "Defines") enters the e-graph as `cat(real, full(0.0))`. The padded
columns still compute something on the rank (sigmoid(0) = 1/2, uniform attention weights for a
zero query) that only vanishes where a product contracts it with the zero rows of the next
padded weight:

    a @ cat(p, 0) = a[..., :k] @ p          a @ cat(0, p) = a[..., k:] @ p     (rows of the right)
    cat(p, 0) @ b = p @ b[..., :k, :]       cat(0, p) @ b = p @ b[..., k:, :]  (columns of the left)
    view(c), transpose(c), expand(c) of a constant c = c of the new shape

The zero part is dropped in one rewrite, never written as a zero summand: `x + 0 = x`
(structure.py's sum-zero) puts x and a sum holding x in one class, and with the sum rules
(flatten, like terms) that made new multiples of zero without end (a 2-rank check ran
past 20 GB). Each rule is an identity for every finite value of the other operand,
checked by the soundness harness on this file's seeds.
"""

from __future__ import annotations

from typing import Any

from refine.ir.term import Term
from refine.ops.registry import Rule, rewrite, rule

ZERO = ["(= z (full v s))", "(= v 0.0)"]

RULES: list[Rule] = [
    # the contraction dim of the right operand (dim -2) holds zeros after k rows, or before
    rule("matmul-pad-right", ["(= e (matmul a (cat p z d)))", *ZERO, "(= d (- (ndim p) 2))", "(= k (size p d))",
                              "(= na (ndim a))"],
         ["(union e (matmul (slice a (- na 1) (dim 0) k) p))"]),
    rule("matmul-pad-right-first", ["(= e (matmul a (cat z p d)))", *ZERO, "(= d (- (ndim p) 2))",
                                    "(= k (size z d))", "(= na (ndim a))"],
         ["(union e (matmul (slice a (- na 1) k (size a (- na 1))) p))"]),
    # the contraction dim of the left operand (its last)
    rule("matmul-pad-left", ["(= e (matmul (cat p z d) b))", *ZERO, "(= d (- (ndim p) 1))", "(= k (size p d))",
                             "(= nb (ndim b))"],
         ["(union e (matmul p (slice b (- nb 2) (dim 0) k)))"]),
    rule("matmul-pad-left-first", ["(= e (matmul (cat z p d) b))", *ZERO, "(= d (- (ndim p) 1))",
                                   "(= k (size z d))", "(= nb (ndim b))"],
         ["(union e (matmul p (slice b (- nb 2) k (size b (- nb 2)))))"]),
    # constants keep their value through reshapes
    rewrite("view-full", "(view (full v s) s2)", "(full v s2)"),
    rule("transpose-full", ["(= e (transpose (full v s) i j))", "(= sh (shape e))"], ["(union e (full v sh))"]),
    rewrite("expand-full", "(expand (full v s) s2)", "(full v s2)"),
]


def SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """Products with a zero-padded operand (padding last or first, 2-d and batched), and
    reshapes of constants: left sides random seeds seldom build."""
    r = gen.rng
    out: list[Term] = []
    for _ in range(gen.instances):
        m, k, z, n = r.choice([1, 2, 3]), r.choice([1, 2]), r.choice([1, 2]), r.choice([1, 3])
        zr, zl = Term("full", (), (0.0, (z, n))), Term("full", (), (0.0, (m, z)))
        a, p = gen.leaf((m, k + z)), gen.leaf((k, n))
        out.append(Term("matmul", (a, Term("cat", (p, zr), (0,)))))
        out.append(Term("matmul", (a, Term("cat", (zr, p), (0,)))))
        out.append(Term("matmul", (Term("cat", (gen.leaf((m, k)), zl), (1,)), gen.leaf((k + z, n)))))
        out.append(Term("matmul", (Term("cat", (zl, gen.leaf((m, k))), (1,)), gen.leaf((k + z, n)))))
        zb = Term("full", (), (0.0, (2, z, n)))
        out.append(Term("matmul", (gen.leaf((2, m, k + z)), Term("cat", (gen.leaf((2, k, n)), zb), (1,)))))
        c = Term("full", (), (float(r.choice([0, 1, 2])), (k, n)))
        out.append(Term("view", (c,), ((k * n,),)))
        out.append(Term("transpose", (c,), (0, 1)))
        out.append(Term("expand", (Term("full", (), (0.0, (1, n))),), ((k, n),)))
    return out
