"""Hugging Face transformers models under their own tensor-parallel plan, made capturable.

transformers (5.x) applies a model's `tp_plan` (`config.base_model_tp_plan` plus the head's
`_tp_plan`, e.g. Llama: q/k/v/gate/up "colwise", o/down "rowwise", lm_head
"colwise_gather_output") with `transformers.distributed.tensor_parallel.
apply_tensor_parallelism(model, mesh)`: every planned parameter becomes a DTensor
`nn.Parameter` (colwise weight Shard(0), rowwise weight Shard(1), ...) and each planned
module's `forward` is wrapped to turn its input into a DTensor, redistribute it and turn the
output back into a local tensor. The collectives come from DTensor's redistributions
(functional all_reduce / all_gather), forward and backward.

refine traces a step with the parameters as plain graph inputs, so `tensor_parallel` below
turns each DTensor parameter back into a plain `nn.Parameter` holding the rank's local
shard, annotated with the placement transformers gave it (derived from the plan, not
guessed), and rebuilds the DTensor (`DTensor.from_local`) inside the module's forward, where
make_fx traces it like any other op. This is the only DTensor-specific glue here: one
parameter wrapper per planned module (`_LocalParams`), nothing else.

Use: `tensor_parallel(model, mesh, plan=None, axis=None)` inside the rank factory (`mesh` a
DeviceMesh made in the rank's fake process group); it applies the model's `tp_plan` (or `plan`)
and returns the model with local-shard parameters annotated from the plan. Parameters and
buffers outside the plan (embeddings, norms, rotary buffers) must be annotated Replicate by the
case; only the step's inputs are matched by name. Example: models/capture/hf_llama.py (a
1-layer LlamaForCausalLM, eager attention, its own causal-LM loss).

`with float64_reference():` (refine.frontends.capture.precision) keeps float64 tensors float64
through transformers' deliberate float32 upcasts (RMSNorm, softmax, rotary, loss), so capture's
float64 replay of the sequential graph compares like with like; the traced float32 run is
unchanged.

Nodes are reported at transformers' own lines (modeling_llama.py, tensor_parallel.py), not at
the one user line that calls the model. DTensor's caches are cleared before each rank (see
refine.frontends.capture.dtensor).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from refine.frontends.capture.annotate import partial, replicate, shard
from refine.frontends.capture.errors import CaptureError
from refine.frontends.capture.precision import float64_reference  # noqa: F401 (re-exported)
from refine.frontends.capture.trace import register_source_library


def _register_source() -> None:
    """Nodes traced in transformers' code are reported at its lines (modeling_llama.py:NNN),
    not at the one user line that calls the model."""
    import transformers

    register_source_library(transformers)


_register_source()


def _placement_annotation(param: torch.Tensor, placements: tuple[Any, ...], axis: str | None) -> None:
    """Annotate a local shard with its DTensor placement (one mesh axis: tensor parallel)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if len(placements) != 1:
        raise CaptureError(f"a DTensor parameter on a {len(placements)}-d mesh: refine.frontends.capture.hf handles a 1-d "
                           "tensor-parallel mesh")
    (p,) = placements
    if isinstance(p, Shard):
        shard(param, p.dim % param.ndim, axis)
    elif isinstance(p, Replicate):
        replicate(param, axis)
    elif isinstance(p, Partial):
        partial(param, "sum", axis)
    else:  # pragma: no cover - a placement transformers does not use for parameters
        raise CaptureError(f"DTensor placement {p} has no refine counterpart")


