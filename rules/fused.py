"""Slices of a fused rank weight, pulled out of the ops that use them.

A fused weight (vLLM's QKV `[q_r | k_r | v_r]`, gate/up `[gate_r | up_r]`) relates to the
sequential one as a concat of slices of rank inputs: `cat(slice(w@0, 0, 0, 768),
slice(w@1, 0, 0, 768), ...)`. The sequential `x @ w.T` then meets products with *slices* of
the rank weights, while each rank computes its whole fused product `x @ w_r.T` and (often
after adding a bias) slices the result. These rules state the missing direction: the op over
a slice of a rank tensor is the slice of the op over the whole rank tensor, which the rank
holds:

    transpose(slice(x, d, s, e), i, j) = slice(transpose(x, i, j), d', s, e)   (d' d swapped by i, j)
    matmul(a, slice(b, last, s, e))    = slice(matmul(a, b), last, s, e)
    op(slice(a, d, s, e), slice(b, d, s, e)) = slice(op(a, b), d, s, e)  (op elementwise, op(a, b) a rank tensor)

The sliced tensor must be a rank tensor (a `D` leaf), so that the whole op is one the rank
program may compute; the opposite direction (a slice of a product is a product with a
slice) is `matmul.py`'s and `structure.py`'s. For an elementwise op the whole op must be a
rank tensor itself: a padded rank holds real heads and padding, the sequential side reads
its real heads (`slice(q@5, 2, 0, 2)` times a slice of the replicated cos), and only the
rank's own product over all its heads names what it holds (elementwise.py's slice-into-op
is the other direction, from a slice of the whole op). Core elementwise ops take operands
of one shape (broadcasts are explicit expands), so equal slices of the operands are the
same elements of the result.
"""

from __future__ import annotations

from typing import Any

from refine.expr import Term
from refine.opset import Rule, rule


def _elementwise(reg: Any) -> list[Rule]:
    """Each elementwise op over the same slice of all its operands, where the op over the
    whole operands is a rank tensor: the slice of that tensor."""
    out: list[Rule] = []
    for op in reg.of_kind("elementwise"):
        xs = [f"x{i}" for i in range(op.inputs)]
        tail = "".join(f" u{i}" for i in range(len(op.attrs)))
        sliced = " ".join(f"(slice {x} d s f)" for x in xs)
        out.append(rule(f"{op.name}-of-slices", [f"(= e ({op.name} {sliced}{tail}))",
                                                  f"(= m ({op.name} {' '.join(xs)}{tail}))", "(= m (D n))"],
                        ["(union e (slice m d s f))"]))
    return out


def RULES(reg: Any) -> list[Rule]:  # noqa: N802 - a rule file's export
    return _elementwise(reg) + [
        rule("transpose-of-slice-i", ["(= e (transpose (slice x d s f) i j))", "(= x (D n))", "(= d i)"],
             ["(union e (slice (transpose x i j) j s f))"]),
        rule("transpose-of-slice-j", ["(= e (transpose (slice x d s f) i j))", "(= x (D n))", "(= d j)",
                                      "(!= i j)"],
             ["(union e (slice (transpose x i j) i s f))"]),
        rule("transpose-of-slice-other", ["(= e (transpose (slice x d s f) i j))", "(= x (D n))", "(!= d i)",
                                          "(!= d j)"],
             ["(union e (slice (transpose x i j) d s f))"]),
        # columns of b (b at most as many dims as a: the result's last dim is a's)
        rule("matmul-of-col-slice", ["(= e (matmul a (slice b d s f)))", "(= b (D n))", "(= d (- (ndim b) 1))",
                                     "(>= (ndim a) (ndim b))", "(>= (ndim b) 2)"],
             ["(union e (slice (matmul a b) (- (ndim a) 1) s f))"]),
    ]


def SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """Transposes and products of slices of rank tensors (defined leaves, as `D` is), and
    elementwise ops over equal slices next to their whole rank op."""
    r = gen.rng
    out: list[Term] = []
    for _ in range(gen.instances):
        x = gen.leaf((4, 3, 2))
        for d in range(3):
            n = (4, 3, 2)[d]
            s = r.randrange(n - 1)
            sl = Term("slice", (x,), (d, s, r.randint(s + 1, n)))
            for i, j in ((0, 1), (1, 2), (0, 2)):
                out.append(Term("transpose", (sl,), (i, j)))
        m, k, n = r.choice([1, 2]), r.choice([2, 3]), r.choice([3, 4])
        b2 = gen.leaf((k, n))
        s = r.randrange(n - 1)
        out.append(Term("matmul", (gen.leaf((m, k)), Term("slice", (b2,), (1, s, r.randint(s + 1, n))))))
        out.append(Term("matmul", (gen.leaf((2, m, k)), Term("slice", (b2,), (1, 0, n - 1)))))
        b3 = gen.leaf((2, k, n))
        out.append(Term("matmul", (gen.leaf((2, m, k)), Term("slice", (b3,), (2, 1, n)))))
        # an elementwise op over equal slices of its operands, next to the rank tensor that
        # is the op over the whole operands (concatenated along the sliced dim: one term)
        for op in gen.registry.of_kind("elementwise"):
            inst = gen.instance(op.name)
            if inst is None:
                continue
            specs, attrs = inst
            xs = [gen.leaf(sh, kind, bound) for sh, kind, bound in specs]
            sh = specs[0][0]
            d = r.randrange(len(sh))
            s = r.randrange(sh[d])
            f = r.randint(s + 1, sh[d])
            whole = gen.defined_leaf(Term(op.name, tuple(xs), attrs))
            part = Term(op.name, tuple(Term("slice", (x,), (d, s, f)) for x in xs), attrs)
            out.append(Term("cat", (whole, part), (d,)))
    return out
