"""Capture a whole training step, sequential and per rank, as a checkable pair of documents.

    spec = Spec(sequential=Step(model, train_step, {"x": x, "target": t}),
                rank=lambda r: Step(tp_model(r), train_step, {"x": x, "target": t}),
                world_size=2)
    case = capture(spec)            # traces, translates, derives relations, validates
    report = case.check()           # or refine.check(*case)
    case.write("case/")             # case/seq.json, case/dist.json

Outputs: `loss` (role loss) and `<param>.grad` (role gradient) for every parameter that got
a gradient; a gradient missing on one side is an error. A parameter the step changes in place
(an optimizer step after backward) has `<param>.updated`, its value after the step; one the
sequential step updates and a rank leaves as it was is an error. Expectations: the loss is
Replicate and equal to the sequential loss (or, when only some ranks return a loss, a layout
over those ranks' losses); each gradient and updated parameter is placed like its parameter
(a DTensor parameter's gradient: as the program's DTensor gradient is; a part of a flat
shard's: in the flat gradient's, or updated shard's, layout). A parameter only some ranks hold whole (a tied embedding on
the first and last pipeline stage) is related to each copy by a list of replica layouts
(matched by name and shape, so flagged as guessed), and its gradient must equal the
sequential one on every rank holding it.

Steps that call backward() several times (gradient accumulation) are unrolled: each backward
is its own piece of the graph, and the `.grad` the step leaves is the sum of the
micro-batches' gradients, which is what is checked.

Input relations come from annotations (refine.frontends.capture.annotate), else from
matching names and comparing shapes (guesses, reported); every relation is then checked
against the values both sides hold (refine.frontends.capture.values): a contradiction is an
error, a tensor without values (meta) leaves its relation unchecked, listed in
`Case.unchecked` and in every report of the case.
"""

from __future__ import annotations

import copy
import re
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from refine.frontends.build import write_case
from refine.frontends.capture import scalars
from refine.frontends.capture.annotate import (
    Annotation,
    check_groups,
    collecting,
    flat_layout,
    padded_layouts,
    placements_on,
    submesh_layouts,
    watching,
)
from refine.frontends.capture.convert import Converted, convert, updated_name
from refine.frontends.capture.dtensor import local_distribution
from refine.frontends.capture.errors import CaptureError
from refine.frontends.capture.trace import (
    Step,
    Traced,
    copy_grad_hooks,
    fake_process_group,
    trace_step,
)
from refine.frontends.capture.values import check_values, has_values
from refine.frontends.graphfile import FORMAT, VERSION, load_dist, load_seq
from refine.ir.errors import InputError
from refine.ir.graph import Dist, Graph
from refine.ops.interp import close, eval_graph, max_err
from refine.ops.registry import Registry, load_registry
from refine.verdict.report import Report

# a tensor only some ranks hold: those ranks, and its placements within their groups (None:
# an explicit layout), refine.frontends.capture.annotate.submesh_layouts
Held = tuple[list[int], list[str] | None]


@dataclass
class Spec:
    """What to capture. `rank(r)` runs inside rank r's (fake) process group, so it may call
    `dist.get_rank()` and `dist.new_group(...)`; it returns that rank's Step. `mesh` names
    the axes (sizes multiply to `world_size`, ranks row-major); default one axis "world"."""

    sequential: Step | Callable[[], Step]
    rank: Callable[[int], Step]
    world_size: int = 2
    mesh: dict[str, int] | None = None
    name: str = "case"
    replay: bool = True  # check the captured sequential graph against an eager float64 run

    def axes(self) -> dict[str, int]:
        mesh = dict(self.mesh or {"world": self.world_size})
        size = 1
        for s in mesh.values():
            size *= s
        if size != self.world_size:
            raise CaptureError(f"mesh {mesh} has {size} ranks but world_size is {self.world_size}")
        return mesh


