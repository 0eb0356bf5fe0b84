"""Views that merge two adjacent dims, moved outward through transposes and batched products.

Megatron's attention merges batch and heads into one bmm batch dim,
`transpose(view(q, [s, b*h, d]), 0, 1)` with q = cat(q_0, q_1, dim=2) of shape [s, b, h, d]
and the heads split across ranks. Row-major, the merged index is `bi * h + hi`: with b the
outer factor a rank's heads are no contiguous block of it, so the view of the concat is no
concat of views (`view-over-cat` holds only when the concat dim is the outer factor of the
merge). Instead of an interleaving, these rules keep the unmerged tensor and move the merge
outward: a transpose of the merged tensor is a view of transposes of the unmerged one, and a
batched product of two such views (the same batch split on both sides) is the view of the
product of the unmerged tensors, whose head dim is an ordinary concat. The sequential
product then relates to the ranks' through `view(cat(view(bmm@0, [b, h/2, ..]), ..))`, with
a rank tensor's unmerged form read back by the inverse view (`view-inverse-rank`).

The same holds for rows: Megatron's [s, b, h] activations under data parallelism (or
micro-batches) split b, the inner factor of a Linear's [s*b, h] rows. A product with a
matrix acts on each row, so it moves inside the merge (`matmul-rows-of-merged-view`), and a
weight gradient's contraction over the merged rows sums one outer product per row, so both
sides' rows may be reordered alike, b outer (`contract-merged-rows-reordered`), where the
concat of the rank pieces is an ordinary one.

`v = view(x, s)` merges x's dims p, p+1 into s's dim p when s is x's shape with those two
entries replaced by their product: the test is exact shape arithmetic (`d*`), so with
symbolic sizes it holds for every value of the symbols (refine.ir.sizes).
"""

from __future__ import annotations

from typing import Any

from refine.ir.term import Term
from refine.ops.registry import Rule, rule

MAX_MERGE_DIM = 3  # templates for a merged dim at 0..2 (merged tensors of up to 4 dims: what the seeds exercise)


def _merges(v: str, x: str, p: str, s: str = "s") -> list[str]:
    """Query facts: v = view(x, s), the merge of x's dims p and p + 1 into s's dim p."""
    return [f"(= {v} (view {x} {s}))", f"(= sx (shape {x}))", f"(< (+ {p} 1) (vec-length sx))",
            f"(= {s} (vec-remove (vec-set sx {p} (d* (vec-get sx {p}) (vec-get sx (+ {p} 1)))) (+ {p} 1)))"]


def _swapped(s: str, i: str, j: str) -> str:
    return f"(vec-set (vec-set {s} {i} (vec-get {s} {j})) {j} (vec-get {s} {i}))"


def _shift(i: str, p: int) -> str:
    """x's dim for the merged tensor's dim i != p: i below p, i + 1 above it."""
    return f"(+ {i} (max 0 (min 1 (- {i} {p}))))"


