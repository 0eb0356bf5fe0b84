"""From traced aten ops to refine ops: the decomposition table and the whole mapping.

Tracing runs with `DECOMPOSITIONS`, so backward formulas arrive as ops refine knows
(gelu_backward as erf/exp/mul, native_layer_norm_backward as mul/sum/sub, ...).

The mapping is generic: an aten op becomes the refine op of its base name (`aten.mul.Tensor`
-> `mul`); its tensor arguments stay positional, in schema order; an argument the refine op
declares as an attribute becomes that attribute (named as in the aten schema unless
`ATTR_ALIASES` renames it); any other number argument becomes a number literal argument
(`pow(x, 2)`). Arguments in `IGNORED` never change values and are dropped, and so is an
argument at its schema default; anything else refine cannot express is an error, never
silently dropped. The exceptions are the tables below: `ALIASES` (another refine name),
`IDENTITY` (ops returning their input's value), `SPECIAL` (ops that need a few refine
nodes), `MULTI` (one refine node per used output) and the collectives. An op whose inputs
are all constant fills and whose result is one is folded to a `full` (refine.frontends.capture.convert)
before any of this. An in-place op (`div_`) maps like its
out-of-place twin: tracing hands the mutated tensor's later readers the op's result, and
refine.frontends.capture.convert refuses graphs where a stale alias of it is read afterwards.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch._decomp import core_aten_decompositions

from refine.frontends.capture.errors import CaptureError
from refine.frontends.capture.foreach import FOREACH_DECOMPOSITIONS
from refine.ir.graph import Arg, TensorType, value_class

DECOMPOSITIONS = core_aten_decompositions()
# select_scatter (the backward of `y[:, i]`) is a slice_scatter of one position: kept whole
# (SPECIAL) rather than aten's where(arange == i, ...) over the whole tensor
del DECOMPOSITIONS[torch.ops.aten.select_scatter.default]
# foreach ops: one op per tensor (refine.frontends.capture.foreach)
DECOMPOSITIONS.update(FOREACH_DECOMPOSITIONS)
# kept whole: refine's op (rules/aten_extra.py) accumulates rows the vocab-parallel rules
# (rules/embedding_grad.py) can window; the decomposition clamps the ids and masks invalid
# ones, which leaves no rule a form to recognize a rank's share of the table in
DECOMPOSITIONS.pop(torch.ops.aten.embedding_dense_backward.default, None)

# aten base name -> refine op (same semantics, other name)
ALIASES: dict[str, str] = {
    "view": "reshape",
    "expand": "expand_as_shape",
    "_log_softmax": "log_softmax_stable",  # written out max-shifted (rules/loss.py)
}

# refine op -> {aten argument name: refine attribute name}
ATTR_ALIASES: dict[str, dict[str, str]] = {
    "reshape": {"size": "shape"},
    "_unsafe_view": {"size": "shape"},
    "expand_as_shape": {"size": "shape"},
}

# arguments that never change a value
IGNORED = {"memory_format", "layout", "device", "pin_memory", "non_blocking", "implicit", "half_to_float"}

# ops whose output is their first input's value. A cast within one dtype class (float to
# float, int to int) is one (refine reasons about real-valued semantics); a cast from bool or
# int to float becomes refine's `cast` (rules/cast.py); others are refused.
IDENTITY = {"clone", "detach", "alias", "lift_fresh_copy", "contiguous", "_to_copy", "to", "resolve_conj",
            "resolve_neg"}
PRIM_IDENTITY = {"prims::convert_element_type"}  # a cast, as torch._refs decompositions leave it
WAITS = {"_c10d_functional::wait_tensor"}  # waiting on a functional collective: its value

# collectives, by qualified name. Functional ones return the result; legacy c10d ones
# mutate their tensor (list) and return (tensors, work): the converter follows the getitems.
FUNCTIONAL_COLLECTIVES = {
    "_c10d_functional::all_reduce": "all_reduce",
    "_c10d_functional::all_reduce_": "all_reduce",
    "_c10d_functional::all_gather_into_tensor": "all_gather",
    "_c10d_functional::reduce_scatter_tensor": "reduce_scatter",
    "_c10d_functional::all_to_all_single": "all_to_all",
    "_c10d_functional::broadcast": "broadcast",
    "_c10d_functional::broadcast_": "broadcast",
    "_c10d_functional_autograd::all_to_all_single": "all_to_all",
    "_c10d_functional_autograd::reduce_scatter_tensor": "reduce_scatter",
    "_c10d_functional_autograd::all_gather_into_tensor": "all_gather",
}
LEGACY_COLLECTIVES = {
    "c10d::allreduce_": "all_reduce",
    "c10d::broadcast_": "broadcast",
    "c10d::_allgather_base_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
}
# legacy collectives that write an output buffer and return only their work handle (like
# `recv_`): the buffer's later readers are rewired to the collective's node
LEGACY_WRITING = {
    "c10d::alltoall_base_": "all_to_all",  # dist.all_to_all_single(output, input)
}

# point-to-point (pipeline stages): dist.send / dist.recv trace as these legacy ops
P2P = {"c10d::send": "send", "c10d::recv_": "recv"}

# torch dtypes, as refine's format names them
DTYPES = {
    torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
    torch.float64: "float64", torch.int32: "int32", torch.int64: "int64", torch.bool: "bool",
    torch.uint8: "uint8", torch.int8: "int8", torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2",
}

REDUCE_OPS = ("sum", "avg", "max")


def qualified(target: Any) -> tuple[str, str]:
    """(namespace::name, overload): aten.add.Tensor -> ("aten::add", "Tensor")."""
    return target._schema.name, target._overloadname


def base_name(target: Any) -> str:
    return target._schema.name.partition("::")[2]


def bind(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments by schema name, defaults filled in."""
    out: dict[str, Any] = {}
    schema = target._schema.arguments
    for i, a in enumerate(schema):
        if i < len(args) and not a.kwarg_only:
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            out[a.name] = None
    return out