@dataclass
class Case:
    """A captured pair: the documents, the loaded graphs, and what capture guessed."""

    name: str
    seq_doc: dict[str, Any]
    dist_doc: dict[str, Any]
    seq: Graph
    dist: Dist
    registry: Registry
    guesses: list[str] = field(default_factory=list)  # relations derived from names and shapes only
    notes: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    # relations not checked against values (tensors on the meta device): assumed, like guesses
    unchecked: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[Any]:
        # refine.check(*case) takes (seq, dist, registry)
        return iter((self.seq, self.dist, self.registry))

    def check(self) -> Report:
        from refine.check import check

        report = check(self.seq, self.dist, self.registry, f"{self.name}/seq.json", f"{self.name}/dist.json")
        # the document flags the guesses; capture knows why it made each one
        why = {g.split(":")[0]: g for g in self.guesses}
        report.guesses = [why.get(g.split(":")[0], g) for g in report.guesses] + self.unchecked
        return report

    def write(self, directory: str | Path) -> None:
        write_case(directory, self.seq_doc, self.dist_doc)

    def summary(self) -> str:
        s = self.stats
        lines = [f"captured {self.name}: sequential step {s['seq_nodes']} nodes; {s['ranks']} ranks "
                 f"(mesh {', '.join(f'{a}={n}' for a, n in s['mesh'].items())}), "
                 f"{s['rank_nodes']} nodes, {s['collectives']} collectives; {s['seconds']} s"]
        lines.append("outputs: " + ", ".join(o["name"] for o in self.seq_doc["graph"]["outputs"]))
        lines.append("relations:")
        guessed = {g.split(":")[0] for g in self.guesses}
        unchecked = {u.split(":")[0] for u in self.unchecked}
        for r in self.dist_doc["relations"]:
            how = r.get("layout") or "[" + ", ".join(r["placements"]) + "]"
            local = f" (rank input {r['input']})" if "input" in r else ""
            lines.append(f"  {r['from']}{local}: {how}" + ("  GUESSED" if r["from"] in guessed else "")
                         + ("  UNCHECKED" if r["from"] in unchecked else ""))
        explicit = {r["from"] for r in self.dist_doc["relations"]}
        for g in self.guesses:
            if g.split(":")[0] not in explicit:
                lines.append(f"  {g}  GUESSED")
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"unchecked: {u}" for u in self.unchecked]
        ops = ", ".join(f"{k} x{v}" for k, v in sorted(s["aten_ops"].items()))
        lines.append(f"aten ops: {ops}")
        return "\n".join(lines)


@dataclass
class _Rank:
    traced: Traced
    converted: Converted
    annotations: dict[str, Annotation]


def _lost(t: torch.Tensor, received: list[Any]) -> str | None:
    """Why an annotated tensor's annotation would be lost, or None: it was annotated inside
    the traced step (a fake value, not an input), or the step receives another tensor on its
    storage (a view or a detach made after the annotation). A tensor annotated and then
    dropped (a module replaced) is no input of the step and is no loss either."""
    if any(v is t for v in received):
        return None
    if is_fake(t):
        return "it is a value inside the traced step"
    ptr = t.untyped_storage().data_ptr() if t.device.type != "meta" else 0
    if ptr != 0 and any(isinstance(v, torch.Tensor) and not is_fake(v) and v.device.type != "meta"
                        and v.untyped_storage().data_ptr() == ptr for v in received):
        return "the step receives a view of it: an op applied after the annotation made a new tensor, which has none"
    return None


