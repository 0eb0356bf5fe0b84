"""Program order: can the ranks run their collectives and sends/receives to the end?

Matching (refine.relate.program, refine.frontends.graphfile) pairs the k-th collective of a
group on each member, and the j-th send from rank a to rank b with the j-th recv on b from a:
pure data. This module checks the other half of a distributed program's meaning: that the
order in which each rank issues those ops admits a run in which every rank finishes. A recv
placed before the send that feeds its peer, or all-reduces over overlapping groups issued in
an order that cycles across ranks, deadlock; such a program computes nothing, so it does not
refine.

The model (conservative: whatever it says finishes, finishes under any weaker semantics):

- A rank's program order is its graph's node order (refine.frontends.graphfile documents it): a
  rank runs its nodes one after another. Compute nodes never wait; their inputs come earlier in
  the order, so they are ready when the rank reaches them.
- Every communication op is a rendezvous that blocks its rank until each member has reached
  the matching op: a collective (all_reduce, all_gather, reduce_scatter, all_to_all,
  broadcast: the broadcast's source too) completes when every member of the group has
  reached its matching op; a send completes together with its matching recv, when both ranks
  have reached them. Sends are NOT buffered: NCCL (and MPI for large messages) can hold a send
  until its receive is posted, and NCCL documents that operations on different communicators
  issued in inconsistent orders can deadlock. A program that finishes with rendezvous sends
  finishes with buffered ones too (buffering only removes waits), so a run found here exists
  under either semantics.
- `dist.isend`/`dist.irecv` trace as the same ops as `dist.send`/`dist.recv` and their `wait()`
  is not in the graph: they are read as blocking at the point they are issued (the earliest the
  wait can be, so again conservative). So a ring written with every rank's `isend` first is
  reported as a deadlock although it runs: post such rings with `dist.batch_isend_irecv`. A
  batch (`batch_isend_irecv`, NCCL's group calls) is a set of sends/recvs posted together:
  consecutive sends/recvs of a rank with the same `batch` attribute are posted when the rank
  reaches the first, and the rank continues when all of them have completed (waited at once,
  however late the program waits). A send in a batch must not carry a value that depends on a
  recv of the same batch (it is posted before that recv completes).

Why one greedy simulation decides it: an event (one matched op, seen from all its members)
can fire once every member has posted it. Matching is fixed in advance (the k-th op of a
group, the j-th of a pair), not chosen at run time, so whether an event can fire depends
only on which steps the members have reached; and a rank leaves a step only after all its
events fired, so an event that can fire stays so until it does: firing one event never
disables another. Every run therefore fires a subset of the events the greedy simulation
fires (by induction along the run, each event it fires is enabled by earlier ones the
simulation fires too), and the simulation, which fires whatever can fire until nothing can,
is itself a run: some run finishes exactly when the simulation does, and the ranks it leaves
waiting are stuck in every run. Each op is posted once and fired once: linear in program size.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from refine.ir.graph import Graph, Node
from refine.ops.registry import Registry

Key = tuple[Any, ...]  # (group, k) for a collective, (("p2p", src, dst), j) for a send/recv


@dataclass
class Stuck:
    """A rank that can never go on: the communication op it waits at, and for whom
    (`deadlock`)."""

    rank: int
    node: str  # the rank node it waits at
    op: str
    source: str | None  # that node's source line
    waits_at: str  # the op, its peer or group and its number there
    waits_for: list[int]  # the ranks that never reach the matching op
    because: str  # those ranks and where each waits instead


@dataclass(frozen=True)
class Comm:
    """One communication op of one rank, and which event it belongs to."""

    rank: int
    index: int  # its position in the rank's node list
    node: Node
    key: Key
    members: tuple[int, ...]  # the ranks that take part in the event

    def describe(self) -> str:
        n, (what, k) = self.node, self.key
        if n.op == "send":
            return f"send {n.name!r} (send #{k} to rank {n.attrs['peer']})"
        if n.op == "recv":
            return f"recv {n.name!r} (recv #{k} from rank {n.attrs['peer']})"
        return f"{n.op} {n.name!r} (#{k} of group {list(what)})"


class ScheduleError(ValueError):
    """A batch that cannot be posted as written (a send carrying a value its own batch receives)."""


@dataclass
class Schedule:
    order: list[list[Comm]] = field(default_factory=list)  # events in an order they can fire, each its members' ops
    stuck: list[Stuck] = field(default_factory=list)  # empty: every rank runs to its end

    def __str__(self) -> str:
        return deadlock_text(self.stuck)


def comm_ops(graphs: Mapping[int, Graph], registry: Registry) -> dict[int, list[Comm]]:
    """Each rank's communication ops in program order, keyed the way refine.relate.program matches them."""
    out: dict[int, list[Comm]] = {}
    for r, g in sorted(graphs.items()):
        seen: dict[Any, int] = {}
        ops: list[Comm] = []
        for i, n in enumerate(g.nodes):
            if registry.ops[n.op].kind != "collective":
                continue
            if n.op in ("send", "recv"):
                src, dst = (r, n.attrs["peer"]) if n.op == "send" else (n.attrs["peer"], r)
                what: Any = ("p2p", src, dst)
                members: tuple[int, ...] = (src, dst)
            else:
                what = members = tuple(n.attrs.get("group") or ())
            k = seen.get(what, 0)
            seen[what] = k + 1
            ops.append(Comm(r, i, n, (what, k), members))
        out[r] = ops
    return out


