"""torch's FSDP2 (`torch.distributed.fsdp.fully_shard`) as its users write it, captured without
edits: per-layer `fully_shard`, grouped `fully_shard([a, b])`, HSDP (a 2-D replicate x shard
mesh), `fully_shard` over tensor-parallel DTensor parameters (a dp x tp mesh), gradient
accumulation with `set_requires_gradient_sync`.

Why glue and not FSDP's own hooks: make_fx does follow FSDP2's hooks (its all-gathers in the
forward pre-hooks and again before backward, its reduce-scatters in post-backward), but the
result is not a graph refine can read soundly: the sharded data is a constant outside the
trace (not the traced parameters), the all-gather output is written in place through views
into buffers (`fsdp::all_gather_copy_in`, `fsdp::split_with_sizes_copy`, `fsdp::chunk_cat`)
that earlier views are read through again after re-gathering, and the storage resizes that
free and re-allocate those buffers are invisible to the trace. So what FSDP does is written
into the trace here, by its documented semantics, reading every setting that changes the
numbers from FSDP's own state at the moment FSDP would read it:

- each FSDP parameter is traced as its padded local shard (FSDP's `_sharded_param_data`:
  dim 0 cut in `ceil(n / world)` rows per rank, the last ranks padded with zeros); its
  relation states that the sequential parameter is the first `n` rows of the shards' concat
  along the FSDP mesh axis, composed with the parameter's own tensor-parallel placements
  (refine.frontends.capture.annotate's `padded`);
- the first forward of any module of an FSDP group all-gathers the group's parameters
  (`all_gather_tensor` over the shard group) into fresh leaves that the modules hold while
  the step runs (FSDP's unsharded parameters; over a TP mesh, the DTensor FSDP rebuilds);
  autograd accumulates their gradients across micro-batches as it does FSDP's;
- after each backward reaches a gathered parameter (a post-accumulate-grad hook), when its
  group's `reduce_grads` is on (`set_requires_gradient_sync`), the accumulated gradient is
  redistributed to the parameter's TP placements (as FSDP does), cast to the reduce dtype,
  padded, reduce-scattered over the shard group with FSDP's own divide factors and reduce op
  (torch's `_get_gradient_divide_factors`: AVG, SUM with a post-divide, or a pre-multiplied
  SUM for `set_gradient_divide_factor`), all-reduced over the replicate group for HSDP, cast
  back, and added to the shard's `.grad`; with sync off the gradient stays on the gathered
  parameter, so a step that never syncs it leaves the shard without it, as FSDP does.

Refused by name (not modelled; fail closed): mixed-precision compute (`param_dtype`,
`output_dtype`), CPU offload, a shard placement other than Shard(0), all-gather extensions,
SPMD meshes (`dp_mesh_dims`), custom all-gather / reduce-scatter comms, an all-reduce hook,
`set_requires_all_reduce(False)`, `reduce_scatter_unused_params`, a separate reduce-scatter
process group, DDP-mode (replicate-only) meshes.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from refine.frontends.capture.annotate import ATTR, Annotation
from refine.frontends.capture.errors import CaptureError

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _states(model: nn.Module) -> list[tuple[str, Any]]:
    """(path, FSDPState) of every fully_shard call in the model, each once, in module order."""
    contract = sys.modules.get("torch.distributed._composable.contract")
    if contract is None:
        return []
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for path, m in model.named_modules():
        registry = contract._get_registry(m)
        if registry and "fully_shard" in registry:
            from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

            state = _get_module_fsdp_state(m)
            if state is not None and id(state) not in seen:
                seen.add(id(state))
                found.append((path, state))
    return found


@dataclass
class _Param:
    """One FSDP parameter: its qualified name, FSDP's FSDPParam, its group, its leaves."""

    name: str
    fp: Any
    group: Any
    shard: torch.Tensor | None = None  # the traced padded shard (a leaf; its .grad is the output)
    full: torch.Tensor | None = None  # the gathered parameter the modules hold in this step
    rows: int = 0  # dim 0 of the (TP-local) tensor FSDP shards
    version: int = 0  # the shard's version when the step starts: an update within it is refused


