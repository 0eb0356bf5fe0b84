"""Check every input relation against the tensors' values.

A relation (annotated, derived from a framework's marks, or guessed from shapes) says how the
ranks' tensors hold a sequential tensor, and refine's proof assumes it. Capture traces over
fresh leaves, so the proof alone says nothing about the values the ranks really hold: a
checkpoint converter that splits a weight strided (`w[r::tp]`) where the annotation says
`Shard(0)`, shards handed to the wrong ranks, a replicated tensor that differs on one rank,
or pieces of a Partial(sum) that do not add up would all be proven against a relation the
program does not have. Capture holds both sides' values (parameters, buffers, and the data
inputs the steps are given), so each relation is checked here, by refine's own meaning of
it (refine.ops.interp: `torch.chunk` per Shard, reductions per Partial, layout terms
evaluated), within a rounding tolerance of the coarser dtype (exact for integers and bools).

Tensors without values (the meta device, fake tensors) cannot be checked: their relations
are returned as unchecked, for the Case to say so, never passed silently.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from refine.frontends.capture.errors import CaptureError
from refine.ir.graph import Dist, Graph, Mesh, Placement, Relation
from refine.ir.term import show
from refine.ops.interp import EvalError, canon, eval_term
from refine.ops.registry import Registry

# a copy may round once per dtype conversion; a reduction of k pieces adds k roundings
_ROUNDINGS = 4


def has_values(t: Tensor) -> bool:
    """False for tensors that only describe a shape (meta, fake): nothing to compare."""
    from torch._subclasses.fake_tensor import is_fake

    return not (t.is_meta or is_fake(t))


def check_values(seq: Graph, dist: Dist, registry: Registry, seq_vals: dict[str, Tensor],
                 rank_vals: dict[int, dict[str, Tensor]]) -> list[str]:
    """Raise CaptureError for the first relation the values contradict; return the relations
    that could not be checked (a tensor without values), one line each."""
    covered = {r.source for r in dist.relations}
    replicate = tuple(Placement("replicate") for _ in dist.mesh.axes)
    # an input no relation names is read as replicated under its own name (refine.relate.program)
    relations = list(dist.relations) + [Relation(i.name, i.name, replicate, guessed=True)
                                        for i in seq.inputs if i.name not in covered]
    unchecked: list[str] = []
    for rel in relations:
        what = _describe(rel)
        v = seq_vals.get(rel.source)
        if v is None:
            raise CaptureError(f"sequential input {rel.source!r} has no value to check its relation ({what}) against")
        locals_ = _rank_tensors(rel, rank_vals)
        named = [(f"the sequential {rel.source!r}", v)] + [(f"{n}@{r}", t) for (n, r), t in sorted(locals_.items())]
        missing = [n for n, t in named if not has_values(t)]
        if missing:
            unchecked.append(f"{rel.source}: {what}: not checked against values ({', '.join(missing[:3])}"
                             f"{' ...' if len(missing) > 3 else ''} on the meta device or fake: shapes only)")
            continue
        why = (_check_layout(rel, v, locals_, registry) if rel.layout is not None
               else _check_placed(rel, v, {r: t for (_, r), t in locals_.items()}, dist.mesh))
        if why is not None:
            how = "guessed from names and shapes" if rel.guessed else "as annotated or derived"
            raise CaptureError(f"the values contradict the relation of {rel.source!r} ({what}, {how}): {why}. "
                               "Capture checks every relation against the tensors the steps hold (a checkpoint "
                               "converter that splits or orders pieces differently, a wrong annotation); make the "
                               "rank tensors hold the sequential ones as the relation says, or annotate the relation "
                               "they have. (Each rank is built in a fake process group that communicates nothing: a "
                               "tensor a rank factory receives by a broadcast or scatter holds no received data.)")
    return unchecked


def _describe(rel: Relation) -> str:
    if rel.layout is not None:
        return "layout " + " = ".join(show(t) for t in (rel.layout, *rel.replicas))
    local = f" (rank input {rel.local!r})" if rel.local and rel.local != rel.source else ""
    return "[" + ", ".join(map(str, rel.placements or ())) + "]" + local


def _rank_tensors(rel: Relation, rank_vals: dict[int, dict[str, Tensor]]) -> dict[tuple[str, int], Tensor]:
    """(rank input, rank) -> value, for every rank tensor the relation reads."""
    if rel.layout is not None:
        names = set().union(*(t.leaves() for t in (rel.layout, *rel.replicas)))
        pairs = [(base, int(r)) for base, _, r in (n.rpartition("@") for n in names)]
    else:
        local = rel.local or rel.source
        pairs = [(local, r) for r in sorted(rank_vals)]
    out = {}
    for name, r in pairs:
        t = rank_vals.get(r, {}).get(name)
        if t is None:
            raise CaptureError(f"rank {r} has no value for {name!r}, which the relation of {rel.source!r} reads")
        out[(name, r)] = t
    return out


# ---------------------------------------------------------------------------------------
# comparisons


def _eps(*ts: Tensor) -> float:
    """The rounding unit of the coarsest floating dtype among `ts` (0 for integers/bools)."""
    return max((torch.finfo(t.dtype).eps for t in ts if t.is_floating_point() or t.is_complex()), default=0.0)


def _copy_tol(*ts: Tensor) -> tuple[float, float]:
    """(rtol, atol) for a copy, perhaps through a coarser dtype: a few roundings, relative,
    and the spacing of the coarsest dtype's subnormals (tiny values flushed to zero)."""
    floats = [torch.finfo(t.dtype) for t in ts if t.is_floating_point()]
    return _ROUNDINGS * _eps(*ts), _ROUNDINGS * max((f.smallest_normal * f.eps for f in floats), default=0.0)


