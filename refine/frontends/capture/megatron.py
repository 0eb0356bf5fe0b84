"""Run Megatron-core (0.16) under refine's capture, on CPU, and read its parallel marks.

Everything refine needs to trace Megatron code lives here, so a case only writes Megatron:

    from refine.frontends.capture import megatron

    def rank(r):                          # Spec.rank: runs in rank r's fake process group
        return megatron.rank_step(lambda: build_model(config), train_step, inputs, tp=2)

- `parallel_state(tp)`: Megatron's global parallel state for one rank, set up on the fake
  process group and torn down on exit, so ranks are captured one after another in one
  process;
- `cpu_device()`: the patches Megatron needs to run without a GPU (why: on each one);
- `rank_step(...)`: a refine Step that builds the model under that state and traces the step
  under it again (Megatron reads its groups and buffers from globals at run time);
- `sequential_step(...)`: the sequential Step of a Megatron model run unparallelized (TP 1,
  in a process group of one rank);
- `finalize_model_grads(model)`: Megatron's own `finalize_model_grads` for a model that is
  not wrapped in Megatron's DistributedDataParallel;
- `register(axis)`: input relations derived from Megatron's parameter attributes
  (`tensor_model_parallel` + `partition_dim` is Shard on the tensor-parallel mesh axis; a
  parameter Megatron marks as not split, `sequence_parallel` included, is Replicate).
  Importing this module registers it for the axis "tp".

Megatron is imported lazily (only by the functions that run it): `import refine` never
imports it, and the deriver works without it.

Example (LayerNorm, ColumnParallelLinear(gather_output=False), gelu,
RowParallelLinear(input_is_parallel=True), an MSE loss, backward and `finalize_model_grads`,
with or without sequence_parallel):

    refine capture models/capture/megatron_mlp.py:make_case --out case/
    refine check case/seq.json case/dist.json

Derived relations, in detail: ColumnParallelLinear's weight and bias are Shard(0),
RowParallelLinear's weight Shard(1); LayerNorm weights and a row-parallel bias are
Replicate. `partition_stride > 1` is refused (annotate a layout instead). Data inputs still
need annotations (the token split under sequence parallelism: Megatron's `[s, b, h]`
layout, Shard(0)).

Under capture, refine traces with fresh leaves in place of the parameters; Megatron's marks
are copied onto them, since `finalize_model_grads` selects parameters by
`param.sequence_parallel`. `GlobalMemoryBuffer.get_tensor` allocates a fresh tensor per call:
the backward's all-gather writing into the forward's storage through an older view is
something capture refuses to follow. `finalize_model_grads(model)` wraps the model as one
chunk with a DDP config and no data-parallel work (data-parallel size 1): Megatron's own
DistributedDataParallel keeps its grad buffers on the GPU and is not supported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import torch
from torch import nn

from refine.frontends.capture.annotate import DERIVERS, Annotation
from refine.frontends.capture.errors import CaptureError
from refine.frontends.capture.trace import Step, fake_process_group

# The attributes Megatron sets on parameters (tensor_parallel.layers and the norms):
# split or not, along which dim, with which stride; reduced over TP after backward (SP).
MARKS = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel", "allreduce")

# ---------------------------------------------------------------------------------------
# derived relations


def derive(t: torch.Tensor, axis: str = "tp") -> Annotation | None:
    """The relation Megatron's marks on `t` mean, on mesh axis `axis`; None if unmarked.

    `tensor_model_parallel=True` with `partition_dim=d`: each TP rank holds the d-th block of
    the full tensor (Shard(d)). `partition_stride` > 1 is an interleaved layout this does not
    express: refused, annotate it with capture.layout. A parameter Megatron marks but does not
    split (`tensor_model_parallel` False, or only `sequence_parallel` / `allreduce` set, as on
    layer norms and the row-parallel bias) is a duplicate on every TP rank: Replicate (under
    sequence parallelism its gradient is partial until finalize_model_grads all-reduces it,
    which is exactly what the gradient expectation checks)."""
    if getattr(t, "tensor_model_parallel", False):
        stride = getattr(t, "partition_stride", 1)
        if stride != 1:
            raise CaptureError(f"a Megatron parameter {list(t.shape)} has partition_stride={stride}: an interleaved "
                               "layout refine does not derive; annotate it with refine.capture.layout")
        dim = getattr(t, "partition_dim", None)
        if not isinstance(dim, int) or dim < 0:
            raise CaptureError(f"a Megatron parameter {list(t.shape)} is tensor_model_parallel with partition_dim="
                               f"{dim!r}: not a dim")
        return Annotation(((axis, f"Shard({dim})"),))
    if any(hasattr(t, m) for m in ("tensor_model_parallel", "sequence_parallel", "allreduce")):
        return Annotation(((axis, "Replicate"),))
    return None


_REGISTERED: list[Callable[[torch.Tensor], Annotation | None]] = []


def register(axis: str = "tp") -> None:
    """Derive relations from Megatron's marks on the mesh axis `axis` (the tensor-parallel
    one); replaces an earlier registration from this module."""
    for d in _REGISTERED:
        DERIVERS.remove(d)
    _REGISTERED.clear()

    def megatron_marks(t: torch.Tensor) -> Annotation | None:
        return derive(t, axis)

    DERIVERS.append(megatron_marks)
    _REGISTERED.append(megatron_marks)


register()

# ---------------------------------------------------------------------------------------
# running Megatron on CPU under a fake process group


class _NoRNGTracker:
    """Stands in for Megatron's CUDA RNG tracker: `fork()` would save and restore CUDA RNG
    states (there is no CUDA); the traced step draws no random numbers (dropout off)."""

    @contextmanager
    def fork(self, name: str = "") -> Iterator[None]:
        yield

    def add(self, name: str, seed: int) -> None:
        pass

    def reset(self) -> None:
        pass


@contextmanager
def cpu_device() -> Iterator[None]:
    """Patches for Megatron code paths that assume a GPU, active only inside this block:

    - `torch.cuda.current_device()` returns "cpu": Megatron allocates communication
      buffers with `device=torch.cuda.current_device()` even with use_cpu_initialization
      (the global memory buffer for the sequence-parallel all-gather, the reduce-scatter
      output in the backward of a sequence-parallel linear, the gather/scatter mappings);
      on a CPU build it raises;
    - `get_cuda_rng_tracker()` is a no-op tracker: weight initialization on the GPU path and
      Megatron's dropout fork CUDA RNG states, which do not exist on CPU;
    - `GlobalMemoryBuffer.get_tensor` allocates a fresh tensor per call instead of handing
      out views of one reused buffer. The reuse is an allocation optimisation whose users
      (the sequence-parallel all-gathers, attention's baddbmm with beta=0) overwrite every
      element before reading, so the values are the same; but in the traced graph the
      backward's all-gather would write into the storage the forward's all-gather wrote,
      through a view taken from the older alias, which refine's capture refuses (it follows
      in-place writes only through the tensor they return)."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import layers, random
    from megatron.core.utils import GlobalMemoryBuffer

    def fresh(self: Any, tensor_shape: Any, dtype: torch.dtype, name: str, mem_alloc_context: Any = None
              ) -> torch.Tensor:
        return torch.empty(*tensor_shape, dtype=dtype, requires_grad=False)

    tracker = _NoRNGTracker()
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: "cpu"))
        stack.enter_context(mock.patch.object(GlobalMemoryBuffer, "get_tensor", fresh))
        for mod in (tensor_parallel, layers, random):
            if hasattr(mod, "get_cuda_rng_tracker"):
                stack.enter_context(mock.patch.object(mod, "get_cuda_rng_tracker", lambda: tracker))
        yield


