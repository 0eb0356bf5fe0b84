"""Read GraphGuard/Entangle `.gpickle` graph files without running any code from them.

A `.gpickle` is a pickle of a `torchgraph` PickleableGraph: FX-like nodes with direct
references to each other and `meta` holding shapes and stack traces. Plain `pickle.load`
would run whatever the file says, so a restricted unpickler resolves only a fixed list of
globals, each to an inert stand-in defined here, and everything is then converted to plain
dataclasses. Any other global is an error naming it.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refine.format import InputError

MAX_BYTES = 256 * 1024 * 1024  # far above the largest corpus file; a bound on what we parse


@dataclass(frozen=True)
class NodeRef:
    """An argument that is another node of the same graph."""

    name: str


@dataclass(frozen=True)
class SymbolRef:
    """A sympy symbol (a symbolic size) by name."""

    name: str


@dataclass
class PNode:
    name: str
    op: str  # FX opcode: placeholder / call_function / output / get_attr
    target: str  # e.g. "aten.mm.default", "_c10d_functional.all_reduce.default", or a placeholder name
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    shape: tuple[Any, ...] | None  # None for multi-output nodes (their getitems carry shapes)
    dtype: str | None
    stack_trace: str | None = None


@dataclass
class PGraph:
    path: str
    nodes: list[PNode]
    direction: str  # fw / bw / both
    gid: int
    rank: int
    index: dict[str, PNode] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.index = {n.name: n for n in self.nodes}


# --- inert stand-ins for the globals the files reference -------------------------------


class _Stub:
    """Accepts constructor arguments and state, and does nothing else."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Stub:
        obj = object.__new__(cls)
        obj._args = args
        obj._state = None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self._state = state


class _Graph(_Stub):
    pass


class _Node(_Stub):
    pass


class _TensorMetadata(_Stub):
    pass


class _Device(_Stub):
    pass


class _NodeSource(_Stub):
    pass


class _Symbol(_Stub):
    pass


@dataclass(frozen=True)
class _Constant:
    """A module-level constant such as torch.float32: never called."""

    value: str


_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool",
           "complex64", "complex128")

_ALLOWED: dict[tuple[str, str], Any] = {
    ("torchgraph.pgraph.pickleable", "PickleableGraph"): _Graph,
    ("torchgraph.pgraph.pickleable", "PickleableNode"): _Node,
    ("torch.fx.passes.shape_prop", "TensorMetadata"): _TensorMetadata,
    ("torch", "device"): _Device,
    ("torch.fx.traceback", "NodeSource"): _NodeSource,
    ("torch.fx.traceback", "NodeSource.NodeInfo"): _NodeSource,
    ("torch.fx.traceback", "NodeSourceAction"): _NodeSource,
    ("torch.fx.traceback", "CallMethodKey"): _NodeSource,
    ("torch.fx.traceback", "SequenceKey"): _NodeSource,
    ("torch.fx.experimental.proxy_tensor", "CallMethodKey"): _NodeSource,
    ("sympy.core.symbol", "Symbol"): _Symbol,
    **{("torch", d): _Constant(d) for d in _DTYPES},
    ("torch._utils", "torch.contiguous_format"): _Constant("contiguous_format"),
    ("torch._utils", "torch.channels_last"): _Constant("channels_last"),
    ("torch._utils", "torch.preserve_format"): _Constant("preserve_format"),
    ("torch", "contiguous_format"): _Constant("contiguous_format"),
    ("torch", "channels_last"): _Constant("channels_last"),
    ("torch", "preserve_format"): _Constant("preserve_format"),
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refuses global {module}.{name}: not a plain-data class of "
                                         "a graph file") from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refuses persistent ids (tensor storages)")


