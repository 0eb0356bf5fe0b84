"""Trace one training step into an aten FX graph, with the user's source line on every node.

The step runs under `make_fx` with fake tensors (so a branch on a tensor's value is an error,
not a silently baked-in guess) and the decompositions of refine.frontends.capture.aten.
Parameters and buffers become graph inputs: the module is re-parametrized with the traced
tensors, the parameters as fresh leaves that require grad, so `loss.backward()` inside the step
(custom autograd Functions included) fills their `.grad`, which the traced function returns.

Distributed ranks are traced one at a time, each inside a fake process group
(`fake_process_group`): collectives become graph nodes and compute nothing.

Hooks: module hooks (forward, forward-pre, backward, global ones) run inside the traced call
and are traced with it. Gradient hooks on a parameter (`register_hook`,
`register_post_accumulate_grad_hook`) belong to the parameter object, which the trace
replaces by a fresh leaf: they are registered again on the leaf, so they are traced too.
What cannot be followed is refused, never dropped: wrappers that communicate from hooks on
the parameters' gradient accumulators (FSDP1, replicate, a DDP inside the model), any hook
on a parameter's gradient accumulator, and gradient hooks on buffers or data inputs (the
trace gives them no gradient). A model that is itself a DistributedDataParallel is traced
through refine.frontends.capture.ddp, which writes its reducer's averaging into the trace; a
model with FSDP2 `fully_shard` modules through refine.frontends.capture.fsdp, which writes
their all-gathers and reduce-scatters into it.
"""

from __future__ import annotations

import inspect
import itertools
import re
import sys
import sysconfig
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import PythonKeyTracer, get_proxy_mode, make_fx
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.utils.stateless import _reparametrize_module

from refine.frontends.capture.aten import DECOMPOSITIONS
from refine.frontends.capture.ddp import DDPSync
from refine.frontends.capture.errors import CaptureError
from refine.frontends.capture.fsdp import FSDPSync

_TORCH = str(Path(torch.__file__).resolve().parent)
_REFINE = str(Path(__file__).resolve().parents[2])  # refine/: its frames are not the user's
_STDLIB = tuple({str(Path(sysconfig.get_paths()[k]).resolve()) for k in ("stdlib", "platstdlib")})
_HERE = str(Path(__file__).resolve())
_RUN = "_traced_step"  # the name of the function make_fx traces: user frames are below it


@dataclass
class Step:
    """One training step to capture: `step(model, **inputs)` returns the loss after calling
    `loss.backward()` (and whatever gradient synchronisation the program does). A rank that
    computes no loss (a pipeline stage before the last) returns None."""

    model: nn.Module
    step: Callable[..., torch.Tensor]
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Traced:
    gm: fx.GraphModule
    inputs: list[tuple[str, str, torch.Tensor]]  # (name, role, value) of each placeholder, in order
    grads: list[str]  # parameters whose gradient follows the loss in the outputs, in order
    no_grad: list[str]  # parameters that require grad but got none
    annotations: dict[str, Any]  # graph input name -> refine.frontends.capture.annotate.Annotation
    grad_annotations: dict[str, Any] = field(default_factory=dict)  # parameter -> its gradient's (DTensor) placement
    has_loss: bool = True  # False: the step returned None (the outputs are the gradients only)
    # the step ran under DistributedDataParallel or FSDP2: its loss is its own batch shard's,
    # and the gradient reduction makes the ranks' mean (or sum) the objective
    # (refine.frontends.capture.ddp, refine.frontends.capture.fsdp)
    ddp: bool = False
    # parameters whose value the step returns last, in order (the step may update them in
    # place: an optimizer step); refine.frontends.capture.convert keeps those it changed
    finals: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)  # of `finals`, those the step changed (set by convert)
    # scalar reads the step made (refine.frontends.capture.scalars), in order
    reads: list[Any] = field(default_factory=list)


@contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """A process group of `world_size` ranks in which this process is `rank`; collectives
    record and do nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise CaptureError("a default process group is already initialized in this process; capture makes "
                           "its own fake one per rank, so call it outside any distributed setup")
    hook = sys.excepthook  # init_process_group wraps it with a "[rank r]" prefix for good
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    from refine.frontends.capture.dtensor import fresh_caches

    fresh_caches()  # DTensor caches plans per (equal-by-value) DeviceMesh: none may cross ranks
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


# Installed libraries whose frames count as the user's code (a node's source line): model
# libraries such as transformers (refine.frontends.capture.hf adds it), whose lines say more than the
# caller's one line running the whole model.
SOURCE_LIBRARIES: list[str] = []


def register_source_library(module: Any) -> None:
    """Count the frames of the installed package `module` (e.g. `import torchtitan`) as the
    user's code: nodes traced in it are reported at its lines (a model's layers, a parallel
    plan's redistributions), not at the one line of the step that calls the model."""
    root = str(Path(module.__file__).resolve().parent)
    if root not in SOURCE_LIBRARIES:
        SOURCE_LIBRARIES.append(root)


def _is_user(filename: str) -> bool:
    try:
        f = str(Path(filename).resolve())
    except (OSError, ValueError):
        return False
    if any(f.startswith(lib) for lib in SOURCE_LIBRARIES):
        return True
    return not (filename.startswith("<") or f.startswith(_TORCH) or f.startswith(_REFINE) or f.startswith(_STDLIB))


def _user_frames(frames: list[Any]) -> list[Any]:
    """Frames of user code below the traced function (not torch, refine or the stdlib)."""
    start = max((i for i, f in enumerate(frames) if f.name == _RUN and f.filename == _HERE), default=-1)
    return [f for f in frames[start + 1:] if _is_user(f.filename)]


_TB_LINE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _source_frame(frames: list[Any]) -> Any:
    """The frame a node is reported at: the innermost user frame; for a node made by the
    backward of a built-in op, the user frame that ran that op forward."""
    node = torch._C._current_autograd_node()
    if node is not None:
        engine = max((i for i, f in enumerate(frames) if f.name == "_engine_run_backward"), default=None)
        if engine is not None:
            custom = _user_frames(frames[engine + 1:])  # a custom autograd Function's backward
            if custom:
                return custom[-1]
        recorded = node.metadata.get("traceback_") or []
        fwd = [traceback.FrameSummary(m.group(1), int(m.group(2)), m.group(3))
               for m in (_TB_LINE.search(s) for s in recorded) if m]
        found = _user_frames(fwd)
        if found:
            return found[-1]
    found = _user_frames(frames)
    return found[-1] if found else None


def _filter_frames(self: Any, summary: traceback.StackSummary) -> traceback.StackSummary:
    frame = _source_frame(list(summary))
    return traceback.StackSummary.from_list([frame] if frame is not None else [])


def source_of(node: fx.Node) -> str | None:
    """"file.py:line" of an FX node traced by `trace_step`."""
    m = _TB_LINE.search(node.meta.get("stack_trace") or "")
    return f"{Path(m.group(1)).name}:{m.group(2)}" if m else None


def exception_source(e: BaseException) -> str | None:
    frames = _user_frames(traceback.extract_tb(e.__traceback__))
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else None


@contextmanager
def _recording_sources() -> Iterator[None]:
    # make_fx keeps only frames below a `forward`; refine wants the user's innermost frame,
    # for backward nodes too (anomaly mode records each autograd node's forward stack)
    with mock.patch.object(PythonKeyTracer, "_filter_traceback_frames", _filter_frames), \
            torch.autograd.set_detect_anomaly(True, check_nan=False), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Aa]nomaly.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


@contextmanager
def math_attention() -> Iterator[None]:
    """scaled_dot_product_attention by its math backend throughout the step, also where the
    program's own code (a library's attention module) selects backends with `sdpa_kernel`.

    Why: the fused CPU kernel's backward is one aten op with no decomposition, while the math
    backend is the reference written in differentiable ops, so autograd traces the backward as
    ops refine knows. The backends only round differently (refine's semantics are real-valued),
    so the choice does not change what is checked. A nested `sdpa_kernel([...])` keeps the math
    backend only if it lists it; one that excludes it leaves no backend, and the trace fails
    (closed) rather than run a kernel refine cannot read."""
    import torch.nn.attention as attention

    real = attention._sdpa_kernel

    def math_only(backends: Any, set_priority: bool = False) -> None:
        real([b for b in backends if b == SDPBackend.MATH], set_priority)

    with sdpa_kernel([SDPBackend.MATH]), mock.patch.object(attention, "_sdpa_kernel", math_only):
        yield