def _mismatch(got: Tensor, want: Tensor, rtol: float, atol: float) -> str | None:
    """None when `got` equals `want` within |got - want| <= atol + rtol |want| (exactly for
    integers and bools); else the largest error and where it is."""
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {list(got.shape)}, expected {list(want.shape)}"
    if got.numel() == 0:
        return None
    a, b = canon(got).to("cpu", torch.float64), canon(want).to("cpu", torch.float64)
    err = (a - b).abs()
    both_nan = torch.isnan(a) & torch.isnan(b)
    err = torch.where(both_nan, torch.zeros_like(err), torch.nan_to_num(err, nan=float("inf")))
    bad = err > atol + rtol * b.abs()
    if not bool(bad.any()):
        return None
    flat = int(torch.argmax(torch.where(bad, err, torch.zeros_like(err))))
    at = [int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(got.shape))]
    return (f"max error {float(err[bad].max()):.3g} at index {at} ({float(a.flatten()[flat]):.6g} where "
            f"{float(b.flatten()[flat]):.6g} is expected; {int(bad.sum())} of {got.numel()} elements differ)")


def _scale(ts: Iterable[Tensor]) -> float:
    """The largest magnitude among `ts`: a reduction's rounding error is relative to its terms."""
    return max((float(canon(t).to(torch.float64).abs().max()) for t in ts if t.numel()), default=0.0)


def _equal(got: Tensor, want: Tensor) -> bool:
    return _mismatch(got, want, *_copy_tol(got, want)) is None


# ---------------------------------------------------------------------------------------
# placements


def _piece(v: Tensor, placements: tuple[Placement, ...], mesh: Mesh, coords: tuple[int, ...]) -> Tensor | str:
    """The part of `v` the rank at `coords` holds, Partial axes read as whole (the pieces of
    a partial sum add up to it): torch.chunk per Shard, in mesh-axis order, as refine splits."""
    for (axis, n), p, c in zip(mesh.axes, placements, coords, strict=True):
        if p.kind != "shard":
            continue
        parts = torch.chunk(v, n, int(p.dim))  # type: ignore[arg-type]
        if len(parts) != n:
            return f"dim {p.dim} of size {v.shape[p.dim]} does not split into {n} pieces along {axis!r}"  # type: ignore[index]
        v = parts[c]
    return v