def load_gpickle(path: str | Path) -> PGraph:
    """The graph in a `.gpickle` file; InputError (exit 2) for anything else."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise InputError(str(p), "$", f"cannot read: {e.strerror or e}") from None
    if len(data) > MAX_BYTES:
        raise InputError(str(p), "$", f"{len(data)} bytes is larger than any graph file refine reads")
    try:
        obj = _Unpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, RecursionError, MemoryError, UnicodeDecodeError) as e:
        raise InputError(str(p), "$", f"not a readable graph pickle: {type(e).__name__}: {e}") from None
    if not isinstance(obj, _Graph) or not isinstance(obj._state, dict):
        raise InputError(str(p), "$", f"expected a PickleableGraph, got {type(obj).__name__}")
    return _convert_graph(str(p), obj._state)


def _convert_graph(path: str, st: dict[str, Any]) -> PGraph:
    raw = st.get("nodes")
    if not isinstance(raw, list):
        raise InputError(path, "$.nodes", "a PickleableGraph without a node list")
    names: dict[int, str] = {}
    for i, n in enumerate(raw):
        if not isinstance(n, _Node) or not isinstance(n._state, dict) or not isinstance(n._state.get("name"), str):
            raise InputError(path, f"$.nodes[{i}]", "not a PickleableNode with a name")
        names[id(n)] = n._state["name"]
    nodes = []
    for i, n in enumerate(raw):
        s = n._state
        where = f"$.nodes[{i}] ({s['name']})"
        meta = s.get("meta") or {}
        tm = meta.get("tensor_meta") if isinstance(meta, dict) else None
        shape, dtype = _tensor_meta(path, where, tm)
        target = s.get("target")
        nodes.append(PNode(
            name=s["name"], op=str(s.get("op")), target=target if isinstance(target, str) else str(target),
            args=tuple(_value(path, where, a, names) for a in (s.get("args") or ())),
            kwargs={str(k): _value(path, where, v, names) for k, v in (s.get("kwargs") or {}).items()},
            shape=shape, dtype=dtype,
            stack_trace=meta.get("stack_trace") if isinstance(meta.get("stack_trace"), str) else None,
        ))
    rank, gid = st.get("rank"), st.get("gid")
    return PGraph(path, nodes, str(st.get("direction")), gid if isinstance(gid, int) else 0,
                  rank if isinstance(rank, int) else 0)


def _tensor_meta(path: str, where: str, tm: Any) -> tuple[tuple[Any, ...] | None, str | None]:
    if tm is None or not isinstance(tm, _TensorMetadata) or len(tm._args) < 2:
        return None, None
    shape, dtype = tm._args[0], tm._args[1]
    if not isinstance(shape, (tuple, list)):
        raise InputError(path, where, f"tensor_meta shape is {type(shape).__name__}, not a tuple")
    dims = tuple(d.name if isinstance(d, _Symbol) else d for d in (_symbol(x) for x in shape))
    return dims, dtype.value if isinstance(dtype, _Constant) else None


def _symbol(x: Any) -> Any:
    if isinstance(x, _Symbol):
        name = x._args[0] if x._args else None
        return SymbolRef(str(name)) if name is not None else x
    return x


def _value(path: str, where: str, v: Any, names: dict[int, str]) -> Any:
    """Arguments as plain data: node references by name, dtypes and formats as strings."""
    if isinstance(v, _Node):
        if id(v) not in names:
            raise InputError(path, where, "an argument refers to a node outside the graph")
        return NodeRef(names[id(v)])
    if isinstance(v, (list, tuple)):
        return type(v)(_value(path, where, x, names) for x in v)
    if isinstance(v, dict):
        return {k: _value(path, where, x, names) for k, x in v.items()}
    if isinstance(v, _Constant):
        return v.value
    if isinstance(v, _Device):
        return "device"
    if isinstance(v, _Symbol):
        return _symbol(v)
    if isinstance(v, (_Stub,)):
        raise InputError(path, where, f"unexpected {type(v).__name__} object as an argument")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise InputError(path, where, f"unexpected {type(v).__name__} value as an argument")
