"""Losses: log-softmax written out stably, the vocab-parallel target lookup, and aten's
nll_loss / log-softmax backward ops.

**Log-softmax.** aten `_log_softmax` as capture maps it (`log_softmax_stable`) lowers to the
formula every vocab-parallel cross-entropy computes: `m = max(x)`, `s = x - m`,
`lse = log(sum(exp(s)))`, `x - m - lse`. Each step is its own tensor, so when x is split
along the softmax dim (logits sharded over the vocab) the max becomes a `Max` of the
ranks' maxes (the all-reduce MAX), the sum a `Sum` of theirs (the all-reduce SUM), and
the log-probs the concat of the ranks' `shifted - log(sum_exp)`. (The core `log_softmax`,
one op, keeps its own rules for concats on other dims.)

**Vocab-parallel lookup.** `gather(x, i, d)` with x a concat along d (the log-probs split
over the vocab): each index falls in one piece, so the gather is the `Sum` over pieces of
the piece's masked lookup, as Megatron's vocab-parallel cross-entropy and torch's
loss_parallel compute it on a rank holding vocab rows [s, s + n):

    mask  = (i < s) | (i >= s + n)
    local = where(mask, 0, i - s)
    piece = where(mask, 0, gather(x_piece, local, d))

The helper `GatherOff x i d s` is the lookup into a piece starting at s; it splits along
nested concats. (Indices must lie in [0, size): the sequential gather's own requirement.)

**aten loss ops.** `nll_loss_forward` (its output and total weight), `nll_loss_backward`
and `_log_softmax_backward_data`, for graphs that keep them (capture decomposes them into
gather / where / scatter first): decompositions into core ops with ignore_index and
reduction none / mean / sum; class weights are refused.

**Limit of the vocab-parallel cross-entropy.** refine relates the programs node by node, so
each step of the sequential decomposition of `F.cross_entropy` must be something the ranks
hold (up to concats, sums and scales). Rank code that computes the nll and label-smoothing
terms apart, masks and averages each as F.cross_entropy does, and whose backward goes
through the gradient at the log-probs and its all-reduced sum over the vocab, refines
(models/capture/vocab_ce.py). Megatron's fused forms compute the same values but not those
intermediates: mixing the smoothing term in per token before masking
(`vocab_ce.make_case(fused=True)`) refines because the walk carries the masked nll, a
small value with one user, into its users (refine.prove.walk.infer). Megatron's backward
`softmax - one_hot` (which uses `sum(grad) = -grad_scale`) has no rank tensor for the
sequential gradient at the log-probs, a value with several users, and no rule relates a
one-hot window written at flat indices (`grad[arange, masked] = ...`) to the scatter.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from refine.ir.graph import Arg, TensorType
from refine.ir.lazy import torch
from refine.ir.term import Term
from refine.ops.lower import Builder
from refine.ops.registry import Helper, Op, Rule, ShapeError, rewrite, rule

REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # aten's enum


def _along(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x = ins[0]
    if not 0 <= attrs["dim"] < x.ndim:
        raise ShapeError(f"dim {attrs['dim']} of {list(x.shape)}")
    return x


def _log_softmax_stable(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    """x - m - log(sum(exp(x - m))), m the max along dim: one tensor per step."""
    (x,) = args
    assert isinstance(x, str)
    d, shape = attrs["dim"], b.type(x).shape
    m = b.emit("rmax", [x], {"dim": d})
    shifted = b.emit("Sum", [x, b.scale(b.broadcast(m, shape), Fraction(-1))], {})
    lse = b.emit("log_t", [b.emit("rsum", [b.emit("exp_t", [shifted], {})], {"dim": d})], {})
    return b.emit("Sum", [shifted, b.scale(b.broadcast(lse, shape), Fraction(-1))], {}, out)


def _nll_args(ins: list[TensorType], attrs: dict[str, Any]) -> tuple[TensorType, TensorType]:
    if len(ins) != 2:
        raise ShapeError("nll_loss takes (log-probs, target) without class weights")
    x, t = ins
    if x.ndim not in (1, 2) or t.shape != x.shape[:-1] or not t.dtype.startswith(("int", "uint")):
        raise ShapeError(f"nll_loss of {list(x.shape)} log-probs and {t.dtype} {list(t.shape)} targets: "
                         "need [N, C] (or [C]) and integer [N] (or [])")
    if attrs.get("reduction", 1) not in REDUCTIONS:
        raise ShapeError(f"nll_loss reduction {attrs.get('reduction')}")
    return x, t


def _nll_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, t = _nll_args(ins, attrs)
    return TensorType(t.shape if REDUCTIONS[attrs.get("reduction", 1)] == "none" else (), x.dtype)


def _nll_weight_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, _ = _nll_args(ins, attrs)
    return TensorType((), x.dtype)


def _valid(b: Builder, t: str, ignore: int) -> tuple[str, str]:
    """(t != ignore_index as bool, the target with ignored entries pointing at class 0)."""
    tt = b.type(t)
    valid = b.emit("ne_t", [t, b.const(float(ignore), tt.shape, tt.dtype)], {})
    safe = b.emit("where_t", [valid, t, b.const(0.0, tt.shape, tt.dtype)], {})
    return valid, safe


def _count(b: Builder, valid: str, dtype: str) -> str:
    """The number of targets that are not ignored, as a float scalar."""
    if b.type(valid).ndim == 0:
        return b.emit("cast_float_t", [valid], {})
    flat = b.view(valid, (_numel(b, valid),))
    return b.emit("cast_float_t", [b.view(b.emit("rsum", [flat], {"dim": 0}), ())], {})


def _numel(b: Builder, ref: str) -> int:
    n = 1
    for s in b.type(ref).shape:
        n *= s
    return n


def _picked(b: Builder, x: str, safe: str) -> str:
    """x[j, safe[j]] for every row j (x [N, C] or [C]), shaped like safe."""
    xt, st = b.type(x), b.type(safe)
    idx = b.view(safe, st.shape + (1,))
    return b.view(b.emit("gather", [x, idx], {"dim": xt.ndim - 1}), st.shape)


def _nll_forward(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    x, t = args
    assert isinstance(x, str) and isinstance(t, str)
    valid, safe = _valid(b, t, int(attrs.get("ignore_index", -100)))
    losses = b.emit("where_t", [valid, b.scale(_picked(b, x, safe), Fraction(-1)),
                                b.const(0.0, b.type(t).shape, out.dtype)], {})
    reduction = REDUCTIONS[attrs.get("reduction", 1)]
    if reduction == "none":
        return losses
    total = losses if b.type(losses).ndim == 0 else b.view(b.emit("rsum", [b.view(losses, (_numel(b, losses),))],
                                                                   {"dim": 0}), ())
    if reduction == "sum":
        return total
    return b.emit("div_t", [total, _count(b, valid, out.dtype)], {}, out)


def _nll_weight(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    """nll_loss_forward's second output: the number of targets not ignored (mean, sum)."""
    x, t = args
    assert isinstance(t, str)
    valid, _ = _valid(b, t, int(attrs.get("ignore_index", -100)))
    if REDUCTIONS[attrs.get("reduction", 1)] == "none":
        return b.const(0.0, (), out.dtype)  # aten leaves it 0 without a reduction
    return _count(b, valid, out.dtype)