def _check_placed(rel: Relation, v: Tensor, locals_: dict[int, Tensor], mesh: Mesh) -> str | None:
    placements = rel.placements or ()
    partial = [i for i, p in enumerate(placements) if p.kind == "partial"]
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in sorted(locals_):
        coords = mesh.coords(r)
        groups.setdefault(tuple(c for i, c in enumerate(coords) if i not in partial), []).append(r)
    problems: list[str] = []
    for members in groups.values():
        coords = mesh.coords(members[0])
        want = _piece(v, placements, mesh, coords)
        if isinstance(want, str):
            return want
        if not partial:
            (r,) = members
            got = locals_[r]
            wrong = _mismatch(got, want, *_copy_tol(got, v))
            if wrong is not None:
                how = _diagnose(r, got, v, placements, mesh, locals_) or "holds another value than its piece"
                problems.append(f"rank {r} {how} ({wrong})")
            continue
        got, parts = _reduce(partial, placements, mesh, coords, locals_)
        scale = _scale(locals_[r] for r in members)
        rtol = _ROUNDINGS * parts * _eps(v, *(locals_[r] for r in members))
        wrong = _mismatch(got, want, rtol, rtol * scale)
        if wrong is not None:
            reduce = " and ".join(sorted({str(placements[i]) for i in partial}))
            problems.append(f"the {reduce} of the values of ranks {members} is not the sequential "
                            f"{'piece' if len(groups) > 1 else 'tensor'} ({wrong})")
    if not problems:
        return None
    return "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")


def _reduce(partial: list[int], placements: tuple[Placement, ...], mesh: Mesh, coords: tuple[int, ...],
            locals_: dict[int, Tensor]) -> tuple[Tensor, int]:
    """The ranks' values along the Partial axes through `coords`, reduced as refine reads
    them (the first axis outermost), and how many values that reduced."""
    count = 0

    def go(k: int, at: list[int]) -> Tensor:
        nonlocal count
        if k == len(partial):
            count += 1
            return canon(locals_[mesh.rank(tuple(at))]).cpu()
        i = partial[k]
        parts = []
        for c in range(mesh.axes[i][1]):
            at[i] = c
            parts.append(go(k + 1, at))
        if placements[i].reduce == "max":
            return torch.stack(parts).amax(0)
        return torch.stack(parts).sum(0)

    out = go(0, list(coords))
    return out, count


def _diagnose(r: int, got: Tensor, v: Tensor, placements: tuple[Placement, ...], mesh: Mesh,
              locals_: dict[int, Tensor]) -> str | None:
    """What rank r holds instead, when it is recognisable: another rank's piece (shards in
    another rank order), a strided piece (`w[k::n]` for a Shard), or the whole tensor."""
    coords = mesh.coords(r)
    shards = [(i, p) for i, p in enumerate(placements) if p.kind == "shard"]
    if not shards:
        others = [q for q in sorted(locals_) if q != r and _equal(locals_[q], v)]
        return "differs from the sequential tensor it should replicate" + (f" (ranks {others} hold it)" if others else "")
    for q in sorted(locals_):
        if q == r:
            continue
        other = _piece(v, placements, mesh, mesh.coords(q))
        if isinstance(other, Tensor) and _equal(got, other):
            return (f"holds the piece of the sequential tensor that rank {q} should hold "
                    f"(mesh coordinates {list(mesh.coords(q))}, not its own {list(coords)}): the pieces are in "
                    "another rank order")
    if _equal(got, v):
        return "holds the whole sequential tensor, not its piece"
    if len(shards) == 1:
        i, p = shards[0]
        n, d = mesh.axes[i][1], int(p.dim)  # type: ignore[arg-type]
        for k in range(n):
            strided = v.index_select(d, torch.arange(k, v.shape[d], n))
            if _equal(got, strided):
                return (f"holds the strided slices [{k}::{n}] of dim {d}, not the contiguous piece {coords[i]} of {n} "
                        f"that {p} means")
    return None


# ---------------------------------------------------------------------------------------
# layouts


def _check_layout(rel: Relation, v: Tensor, locals_: dict[tuple[str, int], Tensor], registry: Registry) -> str | None:
    by_name = {f"{n}@{r}": t for (n, r), t in locals_.items()}
    eps = _eps(v, *locals_.values())
    scale = _scale(locals_.values())
    for term in (rel.layout, *rel.replicas):
        try:
            got = eval_term(term, registry, lambda name: by_name[name])
        except (EvalError, KeyError, RuntimeError) as e:
            return f"the layout {show(term)} cannot be evaluated on the ranks' values ({type(e).__name__}: {e})"
        rtol = _ROUNDINGS * max(len(term.leaves()), 1) * eps
        wrong = _mismatch(got, v, rtol, rtol * scale)
        if wrong is not None:
            return f"the layout {show(term)}, evaluated on the ranks' values, is not the sequential tensor: {wrong}"
    return None
