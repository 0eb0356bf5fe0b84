"""DTensor (torch.distributed.tensor) support for capture: relations derived from placements.

Code parallelized with `parallelize_module` (ColwiseParallel, RowwiseParallel,
SequenceParallel, ...) holds its parameters as DTensors.

Recipe: the rank factory builds a DeviceMesh inside the rank's fake process group
(`init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))`, or `(dp, tp)` with names),
deep-copies the sequential model and calls `parallelize_module`; the Spec's `mesh` names the
same axes in the same order. Plain tensors (an unparallelized LayerNorm, the batch) need
`capture.replicate(...)` / `shard(...)`. A DTensor loss must be Replicate.

    refine capture models/capture/dtensor_mlp.py:make_case --out case/

Capture handles DTensors so:

- **tracing** (`Locals`, used by refine.frontends.capture.trace): make_fx traces plain tensors,
  so the traced function takes each DTensor's *local* tensor and rebuilds the DTensor inside
  with `DTensor.from_local` (same mesh, placements, global shape and stride; no communication).
  Parameters are rebuilt as DTensor leaves, as the program holds them, so their `.grad` is
  whatever DTensor the program's autograd produces; the traced function returns its local
  tensor and `Locals.grad_annotations` records its placements. DTensor redistributions appear
  as `_c10d_functional` collectives + `wait_tensor`.
- **relations** (`derive`, registered in refine.frontends.capture.annotate.DERIVERS): a
  DTensor's placements, per DeviceMesh dim, become the Annotation: Shard(d) -> Shard(d),
  Replicate -> Replicate, Partial(sum|max) -> Partial(sum|max), on the refine mesh axis named
  like the mesh dim. These are the program's own declarations, not guesses. The annotation also
  carries the global ranks along each mesh dim through this rank, which
  refine.frontends.capture.case compares with the Spec's mesh, so a DeviceMesh laid out
  differently from the Spec (another axis order, a non-row-major mesh) is an error, not a wrong
  relation.
- **gradient expectations**: the gradient of a DTensor parameter is expected placed as the
  DTensor autograd produced it. Usually that is the parameter's own placement (a
  ColwiseParallel weight's gradient is Shard(0)); where it is Partial (SequenceParallel
  LayerNorm weights: each rank holds the sum over its tokens), the sequential gradient must
  be the sum of the ranks' local gradients, which is what that DTensor means (the optimizer
  step reduces it when it meets the Replicate parameter).

- **values** (`local_distribution`, around each rank factory): `distribute_tensor` (which
  `parallelize_module` calls) scatters or broadcasts rank 0's data by default; the fake
  process group communicates nothing, so a rank's shard would hold uninitialised memory.
  While a rank is built, DTensor splits each rank's own full tensor locally instead
  (`src_data_rank=None`), which is what the scatter gives when every rank holds the same full
  tensor (one checkpoint, one seed); the values are then checked against the sequential ones.

DTensor's sharding-propagation caches are cleared before each rank: ranks are traced one
after another in one process, and meshes of different ranks compare equal, so a cached plan
would carry rank 0's coordinate into rank 1's trace.

Refused (fail closed): _StridedShard and other placements refine has no counterpart for,
Partial(avg) and other reduce ops, meshes without dim names on more than one dim. Not
supported: uneven shards (refine's Shard takes equal pieces); `loss_parallel` and async TP
are not exercised.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from refine.frontends.capture.annotate import DERIVERS, Annotation
from refine.frontends.capture.errors import CaptureError


def _dtensor_class() -> type | None:
    # a DTensor exists only once torch.distributed.tensor is imported: never import it here
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def is_dtensor(t: Any) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def fresh_caches() -> None:
    """Forget DTensor's process-wide caches. Ranks are traced one after another in one process
    and their DeviceMeshes are equal by value (same ranks and dim names), so a sharding or
    redistribution plan cached while tracing rank 0 would hand rank 1 rank 0's mesh, and with
    it rank 0's coordinate (which shard is "mine"): call this before each rank."""
    if sys.modules.get("torch.distributed.tensor") is None:
        return
    from torch.distributed.tensor import _collective_utils, _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
    for cached in (getattr(_redistribute, "_gen_transform_infos", None),
                   getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None)):
        clear = getattr(cached, "cache_clear", None)
        if clear is not None:
            clear()


@contextmanager
def local_distribution() -> Iterator[None]:
    """While a rank is built: DTensor distributes each rank's own tensor without communication
    (the fake process group's scatter and broadcast would write nothing)."""
    module = sys.modules.get("torch.distributed.tensor.placement_types")
    with ExitStack() as stack:
        for cls_name in ("Shard", "_StridedShard", "Replicate"):
            cls = getattr(module, cls_name, None) if module is not None else None
            for name, raw in list(vars(cls).items()) if cls is not None else []:
                fn = raw.__func__ if isinstance(raw, classmethod) else raw
                if callable(fn) and "src_data_rank" in _parameters(fn):
                    local = _local_source(fn)
                    stack.enter_context(mock.patch.object(cls, name, classmethod(local) if isinstance(raw, classmethod)
                                                          else local))
        yield