def _steps(g: Graph, ops: list[Comm]) -> list[list[Comm]]:
    """A rank's ops grouped into what it posts at once: one op, or a batch of sends/recvs."""
    steps: list[list[Comm]] = []
    for c in ops:
        b = c.node.attrs.get("batch") if c.node.op in ("send", "recv") else None
        prev = steps[-1][-1].node if steps else None
        if b is not None and prev is not None and prev.op in ("send", "recv") and prev.attrs.get("batch") == b:
            steps[-1].append(c)
        else:
            steps.append([c])
    for step in steps:
        if len(step) > 1:
            _check_batch(g, step)
    return steps


def _check_batch(g: Graph, step: list[Comm]) -> None:
    """No send of a batch may carry a value computed from a recv of the same batch."""
    tainted = {c.node.name for c in step if c.node.op == "recv"}
    if not tainted:
        return
    for n in g.nodes[step[0].index:step[-1].index + 1]:
        if n.op == "send":
            bad = next((a for a in n.tensor_args() if a in tainted), None)
            if bad is not None and any(c.node is n for c in step):
                raise ScheduleError(f"rank {step[0].rank}: send {n.name!r} of batch {n.attrs['batch']} sends a value "
                                    f"computed from a recv of the same batch ({bad!r} depends on it): a batch is "
                                    "posted at once, before its receives complete")
        elif n.op != "recv" and any(a in tainted for a in n.tensor_args()):
            tainted.add(n.name)


def simulate(graphs: Mapping[int, Graph], registry: Registry) -> Schedule:
    """Run every rank as far as the rendezvous model lets it (see the module doc)."""
    ops = comm_ops(graphs, registry)
    steps = {r: _steps(graphs[r], ops[r]) for r in ops}
    posted: dict[Key, list[Comm]] = {}  # the members that reached each event so far
    pending = {r: 0 for r in steps}  # events of the rank's current step not fired yet
    pos = {r: 0 for r in steps}
    ready: deque[Key] = deque()
    sched = Schedule()

    def post(r: int) -> None:
        if pos[r] < len(steps[r]):
            step = steps[r][pos[r]]
            pending[r] = len(step)
            for c in step:
                if r not in c.members:
                    continue  # a rank outside the group never completes it
                got = posted.setdefault(c.key, [])
                got.append(c)
                if len(got) == len(c.members) and {x.rank for x in got} == set(c.members):
                    ready.append(c.key)

    for r in steps:
        post(r)
    while ready:
        event = posted.pop(ready.popleft())
        sched.order.append(event)
        for c in event:
            pending[c.rank] -= 1
            if pending[c.rank] == 0:
                pos[c.rank] += 1
                post(c.rank)
    fired = {(c.rank, c.index) for event in sched.order for c in event}
    sched.stuck = _stuck(graphs, steps, pos, posted, fired)
    return sched


def _stuck(graphs: Mapping[int, Graph], steps: dict[int, list[list[Comm]]], pos: dict[int, int],
           posted: dict[Key, list[Comm]], fired: set[tuple[int, int]]) -> list[Stuck]:
    """Where each rank that cannot finish waits, and for whom."""
    waiting = {r: [c for c in steps[r][p] if (r, c.index) not in fired]
               for r, p in pos.items() if p < len(steps[r])}
    out = []
    for r, ops in sorted(waiting.items()):
        for c in ops:
            arrived = {x.rank for x in posted.get(c.key, [])}
            peers = [q for q in c.members if q not in arrived]
            why = []
            for q in peers:
                if q not in graphs:
                    why.append(f"rank {q}, which does not exist")
                elif q in waiting:
                    at = waiting[q][0]
                    src = f" at {at.node.source}" if at.node.source else ""
                    why.append(f"rank {q}, which waits at {at.describe()}{src}")
                else:
                    why.append(f"rank {q}, which ends without reaching the matching op")
            if r not in c.members:
                why.append(f"nobody: rank {r} is not a member of group {list(c.members)}")
            out.append(Stuck(r, c.node.name, c.node.op, c.node.source, c.describe(), peers, "; ".join(why)))
    return out


def deadlock(graphs: Mapping[int, Graph], registry: Registry) -> list[Stuck]:
    """Where the ranks get stuck (empty when every rank runs to its end)."""
    return simulate(graphs, registry).stuck


def deadlock_text(stuck: list[Stuck]) -> str:
    lines = ["the ranks deadlock (communication ops block until every partner reaches the matching op):"]
    for s in stuck:
        src = f" at {s.source}" if s.source else ""
        lines.append(f"  rank {s.rank} waits at {s.waits_at}{src} for {s.because}")
    return "\n".join(lines)
