"""Read GraphGuard/Entangle `.gpickle` graph files without running any code from them.

A `.gpickle` is a pickle of a `torchgraph` PickleableGraph: FX-like nodes with direct
references to each other and `meta` holding shapes and stack traces. Plain `pickle.load`
would run whatever the file says, so a file is read in three steps, each an InputError
(exit 2) naming the file, the place and the reason when it fails:

1. a pre-scan of the opcode stream (decoded here with pickletools' opcode table, linear in
   the file) that follows the pickle machine's stack by kinds of objects and refuses,
   before anything is built: memo
   indices a pickler could not have written (the C unpickler allocates the memo up to the
   index), containers of more than MAX_ITEMS items, constructor calls with more than
   MAX_CALL_ARGS arguments (each call copies them), dict keys and set items whose hash an
   attacker controls (anything but strings, small ints, None/booleans and stand-ins:
   colliding keys make a dict quadratic), calls of anything but a named global, BUILD on
   anything but an object this file made (a global's stand-in is shared by every file
   read), and the opcodes no graph file uses (INST, OBJ, extensions, persistent ids,
   out-of-band buffers), and files of more than MAX_OPCODES opcodes (each makes at most one
   object or stack entry, so this bounds the unpickler's memory);
2. a restricted unpickler that resolves only a fixed list of globals, each to an inert
   stand-in defined here; any other global is an error naming it;
3. a validating conversion to plain dataclasses: every field a graph and a node must have,
   with its type; node names unique; argument values walked once per object (a DAG of
   shared references is exponential as a tree, so results are memoized by identity, a
   cycle is an error, nesting is at most MAX_DEPTH and each node's arguments as a tree at
   most MAX_VALUE_ITEMS, all nodes' together MAX_TREE_ITEMS, so later tree walks are
   bounded too); node references only to earlier nodes of the same graph (the dumps are
   in topological order: a cycle or a node of another graph is an error); shapes of
   non-negative int64 sizes.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refine.ir.errors import InputError

MAX_BYTES = 256 * 1024 * 1024  # far above the largest corpus file; a bound on what we parse
MAX_OPCODES = 1 << 23  # opcodes of a file (84k in the largest corpus file): bounds the objects and the stack
MAX_ITEMS = 1 << 20  # items of one container (the largest corpus list: a graph's ~1,000 nodes)
MAX_CALL_ARGS = 64  # arguments of one constructor call (the stand-ins' classes take at most 7)
MAX_DEPTH = 32  # nesting of an argument value (at most 3 in the corpus)
MAX_VALUE_ITEMS = 1 << 16  # one node's arguments counted as a tree (at most 239 in the corpus)
MAX_TREE_ITEMS = 1 << 20  # every node's arguments of a graph counted as trees (at most 4,900 in the corpus)
MAX_DIMS = 64  # dims of a tensor
INT64 = 1 << 63  # torch sizes are int64


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
    stack: tuple[str, ...] | None = None  # "file:line" frames, outermost first (Neuron dumps' meta["stack"])


@dataclass
class PGraph:
    path: str
    nodes: list[PNode]
    direction: str | None  # fw / bw / both, as the dump says (None: it does not say)
    gid: int | None
    rank: int | None
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


class _Key(_Stub):
    """A step of a key path (`meta["unbacked_bindings"]`): plain data refine does not read."""


class _Symbol(_Stub):
    pass


class _Constant:
    """A module-level constant such as torch.float32: never called, and immutable (one
    instance serves every file read, so a file's BUILD must not change it)."""

    __slots__ = ("value",)

    def __init__(self, value: str) -> None:
        object.__setattr__(self, "value", value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a constant's stand-in is immutable")

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError("BUILD on a constant")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Constant) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return f"_Constant({self.value!r})"


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
    # the key paths of meta["unbacked_bindings"] (frozen dataclasses of a name or an index)
    **{("torch.fx.experimental.symbolic_shapes", k): _Key
       for k in ("CallMethodKey", "DivideByKey", "InnerTensorKey", "ConvertIntKey")},
    **{("torch.utils._pytree", k): _Key for k in ("SequenceKey", "MappingKey", "GetAttrKey")},
    ("sympy.core.symbol", "Symbol"): _Symbol,
    **{("torch", d): _Constant(d) for d in _DTYPES},
    ("torch._utils", "torch.contiguous_format"): _Constant("contiguous_format"),
    ("torch._utils", "torch.channels_last"): _Constant("channels_last"),
    ("torch._utils", "torch.preserve_format"): _Constant("preserve_format"),
    ("torch", "contiguous_format"): _Constant("contiguous_format"),
    ("torch", "channels_last"): _Constant("channels_last"),
    ("torch", "preserve_format"): _Constant("preserve_format"),
}