def _parameters(fn: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _local_source(fn: Callable[..., Any]) -> Callable[..., Any]:
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def local(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        bound.arguments["src_data_rank"] = None
        return fn(*bound.args, **bound.kwargs)

    return local


def _placement(p: Any, what: str) -> str:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if type(p) is Shard:  # subclasses (_StridedShard) interleave: not a plain Shard
        return f"Shard({int(p.dim)})"
    if type(p) is Replicate:
        return "Replicate"
    if type(p) is Partial:
        if p.reduce_op not in ("sum", "max"):
            raise CaptureError(f"{what} is Partial({p.reduce_op}): refine knows Partial(sum) and Partial(max)")
        return f"Partial({p.reduce_op})"
    raise CaptureError(f"{what} has placement {p!r} ({type(p).__name__}), which refine has no counterpart for "
                       "(it knows Shard, Replicate and Partial)")


def _axes(mesh: Any, what: str) -> list[str | None]:
    names = mesh.mesh_dim_names
    if names:
        return list(names)
    if mesh.ndim == 1:
        return [None]  # the only axis of the Spec's mesh
    raise CaptureError(f"{what} lives on a {mesh.ndim}-D DeviceMesh without dim names: name its dims "
                       "(init_device_mesh(..., mesh_dim_names=...)) like the Spec's mesh axes")


def annotation(placements: Any, mesh: Any, what: str) -> Annotation:
    """The Annotation that DTensor `placements` on DeviceMesh `mesh` mean."""
    axes = _axes(mesh, what)
    pl = tuple((a, _placement(p, f"{what} (mesh dim {a or 0})")) for a, p in zip(axes, placements, strict=True))
    groups: list[tuple[str | None, tuple[int, ...]]] = []
    if dist.is_initialized():
        for i, a in enumerate(axes):
            ranks = dist.get_process_group_ranks(mesh.get_group(i))
            groups.append((a, tuple(int(r) for r in ranks)))
    return Annotation(pl, groups=tuple(groups))


def derive(t: torch.Tensor) -> Annotation | None:
    """DERIVERS hook: a DTensor's placements as an Annotation; None for other tensors."""
    if not is_dtensor(t):
        return None
    return annotation(t.placements, t.device_mesh, "a DTensor")  # type: ignore[attr-defined]


if derive not in DERIVERS:
    DERIVERS.append(derive)


class Locals:
    """Trace DTensor parameters, buffers and inputs through their local tensors.

    `traced(name, v)` is what make_fx gets for `v` (its local tensor, detached);
    `rebuild(name, x)` turns the traced local tensor back into the DTensor the program holds
    (plain tensors pass through); `grad(name, g)` is the traced output for a parameter's
    gradient (its local tensor), recording the gradient's placements."""

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        self.specs: dict[str, tuple[Any, tuple[Any, ...], torch.Size, tuple[int, ...]]] = {}
        for name, v in values.items():
            if is_dtensor(v):
                self.specs[name] = (v.device_mesh, tuple(v.placements), v.shape, v.stride())  # type: ignore[attr-defined]
        self.grad_annotations: dict[str, Annotation] = {}
        fresh_caches()

    def traced(self, name: str, v: torch.Tensor) -> torch.Tensor:
        if name in self.specs:
            return v.to_local().detach()  # type: ignore[attr-defined]
        return v.detach()

    def rebuild(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if name not in self.specs:
            return x
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = self.specs[name]
        return DTensor.from_local(x, mesh, placements, run_check=False, shape=shape, stride=stride)

    def grad(self, name: str, g: torch.Tensor) -> torch.Tensor:
        if not is_dtensor(g):
            if name in self.specs:
                raise CaptureError(f"the gradient of DTensor parameter {name!r} is a plain tensor")
            return g
        if name in self.specs and g.device_mesh.get_coordinate() != self.specs[name][0].get_coordinate():  # type: ignore[attr-defined]
            raise CaptureError(f"the gradient of {name!r} lives on a DeviceMesh with another rank's coordinate: "
                               "a DTensor cache outlived a rank's trace")
        self.grad_annotations[name] = annotation(g.placements, g.device_mesh,  # type: ignore[attr-defined]
                                                 f"the gradient of {name!r}")
        return g.to_local()  # type: ignore[attr-defined]

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The traced loss: a DTensor loss must be Replicate (every rank holds the loss)."""
        if not is_dtensor(loss):
            return loss
        ann = annotation(loss.placements, loss.device_mesh, "the loss")  # type: ignore[attr-defined]
        if any(p != "Replicate" for _, p in ann.placements):
            raise CaptureError(f"the step returns a DTensor loss placed {ann.describe()}: return a replicated loss "
                               "(loss.full_tensor(), or redistribute it to Replicate)")
        return loss.to_local()  # type: ignore[attr-defined]
