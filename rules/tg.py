"""torchgraph's tensor-logging hooks (the `tg` namespace of the graphs GraphGuard/Entangle
captured): they record a tensor under a name and hand it on unchanged.

Evidence from the corpus (bug_missing_layernorm_allreduce): `tg.log_tensor(t, name)` is
called on the batch inputs right after their dtype cast (names "tokens", "labels",
"loss_mask", "attention_mask", "position_ids"); its result has t's shape and dtype and its
only user is the broadcast that distributes the batch, so it is the identity on t's value.
`tg.inplace_log_tensor(t, s)` logs a parameter by name and comes wrapped in
`auto_functionalized_v2(op, s=name, _t_base_index=0, _all_bases=[base])`; its getitem 1 is
the base after the call, i.e. the base unchanged: an importer maps it to `tg_log_tensor(base)`.
"""

from __future__ import annotations

from typing import Any

from refine.ir.graph import TensorType
from refine.ops.registry import Op


def _same(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    return ins[0]


OPS = [
    Op("tg_log_tensor", 1, _same, (("name", "str?"),), ref=lambda x, **_: x, kind="identity",
       doc="logs x under name; its value is x"),
]
RULES: list = []