def capture(spec: Spec, registry: Registry | None = None) -> Case:
    """Trace the sequential step and every rank's, translate them to refine graphs, derive the
    input relations and the output expectations, and validate the pair with refine's loader."""
    t0 = time.perf_counter()
    if not isinstance(spec, Spec):
        raise CaptureError(f"capture takes a refine.capture.Spec, got {type(spec).__name__}")
    registry = registry or load_registry()
    mesh = spec.axes()
    seq_step = spec.sequential if isinstance(spec.sequential, Step) else spec.sequential()
    with collecting() as named:
        seq_tr = _trace_sequential(seq_step)
    if named:
        raise CaptureError(f"the sequential step annotates {sorted(named)}: annotations describe rank tensors")
    seq_cv = convert(seq_tr, registry, "the sequential step")
    t_seq = time.perf_counter() - t0
    ranks: dict[int, _Rank] = {}
    known: dict[int, list[Any]] = {r: [] for r in range(spec.world_size)}  # scalar reads resolved so far
    programs: dict[int, scalars.Program] = {}  # each rank's trace (prefix) as a program to run concretely
    pending = list(range(spec.world_size))
    while pending:  # trace; ranks stopped at an unknown scalar read are traced again once it is known
        stopped: list[int] = []
        for r in pending:
            traced = _trace_rank(spec, r, known[r], registry)
            if isinstance(traced, scalars.Program):
                programs[r] = traced
                stopped.append(r)
            else:
                ranks[r], programs[r] = traced
        if stopped:
            for r, got in scalars.evaluate(list(programs.values())).items():
                if r in stopped:
                    known[r].append(got[-1])
        pending = stopped
    if any(rk.traced.reads for rk in ranks.values()):
        # the final traces must give every read the value it took
        final = scalars.evaluate(list(programs.values()))
        for r, got in final.items():
            if got != known[r]:
                raise CaptureError(f"rank {r}: its scalar reads gave {got} on the final trace, but the trace took "
                                   f"{known[r]}: the traced program is not deterministic")
    t_ranks = time.perf_counter() - t0 - t_seq

    notes: list[str] = []
    relations, placed, guesses, held, flat_grads, grad_layouts = _relations(seq_cv, ranks, mesh)
    expectations = _expectations(seq_tr, ranks, placed, mesh, notes, held, flat_grads, grad_layouts)
    seq_doc = {"format": FORMAT, "version": VERSION, "kind": "sequential", "graph": seq_cv.graph}
    dist_doc = {
        "format": FORMAT, "version": VERSION, "kind": "distributed",
        "mesh": {"axes": [{"name": a, "size": n} for a, n in mesh.items()]},
        "ranks": [{"rank": r, "graph": rk.converted.graph} for r, rk in sorted(ranks.items())],
        "relations": relations, "expectations": expectations,
    }
    seq, dist = _load(seq_doc, dist_doc, registry)
    if spec.replay:
        _replay(seq_step, seq_tr, seq_cv, seq, registry, notes)
    # the relations are the proof's assumptions: the values both sides hold must meet them
    unchecked = check_values(seq, dist, registry, _values(seq_tr, seq_cv),
                             {r: _values(rk.traced, rk.converted) for r, rk in ranks.items()})
    aten_ops: Counter[str] = Counter(seq_cv.aten_ops)
    for rk in ranks.values():
        aten_ops.update(rk.converted.aten_ops)
    stats = {
        "seconds": round(time.perf_counter() - t0, 2), "trace_seq_seconds": round(t_seq, 2),
        "trace_ranks_seconds": round(t_ranks, 2), "seq_nodes": len(seq.nodes),
        "rank_nodes": sum(len(g.nodes) for g in dist.ranks.values()), "ranks": spec.world_size, "mesh": mesh,
        "collectives": sum(1 for g in dist.ranks.values() for n in g.nodes
                           if registry.ops[n.op].kind == "collective"),
        "aten_ops": dict(aten_ops),
        # the values of the ranks' scalar reads (refine.frontends.capture.scalars), by rank
        "scalar_reads": {r: list(v) for r, v in known.items() if v},
    }
    return Case(spec.name, seq_doc, dist_doc, seq, dist, registry, guesses, notes, stats, unchecked)


def _trace_sequential(step: Step) -> Traced:
    """The sequential step's trace. Its scalar reads are resolved as the ranks' are (a read of a
    constant traced as its value); when that fails (a read of an input-dependent value, or one
    the runner cannot reach), the step is traced by make_fx alone, as it always was: a read whose
    value nothing uses stays a dead node, but one that reaches a size or a value (torch traces it
    as an unbacked symbol, which refine has no counterpart for) is refused with the reason the
    resolution gave: its line and the inputs it depends on."""
    where = "the sequential step"
    known: list[Any] = []
    try:
        while True:
            try:
                tr = trace_step(step, where, scalars.Reads(known=list(known)))
            except scalars.Unresolved as u:
                program = scalars.compile_rank(0, u.graph, u.root, u.read.cutoff, [u.read], where, u.names)
                known.append(scalars.evaluate([program])[0][-1])
                continue
            if tr.reads:  # the final trace must give every read the value it took
                program = scalars.compile_rank(0, tr.gm.graph, tr.gm, max(x.cutoff for x in tr.reads), tr.reads,
                                               where, [n for n, _, _ in tr.inputs])
                if (got := scalars.evaluate([program])[0]) != known:
                    raise CaptureError(f"{where}: its scalar reads gave {got} on the final trace, but the trace "
                                       f"took {known}: the traced program is not deterministic")
            return tr
    except CaptureError as refused:
        try:
            tr = trace_step(step, where)
        except CaptureError:
            raise refused from None
        if _symbolic(tr.gm.graph):
            raise refused from None
        return tr


def _symbolic(graph: Any) -> bool:
    """Whether a value or a size of the graph is one of torch's symbols (an unbacked scalar read
    that is used: a dead read of a logged value is not)."""
    def has(v: Any) -> bool:
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return True
        if isinstance(v, torch.Tensor):
            return any(not isinstance(s, int) for s in v.shape)
        return isinstance(v, (list, tuple)) and any(has(x) for x in v)
    return any(has(n.meta.get("val")) for n in graph.nodes
               if not (n.target is torch.ops.aten._local_scalar_dense.default and not n.users))