def RULES(reg: Any) -> list[Rule]:  # noqa: N802 - a rule file's export
    out: list[Rule] = []
    for p in range(MAX_MERGE_DIM):
        # a transpose of two dims that are not the merged one: transpose x's (shifted) dims
        out.append(rule(f"transpose-merged-view-other-{p}",
                        ["(= e (transpose v i j))", f"(!= i {p})", f"(!= j {p})", *_merges("v", "x", str(p))],
                        [f"(union e (view (transpose x {_shift('i', p)} {_shift('j', p)}) {_swapped('s', 'i', 'j')}))"]))
    for a, b in (("i", "j"), ("j", "i")):  # either order of the transpose's dims
        # the merged dim p swapped with the dim after it (x's p + 2): [.., A, B, C, ..] -> [.., C, A, B, ..]
        out.append(rule(f"transpose-merged-view-right-{a}{b}",
                        [f"(= e (transpose v {a} {b}))", "(= j (+ i 1))", *_merges("v", "x", "i")],
                        [f"(union e (view (transpose (transpose x j (+ i 2)) i j) {_swapped('s', 'i', 'j')}))"]))
        # the merged dim p swapped with the dim before it (x's p - 1): [.., Z, A, B, ..] -> [.., A, B, Z, ..]
        out.append(rule(f"transpose-merged-view-left-{a}{b}",
                        [f"(= e (transpose v {a} {b}))", "(= j (+ i 1))", *_merges("v", "x", "j")],
                        [f"(union e (view (transpose (transpose x i j) j (+ j 1)) {_swapped('s', 'i', 'j')}))"]))
    # batched products of two views that reshape only the batch dims, from the same batch
    # shape to the same batch shape: batch k of one side meets batch k of the other
    # (row-major), so the product is the view of the product of the unviewed operands
    out.append(rule("matmul-of-batch-views",
                    ["(= e (matmul va vb))", "(= va (view a s1))", "(= vb (view b s2))",
                     "(= sa (shape a))", "(= sb (shape b))", "(= na (vec-length sa))", "(> na 2)",
                     "(= na (vec-length sb))", "(= n1 (vec-length s1))", "(> n1 2)", "(= n1 (vec-length s2))",
                     "(= (vec-pop (vec-pop sa)) (vec-pop (vec-pop sb)))",
                     "(= (vec-pop (vec-pop s1)) (vec-pop (vec-pop s2)))",
                     "(= (vec-get s1 (- n1 1)) (vec-get sa (- na 1)))", "(= (vec-get s1 (- n1 2)) (vec-get sa (- na 2)))",
                     "(= (vec-get s2 (- n1 1)) (vec-get sb (- na 1)))", "(= (vec-get s2 (- n1 2)) (vec-get sb (- na 2)))"],
                    ["(union e (view (matmul a b) (vec-set s1 (- n1 1) (vec-get sb (- na 1)))))"]))
    # a product with a matrix acts on rows (the last dim): a view that only merges leading
    # dims keeps every row whole, so the product of the view is the view of the product of
    # the unmerged tensor ([S, B, H] activations under data parallelism: the batch, dim 1, is
    # the inner factor of the merged rows, and the unmerged product splits along it)
    out.append(rule("matmul-rows-of-merged-view",
                    ["(= e (matmul v b))", "(= v (view x s))", "(= (ndim b) 2)", "(= sx (shape x))",
                     "(= sb (shape b))", "(= n (vec-length s))", "(< n (vec-length sx))",
                     "(= (vec-get s (- n 1)) (vec-get sx (- (vec-length sx) 1)))"],
                    ["(union e (view (matmul x b) (vec-set s (- n 1) (vec-get sb 1))))"]))
    # a contraction over merged rows ([S, B, H1]^T [S, B, H2], a weight's gradient) sums one
    # outer product per row: reordering the rows alike on both sides changes nothing, so the
    # batch (the inner factor) may become the outer one, whose concat the merge then splits
    out.append(rule("contract-merged-rows-reordered",
                    ["(= e (matmul t vb))", "(= t (transpose va 0 1))", "(= va (view a s1))", "(= vb (view b s2))",
                     "(= sa (shape a))", "(= sb (shape b))", "(= 3 (vec-length sa))", "(= 3 (vec-length sb))",
                     "(= 2 (vec-length s1))", "(= 2 (vec-length s2))",
                     "(= (vec-get sa 0) (vec-get sb 0))", "(= (vec-get sa 1) (vec-get sb 1))",
                     "(= (vec-get s1 1) (vec-get sa 2))", "(= (vec-get s2 1) (vec-get sb 2))"],
                    ["(union e (matmul (transpose (view (transpose a 0 1) s1) 0 1) (view (transpose b 0 1) s2)))"]))
    # a view is invertible: a rank tensor's operand is the rank tensor viewed back (the
    # unmerged product of a rank, seen as its merged bmm output viewed back)
    out.append(rule("view-inverse-rank", ["(= y (view x s))", "(= y (D n))", "(= sx (shape x))", "(!= sx s)"],
                    ["(union x (view y sx))"]))
    # and a rank tensor is its own view viewed back (a relation that views a rank's merged
    # bmm output unmerged: the rank's own ops on the merged tensor then meet the unmerged one)
    out.append(rule("view-of-rank-inverse", ["(= v (view y s))", "(= y (D n))", "(= sy (shape y))", "(!= sy s)"],
                    ["(union y (view v sy))"]))
    return out


def SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """Merging views (of leaves and of concats), transposed every way, batched products of
    batch views, and rank tensors defined as views."""
    r = gen.rng
    out: list[Term] = []

    def view(x: Term, s: tuple[int, ...]) -> Term:
        return Term("view", (x,), (s,))

    def tr(x: Term, i: int, j: int) -> Term:
        return Term("transpose", (x,), (i, j))

    for _ in range(gen.instances):
        for nd in (3, 4):
            shape = tuple(r.choice([1, 2, 3]) for _ in range(nd))
            for p in range(nd - 1):
                merged = shape[:p] + (shape[p] * shape[p + 1],) + shape[p + 2:]
                x = gen.leaf(shape)
                if r.random() < 0.5 and shape[p] >= 2:  # a concat along the merged pair's outer dim
                    k = r.randint(1, shape[p] - 1)
                    x = Term("cat", (gen.leaf(shape[:p] + (k,) + shape[p + 1:]),
                                     gen.leaf(shape[:p] + (shape[p] - k,) + shape[p + 1:])), (p,))
                v = view(x, merged)
                for i in range(nd - 1):
                    for j in range(nd - 1):
                        if i != j:
                            out.append(tr(v, i, j))
        # [B, H, m, k] @ [B, H, k, n] viewed as [B*H, ..] (and the other way round)
        bb, hh, m, k, n = (r.choice([1, 2, 3]) for _ in range(5))
        a, b = gen.leaf((bb, hh, m, k)), gen.leaf((bb, hh, k, n))
        out.append(Term("matmul", (view(a, (bb * hh, m, k)), view(b, (bb * hh, k, n)))))
        a3, b3 = gen.leaf((bb * hh, m, k)), gen.leaf((bb * hh, k, n))
        out.append(Term("matmul", (view(a3, (bb, hh, m, k)), view(b3, (bb, hh, k, n)))))
        # rows merged ([S, B, H] -> [S*B, H]) times a matrix, of a leaf and of a concat on the inner factor
        ss, bb2, hh2, cc = (r.choice([1, 2, 3]) for _ in range(4))
        w = gen.leaf((hh2, cc))
        out.append(Term("matmul", (view(gen.leaf((ss, bb2, hh2)), (ss * bb2, hh2)), w)))
        b3 = r.choice([1, 2])
        xc = Term("cat", (gen.leaf((ss, bb2, hh2)), gen.leaf((ss, b3, hh2))), (1,))
        out.append(Term("matmul", (view(xc, (ss * (bb2 + b3), hh2)), w)))
        # a contraction over merged rows, of leaves and of concats along the inner factor
        for left in (gen.leaf((ss, bb2, hh2)), xc):
            s0, s1_ = (ss, bb2) if left is not xc else (ss, bb2 + b3)
            right = gen.leaf((s0, s1_, cc))
            out.append(Term("matmul", (tr(view(left, (s0 * s1_, hh2)), 0, 1), view(right, (s0 * s1_, cc)))))
        # a rank tensor that is a view of another term
        y = gen.defined_leaf(view(gen.leaf((bb, hh, m)), (bb * hh, m)))
        out.append(view(y, (bb * hh * m,)))  # the harness picks seeds by the ops they hold
    return out
