"""Embedding lookup, and the vocab-parallel lookup that shards the table by rows.

A rank holding rows [s, s+n) of the table looks up `ids - s` where ids fall in its range,
zeroes the rest and the ranks' results are summed (Megatron's VocabParallelEmbedding). The
rule builds exactly that masked lookup from the sequential one, so a rank program written
this way becomes congruent to it.

The gradient of the table, as torch's decomposition of the embedding backward writes it
(`embedding_dense_backward`: the values of ids outside [0, V) or equal to the padding index
zeroed, the ids clamped into [-V, V), an accumulating index_put), is `EmbGradRows(ids, g,
0, V)`: row j the sum of g at the positions whose id is j. A rank holding rows [s, s+n)
computes the backward of its own lookup: with torchtitan's clamped ids and in-range mask as
a number, `EmbGradRows(clamp(ids - s, 0, n - 1), g * in, 0, n)`, which is `EmbGradRows(ids,
g, s, n)`; adjacent row ranges of one accumulation concatenate, so the sequential gradient
is the concat of the ranks'. It is linear in g (a scaled gradient scales it). Concrete sizes only, a padding index < 0 (none) only.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from refine.ir.graph import TensorType
from refine.ir.lazy import torch
from refine.ir.term import Term
from refine.ops.registry import ArgSpec, Helper, Op, Rule, Sample, ShapeError, rewrite, rule


def _shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    w, ids = ins
    if w.ndim != 2:
        raise ShapeError(f"embedding table must be 2-d, got {list(w.shape)}")
    return TensorType(ids.shape + (w.shape[1],), w.dtype)


OPS = [
    Op("embedding", 2, _shape, ref=lambda w, ids: torch.nn.functional.embedding(ids.long(), w),
       core=True,
       egglog_shape="(rule ((= e (embedding w ids)) (= sw (shape w)) (= si (shape ids))) "
       "((set (shape e) (vec-push si (vec-get sw 1)))))",
       doc="rows of weight (first arg) picked by ids (second arg)", linear="first"),
]

_MASK = ("(logical_or_t (lt_t ids (full (to-f64 s) si)) "
         "(ge_t ids (full (to-f64 (+ s (size w 0))) si)))")


def _masked_lookup(shifted: str) -> str:
    return (f"(masked_fill_t (embedding w (masked_fill_t {shifted} {_MASK} 0.0)) "
            f"(expand (view {_MASK} (vec-push si 1)) (vec-push si (size w 1))) 0.0)")


# the same lookup as frameworks write it with arithmetic on the in-range mask: `in * (ids -
# s)`, or vLLM's `in * (ids - s * in)` (its offset is itself masked), out-of-range rows zeroed
# by `~in`. For integer ids, `~in` is _MASK; `in` is 0 or 1, so both indexes are `in * (ids - s)`
_IN = ("(logical_and_t (ge_t ids (full (to-f64 s) si)) "
       "(lt_t ids (full (to-f64 (+ s (size w 0))) si)))")
_NEG_S = f"(Scale {_IN} (bigrat (bigint (- 0 s)) (bigint 1)))"


def _product_lookup(index: str) -> str:
    return (f"(masked_fill_t (embedding w {index}) "
            f"(expand (view (logical_not_t {_IN}) (vec-push si 1)) (vec-push si (size w 1))) 0.0)")


# torchtitan's (and XLA's gather's) form: the shifted ids clamped into the table, so every id
# looks up some row, and the rows of ids out of range multiplied by the in-range mask as a
# number (0 times a real row is 0): `embedding(w, (ids - s).clamp(0, n - 1)) * in.float()`
def _clamped_lookup(shifted: str) -> str:
    return (f"(mul_t (embedding w (clamp_t {shifted} 0.0 (to-f64 (- (size w 0) 1)))) "
            f"(expand (cast_float_t (view {_IN} (vec-push si 1))) (vec-push si (size w 1))))")


# torch's embedding backward (embedding_dense_backward decomposed) of g at ids into a table of
# v rows: values of invalid ids (outside [0, v), or the padding index p) zeroed, ids clamped
_GRAD = ["(= e (index_put_acc (clamp_t ids lo hi) (where_t (expand (logical_not_t (view m sm)) sg) (full 0.0 sg) g) sh))",
         "(= m (logical_and_t (logical_and_t (ge_t ids (full 0.0 si)) (lt_t ids (full vf si))) (ne_t ids (full p si))))",
         "(= si (shape ids))", "(= v (vec-get sh 0))", "(= vf (to-f64 v))", "(= hi (- vf 1.0))", "(= lo (neg vf))",
         "(< p 0.0)"]
# a rank's piece of that backward for rows [lo, lo + n): its clamped ids `l`, its values the
# incoming gradient times the in-range mask as a number
_PIECE = ["(= e (EmbGradRows l gr (dim 0) n))", "(= l (clamp_t x 0.0 nm1))", "(= nm1 (to-f64 (- n 1)))",
          "(= gr (mul_t g (expand (cast_float_t (view (logical_and_t (ge_t ids (full lo si)) "
          "(lt_t ids (full (+ lo (to-f64 n)) si))) sv)) sg)))", "(= si (shape ids))"]


def RULES(reg: Any) -> list[Rule]:  # noqa: N802 - a rule file's export
    return [
        # the embedding backward: the accumulation as row ranges, a rank's piece as its rows,
        # adjacent ranges concatenated
        rule("emb-grad-rows", _GRAD, ["(union e (EmbGradRows ids g (dim 0) v))"], symbolic=False),
        rule("emb-grad-piece-first", [*_PIECE, "(= x ids)", "(= lo 0.0)"],
             ["(union e (EmbGradRows ids g (dim 0) n))"], symbolic=False),
        rule("emb-grad-piece-shifted", [*_PIECE, "(= x (Sum (multiset-of ids f)))", "(= f (full nlo si))", "(= nlo (neg lo))",
                                        "(> lo 0.0)", "(= lo (to-f64 (to-i64 lo)))"],
             ["(union e (EmbGradRows ids g (to-i64 lo) n))"], symbolic=False),
        rule("emb-grad-rows-cat", ["(= a (EmbGradRows ids g s n1))", "(= b (EmbGradRows ids g s2 n2))",
                                   "(= s2 (d+ s n1))"],
             ["(union (EmbGradRows ids g s (d+ n1 n2)) (cat a b 0))"]),
        # linear in the gradient: a gradient off by a factor (a bug's) stays related, scaled
        rewrite("emb-grad-rows-scale", "(EmbGradRows i (Scale g r) s n)", "(Scale (EmbGradRows i g s n) r)"),
        # a lookup is row-wise in ids and column-wise in the table
        rewrite("embedding-ids-cat", "(embedding w (cat a b d))", "(cat (embedding w a) (embedding w b) d)"),
        rewrite("slice-into-embedding-ids", "(slice (embedding w ids) d s e)", "(embedding w (slice ids d s e))",
                "(< d (ndim ids))"),
        rewrite("embedding-cols-cat", "(embedding (cat a b 1) ids)",
                "(cat (embedding a ids) (embedding b ids) (ndim ids))"),
        rewrite("slice-into-embedding-cols", "(slice (embedding w ids) d s e)", "(embedding (slice w 1 s e) ids)",
                "(= d (ndim ids))"),
        rewrite("embedding-vocab-split", "(embedding (cat a b 0) ids)", "(EmbRows (cat a b 0) ids (dim 0))"),
        rule("emb-rows-split", ["(= e (EmbRows (cat a b 0) ids s))", "(= k (size a 0))"],
             ["(union e (Sum (multiset-of (EmbRows a ids s) (EmbRows b ids (d+ s k)))))"]),
        # each form of the masked lookup: `masked_fill` (Megatron), the products with the
        # in-range mask (vLLM, and `in * (ids - s)`), the clamped ids (torchtitan)
        rule("emb-rows-first", ["(= e (EmbRows w ids s))", "(= s (dim 0))", "(= si (shape ids))", "(= sw (shape w))"],
             [f"(union e {_masked_lookup('ids')})", f"(union e {_product_lookup(f'(mul_t {_IN} ids)')})",
              f"(union e {_clamped_lookup('ids')})"],
             symbolic=False),
        rule("emb-rows-shifted", ["(= e (EmbRows w ids s))", "(d> s (dim 0))", "(= si (shape ids))", "(= sw (shape w))"],
             [f"(union e {_masked_lookup('(Sum (multiset-of ids (full (to-f64 (- 0 s)) si)))')})",
              f"(union e {_product_lookup(f'(mul_t {_IN} (Sum (multiset-of ids (full (to-f64 (- 0 s)) si))))')})",
              f"(union e {_product_lookup(f'(mul_t {_IN} (Sum (multiset-of ids {_NEG_S})))')})",
              f"(union e {_clamped_lookup('(Sum (multiset-of ids (full (to-f64 (- 0 s)) si)))')})"],
             symbolic=False),
    ]




def _emb_rows(op: Any, w: Any, ids: Any, s: int) -> Any:
    """Rows [s, s + rows) of a table: ids in range look up row id - s, the rest give 0."""
    ids = ids.long()
    inside = (ids >= s) & (ids < s + w.shape[0])
    local = torch.where(inside, ids - s, torch.zeros_like(ids))
    out = torch.nn.functional.embedding(local, w)
    return out.masked_fill(~inside.unsqueeze(-1), 0.0)


def _emb_grad_rows(op: Any, ids: Any, g: Any, s: int, n: int) -> Any:
    """Rows [s, s + n) of the table gradient: row j the sum of g at the positions of id s + j."""
    ids = ids.long()
    inside = (ids >= s) & (ids < s + n)
    local = torch.where(inside, ids - s, torch.zeros_like(ids))
    vals = (g * inside.unsqueeze(-1).to(g.dtype)).reshape(-1, g.shape[-1])
    out = torch.zeros((n, g.shape[-1]), dtype=g.dtype)
    return out.index_put((local.reshape(-1),), vals, accumulate=True)


HELPERS = [Helper("EmbRows", ("T", "T", "Dim"), _emb_rows),
           Helper("EmbGradRows", ("T", "T", "Dim", "Dim"), _emb_grad_rows)]


# The soundness harness's seeds: a table and ids within it
def _embedding(gen: Any, x: tuple[int, ...]) -> tuple[list[ArgSpec], tuple[Any, ...]]:
    r = gen.rng
    v, h = r.choice([2, 3, 4, 5]), r.choice([1, 2, 3])
    return [((v, h), "f", 0), (gen.dims(r.choice([1, 2])), "i", v)], ()


# the table cut by rows
SAMPLES = {"embedding": Sample(_embedding, count=2, concat_dim=lambda gen, i, attrs: 0 if i == 0 else None)}


def SHARED_SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """The helper constructor applied directly (ids past the table too, and a table cut by
    rows), lookups in a table cut by columns, and slices of lookups."""
    r = gen.rng
    out: list[Term] = []
    for _ in range(gen.instances):
        v = r.choice([2, 3, 5])
        w = gen.leaf((v, 2))
        ids = gen.leaf(gen.dims(r.choice([1, 2])), "i", v + 3)
        out.append(Term("EmbRows", (w, ids), (r.choice([0, 1, 2, 3]),)))
        out.append(Term("EmbRows", (Term("cat", (gen.leaf((1, 2)), gen.leaf((v, 2))), (0,)), ids), (r.choice([0, 1]),)))
    for _ in range(gen.instances):
        v = r.choice([2, 3, 4])
        ids = gen.leaf(gen.dims(r.choice([1, 2])), "i", v)
        table = Term("cat", (gen.leaf((v, 1)), gen.leaf((v, 2))), (1,))
        out.append(Term("embedding", (table, ids)))
        emb = Term("embedding", (gen.leaf((v, 3)), ids))
        out.append(Term("slice", (emb,), (len(gen.shape(ids)), 1, 3)))
    for _ in range(gen.instances):
        out += _grad_seeds(gen)
    return out


def _full(value: float, shape: tuple[int, ...]) -> Term:
    return Term("full", (), (value, shape))


def _int_sum(gen: Any, ids: Term, k: int, si: tuple[int, ...]) -> Term:
    """ids + k as an integer rank tensor (a seed's Sum would take the float constant's dtype):
    a leaf the harness unions with its definition."""
    t = gen.leaf(si, "i", 1)
    gen.defined[t.attrs[0]] = Term("Sum", (ids, _full(float(k), si)))
    return t


def _torch_grad(ids: Term, g: Term, v: int, si: tuple[int, ...], sg: tuple[int, ...], pad: float = -1.0) -> Term:
    """torch's embedding backward of g at ids into v rows (decomposed, as capture traces it),
    rows of the padding index `pad` left without gradient."""
    valid = Term("logical_and_t", (Term("ge_t", (ids, _full(0.0, si))), Term("lt_t", (ids, _full(float(v), si)))))
    m = Term("logical_and_t", (valid, Term("ne_t", (ids, _full(pad, si)))))
    zeroed = Term("expand", (Term("logical_not_t", (Term("view", (m,), (si + (1,),)),)),), (sg,))
    vals = Term("where_t", (zeroed, _full(0.0, sg), g))
    return Term("index_put_acc", (Term("clamp_t", (ids,), (float(-v), float(v - 1))), vals), ((v, sg[-1]),))


def _grad_seeds(gen: Any) -> list[Term]:
    """The whole table's gradient (ids past it, and negative ones), and the ranks' pieces of
    a table cut in two by rows, each the backward of its clamped, masked lookup."""
    r = gen.rng
    v = r.choice([3, 4, 6])
    si = gen.dims(r.choice([1, 2]))
    sg = si + (2,)
    raw = gen.leaf(si, "i", v + 3)
    ids = _int_sum(gen, raw, -2, si) if r.random() < 0.5 else raw
    g = gen.leaf(sg)
    out = [_torch_grad(ids, g, v, si, sg)]
    k = r.choice(range(1, v))
    for lo, n in ((0, k), (k, v - k)):
        shifted = raw if lo == 0 else _int_sum(gen, raw, -lo, si)
        local = Term("clamp_t", (shifted,), (0.0, float(n - 1)))
        inside = Term("logical_and_t", (Term("ge_t", (raw, _full(float(lo), si))),
                                        Term("lt_t", (raw, _full(float(lo + n), si)))))
        mask = Term("expand", (Term("cast_float_t", (Term("view", (inside,), (si + (1,),)),)),), (sg,))
        out.append(_torch_grad(local, Term("mul_t", (g, mask)), n, si, sg))
        # the same in row ranges, as the other rules leave them (each rule is checked alone)
        # (a shifted piece's gradient a Sum: the harness picks a rule's seeds by the ops they
        # hold, and the shift's Sum sits in the defined leaf)
        gi = Term("Sum", (g, gen.leaf(sg))) if lo else g
        out.append(Term("EmbGradRows", (local, Term("mul_t", (gi, mask))), (0, n)))
        out.append(Term("EmbGradRows", (raw, g), (lo, n)))
        out.append(Term("EmbGradRows", (raw, Term("Scale", (g,), (Fraction(r.choice([-1, 2, 3])),))), (lo, n)))
    out.append(_torch_grad(raw, g, v, si, sg))
    out.append(_torch_grad(raw, g, v, si, sg, pad=0.0))  # a real padding row: not the plain accumulation
    return out