def _trace_rank(spec: Spec, r: int, known: list[Any], registry: Registry
                ) -> tuple[_Rank, scalars.Program] | scalars.Program:
    """Rank r's trace, converted (and as a program to run its scalar reads), or, if it stopped at
    a scalar read not in `known`, the program of its prefix up to that read."""
    where = f"rank {r}"
    with fake_process_group(r, spec.world_size), collecting() as named, watching() as made:
        try:
            with local_distribution():
                step = spec.rank(r)
        except CaptureError:
            raise
        except Exception as e:
            from refine.frontends.capture.trace import exception_source

            raise CaptureError(f"{where}: the rank factory failed: {type(e).__name__}: {e}",
                               exception_source(e)) from e
        try:
            tr = trace_step(step, where, scalars.Reads(known=list(known)))
        except scalars.Unresolved as u:  # p2p peers resolve in the rank's process group: compile here
            return scalars.compile_rank(r, u.graph, u.root, u.read.cutoff, [u.read], where, u.names)
        program = scalars.compile_rank(r, tr.gm.graph, tr.gm, max((x.cutoff for x in tr.reads), default=0),
                                       tr.reads, where, [n for n, _, _ in tr.inputs])
        cv = convert(tr, registry, where)
    names = {n for n, _, _ in tr.inputs}
    unknown = sorted(set(named) - names)
    if unknown:
        raise CaptureError(f"{where}: annotated {unknown}, which are not inputs of the rank's step "
                           f"(parameters, buffers and inputs: {', '.join(sorted(names))})")
    received = [v for _, _, v in tr.inputs]
    for t, ann, line in made:
        if (why := _lost(t, received)) is not None:
            raise CaptureError(
                f"{where}: the tensor annotated {ann.describe()} at {line} (shape {tuple(t.shape)}) is not a "
                f"parameter, buffer or input of the rank's step; {why}. Annotate the tensor the step receives "
                "(capture.shard(x.squeeze(0), 0), not capture.shard(x, 0).squeeze(0)).")
    return _Rank(tr, cv, tr.annotations | named), program


def _values(traced: Traced, conv: Converted) -> dict[str, torch.Tensor]:
    """Each graph input's value as the step holds it (a DTensor's local tensor)."""
    from refine.frontends.capture.dtensor import is_dtensor

    out = {n: (v.to_local() if is_dtensor(v) else v).detach() for n, _, v in traced.inputs}  # type: ignore[attr-defined]
    return out | conv.constants


