"""Grouped-query attention's repeat of the kv heads, and transposes of broadcasts.

HF's `repeat_kv` (`x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)`) and the
HLO form (`broadcast_in_dim` + `reshape`) lower to the core term
`view(expand(view(x, s1), s2), s3)`: a size-1 dim put after x's dim d, broadcast to n and
merged back into d. That is `repeat_interleave(x, n, dim=d)`: head h of x becomes heads
h*n .. h*n + n - 1. With the kv heads split across ranks (or a slice taking some of the
repeated heads) the relation needs the heads one at a time, so `repeat-kv-D` peels head 0
off as a broadcast of the unit slice `slice(x, d, 0, 1)` and leaves the other heads as the
same triple over `slice(x, d, 1, H)`, on which the rule fires again:
`cat(expand(x_0), cat(expand(x_1), ... expand(x_{H-1})))` (slice-slice names x_h).
`repeat-kv-one-D` ends it: one head repeated is its broadcast.

egglog has no primitive to insert into a Vec at an index, so the rules are templates over
d (`vec-remove` tests that s1 is x's shape with one entry more). Only this exact triple
matches: the query joins view, expand, view, then compares shape vecs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from refine.ir.term import Term
from refine.ops.registry import Rule, rewrite, rule

MAX_REPEAT_DIM = 4  # templates for the repeated dim d = 0..3 (HF: 1, HLO's Llama: 2)


def _repeat_query(d: int) -> list[str]:
    """e = view(expand(view(x, s1), s2), s3): s1 is x's shape with 1 put at d + 1, s2 that
    with n > 1 there, s3 x's shape with h * n at d (h = x's size at d)."""
    return [
        "(= e (view v s3))", "(= v (expand w s2))", "(= w (view x s1))",
        "(= sx (shape x))", "(= k (vec-length sx))", f"(< {d} k)",
        # lengths first: vec-remove and vec-set panic on an index out of range
        "(= (vec-length s1) (+ k 1))", "(= (vec-length s2) (+ k 1))",
        f"(= (vec-get s1 {d + 1}) (dim 1))", f"(= sx (vec-remove s1 {d + 1}))",
        f"(= n (vec-get s2 {d + 1}))", "(d> n (dim 1))", f"(= s2 (vec-set s1 {d + 1} n))",
        f"(= h (vec-get sx {d}))", f"(= s3 (vec-set sx {d} (d* h n)))",
    ]


def RULES(reg: Any) -> list[Rule]:  # noqa: N802 - a rule file's export
    out: list[Rule] = []
    for d in range(MAX_REPEAT_DIM):
        h1 = "(d- h (dim 1))"
        # head 0 broadcast n times, then the same repeat over heads 1..h (shapes shrunk at d)
        rest = (f"(view (expand (view (slice x {d} (dim 1) h) (vec-set s1 {d} {h1})) (vec-set s2 {d} {h1})) "
                f"(vec-set s3 {d} (d* {h1} n)))")
        out.append(rule(f"repeat-kv-{d}", [*_repeat_query(d), "(d> h (dim 1))"],
                        [f"(union e (cat (expand (slice x {d} (dim 0) (dim 1)) (vec-set sx {d} n)) {rest} {d}))"]))
        out.append(rule(f"repeat-kv-one-{d}", [*_repeat_query(d), "(= h (dim 1))"],
                        [f"(union e (expand x (vec-set sx {d} n)))"]))
    # an expand that adds no dims keeps or broadcasts each dim in place, so a transpose
    # commutes with it (a batched dot's transposes meet the repeat's broadcasts)
    out.append(rewrite("transpose-expand", "(transpose (expand x sh) i j)",
                       "(expand (transpose x i j) (vec-set (vec-set sh i (vec-get sh j)) j (vec-get sh i)))",
                       "(= (vec-length sh) (ndim x))"))
    # a repeat cut by the ranks' blocks, and the broadcasts it leaves, arise where ranks hold
    # copies of KV heads, which defines state: other cases leave these rules out (Rule.needs)
    return [replace(r, needs="defines") for r in out]


def _repeat_term(x: Term, shape: tuple[int, ...], d: int, n: int) -> Term:
    """view(expand(view(x, s1), s2), s3): x repeated n times per entry along d."""
    s1 = shape[:d + 1] + (1,) + shape[d + 1:]
    s2 = shape[:d + 1] + (n,) + shape[d + 1:]
    s3 = shape[:d] + (shape[d] * n,) + shape[d + 1:]
    return Term("view", (Term("expand", (Term("view", (x,), (s1,)),), (s2,)),), (s3,))


def SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """Repeats along every templated dim (one head and several; x a leaf or a concat of
    heads), sliced at a cut inside a head's copies; a tile (the size-1 dim put before d,
    which is no repeat_interleave) as a near miss; transposes of broadcasts."""
    r = gen.rng
    out: list[Term] = []
    for _ in range(gen.instances):
        for d in range(MAX_REPEAT_DIM):
            nd = d + r.choice([1, 2])
            for h in (1, r.choice([2, 3])):
                shape = tuple(h if i == d else r.choice([1, 2, 3]) for i in range(nd))
                n = r.choice([2, 3])
                x = gen.leaf(shape)
                if h > 1 and r.random() < 0.5:  # heads split in two pieces, as across ranks
                    k = r.randint(1, h - 1)
                    x = Term("cat", (gen.leaf(shape[:d] + (k,) + shape[d + 1:]),
                                     gen.leaf(shape[:d] + (h - k,) + shape[d + 1:])), (d,))
                t = _repeat_term(x, shape, d, n)
                out.append(t)
                s = r.randint(0, h * n - 1)
                out.append(Term("slice", (t,), (d, s, r.randint(s + 1, h * n))))
                # the tile: [.., 1, h, ..] broadcast to [.., n, h, ..] and merged
                s1 = shape[:d] + (1,) + shape[d:]
                s2 = shape[:d] + (n,) + shape[d:]
                tile = Term("expand", (Term("view", (gen.leaf(shape),), (s1,)),), (s2,))
                out.append(Term("view", (tile,), (shape[:d] + (shape[d] * n,) + shape[d + 1:],)))
        # transposes of same-rank broadcasts (of a leaf, of a concat along a kept dim)
        shape = (r.choice([2, 3]), 2, 3)
        src = (1, 2, r.choice([1, 3]))
        for i, j in ((0, 1), (0, 2), (1, 2), (2, 0)):
            out.append(Term("transpose", (Term("expand", (gen.leaf(src),), (shape,)),), (i, j)))
        c = Term("cat", (gen.leaf((1, 1, 3)), gen.leaf((1, 1, 3))), (1,))
        out.append(Term("transpose", (Term("expand", (c,), ((4, 2, 3),)),), (0, 1)))
        # a broadcast that adds dims: not this rule's
        out.append(Term("transpose", (Term("expand", (gen.leaf((2, 3)),), ((2, 2, 3),)),), (0, 1)))
    return out
