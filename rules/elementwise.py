"""Elementwise ops: they commute with concat and slice, and the linear ones with sums.

Core elementwise ops take operands of one shape: when a graph is lowered, number literals
become `full` constants and smaller operands an explicit `expand`, so broadcasting is a
structural fact the structure rules handle (slicing an expand along a broadcast dim).
`add`, `sub`, `neg` and multiplication by a number lower to `Sum` and `Scale`.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from refine.ir.graph import VALUE_CLASSES, Arg, Node, TensorType, value_class
from refine.ir.lazy import F, torch
from refine.ir.term import Term
from refine.ops.lower import Builder, rational
from refine.ops.registry import (
    ArgSpec,
    Helper,
    Op,
    Registry,
    Rule,
    Sample,
    ShapeError,
    broadcast_shapes,
    rewrite,
    rule,
)


def _widest(ins: list[TensorType]) -> str:
    """The dtype of the widest value class among the operands (torch promotes int with float
    to float, bool with int to int), the first of its class; float32 for none."""
    return max(ins, key=lambda t: VALUE_CLASSES.index(value_class(t.dtype))).dtype if ins else "float32"


def _broadcast(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    try:
        shape = broadcast_shapes(*(t.shape for t in ins))
    except ShapeError:
        raise ShapeError(f"operands do not broadcast: {[list(t.shape) for t in ins]}") from None
    return TensorType(shape, _widest(ins))


def _broadcast_bool(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    return TensorType(_broadcast(ins, attrs).shape, "bool")


def _same_shape(dtype: str | None = None):
    def shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
        if len({t.shape for t in ins}) != 1:
            raise ShapeError(f"operands must have one shape, got {[list(t.shape) for t in ins]}")
        return TensorType(ins[0].shape, dtype or ins[-1].dtype)

    return shape


def _scalar_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    return ins[0] if ins else TensorType(())


def _out_shape(b: Builder, args: list[Arg]) -> tuple[int, ...]:
    shapes = [b.type(a).shape for a in args if isinstance(a, str)]
    return broadcast_shapes(*shapes) if shapes else ()


def _operand(b: Builder, a: Arg, shape: tuple[Any, ...], dtype: str = "float32") -> str:
    """`b.broadcast`, with a broadcast constant (a rank-0 `scalar_tensor`, say) folded into a
    constant of the full shape: the prover takes a `full` as a constant, an expand of one
    as a rank tensor it has to find."""
    if isinstance(a, str):
        node = b.graph.index().get(a)
        if isinstance(node, Node) and node.op == "full" and tuple(node.type.shape) != tuple(shape):
            return b.const(float(node.attrs["value"]), shape, node.type.dtype)
    return b.broadcast(a, shape, dtype)


def _lower_elementwise(core: str):
    """A broadcasting user op lowered to the same-shape core op."""

    def decompose(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
        shape = out.shape
        dtype = next((b.type(a).dtype for a in args if isinstance(a, str)), "float32")
        ins = [_operand(b, a, shape, dtype) for a in args]
        return b.emit(core, ins, attrs, out)

    return decompose


def _is_bool(b: Builder, a: Arg) -> bool:
    return isinstance(a, bool) or (isinstance(a, str) and b.type(a).dtype == "bool")


def _add(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    x, y = args
    alpha = rational(attrs.get("alpha", 1), "alpha")
    if _is_bool(b, x) and _is_bool(b, y):
        # two bools add to their logical or (torch: True + True is True), never to a count
        if alpha != 1:
            raise ShapeError(f"{'a difference' if alpha == -1 else 'a scaled sum'} of bool tensors: torch refuses it")
        return _lower_logical("logical_or_t")(b, [x, y], {}, out)
    terms = []
    for a, f in ((x, Fraction(1)), (y, alpha)):
        if _constant(b, a) == 0:
            a = 0.0  # a zeros tensor (an accumulator's start) adds nothing either
        if not isinstance(a, str):
            # the literal times alpha as the reals they stand for, rounded once (an infinity as a float)
            c = float(rational(a) * f) if math.isfinite(float(a)) else float(a) * float(f)
            if c == 0.0:
                continue  # adding zero is the identity
            terms.append(b.const(c, out.shape, out.dtype))
        else:
            terms.append(b.scale(_operand(b, a, out.shape), f))
    if len(terms) <= 1:
        return terms[0] if terms else b.const(0.0, out.shape, out.dtype)
    return b.emit("Sum", terms, {}, out)


def _sub(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    x, y = args
    alpha = rational(attrs.get("alpha", 1), "alpha")
    return _add(b, [x, y], {"alpha": -alpha}, out)


def _rsub(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    x, y = args
    return _sub(b, [y, x], attrs, out)


def _neg(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    if _is_bool(b, args[0]):
        raise ShapeError("the negation of a bool tensor: torch refuses it")
    return b.scale(args[0], Fraction(-1))  # type: ignore[arg-type]


def _finite(a: Arg) -> bool:
    """A tensor, or a literal that is a real number."""
    return isinstance(a, str) or math.isfinite(float(a))


def _constant(b: Builder, a: Arg) -> Arg:
    """A `full` constant operand as the rational it stands for (a traced seed gradient, the
    1/M of a loss scale: a product with it lowers to a Scale like a literal's), read as
    every constant is (`refine.ops.lower.rational`: 0.333.. is 1/3); other operands as
    they are."""
    if isinstance(a, str):
        node = b.graph.index().get(a)
        if isinstance(node, Node) and node.op == "full" and math.isfinite(v := float(node.attrs["value"])):
            return rational(v)
    return a


def _mul(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    x, y = (_constant(b, a) for a in args)
    if not all(_finite(a) for a in (x, y)):
        # an infinity is no rational factor (inf * 0 is NaN): the product of values, as for
        # an infinite `full` operand (_constant)
        return _lower_elementwise("mul_t")(b, args, attrs, out)
    if not isinstance(x, str) and not isinstance(y, str):
        return b.const(float(rational(x) * rational(y)), out.shape, out.dtype)
    if (not isinstance(x, str) and x == 0) or (not isinstance(y, str) and y == 0):
        # zero times a (real) value: zeros, not a Scale by 0 (vLLM's `org_mask * start` on rank 0)
        return b.const(0.0, out.shape, out.dtype)
    if not isinstance(y, str) and isinstance(x, str):
        return b.scale(_operand(b, x, out.shape), rational(y))
    if not isinstance(x, str) and isinstance(y, str):
        return b.scale(_operand(b, y, out.shape), rational(x))
    return _lower_elementwise("mul_t")(b, args, attrs, out)


def _div(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    x, y = args[0], _constant(b, args[1])
    if not isinstance(y, str) and isinstance(x, str) and _finite(y):
        if float(y) == 0.0:
            raise ShapeError("division by the literal 0")
        return b.scale(_operand(b, x, out.shape), 1 / rational(y))
    return _lower_elementwise("div_t")(b, args, attrs, out)


def _empty_range(b: Builder, x: Arg, y: Arg) -> bool:
    """x and y are `t >= a` and `t < c` (either order) over one tensor with constants a >= c:
    no value is in [a, c) (vLLM's added-vocab range when no tokens were added)."""
    nodes = [b.graph.index().get(a) if isinstance(a, str) else None for a in (x, y)]
    if not all(isinstance(n, Node) for n in nodes):
        return False
    by_op = {n.op: n for n in nodes}  # type: ignore[union-attr]
    ge, lt = by_op.get("ge_t"), by_op.get("lt_t")
    if ge is None or lt is None or ge.args[0] != lt.args[0]:
        return False
    a, c = _constant(b, ge.args[1]), _constant(b, lt.args[1])
    return not isinstance(a, str) and not isinstance(c, str) and a >= c


def _lower_logical(core: str):
    """logical and/or of masks, folding what is known at lowering: an and with an empty range
    or with false is false, an or with false is the other (bool) mask. A mask known false
    then zeroes the arithmetic done with it (`_mul`, `_add`) instead of reaching the prover."""

    def decompose(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
        x, y = args
        false = [not isinstance(a, str) and not a or (isinstance(a, str) and _constant(b, a) == 0) for a in args]
        if core == "logical_and_t" and (any(false) or _empty_range(b, x, y)):
            return b.const(0.0, out.shape, out.dtype)
        if core == "logical_or_t" and any(false):
            other = y if false[0] else x
            if isinstance(other, str) and b.type(other).dtype == "bool" and b.type(other).shape == out.shape:
                return other
        return _lower_elementwise(core)(b, args, attrs, out)

    return decompose


def _masked_fill(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    x, mask = args
    m = b.broadcast(mask, out.shape, "bool")
    return b.emit("masked_fill_t", [b.broadcast(x, out.shape), m], {"value": float(attrs["value"])}, out)


def _dropout(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    # dropout with its mask as an explicit input: x * mask / (1 - p)
    x, mask = args
    kept = _lower_elementwise("mul_t")(b, [x, mask], {}, out)
    return b.scale(kept, 1 / (1 - rational(attrs["p"], "dropout p")))


def _gelu(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    return b.emit("gelu_t", list(args), {"approximate": attrs.get("approximate", "none")}, out)


def _where_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    # the condition is always a tensor (ins[0]); the result has the branches' dtype
    shape = _broadcast(ins, attrs).shape
    branches = [t.dtype for t in ins[1:]]
    floats = [d for d in branches if not d.startswith(("int", "uint", "bool"))]
    return TensorType(shape, (floats or branches or ["float32"])[0])


def _where(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    # a literal branch takes the result's dtype, not the condition's (a bool -inf is True)
    c, x, y = args
    ins = [_operand(b, c, out.shape, "bool"), _operand(b, x, out.shape, out.dtype), _operand(b, y, out.shape, out.dtype)]
    return b.emit("where_t", ins, {}, out)


def _clamp(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    lo, hi = attrs.get("min"), attrs.get("max")
    return b.emit("clamp_t", list(args), {"min": -math.inf if lo is None else float(lo),
                                          "max": math.inf if hi is None else float(hi)}, out)


def _clamp_ref(x: torch.Tensor, min: float | None = None, max: float | None = None) -> torch.Tensor:  # noqa: A002
    if x.is_floating_point():
        return torch.clamp(x, min, max)
    # integer tensors stay integers: clamp to the integers inside [min, max]
    lo = None if min is None or min == -math.inf else math.ceil(min)
    hi = None if max is None or max == math.inf else math.floor(max)
    return x if lo is None and hi is None else torch.clamp(x, lo, hi)


def _bool_only(core: str):
    """bitwise ops on bool tensors are the logical ops; on integers they are not supported."""

    def shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
        if any(t.dtype != "bool" for t in ins):
            raise ShapeError(f"{core[:-2]} as a bitwise op on {[t.dtype for t in ins]}: only bool tensors are supported")
        return _broadcast_bool(ins, attrs)

    return shape


UNARY = {
    "exp_t": torch.exp, "log_t": torch.log, "sqrt_t": torch.sqrt, "rsqrt_t": torch.rsqrt,
    "sigmoid_t": torch.sigmoid, "silu_t": F.silu, "tanh_t": torch.tanh, "relu_t": torch.relu,
    "abs_t": torch.abs, "reciprocal_t": torch.reciprocal, "erf_t": torch.erf, "sin_t": torch.sin,
    "cos_t": torch.cos, "logical_not_t": torch.logical_not, "square_t": torch.square,
}
BINARY = {
    "mul_t": torch.mul, "div_t": torch.div, "maximum_t": torch.maximum,
    "minimum_t": torch.minimum, "pow_t": torch.pow, "lt_t": torch.lt, "le_t": torch.le,
    "gt_t": torch.gt, "ge_t": torch.ge, "eq_t": torch.eq, "ne_t": torch.ne,
    "logical_or_t": torch.logical_or, "logical_and_t": torch.logical_and,
}
PREDICATES = {"lt_t", "le_t", "gt_t", "ge_t", "eq_t", "ne_t", "logical_or_t", "logical_and_t", "logical_not_t"}
# ops whose value is a float whatever their inputs (torch.exp of an int64 tensor is float32;
# `/` is true division): a node declaring an integer dtype for one is refused (refine.frontends.graphfile)
FLOATING = {"exp_t", "log_t", "sqrt_t", "rsqrt_t", "sigmoid_t", "silu_t", "tanh_t", "reciprocal_t", "erf_t",
            "sin_t", "cos_t", "div_t", "gelu_t"}


def _floating(shape: Any) -> Any:
    """A shape rule whose dtype is floating: its inputs' if they are floats, else float32."""

    def rule(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
        t = shape(ins, attrs)
        return t if value_class(t.dtype) == "float" else TensorType(t.shape, "float32")

    return rule


def _shape_of(name: str, shape: Any) -> Any:
    return _floating(shape) if name in FLOATING else shape


def _gelu_ref(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return F.gelu(x, approximate=approximate)


OPS = [
    *(Op(n, 1, _shape_of(n, _same_shape("bool" if n in PREDICATES else None)), ref=f, core=True, kind="unary")
      for n, f in UNARY.items()),
    Op("gelu_t", 1, _floating(_same_shape()), (("approximate", "str"),), ref=_gelu_ref, core=True, kind="unary"),
    Op("gelu", 1, _floating(_same_shape()), (("approximate", "str?"),), ref=_gelu_ref, decompose=_gelu),
    Op("clamp_t", 1, _same_shape(), (("min", "float"), ("max", "float")), ref=_clamp_ref, core=True,
       kind="unary", doc="clamp to [min, max] (either may be infinite)"),
    Op("clamp", 1, _same_shape(), (("min", "float?"), ("max", "float?")), ref=_clamp_ref, decompose=_clamp),
    *(Op(n[:-2], 1, _shape_of(n, _same_shape("bool" if n in PREDICATES else None)), ref=f,
         decompose=_lower_elementwise(n)) for n, f in UNARY.items()),
    *(Op(n, 2, _shape_of(n, _same_shape("bool" if n in PREDICATES else None)), ref=f, core=True, kind="elementwise",
         linear={"mul_t": "each", "div_t": "first"}.get(n, ""))
      for n, f in BINARY.items()),
    # the filled tensor's dtype, not the mask's (an integer target masked before a gather)
    Op("masked_fill_t", 2, lambda ins, a: TensorType(_same_shape()(ins, a).shape, ins[0].dtype), (("value", "float"),),
       ref=lambda x, m, value: x.masked_fill(m.bool(), value), core=True, kind="elementwise"),
    Op("where_t", 3, _same_shape(), ref=lambda c, x, y: torch.where(c.bool(), x, y), core=True,
       kind="elementwise"),
    # user-level ops, lowered to the above
    Op("add", 2, _broadcast, (("alpha", "float?"),), ref=lambda x, y, alpha=1: x + alpha * y, decompose=_add),
    Op("sub", 2, _broadcast, (("alpha", "float?"),), ref=lambda x, y, alpha=1: x - alpha * y, decompose=_sub),
    Op("rsub", 2, _broadcast, (("alpha", "float?"),), ref=lambda x, y, alpha=1: y - alpha * x, decompose=_rsub),
    Op("neg", 1, _scalar_shape, ref=torch.neg, decompose=_neg),
    Op("mul", 2, _broadcast, ref=torch.mul, decompose=_mul),
    Op("div", 2, _floating(_broadcast), ref=torch.div, decompose=_div),
    Op("masked_fill", 2, lambda ins, a: ins[0], (("value", "float"),),
       ref=lambda x, m, value: x.masked_fill(m.bool(), value), decompose=_masked_fill),
    Op("where", 3, _where_shape, ref=lambda c, x, y: torch.where(torch.as_tensor(c).bool(), x, y),
       decompose=_where, doc="args: condition, x, y (tensors or number literals)"),
    Op("dropout_masked", 2, _broadcast, (("p", "float"),),
       ref=lambda x, m, p: x * m / (1 - p), decompose=_dropout,
       doc="dropout with its keep-mask as an explicit input"),
    *(Op(n[:-2], 2, _broadcast_bool if n in PREDICATES else _broadcast, ref=f,
         decompose=_lower_logical(n) if n in ("logical_and_t", "logical_or_t") else _lower_elementwise(n))
      for n, f in BINARY.items() if n not in ("mul_t", "div_t")),
    # aten's bitwise ops on bool tensors (masks) are the logical ones
    Op("bitwise_and", 2, _bool_only("logical_and_t"), ref=torch.bitwise_and,
       decompose=_lower_logical("logical_and_t")),
    Op("bitwise_or", 2, _bool_only("logical_or_t"), ref=torch.bitwise_or,
       decompose=_lower_logical("logical_or_t")),
    Op("bitwise_not", 1, _bool_only("logical_not_t"), ref=torch.bitwise_not,
       decompose=_lower_elementwise("logical_not_t")),
]


def _vars(n: int, prefix: str) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def RULES(reg: Registry) -> list[Rule]:  # noqa: N802 - a rule file's export
    out: list[Rule] = []
    for op in reg.of_kind("unary"):
        attrs = " ".join(_vars(len(op.attrs), "u"))
        tail = f" {attrs}" if attrs else ""
        out.append(rewrite(f"{op.name}-over-cat", f"({op.name} (cat a b d){tail})",
                           f"(cat ({op.name} a{tail}) ({op.name} b{tail}) d)"))
        out.append(rewrite(f"slice-into-{op.name}", f"(slice ({op.name} x{tail}) d s e)",
                           f"({op.name} (slice x d s e){tail})"))
        if op.name != "Scale":  # view-scale (structure.py)
            # position by position, so any view: a rank that reduces without keepdim and
            # applies the op after (log of Megatron's all-reduced sum of exps, [s, b]) holds
            # the view of the op on the kept dims the sequential log-softmax computes
            # (concrete sizes only: with symbols, the new views meet the reshape rules' size
            # arithmetic on shapes it does not cover)
            out.append(rewrite(f"view-into-{op.name}", f"(view ({op.name} x{tail}) s)",
                               f"({op.name} (view x s){tail})", symbolic=False))
    for op in reg.of_kind("elementwise"):
        attrs = " ".join(_vars(len(op.attrs), "u"))
        tail = f" {attrs}" if attrs else ""
        xs = _vars(op.inputs, "x")
        for i in range(op.inputs):
            lhs_args = [("(cat p q d)" if j == i else x) for j, x in enumerate(xs)]
            left = [("p" if j == i else f"(slice {x} d (dim 0) k)") for j, x in enumerate(xs)]
            right = [("q" if j == i else f"(slice {x} d k n)") for j, x in enumerate(xs)]
            out.append(rule(
                f"{op.name}-over-cat-{i}",
                [f"(= e ({op.name} {' '.join(lhs_args)}{tail}))", "(= k (size p d))", "(= n (size e d))"],
                [f"(union e (cat ({op.name} {' '.join(left)}{tail}) ({op.name} {' '.join(right)}{tail}) d))"],
            ))
        sliced = " ".join(f"(slice {x} d s f)" for x in xs)
        out.append(rewrite(f"slice-into-{op.name}", f"(slice ({op.name} {' '.join(xs)}{tail}) d s f)",
                           f"({op.name} {sliced}{tail})"))
    # linearity: products and quotients distribute over sums and commute with scales
    out += [
        rule("mul-sum-left", ["(= e (mul_t (Sum ms) y))"],
             ["(union e (Sum (unstable-multiset-map (unstable-fn \"MulBy\" y) ms)))"]),
        rule("mul-sum-right", ["(= e (mul_t y (Sum ms)))"],
             ["(union e (Sum (unstable-multiset-map (unstable-fn \"mul_t\" y) ms)))"]),
        rule("div-sum", ["(= e (div_t (Sum ms) y))"],
             ["(union e (Sum (unstable-multiset-map (unstable-fn \"DivBy\" y) ms)))"]),
        rewrite("mul-by", "(MulBy y x)", "(mul_t x y)"),
        rewrite("div-by", "(DivBy y x)", "(div_t x y)"),
        rewrite("mul-scale-left", "(mul_t (Scale x r) y)", "(Scale (mul_t x y) r)"),
        rewrite("mul-scale-right", "(mul_t x (Scale y r))", "(Scale (mul_t x y) r)"),
        rewrite("div-scale", "(div_t (Scale x r) y)", "(Scale (div_t x y) r)"),
        # a product and its swap, both present, are one (no commutativity in saturation: it
        # makes no term; a product distributed over a sum meets the same product written
        # the other way, as flash attention's P_j * (dP_j - D) meets dP * P)
        rule("mul-comm-existing", ["(= e (mul_t a b))", "(= f (mul_t b a))"], ["(union e f)"]),
    ]
    return out


HELPERS = [Helper("MulBy", ("T", "T"), lambda op, y, x: op("mul_t")(x, y)),
           Helper("DivBy", ("T", "T"), lambda op, y, x: op("div_t")(x, y))]


# The soundness harness's seeds: arguments in each op's domain (positive where it needs,
# bool for logic), and its attributes' values
def _positive(gen: Any, x: tuple[int, ...]) -> tuple[list[ArgSpec], tuple[Any, ...]]:
    return [(x, "p", 0)], ()


def _logical(gen: Any, x: tuple[int, ...]) -> tuple[list[ArgSpec], tuple[Any, ...]]:
    return [(x, "b", 0), (x, "b", 0)], ()


SAMPLES = {
    **{name: Sample(_positive) for name in ("log_t", "sqrt_t", "rsqrt_t", "reciprocal_t")},
    "logical_not_t": Sample(lambda gen, x: ([(x, "b", 0)], ())),
    "gelu_t": Sample(lambda gen, x: ([(x, "f", 0)], (gen.rng.choice(["none", "tanh"]),))),
    "clamp_t": Sample(lambda gen, x: ([(x, "f", 0)], gen.rng.choice([(-0.5, 0.5), (-math.inf, 0.0), (0.0, math.inf)]))),
    "logical_or_t": Sample(_logical),
    "logical_and_t": Sample(_logical),
    "masked_fill_t": Sample(lambda gen, x: ([(x, "f", 0), (x, "b", 0)], (gen.rng.choice([0.0, -1.5]),))),
    "where_t": Sample(lambda gen, x: ([(x, "b", 0), (x, "f", 0), (x, "f", 0)], ())),
    "pow_t": Sample(lambda gen, x: ([(x, "p", 0), (x, "f", 0)], ())),
    "div_t": Sample(lambda gen, x: ([(x, "f", 0), (x, "p", 0)], ())),
}


def SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """A product next to its swap (mul-comm-existing joins them; alone, neither is swapped);
    views of each unary op (view-into-*), reshaped and with a unit dim dropped."""
    out: list[Term] = []
    for _ in range(gen.instances):
        a, b = gen.leaf((2, 3)), gen.leaf((2, 3))
        out += [Term("mul_t", (a, b)), Term("mul_t", (b, a)), Term("mul_t", (b, gen.leaf((2, 3))))]
        for name in sorted(n for n, op in gen.core.items() if op.kind == "unary" and n != "Scale"):
            inst = gen.instance(name)
            if inst is None:
                continue
            specs, attrs = inst
            shape, kind, bound = specs[0]
            x = gen.build(name, [gen.leaf(shape, kind, bound)], attrs)
            out.append(Term("view", (x,), (gen.refactor(shape),)))
            kept = gen.build(name, [gen.leaf((*shape, 1), kind, bound)], attrs)
            out.append(Term("view", (kept,), (shape,)))
    return out


def SHARED_SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """The helper constructors applied directly (the divisor positive)."""
    out: list[Term] = []
    for _ in range(gen.instances):
        t = gen.leaf((2, 3))
        out += [Term("MulBy", (gen.leaf((2, 3)), t)), Term("DivBy", (gen.leaf((2, 3), "p"), t))]
    return out