def _relations(seq_cv: Converted, ranks: dict[int, _Rank], mesh: dict[str, int]
               ) -> tuple[list[dict[str, Any]], dict[str, tuple[str, list[str] | None]], list[str],
                          dict[str, Held], dict[str, tuple[tuple[str, int, tuple[int, ...]], list[int]]],
                          dict[str, list[str]]]:
    """A relation per sequential input; `placed`: input -> (rank input, placements or None
    for a layout); `held`: inputs that only some ranks hold (pipeline stages, and their
    tensor-parallel groups) -> those ranks and the placements within their groups (None for an
    explicit layout); `flat_grads`: inputs that are parts of a flat shard -> the part and its ranks;
    `grad_layouts`: inputs held as padded shards -> their gradient's layouts.
    Replicate guesses are left out of the document: the checker makes the same guess and
    flags it."""
    axes = list(mesh)
    relations: list[dict[str, Any]] = []
    placed: dict[str, tuple[str, list[str] | None]] = {}
    guesses: list[str] = []
    held: dict[str, Held] = {}
    flat_grads: dict[str, tuple[tuple[str, int, tuple[int, ...]], list[int]]] = {}  # input -> its flat part, ranks
    grad_layouts: dict[str, list[str]] = {}
    rank_inputs = {r: {i["name"]: i for i in rk.converted.graph["inputs"]} for r, rk in ranks.items()}
    for inp in seq_cv.graph["inputs"]:
        s = inp["name"]
        if s in seq_cv.constants:
            missing = [r for r in ranks if s not in rank_inputs[r]]
            if missing:
                raise CaptureError(f"the sequential step uses a constant tensor {list(inp['shape'])} ({s}) that rank "
                                   f"{missing[0]} does not use: make it a buffer or an input of both, and annotate it")
            relations.append({"from": s, "placements": ["Replicate"] * len(axes)})  # equal contents, equal name
            placed[s] = (s, ["Replicate"] * len(axes))
            continue
        local, holders = _local_name(s, ranks, rank_inputs)
        if len(holders) < len(ranks):  # a pipeline stage's parameter or data: held by its ranks only
            anns = {r: ranks[r].annotations.get(local) for r in holders}
            if all(a is None for a in anns.values()):
                bad = [r for r in holders if tuple(rank_inputs[r][local]["shape"]) != tuple(inp["shape"])]
                if bad:
                    raise CaptureError(f"{local!r} is held by ranks {holders} only, and rank {bad[0]} holds shape "
                                       f"{rank_inputs[bad[0]][local]['shape']}, not the sequential "
                                       f"{list(inp['shape'])}: annotate how its holders split it "
                                       "(refine.capture.shard(t, dim, axis=...))")
                relations.append({"from": s, "layout": [f"{local}@{r}" for r in holders], "guessed": True})
                placed[s], held[s] = (local, None), (holders, ["Replicate"] * len(axes))
                guesses.append(f"{s}: held whole by ranks {holders} (same name and shape; the other ranks do not use it)")
                continue
            pl = _held_placements(anns, mesh, local)
            if isinstance(pl, str):  # an explicit layout over the holders' tensors
                relations.append({"from": s, "layout": pl})
                placed[s], held[s] = (local, None), (holders, None)
                continue
            relations.append({"from": s, "layout": submesh_layouts(local, pl, mesh, holders, repr(local))})
            placed[s], held[s] = (local, None), (holders, pl)
            continue
        anns = {r: ranks[r].annotations.get(local) for r in ranks}
        distinct = {a.layout if a and a.layout else (tuple(a.placements), a.padded) if a else None for a in anns.values()}
        if len(distinct) > 1:
            shown = "; ".join(f"rank {r}: {a.describe() if a else 'none'}" for r, a in sorted(anns.items()))
            raise CaptureError(f"{local!r} is annotated differently on different ranks ({shown})")
        for r, a in anns.items():
            if a is not None:
                check_groups(a, mesh, r, repr(local))
        ann = anns[min(anns)]
        rel: dict[str, Any] = {"from": s}
        if ann is not None and ann.padded is not None:  # FSDP2's padded dim-0 shards
            relations.append({"from": s, "layout": padded_layouts(local, ann, mesh, repr(local))})
            placed[s] = (local, None)
            grad_layouts[s] = padded_layouts(f"{local}.grad", ann, mesh, repr(local))
            continue
        if ann is not None and ann.flat:
            part, order = _flat_part(ann, s, local, mesh)
            relations.append({"from": s, "layout": flat_layout(local, part, order)})
            placed[s] = (local, None)
            flat_grads[s] = (part, order)
            continue
        if local != s:
            rel["input"] = local
        if ann is not None and ann.layout is not None:
            relations.append({"from": s, "layout": ann.layout})
            placed[s] = (local, None)
            continue
        if ann is not None:
            pl = placements_on(ann, axes, repr(local))
            relations.append(rel | {"placements": pl})
            placed[s] = (local, pl)
            continue
        shapes = {tuple(rank_inputs[r][local]["shape"]) for r in ranks}
        if len(shapes) != 1:
            raise CaptureError(f"{local!r} has shapes {sorted(map(list, shapes))} on different ranks: refine cannot "
                               "guess its relation; annotate it (refine.capture.shard/replicate/layout)")
        (shape,) = shapes
        pl, why = _guess(tuple(inp["shape"]), shape, mesh)
        if pl is None:
            raise CaptureError(f"cannot guess how {local!r} {list(shape)} on the ranks holds the sequential "
                               f"{s!r} {list(inp['shape'])}: {why}; annotate it (refine.capture.shard/replicate/layout)")
        desc = ", ".join(pl)
        guesses.append(f"{s}: [{desc}] ({why})")
        if any(p != "Replicate" for p in pl) or local != s:
            relations.append(rel | {"placements": pl, "guessed": True})
        placed[s] = (local, pl)
    return relations, placed, guesses, held, flat_grads, grad_layouts


def _held_placements(anns: dict[int, Annotation | None], mesh: dict[str, int], local: str) -> list[str] | str:
    """The placements (or explicit layout) of a tensor only the ranks `anns` hold: every holder
    must annotate it alike."""
    distinct = {(a.layout, a.placements, a.padded, a.flat) if a else None for a in anns.values()}
    if len(distinct) > 1:
        shown = "; ".join(f"rank {r}: {a.describe() if a else 'none'}" for r, a in sorted(anns.items()))
        raise CaptureError(f"{local!r}, held by ranks {sorted(anns)} only, is annotated differently on them ({shown})")
    ann = anns[min(anns)]
    assert ann is not None
    if ann.padded is not None or ann.flat:
        raise CaptureError(f"{local!r} is {ann.describe()} held by ranks {sorted(anns)} only: refine relates flat and "
                           "padded shards held by every rank")
    for r, a in anns.items():
        check_groups(a, mesh, r, repr(local))  # type: ignore[arg-type]
    if ann.layout is not None:
        return ann.layout
    return placements_on(ann, list(mesh), repr(local))


