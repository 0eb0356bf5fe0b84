"""A rule family for `cumprod` (running product along a dim): the worked example of
rules/README.md.

The op is core (an egglog constructor), so refine needs rules for how it meets the relation
language. A running product along dim d2 treats every other dim independently, so a concat or a
slice along another dim passes through it. Along d2 itself it does not (the second block
needs the first block's product), and no rule claims it: refine then reports the node.
"""

from __future__ import annotations

from typing import Any

import torch

from refine.ir.graph import TensorType
from refine.ops.registry import Op, ShapeError, rewrite


def _shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    if not 0 <= attrs["dim"] < x.ndim:
        raise ShapeError(f"cumprod over dim {attrs['dim']} of {list(x.shape)}")
    return x


OPS = [
    Op("cumprod", 1, _shape, (("dim", "dim"),), ref=lambda x, dim: torch.cumprod(x, dim), core=True,
       egglog_shape="(rule ((= e (cumprod x d)) (= s (shape x))) ((set (shape e) s)))",
       doc="running product along dim"),
]

RULES = [
    rewrite("cumprod-over-cat", "(cumprod (cat a b d) d2)", "(cat (cumprod a d2) (cumprod b d2) d)", "(!= d d2)"),
    rewrite("slice-into-cumprod", "(slice (cumprod x d2) d s e)", "(cumprod (slice x d s e) d2)", "(!= d d2)"),
]
