"""Scalar reads (`t.item()`, `int(t)`, `bool(t)`) of values that do not depend on the step's
inputs, resolved by running the ranks' traced programs concretely.

A trace cannot follow a Python branch on a tensor's value. When that value is a constant of the
distributed program, the same whatever the parameters and data (a protocol the ranks run among
themselves, as torch.distributed.pipelining's schedules vote on how to infer shapes: each stage
sends the product of the votes so far on, the last stage sends the result back, and every stage
branches on `result.item()`), capture can know it: it traces each rank until its first unknown
read, runs the traced prefixes of all ranks with real tensors (sends and recvs matched per pair
of ranks in program order), reads the value, and traces again with it; until no rank stops.

A read whose value depends on a parameter, buffer, input or random number is refused as before
(data-dependent control flow): baking such a value in would hold only for the captured inputs.
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


class Runner:
    """Runs several ranks' programs with real tensors, matching each pair's sends and recvs in order."""

    def __init__(self) -> None:
        self.env: dict[tuple[int, fx.Node], Any] = {}
        self.tainted: set[tuple[int, fx.Node]] = set()
        self.channels: dict[tuple[int, int], deque[tuple[torch.Tensor, bool]]] = {}
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
                 where: str) -> Program:
    """The steps of a rank's graph. Run inside the rank's process group, which the p2p ops name."""
    nodes = list(graph.nodes)
    steps: list[Callable[[Runner], bool]] = []
    # a step capture cannot run is refused at the user's line that reads the scalar
    at = next((f"{where}, at {r.source}" for r in reads if r.source), where)
    for n in nodes:
        steps.append(_step(rank, n, root, at))
    pos = {n: i for i, n in enumerate(nodes)}
    return Program(rank, steps, cutoff, [r for r in reads if r.node in pos], where)


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
            raise CaptureError(f"a scalar read cannot be evaluated: {', '.join(waiting)} wait on recvs no rank sends")
    for p in programs:
        for read in p.reads:
            key = (p.rank, read.node)
            if run.taint_of(p.rank, read.node):
                raise CaptureError(
                    f"{by_rank[p.rank].where}: the step branches on (or reads) a tensor's value that depends on "
                    "the step's inputs (parameters, data) or on random numbers, which a trace cannot follow: "
                    "data-dependent control flow", read.source)
            values[p.rank].append(run.env[key].item())
    return values