# ---------------------------------------------------------------------------------------
# Special ops. A handler gets the emitter, the FX node, its bound arguments and (for ops
# with several outputs) the index of the output wanted; it returns the refine ref.

class EmitterAPI(Protocol):
    """What a handler may ask of the translation it runs in: the part of
    `refine.frontends.capture.convert.Emitter` the handlers here use."""

    fills: dict[str, float]  # refine refs known to be one value repeated

    def cached(self, key: Any, make: Any) -> Any: ...

    def fail(self, message: str) -> CaptureError: ...

    def dtype(self, dt: Any) -> str: ...

    def type(self, ref: Arg) -> TensorType: ...

    def value(self, a: Any) -> Arg: ...

    def emit(self, op: str, args: list[Arg], attrs: dict[str, Any], *, final: bool = True,
             index: int | None = None, suffix: str = "", dtype: str | None = None, val: Any = None) -> str: ...


Handler = Callable[..., Any]


def _out_shape(em: EmitterAPI, node: Any, index: int | None = None) -> tuple[int, ...]:
    val = node.meta["val"]
    if index is not None:
        val = val[index]
    return tuple(int(s) for s in val.shape)


def _full(em: EmitterAPI, node: Any, a: dict[str, Any]) -> str:
    """full / full_like / zeros / ones / scalar_tensor: a constant of the traced shape."""
    name = base_name(node.target)
    value = {"zeros": 0.0, "zeros_like": 0.0, "new_zeros": 0.0, "zero": 0.0, "ones": 1.0, "ones_like": 1.0,
             "new_ones": 1.0}.get(name.rstrip("_"))
    if value is None:
        value = a.get("fill_value", a.get("value", a.get("s")))
    if not isinstance(value, (int, float, bool)):
        raise em.fail(f"{name} with a non-constant fill value")
    return em.emit("full", [], {"value": float(value), "shape": list(_out_shape(em, node))})


def _copy(em: EmitterAPI, node: Any, a: dict[str, Any]) -> str:
    """copy_(self, src): self's new value is src, broadcast to self's shape."""
    src = em.value(a["src"])
    if em.type(src).shape == _out_shape(em, node):
        return src  # type: ignore[return-value]
    return em.emit("expand_as_shape", [src], {"shape": list(_out_shape(em, node))})