@dataclass
class FSDPSync:
    """What FSDP2 would do, for one traced step of one model."""

    model: nn.Module
    where: str
    params: dict[str, _Param] = field(default_factory=dict)
    states: list[tuple[str, Any]] = field(default_factory=list)

    @staticmethod
    def of(model: nn.Module, where: str) -> FSDPSync | None:
        """The model's FSDP2 emulation, or None when no module of it is fully_shard-ed."""
        states = _states(model)
        if not states:
            return None
        sync = FSDPSync(model, where, states=states)
        by_obj = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        for path, state in states:
            for group in state._fsdp_param_groups:
                sync._refuse_group(path, group)
                for fp in group.fsdp_params:
                    name = by_obj.get(id(fp.sharded_param))
                    if name is None:
                        raise CaptureError(f"{where}: an FSDP parameter of module {path or 'the model'!r} is not a "
                                           "parameter of the model as FSDP registered it (was the model's parameter "
                                           "replaced after fully_shard?)")
                    sync._refuse_param(name, fp)
                    if fp.mesh_info is not group.mesh_info:
                        raise CaptureError(f"{where}: FSDP parameter {name!r} cannot be captured: it is sharded over "
                                           "a mesh of its own (shard_placement_fn's mesh_info)")
                    sync.params[name] = _Param(name, fp, group, rows=int(fp._orig_size[0]))
        return sync

    def _refuse_group(self, path: str, g: Any) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultAllGather,
            DefaultReduceScatter,
        )
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

        at = f"module {path!r}" if path else "the model"
        mp = g.mp_policy
        why = None
        if not isinstance(g.mesh_info, FSDPMeshInfo):
            why = "its mesh only replicates (DDP mode of fully_shard / replicate)"
        elif g.mesh_info.is_spmd_mesh:
            why = "it shards over an SPMD mesh (dp_mesh_dims)"
        elif getattr(g.mesh_info, "reduce_scatter_process_group", None) is not None:
            why = "it reduce-scatters over a separate process group"
        elif mp.param_dtype is not None and any(mp.param_dtype != fp.sharded_param.dtype for fp in g.fsdp_params):
            why = f"mixed precision: it computes in param_dtype={mp.param_dtype}"
        elif mp.output_dtype is not None:
            why = f"mixed precision: it casts outputs to output_dtype={mp.output_dtype}"
        elif isinstance(g.offload_policy, CPUOffloadPolicy):
            why = "CPU offload (offload_policy=CPUOffloadPolicy())"
        elif type(g._all_gather_comm) is not DefaultAllGather:
            why = f"a custom all-gather ({type(g._all_gather_comm).__name__})"
        elif type(g._reduce_scatter_comm) is not DefaultReduceScatter:
            why = f"a custom reduce-scatter ({type(g._reduce_scatter_comm).__name__})"
        if why:
            raise CaptureError(f"{self.where}: {at} is fully_shard-ed with a setting capture does not model: {why}")

    def _refuse_param(self, name: str, fp: Any) -> None:
        why = None
        if fp.fsdp_placement.dim != 0:
            why = f"it is sharded on dim {fp.fsdp_placement.dim} (shard_placement_fn); capture models Shard(0)"
        elif hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather"):
            why = "its tensor has FSDP all-gather extensions (fsdp_pre_all_gather)"
        elif getattr(fp.sharded_param, "_backward_hooks", None) or \
                getattr(fp.sharded_param, "_post_accumulate_grad_hooks", None):
            why = "it has gradient hooks (FSDP runs post-accumulate ones after its reduce-scatter; not modelled)"
        elif fp.sharded_state.name != "SHARDED":
            why = f"it is {fp.sharded_state.name} when the step starts (capture starts from sharded parameters)"
        if why:
            raise CaptureError(f"{self.where}: FSDP parameter {name!r} cannot be captured: {why}")

    def _refuse_at_reduce(self, p: _Param) -> None:
        g = p.group
        why = None
        if not g.all_reduce_grads:
            why = "set_requires_all_reduce(False) (HSDP keeps a partial reduction capture does not model)"
        elif g.reduce_scatter_unused_params:
            why = "reduce_scatter_unused_params"
        elif g._all_reduce_hook is not None:
            why = "an all-reduce hook (set_all_reduce_hook)"
        if why:
            raise CaptureError(f"{self.where}: FSDP parameter {p.name!r} is reduced with a setting capture does not "
                               f"model: {why}")

    # ------------------------------------------------------------------ the traced inputs

    def managed(self) -> set[str]:
        return set(self.params)

    def inputs(self) -> dict[str, torch.Tensor]:
        """Each FSDP parameter as the trace takes it: its padded local shard, annotated."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self.params.items():
            fp = p.fp
            padded = fp._sharded_param_data.view(fp.padded_sharded_param_size).detach()
            padded.requires_grad_(fp.sharded_param.requires_grad)
            setattr(padded, ATTR, self._annotation(p))
            out[name] = padded
        return out

    def _annotation(self, p: _Param) -> Annotation:
        from refine.frontends.capture.dtensor import _axes, annotation

        fp, info = p.fp, p.group.mesh_info
        what = f"FSDP parameter {p.name!r}"
        axes = _axes(info.mesh, what)
        shard_axis = axes[info.shard_mesh_dim]
        placements: list[tuple[str | None, str]] = []
        groups: list[tuple[str | None, tuple[int, ...]]] = [
            (shard_axis, tuple(dist.get_process_group_ranks(info.shard_process_group)))]
        if getattr(info, "replicate_mesh_dim", None) is not None:  # HSDP
            rep = axes[info.replicate_mesh_dim]
            placements.append((rep, "Replicate"))
            groups.append((rep, tuple(dist.get_process_group_ranks(info.replicate_process_group))))
        if fp._unsharded_dtensor_spec is not None:  # over tensor-parallel DTensors
            spec = fp._unsharded_dtensor_spec
            tp = annotation(spec.placements, spec.mesh, what)
            if any(p_.startswith("Partial") for _, p_ in tp.placements):
                raise CaptureError(f"{what} is a Partial DTensor: FSDP shards parameters held whole or sharded")
            placements += tp.placements
            groups += tp.groups
        return Annotation(tuple(placements), groups=tuple(groups),
                          padded=(shard_axis, p.rows, int(fp.padded_sharded_param_size[0])))

    def leaf(self, name: str, shard: torch.Tensor) -> None:
        """Record the traced leaf standing for `name`'s padded shard. The modules hold it
        outside their forward, where FSDP holds its sharded DTensor: a gradient reaching it
        through autograd means the step computed with it there, which is not modelled."""
        p = self.params[name]
        p.shard, p.full, p.version = shard, None, shard._version
        if shard.requires_grad:
            shard.register_hook(lambda g, name=name: self._used_outside(name))

    def _used_outside(self, name: str) -> None:
        raise CaptureError(f"{self.where}: FSDP parameter {name!r} is used outside the forward of its fully_shard "
                           "module (where FSDP holds it as a sharded DTensor), which capture does not model")

    # ------------------------------------------------------------------ forward and backward

    def _gather(self, p: _Param) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        fp = p.fp
        assert p.shard is not None
        full = funcol.all_gather_tensor(p.shard.detach(), 0, fp.mesh_info.shard_process_group)
        full = full.narrow(0, 0, p.rows).reshape(fp._orig_size)
        if fp._unsharded_dtensor_spec is not None:
            from torch.distributed.tensor import DTensor

            spec = fp._unsharded_dtensor_spec
            full = DTensor.from_local(full, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                                      stride=spec.stride)
        leaf = full.detach().requires_grad_(fp.sharded_param.requires_grad)
        if leaf.requires_grad:
            leaf.register_post_accumulate_grad_hook(lambda t, p=p: self._reduce(p, t))
        return leaf

    def _unshard(self, group: Any) -> None:
        """Gather the group's parameters once per step (FSDP re-gathers the same values: the
        parameters do not change within a step, which `forwarding` checks) and let the
        modules hold them."""
        from torch.distributed.fsdp._fully_shard._fsdp_param import unsafe_setattr_param

        for p in self.params.values():
            if p.group is group:
                if p.full is None:
                    p.full = self._gather(p)
                info = p.fp._module_info
                unsafe_setattr_param(info.module, info.param_name, p.full)
                for m, n in zip(info.shared_modules, info.shared_param_names, strict=True):
                    unsafe_setattr_param(m, n, p.full)

    def _reshard(self, module: nn.Module, group: Any) -> None:
        """After a module's forward: the group's parameters it owns are its shards again, as
        FSDP reshards every group but the root's (backward keeps the gathered leaves)."""
        from torch.distributed.fsdp._fully_shard._fsdp_param import unsafe_setattr_param

        inside = {id(m) for m in module.modules()}
        for p in self.params.values():
            info = p.fp._module_info
            if p.group is group and id(info.module) in inside and p.shard is not None:
                unsafe_setattr_param(info.module, info.param_name, p.shard)
                for m, n in zip(info.shared_modules, info.shared_param_names, strict=True):
                    unsafe_setattr_param(m, n, p.shard)

    def _reduce(self, p: _Param, full: torch.Tensor) -> None:
        import torch.distributed._functional_collectives as funcol
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            _get_gradient_divide_factors,
        )

        g = p.group
        if not g.reduce_grads or full.grad is None:  # set_requires_gradient_sync(False): it stays here
            return
        self._refuse_at_reduce(p)
        fp, info = p.fp, g.mesh_info
        grad = full.grad
        full.grad = None
        if fp._unsharded_dtensor_spec is not None:  # FSDP reduces the TP placement's local gradient
            want = fp._unsharded_dtensor_spec.placements
            if tuple(grad.placements) != tuple(want):
                grad = grad.redistribute(placements=want)
            grad = grad.to_local()
        orig = grad.dtype
        mp = g.mp_policy
        reduce_dtype = mp.reduce_dtype if mp.reduce_dtype not in (None, orig) else None
        if reduce_dtype is not None:
            grad = grad.to(reduce_dtype)
        world = info.shard_mesh_size
        replicate = info.replicate_process_group if getattr(info, "replicate_mesh_dim", None) is not None else None
        pre, post, rs_op, ar_op = _get_gradient_divide_factors(
            info.shard_process_group, replicate, grad.dtype, fp.device.type, g.gradient_divide_factor,
            g.force_sum_reduction_for_comms)
        padded = int(fp.padded_sharded_param_size[0]) * world
        if padded != grad.shape[0]:
            grad = torch.cat([grad, grad.new_zeros((padded - grad.shape[0], *grad.shape[1:]))])
        if pre is not None and pre != 1:
            grad = grad / pre
        if world > 1:
            op = _op_name(rs_op)
            if op == "premul_sum":  # ReduceOp.PREMUL_SUM(1 / factor): the factor set by the user
                grad = grad * (1.0 / g.gradient_divide_factor)
                op = "sum"
            out = funcol.reduce_scatter_tensor(grad, op, 0, info.shard_process_group)
        else:  # FSDP over one rank copies, divided by the user's factor if one is set
            out = grad / g.gradient_divide_factor if g.gradient_divide_factor is not None else grad
        if replicate is not None:
            out = funcol.all_reduce(out, _op_name(ar_op), replicate)
        if post is not None and post != 1:
            out = out / post
        out = out.to(orig)
        shard = p.shard
        assert shard is not None
        shard.grad = out if shard.grad is None else shard.grad + out

    @contextmanager
    def forwarding(self) -> Iterator[None]:
        """While the step runs: FSDP's own forward hooks are set aside and each module of an
        FSDP group gathers the group's parameters before its first forward."""
        saved: list[tuple[nn.Module, dict[str, dict[Any, Any]]]] = []
        try:
            for m in self.model.modules():
                dicts = {d: dict(getattr(m, d)) for d in _HOOK_DICTS}
                saved.append((m, dicts))
                for k, fn in list(m._forward_pre_hooks.items()) + list(m._forward_hooks.items()):
                    if _is_fsdp_hook(fn):
                        for d in _HOOK_DICTS:
                            getattr(m, d).pop(k, None)
            for _, state in self.states:
                root = any(m is self.model for m in state._modules)
                for group in state._fsdp_param_groups:
                    for m in group.modules:
                        m.register_forward_pre_hook(lambda *_, group=group: self._unshard(group), prepend=True)
                        if not root:
                            m.register_forward_hook(lambda m, *_, group=group: self._reshard(m, group))
            yield
            for p in self.params.values():
                if p.shard is not None and p.shard._version != p.version:
                    raise CaptureError(f"{self.where}: FSDP parameter {p.name!r} is updated in place within the step "
                                       "(an optimizer step): FSDP would gather the new values for a later forward, "
                                       "which capture does not model")
        finally:
            for m, dicts in saved:
                for d, content in dicts.items():
                    getattr(m, d).clear()
                    getattr(m, d).update(content)
            for p in self.params.values():  # the modules hold FSDP's sharded parameters again
                from torch.distributed.fsdp._fully_shard._fsdp_param import unsafe_setattr_param

                info = p.fp._module_info
                unsafe_setattr_param(info.module, info.param_name, p.fp.sharded_param)
                for m, n in zip(info.shared_modules, info.shared_param_names, strict=True):
                    unsafe_setattr_param(m, n, p.fp.sharded_param)
                p.full = p.shard = None


def _op_name(op: Any) -> str:
    if op == dist.ReduceOp.AVG:
        return "avg"
    if op == dist.ReduceOp.SUM:
        return "sum"
    return "premul_sum"


def _is_fsdp_hook(fn: Any) -> bool:
    """Whether a module hook is one of FSDP2's (a bound FSDPState method, possibly wrapped)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    for _ in range(8):
        if isinstance(getattr(fn, "__self__", None), FSDPState):
            return True
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return False
    return False
