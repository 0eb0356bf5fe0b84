"""Embedding lookup, and the vocab-parallel lookup that shards the table by rows.

A rank holding rows [s, s+n) of the table looks up `ids - s` where ids fall in its range,
zeroes the rest and the ranks' results are summed (Megatron's VocabParallelEmbedding). The
rule builds exactly that masked lookup from the sequential one, so a rank program written
this way becomes congruent to it. The table's gradient is rules/embedding_grad.py's.
"""

from __future__ import annotations

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




def RULES(reg: Any) -> list[Rule]:  # noqa: N802 - a rule file's export
    return [
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


HELPERS = [Helper("EmbRows", ("T", "T", "Dim"), _emb_rows)]


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
    return out