class _Rows:
    """Torch's advanced indexing of x by integer tensors at `dims` as one row lookup: x with
    the indexed dims moved to the front and merged (`table`), and the flat row index
    sum_t idx_t * stride_t (row-major over those dims, the index tensors broadcast to
    `bshape`). The result of x[indices] is `table[flat]` with its dims put where torch puts
    them (`back`): the indices' broadcast shape in place of the indexed dims when they are
    adjacent, in front of the others when they are apart."""

    def __init__(self, em: EmitterAPI, x: str, indices: list[Any]) -> None:
        shape = em.type(x).shape
        self.dims = [d for d, t in enumerate(indices) if t is not None]
        if not self.dims:
            raise em.fail("advanced indexing with no index tensor")
        refs = [em.value(indices[d]) for d in self.dims]
        for r in refs:
            if value_class(em.type(r).dtype) != "int":
                raise em.fail(f"indexing by a {em.type(r).dtype} tensor: refine maps integer index tensors (a "
                              "boolean mask selects a data-dependent number of elements)")
        self.bshape = tuple(torch.broadcast_shapes(*(em.type(r).shape for r in refs)))
        flat: Arg | None = None
        for d, r in zip(self.dims, refs, strict=True):
            if len(refs) > 1 and em.type(r).shape != self.bshape:
                r = em.emit("expand_as_shape", [r], {"shape": list(self.bshape)}, final=False, suffix="index_b")
            flat = r if flat is None else em.emit(
                "add", [em.emit("mul", [flat, shape[d]], {}, final=False, suffix="index_s"), r], {}, final=False,
                suffix="index_f")
        assert isinstance(flat, str)
        self.flat = flat
        self.others = [d for d in range(len(shape)) if d not in self.dims]
        self.order = self.dims + self.others
        self.shape = shape
        moved = x if self.order == list(range(len(shape))) else \
            em.emit("permute", [x], {"dims": self.order}, final=False, suffix="index_p")
        rows = [math.prod(shape[d] for d in self.dims)] + [shape[d] for d in self.others]
        self.table = moved if len(self.dims) == 1 else \
            em.emit("reshape", [moved], {"shape": rows}, final=False, suffix="index_t")
        k, nb = self.dims[0], len(self.bshape)
        adjacent = self.dims == list(range(k, self.dims[-1] + 1))
        # the picked rows are [bshape..., others...]; torch puts bshape after the dims before
        # the indexed ones when those are adjacent
        self.back = None if not adjacent or k == 0 else \
            [nb + i for i in range(k)] + list(range(nb)) + [nb + i for i in range(k, len(self.others))]


def _index(em: EmitterAPI, node: Any, a: dict[str, Any]) -> str:
    """index(self, indices): x[idx] over dim 0 is refine's index_rows; any other integer
    advanced indexing is one index_rows over the indexed dims merged (_Rows)."""
    rows = _Rows(em, em.value(a["self"]), list(a["indices"]))  # type: ignore[arg-type]
    if rows.back is None:
        return em.emit("index_rows", [rows.table, rows.flat], {})
    picked = em.emit("index_rows", [rows.table, rows.flat], {}, final=False, suffix="index_r")
    return em.emit("permute", [picked], {"dims": rows.back})