def _short(s: str, n: int = 80) -> str:
    return s if len(s) <= n else s[:n] + "..."


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refuses global {_short(module)}.{_short(name)}: not a plain-data class "
                                         "of a graph file") from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refuses persistent ids (tensor storages)")


# --- 1. the opcode pre-scan ------------------------------------------------------------

# the kind of what an opcode pushes: s str, i small int, k None/bool, a another atom,
# L list, T tuple, D dict, S set, F frozenset, G a global, O an object a call made
_PUSH = {
    "SHORT_BINUNICODE": "s", "BINUNICODE": "s", "BINUNICODE8": "s", "UNICODE": "s", "STRING": "s",
    "BINSTRING": "s", "SHORT_BINSTRING": "s",
    "BININT": "i", "BININT1": "i", "BININT2": "i", "INT": "a", "LONG": "a", "LONG1": "a", "LONG4": "a",
    "NONE": "k", "NEWTRUE": "k", "NEWFALSE": "k", "FLOAT": "a", "BINFLOAT": "a",
    "BINBYTES": "a", "SHORT_BINBYTES": "a", "BINBYTES8": "a", "BYTEARRAY8": "a",
    "EMPTY_LIST": "L", "EMPTY_TUPLE": "T", "EMPTY_DICT": "D", "EMPTY_SET": "S", "GLOBAL": "G",
}
_HASHABLE = frozenset("sikOG")  # keys whose hash is cheap and not the file's to choose
_REFUSED = {
    "INST": "an old-style instance (a class called with arguments)", "OBJ": "an old-style instance",
    "EXT1": "an extension-registry global", "EXT2": "an extension-registry global",
    "EXT4": "an extension-registry global", "PERSID": "a persistent id", "BINPERSID": "a persistent id",
    "NEXT_BUFFER": "an out-of-band buffer", "READONLY_BUFFER": "an out-of-band buffer",
}
_KIND_NAMES = {"s": "a string", "i": "an integer", "k": "a constant", "a": "a number or bytes", "L": "a list",
               "T": "a tuple", "D": "a dict", "S": "a set", "F": "a frozenset", "G": "a global", "O": "an object"}


class _Refused(Exception):
    pass


class _Unreadable(_Refused):
    """Bytes that are no pickle at all: not an opcode, or cut short."""


# opcode byte -> (name, argument): n > 0 that many bytes; _LINE one line (_LINES two);
# _LEN1/_LEN4/_LEN4U/_LEN8 a length of 1/4/4/8 bytes (little-endian, _LEN4 signed) and that many bytes
_LINE, _LINES, _LEN1, _LEN4, _LEN4U, _LEN8 = -1, -2, -3, -4, -6, -5
_OPS: list[tuple[str, int, str | None] | None] = [None] * 256  # (name, argument, the kind it pushes)
for _op in pickletools.opcodes:
    _n = _op.arg.n if _op.arg is not None else 0
    _arg = _LINES if _op.arg is not None and _op.arg.name == "stringnl_noescape_pair" else \
        {-1: _LINE, -2: _LEN1, -3: _LEN4, -4: _LEN4U, -5: _LEN8}.get(_n, _n)
    _OPS[ord(_op.code)] = (_op.name, _arg, _PUSH.get(_op.name))