def _flat_part(ann: Annotation, s: str, local: str, mesh: dict[str, int]
               ) -> tuple[tuple[str, int, tuple[int, ...]], list[int]]:
    """The part `s` of flat shard `local` and the ranks holding its shards, in order: every
    rank of a one-axis mesh (or of the world, no axis named)."""
    (part,) = [f for f in ann.flat if f[0] == s]
    axis = ann.flat_axis
    if axis is not None and axis not in mesh:
        raise CaptureError(f"{local!r} is annotated a flat shard along axis {axis!r}, which the mesh does not have "
                           f"(axes: {', '.join(mesh)})")
    if axis is not None and len(mesh) > 1:
        raise CaptureError(f"{local!r} is a flat shard along axis {axis!r} of a mesh of several axes ({mesh}): refine "
                           "relates flat shards over every rank only; shard over the whole world (axis=None)")
    world = 1
    for n in mesh.values():
        world *= n
    return part, list(range(world))


def _local_name(s: str, ranks: dict[int, _Rank], rank_inputs: dict[int, dict[str, Any]]) -> tuple[str, list[int]]:
    """The rank input holding sequential input `s` (the one annotated seq=s, else `s` itself)
    and the ranks that hold it (all of them, unless the program is split into stages)."""
    found: dict[int, str] = {}
    for r, rk in ranks.items():
        named = [n for n, a in rk.annotations.items() if a.seq == s or any(f[0] == s for f in a.flat)]
        if len(named) > 1:
            raise CaptureError(f"rank {r}: {named} are all annotated as pieces of {s!r}")
        if named:
            found[r] = named[0]
        elif s in rank_inputs[r] and not (rk.annotations.get(s) and (rk.annotations[s].seq not in (None, s)
                                                                      or rk.annotations[s].flat)):
            found[r] = s
    if not found:
        raise CaptureError(f"sequential input {s!r} has no counterpart on any rank: no rank input has that name "
                           f"or is annotated seq={s!r}")
    if len(set(found.values())) > 1:
        raise CaptureError(f"sequential input {s!r} is held by differently named rank inputs "
                           f"({', '.join(f'rank {r}: {n}' for r, n in sorted(found.items()))}); one name on every rank")
    return next(iter(found.values())), sorted(found)


def _guess(seq: tuple[int, ...], local: tuple[int, ...], mesh: dict[str, int]) -> tuple[list[str] | None, str]:
    """Placements from shapes alone: equal shapes are Replicate; one dim divided by a mesh
    axis's size (or by all ranks) is Shard(d) along it."""
    axes = list(mesh)
    if len(seq) != len(local):
        return None, f"the ranks hold {len(local)} dims, the sequential tensor {len(seq)}"
    diff = [d for d, (a, b) in enumerate(zip(seq, local, strict=True)) if a != b]
    if not diff:
        return ["Replicate"] * len(axes), "same name and shape on every rank"
    if len(diff) > 1:
        return None, f"dims {diff} differ"
    d = diff[0]
    if local[d] == 0 or seq[d] % local[d]:
        return None, f"dim {d} ({local[d]} on the ranks) does not divide {seq[d]}"
    k = seq[d] // local[d]
    by = [a for a in axes if mesh[a] == k]
    total = 1
    for n in mesh.values():
        total *= n
    if len(by) == 1:
        return [f"Shard({d})" if a == by[0] else "Replicate" for a in axes], \
            f"dim {d} is 1/{k} of the sequential size; mesh axis {by[0]!r} has {k} ranks"
    if not by and k == total:
        return [f"Shard({d})"] * len(axes), f"dim {d} is 1/{k} of the sequential size, split over all ranks"
    if by:
        return None, f"dim {d} is 1/{k} of the sequential size and mesh axes {by} all have {k} ranks"
    return None, f"dim {d} is 1/{k} of the sequential size, which is no mesh axis's size"


