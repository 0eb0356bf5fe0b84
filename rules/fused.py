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

from dataclasses import replace
from typing import Any

from refine.ir.term import Term, nary
from refine.ops.registry import Rule, rule


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
        # the slice of the rank op whose operand the sequential op reads a slice of: its
        # other operands need not be slices (a padded rank's real heads of the scores, under
        # a mask broadcast over all the sequential heads), and slice-into-op then pushes the
        # slice into them, where they meet the sequential operands (or do not). Only a term
        # is made, nothing is unioned
        for i in range(op.inputs):
            args = " ".join("(slice m d s f)" if j == i else f"a{j}" for j in range(op.inputs))
            whole = " ".join("m" if j == i else f"x{j}" for j in range(op.inputs))
            out.append(replace(rule(f"{op.name}-slice-of-whole-{i}", [f"(= e ({op.name} {args}{tail}))",
                                                                       f"(= w ({op.name} {whole}{tail}))", "(= w (D n))"],
                                    ["(slice w d s f)"]), needs="defines"))
    return out


def _one_operand(reg: Any) -> list[Rule]:
    """A unary op, or a reduction along another dim, of a slice of a rank tensor whose
    whole op is a rank tensor: the slice of that tensor (a padded rank's softmax over its
    real heads)."""
    out: list[Rule] = []
    for op in reg.of_kind("unary"):
        tail = "".join(f" u{i}" for i in range(len(op.attrs)))
        out.append(rule(f"{op.name}-of-slice", [f"(= e ({op.name} (slice m d s f){tail}))",
                                                 f"(= w ({op.name} m{tail}))", "(= w (D n))"],
                        ["(union e (slice w d s f))"]))
    for op in REDUCTIONS:
        out.append(rule(f"{op}-of-slice", [f"(= e ({op} (slice m d s f) r))", "(!= d r)",
                                            f"(= w ({op} m r))", "(= w (D n))"],
                        ["(union e (slice w d s f))"]))
    # a sum holding a slice of a term of a rank tensor's sum: the slice of that tensor
    # (slice-sum then pushes it into the rank sum's terms, where they meet or not)
    out.append(rule("Sum-slice-of-whole", ["(= e (Sum ms))", "(SumHas e a)", "(= a (slice m d s f))",
                                           "(SumHas w m)", "(= w (D n))"],
                    ["(slice w d s f)"]))
    return out


REDUCTIONS = ("rsum", "rmax", "rmean")  # keepdim reductions (rules/reduce.py)


def RULES(reg: Any) -> list[Rule]:  # noqa: N802 - a rule file's export
    # a padded rank's real heads (a define's zeros) are where a slice of a whole rank op is
    # met: other cases leave those rules out (Rule.needs)
    padded = [replace(r, needs="defines") for r in _one_operand(reg)]
    return _elementwise(reg) + padded + [
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
        # a batch dim sliced alike on both operands, where the whole batched product is a
        # rank tensor: a padded rank's real heads' scores are a slice of its own (TP6's last
        # rank holds 2 real query heads of 6)
        replace(rule("matmul-of-batch-slices", ["(= e (matmul (slice a d s f) (slice b d s f)))", "(= m (matmul a b))",
                                        "(= m (D n))", "(= (ndim a) (ndim b))", "(< d (- (ndim a) 2))"],
             ["(union e (slice m d s f))"]), needs="defines"),
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
        # batched products of equal batch slices, next to the whole product as a rank tensor
        a4, b4 = gen.leaf((3, 2, m, k)), gen.leaf((3, 2, k, n))
        for d, size in ((0, 3), (1, 2)):
            s = r.randrange(size)
            f = r.randint(s + 1, size)
            whole = gen.defined_leaf(Term("matmul", (a4, b4), ()))
            part = Term("matmul", (Term("slice", (a4,), (d, s, f)), Term("slice", (b4,), (d, s, f))), ())
            out.append(Term("cat", (whole, part), (d,)))
        # unary ops and reductions of a slice, next to the whole op as a rank tensor
        x3 = gen.leaf((3, 4, 2))
        s = r.randrange(3)
        sl = Term("slice", (x3,), (0, s, r.randint(s + 1, 3)))
        for op in gen.registry.of_kind("unary"):
            inst = gen.instance(op.name)
            if inst is None:
                continue
            specs, attrs = inst
            x = gen.leaf(specs[0][0], specs[0][1], specs[0][2])
            sh = specs[0][0]
            d = r.randrange(len(sh))
            s = r.randrange(sh[d])
            whole = gen.defined_leaf(Term(op.name, (x,), attrs))
            out.append(Term("cat", (whole, Term(op.name, (Term("slice", (x,), (d, s, r.randint(s + 1, sh[d]))),), attrs)),
                            (d,)))
        for op in REDUCTIONS:
            for red in (1, 2):
                whole = gen.defined_leaf(Term(op, (x3,), (red,)))
                out.append(Term("cat", (whole, Term(op, (sl,), (red,))), (0,)))
        # a sum with a slice of a term of a rank tensor's sum
        a3, b3 = gen.leaf((3, 4, 2)), gen.leaf((3, 4, 2))
        whole = gen.defined_leaf(nary("Sum", [a3, b3]))
        out.append(Term("cat", (whole, nary("Sum", [Term("slice", (a3,), sl.attrs), gen.leaf((sl.attrs[2] - sl.attrs[1], 4, 2))])), (0,)))
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
            # the same op over one sliced operand and others of the slice's shape
            i = r.randrange(len(xs))
            others = [x if j == i else gen.leaf(_sliced(specs[j][0], d, s, f), specs[j][1], specs[j][2])
                      for j, x in enumerate(xs)]
            part = Term(op.name, tuple(Term("slice", (x,), (d, s, f)) if j == i else x
                                       for j, x in enumerate(others)), attrs)
            out.append(Term("cat", (whole, part), (d,)))
    return out


def _sliced(shape: tuple[int, ...], d: int, s: int, f: int) -> tuple[int, ...]:
    return tuple(f - s if k == d else n for k, n in enumerate(shape))
