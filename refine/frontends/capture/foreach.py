"""Foreach ops (`torch._foreach_*`) expanded at trace time into one aten op per tensor.

`clip_grad_norm_` (and fused optimizers) call list-valued aten ops: `_foreach_norm` returns a
list, `_foreach_mul_` mutates a list in place and returns nothing. Neither fits refine's
one-node-per-tensor graphs, and an in-place list op returns no tensor whose later readers
tracing could rewire, so the step's outputs would still name the tensors before the write.
These decompositions run inside `make_fx`, so each per-tensor op they call (`mul_`,
`linalg_vector_norm`) is traced like user code: an in-place `t.mul_(c)` gives `t`'s later
readers its result. A foreach op not listed here stays in the graph and is refused: the
converter knows no refine op for it, and `refine.frontends.capture.convert.check_mutations`
refuses any read of a tensor a list op wrote.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

aten = torch.ops.aten


def _pick(other: Any, i: int) -> Any:
    """The i-th operand of a List / ScalarList overload, or the shared one."""
    return other[i] if isinstance(other, (list, tuple)) else other


def _norm(tensors: Sequence[torch.Tensor], ord: Any = 2, dtype: torch.dtype | None = None) -> list[torch.Tensor]:  # noqa: A002
    return [aten.linalg_vector_norm.default(t, ord, None, False, dtype=dtype) for t in tensors]


def _binary(name: str, inplace: bool) -> Callable[..., Any]:
    """_foreach_<name>[_] over its overloads (Scalar, Tensor, List, ScalarList): the
    per-tensor aten op with the i-th or the shared operand; add/sub keep List's alpha."""
    method = getattr(torch.Tensor, name + ("_" if inplace else ""))

    def decompose(tensors: Sequence[torch.Tensor], other: Any, *, alpha: Any = 1) -> list[torch.Tensor] | None:
        kw = {"alpha": alpha} if alpha != 1 else {}
        out = [method(t, _pick(other, i), **kw) for i, t in enumerate(tensors)]
        return None if inplace else out

    return decompose


def _table() -> dict[Any, Callable[..., Any]]:
    table: dict[Any, Callable[..., Any]] = {aten._foreach_norm.Scalar: _norm}
    for name in ("mul", "div", "add", "sub"):
        for inplace in (False, True):
            packet = getattr(aten, f"_foreach_{name}{'_' if inplace else ''}")
            for overload in ("Scalar", "Tensor", "List", "ScalarList"):
                if overload in packet.overloads():
                    table[getattr(packet, overload)] = _binary(name, inplace)
    return table


FOREACH_DECOMPOSITIONS = _table()