@contextmanager
def parallel_state(tp: int) -> Iterator[None]:
    """Megatron's global parallel state (groups, global memory buffer) for this rank, on the
    current (fake) default process group, with tensor-parallel size `tp` and data parallel
    size world_size / tp; destroyed on exit so the next rank starts clean.

    Gloo groups are off (`create_gloo_process_groups=False`): they would open real gloo
    process groups, which the fake backend cannot stand in for."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        raise CaptureError("Megatron's parallel state is already initialized in this process: capture sets up its "
                           "own per rank (refine.frontends.capture.megatron.parallel_state); destroy_model_parallel() first")
    with cpu_device():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
        try:
            yield
        finally:
            ps.destroy_model_parallel()


def _copy_marks(originals: dict[str, torch.Tensor], model: nn.Module) -> None:
    """refine traces the step with fresh leaf tensors in place of the parameters; Megatron
    reads its marks off the parameters at run time (finalize_model_grads picks the
    sequence-parallel ones by `param.sequence_parallel`), so copy them onto the leaves."""
    for name, p in model.named_parameters():
        orig = originals.get(name)
        if orig is None or orig is p:
            continue
        for m in MARKS:
            if hasattr(orig, m):
                setattr(p, m, getattr(orig, m))


def rank_step(build: Callable[[], nn.Module], step: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor],
              tp: int) -> Step:
    """The Step of one rank of a Megatron model, for `Spec.rank`: `build()` makes the model
    under this rank's Megatron parallel state, and `step(model, **inputs)` is traced under
    it again (forward and backward read Megatron's groups and global buffers), with the
    parameters' Megatron marks on the traced parameters. The state exists only while the
    model is built and while the step is traced."""
    with parallel_state(tp):
        model = build()
    originals = dict(model.named_parameters())

    def megatron_step(m: nn.Module, **kw: torch.Tensor) -> torch.Tensor:
        with parallel_state(tp):
            _copy_marks(originals, m)
            return step(m, **kw)

    return Step(model, megatron_step, inputs)


def sequential_step(build: Callable[[], nn.Module], step: Callable[..., torch.Tensor],
                    inputs: dict[str, torch.Tensor]) -> Step:
    """The Step of the sequential model as Megatron itself runs it unparallelized: built and
    traced in a process group of one rank with tensor-parallel size 1 (Megatron's layers
    need its parallel state even then), for `Spec.sequential`. Megatron skips most of its
    communication at TP 1; what it still calls (vocab_parallel_cross_entropy's all-reduces)
    is over one rank, which capture translates as the identity."""
    with fake_process_group(0, 1), parallel_state(1):
        model = build()

    def megatron_step(m: nn.Module, **kw: torch.Tensor) -> torch.Tensor:
        with fake_process_group(0, 1), parallel_state(1):
            return step(m, **kw)

    return Step(model, megatron_step, inputs)


class _Chunk:
    """A model chunk as finalize_model_grads expects one from Megatron's DDP wrapper: the
    model (`module`, which Megatron unwraps), its config, a DDP config, and a data-parallel
    gradient sync that has nothing to do (one data-parallel rank)."""

    def __init__(self, model: nn.Module, config: Any) -> None:
        from megatron.core.distributed import DistributedDataParallelConfig

        self.module, self.config, self.ddp_config = model, config, DistributedDataParallelConfig()

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        from megatron.core import parallel_state as ps

        if ps.get_data_parallel_world_size() != 1:
            raise CaptureError("refine.frontends.capture.megatron.finalize_model_grads wraps a model without Megatron's "
                               "DistributedDataParallel: data-parallel size must be 1")


def finalize_model_grads(model: nn.Module, config: Any = None) -> None:
    """Megatron's own `megatron.core.distributed.finalize_model_grads` for `model` (not
    wrapped in Megatron's DistributedDataParallel, whose contiguous gradient buffers need a
    GPU): it all-reduces over the TP group the gradients of the parameters marked
    `sequence_parallel` (layer norms and the row-parallel bias under sequence parallelism),
    as a Megatron training step does after backward. `config` (a TransformerConfig)
    defaults to `model.config`. Data-parallel size must be 1."""
    from megatron.core.distributed import finalize_model_grads as megatron_finalize

    megatron_finalize([_Chunk(model, config if config is not None else model.config)])
