"""Scalar reads (`t.item()`, `int(t)`, `bool(t)`) of values that do not depend on the step's
inputs, resolved by running the ranks' traced programs concretely.

A trace cannot follow a Python branch on a tensor's value. When that value is a constant of the
distributed program, the same whatever the parameters and data (a protocol the ranks run among
themselves, as torch.distributed.pipelining's schedules vote on how to infer shapes: each stage
sends the product of the votes so far on, the last stage sends the result back, and every stage
branches on `result.item()`), capture can know it: it traces each rank until its first unknown
read, runs the traced prefixes of all ranks with real tensors (sends and recvs matched per pair
of ranks in program order, collectives per group: all_to_all_single with its split sizes,
all_reduce, all_gather), reads the value, and traces again with it; until no rank stops. The
sequential step's reads are resolved the same way (refine.frontends.capture.case).

A read whose value depends on a parameter, buffer, input or random number is refused (data-
dependent control flow or sizes: a dropless MoE's routing counts), naming the inputs it is
computed from: baking such a value in would hold only for the inputs that give it.
At the end every read is evaluated again on the final traces and must give the value the trace
took (`check`), so the graphs refine checks are the ones the reads were made on.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
from torch.utils._python_dispatch import TorchDispatchMode

from refine.frontends.capture import aten
from refine.frontends.capture.errors import CaptureError


@dataclass
class Read:
    """One scalar read of a rank's trace: the tensor read (its FX node), and how many nodes the
    graph had then (the prefix that computes it)."""

    node: fx.Node
    cutoff: int
    source: str | None = None


class Unresolved(Exception):  # noqa: N818 - a control signal, not an error
    """The trace reached a read whose value capture does not know yet."""

    def __init__(self, read: Read, graph: fx.Graph, root: torch.nn.Module) -> None:
        super().__init__("unresolved scalar read")
        self.read, self.graph, self.root = read, graph, root
        self.names: list[str] = []  # the step's inputs in placeholder order (set by trace_step)


@dataclass
class Reads:
    """The reads of one rank's trace, in order; `known` holds the values already resolved."""

    known: list[int | float | bool] = field(default_factory=list)
    made: list[Read] = field(default_factory=list)


class ReadingScalars(TorchDispatchMode):
    """Entered inside the traced function (above make_fx's proxy mode): a scalar read takes the
    next known value, or stops the trace (`Unresolved`) so capture can compute it."""

    def __init__(self, reads: Reads, line: Callable[[], str | None]) -> None:
        super().__init__()
        self.reads, self.line = reads, line  # line(): "file.py:N" of the user's code reading

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func is not torch.ops.aten._local_scalar_dense.default:
            return func(*args, **(kwargs or {}))
        mode = get_proxy_mode()
        if mode is None:
            return func(*args, **(kwargs or {}))
        tracer = mode.tracer
        (t,) = args
        try:
            node = get_proxy_slot(t, tracer).proxy.node
        except (KeyError, AttributeError, RuntimeError):
            return func(*args, **(kwargs or {}))  # not a traced tensor: make_fx decides (and refuses)
        read = Read(node, len(tracer.graph.nodes), self.line())
        k = len(self.reads.made)
        self.reads.made.append(read)
        if k < len(self.reads.known):
            return self.reads.known[k]
        raise Unresolved(read, tracer.graph, tracer.root)


# ---------------------------------------------------------------------------------------
# running traced prefixes


_DATA = "data"  # taint: the value depends on the step's inputs or on random numbers


@dataclass
class Program:
    """A rank's traced graph as steps to run: the prefix up to `cutoff` is what must run; the
    rest runs only when another rank waits on one of its sends."""

    rank: int
    steps: list[Callable[[Runner], bool]]  # each returns False when it must wait (a recv)
    cutoff: int
    reads: list[Read]
    where: str
    names: list[str] = field(default_factory=list)  # the step's inputs (parameters, buffers, inputs) in placeholder order


