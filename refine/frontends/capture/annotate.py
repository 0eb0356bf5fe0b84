"""Annotations: how a rank's tensor holds the sequential tensor it is a piece of.

Annotate once per parameter or input, where it is made, like Megatron marks its parallel
parameters:

    self.weight = capture.shard(nn.Parameter(torch.empty(out // world, inp)), 0)
    x = capture.shard(batch[rank * b:(rank + 1) * b], 0, axis="dp")
    capture.replicate("ln.weight")          # by name, inside the rank's factory

Each call returns its tensor. On a mesh of several axes say which axis; calls for different
axes add up (axes not named are Replicate). `seq=` names the sequential input when the rank
tensor is named differently. Tensors nobody annotates are matched by name and their
placement is guessed from the shapes (and the guess is reported).

The calls: `shard(t, dim, axis=None, *, seq=None)`, `replicate(t, axis=None, *, seq=None)`,
`partial(t, reduce="sum", axis=None, *, seq=None)`, `layout(t, expr, *, seq=None)` (`expr` in
the relation language over rank tensors `name@rank`), `flat(t, [(name, shape), ...],
axis=None)` (one rank tensor holding its shard of several sequential tensors flattened,
concatenated and padded: ZeRO's and FSDP's flat buffers); `t` is a tensor or its qualified name.
The guess for an unannotated tensor: equal shapes are Replicate, one dim divided by a mesh
axis's size is Shard on that axis. `refine capture` prints the guesses, the documents write
them `"guessed": true`, and every report flags them. Frameworks register derivers
(`DERIVERS`) that read their own marks (DTensor placements, Megatron's
`tensor_model_parallel` attributes): those relations are derived, not guessed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from refine.frontends.capture.errors import CaptureError

ATTR = "_refine_capture"
T = TypeVar("T", torch.Tensor, str)


@dataclass(frozen=True)
class Annotation:
    placements: tuple[tuple[str | None, str], ...] = ()  # (mesh axis, or None for the only one; placement)
    layout: str | None = None  # a relation expression over rank inputs, `name@rank`
    seq: str | None = None  # the sequential input, when named differently
    # the global ranks along each axis through this rank, when a framework states them (a
    # DeviceMesh): checked against the Spec's mesh, so axes laid out differently are an error
    groups: tuple[tuple[str | None, tuple[int, ...]], ...] = ()
    # a flat shard (refine.capture.flat): the sequential tensors packed in it, each
    # (name, offset in the packed buffer, shape), and the mesh axis its shards run along
    flat: tuple[tuple[str, int, tuple[int, ...]], ...] = ()
    flat_axis: str | None = None
    # a padded dim-0 shard (FSDP2's): (mesh axis, rows n of the tensor the shards cover, rows
    # per shard): along that axis the first n rows of the shards' concat are the tensor the
    # other axes' `placements` place (refine.frontends.capture.fsdp)
    padded: tuple[str | None, int, int] | None = None

    def describe(self) -> str:
        if self.padded is not None:
            return f"padded dim-0 shard along {self.padded[0] or 'the mesh'}"
        if self.flat:
            return f"flat shard of {', '.join(n for n, _, _ in self.flat)}"
        if self.layout is not None:
            return f"layout {self.layout}"
        return ", ".join(p if a is None else f"{p} on {a}" for a, p in self.placements) or "Replicate"


_BY_NAME: ContextVar[dict[str, Annotation] | None] = ContextVar("refine_capture_names", default=None)


@contextmanager
def collecting() -> Iterator[dict[str, Annotation]]:
    """Name annotations made while this is active (a rank's factory and its step) land here."""
    found: dict[str, Annotation] = {}
    token = _BY_NAME.set(found)
    try:
        yield found
    finally:
        _BY_NAME.reset(token)


# Tensors annotated while a rank is built, with the line that annotated each: one that is not
# what the step receives (an op applied after the annotation made a new tensor) is an error,
# never an annotation lost silently.
Made = list[tuple[torch.Tensor, Annotation, str]]
_MADE: ContextVar[Made | None] = ContextVar("refine_capture_made", default=None)


@contextmanager
def watching() -> Iterator[Made]:
    """Tensors annotated while this is active land here (see `_MADE`)."""
    made: Made = []
    token = _MADE.set(made)
    try:
        yield made
    finally:
        _MADE.reset(token)


def _caller() -> str:
    """The first frame outside this file: the user's line that annotated."""
    f = sys._getframe(1)
    while f is not None and Path(f.f_code.co_filename) == Path(__file__):
        f = f.f_back
    return "<unknown>" if f is None else f"{Path(f.f_code.co_filename).name}:{f.f_lineno}"


def _merge(old: Annotation | None, new: Annotation, what: str) -> Annotation:
    if old is None:
        return new
    if old.flat or new.flat:
        raise CaptureError(f"{what} is annotated twice, as a flat shard and with another annotation")
    if (old.layout is None) != (new.layout is None) or (old.layout and new.layout and old.layout != new.layout):
        raise CaptureError(f"{what} is annotated twice, with a layout and another annotation")
    if old.seq and new.seq and old.seq != new.seq:
        raise CaptureError(f"{what} is annotated as a piece of {old.seq!r} and of {new.seq!r}")
    axes = {a for a, _ in new.placements}
    kept = tuple((a, p) for a, p in old.placements if a not in axes)
    return replace(new, placements=kept + new.placements, seq=new.seq or old.seq)


def _annotate(target: T, ann: Annotation) -> T:
    if isinstance(target, str):
        names = _BY_NAME.get()
        if names is None:
            raise CaptureError(f"capture annotation of {target!r} by name outside a capture: annotate the tensor "
                               "itself, or call this while refine builds a rank (in the rank factory)")
        names[target] = _merge(names.get(target), ann, repr(target))
        return target
    if not isinstance(target, torch.Tensor):
        raise CaptureError(f"capture annotations take a tensor or a name, got {type(target).__name__}")
    merged = _merge(getattr(target, ATTR, None), ann, "a tensor")
    setattr(target, ATTR, merged)
    made = _MADE.get()
    if made is not None:
        made.append((target, merged, _caller()))
    return target


def shard(target: T, dim: int, axis: str | None = None, *, seq: str | None = None) -> T:
    """`target` is the piece of the sequential tensor along `dim` (rank order along `axis`)."""
    return _annotate(target, Annotation(((axis, f"Shard({int(dim)})"),), seq=seq))


def replicate(target: T, axis: str | None = None, *, seq: str | None = None) -> T:
    """Every rank (along `axis`, or all) holds the whole sequential tensor."""
    return _annotate(target, Annotation(((axis, "Replicate"),), seq=seq))


def partial(target: T, reduce: str = "sum", axis: str | None = None, *, seq: str | None = None) -> T:
    """The sequential tensor is the sum (or max) of the ranks' tensors along `axis`."""
    if reduce not in ("sum", "max"):
        raise CaptureError(f"partial({reduce!r}): refine knows Partial(sum) and Partial(max)")
    return _annotate(target, Annotation(((axis, f"Partial({reduce})"),), seq=seq))


def layout(target: T, expr: str, *, seq: str | None = None) -> T:
    """An explicit relation for fused weights: `expr` over rank inputs `name@rank` equals the
    sequential tensor, e.g. "cat(slice(qkv@0, 0, 0, 4), slice(qkv@1, 0, 0, 4), dim=0)"."""
    return _annotate(target, Annotation(layout=str(expr), seq=seq))


def flat(target: T, parts: list[tuple[str, tuple[int, ...] | torch.Size]], axis: str | None = None) -> T:
    """`target` is this rank's shard of a flat buffer (ZeRO, FSDP's flat parameter): the
    sequential tensors `parts` (name, shape), flattened and concatenated in that order,
    padded at the end to a multiple of the ranks along `axis` (or all), cut into equal
    shards in rank order. Each part's relation is derived (a view of a slice of the shards'
    concat); a flat parameter's gradient is expected in the same layout (its shards hold
    the sequential gradients, the padding nothing)."""
    parts_out: list[tuple[str, int, tuple[int, ...]]] = []
    offset = 0
    for name, shape in parts:
        dims = tuple(int(d) for d in shape)
        parts_out.append((str(name), offset, dims))
        n = 1
        for d in dims:
            n *= d
        offset += n
    if not parts_out:
        raise CaptureError("capture.flat: no parts given")
    if len({n for n, _, _ in parts_out}) != len(parts_out):
        raise CaptureError("capture.flat: a part is named twice")
    return _annotate(target, Annotation(flat=tuple(parts_out), flat_axis=axis))


def padded_layouts(name: str, ann: Annotation, mesh: dict[str, int], what: str) -> list[str]:
    """The relation of a padded dim-0 shard `name` (`Annotation.padded`): one layout per
    combination of the Replicate axes' coordinates (every copy must hold the tensor); within
    one, the padded shards along their axis make the tensor's (TP-local) piece, and the
    Shard axes concatenate those pieces, the first mesh axis outermost (DTensor's order)."""
    assert ann.padded is not None
    axes, sizes = list(mesh), list(mesh.values())
    pad_axis, rows, per = ann.padded
    if pad_axis is None:
        if len(axes) != 1:
            raise CaptureError(f"{what} is a padded shard without an axis, but the mesh has axes {', '.join(axes)}")
        pad_axis = axes[0]
    if pad_axis not in mesh:
        raise CaptureError(f"{what} is a padded shard along axis {pad_axis!r}, which the mesh does not have "
                           f"(axes: {', '.join(axes)})")
    pl = placements_on(Annotation(ann.placements), axes, what)
    if pl[axes.index(pad_axis)] != "Replicate":
        raise CaptureError(f"{what} is placed {pl[axes.index(pad_axis)]} on its padded shard's axis {pad_axis!r}")
    others = [a for a in axes if a != pad_axis]
    if any(pl[axes.index(a)].startswith("Partial") for a in others):
        raise CaptureError(f"{what} is a padded shard of a Partial tensor: refine relates held or sharded ones")
    shard_axes = [a for a in others if pl[axes.index(a)].startswith("Shard")]
    rep_axes = [a for a in others if a not in shard_axes]

    def rank(coords: dict[str, int]) -> int:
        r = 0
        for a, n in zip(axes, sizes, strict=True):
            r = r * n + coords[a]
        return r

    def build(i: int, coords: dict[str, int]) -> str:
        if i == len(shard_axes):
            shards = [f"{name}@{rank(coords | {pad_axis: k})}" for k in range(mesh[pad_axis])]
            whole = shards[0] if len(shards) == 1 else f"cat({', '.join(shards)}, dim=0)"
            return whole if per * len(shards) == rows else f"slice({whole}, 0, 0, {rows})"
        a = shard_axes[i]
        dim = int(pl[axes.index(a)][len("Shard("):-1])
        parts = [build(i + 1, coords | {a: k}) for k in range(mesh[a])]
        return parts[0] if len(parts) == 1 else f"cat({', '.join(parts)}, dim={dim})"

    out: list[str] = []
    combos: list[dict[str, int]] = [{}]
    for a in rep_axes:
        combos = [c | {a: k} for c in combos for k in range(mesh[a])]
    for c in combos:
        out.append(build(0, c))
    return out


def _coords(rank: int, sizes: list[int]) -> tuple[int, ...]:
    out, rest = [], rank
    for n in reversed(sizes):
        out.insert(0, rest % n)
        rest //= n
    return tuple(out)


def _flat_rank(coords: tuple[int, ...] | list[int], sizes: list[int]) -> int:
    r = 0
    for c, n in zip(coords, sizes, strict=True):
        r = r * n + c
    return r


def submesh_layouts(name: str, placements: list[str], mesh: dict[str, int], holders: list[int], what: str
                    ) -> list[str]:
    """The relation of `name`, held by `holders` only (a pipeline stage's tensor-parallel group,
    or the first and last stages' groups of a tied weight), placed by `placements` (one per mesh
    axis) within each group: one layout per copy. An axis is *spanned* when the holders are
    whole lines along it (with every rank they hold, they hold all its neighbours along it);
    the others (the pipeline axis) only select the groups, so the tensor must be Replicate on
    them: each group holds it whole in its own pieces. Within a group, Shard axes concatenate
    and Partial(sum) axes add (the first mesh axis outermost, DTensor's order), and each
    coordinate of a Replicate axis is another copy. Ranks outside the holders have no part in
    any layout: every copy must hold the sequential tensor."""
    axes, sizes = list(mesh), list(mesh.values())
    held = set(holders)
    coords = {r: _coords(r, sizes) for r in holders}
    spanned = [all(_flat_rank(c[:i] + (k,) + c[i + 1:], sizes) in held for c in coords.values() for k in range(n))
               for i, n in enumerate(sizes)]
    for i, a in enumerate(axes):
        p = placements[i]
        if not spanned[i] and p != "Replicate":
            raise CaptureError(f"{what} is placed {p} on mesh axis {a!r}, but only ranks {sorted(held)} hold it, "
                               f"not whole lines along {a!r}: a tensor some ranks hold can be split only along the axes "
                               "its holders span (a stage's tensor-parallel axis), and is whole across the others")
        if p == "Partial(max)":
            raise CaptureError(f"{what} is placed Partial(max) and held by some ranks only: refine relates a subset's "
                               "Shard, Replicate and Partial(sum) pieces")
    split = [i for i in range(len(axes)) if spanned[i] and placements[i] != "Replicate"]
    groups = sorted({tuple(c[i] if not spanned[i] or placements[i] == "Replicate" else 0 for i in range(len(axes)))
                     for c in coords.values()})

    def build(j: int, c: tuple[int, ...]) -> str:
        if j == len(split):
            return f"{name}@{_flat_rank(c, sizes)}"
        i = split[j]
        parts = [build(j + 1, c[:i] + (k,) + c[i + 1:]) for k in range(sizes[i])]
        if len(parts) == 1:
            return parts[0]
        p = placements[i]
        return f"sum({', '.join(parts)})" if p.startswith("Partial") else \
            f"cat({', '.join(parts)}, dim={int(p[len('Shard('):-1])})"

    return [build(0, g) for g in groups]


def flat_layout(name: str, part: tuple[str, int, tuple[int, ...]], ranks: list[int]) -> str:
    """The relation of one part of a flat shard `name`, held by `ranks` in shard order."""
    _, offset, shape = part
    n = 1
    for d in shape:
        n *= d
    shards = ", ".join(f"{name}@{r}" for r in ranks)
    return f"view(slice(cat({shards}, dim=0), 0, {offset}, {offset + n}), [{', '.join(map(str, shape))}])"


# Frameworks mark their parallel tensors themselves (DTensor placements, Megatron's
# `tensor_model_parallel` / `partition_dim` attributes). A deriver reads such marks off a
# tensor (its value as the rank program sees it) and returns the Annotation they mean, or
# None. Explicit refine annotations win over derived ones; derived ones are not guesses.
Deriver = Callable[[torch.Tensor], "Annotation | None"]
DERIVERS: list[Deriver] = []


def annotation_of(t: Any) -> Annotation | None:
    if not isinstance(t, torch.Tensor):
        return None
    explicit = getattr(t, ATTR, None)
    if explicit is not None:
        return explicit
    for derive in DERIVERS:
        found = derive(t)
        if found is not None:
            return found
    return None


def placements_on(ann: Annotation, axes: list[str], what: str) -> list[str]:
    """One placement per mesh axis (axes the annotation does not name are Replicate)."""
    out = {a: "Replicate" for a in axes}
    for axis, p in ann.placements:
        if axis is None and p == "Replicate":
            out = {a: "Replicate" for a in axes}  # replicate(t): on every axis
            continue
        if axis is None:
            if len(axes) != 1:
                raise CaptureError(f"{what} is annotated {p} without an axis, but the mesh has axes "
                                   f"{', '.join(axes)}: say which one (axis=...)")
            axis = axes[0]
        if axis not in out:
            raise CaptureError(f"{what} is annotated {p} on axis {axis!r}, which the mesh does not have "
                               f"(axes: {', '.join(axes)})")
        out[axis] = p
    return [out[a] for a in axes]


def check_groups(ann: Annotation, mesh: dict[str, int], rank: int, what: str) -> None:
    """The groups an annotation states must be the Spec mesh's (ranks row-major over its axes)."""
    axes, sizes = list(mesh), list(mesh.values())
    coords, rest = [], rank
    for n in reversed(sizes):
        coords.insert(0, rest % n)
        rest //= n
    for axis, ranks in ann.groups:
        a = axis if axis is not None else axes[0] if len(axes) == 1 else None
        if a not in mesh:
            raise CaptureError(f"{what} lives on mesh axis {axis!r}, which the Spec's mesh does not have "
                               f"(axes: {', '.join(axes)})")
        i = axes.index(a)
        want = []
        for k in range(sizes[i]):
            c = coords[:i] + [k] + coords[i + 1:]
            flat = 0
            for x, n in zip(c, sizes, strict=True):
                flat = flat * n + x
            want.append(flat)
        if list(ranks) != want:
            raise CaptureError(f"{what}: on rank {rank} its mesh axis {a!r} runs over ranks {list(ranks)}, but the "
                               f"Spec's mesh {mesh} (ranks row-major) puts ranks {want} there; make them agree")
