"""torch's DistributedDataParallel as its users write it (`DDP(model)` in the rank factory,
`no_sync()` for gradient accumulation), captured without edits.

DDP synchronises gradients from its reducer: C++ hooks on the original parameters'
gradient accumulators. Capture traces fresh parameters, where those hooks never run, so
what the reducer does is written into the trace instead, by its documented semantics:

- the wrapped module is traced, its parameters and buffers named as the module names them
  (no `module.` prefix, as the sequential model names them);
- a forward run with gradient sync on (outside `no_sync()`) makes the next backward average
  every parameter's accumulated gradient over DDP's process group: divided by the group
  size and all-reduced, once per parameter, after its gradient is accumulated
  (`register_post_accumulate_grad_hook` on the traced parameter, which the trace follows);
  parameters in `parameters_to_ignore` are left alone;
- with `forward_sync_buffers` (`broadcast_buffers`, on by default) each forward first
  broadcasts the module's buffers from the group's first rank.

Refused, never guessed: a communication hook (`register_comm_hook` or a built-in one: the
reducer would run the user's reduction), mixed precision, and `find_unused_parameters=True`
(DDP then all-reduces zeros for a parameter this rank did not use; the trace would leave it
without a gradient). A DDP nested inside another module is refused by
refine.frontends.capture.trace as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from refine.frontends.capture.errors import CaptureError


class DDPSync:
    """What one DDP wrapper's reducer would do, for one traced step."""

    def __init__(self, wrapper: Any, where: str) -> None:
        self.wrapper = wrapper
        self.module: nn.Module = wrapper.module
        self.group = wrapper.process_group
        self.size = dist.get_world_size(self.group)
        self.ignored = set(getattr(wrapper, "parameters_to_ignore", ()) or ())
        self.sync = True
        _refuse(wrapper, where)

    @staticmethod
    def of(model: nn.Module, where: str) -> DDPSync | None:
        """The model's DDP emulation, or None when the model is not a DDP wrapper."""
        from torch.nn.parallel import DistributedDataParallel

        return DDPSync(model, where) if isinstance(model, DistributedDataParallel) else None

    def managed(self) -> set[str]:
        """Parameters whose gradient accumulators DDP's reducer holds (not refused for it)."""
        return {n for n, p in self.module.named_parameters() if p.requires_grad}

    def hook(self, leaves: dict[str, torch.Tensor]) -> None:
        """The reducer's averaging, on each traced parameter that DDP synchronises."""
        for name, leaf in leaves.items():
            if leaf.requires_grad and name not in self.ignored:
                leaf.register_post_accumulate_grad_hook(self._average)

    def _average(self, p: torch.Tensor) -> None:
        if self.sync:
            assert p.grad is not None
            p.grad.div_(self.size)
            dist.all_reduce(p.grad, group=self.group)

    @contextmanager
    def forwarding(self) -> Iterator[None]:
        """The wrapper's forward as DDP runs it: record whether this forward's backward
        synchronises, broadcast the buffers if DDP would, then the module's forward."""
        w = self.wrapper

        def forward(*args: Any, **kwargs: Any) -> Any:
            self.sync = bool(w.require_backward_grad_sync)
            if getattr(w, "forward_sync_buffers", False):
                src = dist.get_global_rank(self.group, 0)
                for b in self.module.buffers():
                    dist.broadcast(b, src=src, group=self.group)
            return self.module(*args, **kwargs)

        w.forward = forward  # an instance attribute: nn.Module.__call__ finds it first
        try:
            yield
        finally:
            del w.forward


def _refuse(w: Any, where: str) -> None:
    why = None
    if getattr(w, "_comm_hooks", None):
        why = "it has a communication hook (register_comm_hook): the reducer would run that reduction"
    elif getattr(w, "mixed_precision", None) is not None:
        why = "it runs with mixed precision"
    elif getattr(w, "find_unused_parameters", False):
        why = ("find_unused_parameters=True: DDP all-reduces zeros for a parameter this rank did not use, which "
               "the trace leaves without a gradient")
    else:
        logger = getattr(w, "logger", None)  # a built-in hook is named in DDP's logging data only
        hook = logger._get_ddp_logging_data().strs_map.get("comm_hook") if logger is not None else None
        if hook:
            why = f"it has the communication hook {hook}: the reducer would run that reduction"
    if why:
        raise CaptureError(f"{where}: the model is a DistributedDataParallel that capture cannot follow: {why}")