class Runner:
    """Runs several ranks' programs with real tensors, matching each pair's sends and recvs in
    order, and each group's collectives in order (the k-th of a group on every member)."""

    def __init__(self) -> None:
        self.env: dict[tuple[int, fx.Node], Any] = {}
        self.tainted: set[tuple[int, fx.Node]] = set()
        self.channels: dict[tuple[int, int], deque[tuple[torch.Tensor, bool]]] = {}
        # collectives: how many each rank posted per group, what each posted, which one a node is
        self.posted: dict[tuple[tuple[int, ...], int], int] = {}
        self.arrived: dict[tuple[tuple[int, ...], int], dict[int, tuple[torch.Tensor | None, list[int], bool]]] = {}
        self.slot: dict[tuple[int, fx.Node], int] = {}
        # storages an input-dependent value was written into (through any view of them)
        self.dirty: set[tuple[int, int]] = set()

    def storage(self, rank: int, a: Any) -> tuple[int, int] | None:
        v = self.env.get((rank, a)) if isinstance(a, fx.Node) else None
        return (rank, v.untyped_storage().data_ptr()) if isinstance(v, torch.Tensor) else None

    def clean(self, rank: int, a: fx.Node, t: torch.Tensor) -> None:
        """`a` (holding `t`) was overwritten whole by constants: its storage too, if `t` covers it."""
        self.tainted.discard((rank, a))
        if t.numel() * t.element_size() == t.untyped_storage().nbytes():
            self.dirty.discard((rank, t.untyped_storage().data_ptr()))

    def dirty_write(self, rank: int, a: Any) -> None:
        self.tainted.add((rank, a))
        if (s := self.storage(rank, a)) is not None:
            self.dirty.add(s)

    def value(self, rank: int, a: Any) -> Any:
        if isinstance(a, fx.Node):
            return self.env[(rank, a)]
        if isinstance(a, (list, tuple)):
            return type(a)(self.value(rank, x) for x in a)
        if isinstance(a, dict):
            return {k: self.value(rank, v) for k, v in a.items()}
        return a

    def taint_of(self, rank: int, args: Any) -> bool:
        found = False

        def visit(a: Any) -> None:
            nonlocal found
            if isinstance(a, fx.Node) and ((rank, a) in self.tainted or self.storage(rank, a) in self.dirty):
                found = True
        fx.node.map_aggregate(args, visit)
        return found


def compile_rank(rank: int, graph: fx.Graph, root: torch.nn.Module, cutoff: int, reads: list[Read],
                 where: str, names: list[str] | None = None) -> Program:
    """The steps of a rank's graph. Run inside the rank's process group, which the p2p ops name.
    `names`: the step's inputs in placeholder order, to say what a data-dependent read depends on."""
    nodes = list(graph.nodes)
    steps: list[Callable[[Runner], bool]] = []
    # a step capture cannot run is refused at the user's line that reads the scalar
    at = next((f"{where}, at {r.source}" for r in reads if r.source), where)
    for n in nodes:
        steps.append(_step(rank, n, root, at))
    pos = {n: i for i, n in enumerate(nodes)}
    return Program(rank, steps, cutoff, [r for r in reads if r.node in pos], where, list(names or []))


def _peer(rank_of_group: int, group: Any, root: torch.nn.Module) -> int:
    pg = dist.ProcessGroup.unbox(getattr(root, group.target)) if isinstance(group, fx.Node) else group
    return int(dist.get_process_group_ranks(pg)[rank_of_group])