def _masked_put(em: EmitterAPI, x: Arg, indices: list[Any], values: Any, accumulate: bool) -> str | None:
    """`x[mask] = v` (`+= v`) with one boolean mask over consecutive dims: a `where` over x's
    shape, when v is the same for every selected element or row (it broadcasts to any number
    of them: a scalar, or one row), so no size depends on the data (Megatron's
    vocab-parallel embedding zeroes the ids and rows outside its vocab range this way).
    None when the index is not such a mask."""
    at = [d for d, t in enumerate(indices) if t is not None]
    if len(at) != 1:
        return None
    mask = em.value(indices[at[0]])
    mtype = em.type(mask)
    if mtype.dtype != "bool":
        return None
    shape = em.type(x).shape
    p, m = at[0], len(mtype.shape)
    rest = shape[p + m:]
    v = em.value(values)
    vshape = em.type(v).shape
    fill = em.fills.get(v) if isinstance(v, str) else float(v)
    # v must broadcast to (count, *rest) for any count, and then sits before the rest
    if len(vshape) > len(rest) and any(s != 1 for s in vshape[:len(vshape) - len(rest)]):
        raise em.fail(f"index_put by a boolean mask with values of shape {list(vshape)}: one value per selected "
                      "element makes a size depend on the data")
    vshape = vshape[len(vshape) - len(rest):] if len(vshape) > len(rest) else vshape
    if tuple(em.type(v).shape) != tuple(vshape):
        v = em.emit("reshape", [v], {"shape": list(vshape)}, final=False, suffix="mask_v")
    full_mask = em.emit("expand_as_shape", [em.emit("reshape", [mask], {"shape": [1] * p + list(mtype.shape) + [1] * len(rest)},
                                                    final=False, suffix="mask_m")],
                        {"shape": list(shape)}, final=False, suffix="mask_e")
    if fill is not None and not accumulate:  # one constant: a masked_fill, as a user writes it
        return em.emit("masked_fill", [x, full_mask], {"value": fill})
    spread = em.emit("expand_as_shape", [v], {"shape": list(shape)}, final=False, suffix="mask_s") \
        if tuple(vshape) != tuple(shape) else v
    if not accumulate:
        return em.emit("where", [full_mask, spread, x], {})
    zero = em.emit("full", [], {"value": 0.0, "shape": list(shape)}, final=False, suffix="mask_0",
                   dtype=em.type(x).dtype)
    return em.emit("add", [x, em.emit("where", [full_mask, spread, zero], {}, final=False, suffix="mask_w")], {})


_ARANGES = ("arange.default", "arange.start", "arange.start_step")


def _distinct_positions(em: EmitterAPI, indices: list[Any]) -> bool:
    """Whether the index tuples of an advanced indexing are pairwise distinct whatever the
    index values: one index tensor is an `arange` (distinct values, step != 0) as large as
    all the indices broadcast together, so no two positions share its value."""
    nodes = [t for t in indices if t is not None]
    shapes = [tuple(em.type(em.value(t)).shape) for t in nodes]
    bshape = tuple(torch.broadcast_shapes(*shapes))
    for t, shape in zip(nodes, shapes, strict=True):
        target = getattr(t, "target", None)
        if not isinstance(target, torch._ops.OpOverload) or f"{target._opname}.{target._overloadname}" not in _ARANGES:
            continue
        step = t.kwargs.get("step", t.args[2] if len(t.args) > 2 else 1)
        if len(shape) == 1 and shape == bshape and isinstance(step, (int, float)) and step != 0:
            return True
    return False


def _read_modify_write(node: Any, a: dict[str, Any]) -> tuple[Any, float] | None:
    """`x[idx] += w` / `x[idx] -= w` as torch traces it, index_put(x, idx, x[idx] ± w) with
    the same x and idx: (w, ±1); None for any other values."""
    v = a["values"]
    target = getattr(v, "target", None)
    adds, subs = (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor), (torch.ops.aten.sub.Tensor, torch.ops.aten.sub_.Tensor)
    if target not in adds + subs or v.kwargs.get("alpha", 1) != 1:
        return None
    picked, w = v.args[0], v.args[1]
    if getattr(picked, "target", None) is not torch.ops.aten.index.Tensor or picked.args[0] is not a["self"] or \
            list(picked.args[1]) != list(a["indices"]):
        return None
    return w, (1.0 if target in adds else -1.0)


