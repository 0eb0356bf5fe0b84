"""Constants: ranges (position ids) and aten's scalar/like constructors.

`arange_c(start, end, step)` is a clean constant like `full`: a slice of it is the range of
the sub-range, and two adjacent ranges concatenate to one. So a sequence-parallel rank that
builds its own positions `arange(r*T/n, (r+1)*T/n)` is seen as holding a piece of the
sequential `arange(0, T)`. `scalar_tensor` and `full_like` lower to `full` (the latter
keeps only its input's shape, never its values), with the fill as their dtype holds it
(`refine.ops.lower.held`: an integer dtype truncates it, bool is `!= 0`).
"""

from __future__ import annotations

from typing import Any

from refine.ir import sizes
from refine.ir.graph import Arg, TensorType, value_class
from refine.ir.lazy import torch
from refine.ir.term import Term
from refine.ops.lower import Builder
from refine.ops.registry import ArgSpec, Op, Rule, Sample, ShapeError, rewrite, rule


def _arange_len(start: Any, end: Any, step: int) -> Any:
    if type(step) is not int or step < 1:
        raise ShapeError(f"arange step must be a positive integer, got {step!r}")
    if not sizes.le(start, end):
        raise ShapeError(f"arange from {start} to {end}: end must be provably at least start")
    # ceil((end - start) / step), exactly as the egglog shape rule computes it
    return sizes.div(sizes.add(sizes.sub(end, start), step - 1), step)


def _arange_c_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    return TensorType((_arange_len(attrs["start"], attrs["end"], attrs["step"]),), "int64")


def _range_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    start, step = attrs.get("start"), attrs.get("step")
    return {"start": 0 if start is None else start, "end": attrs["end"], "step": 1 if step is None else step}


def _arange_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    a = _range_attrs(attrs)
    dtype = attrs.get("dtype") or "int64"
    if value_class(dtype) == "bool":
        raise ShapeError("arange of dtype bool: torch makes none (its integers are not bools)")
    return TensorType((_arange_len(a["start"], a["end"], a["step"]),), dtype)


def _arange(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    return b.emit("arange_c", [], _range_attrs(attrs), out)


def _ref_arange(start: int = 0, end: int = 0, step: int | None = 1, dtype: str | None = None) -> torch.Tensor:
    return torch.arange(start or 0, end, step or 1)


def _scalar_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    return TensorType((), attrs.get("dtype") or "float32")


def _scalar_tensor(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    return b.const(float(attrs["s"]), (), out.dtype)


def _full_like_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    return TensorType(x.shape, attrs.get("dtype") or x.dtype)


def _full_like(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    # only the input's shape matters: the constant does not read its values
    return b.const(float(attrs["fill_value"]), out.shape, out.dtype)


OPS = [
    Op("arange_c", 0, _arange_c_shape, (("start", "size"), ("end", "size"), ("step", "int")),
       ref=_ref_arange, core=True, clean=True, kind="clean",
       egglog_shape="(rule ((= e (arange_c s f st))) "
       "((set (shape e) (vec-of (d/ (d+ (d- f s) (dim (- st 1))) (dim st))))))",
       doc="the integers start, start + step, ... below end (step >= 1)"),
    Op("arange", 0, _arange_shape, (("start", "size?"), ("end", "size"), ("step", "int?"), ("dtype", "str?")),
       ref=_ref_arange, decompose=_arange, doc="aten.arange.start_step (start defaults to 0, step to 1)"),
    # attribute names as in the aten schemas
    Op("scalar_tensor", 0, _scalar_shape, (("s", "float"), ("dtype", "str?")),
       ref=lambda s, dtype=None: torch.tensor(float(s), dtype=torch.float64), decompose=_scalar_tensor,
       doc="a rank-0 constant"),
    Op("full_like", 1, _full_like_shape, (("fill_value", "float"), ("dtype", "str?"), ("memory_format", "str?")),
       ref=lambda x, fill_value, dtype=None, memory_format=None: torch.full(tuple(x.shape), float(fill_value),
                                                                            dtype=torch.float64),
       decompose=_full_like, doc="a constant of x's shape (x's values are not read)"),
]


# a comparison of a finite constant with itself: true for eq/le/ge, false for ne/lt/gt (NaN,
# unequal to itself, and infinities are left out by the finiteness conditions)
SELF_COMPARE = {"eq_t": 1.0, "le_t": 1.0, "ge_t": 1.0, "ne_t": 0.0, "lt_t": 0.0, "gt_t": 0.0}
FINITE = ("(<= v 1.0e308)", "(>= v -1.0e308)")


def RULES(reg: Any) -> list[Rule]:  # noqa: N802 - a rule file's export
    return [
        # a mask compared with the fill it was padded with (an ignore_index pad of the labels)
        # is constant there: counts over a padded target equal counts over the unpadded part
        *(rewrite(f"{op}-const-self", f"({op} (full v s) (full v s))", f"(full {value} s)", *FINITE)
          for op, value in SELF_COMPARE.items()),
        rewrite("rsum-zero", "(rsum (full v s) d)", "(full v (vec-set s d (dim 1)))", "(= v 0.0)"),
        rewrite("slice-arange", "(slice (arange_c s f st) d a z)",
                "(arange_c (d+ s (d* a (dim st))) (d+ s (d* z (dim st))) st)"),
        # [s, m) then [m, e) is [s, e) when the first range ends on a step
        rule("arange-adjacent", ["(= p (arange_c s m st))", "(= q (arange_c m e st))",
                                 "(d-divides (dim st) (d- m s))"],
             ["(union (arange_c s e st) (cat p q 0))"]),
    ]


# The soundness harness's seeds: ranges of a few elements, the end anywhere in the last step
def _arange(gen: Any, x: tuple[int, ...]) -> tuple[list[ArgSpec], tuple[Any, ...]]:
    r = gen.rng
    start, step, n = r.randint(0, 3), r.choice([1, 1, 2, 3]), r.randint(1, 5)
    return [], (start, start + (n - 1) * step + r.randint(1, step), step)


SAMPLES = {"arange_c": Sample(_arange)}


def SHARED_SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """Adjacent ranges (one step apart), concatenated; a constant compared with itself; a sum
    of zeros."""
    r = gen.rng
    out: list[Term] = []
    for _ in range(gen.instances):
        st = r.choice([1, 2])
        s0, n0, n1 = r.randint(0, 2), r.randint(1, 3), r.randint(1, 3)
        a1 = Term("arange_c", (), (s0, s0 + n0 * st, st))
        a2 = Term("arange_c", (), (s0 + n0 * st, s0 + (n0 + n1) * st, st))
        out.append(Term("cat", (a1, a2), (0,)))
        v, shape = r.choice([-100.0, 0.0, 1.5]), (2, r.randint(1, 3))
        out += [Term(op, (Term("full", (), (v, shape)), Term("full", (), (v, shape)))) for op in SELF_COMPARE]
        out.append(Term("rsum", (Term("full", (), (0.0, shape)),), (r.randrange(2),)))
    return out