def _step(rank: int, n: fx.Node, root: torch.nn.Module, where: str) -> Callable[[Runner], bool]:
    # the arguments as traced: conversion later rewires readers of a recv's buffer in place
    key, n_args, n_kwargs = (rank, n), n.args, dict(n.kwargs)
    if n.op == "placeholder":
        def placeholder(run: Runner) -> bool:
            run.env[key] = None  # an input of the step: its value is never needed by a read
            run.tainted.add(key)
            return True
        return placeholder
    if n.op == "get_attr":
        def get_attr(run: Runner) -> bool:
            v = getattr(root, n.target)  # type: ignore[arg-type]
            run.env[key] = v.clone() if isinstance(v, torch.Tensor) else v  # the graph's constant stays as is
            return True
        return get_attr
    if n.op == "output":
        return lambda run: True
    if n.op != "call_function":
        raise CaptureError(f"{where}: a scalar read follows a {n.op} node, which capture cannot run")
    target = n.target
    if target is operator.getitem:
        def getitem(run: Runner) -> bool:
            base = run.value(rank, n_args[0])
            run.env[key] = None if base is None else base[n_args[1]]
            if run.taint_of(rank, n_args):
                run.tainted.add(key)
            return True
        return getitem
    if not isinstance(target, torch._ops.OpOverload):
        return _refusing(rank, n, where, f"{target}")
    qual = target._schema.name
    if qual in aten.P2P:
        a = aten.bind(target, n_args, n_kwargs)
        (buf,) = a["tensors"]
        peer = _peer(a["dst"] if qual == "c10d::send" else a["src"], a["process_group"], root)
        if qual == "c10d::send":
            def send(run: Runner) -> bool:
                x = run.value(rank, buf)
                run.channels.setdefault((rank, peer), deque()).append(
                    (None if x is None else x.clone(), run.taint_of(rank, buf)))
                run.env[key] = None
                return True
            return send

        def recv(run: Runner) -> bool:
            q = run.channels.get((peer, rank))
            if not q:
                return False
            x, tainted = q.popleft()
            into = run.value(rank, buf)
            if x is not None and into is not None:
                into.copy_(x)
            if tainted or x is None or into is None:
                run.dirty_write(rank, buf)
            else:  # a buffer made by `empty` holds the received values now
                run.clean(rank, buf, into)
            run.env[key] = None
            return True
        return recv
    if qual in aten.WAITS:
        def wait(run: Runner) -> bool:
            run.env[key] = run.value(rank, n_args[0])
            if run.taint_of(rank, n_args):
                run.tainted.add(key)
            return True
        return wait
    if qual in _RUNNABLE:
        return _collective(rank, n, root, qual, where)
    if qual.split("::")[0] != "aten":
        return _refusing(rank, n, where, qual)
    # random numbers, and uninitialized memory (a read of it before a write is no constant)
    random = torch.Tag.nondeterministic_seeded in target.tags

    def call(run: Runner) -> bool:
        if qual in _SHAPE_ONLY and run.value(rank, n_args[0]) is not None and \
                not run.taint_of(rank, (n_args[1:], n_kwargs)):
            run.env[key] = target(*run.value(rank, n_args), **run.value(rank, n_kwargs))
            return True
        if qual in _OVERWRITING and not run.taint_of(rank, (n_args[1:], n_kwargs)):
            # writes every element of its first argument without reading it: that tensor holds
            # a constant now, whatever it held before (an `empty` buffer filled)
            dst = run.value(rank, n_args[0])
            if dst is not None:
                run.env[key] = target(dst, *run.value(rank, n_args[1:]), **run.value(rank, n_kwargs))
                run.clean(rank, n_args[0], dst)
                return True
        if qual in _UNINITIALIZED and not run.taint_of(rank, (n_args, n_kwargs)):
            run.env[key] = target(*run.value(rank, n_args), **run.value(rank, n_kwargs))
            run.dirty_write(rank, n)  # until a recv overwrites it
            return True
        if random or run.taint_of(rank, (n_args, n_kwargs)):
            run.tainted.add(key)
            # a tainted value is never needed; in-place ops taint what they write
            _taint_written(run, rank, target, n_args, n_kwargs)
            run.env[key] = None
            return True
        args, kwargs = run.value(rank, n_args), run.value(rank, n_kwargs)
        run.env[key] = target(*args, **kwargs)
        return True
    return call


# collectives the runner runs: a value exchanged among the ranks is known when what every rank
# sends is (a count the ranks agree on); it depends on the inputs when any rank's part does
_RUNNABLE = {
    "_c10d_functional::all_to_all_single", "_c10d_functional_autograd::all_to_all_single", "c10d::alltoall_base_",
    "_c10d_functional::all_reduce", "c10d::allreduce_",
    "_c10d_functional::all_gather_into_tensor", "c10d::_allgather_base_",
}


def _members(g: Any, root: torch.nn.Module) -> tuple[int, ...]:
    """A collective's group as global ranks (resolved while the rank's process group is current)."""
    if isinstance(g, fx.Node):  # legacy ops take the ProcessGroup as a script object
        pg = dist.ProcessGroup.unbox(getattr(root, g.target))  # type: ignore[arg-type]
    else:
        from torch.distributed.distributed_c10d import _resolve_process_group

        pg = _resolve_process_group(g)
    return tuple(int(r) for r in dist.get_process_group_ranks(pg))