def _index_put(em: EmitterAPI, node: Any, a: dict[str, Any]) -> str:
    """index_put(self, indices, values, accumulate): refine's index_put over dim 0 of the
    indexed dims merged (_Rows), values laid out as the rows the lookup would pick, the
    result's dims moved back.

    Without accumulation refine takes a write at pairwise distinct positions (one index an
    arange: Megatron's vocab-parallel cross-entropy backward, `grad_2d[arange, target] -=
    update`): each position is written once, so it is x plus the accumulation of the change
    there (±w for `x[idx] ±= w`, else the new values minus the old)."""
    x = em.value(a["self"])
    masked = _masked_put(em, x, list(a["indices"]), a["values"], bool(a.get("accumulate", False)))
    if masked is not None:
        return masked
    rows = _Rows(em, x, list(a["indices"]))  # type: ignore[arg-type]
    acc = {"accumulate": bool(a.get("accumulate", False))}
    v = em.value(a["values"])
    picked = list(rows.bshape) + [rows.shape[d] for d in rows.others]
    seen = picked if rows.back is None else [picked[i] for i in rows.back]  # x[indices]'s shape
    if not acc["accumulate"] and not _distinct_positions(em, list(a["indices"])):
        # refine's index_put accumulates: writes by integer indices leave an unspecified
        # winner where indices repeat, so they are refused here, at the program's line
        raise em.fail("index_put by integer indices without accumulate (`x[idx] = v`) at positions that may "
                      "repeat: the value written there is unspecified, and refine lowers only the accumulating "
                      "form (`x.index_put_(idx, v, accumulate=True)`, `index_add_`) or writes at distinct positions "
                      "(one index an arange)")
    if not acc["accumulate"]:
        # each position written once: x + the accumulation of (new - old) there
        rmw = _read_modify_write(node, a)
        w = em.value(rmw[0]) if rmw is not None else None
        if rmw is not None and isinstance(w, str):  # x[idx] +-= w: the change is +-w
            v = w if rmw[1] > 0 else em.emit("neg", [w], {}, final=False, suffix="index_neg")
        else:
            old = em.emit("index_rows", [rows.table, rows.flat], {}, final=False, suffix="index_old")
            if rows.back is not None:
                old = em.emit("permute", [old], {"dims": rows.back}, final=False, suffix="index_oldp")
            v = em.emit("sub", [v, old], {}, final=False, suffix="index_new")
        acc = {"accumulate": True}
    if rows.dims == [0]:
        return em.emit("index_put", [x, rows.flat, v], acc)
    if em.type(v).shape != tuple(seen):
        v = em.emit("expand_as_shape", [v], {"shape": seen}, final=False, suffix="index_v")
    if rows.back is not None:  # into the picked rows' layout
        v = em.emit("permute", [v], {"dims": [rows.back.index(i) for i in range(len(rows.back))]}, final=False,
                    suffix="index_vp")
    put = em.emit("index_put", [rows.table, rows.flat, v], acc, final=False, suffix="index_put")
    if rows.order == list(range(len(rows.shape))):
        return em.emit("reshape", [put], {"shape": list(rows.shape)})
    whole = em.emit("reshape", [put], {"shape": [rows.shape[d] for d in rows.order]}, final=False, suffix="index_w")
    return em.emit("permute", [whole], {"dims": [rows.order.index(i) for i in range(len(rows.order))]})


def _dim(d: int, ndim: int) -> int:
    return d % max(ndim, 1)


def _bounds(a: dict[str, Any], shape: tuple[int, ...]) -> tuple[int, int, int]:
    """A slice's (dim, start, end) as torch reads them: negative and out-of-range ends clamped."""
    d = _dim(a["dim"], len(shape))
    n = shape[d]
    start = 0 if a["start"] is None else a["start"]
    end = n if a["end"] is None else a["end"]
    start = max(0, min(n, start + n if start < 0 else start))
    return d, start, max(start, min(n, end + n if end < 0 else end))


def _slice(em: EmitterAPI, node: Any, a: dict[str, Any]) -> str:
    x = em.value(a["self"])
    shape = em.type(x).shape
    d, start, end = _bounds(a, shape)
    if (a.get("step") or 1) != 1:
        raise em.fail(f"slice with step {a['step']}: refine slices take step 1")
    if start == 0 and end == shape[d]:
        return x
    return em.emit("slice", [x], {"dim": d, "start": start, "end": end})


def _select(em: EmitterAPI, node: Any, a: dict[str, Any]) -> str:
    x = em.value(a["self"])
    shape = em.type(x).shape
    d = _dim(a["dim"], len(shape))
    i = a["index"] + shape[d] if a["index"] < 0 else a["index"]
    s = em.emit("slice", [x], {"dim": d, "start": i, "end": i + 1}, final=False)
    return em.emit("reshape", [s], {"shape": list(_out_shape(em, node))})


def _cat(em: EmitterAPI, node: Any, a: dict[str, Any]) -> str:
    xs = [em.value(t) for t in a["tensors"]]
    xs = [x for x in xs if em.type(x).shape != (0,)]  # torch.cat skips empty 1-d tensors
    d = _dim(a["dim"], len(em.type(xs[0]).shape))
    if len(xs) == 1:
        return xs[0]
    return em.emit("concat", xs, {"dim": d})