BATCH = "refine_batch"  # FX node meta: the batch_isend_irecv call a send/recv was posted by


@contextmanager
def _marking_batches() -> Iterator[None]:
    """The sends and recvs one `dist.batch_isend_irecv` call posts trace as the same ops as
    blocking ones: mark them with the call's number, so refine.ops.schedule knows they are posted
    together (a ring of them does not deadlock; the same ops posted one by one can)."""
    real = dist.batch_isend_irecv
    calls = itertools.count()

    def batch_isend_irecv(p2p_op_list: list[Any]) -> Any:
        mode = get_proxy_mode()
        graph = mode.tracer.graph if mode is not None else None
        before = len(graph.nodes) if graph is not None else 0
        works = real(p2p_op_list)
        if graph is not None:
            k = next(calls)
            new = list(itertools.islice(reversed(graph.nodes), len(graph.nodes) - before))
            for n in new:
                if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.name in ("c10d::send", "c10d::recv_"):
                    n.meta[BATCH] = k
        return works

    with mock.patch.object(dist, "batch_isend_irecv", batch_isend_irecv), \
            mock.patch.object(dist.distributed_c10d, "batch_isend_irecv", batch_isend_irecv):
        yield


def trace_step(step: Step, where: str, reads: Any = None) -> Traced:
    """The aten graph of `step` (`where` names it in messages: "the sequential step", "rank 1").
    `reads` (refine.frontends.capture.scalars.Reads): the values of the step's scalar reads
    known so far; a read past them stops the trace (scalars.Unresolved)."""
    from refine.frontends.capture.annotate import annotation_of
    from refine.frontends.capture.dtensor import Locals, is_dtensor
    from refine.frontends.capture.scalars import ReadingScalars, Unresolved

    if not isinstance(step, Step):
        raise CaptureError(f"{where}: expected a refine.capture.Step, got {type(step).__name__}")
    model = step.model
    if not isinstance(model, nn.Module):
        raise CaptureError(f"{where}: Step.model must be a torch.nn.Module, got {type(model).__name__}")
    ddp = DDPSync.of(model, where)  # torch's DistributedDataParallel: the module it wraps is traced
    if ddp is not None:
        model = ddp.module
    # torch's FSDP2 (fully_shard): its parameters are traced as their padded shards
    fsdp = FSDPSync.of(model, where) if ddp is None else None
    params = dict(model.named_parameters()) | (fsdp.inputs() if fsdp is not None else {})
    buffers = dict(model.named_buffers())
    inputs = dict(step.inputs)
    for name, v in inputs.items():
        if not isinstance(v, torch.Tensor):
            raise CaptureError(f"{where}: input {name!r} is a {type(v).__name__}, not a tensor")
        if name in params or name in buffers:
            raise CaptureError(f"{where}: input {name!r} has the name of a parameter or buffer of the model")
    refuse_untraceable_hooks(model, buffers, inputs, where,
                             ddp.managed() if ddp is not None else fsdp.managed() if fsdp is not None else set(),
                             fsdp is not None)
    grads: list[str] = []
    no_grad: list[str] = []
    finals: list[str] = []
    has_loss: list[bool] = []
    # DTensors are traced as local tensors (refine.frontends.capture.dtensor)
    local = Locals(params | buffers | inputs)
    reading = ReadingScalars(reads, _user_line) if reads is not None else nullcontext()  # else make_fx refuses reads

    def _traced_step(p_vals: list[torch.Tensor], b_vals: list[torch.Tensor], x_vals: list[torch.Tensor]) -> Any:
        leaves = {n: local.rebuild(n, v).detach().requires_grad_(params[n].requires_grad)
                  for n, v in zip(params, p_vals, strict=True)}
        for n, leaf in leaves.items():
            copy_grad_hooks(params[n], leaf)
        if ddp is not None:
            ddp.hook(leaves)
        if fsdp is not None:
            for n in fsdp.managed():
                fsdp.leaf(n, leaves[n])
        state = leaves | {n: local.rebuild(n, v) for n, v in zip(buffers, b_vals, strict=True)}
        sync = ddp.forwarding() if ddp is not None else fsdp.forwarding() if fsdp is not None else nullcontext()
        with _reparametrize_module(model, state, tie_weights=True), sync, reading:
            loss = step.step(step.model, **{n: local.rebuild(n, v) for n, v in zip(inputs, x_vals, strict=True)})
        if loss is None and where != "the sequential step":
            out = []  # a pipeline stage without the loss
        elif not isinstance(loss, torch.Tensor):
            raise CaptureError(f"{where}: the step must return the loss tensor, got {type(loss).__name__}")
        else:
            out = [local.loss(loss)]
        has_loss.append(bool(out))
        for n, leaf in leaves.items():
            if leaf.grad is not None:
                grads.append(n)
                out.append(local.grad(n, leaf.grad))
            elif params[n].requires_grad:
                no_grad.append(n)
        # each parameter's value after the step, to see an update made in place (an
        # optimizer step); not for DTensor parameters, whose updates are not followed
        if not any(is_dtensor(leaf) for leaf in leaves.values()):
            finals.extend(leaves)
            out.extend(leaves.values())
        return tuple(out)

    args = ([local.traced(n, p) for n, p in params.items()], [local.traced(n, b) for n, b in buffers.items()],
            [local.traced(n, x) for n, x in inputs.items()])
    try:
        with _recording_sources(), _marking_batches(), math_attention():
            gm = make_fx(_traced_step, decomposition_table=DECOMPOSITIONS, tracing_mode="fake",
                         record_stack_traces=True, _allow_non_fake_inputs=True)(*args)
    except Unresolved as u:
        u.names = [*params, *buffers, *inputs]  # the placeholders' names, for its messages
        raise
    except CaptureError:
        raise
    except Exception as e:
        raise CaptureError(f"{where}: cannot trace the step: {_why(e)}", exception_source(e)) from e
    values = [*params.values(), *buffers.values(), *inputs.values()]
    roles = ["parameter"] * len(params) + ["buffer"] * len(buffers) + ["data"] * len(inputs)
    names = [*params, *buffers, *inputs]
    annotations = {n: a for n, v in zip(names, values, strict=True) if (a := annotation_of(v)) is not None}
    return Traced(gm, list(zip(names, roles, values, strict=True)), grads, no_grad, annotations,
                  local.grad_annotations, has_loss[-1], ddp is not None or fsdp is not None, finals,
                  reads=list(reads.made) if reads is not None else [])