def _collective(rank: int, n: fx.Node, root: torch.nn.Module, qual: str, where: str) -> Callable[[Runner], bool]:
    """A collective run concretely: each member posts its part, the last to come completes it.
    Legacy ones write their output buffer (or tensor list) in place, as recv does."""
    a = aten.bind(n.target, n.args, dict(n.kwargs))
    legacy = qual.startswith("c10d::")
    try:
        group = _members(a["process_group"] if legacy else a["group_name"], root)
    except (KeyError, ValueError, RuntimeError, AttributeError):  # a group gone (or none): refused only if run
        return _refusing(rank, n, where, f"{qual} over a process group capture cannot resolve")
    key = (rank, n)
    if qual == "c10d::allreduce_":
        (src,) = a["tensors"]
        dst = src
        code = getattr(root, a["reduce_op"].target)._get_method("op")()  # type: ignore[union-attr]
        op = dist.ReduceOp.RedOpType(code).name.lower()
    elif legacy:  # alltoall_base_, _allgather_base_: (output, input)
        src, dst = a["input"] if "input" in a else a["input_tensor"], a["output"] if "output" in a else a["output_tensor"]
        op = ""
    else:
        src, dst, op = a["input"], None, str(a.get("reduce_op", "")).lower()
    if op not in ("", "sum", "avg", "max"):
        return _refusing(rank, n, where, f"{qual} with reduce op {op}")
    kind = aten.FUNCTIONAL_COLLECTIVES.get(qual) or aten.LEGACY_COLLECTIVES.get(qual) or aten.LEGACY_WRITING[qual]
    splits = list(a.get("input_split_sizes") or [])  # uneven all_to_all: the sizes this rank sends

    def result(parts: list[tuple[torch.Tensor, list[int]]]) -> torch.Tensor:
        if kind == "all_reduce":
            stacked = torch.stack([p for p, _ in parts])
            return stacked.amax(0) if op == "max" else stacked.mean(0) if op == "avg" else stacked.sum(0)
        if kind == "all_gather":
            return torch.cat([p for p, _ in parts])
        me = group.index(rank)  # all_to_all: chunk `me` of every member's part, in member order
        return torch.cat([(p.split(s) if s else p.chunk(len(group)))[me] for p, s in parts])

    def collective(run: Runner) -> bool:
        if key not in run.slot:  # post this rank's part once; a retry only waits
            k = run.posted.get((group, rank), 0)
            run.posted[(group, rank)] = k + 1
            run.slot[key] = k
            x = run.value(rank, src)
            run.arrived.setdefault((group, k), {})[rank] = (
                None if x is None else x.clone(), splits, run.taint_of(rank, src) or x is None)
        got = run.arrived[(group, run.slot[key])]
        if len(got) < len(group):
            return False
        tainted = any(t for _, _, t in got.values())
        try:
            value = None if tainted else result([(got[g][0], got[g][1]) for g in group])  # type: ignore[misc]
        except (RuntimeError, ValueError, IndexError) as e:
            raise CaptureError(f"{where}: a scalar read needs {qual} run concretely, which failed: {e}") from e
        if dst is None:  # functional: a new tensor
            run.env[key] = value
            if tainted:
                run.tainted.add(key)
            return True
        into = run.value(rank, dst)
        if value is not None and into is not None:
            into.copy_(value.reshape(into.shape))
            run.clean(rank, dst, into)
        else:
            run.dirty_write(rank, dst)
        run.env[key] = ([into], None) if qual == "c10d::allreduce_" else None if kind == "all_to_all" else (into, None)
        if tainted:
            run.tainted.add(key)
        return True
    return collective


_OVERWRITING = {"aten::fill_", "aten::zero_", "aten::copy_"}  # in place, reading nothing of their first argument
_SHAPE_ONLY = {"aten::full_like", "aten::zeros_like", "aten::ones_like"}  # read their first argument's shape only
_UNINITIALIZED = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
                  "aten::new_empty_strided", "aten::empty_permuted"}


def _taint_written(run: Runner, rank: int, target: Any, args: Any, kwargs: dict[str, Any]) -> None:
    """An op not run (its value depends on the inputs) taints what it writes in place, with
    every view of it (the storage)."""
    a = aten.bind(target, args, kwargs)
    for arg in target._schema.arguments:
        v = a.get(arg.name)
        if arg.alias_info is not None and arg.alias_info.is_write:
            for w in v if isinstance(v, (list, tuple)) else [v]:
                if isinstance(w, fx.Node):
                    run.dirty_write(rank, w)