def _nll_backward_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    if len(ins) != 4:
        raise ShapeError("nll_loss_backward takes (grad_output, log-probs, target, total_weight) without class weights")
    g, x, t, w = ins
    _nll_args([x, t], attrs)
    want = t.shape if REDUCTIONS[attrs.get("reduction", 1)] == "none" else ()
    if g.shape != want or w.shape != ():
        raise ShapeError(f"nll_loss_backward grad {list(g.shape)} (want {list(want)}), total_weight {list(w.shape)}")
    return x


def _nll_backward(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    """-grad (divided by total_weight for mean) at each row's target, 0 elsewhere and on
    ignored rows: a scatter of -1 into zeros, times the per-row weight."""
    g, x, t, w = args
    assert isinstance(g, str) and isinstance(x, str) and isinstance(t, str) and isinstance(w, str)
    reduction = REDUCTIONS[attrs.get("reduction", 1)]
    valid, safe = _valid(b, t, int(attrs.get("ignore_index", -100)))
    ts, xs = b.type(t).shape, b.type(x).shape
    scale = b.emit("div_t", [g, w], {}) if reduction == "mean" else g
    per_row = b.emit("where_t", [valid, b.broadcast(scale, ts), b.const(0.0, ts, out.dtype)], {})
    d = len(xs) - 1
    one_hot = b.emit("scatter_value", [b.const(0.0, xs, out.dtype), b.view(safe, ts + (1,))],
                     {"dim": d, "value": -1.0})
    return b.emit("mul_t", [one_hot, b.broadcast(b.view(per_row, ts + (1,)), xs)], {}, out)


def _log_softmax_backward_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    g, y = ins
    if g.shape != y.shape or not 0 <= attrs["dim"] < y.ndim:
        raise ShapeError(f"_log_softmax_backward_data of {list(g.shape)} and {list(y.shape)} on dim {attrs['dim']}")
    return g


def _log_softmax_backward(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    """g - exp(y) * sum(g, dim), y the log-softmax output."""
    g, y = args
    assert isinstance(g, str) and isinstance(y, str)
    shape = b.type(y).shape
    total = b.broadcast(b.emit("rsum", [g], {"dim": attrs["dim"]}), shape)
    prod = b.emit("mul_t", [b.emit("exp_t", [y], {}), total], {})
    return b.emit("Sum", [g, b.scale(prod, Fraction(-1))], {}, out)


def _nll_ref(x: torch.Tensor, t: torch.Tensor, reduction: int = 1, ignore_index: int = -100) -> torch.Tensor:
    return torch.ops.aten.nll_loss_forward(x, t.long(), None, reduction, ignore_index)[0]


def _nll_weight_ref(x: torch.Tensor, t: torch.Tensor, reduction: int = 1, ignore_index: int = -100) -> torch.Tensor:
    return torch.ops.aten.nll_loss_forward(x, t.long(), None, reduction, ignore_index)[1]


def _nll_backward_ref(g: torch.Tensor, x: torch.Tensor, t: torch.Tensor, w: torch.Tensor, reduction: int = 1,
                      ignore_index: int = -100) -> torch.Tensor:
    return torch.ops.aten.nll_loss_backward(g, x, t.long(), None, reduction, ignore_index, w)


NLL_ATTRS = (("reduction", "int?"), ("ignore_index", "int?"))

OPS = [
    Op("log_softmax_stable", 1, _along, (("dim", "dim"), ("half_to_float", "bool?")),
       ref=lambda x, dim, half_to_float=False: torch.log_softmax(x, dim), decompose=_log_softmax_stable,
       doc="aten _log_softmax as capture maps it: x - max - log(sum(exp(x - max))), one tensor per step"),
    Op("nll_loss_forward", 2, _nll_shape, NLL_ATTRS, ref=_nll_ref, decompose=_nll_forward,
       doc="aten nll_loss_forward output 0: args log-probs [N, C] (or [C]), target; no class weights"),
    Op("nll_loss_total_weight", 2, _nll_weight_shape, NLL_ATTRS, ref=_nll_weight_ref, decompose=_nll_weight,
       doc="aten nll_loss_forward output 1: the count of targets that are not ignored"),
    Op("nll_loss_backward", 4, _nll_backward_shape, NLL_ATTRS, ref=_nll_backward_ref, decompose=_nll_backward,
       doc="aten nll_loss_backward: args grad_output, log-probs, target, total_weight; no class weights"),
    Op("_log_softmax_backward_data", 2, _log_softmax_backward_shape, (("dim", "dim"), ("input_dtype", "str?")),
       ref=lambda g, y, dim, input_dtype=None: g - torch.exp(y) * g.sum(dim, keepdim=True),
       decompose=_log_softmax_backward, doc="args grad_output, the log-softmax output"),
]


def _mask(i: str, s: str, e: str, si: str) -> str:
    return f"(logical_or_t (lt_t {i} (full (to-f64 {s}) {si})) (ge_t {i} (full (to-f64 {e}) {si})))"


def _masked_gather(local: str) -> str:
    m = _mask("i", "s", "(+ s (size w g))", "si")
    return f"(where_t {m} (full 0.0 si) (gather w (where_t {m} (full 0.0 si) {local}) g))"


PREDICATES = ("lt_t", "le_t", "gt_t", "ge_t", "eq_t", "ne_t")


def RULES(reg: Any) -> list[Rule]:  # noqa: N802 - a rule file's export
    # a mask computed on a viewed target (nll_loss_backward unsqueezes it first) is the
    # view of the mask on the target: views come out of comparisons with a constant and of
    # a where between a broadcast scalar and a constant
    views = [rewrite(f"{op}-view-const", f"({op} (view x s) (full v s))",
                     f"(view ({op} x (full v (shape x))) s)") for op in PREDICATES]
    views += [
        rule("where-view-view-const", ["(= e (where_t (view c s) (view x s) (full v s)))", "(= sc (shape c))",
                                       "(= sc (shape x))"],
             ["(union e (view (where_t c x (full v sc)) s))"]),
        rule("where-view-scalar-const", ["(= e (where_t (view c s) (expand x s) (full v s)))", "(= (ndim x) 0)",
                                         "(= sc (shape c))"],
             ["(union e (view (where_t c (expand x sc) (full v sc)) s))"]),
        rule("where-view-const-scalar", ["(= e (where_t (view c s) (full v s) (expand x s)))", "(= (ndim x) 0)",
                                         "(= sc (shape c))"],
             ["(union e (view (where_t c (full v sc) (expand x sc)) s))"]),
    ]
    # a rank's one-hot of its masked local target is its slice of the one-hot over the whole
    # vocab (nll_loss_backward's scatter): the scatter of one value per row into zeros
    piece = "(where_t (expand m shp) (full 0.0 shp) (scatter_value (full 0.0 shp) LOCAL g v))"
    mask = "(= m (logical_or_t (lt_t i (full sf si)) (ge_t i (full ef si))))"
    common = ["(= big (scatter_value (full 0.0 shb) i g v))", "(= si (shape i))", "(= (vec-get si g) 1)",
              "(= (vec-get shp g) (- (to-i64 ef) (to-i64 sf)))", "(= shp (vec-set shb g (vec-get shp g)))",
              "(>= (to-i64 sf) 0)", "(<= (to-i64 ef) (vec-get shb g))", "(= sf (to-f64 (to-i64 sf)))",
              "(= ef (to-f64 (to-i64 ef)))"]
    onehot = [
        rule("one-hot-piece-first", [f"(= e {piece.replace('LOCAL', '(where_t m (full 0.0 si) i)')})", mask, "(= sf 0.0)", *common],
             ["(union e (slice big g (to-i64 sf) (to-i64 ef)))"], symbolic=False),
        rule("one-hot-piece-shifted", [f"(= e {piece.replace('LOCAL', '(where_t m (full 0.0 si) (Sum (multiset-of i (full nsf si))))')})", mask,
                                       "(= nsf (neg sf))", "(> sf 0.0)", *common],
             ["(union e (slice big g (to-i64 sf) (to-i64 ef)))"], symbolic=False),
    ]
    return views + onehot + [
        # a lookup along a concat's own dim: the sum of the pieces' masked lookups
        rewrite("gather-vocab-split", "(gather (cat a b g) i g)", "(GatherOff (cat a b g) i g (dim 0))"),
        rule("gather-off-split", ["(= e (GatherOff (cat a b g) i g s))", "(= k (size a g))"],
             ["(union e (Sum (multiset-of (GatherOff a i g s) (GatherOff b i g (d+ s k)))))"]),
        rule("gather-off-first", ["(= e (GatherOff w i g s))", "(= s (dim 0))", "(= si (shape i))"],
             [f"(union e {_masked_gather('i')})"], symbolic=False),
        rule("gather-off-shifted", ["(= e (GatherOff w i g s))", "(d> s (dim 0))", "(= si (shape i))"],
             [f"(union e {_masked_gather('(Sum (multiset-of i (full (to-f64 (- 0 s)) si)))')})"], symbolic=False),
    ]




def _gather_off(op: Any, x: Any, i: Any, g: int, s: int) -> Any:
    """Positions [s, s + n) along g of a gather: indices in range look up position
    index - s of x, the others give 0."""
    i = i.long()
    inside = (i >= s) & (i < s + x.shape[g])
    local = torch.where(inside, i - s, torch.zeros_like(i))
    return torch.gather(x, g, local).masked_fill(~inside, 0.0)


HELPERS = [Helper("GatherOff", ("T", "T", "i64", "Dim"), _gather_off)]


def SHARED_SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """Lookups along a concat's own dim (vocab pieces, nested), the helper constructor
    applied directly (in range or not, the table whole or split), comparisons and masks on
    a viewed target, and a one-hot next to a rank's masked one-hot of its vocab range."""
    out: list[Term] = []
    for _ in range(gen.instances):
        for k in (1, 2):
            idx = gen.leaf((3, k), "i", 5)
            out.append(Term("gather", (Term("cat", (gen.leaf((3, 2)), gen.leaf((3, 3))), (1,)), idx), (1,)))
            nested = Term("cat", (gen.leaf((3, 1)), Term("cat", (gen.leaf((3, 2)), gen.leaf((3, 2))), (1,))), (1,))
            out.append(Term("gather", (nested, idx), (1,)))
            out.append(Term("GatherOff", (gen.leaf((3, 2)), gen.leaf((3, k), "i", 6)), (1, 3)))
            out.append(Term("GatherOff", (gen.leaf((3, 2)), gen.leaf((3, k), "i", 4)), (1, 0)))
            split = Term("cat", (gen.leaf((3, 1)), gen.leaf((3, 2))), (1,))
            out.append(Term("GatherOff", (split, gen.leaf((3, k), "i", 5)), (1, 1)))
        for op in ("lt_t", "le_t", "gt_t", "ge_t", "eq_t", "ne_t"):
            ints = gen.leaf((2, 3), "i", 3)
            out.append(Term(op, (Term("view", (ints,), ((6, 1),)), Term("full", (), (1.0, (6, 1))))))
        c, x = gen.leaf((2, 3), "b"), gen.leaf((2, 3))
        out.append(Term("where_t", (Term("view", (c,), ((3, 2),)), Term("view", (x,), ((3, 2),)),
                                    Term("full", (), (0.0, (3, 2))))))
        c1, s = Term("view", (gen.leaf((3,), "b"),), ((3, 1),)), gen.leaf(())
        scalar = Term("expand", (s,), ((3, 1),))
        out += [Term("where_t", (c1, scalar, Term("full", (), (0.0, (3, 1))))),
                Term("where_t", (c1, Term("full", (), (0.0, (3, 1))), scalar))]
        out += _one_hots(gen)
    return out


def _one_hots(gen: Any) -> list[Term]:
    """The one-hot over 5 classes, next to the masked one-hots of classes [0, 2) and [2, 5)."""
    out: list[Term] = []
    i = gen.leaf((3, 1), "i", 5)
    zero = Term("full", (), (0.0, (3, 1)))
    big = Term("scatter_value", (Term("full", (), (0.0, (3, 5))), i), (1, -1.0))
    for start, end in ((0, 2), (2, 5)):
        mask = Term("logical_or_t", (Term("lt_t", (i, Term("full", (), (float(start), (3, 1))))),
                                     Term("ge_t", (i, Term("full", (), (float(end), (3, 1)))))))
        shifted = i
        if start:  # an integer rank tensor defined as the shifted index (a sum's type is its first term's)
            shifted = gen.leaf((3, 1), "i", 5)
            gen.defined[shifted.attrs[0]] = Term("Sum", (i, Term("full", (), (float(-start), (3, 1)))))
        local = Term("where_t", (mask, zero, shifted))
        piece = (3, end - start)
        hot = Term("scatter_value", (Term("full", (), (0.0, piece)), local), (1, -1.0))
        masked = Term("where_t", (Term("expand", (mask,), (piece,)), Term("full", (), (0.0, piece)), hot))
        if start:  # the seed names every constructor the rule reads: the sum too
            masked = Term("cat", (masked, gen.defined[shifted.attrs[0]]), (1,))
        out.append(Term("cat", (big, masked), (1,)))  # one seed: the rule reads both
    return out