# ---------------------------------------------------------------------------------------
# hooks


def grad_hooks(t: torch.Tensor) -> list[tuple[str, Callable[..., Any]]]:
    """A tensor's gradient hooks, in registration order: ("register_hook" |
    "register_post_accumulate_grad_hook", function)."""
    out: list[tuple[str, Callable[..., Any]]] = []
    for kind, attr in (("register_hook", "_backward_hooks"),
                       ("register_post_accumulate_grad_hook", "_post_accumulate_grad_hooks")):
        out += [(kind, fn) for fn in (getattr(t, attr, None) or {}).values()]
    return out


def copy_grad_hooks(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Register `src`'s gradient hooks on `dst` (a fresh leaf standing for it), in order."""
    for kind, fn in grad_hooks(src):
        getattr(dst, kind)(fn)


def hook_name(fn: Any) -> str:
    """A hook function as `name (file.py:line)`."""
    while hasattr(fn, "func"):  # functools.partial
        fn = fn.func
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    try:
        file, line = inspect.getsourcefile(fn), inspect.getsourcelines(fn)[1]
    except (OSError, TypeError):
        return name
    return f"{name} ({Path(file).name}:{line})" if file else name


# Wrappers whose communication runs from hooks the trace does not see (on the original
# parameters' gradient accumulators, or from reducers in C++): (module, class name, what it does)
_WRAPPERS = (
    ("torch.nn.parallel", "DistributedDataParallel", "its reducer all-reduces the gradients from hooks on the "
     "parameters' gradient accumulators"),
    ("torch.distributed.fsdp", "FullyShardedDataParallel", "it all-gathers the parameters and reduce-scatters the "
     "gradients from hooks"),
    ("torch.distributed.fsdp", "FSDPModule", "fully_shard all-gathers the parameters and reduce-scatters the "
     "gradients from hooks"),
)
_SYNC_ADVICE = ("capture traces fresh parameters, where that communication would silently not happen; write the "
                "gradient synchronisation in the step instead (e.g. dist.all_reduce(p.grad, op=dist.ReduceOp.AVG) "
                "for each parameter after loss.backward(), as models/capture/ddp_mlp.py does)")


def refuse_untraceable_hooks(model: nn.Module, buffers: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor],
                             where: str, managed: set[str] = frozenset(),  # type: ignore[assignment]
                             fully_shard: bool = False) -> None:
    """Refuse what the trace would silently drop: data-parallel wrappers, hooks held on a
    parameter's gradient accumulator (but on the `managed` parameters, whose reducer hooks
    refine.frontends.capture.ddp writes into the trace), gradient hooks on tensors that get
    no gradient. `fully_shard`: the model's fully_shard modules are traced through
    refine.frontends.capture.fsdp, which writes their communication into the trace."""
    for path, m in model.named_modules():
        at = f"module {path!r}" if path else "the model"
        for mod_name, cls_name, does in _WRAPPERS:
            if fully_shard and cls_name == "FSDPModule":
                continue
            cls = getattr(sys.modules.get(mod_name), cls_name, None)
            if isinstance(cls, type) and isinstance(m, cls):
                raise CaptureError(f"{where}: {at} is a {mod_name}.{cls_name} ({type(m).__name__}): {does}; "
                                   + _SYNC_ADVICE)
        contract = sys.modules.get("torch.distributed._composable.contract")
        registry = contract._get_registry(m) if contract is not None else None  # type: ignore[attr-defined]
        for api in registry or {}:
            if api == "replicate" or (api == "fully_shard" and not fully_shard):
                raise CaptureError(f"{where}: {at} is wrapped by torch.distributed's composable {api}(), which "
                                   f"communicates from hooks on the parameters; " + _SYNC_ADVICE)
    for name, p in model.named_parameters():
        if p.requires_grad and name not in managed and _accumulator_held(p):
            raise CaptureError(
                f"{where}: parameter {name!r} has its gradient accumulator (autograd's AccumulateGrad node) held "
                "outside the step: a hook registered on it (as DistributedDataParallel, Megatron's "
                "DistributedDataParallel or FSDP register theirs), or an autograd graph of an earlier forward pass "
                "still alive. Capture traces fresh parameters, so such a hook would silently not run; register "
                "gradient hooks on the parameter itself (p.register_hook, p.register_post_accumulate_grad_hook: "
                "traced), or write the gradient synchronisation in the step")
    for role, tensors in (("buffer", buffers), ("input", inputs)):
        for name, t in tensors.items():
            hooks = grad_hooks(t)
            if hooks:
                kind, fn = hooks[0]
                raise CaptureError(f"{where}: {role} {name!r} has a gradient hook ({kind}: {hook_name(fn)}), which "
                                   f"would never run: capture gives {role}s no gradient")


def _accumulator_held(p: torch.Tensor) -> bool:
    """Whether something outside keeps `p`'s AccumulateGrad node alive (autograd holds it only
    weakly, so a node made here is a fresh one unless another holder exists): a mark left on
    the node is still there when it is fetched again only if the node survived in between."""
    from torch.autograd.graph import get_gradient_edge

    try:
        get_gradient_edge(p).node.metadata["refine_capture_probe"] = True
        node = get_gradient_edge(p).node
    except RuntimeError:  # not a leaf that accumulates (a view, no grad): nothing is held
        return False
    held = "refine_capture_probe" in node.metadata
    node.metadata.pop("refine_capture_probe", None)
    return held


def _user_line() -> str | None:
    """"file.py:line" of the innermost user frame running now."""
    frames = _user_frames(traceback.extract_stack())
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else None


def _why(e: Exception) -> str:
    kind = type(e).__name__
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if "DataDependent" in kind or "data-dependent" in str(e) or "data dependent" in str(e):
        return ("the step branches on (or reads) a tensor's value, which a trace cannot follow: "
                f"data-dependent control flow ({kind}: {text[:300]})")
    return f"{kind}: {text[:500]}"