def _stack(em: EmitterAPI, node: Any, a: dict[str, Any]) -> str:
    """stack(tensors, dim): each tensor with a size-1 dim inserted, concatenated along it."""
    xs = [em.value(t) for t in a["tensors"]]
    shape = list(em.type(xs[0]).shape)
    d = _dim(a["dim"], len(shape) + 1)
    one = shape[:d] + [1] + shape[d:]
    if len(xs) == 1:
        return em.emit("reshape", [xs[0]], {"shape": one})
    parts = [em.emit("reshape", [x], {"shape": one}, final=False, suffix=f"item{i}") for i, x in enumerate(xs)]
    return em.emit("concat", parts, {"dim": d})


def _split(em: EmitterAPI, node: Any, a: dict[str, Any], index: int) -> str:
    """split / split_with_sizes / unbind: output `index` is a slice (unbind: then a reshape)."""
    x = em.value(a["self"])
    shape = em.type(x).shape
    d = _dim(a.get("dim") or 0, len(shape))
    name = base_name(node.target)
    if name == "unbind":
        s = em.emit("slice", [x], {"dim": d, "start": index, "end": index + 1}, final=False)
        return em.emit("reshape", [s], {"shape": list(_out_shape(em, node, index))}, index=index)
    if name == "split_with_sizes":
        sizes = list(a["split_sizes"])
    else:
        k = a["split_size"]
        sizes = [min(k, shape[d] - s) for s in range(0, shape[d], k)]
    start = sum(sizes[:index])
    if start == 0 and sizes[index] == shape[d]:
        return x
    return em.emit("slice", [x], {"dim": d, "start": start, "end": start + sizes[index]}, index=index)


def _moments(em: EmitterAPI, x: str, dims: list[int], correction: float = 0) -> tuple[str, str]:
    """mean and variance of x over `dims`, kept; in refine ops."""
    shape = em.type(x).shape
    mean = em.emit("mean", [x], {"dim": dims, "keepdim": True}, final=False, suffix="mean")
    centred = em.emit("sub", [x, mean], {}, final=False, suffix="centred")
    sq = em.emit("mul", [centred, centred], {}, final=False, suffix="sq")
    var = em.emit("mean", [sq], {"dim": dims, "keepdim": True}, final=False, suffix="var")
    if correction:
        n = math.prod(shape[d] for d in dims)
        var = em.emit("mul", [var, n / (n - correction)], {}, final=False, suffix="var_corrected")
    return mean, var


def _native_layer_norm(em: EmitterAPI, node: Any, a: dict[str, Any], index: int) -> str:
    """Output 0: refine's layer_norm; 1 and 2: the statistics its decomposed backward reads
    (mean and 1/sqrt(var + eps) over the normalized dims, kept)."""
    x = em.value(a["input"])
    ns, eps = list(a["normalized_shape"]), float(a["eps"])
    if index == 0:
        args = [x]
        w, b = a["weight"], a["bias"]
        if w is not None or b is not None:
            args.append(em.value(w) if w is not None else em.emit("full", [], {"value": 1.0, "shape": ns}, final=False))
            if b is not None:
                args.append(em.value(b))
        return em.emit("layer_norm", args, {"normalized_shape": ns, "eps": eps}, index=0)
    stat = "layer_norm_mean" if index == 1 else "layer_norm_rstd"
    return em.emit(stat, [x], {"normalized_shape": ns, "eps": eps}, index=index)


def _var_mean(em: EmitterAPI, node: Any, a: dict[str, Any], index: int) -> str:
    x = em.value(a["self"])
    ndim = len(em.type(x).shape)
    dims = list(range(ndim)) if not a.get("dim") else [_dim(d, ndim) for d in a["dim"]]
    correction = a.get("correction")
    correction = 1 if correction is None else correction
    mean, var = em.cached((node, "moments"), lambda: _moments(em, x, dims, correction))
    return em.emit("reshape", [var if index == 0 else mean], {"shape": list(_out_shape(em, node, index))},
                   index=index)


def _max_dim(em: EmitterAPI, node: Any, a: dict[str, Any], index: int) -> str:
    if index != 0:
        raise em.fail("the indices output of max.dim (argmax): refine has no op for it")
    return em.emit("amax", [em.value(a["self"])], {"dim": [a["dim"]], "keepdim": bool(a["keepdim"])}, index=0)


