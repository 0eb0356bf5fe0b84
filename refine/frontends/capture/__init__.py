"""Capture a real PyTorch training step, sequential and per rank, and check it with refine.

    from refine import capture, check

    case = capture(capture.Spec(sequential=capture.Step(model, train_step, inputs),
                                rank=lambda r: capture.Step(tp_model(r), train_step, inputs),
                                world_size=2))
    report = check(*case)           # or case.check(), which also flags shape-guessed shards
    case.write("case/")             # seq.json + dist.json for `refine check`

Rank code annotates its parameters and inputs once (`capture.shard(w, 0)`,
`capture.replicate(...)`, `capture.partial(...)`, `capture.layout(...)`); anything not
annotated is matched by name and its placement guessed from shapes. See
refine.frontends.capture.case for the outputs and expectations, refine.frontends.capture.aten
for the op mapping.

The module itself is callable: `capture(spec)` is `capture.capture(spec)`.

From the command line: `refine capture FILE.py:FUNC --out DIR [--world-size N] [--check]`,
FUNC returning a Spec (or a captured Case). CPU only: no GPU and no real process group.
Examples of every idiom: models/capture/*.py, each `make_case(world_size=..., bug=...)`.

The step. `Step(model, step, inputs)`: `step(model, **inputs)` computes the loss, calls
`loss.backward()`, does whatever gradient synchronisation the program does, and returns the
loss (None on a pipeline stage that computes none). `Spec.rank(r)` runs inside rank r's fake
process group (`dist.get_rank()`, `dist.new_group(...)` work, so subgroups of a dp x tp mesh
resolve to global ranks); `Spec.mesh` names the axes (sizes multiply to world_size, ranks
row-major).

Tracing (refine.frontends.capture.trace): parameters and buffers become inputs named by their
qualified names (`fc1.weight`); custom autograd Functions work. Collectives: the functional
ones (`_c10d_functional.*`) and the legacy in-place `dist.*` ones (`dist.all_to_all_single(out,
x)` writes `out`: its later readers read the exchange); `dist.send`/`dist.recv`
become the format's send/recv (recv fills a buffer and returns nothing: its later readers
are rewired to the received tensor); sends/recvs of one `dist.batch_isend_irecv` call share
a `batch`.

Checked on the way: every node keeps its source (`file.py:line`, the innermost frame of user
code; for backward nodes, the line that ran the op forward); the documents go through the
same loader as hand-written ones; the sequential graph is replayed with refine's interpreter
against the step run eagerly in float64, so a mistranslation cannot reach the checker; an
in-place op whose tensor is read afterwards through an older view is refused (a read of the
very tensor written, under another name such as `p.grad.data`, follows the write). An aten
op refine cannot express is an error naming the op, the FX node and the user's line; no
half-written case is ever left behind.

Static shapes only: data-dependent sizes cannot be traced. Top-k routed MoE must use a
static capacity (tokens in groups, S slots per expert per group, a stable sort for the
permutation, `scatter_add` to unpermute; `all_to_all_single` then splits evenly); an
unstable `sort`, `topk(largest=False)` or `scatter(reduce=...)` is refused (ties or
reductions would be unspecified).

Scalar reads (refine.frontends.capture.scalars): a rank's `t.item()` (`int(t)`, `bool(t)`) of a
value that depends on no input and no random number, only on constants the ranks exchange (a
torch.distributed.pipelining schedule's vote on static or dynamic shape inference), is
resolved by running the ranks' traced prefixes with real tensors (sends and recvs, and
collectives: all_to_all_single with its split sizes, all_reduce, all_gather) and traced as that
value; every read is evaluated again on the final traces. The sequential step's reads are
resolved the same way. A read of an input-dependent value is data-dependent control flow or
sizes (a dropless MoE's routing counts), refused at its line, naming the inputs it is computed
from. So `torch.distributed.pipelining`'s GPipe,
1F1B and interleaved 1F1B schedules are captured (models/capture/pp_schedule.py; stages given
their micro-batch's input and output: dynamic shape inference exchanges pickled objects, not
covered).

Pipeline stages that are also tensor parallel: a tensor only some ranks hold (one stage's
tensor-parallel group, or the first and last stages' groups of a tied weight) is annotated as
usual (`shard(w, 0, axis="tp")`, `replicate`, `partial`, or a DTensor's placements) and related
within each group of its holders (refine.frontends.capture.annotate.submesh_layouts: Shard and
Partial(sum) only along axes the holders span, a copy per group and per Replicate coordinate);
its gradient is expected alike, and ranks outside the holders hold no part of it. Unannotated,
such a tensor is taken as held whole by each holder (models/capture/pp_tp.py). `isend`/`irecv`
count as blocking where issued (their waits are not traced).

Framework glue: refine.frontends.capture.ddp (torch's DistributedDataParallel, applied by
itself to a DDP-wrapped model), refine.frontends.capture.fsdp (torch's FSDP2 `fully_shard`,
applied by itself to a model with fully_shard modules: per layer, grouped, HSDP, over TP
DTensors, gradient sync toggled, divide factor, reduce dtype; its parameters are traced as
their padded dim-0 shards, `Annotation.padded`; settings it does not model are refused by
name), refine.frontends.capture.megatron (Megatron-core),
refine.frontends.capture.dtensor (`parallelize_module`), refine.frontends.capture.hf
(transformers' `tp_plan`). For any model library: `trace.register_source_library(pkg)` reports
nodes at the library's lines, `precision.float64_reference()` keeps its deliberate float32
casts out of the float64 replay; a library's own `sdpa_kernel([...])` keeps the math backend.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types
from pathlib import Path
from typing import Any

from refine.frontends.capture.annotate import Annotation, flat, layout, partial, replicate, shard
from refine.frontends.capture.case import Case, Spec, capture
from refine.frontends.capture.errors import CaptureError
from refine.frontends.capture.trace import Step, exception_source, fake_process_group

__all__ = ["Annotation", "CaptureError", "Case", "Spec", "Step", "capture", "fake_process_group", "flat", "layout",
           "load_target", "partial", "replicate", "shard"]


def load_target(target: str, world_size: int | None = None) -> Spec | Case:
    """Run `FILE.py:FUNC` (the CLI's argument) and return its Spec or Case. FUNC gets
    `world_size=` when it takes one; otherwise the Spec must have that world size."""
    file, sep, func = target.rpartition(":")
    if not sep or not file or not func:
        raise CaptureError(f"expected FILE.py:FUNC, got {target!r}")
    path = Path(file)
    if not path.is_file():
        raise CaptureError(f"{file}: no such file")
    name = f"refine_capture_target_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CaptureError(f"{file}: cannot import it as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.resolve().parent))  # so the file can import its neighbours
    try:
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except Exception as e:
        raise CaptureError(f"{file}: importing it failed: {type(e).__name__}: {e}", exception_source(e)) from e
    finally:
        sys.path.remove(str(path.resolve().parent))
    fn = getattr(module, func, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == name)
        raise CaptureError(f"{file} has no function {func!r} (functions: {', '.join(found) or 'none'})")
    kwargs: dict[str, Any] = {}
    if world_size is not None and "world_size" in inspect.signature(fn).parameters:
        kwargs["world_size"] = world_size
    try:
        result = fn(**kwargs)
    except CaptureError:
        raise
    except Exception as e:
        raise CaptureError(f"{target}: {type(e).__name__}: {e}", exception_source(e)) from e
    if not isinstance(result, (Spec, Case)):
        raise CaptureError(f"{target} returned a {type(result).__name__}; it must return a refine.capture.Spec")
    got = result.world_size if isinstance(result, Spec) else result.stats.get("ranks")
    if world_size is not None and got != world_size:
        raise CaptureError(f"{target} makes a case of {got} ranks, not {world_size} (and takes no world_size)")
    return result


class _CallableModule(types.ModuleType):
    """`from refine import capture; capture(spec)` and `capture.shard(...)` both read naturally."""

    def __call__(self, spec: Spec, registry: Any = None) -> Case:
        return capture(spec, registry)


sys.modules[__name__].__class__ = _CallableModule
