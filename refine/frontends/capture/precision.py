"""Float64 reference runs through code that casts to float32 on purpose.

Capture replays the captured sequential graph against the step run eagerly in float64
(refine.frontends.capture.case). Model libraries cast to float32 in places whatever the
model's dtype; `float64_reference()` keeps those casts from rounding the float64 run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree


class _KeepFloat64(TorchFunctionMode):
    """Float casts and `dtype=` arguments that would take a float64 tensor to another
    floating dtype keep it float64."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if any(t.dtype == torch.float64 for t in tensors):
            if func in _DOWNCASTS and args and args[0].dtype == torch.float64:
                return args[0]

            def keep(v: Any) -> Any:
                return torch.float64 if isinstance(v, torch.dtype) and v.is_floating_point else v

            args = tuple(keep(a) for a in args)
            if "dtype" in kwargs:
                kwargs["dtype"] = keep(kwargs["dtype"])
        return func(*args, **kwargs)


_DOWNCASTS = (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16)


@contextmanager
def float64_reference() -> Iterator[None]:
    """Inside it, a float64 tensor stays float64 through float casts (`.float()`,
    `.to(torch.float32)`, `softmax(..., dtype=torch.float32)`, ...). No effect on float32
    runs (the traced one).

    Why: model libraries upcast to float32 on purpose in places (transformers: RMSNorm's
    variance, eager attention's softmax, the rotary angles, the loss's logits; torchtitan: the
    cross-entropy's logits), whatever the model's dtype.
    refine replays the captured sequential graph against the step run eagerly in float64
    (refine.frontends.capture.case) and treats float casts as identities (real-valued semantics), so
    those float32 roundings (~1e-7 relative) fail that strict replay although the
    translation is exact. A step wrapped in this context runs the float64 replay with the
    same real-valued formulas in float64 throughout."""
    with _KeepFloat64():
        yield
