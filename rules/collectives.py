"""Collectives, lowered to the relation language over the group's rank tensors.

A collective node names its process group as an explicit list of ranks. Matching the k-th
collective of a group on every member (see refine.relate.program) gives each member's inputs;
`lower` then says what the member's output equals.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from refine.ir import sizes
from refine.ir.graph import TensorType
from refine.ir.lazy import torch
from refine.ir.term import Term, cat, nary, scale
from refine.ops.registry import Op, ShapeError

REDUCE_OPS = ("sum", "avg", "max")


def _group(attrs: dict[str, Any]) -> tuple[int, ...]:
    g = tuple(attrs.get("group") or ())
    if not g or len(set(g)) != len(g):
        raise ShapeError(f"group must be a non-empty list of distinct ranks, got {list(g)}")
    return g


def _reduce_op(attrs: dict[str, Any]) -> str:
    op = attrs.get("reduce_op", "sum")
    if op not in REDUCE_OPS:
        raise ShapeError(f"reduce_op {op!r} is not one of {list(REDUCE_OPS)}")
    return op


def _reduce(terms: list[Term], op: str) -> Term:
    if op == "max":
        return nary("Max", terms)
    s = nary("Sum", terms)
    return scale(s, Fraction(1, len(terms))) if op == "avg" else s


def _all_reduce_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    _group(attrs), _reduce_op(attrs)
    return ins[0]


def _all_gather_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    n, d = len(_group(attrs)), attrs["dim"]
    s = list(x.shape)
    s[d] *= n
    return TensorType(tuple(s), x.dtype)


def _reduce_scatter_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    n, d = len(_group(attrs)), attrs["dim"]
    _reduce_op(attrs)
    if not sizes.divides(n, x.shape[d]):
        raise ShapeError(f"reduce_scatter of dim {d} (size {x.shape[d]}) over {n} ranks")
    s = list(x.shape)
    s[d] = sizes.exact_div(s[d], n)
    return TensorType(tuple(s), x.dtype)


def _all_to_all_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    n = len(_group(attrs))
    sd, cd = attrs["split_dim"], attrs["concat_dim"]
    if not sizes.divides(n, x.shape[sd]):
        raise ShapeError(f"all_to_all splits dim {sd} (size {x.shape[sd]}) over {n} ranks")
    s = list(x.shape)
    s[sd] = sizes.exact_div(s[sd], n)
    s[cd] *= n
    return TensorType(tuple(s), x.dtype)


def _broadcast_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    if attrs["src"] not in _group(attrs):
        raise ShapeError(f"broadcast src {attrs['src']} is not in group {list(attrs['group'])}")
    return ins[0]


def _recv_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    return TensorType(tuple(attrs["shape"]), attrs.get("dtype") or "float32")


def _lower_all_gather(xs: list[Term], i: int, attrs: dict[str, Any]) -> Term:
    return cat(xs, attrs["dim"])


def _lower_reduce_scatter(xs: list[Term], i: int, attrs: dict[str, Any], size: Any) -> Term:
    c = sizes.exact_div(size, len(xs))
    return Term("slice", (_reduce(xs, attrs.get("reduce_op", "sum")),), (attrs["dim"], i * c, (i + 1) * c))


def _lower_all_to_all(xs: list[Term], i: int, attrs: dict[str, Any], size: Any) -> Term:
    c = sizes.exact_div(size, len(xs))
    sd = attrs["split_dim"]
    return cat([Term("slice", (x,), (sd, i * c, (i + 1) * c)) for x in xs], attrs["concat_dim"])


def _ref_unavailable(*args: Any, **kw: Any) -> Any:
    raise NotImplementedError("collectives are evaluated across ranks by refine.ops.interp")


GROUP = ("group", "ints")
OPS = [
    Op("all_reduce", 1, _all_reduce_shape, (("reduce_op", "str?"), GROUP), ref=_ref_unavailable,
       kind="collective", lower=lambda xs, i, a, size: _reduce(xs, a.get("reduce_op", "sum"))),
    Op("all_gather", 1, _all_gather_shape, (("dim", "dim"), GROUP), ref=_ref_unavailable,
       kind="collective", lower=lambda xs, i, a, size: _lower_all_gather(xs, i, a)),
    Op("reduce_scatter", 1, _reduce_scatter_shape, (("dim", "dim"), ("reduce_op", "str?"), GROUP),
       ref=_ref_unavailable, kind="collective", lower=_lower_reduce_scatter),
    Op("all_to_all", 1, _all_to_all_shape, (("split_dim", "dim"), ("concat_dim", "dim"), GROUP),
       ref=_ref_unavailable, kind="collective", lower=_lower_all_to_all),
    Op("broadcast", 1, _broadcast_shape, (("src", "int"), GROUP), ref=_ref_unavailable,
       kind="collective", lower=lambda xs, i, a, size: xs[list(a["group"]).index(a["src"])]),
    # `batch`: consecutive sends/recvs of a rank with the same value are posted together
    # (batch_isend_irecv, an NCCL group) and complete together (refine.ops.schedule)
    Op("send", 1, lambda ins, a: ins[0], (("peer", "int"), ("batch", "int?")), ref=_ref_unavailable,
       kind="collective"),
    Op("recv", 0, _recv_shape, (("peer", "int"), ("shape", "shape"), ("dtype", "str?"), ("batch", "int?")),
       ref=_ref_unavailable, kind="collective"),
]
RULES: list = []
_ = torch
