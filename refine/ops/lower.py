"""Lower a user graph to core ops: the only ops the e-graph knows.

Each user node either is a core op already (kept, attributes normalised) or decomposes
through its op's `decompose` into core nodes emitted by a `Builder`. Decomposed nodes keep
`origin` = the user node, so a bug found in them is reported at the user's node and source
line. Identity-like ops (clone, wait_tensor, ...) become aliases and vanish, unless they make
a bool a number (`cast_float_t`, rules/cast.py); one that narrows the value class is refused.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from refine.ir.graph import Arg, Graph, Node, TensorType, narrowing, value_class
from refine.ir.sizes import Sym
from refine.ops.registry import Op, Registry, ShapeError


class UnsupportedOp(ValueError):
    """An op with neither a rule family nor a decomposition: the check fails closed."""


@dataclass
class Builder:
    registry: Registry
    graph: Graph  # the core graph being built
    origin: str = ""
    source: str | None = None
    count: int = 0
    alias: dict[str, str] = field(default_factory=dict)
    # (op, args, attrs, dtype) -> the node computing it: a value computed twice (traces
    # recompute masks, casts, views) is one tensor, so relations found for it hold for all
    # its uses. Collectives are events, never merged.
    memo: dict[Any, str] = field(default_factory=dict)
    numbered: dict[str, int] = field(default_factory=dict)  # base name -> the last number tried

    def type(self, ref: str) -> TensorType:
        return self.graph.type_of(ref)

    def emit(self, op: str, args: list[Arg], attrs: dict[str, Any] | None = None,
             type: TensorType | None = None, name: str | None = None) -> str:
        spec = self.registry.ops[op]
        attrs = dict(attrs or {})
        ins = [self.type(a) for a in args if isinstance(a, str)]
        inferred = spec.shape(ins, attrs)
        if type is not None and type.shape != inferred.shape:
            raise ShapeError(f"{op} gives shape {list(inferred.shape)}, node says {list(type.shape)}")
        if name is None:
            # readable and unique: fc2_bias.expand, fc2_bias.Sum, fc2_bias.expand2
            base = f"{self.origin}.{op}"
            k = self.numbered.get(base, 1)  # from the last one: a split into n pieces names n nodes, not n^2
            name = f"{base}{k}" if k > 1 else base
            while name in self.graph.index():
                k += 1
                name = f"{base}{k}"
            self.numbered[base] = k
        out = TensorType(inferred.shape, type.dtype if type else inferred.dtype)
        if "value" in attrs:  # a number the op stores in its output (a fill): as its dtype holds it
            attrs["value"] = held(attrs["value"], out.dtype)
        key = None if spec.kind == "collective" else (op, tuple(args), _frozen(attrs), out.dtype)
        if key is not None and key in self.memo:
            return self.memo[key]
        if key is not None:
            self.memo[key] = name
        node = Node(name, op, list(args), attrs, out, self.source, self.origin)
        self.graph.add(node)
        return name

    # conveniences for decompositions

    def const(self, value: float, shape: tuple[int, ...], dtype: str = "float32") -> str:
        return self.emit("full", [], {"value": float(value), "shape": tuple(shape)},
                         TensorType(tuple(shape), dtype))

    def broadcast(self, arg: Arg, shape: tuple[int, ...], dtype: str = "float32") -> str:
        """A tensor argument of `shape`: literals become constants, smaller tensors expand."""
        if not isinstance(arg, str):
            return self.const(float(arg), shape, dtype)
        if self.type(arg).shape == tuple(shape):
            return arg
        return self.emit("expand", [arg], {"shape": tuple(shape)})

    def scale(self, ref: str, factor: Fraction) -> str:
        node = self.graph.index().get(ref)
        if isinstance(node, Node) and node.op == "Scale" and factor != 1:
            # a scale of a scale is one scale: the prover then reaches the scaled tensor's
            # users in one hop fewer (a loss scaled by 1/M, then by the seed gradient)
            ref, factor = node.args[0], Fraction(node.attrs["factor"]) * Fraction(factor)  # type: ignore[assignment]
        return ref if factor == 1 else self.emit("Scale", [ref], {"factor": Fraction(factor)})

    def cast(self, ref: str, dtype: str) -> str:
        """`ref` in `dtype`. refine's values are real numbers, so another precision, or an
        integer as a floating dtype, is the same tensor; a bool as a number is `cast_float_t`
        (rules/cast.py: never an identity, a bool's + is an or). A narrower class would change
        values: the loader refuses it first."""
        typ = self.type(ref)
        problem = narrowing(typ.dtype, dtype)
        if problem:
            raise ShapeError(problem)
        if value_class(typ.dtype) == "bool" and value_class(dtype) != "bool":
            return self.emit("cast_float_t", [ref], {}, TensorType(typ.shape, dtype))
        return ref

    def view(self, ref: str, shape: tuple[int, ...]) -> str:
        return ref if self.type(ref).shape == tuple(shape) else self.emit("view", [ref], {"shape": tuple(shape)})

    def transpose(self, ref: str, i: int, j: int) -> str:
        return ref if i == j else self.emit("transpose", [ref], {"dim0": i, "dim1": j})


def rational(v: Any, what: str = "constant") -> Fraction:
    """The exact rational a number in a program stands for: the one reading of constants
    that every place a constant enters the prover uses (a `Scale` factor, a literal operand
    of mul/div, an `alpha`, a `full` fill taken as a factor, a rational attribute).

    Integers, `Fraction`s and strings ("1/3", "0.1": the number as written) are exact. A
    float is read by `float_rational`, not as its binary fraction: 0.3333333333333333
    stands for 1/3, 0.010416666666666666 (autograd's 2/192) for 1/96, 0.0625 for 1/16, 0.1
    for 1/10, an integral float for its integer.

    Why this is sound for refine's model: the programs run in floating point, the prover
    reasons over the reals, and a float literal in either program is the rounding of the
    real number its author meant, which refine cannot see. Reading a float as its binary
    fraction is one guess at that number; it makes a 1/3 written as a float on one side
    and a 1/3 made by a mean over 3 elements on the other two different reals, so equal
    programs false-alarm (`models/capture/accum_mlp.py` at a batch of 12 in 3
    micro-batches). The simplest rational rounding to the float is the guess that meets
    such constants, and it keeps what matters: it rounds back to the same float (so the numeric oracle, which
    runs the programs' own floats, runs exactly the constants the prover reasoned with),
    and distinct floats are distinct rationals (each lies in its own float's rounding
    interval), so two different literals never become one number (0.0104 is not 1/96).

    What it cannot do: meet a constant whose float arithmetic rounded on the way
    (0.1 / 3 computed in floats is not always the float nearest 1/30), one stored in a
    narrower dtype than float64 (a float32 1/3 is 0.3333333432674408, whose simplest
    rational is not 1/3), or a literal its author rounded by hand (0.0104 for 1/96).
    An infinity or NaN has no rational: refused."""
    if isinstance(v, bool):
        return Fraction(int(v))
    if isinstance(v, (int, Fraction, str)):
        return Fraction(v)
    v = float(v)
    if not math.isfinite(v):
        raise ShapeError(f"{what} {v} is not a finite number: refine scales by exact rationals")
    return float_rational(v)


@functools.lru_cache(maxsize=4096)
def float_rational(x: float) -> Fraction:
    """The rational a float stands for: x = m * 2^e with 1/2 <= |m| < 1 (exact), read as
    `simplest_rational(m) * 2^e`; an integral float is its integer.

    That is the simplest rational rounding to x whenever that one is a rational anyone
    writes (odd parts of numerator and denominator under 2^25: 1/3, 2/96, 0.1, 13/1250),
    and unlike the plain simplest rational it commutes with scaling by powers of two:
    halving a float is exact, so a rank that halves a literal (1/sqrt(128) / 2) must meet
    the sequential literal it halved, as the binary reading did (but for a scale that makes
    the float integral: c * 2^52 of an irrational-like c is read as an integer). It rounds
    back to x (the scaling is exact in the normal range; checked, else x's binary fraction)."""
    exact = Fraction(x)
    if exact.denominator == 1:
        return exact
    m, e = math.frexp(x)
    r = simplest_rational(m) * Fraction(2) ** e
    try:
        return r if float(r) == x else exact
    except OverflowError:
        return exact


@functools.lru_cache(maxsize=4096)
def simplest_rational(x: float) -> Fraction:
    """The rational of smallest denominator that rounds to the float `x` (`float(q) == x`).

    The candidates are the continued-fraction semiconvergents of x's exact value, in order
    of growing denominator: a rational of least denominator in x's rounding interval is a
    best approximation of x, and every best approximation is a semiconvergent. Within one
    level (p0 + k*p1)/(q0 + k*q1), k = 1..a, the semiconvergents approach x monotonically
    from one side, so the least k that rounds to x is found by bisection. The last
    convergent is x's binary fraction itself, so the search always ends."""
    exact = Fraction(x)
    if exact.denominator == 1:
        return exact
    sign, n, d = (-1 if exact < 0 else 1), abs(exact.numerator), exact.denominator
    ax = abs(x)
    p0, q0, p1, q1 = 0, 1, 1, 0  # the convergents before and at the current level
    while True:
        a = n // d
        if float(Fraction(p0 + a * p1, q0 + a * q1)) == ax:
            lo, hi = 1, a  # hi rounds to x; find the least k that does
            while lo < hi:
                k = (lo + hi) // 2
                if float(Fraction(p0 + k * p1, q0 + k * q1)) == ax:
                    hi = k
                else:
                    lo = k + 1
            return sign * Fraction(p0 + hi * p1, q0 + hi * q1)
        p0, q0, p1, q1 = p1, q1, p0 + a * p1, q0 + a * q1
        n, d = d, n - a * d


def held(value: Any, dtype: str) -> Any:
    """A number as a tensor of `dtype` holds it, as torch converts a fill: an integer dtype
    truncates toward zero, bool is `value != 0`, a floating one keeps it (real values)."""
    cls = value_class(dtype)
    if cls == "float":
        return value
    if cls == "bool":
        return float(value != 0)
    if not math.isfinite(value):
        raise ShapeError(f"a tensor of dtype {dtype} cannot hold {value}")
    return float(math.trunc(value))


def _frozen(v: Any) -> Any:
    if isinstance(v, dict):
        return tuple(sorted((k, _frozen(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_frozen(x) for x in v)
    if isinstance(v, float) and v != v:
        return "nan"  # NaN != NaN would defeat the lookup
    return v


def normalize_dim(d: int, ndim: int) -> int:
    if not -max(ndim, 1) <= d < max(ndim, 1):
        raise ShapeError(f"dim {d} is out of range for a {ndim}-d tensor")
    return d % max(ndim, 1)


def normalize_attrs(op: Op, attrs: dict[str, Any], ins: list[TensorType]) -> dict[str, Any]:
    """Fill defaults, normalise negative dims against the first tensor argument."""
    out = dict(attrs)
    ndim = ins[0].ndim if ins else 0
    for name, kind in op.attrs:
        optional = kind.endswith("?")
        kind = kind.rstrip("?")
        if name not in out:
            if optional:
                continue
            raise ShapeError(f"missing attribute {name!r}")
        v = out[name]
        if kind == "dim" and v is not None:
            out[name] = normalize_dim(int(v), ndim)
        elif kind == "dims" and v is not None:
            vs = [v] if isinstance(v, int) else v
            out[name] = tuple(normalize_dim(int(x), ndim) for x in vs)
        elif kind in ("ints", "shape") and v is not None:
            out[name] = tuple(x if isinstance(x, Sym) else int(x) for x in v)
        elif kind == "rational":
            out[name] = rational(v, name)
    return out


def lower(graph: Graph, registry: Registry) -> tuple[Graph, dict[str, str]]:
    """The core graph, and the map from each user tensor name to its core tensor name."""
    core = Graph(list(graph.inputs), [], [], graph.name)
    rename: dict[str, str] = {i.name: i.name for i in graph.inputs}
    memo: dict[Any, str] = {}
    for n in graph.nodes:
        op = registry.ops.get(n.op)
        if op is None:
            raise UnsupportedOp(f"op {n.op!r} (node {n.name!r}) has no rule family and no decomposition")
        args = [rename[a] if isinstance(a, str) else a for a in n.args]
        b = Builder(registry, core, origin=n.origin or n.name, source=n.source, memo=memo)
        ins = [core.type_of(a) for a in args if isinstance(a, str)]
        attrs = normalize_attrs(op, n.attrs, ins)
        if op.kind == "identity":
            # the input's value in the node's dtype (Builder.cast): never a bool taken as a
            # number unseen (a bool's + is an or), never a narrowing
            rename[n.name] = b.cast(args[0], n.type.dtype)  # type: ignore[arg-type]
            continue
        if op.decompose is not None:
            try:
                out = op.decompose(b, args, attrs, n.type)
            except ShapeError as e:  # name the node: the caller knows the file only
                raise ShapeError(f"node {n.name!r} ({n.op}): {e}") from None
            if core.type_of(out).shape != n.type.shape:
                raise ShapeError(f"{n.op} gives shape {list(core.type_of(out).shape)}, node says {list(n.type.shape)}")
            rename[n.name] = out
            continue
        if not op.core and op.kind != "collective":
            raise UnsupportedOp(f"op {n.op!r} (node {n.name!r}) is not a core op and has no decomposition")
        # the node keeps its name, unless lowering made that name up for an earlier node's
        # parts (a node "e.exp_t" after "e" = exp(...)): then it gets a fresh one, or its
        # users and the earlier node's would read one tensor
        rename[n.name] = b.emit(n.op, args, attrs, n.type, name=None if n.name in core.index() else n.name)
    core.outputs = [type(o)(o.name, rename[o.ref], o.role, o.of) for o in graph.outputs]
    return core, rename