def _expectations(seq_tr: Traced, ranks: dict[int, _Rank], placed: dict[str, tuple[str, list[str] | None]],
                  mesh: dict[str, int], notes: list[str], held: dict[str, Held],
                  flat_grads: dict[str, tuple[tuple[str, int, tuple[int, ...]], list[int]]],
                  grad_layouts: dict[str, list[str]]) -> list[dict[str, Any]]:
    """The loss is Replicate (or equal on each rank that computes one: a pipeline's last
    stage); each gradient is placed like its parameter (a parameter only some ranks hold: in
    each copy its holders' groups make, as the parameter is; a part of a flat shard's, in the
    flat gradient's shards as the part is in the parameter's)."""
    with_loss = [r for r, rk in sorted(ranks.items()) if rk.traced.has_loss]
    if not with_loss:
        raise CaptureError("no rank's step returns the loss (each returned None)")
    if len(with_loss) == len(ranks) and any(rk.traced.ddp for rk in ranks.values()):
        # a DDP rank's loss is its batch shard's; DDP averages the gradients, so the loss is
        # the ranks' mean (or, when the step averages it for logging, the same on each)
        notes.append("loss: each DistributedDataParallel rank returns its own batch shard's; checked by the default "
                     "(Replicate, the ranks' mean, ...)")
        out: list[dict[str, Any]] = []
    else:
        out = [{"output": "loss", "placements": ["Replicate"] * len(mesh)} if len(with_loss) == len(ranks) else
               {"output": "loss", "layout": [f"loss@{r}" for r in with_loss]}]
    for p in seq_tr.no_grad:
        notes.append(f"parameter {p!r} requires grad but gets none in the sequential step: no gradient output")
    for p in seq_tr.grads:
        local, pl = placed[p]
        holders = held[p][0] if p in held else sorted(ranks)
        for r in holders:
            if local not in ranks[r].traced.grads:
                raise CaptureError(
                    f"the sequential step has a gradient for {p!r} but rank {r} has none for "
                    f"{local!r} (its .grad is None after the step: is the parameter used, does the loss reach it?)")
        if p in held:
            # a DTensor gradient is placed as the program's autograd made it
            hpl = _grad_placement(ranks, local, mesh, holders) or held[p][1]
            if hpl is None or any(x.startswith("Partial") for x in hpl):
                notes.append(f"{p}.grad: no expected placement ({p!r}, held by ranks {holders}, is not placed by "
                             "Replicate/Shard); it must be reconstructible from the rank outputs (the default)")
                continue
            out.append({"output": f"{p}.grad", "layout": submesh_layouts(f"{local}.grad", hpl, mesh, holders,
                                                                          f"{local!r}.grad")})
            continue
        if p in flat_grads:
            out.append({"output": f"{p}.grad", "layout": [flat_layout(f"{local}.grad", *flat_grads[p])]})
            continue
        if p in grad_layouts:
            out.append({"output": f"{p}.grad", "layout": grad_layouts[p]})
            continue
        derived = _grad_placement(ranks, local, mesh)
        if derived is not None:  # a DTensor gradient: placed as the program's autograd made it
            pl = derived
        elif pl is None or any(x.startswith("Partial") for x in pl):
            notes.append(f"{p}.grad: no expected placement ({p!r} is not placed by Replicate/Shard); it must be "
                         "checked by the default: a standard placement of the ranks' copies, or reconstructible from the rank "
                         "outputs when the names differ")
            continue
        ex: dict[str, Any] = {"output": f"{p}.grad", "placements": pl}
        if local != p:
            ex["local"] = f"{local}.grad"
        out.append(ex)
    for p in seq_tr.updated:  # parameters the step updates in place: placed like the parameter
        local, pl = placed[p]
        name = updated_name(p)
        holders = held[p][0] if p in held else sorted(ranks)
        for r in holders:
            if local not in ranks[r].traced.updated:
                raise CaptureError(f"the sequential step updates {p!r} in place but rank {r} leaves {local!r} as it was")
        if p in held and held[p][1] is not None and not any(x.startswith("Partial") for x in held[p][1]):
            out.append({"output": name, "layout": submesh_layouts(updated_name(local), held[p][1], mesh, holders,
                                                                   repr(updated_name(local)))})
        elif p in held:
            notes.append(f"{name}: no expected placement ({p!r}, held by ranks {holders}, is not placed by "
                         "Replicate/Shard); checked by the default")
        elif p in flat_grads:
            out.append({"output": name, "layout": [flat_layout(updated_name(local), *flat_grads[p])]})
        elif pl is not None and not any(x.startswith("Partial") for x in pl):
            out.append({"output": name, "placements": pl} | ({"local": updated_name(local)} if local != p else {}))
        else:
            notes.append(f"{name}: no expected placement ({p!r} is not placed by Replicate/Shard); checked by the "
                         "default")
    with_grad = {placed[p][0] for p in seq_tr.grads}
    for r, rk in sorted(ranks.items()):
        extra = [g for g in rk.traced.grads if g not in with_grad]
        if extra:
            notes.append(f"rank {r} has gradients for {extra}, which have no sequential gradient to compare with")
    return out