class _LocalParams:
    """A planned module's parameters as local shards, rebuilt as DTensors for its forward.

    Why: make_fx traces a function of plain tensors; refine's tracer passes the parameters
    in as fresh leaves (refine.frontends.capture.trace). Rebuilding the DTensor from the leaf inside
    the forward makes DTensor's own dispatch (sharding propagation, redistributions) part of
    the trace, and `from_local`'s backward hands the leaf its local gradient, placed like the
    parameter."""

    def __init__(self, module: nn.Module, mesh: Any, placements: dict[str, tuple[Any, ...]]) -> None:
        self.module, self.mesh, self.placements = module, mesh, placements

    @contextmanager
    def as_dtensors(self) -> Iterator[None]:
        from torch.distributed.tensor import DTensor

        params = self.module._parameters
        saved = {n: params[n] for n in self.placements}
        try:
            for n, pl in self.placements.items():
                local = saved[n]
                if local is not None and not isinstance(local, DTensor):
                    params[n] = DTensor.from_local(local, self.mesh, pl, run_check=False)  # type: ignore[assignment]
            yield
        finally:
            params.update(saved)

    def install(self) -> None:
        forward = self.module.forward  # transformers' TP forward (input/output redistribution)

        def local_params_forward(*args: Any, **kwargs: Any) -> Any:
            with self.as_dtensors():
                return forward(*args, **kwargs)

        self.module.forward = local_params_forward  # type: ignore[method-assign]


def fresh_dtensor_caches() -> None:
    """Empty DTensor's sharding-propagation and redistribution caches.

    Why: capture traces the ranks one after another in one process. A DeviceMesh compares
    equal to another rank's mesh of the same shape (equality ignores which rank holds it),
    so a cached propagation made while tracing rank 0 hands rank 1 output specs carrying
    rank 0's mesh object, whose coordinate is 0: rank 1 then takes rank 0's shard when
    DTensor splits a replicated tensor (seen in the backward of lm_head's gathered logits).
    Each rank must start with empty caches."""
    from torch.distributed.tensor import DTensor, _redistribute
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    prop = DTensor._op_dispatcher.sharding_propagator
    prop.propagate_op_sharding.cache_clear()
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:  # the C++ dispatch fast path's own cache
        clear_native()


def tensor_parallel(model: nn.Module, mesh: Any, plan: dict[str, str] | None = None, axis: str | None = None,
                    copy_model: bool = True) -> nn.Module:
    """`model` (a transformers PreTrainedModel) parallelized by transformers' own
    `apply_tensor_parallelism` over `mesh` with its tp_plan (or `plan`, the full plan keyed
    by module path as `model.tp_plan` gives it), with local-shard parameters annotated for
    capture. Call it inside the rank's process group (the rank factory of a Spec)."""
    from torch.distributed.tensor import DTensor
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    fresh_dtensor_caches()
    m = copy.deepcopy(model) if copy_model else model
    if plan is not None:
        m.tp_plan = dict(plan)  # type: ignore[assignment]
    elif not m.tp_plan:
        raise CaptureError(f"{type(model).__name__} has no tensor-parallel plan (tp_plan)")
    tied = _shared_parameters(m)
    apply_tensor_parallelism(m, mesh)
    if tied:
        # sharding a parameter replaces it per module, which unties tied weights (an embedding
        # and lm_head); transformers' from_pretrained ties them again after distributing
        m.tie_weights()  # type: ignore[operator]
        if _shared_parameters(m) != tied:
            raise CaptureError(f"{type(model).__name__}'s tied parameters {sorted(map(sorted, tied))} are not tied "
                               "after tensor parallelism (tie_weights)")
    locals_: dict[int, nn.Parameter] = {}  # one local leaf per (shared) DTensor parameter
    for module in m.modules():
        found: dict[str, tuple[Any, ...]] = {}
        for name, p in list(module.named_parameters(recurse=False)):
            if isinstance(p, DTensor):
                local = locals_.get(id(p))
                if local is None:
                    local = nn.Parameter(p.to_local().detach().clone(), requires_grad=p.requires_grad)
                    _placement_annotation(local, tuple(p.placements), axis)
                    locals_[id(p)] = local
                module._parameters[name] = local
                found[name] = tuple(p.placements)
            else:  # no plan entry: transformers keeps it whole on every rank
                replicate(p, axis)
        for b in module.buffers(recurse=False):
            replicate(b, axis)
        if found:
            _LocalParams(module, p.device_mesh, found).install()  # type: ignore[union-attr]
    return m


def _shared_parameters(model: nn.Module) -> set[frozenset[str]]:
    """The groups of parameter names that are one parameter (tied weights)."""
    names: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), set()).add(name)
    return {frozenset(g) for g in names.values() if len(g) > 1}