def _max(em: EmitterAPI, node: Any, a: dict[str, Any]) -> str:
    return em.emit("amax", [em.value(a["self"])], {})


def _transpose(em: EmitterAPI, node: Any, a: dict[str, Any]) -> str:
    x = em.value(a["self"])
    ndim = len(em.type(x).shape)
    i, j = _dim(a["dim0"], ndim), _dim(a["dim1"], ndim)
    if i == j:
        return x
    return em.emit("transpose", [x], {"dim0": i, "dim1": j})


def _constant_pad_nd(em: EmitterAPI, node: Any, a: dict[str, Any]) -> str:
    """constant_pad_nd(x, pad, value): per dim (pairs from the last dim) a slice for negative
    pads and a concat with `full` constants for positive ones (label shifting pads with -100)."""
    x = em.value(a["self"])
    pad, value = list(a["pad"]), float(a.get("value") or 0.0)
    for i in range(len(pad) // 2):
        d = len(em.type(x).shape) - 1 - i
        before, after = int(pad[2 * i]), int(pad[2 * i + 1])
        shape = list(em.type(x).shape)
        if before < 0 or after < 0:
            x = em.emit("slice", [x], {"dim": d, "start": max(0, -before), "end": shape[d] - max(0, -after)},
                        final=False, suffix=f"crop{d}")
            before, after = max(0, before), max(0, after)
        parts = []
        for n, what in ((before, "before"), (after, "after")):
            shape = list(em.type(x).shape)
            shape[d] = n
            parts.append(em.emit("full", [], {"value": value, "shape": shape}, final=False, suffix=f"pad{d}_{what}",
                                 dtype=em.type(x).dtype) if n else None)
        pieces = [p for p in (parts[0], x, parts[1]) if p is not None]
        if len(pieces) > 1:
            x = em.emit("concat", pieces, {"dim": d}, final=False, suffix=f"pad{d}")
    return x


def _select_scatter(em: EmitterAPI, node: Any, a: dict[str, Any]) -> str:
    """select_scatter(x, src, dim, index): x with position index along dim replaced by src
    (the backward of a select): the slice_scatter of src unsqueezed there."""
    x = em.value(a["self"])
    shape = em.type(x).shape
    d = _dim(a["dim"], len(shape))
    i = a["index"] + shape[d] if a["index"] < 0 else a["index"]
    src = em.emit("unsqueeze", [em.value(a["src"])], {"dim": d}, final=False, suffix="select")
    return _scatter_slice(em, x, src, d, i, i + 1)


def _slice_scatter(em: EmitterAPI, node: Any, a: dict[str, Any]) -> str:
    """slice_scatter(x, src, dim, start, end): x with that slice replaced by src (the backward
    of a slice), as a concat of x's pieces around src."""
    x, src = em.value(a["self"]), em.value(a["src"])
    d, start, end = _bounds(a, em.type(x).shape)
    if (a.get("step") or 1) != 1:
        raise em.fail(f"slice_scatter with step {a['step']}: refine slices take step 1")
    return _scatter_slice(em, x, src, d, start, end)


def _scatter_slice(em: EmitterAPI, x: Any, src: Any, d: int, start: int, end: int) -> str:
    n = em.type(x).shape[d]

    def piece(lo: int, hi: int, what: str) -> str:
        if isinstance(x, str) and x in em.fills:  # a slice of a constant is a constant (zeros, mostly)
            shape = list(em.type(x).shape)
            shape[d] = hi - lo
            return em.emit("full", [], {"value": em.fills[x], "shape": shape}, final=False, suffix=what,
                           dtype=em.type(x).dtype)
        return em.emit("slice", [x], {"dim": d, "start": lo, "end": hi}, final=False, suffix=what)

    pieces = []
    if start > 0:
        pieces.append(piece(0, start, "head"))
    pieces.append(src)  # type: ignore[arg-type]
    if end < n:
        pieces.append(piece(end, n, "tail"))
    return pieces[0] if len(pieces) == 1 else em.emit("concat", pieces, {"dim": d})


def _topk(em: EmitterAPI, node: Any, a: dict[str, Any], index: int) -> str:
    """topk(x, k, dim, largest, sorted): output 0 the values, 1 the indices (rules/moe.py)."""
    if not a.get("largest", True) or not a.get("sorted", True):
        raise em.fail("topk with largest=False or sorted=False: refine's topk is the k largest, sorted")
    x = em.value(a["self"])
    attrs = {"k": int(a["k"]), "dim": _dim(a["dim"], len(em.type(x).shape))}
    return em.emit("topk_indices" if index else "topk_values", [x], attrs, index=index)


def _sort(em: EmitterAPI, node: Any, a: dict[str, Any], index: int) -> str:
    """sort(x, stable=True, dim, descending=False): output 0 the values, 1 the permutation."""
    if not a.get("stable") or a.get("descending"):
        raise em.fail("sort without stable=True, or descending: the order of ties would be unspecified "
                      "(refine's sort is a stable ascending sort)")
    x = em.value(a["self"])
    attrs = {"dim": _dim(a["dim"], len(em.type(x).shape))}
    return em.emit("sort_indices" if index else "sort_values", [x], attrs, index=index)


def _scatter_src(em: EmitterAPI, node: Any, a: dict[str, Any]) -> str:
    """scatter.src(self, dim, index, src): refine's scatter_src (rules/moe.py)."""
    if a.get("reduce") is not None:
        raise em.fail(f"scatter with reduce={a['reduce']!r} is not supported")
    x = em.value(a["self"])
    args = [x, em.value(a["index"]), em.value(a["src"])]
    return em.emit("scatter_src", args, {"dim": _dim(a["dim"], len(em.type(x).shape))})


def _nll_attrs(em: EmitterAPI, a: dict[str, Any]) -> dict[str, Any]:
    if a.get("weight") is not None:
        raise em.fail("nll_loss with class weights: refine's nll ops take none")
    return {"reduction": int(a["reduction"]), "ignore_index": int(a["ignore_index"])}


def _nll_loss_forward(em: EmitterAPI, node: Any, a: dict[str, Any], index: int) -> str:
    """Output 0: the loss; 1: the total weight (the count of targets not ignored)."""
    op = "nll_loss_forward" if index == 0 else "nll_loss_total_weight"
    return em.emit(op, [em.value(a["self"]), em.value(a["target"])], _nll_attrs(em, a), index=index)


def _nll_loss_backward(em: EmitterAPI, node: Any, a: dict[str, Any]) -> str:
    args = [em.value(a["grad_output"]), em.value(a["self"]), em.value(a["target"]), em.value(a["total_weight"])]
    return em.emit("nll_loss_backward", args, _nll_attrs(em, a))


def _log_softmax_backward_data(em: EmitterAPI, node: Any, a: dict[str, Any]) -> str:
    out = em.value(a["output"])
    return em.emit("_log_softmax_backward_data", [em.value(a["grad_output"]), out],
                   {"dim": _dim(a["dim"], len(em.type(out).shape))})


# base name -> handler; MULTI handlers take the output index
SPECIAL: dict[str, Handler] = {
    "full": _full, "full_like": _full, "zeros": _full, "zeros_like": _full, "ones": _full,
    "ones_like": _full, "scalar_tensor": _full, "new_full": _full, "new_zeros": _full, "new_ones": _full,
    "zero": _full, "fill": _full, "copy": _copy, "index_put": _index_put, "_unsafe_index_put": _index_put,
    "slice": _slice, "slice_scatter": _slice_scatter, "select_scatter": _select_scatter, "select": _select, "cat": _cat, "stack": _stack,
    "transpose": _transpose,
    "index": _index, "constant_pad_nd": _constant_pad_nd, "nll_loss_backward": _nll_loss_backward,
    "_log_softmax_backward_data": _log_softmax_backward_data,
}
SPECIAL_OVERLOAD: dict[tuple[str, str], Handler] = {("max", "default"): _max, ("scatter", "src"): _scatter_src}
MULTI: dict[str, Handler] = {
    "split": _split, "split_with_sizes": _split, "unbind": _split,
    "native_layer_norm": _native_layer_norm, "var_mean": _var_mean, "max": _max_dim,
    "topk": _topk, "sort": _sort, "nll_loss_forward": _nll_loss_forward,
}