def _grad_placement(ranks: dict[int, _Rank], local: str, mesh: dict[str, int], holders: list[int] | None = None
                    ) -> list[str] | None:
    """The placement a framework states for `local`'s gradient (a DTensor's), if any, on the
    ranks holding it (`holders`, default all)."""
    anns = {r: rk.traced.grad_annotations.get(local) for r, rk in ranks.items() if holders is None or r in holders}
    if all(a is None for a in anns.values()):
        return None
    pls = {r: placements_on(a, list(mesh), f"{local}.grad") if a is not None else None for r, a in anns.items()}
    if len({tuple(p) if p else None for p in pls.values()}) > 1:
        raise CaptureError(f"{local}.grad is placed differently on different ranks: {pls}")
    for r, a in anns.items():
        check_groups(a, mesh, r, f"{local}.grad")  # type: ignore[arg-type]
    return pls[min(pls)]


def _replay(step: Step, traced: Traced, conv: Converted, seq: Graph, registry: Registry, notes: list[str]) -> None:
    """Evaluate the captured sequential graph with refine's interpreter on the model's own
    values and compare it with the step run eagerly (both in float64): a translation that
    changed what the step computes must never reach the checker."""
    shapes_only = [n for n, _, v in traced.inputs if not has_values(v)]
    if shapes_only:
        notes.append(f"not replayed eagerly: {', '.join(shapes_only[:3])}{' ...' if len(shapes_only) > 3 else ''} "
                     "hold no values (the meta device)")
        return
    try:
        model = copy.deepcopy(step.model).double()
        originals = dict(step.model.named_parameters())
        for n, p in model.named_parameters():  # a deep copy drops a parameter's gradient hooks; the trace has them
            copy_grad_hooks(originals[n], p)
        inputs = {k: v.double() if v.is_floating_point() else v for k, v in step.inputs.items()}
        loss = step.step(model, **inputs)
    except Exception as e:  # noqa: BLE001 - the capture itself does not depend on it
        notes.append(f"not replayed eagerly in float64 ({type(e).__name__}: {e})")
        return
    params = dict(model.named_parameters())
    want = {"loss": loss.detach()} | {f"{p}.grad": params[p].grad for p in traced.grads} | \
        {updated_name(p): params[p].detach() for p in traced.updated}
    values = {name: v.detach() for name, _, v in traced.inputs} | conv.constants
    got = eval_graph(seq, registry, values)
    for o in seq.outputs:
        w = want.get(o.name)
        if w is None or not close(got[o.ref], w, rtol=1e-6, atol=1e-9):
            err = max_err(got[o.ref], w) if w is not None else float("nan")
            raise CaptureError(f"the captured sequential graph computes output {o.name!r} differently from the step run "
                               f"eagerly (max error {err:.3g}): a translation in refine/frontends/capture/aten.py is wrong")


_AT_NODE = re.compile(r"^\$(?:\.ranks\[(\d+)\])?\.graph\.nodes\[(\d+)\]")


def _load(seq_doc: dict[str, Any], dist_doc: dict[str, Any], registry: Registry) -> tuple[Graph, Dist]:
    """Load the documents with refine's own loader, so capture output meets every check a
    hand-written file does; a failure names the rank, node and source line."""
    with tempfile.TemporaryDirectory(prefix="refine-capture-") as tmp:
        write_case(tmp, seq_doc, dist_doc)
        try:
            seq = load_seq(Path(tmp) / "seq.json", registry)
            dist = load_dist(Path(tmp) / "dist.json", registry, seq)
        except InputError as e:
            doc = seq_doc if e.file.endswith("seq.json") else dist_doc
            raise CaptureError(_explain(e, doc)) from None
    return seq, dist


def _explain(e: InputError, doc: dict[str, Any]) -> str:
    file = Path(e.file).name
    m = _AT_NODE.match(e.where)
    if not m:
        return f"the captured {file} does not load: {e.where}: {e.reason}"
    rank_i, node_i = m.group(1), int(m.group(2))
    graph = doc["ranks"][int(rank_i)]["graph"] if rank_i is not None else doc["graph"]
    node = graph["nodes"][node_i]
    who = f"rank {doc['ranks'][int(rank_i)]['rank']}" if rank_i is not None else "the sequential step"
    src = f" at {node['source']}" if node.get("source") else ""
    return f"{who}, node {node['name']!r} ({node['op']}){src}: {e.reason}"