def _refusing(rank: int, n: fx.Node, where: str, what: str) -> Callable[[Runner], bool]:
    def refuse(run: Runner) -> bool:
        raise CaptureError(f"{where}: a scalar read (t.item(), int(t), bool(t)), data-dependent control flow or "
                           f"sizes unless its value is the same for every input: telling needs the trace run up to "
                           f"it, and it runs {what}, which capture cannot run concretely")
    return refuse


def _writes_first(target: Any) -> bool:
    q = target._schema.name
    return q in aten.LEGACY_WRITING or q in aten.LEGACY_COLLECTIVES or q == "c10d::recv_"


def _depends_on(run: Runner, p: Program, node: fx.Node) -> str:
    """The step's inputs a read's value is computed from: its tainted ancestors in the rank's
    graph (a buffer written in place, as by `dist.all_to_all_single(out, x)`, counts its writers
    as ancestors), the data inputs first."""
    graph = node.graph
    writers: dict[fx.Node, list[fx.Node]] = {}
    for n in graph.nodes:
        if isinstance(n.target, torch._ops.OpOverload):
            a = aten.bind(n.target, n.args, dict(n.kwargs))
            for i, arg in enumerate(n.target._schema.arguments):
                # c10d's in-place collectives and recv write their first argument, unannotated
                if (arg.alias_info is not None and arg.alias_info.is_write) or (i == 0 and _writes_first(n.target)):
                    v = a.get(arg.name)
                    for w in v if isinstance(v, (list, tuple)) else [v]:
                        if isinstance(w, fx.Node):
                            writers.setdefault(w, []).append(n)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in seen or not run.taint_of(p.rank, n):
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
        todo.extend(writers.get(n, []))
    if len(p.names) != len(placeholders):
        return ""
    found = [name for name, ph in zip(p.names, placeholders, strict=True) if ph in seen]
    shown = sorted(found, key=lambda name: "." in name)  # inputs (x, target) before parameters (a.b.weight)
    return ", ".join(shown[:6]) + (f" and {len(shown) - 6} more" if len(shown) > 6 else "")


def evaluate(programs: list[Program]) -> dict[int, list[int | float | bool]]:
    """Run the programs (each at least up to its cutoff; further only while another rank waits
    on it) and return each rank's read values, in order. A read of a value that depends on the
    step's inputs or on random numbers is refused."""
    run = Runner()
    at = {p.rank: 0 for p in programs}
    by_rank = {p.rank: p for p in programs}
    values: dict[int, list[int | float | bool]] = {p.rank: [] for p in programs}

    def advance(p: Program, limit: int) -> bool:
        moved = False
        while at[p.rank] < min(limit, len(p.steps)):
            if not p.steps[at[p.rank]](run):
                break
            at[p.rank] += 1
            moved = True
        return moved

    while True:
        moved = False
        for p in programs:
            moved |= advance(p, p.cutoff)
        if all(at[p.rank] >= p.cutoff for p in programs):
            break
        if not moved:  # ranks wait on sends past another rank's cutoff: run those ranks on
            for p in programs:
                if at[p.rank] >= p.cutoff and advance(p, at[p.rank] + 1):
                    moved = True
                    break
        if not moved:
            waiting = [p.where for p in programs if at[p.rank] < p.cutoff]
            raise CaptureError(f"a scalar read cannot be evaluated: {', '.join(waiting)} wait on recvs no rank sends "
                               "or on collectives not every member of their group reaches")
    for p in programs:
        for read in p.reads:
            key = (p.rank, read.node)
            if run.taint_of(p.rank, read.node):
                on = _depends_on(run, p, read.node)
                raise CaptureError(
                    f"{by_rank[p.rank].where}: the step reads a tensor's value (t.item(), int(t), t.tolist()) that "
                    f"depends on the step's inputs{' (' + on + ')' if on else ''} or on random numbers, which a trace "
                    "cannot follow: data-dependent control flow or sizes (a dropless MoE's all_to_all split sizes, "
                    "counted from its routing, are such sizes). Tracing on with the captured value would give graphs "
                    "right only for the inputs that give that value (one routing), no proof for every input, so "
                    "capture refuses; refine's sizes are static or declared symbols. A routed MoE captures with a "
                    "static capacity (tokens in groups, a fixed number of slots per expert: models/zoo/moe_gshard.py)",
                    read.source)
            values[p.rank].append(run.env[key].item())
    return values