def _scan(path: str, data: bytes) -> None:
    """Decode the opcode stream, follow the pickle machine's stack by kinds of objects, and
    refuse, before unpickling, whatever could cost more than linear time or memory, or change
    a shared stand-in. (A decoder of its own: pickletools.genops costs twice as much.)"""
    kinds: list[str] = []  # per object the stream makes
    sizes: list[int] = []
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[int, int] = {}

    def new(kind: str, size: int = 0) -> int:
        if size > MAX_ITEMS:
            raise _Refused(f"{_KIND_NAMES[kind]} of {size} items (refine reads at most {MAX_ITEMS})")
        kinds.append(kind)
        sizes.append(size)
        return len(kinds) - 1

    def pop() -> int:
        if not stack or (marks and len(stack) <= marks[-1]):
            raise _Refused("the stack is empty")
        return stack.pop()

    def top() -> int:
        if not stack or (marks and len(stack) <= marks[-1]):
            raise _Refused("the stack is empty")
        return stack[-1]

    def pop_mark() -> list[int]:
        if not marks:
            raise _Refused("no MARK before it")
        k = marks.pop()
        items = stack[k:]
        del stack[k:]
        return items

    def grow(obj: int, kind: str, n: int) -> None:
        if kinds[obj] != kind:
            raise _Refused(f"adds items to {_KIND_NAMES[kinds[obj]]}, not {_KIND_NAMES[kind]}")
        sizes[obj] += n
        if sizes[obj] > MAX_ITEMS:
            raise _Refused(f"{_KIND_NAMES[kind]} of more than {MAX_ITEMS} items")

    def keys(items: list[int]) -> None:
        for x in items:
            if kinds[x] not in _HASHABLE:
                raise _Refused(f"{_KIND_NAMES[kinds[x]]} as a dict key or set item (graph files use strings)")

    def call(fn: int, args: int, kwargs: int | None = None) -> None:
        if kinds[fn] != "G":
            raise _Refused(f"calls {_KIND_NAMES[kinds[fn]]}, not a named class")
        if kinds[args] != "T":
            raise _Refused(f"call arguments in {_KIND_NAMES[kinds[args]]}, not a tuple")
        if kwargs is not None and kinds[kwargs] != "D":
            raise _Refused(f"keyword arguments in {_KIND_NAMES[kinds[kwargs]]}, not a dict")
        n = sizes[args] + (sizes[kwargs] if kwargs is not None else 0)
        if n > MAX_CALL_ARGS:
            raise _Refused(f"a call with {n} arguments (refine's stand-ins take at most {MAX_CALL_ARGS})")
        stack.append(new("O"))

    end = len(data)
    i = pos = count = 0
    name = ""
    try:
        while True:
            count += 1
            if count > MAX_OPCODES:
                raise _Refused(f"more than {MAX_OPCODES} opcodes (refine reads graph files of at most that many)")
            if i >= end:
                raise _Unreadable(f"the data ends at byte {end} before the pickle's STOP (a truncated file)")
            pos = i
            spec = _OPS[data[i]]
            if spec is None:
                raise _Unreadable(f"byte {pos} (0x{data[i]:02x}) is not a pickle opcode")
            name, arg, kind = spec
            i += 1
            a = i  # where the argument starts
            if arg > 0:
                i += arg
            elif arg == _LINE or arg == _LINES:
                for _ in range(1 if arg == _LINE else 2):
                    j = data.find(b"\n", i)
                    if j < 0:
                        raise _Unreadable(f"the argument of {name} at byte {pos} runs past the end (a truncated file)")
                    i = j + 1
            elif arg == _LEN1:
                i += 1 + (data[a] if a < end else 0)
            elif arg in (_LEN4, _LEN4U, _LEN8):
                w = 8 if arg == _LEN8 else 4
                length = int.from_bytes(data[a:a + w], "little", signed=arg == _LEN4)
                if length < 0:
                    raise _Refused("a negative length")
                i += w + length
            if i > end:
                raise _Unreadable(f"the argument of {name} at byte {pos} runs past the end (a truncated file)")
            if kind is not None:
                stack.append(new(kind))
            elif name == "MEMOIZE":
                memo[len(memo)] = top()
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                k = int(data[a:i]) if name == "GET" else int.from_bytes(data[a:i], "little")
                if k not in memo:
                    raise _Refused(f"memo index {k} was never stored")
                stack.append(memo[k])
            elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
                k = int(data[a:i]) if name == "PUT" else int.from_bytes(data[a:i], "little")
                # a pickler numbers its memo 0, 1, 2, ...: an index beyond the next one
                # would make the unpickler allocate its memo up to it
                if not 0 <= k <= len(memo):
                    raise _Refused(f"memo index {k}, beyond the {len(memo)} values stored so far")
                memo[k] = top()
            elif name == "MARK":
                marks.append(len(stack))
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                for _ in range(n):
                    pop()
                stack.append(new("T", n))
            elif name == "TUPLE":
                stack.append(new("T", len(pop_mark())))
            elif name == "LIST":
                stack.append(new("L", len(pop_mark())))
            elif name == "APPEND":
                pop()
                grow(top(), "L", 1)
            elif name == "APPENDS":
                items = pop_mark()
                grow(top(), "L", len(items))
            elif name in ("DICT", "SETITEMS"):
                items = pop_mark()
                if len(items) % 2:
                    raise _Refused("an odd number of items for key/value pairs")
                keys(items[0::2])
                if name == "DICT":
                    stack.append(new("D", len(items) // 2))
                else:
                    grow(top(), "D", len(items) // 2)
            elif name == "SETITEM":
                pop()
                keys([pop()])
                grow(top(), "D", 1)
            elif name == "ADDITEMS":
                items = pop_mark()
                keys(items)
                grow(top(), "S", len(items))
            elif name == "FROZENSET":
                items = pop_mark()
                keys(items)
                stack.append(new("F", len(items)))
            elif name == "STACK_GLOBAL":
                qual, module = pop(), pop()
                if kinds[qual] != "s" or kinds[module] != "s":
                    raise _Refused("a global named by something other than two strings")
                stack.append(new("G"))
            elif name in ("REDUCE", "NEWOBJ"):
                args = pop()
                call(pop(), args)
            elif name == "NEWOBJ_EX":
                kwargs, args = pop(), pop()
                call(pop(), args, kwargs)
            elif name == "BUILD":
                pop()
                obj = top()
                if kinds[obj] != "O":
                    raise _Refused(f"sets the state of {_KIND_NAMES[kinds[obj]]}, not of an object this file made")
            elif name == "DUP":
                stack.append(top())
            elif name == "POP":
                if marks and len(stack) == marks[-1]:
                    marks.pop()  # as the unpickler does: POP right after a MARK drops the mark
                else:
                    pop()
            elif name == "POP_MARK":
                pop_mark()
            elif name == "STOP":
                pop()
                return
            elif name in ("PROTO", "FRAME"):
                pass
            elif name in _REFUSED:
                raise _Refused(f"{_REFUSED[name]}: graph files do not use it")
            else:
                raise _Refused("an opcode refine does not read")
    except _Unreadable as e:
        raise InputError(path, "$", f"not a readable graph pickle: {e}") from None
    except _Refused as e:
        raise InputError(path, f"byte {pos} ({name})", str(e)) from None
    except ValueError:  # a GET/PUT line that is not a number
        raise InputError(path, f"byte {pos} ({name})", "its argument is not a number") from None


# --- 2. unpickling ---------------------------------------------------------------------


def load_gpickle(path: str | Path) -> PGraph:
    """The graph in a `.gpickle` file; InputError (exit 2) for anything else."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise InputError(str(p), "$", f"cannot read: {e.strerror or e}") from None
    if len(data) > MAX_BYTES:
        raise InputError(str(p), "$", f"{len(data)} bytes is larger than any graph file refine reads")
    if not data:
        raise InputError(str(p), "$", "an empty file, not a graph pickle")
    _scan(str(p), data)
    try:
        obj = _Unpickler(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 - nothing from the file runs, so any error means a bad file
        raise InputError(str(p), "$", f"not a readable graph pickle: {type(e).__name__}: {_short(str(e), 200)}") \
            from None
    try:
        return _Reader(str(p)).graph(obj)
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 - a last line of defence: the checks above should say why
        raise InputError(str(p), "$", f"not a graph refine can read ({type(e).__name__}: {_short(str(e), 200)})") \
            from None


# --- 3. the validating conversion ------------------------------------------------------


def _type(v: Any) -> str:
    return {_Graph: "PickleableGraph", _Node: "PickleableNode", _TensorMetadata: "TensorMetadata"}.get(
        type(v), type(v).__name__.lstrip("_"))


_NODE_FIELDS = ("name", "op", "target", "args", "kwargs", "meta")


class _Reader:
    """One file's conversion: argument values memoized by identity, with their tree sizes
    and the position of the latest node they refer to."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.done: dict[int, tuple[Any, int, int]] = {}  # id -> (value, tree size, latest node position)
        self.active: set[int] = set()
        self.position: dict[int, int] = {}  # id of a node object -> its position
        self.names: list[str] = []
        self.total = 0

    def fail(self, where: str, reason: str) -> InputError:
        return InputError(self.path, where, reason)

    def graph(self, obj: Any) -> PGraph:
        if not isinstance(obj, _Graph):
            raise self.fail("$", f"expected a PickleableGraph, got {_type(obj)}")
        st = obj._state
        if not isinstance(st, dict):
            raise self.fail("$", f"a PickleableGraph whose state is {_type(st)}, not a dict of fields")
        raw = st.get("nodes")
        if not isinstance(raw, list):
            raise self.fail("$.nodes", f"a PickleableGraph needs a node list, got {_type(raw)}")
        seen: dict[str, int] = {}
        for i, n in enumerate(raw):
            where = f"$.nodes[{i}]"
            if not isinstance(n, _Node):
                raise self.fail(where, f"expected a PickleableNode, got {_type(n)}")
            s = n._state
            if not isinstance(s, dict):
                raise self.fail(where, f"a PickleableNode whose state is {_type(s)}, not a dict of fields")
            missing = [f for f in _NODE_FIELDS if f not in s]
            if missing:
                raise self.fail(where, f"a PickleableNode without {', '.join(missing)}")
            name = s["name"]
            if not isinstance(name, str) or not name:
                raise self.fail(f"{where}.name", f"a node name must be a non-empty string, got {_type(name)}")
            if name in seen:
                raise self.fail(f"{where} ({_short(name)})", f"a second node named {_short(name)!r} (the first is "
                                                            f"$.nodes[{seen[name]}])")
            seen[name] = i
            self.position[id(n)] = i
            self.names.append(name)
        nodes = [self.node(i, n._state) for i, n in enumerate(raw)]
        direction, gid, rank = st.get("direction"), st.get("gid"), st.get("rank")
        if direction is not None and not isinstance(direction, str):
            raise self.fail("$.direction", f"expected a string, got {_type(direction)}")
        for k, v in (("gid", gid), ("rank", rank)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < INT64):
                raise self.fail(f"$.{k}", f"expected a non-negative integer, got {_type(v)}")
        return PGraph(self.path, nodes, direction, gid, rank)

    def node(self, i: int, s: dict[str, Any]) -> PNode:
        name = s["name"]
        where = f"$.nodes[{i}] ({_short(name)})"
        for k in ("op", "target"):
            if not isinstance(s[k], str):
                raise self.fail(f"{where}.{k}", f"expected a string, got {_type(s[k])}")
        args, kwargs, meta = s["args"], s["kwargs"], s["meta"]
        if not isinstance(args, (list, tuple)):
            raise self.fail(f"{where}.args", f"expected a tuple of arguments, got {_type(args)}")
        if not isinstance(kwargs, dict):
            raise self.fail(f"{where}.kwargs", f"expected a dict of keyword arguments, got {_type(kwargs)}")
        if not isinstance(meta, dict):
            raise self.fail(f"{where}.meta", f"expected a dict, got {_type(meta)}")
        a = self.arguments(i, f"{where}.args", args)
        kw = self.arguments(i, f"{where}.kwargs", kwargs)
        shape, dtype = self.tensor_meta(f"{where}.meta.tensor_meta", meta.get("tensor_meta"))
        trace = meta.get("stack_trace")
        if trace is not None and not isinstance(trace, str):
            raise self.fail(f"{where}.meta.stack_trace", f"expected a string, got {_type(trace)}")
        stack = meta.get("stack")
        if stack is not None and (not isinstance(stack, (list, tuple)) or len(stack) > MAX_ITEMS
                                  or not all(isinstance(x, str) for x in stack)):
            raise self.fail(f"{where}.meta.stack", f"expected a list of \"file:line\" strings, got {_type(stack)}"
                                                   + (" with other items" if isinstance(stack, (list, tuple)) else ""))
        return PNode(name=name, op=s["op"], target=s["target"], args=tuple(a), kwargs=kw, shape=shape, dtype=dtype,
                     stack_trace=trace, stack=tuple(stack) if stack is not None else None)

    def arguments(self, i: int, where: str, v: Any) -> Any:
        """A node's args or kwargs as plain data, bounded as a tree, referring to earlier nodes only."""
        out, size, latest = self.value(where, v, 0)
        if size > MAX_VALUE_ITEMS:
            raise self.fail(where, f"{size} items counted as a tree (shared references count each time they occur; "
                                   f"refine reads at most {MAX_VALUE_ITEMS})")
        self.total += size
        if self.total > MAX_TREE_ITEMS:
            raise self.fail(where, f"the arguments so far make more than {MAX_TREE_ITEMS} items counted as trees")
        if latest >= i:
            what = "itself" if latest == i else f"node {_short(self.names[latest])!r}, which comes after it"
            raise self.fail(where, f"refers to {what}: a node reads earlier nodes only (a cycle of references, "
                                   "or nodes out of order)")
        return out

    def value(self, where: str, v: Any, depth: int) -> tuple[Any, int, int]:
        """(plain value, size as a tree, position of the latest node it refers to or -1)."""
        if v is None or isinstance(v, (bool, float, str)):
            return v, 1, -1
        if isinstance(v, int):
            if not -INT64 <= v < INT64:
                raise self.fail(where, "an integer outside int64")
            return v, 1, -1
        if isinstance(v, _Node):
            k = self.position.get(id(v))
            if k is None:
                raise self.fail(where, "refers to a node that is not in this graph's node list")
            return NodeRef(self.names[k]), 1, k
        if isinstance(v, _Constant):
            return v.value, 1, -1
        if isinstance(v, _Device):
            return "device", 1, -1
        if isinstance(v, _Symbol):
            return self.symbol(where, v), 1, -1
        if isinstance(v, (list, tuple, dict)):
            key = id(v)
            hit = self.done.get(key)
            if hit is not None:
                return hit
            if key in self.active:
                raise self.fail(where, f"a {_type(v)} that contains itself (a cycle of references)")
            if depth >= MAX_DEPTH:
                raise self.fail(where, f"values nested deeper than {MAX_DEPTH}")
            self.active.add(key)
            size, latest = 1, -1
            if isinstance(v, dict):
                out: Any = {}
                for k, x in v.items():
                    if not isinstance(k, str):
                        raise self.fail(where, f"a dict key that is {_type(k)}, not a string")
                    out[k], n, last = self.value(f"{where}[{_short(k, 40)!r}]", x, depth + 1)
                    size, latest = size + n, max(latest, last)
                    if size > MAX_VALUE_ITEMS:
                        break
            else:
                items = []
                for j, x in enumerate(v):
                    y, n, last = self.value(f"{where}[{j}]", x, depth + 1)
                    items.append(y)
                    size, latest = size + n, max(latest, last)
                    if size > MAX_VALUE_ITEMS:
                        break
                out = type(v)(items)
            self.active.discard(key)
            if size > MAX_VALUE_ITEMS:
                raise self.fail(where, f"more than {MAX_VALUE_ITEMS} items counted as a tree (shared references "
                                       "count each time they occur)")
            self.done[key] = (out, size, latest)
            return out, size, latest
        if isinstance(v, _Stub):
            raise self.fail(where, f"unexpected {_type(v)} object as an argument")
        raise self.fail(where, f"unexpected {_type(v)} value as an argument")

    def symbol(self, where: str, x: _Symbol) -> SymbolRef:
        name = x._args[0] if x._args else None
        if not isinstance(name, str):
            raise self.fail(where, f"a sympy Symbol named by {_type(name)}, not a string")
        return SymbolRef(name)

    def tensor_meta(self, where: str, tm: Any) -> tuple[tuple[Any, ...] | None, str | None]:
        if tm is None or isinstance(tm, (list, tuple)):
            return None, None  # no shape, or a multi-output node's (its getitem users carry them)
        if not isinstance(tm, _TensorMetadata):
            raise self.fail(where, f"expected a TensorMetadata, got {_type(tm)}")
        if len(tm._args) < 2:
            return None, None
        shape, dtype = tm._args[0], tm._args[1]
        if not isinstance(shape, (tuple, list)):
            raise self.fail(f"{where}.shape", f"expected a tuple of sizes, got {_type(shape)}")
        if len(shape) > MAX_DIMS:
            raise self.fail(f"{where}.shape", f"{len(shape)} dims (refine reads at most {MAX_DIMS})")
        dims: list[Any] = []
        numel = 1
        for k, d in enumerate(shape):
            if isinstance(d, _Symbol):
                dims.append(self.symbol(f"{where}.shape[{k}]", d))
                continue
            if not isinstance(d, int) or isinstance(d, bool):
                raise self.fail(f"{where}.shape[{k}]", f"a size must be an integer or a symbol, got {_type(d)}")
            if not 0 <= d < INT64:
                raise self.fail(f"{where}.shape[{k}]", "a size must be a non-negative int64, got "
                                                       + ("a negative one" if d < 0 else "a larger one"))
            numel *= d
            dims.append(d)
        if numel >= INT64:
            raise self.fail(f"{where}.shape", "a tensor of more elements than int64 counts")
        return tuple(dims), dtype.value if isinstance(dtype, _Constant) else None
