"""`refine import entangle` on hostile and malformed `.gpickle` files: every one is exit 2
naming the file (and, for a structural fault, the node and field) and the reason, within a memory bound,
never a traceback; and the real dump features the importer reads (another graph id in the
directory, unbacked-binding key paths, Neuron `meta["stack"]` source lines).

Each file is made here: graphs with stand-in torchgraph classes pickled by `pickle` (so the
bytes are what a real dump holds), hostile opcode streams assembled by hand."""

from __future__ import annotations

import json
import pickle
import pickletools
import shutil
import struct
import tracemalloc
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch.fx.passes.shape_prop import TensorMetadata

import refine.frontends.importer.entangle  # noqa: F401 - imported here so the timings below measure the import only
from refine.cli import main
from refine.frontends.importer.gpickle import load_gpickle
from refine.ir.errors import InputError
from tests.helpers import torchgraph

# Python memory one import may allocate: a refusal here takes at most tens of MB (a list is
# read up to its bound of 2**20 items before it is refused), while the bombs expand to 2**30
# leaves or hold GBs (they took minutes and ended in MemoryError). A bound on what a refusal
# costs, asserted as memory rather than time (timings are not tests).
PEAK = 64 << 20  # bytes

Nodes = list[Any]


# --- graphs pickled as torchgraph writes them --------------------------------------------


def _meta(shape: Any = (2, 3), dtype: Any = torch.float32, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    if shape is not None:
        meta["tensor_meta"] = TensorMetadata(shape, dtype, False, (), None, False, {})
    return meta | extra


def _node(mod: types.ModuleType, name: Any, op: str, target: Any, args: Any = (), kwargs: Any = None,
          meta: Any = None) -> Any:
    n = mod.PickleableNode()
    n.__dict__.update(name=name, op=op, target=target, args=args, kwargs=kwargs if kwargs is not None else {},
                      meta=meta if meta is not None else _meta(), rank=0)
    return n


def _graph(mutate: Callable[[types.ModuleType, Nodes], Any] | None = None, target: str = "aten.neg.default",
           gid: Any = 0, rank: Any = None, direction: Any = "fw", y_meta: dict[str, Any] | None = None) -> bytes:
    """x (a [2, 3] placeholder) -> y = target(x) -> output (y,); `mutate(mod, [x, y, output])`
    may change any of it, and what it returns (if anything) is pickled instead of the graph.
    (The rank is None, "not said", so one dump serves as any rank.)"""
    with torchgraph() as mod:
        x = _node(mod, "x", "placeholder", "x")
        y = _node(mod, "y", "call_function", target, (x,), meta=_meta(**(y_meta or {})))
        out = _node(mod, "output", "output", "output", ((y,),), meta={})
        nodes = [x, y, out]
        g = mod.PickleableGraph()
        g.__dict__.update(nodes=nodes, node_dict={}, direction=direction, gid=gid, rank=rank, readable_str="")
        other = mutate(mod, nodes) if mutate is not None else None
        return pickle.dumps(other if other is not None else g, protocol=5)


def _cli(tmp_path: Path, seq: bytes, ranks: list[bytes], *extra: str, name: str = "fw.g0") -> tuple[Any, int]:
    """`refine import entangle` on a sequential dump and one dump per rank; (result, the peak
    of the Python memory it allocated, in bytes). Run once untraced first when nothing has
    imported the importer yet, so the peak counts the import's work, not module loading."""
    for d, files in (("seq", [seq]), ("dist", ranks)):
        (tmp_path / d).mkdir(exist_ok=True)
        for r, data in enumerate(files):
            (tmp_path / d / f"{name}.r{r}.gpickle").write_bytes(data)
    args = ["import", "entangle", str(tmp_path / "seq"), str(tmp_path / "dist"), "--out", str(tmp_path / "out"),
            *extra]
    if not _WARM:
        CliRunner().invoke(main, args)
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        _WARM.append(True)
    tracemalloc.start()
    try:
        r = CliRunner().invoke(main, args)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return r, peak


_WARM: list[bool] = []


def _refused(tmp_path: Path, bad: bytes, *reason: str) -> str:
    """The bad dump as rank 1 of two (the sequential dump and rank 0 are good): exit 2
    naming that file and each `reason` fragment, within PEAK bytes, no traceback, no case written."""
    r, peak = _cli(tmp_path, _graph(), [_graph(), bad])
    bad_file = str(tmp_path / "dist" / "fw.g0.r1.gpickle")
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    assert bad_file in r.output and "Traceback" not in r.output, r.output
    for part in reason:
        assert part in r.output, r.output
    assert peak < PEAK, f"{peak >> 20} MB: {r.output}"
    assert not (tmp_path / "out").exists()
    return r.output


def test_the_base_graph_imports(tmp_path: Path) -> None:
    """The graph every case below breaks imports as it is (exit 0)."""
    r, _ = _cli(tmp_path, _graph(), [_graph(), _graph()])
    assert r.exit_code == 0, r.output
    seq = json.loads((tmp_path / "out" / "seq.json").read_text())
    assert [n["op"] for n in seq["graph"]["nodes"]] == ["neg"]


# --- 1. malformed structure: exit 2 naming the file, the node and field, the reason --------


def _set(i: int, **fields: Any) -> Callable[[types.ModuleType, Nodes], None]:
    return lambda mod, nodes: nodes[i].__dict__.update(fields)


def _drop(i: int, name: str) -> Callable[[types.ModuleType, Nodes], None]:
    def drop(mod: types.ModuleType, nodes: Nodes) -> None:
        del nodes[i].__dict__[name]
    return drop


def _self_list(mod: types.ModuleType, nodes: Nodes) -> None:
    loop: list[Any] = [nodes[0]]
    loop.append(loop)
    nodes[1].args = (loop,)


def _self_dict(mod: types.ModuleType, nodes: Nodes) -> None:
    loop: dict[str, Any] = {}
    loop["again"] = loop
    nodes[1].kwargs = {"k": loop}


def _cycle(mod: types.ModuleType, nodes: Nodes) -> None:
    nodes[0].__dict__.update(op="call_function", target="aten.neg.default", args=(nodes[1],))


def _stranger(mod: types.ModuleType, nodes: Nodes) -> None:
    nodes[1].args = (_node(mod, "x", "placeholder", "x"),)  # a node of another graph, with a known name


def _deep(mod: types.ModuleType, nodes: Nodes) -> None:
    v: Any = nodes[0]
    for _ in range(200):
        v = [v]
    nodes[1].args = (v,)


def _graph_state(state: Any) -> Callable[[types.ModuleType, Nodes], Any]:
    def make(mod: types.ModuleType, nodes: Nodes) -> Any:
        mod.PickleableGraph.__reduce__ = lambda self: (mod.PickleableGraph, (), state)
        return mod.PickleableGraph()
    return make


def _listed_node(mod: types.ModuleType, nodes: Nodes) -> None:
    n = mod.PickleableNode()
    n.__getstate__ = lambda: [1, 2]  # pickled as the node's state
    nodes.append(n)


def _shape(shape: Any) -> Callable[[types.ModuleType, Nodes], None]:
    return lambda mod, nodes: nodes[1].meta.update(tensor_meta=TensorMetadata(shape, torch.float32, False, (), None,
                                                                                False, {}))


MALFORMED = {
    "meta is a list": (_set(1, meta=[1, 2]), "$.nodes[1] (y).meta", "expected a dict, got list"),
    "args is an int": (_set(1, args=3), "$.nodes[1] (y).args", "expected a tuple of arguments, got int"),
    "kwargs is a list": (_set(1, kwargs=[1]), "$.nodes[1] (y).kwargs", "expected a dict of keyword arguments"),
    "args hold a list that holds itself": (_self_list, "$.nodes[1] (y).args[0]", "contains itself"),
    "kwargs hold a dict that holds itself": (_self_dict, "$.nodes[1] (y).kwargs['k']['again']", "contains itself"),
    "a name that is not a string": (_set(1, name=5), "$.nodes[1].name", "non-empty string, got int"),
    "an empty name": (_set(1, name=""), "$.nodes[1].name", "non-empty string"),
    "a target that is an int": (_set(1, target=7), "$.nodes[1] (y).target", "expected a string, got int"),
    "a target that is a node": (lambda mod, nodes: nodes[1].__dict__.update(target=nodes[0]), "$.nodes[1] (y).target",
                                "expected a string, got PickleableNode"),
    "an op that is None": (_set(1, op=None), "$.nodes[1] (y).op", "expected a string, got NoneType"),
    "no op": (_drop(1, "op"), "$.nodes[1]", "without op"),
    "no target": (_drop(1, "target"), "$.nodes[1]", "without target"),
    "no args": (_drop(1, "args"), "$.nodes[1]", "without args"),
    "no meta": (_drop(1, "meta"), "$.nodes[1]", "without meta"),
    "a negative size": (_shape((-1, 3)), "$.nodes[1] (y).meta.tensor_meta.shape[0]", "non-negative int64, got a negative one"),
    "a size beyond int64": (_shape((2 ** 70, 3)), "$.nodes[1] (y).meta.tensor_meta.shape[0]", "got a larger one"),
    "more elements than int64": (_shape((2 ** 40, 2 ** 40)), "$.nodes[1] (y).meta.tensor_meta.shape", "more elements"),
    "a float size": (_shape((2.5, 3)), "$.nodes[1] (y).meta.tensor_meta.shape[0]", "an integer or a symbol, got float"),
    "a string size": (_shape(("3", 3)), "$.nodes[1] (y).meta.tensor_meta.shape[0]", "got str"),
    "a bool size": (_shape((True, 3)), "$.nodes[1] (y).meta.tensor_meta.shape[0]", "got bool"),
    "a shape that is an int": (_shape(6), "$.nodes[1] (y).meta.tensor_meta.shape", "expected a tuple of sizes, got int"),
    "a shape of 100 dims": (_shape((1,) * 100), "$.nodes[1] (y).meta.tensor_meta.shape", "100 dims"),
    "tensor_meta is a string": (lambda mod, nodes: nodes[1].meta.update(tensor_meta="f32[2,3]"),
                                "$.nodes[1] (y).meta.tensor_meta", "expected a TensorMetadata, got str"),
    "stack_trace is an int": (lambda mod, nodes: nodes[1].meta.update(stack_trace=5), "$.nodes[1] (y).meta.stack_trace",
                              "expected a string"),
    "stack holds ints": (lambda mod, nodes: nodes[1].meta.update(stack=[1, 2]), "$.nodes[1] (y).meta.stack", "file:line"),
    "two nodes with one name": (_set(1, name="x"), "$.nodes[1] (x)", "a second node named 'x'"),
    "a node of another graph": (_stranger, "$.nodes[1] (y).args", "not in this graph's node list"),
    "nodes referring to each other": (_cycle, "$.nodes[0] (x).args", "node 'y', which comes after it"),
    "a node referring to itself": (lambda mod, nodes: nodes[1].__dict__.update(args=(nodes[1],)),
                                   "$.nodes[1] (y).args", "refers to itself"),
    "the output before its value": (lambda mod, nodes: nodes.reverse(), "$.nodes[0] (output).args",
                                    "comes after it"),
    "a keyword that is not a string": (_set(1, kwargs={1: 2}), "$.nodes[1] (y).kwargs", "a dict key that is int"),
    "bytes as an argument": (_set(1, args=(b"\x00",)), "$.nodes[1] (y).args[0]", "unexpected bytes value"),
    "a set as an argument": (_set(1, args=({1, 2},)), "$.nodes[1] (y).args[0]", "unexpected set value"),
    "an integer beyond int64": (_set(1, args=(2 ** 80,)), "$.nodes[1] (y).args[0]", "outside int64"),
    "arguments nested 200 deep": (_deep, "$.nodes[1] (y).args[0]", "nested deeper than 32"),
    "a node that is not a PickleableNode": (lambda mod, nodes: nodes.append(5), "$.nodes[3]",
                                            "expected a PickleableNode, got int"),
    "a node whose state is a list": (_listed_node, "$.nodes[3]", "a PickleableNode whose state is list"),
    "nodes that are a dict": (_graph_state({"nodes": {"x": 1}}), "$.nodes", "needs a node list, got dict"),
    "a graph that is a node": (lambda mod, nodes: nodes[1], "$", "expected a PickleableGraph, got PickleableNode"),
    "a graph that is a list": (lambda mod, nodes: [1, 2, 3], "$", "expected a PickleableGraph, got list"),
    "a graph whose state is a list": (_graph_state([1, 2]), "$", "whose state is list"),
    "a graph without nodes": (_graph_state({"gid": 0}), "$.nodes", "needs a node list, got NoneType"),
    "a gid that is a string": (None, "$.gid", "expected a non-negative integer, got str"),
    "a direction that is an int": (None, "$.direction", "expected a string, got int"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_graph_is_refused(tmp_path: Path, case: str) -> None:
    mutate, where, reason = MALFORMED[case]
    if case == "a gid that is a string":
        bad = _graph(gid="0")
    elif case == "a direction that is an int":
        bad = _graph(direction=1)
    else:
        bad = _graph(mutate)
    out = _refused(tmp_path, bad, reason)
    assert f": {where}" in out, out


# --- 2. hostile opcode streams: exit 2 within PEAK bytes, the file named ---------------


def _op(name: str) -> bytes:
    return next(o.code for o in pickletools.opcodes if o.name == name).encode("latin-1")


def _str(s: str) -> bytes:
    b = s.encode()
    return _op("SHORT_BINUNICODE") + bytes([len(b)]) + b


def _global(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + _op("STACK_GLOBAL")


PROTO = _op("PROTO") + b"\x04"
STOP = _op("STOP")


def _splice(marker: str, payload: Callable[[int], bytes], data: bytes | None = None) -> bytes:
    """A good graph whose y reads `marker` as its second argument, with that string replaced
    by `payload(k)`: opcodes leaving one value on the stack and storing it (and only it) at
    memo index k, the index the marker had, so the rest of the stream is unchanged."""
    if data is None:
        data = _graph(lambda mod, nodes: nodes[1].__dict__.update(args=(nodes[0], marker)))
    needle = _str(marker) + _op("MEMOIZE")
    at = data.index(needle)
    k = sum(1 for op, _, pos in pickletools.genops(data) if op.name == "MEMOIZE" and pos < at)
    framed = data[:at] + payload(k) + data[at + len(needle):]
    return _unframe(framed)


def _unframe(data: bytes) -> bytes:
    """The stream without its FRAME opcodes (their lengths no longer fit once spliced)."""
    out, i = bytearray(), 0
    for op, _, pos in pickletools.genops(data):
        if op.name == "FRAME":
            out += data[i:pos]
            i = pos + 9
    return bytes(out + data[i:])


def _put(k: int) -> bytes:
    return _op("BINPUT") + bytes([k]) if k < 256 else _op("LONG_BINPUT") + struct.pack("<I", k)


def _get(k: int) -> bytes:
    return _op("BINGET") + bytes([k]) if k < 256 else _op("LONG_BINGET") + struct.pack("<I", k)


def _memo_bomb(k: int) -> bytes:
    """[v, v] of [v, v] of ... 30 times, by BINPUT/BINGET of one memo slot: 2**30 leaves as a tree."""
    level = _op("MARK") + _get(k) + _get(k) + _op("LIST") + _put(k) + _op("POP")
    return _op("EMPTY_LIST") + _put(k) + _op("POP") + level * 30 + _get(k)


def _dup_bomb(k: int) -> bytes:
    """(v, v) of (v, v) of ... 30 times, by DUP (no memo)."""
    return _op("NONE") + (_op("DUP") + _op("TUPLE2")) * 30 + _put(k)


def _dict_bomb(k: int) -> bytes:
    """{"a": v, "b": v} nested 30 times."""
    level = _op("MARK") + _str("a") + _get(k) + _str("b") + _get(k) + _op("DICT") + _put(k) + _op("POP")
    return _op("EMPTY_DICT") + _put(k) + _op("POP") + level * 30 + _get(k)


def _self_append(k: int) -> bytes:
    """A list appended to itself 100,000 times."""
    return _op("EMPTY_LIST") + _put(k) + (_get(k) + _op("APPEND")) * 100_000


def _deep_tuple(k: int) -> bytes:
    """(((...(None,)...),),) 100,000 deep: one byte per level."""
    return _op("NONE") + _op("TUPLE1") * 100_000 + _put(k)


def _colliding_keys(n: int) -> bytes:
    """A dict of n int keys with one hash (multiples of the modulus of int hashing): each
    insertion compares with every key before it."""
    p = (1 << 61) - 1
    body = b"".join(_op("LONG1") + bytes([12]) + (i * p).to_bytes(12, "little") + _op("BININT1") + b"\x00"
                    for i in range(1, n + 1))
    return PROTO + _op("EMPTY_DICT") + _op("MARK") + body + _op("SETITEMS") + STOP


def _copied_args(n: int) -> bytes:
    """One tuple of n items passed to n constructor calls: each call copies it."""
    big = _op("MARK") + _op("NONE") * n + _op("TUPLE") + _op("MEMOIZE")  # memo 1
    call = _get(0) + _get(1) + _op("NEWOBJ") + _op("POP")
    return PROTO + _global("torchgraph.pgraph.pickleable", "PickleableNode") + _op("MEMOIZE") + big + call * n + \
        _op("NONE") + STOP


HOSTILE: dict[str, tuple[Callable[[], bytes], str]] = {
    "a memo bomb of nested lists as an argument": (lambda: _splice("MARKER", _memo_bomb), "counted as a tree"),
    "a DUP bomb of nested tuples as an argument": (lambda: _splice("MARKER", _dup_bomb), "counted as a tree"),
    "a memo bomb of nested dicts as an argument": (lambda: _splice("MARKER", _dict_bomb), "counted as a tree"),
    "a list appended to itself": (lambda: _splice("MARKER", _self_append), "contains itself"),
    "a tuple nested 100,000 deep": (lambda: _splice("MARKER", _deep_tuple), "nested deeper than 32"),
    "dict keys with one hash": (lambda: _colliding_keys(40_000), "as a dict key"),
    "a big tuple passed to many calls": (lambda: _copied_args(60_000), "a call with 60000 arguments"),
    "a memo index of 2**32 - 16": (lambda: PROTO + _op("NONE") + _op("LONG_BINPUT") + struct.pack("<I", 2 ** 32 - 16)
                                   + STOP, "memo index 4294967280"),
    "a memo read never stored": (lambda: PROTO + _get(5) + STOP, "memo index 5 was never stored"),
    "a bytes length past the end": (lambda: PROTO + _op("BINBYTES8") + struct.pack("<Q", 2 ** 60) + STOP,
                                    "runs past the end"),
    "a list of 2**21 items": (lambda: PROTO + _op("EMPTY_LIST") + (_op("MARK") + _op("NONE") * 50_000
                                                                   + _op("APPENDS")) * 42 + STOP, "items"),
    "os.system": (lambda: PROTO + _global("os", "system") + _str("echo pwned") + _op("TUPLE1") + _op("REDUCE") + STOP,
                  "refuses global os.system"),
    "builtins.eval": (lambda: PROTO + _global("builtins", "eval") + _str("1") + _op("TUPLE1") + _op("REDUCE") + STOP,
                      "refuses global builtins.eval"),
    "copyreg._reconstructor (a subclass trick)": (
        lambda: PROTO + _global("copyreg", "_reconstructor") + _global("torchgraph.pgraph.pickleable", "PickleableNode")
        + _global("builtins", "object") + _op("NONE") + _op("TUPLE3") + _op("REDUCE") + STOP,
        "refuses global copyreg._reconstructor"),
    "an allowed class called with a forbidden global": (
        lambda: PROTO + _global("torch", "device") + _global("os", "system") + _op("TUPLE1") + _op("REDUCE") + STOP,
        "refuses global os.system"),
    "REDUCE of a list": (lambda: PROTO + _op("EMPTY_LIST") + _op("EMPTY_TUPLE") + _op("REDUCE") + STOP,
                         "calls a list, not a named class"),
    "BUILD on a dtype constant": (lambda: PROTO + _global("torch", "float32") + _op("EMPTY_DICT") + _str("value")
                                  + _str("int64") + _op("SETITEM") + _op("BUILD") + STOP, "sets the state of a global"),
    "BUILD on an allowed class": (lambda: PROTO + _global("torchgraph.pgraph.pickleable", "PickleableNode")
                                  + _op("EMPTY_DICT") + _op("BUILD") + STOP, "sets the state of a global"),
    "APPEND to a stand-in object": (lambda: PROTO + _global("torch", "device") + _op("EMPTY_TUPLE") + _op("NEWOBJ")
                                    + _op("NONE") + _op("APPEND") + STOP, "adds items to an object, not a list"),
    "INST": (lambda: b"(S'echo pwned'\nios\nsystem\n.", "old-style instance"),
    "OBJ": (lambda: PROTO + _op("MARK") + _global("os", "system") + _str("echo pwned") + _op("OBJ") + STOP,
            "old-style instance"),
    "a persistent id": (lambda: b"P1\n.", "a persistent id"),
    "a binary persistent id": (lambda: PROTO + _str("storage") + _op("BINPERSID") + STOP, "a persistent id"),
    "an extension code": (lambda: PROTO + _op("EXT1") + b"\x01" + STOP, "an extension-registry global"),
    "an out-of-band buffer": (lambda: PROTO[:1] + b"\x05" + _op("NEXT_BUFFER") + STOP, "an out-of-band buffer"),
    "a dict key that is a tuple": (lambda: PROTO + _op("EMPTY_DICT") + _op("EMPTY_TUPLE") + _op("NONE") + _op("SETITEM")
                                   + STOP, "a tuple as a dict key"),
    "a set of floats": (lambda: PROTO + _op("EMPTY_SET") + _op("MARK") + _op("BINFLOAT") + struct.pack(">d", 1.0)
                        + _op("ADDITEMS") + STOP, "set item"),
    "a global named by an int": (lambda: PROTO + _str("os") + _op("BININT1") + b"\x01" + _op("STACK_GLOBAL") + STOP,
                                 "a global named by something other than two strings"),
    "POP of an empty stack": (lambda: PROTO + _op("POP") + STOP, "the stack is empty"),
    "APPENDS without a MARK": (lambda: PROTO + _op("EMPTY_LIST") + _op("APPENDS") + STOP, "no MARK"),
    "not a pickle": (lambda: b"GPICKLE? no, a text file\n", "not a readable graph pickle"),
    "an empty file": (lambda: b"", "an empty file"),
    "a truncated pickle": (lambda: _graph()[:-40], "truncated"),
    "a pickle without STOP": (lambda: PROTO + _op("NONE"), "truncated"),
    "a GET of a word": (lambda: b"N0gzero\n.", "its argument is not a number"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_pickle_is_refused_quickly(tmp_path: Path, case: str) -> None:
    make, reason = HOSTILE[case]
    _refused(tmp_path, make(), reason)
    assert not Path("/tmp/refine_sound_pwned").exists()


@pytest.mark.parametrize("bound, payload, reason", [
    ("MAX_OPCODES", PROTO + (_op("NONE") + _op("POP")) * 600 + _op("NONE") + STOP, "more than 1000 opcodes"),
    ("MAX_ITEMS", PROTO + _op("MARK") + _op("NONE") * 1001 + _op("LIST") + STOP, "a list of 1001 items"),
    ("MAX_CALL_ARGS", PROTO + _global("torch", "device") + _op("MARK") + _op("NONE") * 1001 + _op("TUPLE")
     + _op("REDUCE") + STOP, "a call with 1001 arguments"),
])
def test_each_bound_of_the_pre_scan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bound: str, payload: bytes,
                                    reason: str) -> None:
    """Each bound, lowered to 1000 so a small file exceeds it: refused before unpickling."""
    from refine.frontends.importer import gpickle

    monkeypatch.setattr(gpickle, bound, 1000)
    p = tmp_path / "f.gpickle"
    p.write_bytes(payload)
    with pytest.raises(InputError) as e:
        load_gpickle(p)
    assert reason in e.value.reason and e.value.file == str(p), e.value


def test_the_splice_keeps_a_good_graph_good(tmp_path: Path) -> None:
    """The splicing the bombs use, with a payload that is one string: the graph reads as
    before, so each bomb above is refused for its payload alone."""
    from refine.frontends.importer.gpickle import NodeRef

    p = tmp_path / "f.gpickle"
    p.write_bytes(_splice("MARKER", lambda k: _str("plain") + _put(k)))
    g = load_gpickle(p)
    assert g.index["y"].args == (NodeRef("x"), "plain")


def test_a_refused_file_leaves_the_stand_ins_unchanged(tmp_path: Path) -> None:
    """The dtype stand-ins are shared by every file read: a file that sets the state of
    torch.float32's stand-in (refused) must not change how the next file's dtypes read."""
    bad, good = tmp_path / "bad.gpickle", tmp_path / "good.gpickle"
    bad.write_bytes(HOSTILE["BUILD on a dtype constant"][0]())
    good.write_bytes(_graph())
    with pytest.raises(InputError):
        load_gpickle(bad)
    assert load_gpickle(good).index["y"].dtype == "float32"
    # the unpickler alone (no pre-scan) cannot change them either
    import io

    from refine.frontends.importer.gpickle import _Unpickler

    with pytest.raises(pickle.UnpicklingError):
        _Unpickler(io.BytesIO(HOSTILE["BUILD on a dtype constant"][0]())).load()
    assert load_gpickle(good).index["y"].dtype == "float32"


def test_meta_the_importer_does_not_read_is_not_walked(tmp_path: Path) -> None:
    """A memo bomb in a meta field refine ignores (nn_module_stack) costs nothing: the graph imports."""
    data = _graph(lambda mod, nodes: nodes[1].meta.update(nn_module_stack="MARKER"))
    bombed = _splice("MARKER", _memo_bomb, data)
    r, peak = _cli(tmp_path, _graph(), [bombed])
    assert r.exit_code == 0 and peak < PEAK, (r.output, peak)


# --- 3. real dump features -------------------------------------------------------------


def test_graph_id_chooses_among_the_graphs_of_a_directory(tmp_path: Path) -> None:
    """A directory holding graph 0 (the step) and graph 1 (a loss-scale graph): graph 0 by
    default, --graph-id 1 the other; a graph that is not there names the ones that are."""
    for d in ("seq", "dist"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "fw.g0.r0.gpickle").write_bytes(_graph(target="aten.neg.default"))
        (tmp_path / d / "fw.g1.r0.gpickle").write_bytes(_graph(target="aten.exp.default", gid=1))

    def run(*extra: str) -> Any:
        return CliRunner().invoke(main, ["import", "entangle", str(tmp_path / "seq"), str(tmp_path / "dist"),
                                         "--out", str(tmp_path / "out"), *extra])

    r = run()
    assert r.exit_code == 0, r.output
    assert [n["op"] for n in json.loads((tmp_path / "out" / "seq.json").read_text())["graph"]["nodes"]] == ["neg"]
    r = run("--graph-id", "1")
    assert r.exit_code == 0, r.output
    assert [n["op"] for n in json.loads((tmp_path / "out" / "seq.json").read_text())["graph"]["nodes"]] == ["exp"]
    r = run("--graph-id", "2")
    assert r.exit_code == 2 and str(tmp_path / "seq") in r.output and "there are graphs 0, 1" in r.output, r.output
    r = run("--graph-id", "-1")
    assert r.exit_code == 2, r.output


def test_a_dump_contradicting_its_file_name_is_refused(tmp_path: Path) -> None:
    """A file named graph 0, rank 1, fw whose dump says graph 1 / rank 0 / bw: exit 2 at that field."""
    for field, kwargs in (("$.gid", {"gid": 1}), ("$.rank", {"rank": 0}), ("$.direction", {"direction": "bw"})):
        d = tmp_path / field.strip("$.")
        d.mkdir()
        r, _ = _cli(d, _graph(), [_graph(rank=0), _graph(**kwargs)])
        assert r.exit_code == 2 and f"{d / 'dist' / 'fw.g0.r1.gpickle'}: {field}: the dump says" in r.output, r.output


def test_unbacked_binding_key_paths_are_read(tmp_path: Path) -> None:
    """meta["unbacked_bindings"] maps sympy symbols to key paths of torch's plain-data key
    classes (pickled here from the real classes): read as inert stand-ins, the graph imports."""
    import sympy
    from torch.fx.experimental.symbolic_shapes import (
        CallMethodKey,
        ConvertIntKey,
        DivideByKey,
        InnerTensorKey,
    )
    from torch.utils._pytree import GetAttrKey, MappingKey, SequenceKey

    paths = (CallMethodKey("size"), SequenceKey(0), MappingKey("a"), GetAttrKey("b"), DivideByKey(2),
             InnerTensorKey("c"), ConvertIntKey())
    bindings = {sympy.Symbol("u0", integer=True): paths, sympy.Symbol("u1"): (CallMethodKey("size"), SequenceKey(1))}
    dump = _graph(y_meta={"unbacked_bindings": bindings})
    assert b"symbolic_shapes" in dump and b"_pytree" in dump
    r, _ = _cli(tmp_path, dump, [dump])
    assert r.exit_code == 0, r.output


def test_neuron_stack_gives_the_source_line(tmp_path: Path) -> None:
    """A Neuron dump's meta["stack"] ("path:line", outermost first, ending in torch_neuronx's
    tracer): the node's source is the innermost frame outside torch and its backends."""
    stack = ["/opt/app/test.py:46", "/opt/app/src/model.py:231", "/opt/app/src/layers/rotary.py:67",
             "/env/lib/python3.11/site-packages/torch_neuronx/pyhlo/scribe.py:553"]
    dump = _graph(y_meta={"stack": stack})
    r, _ = _cli(tmp_path, dump, [dump])
    assert r.exit_code == 0, r.output
    for f in ("seq.json", "dist.json"):
        doc = json.loads((tmp_path / "out" / f).read_text())
        graph = doc["graph"] if "graph" in doc else doc["ranks"][0]["graph"]
        assert [n.get("source") for n in graph["nodes"]] == ["rotary.py:67"], graph["nodes"]


def test_neuron_stack_source_names_the_culprit(tmp_path: Path) -> None:
    """A rank computing exp where the sequential graph computes neg: the report's culprit
    carries the rank node's source line from meta["stack"]."""
    from refine.check import check_files

    seq = _graph(y_meta={"stack": ["/m/model.py:10"]})
    bad = _graph(target="aten.exp.default", y_meta={"stack": ["/m/model.py:11"]})
    r, _ = _cli(tmp_path, seq, [bad])
    assert r.exit_code == 0, r.output
    report = check_files(tmp_path / "out" / "seq.json", tmp_path / "out" / "dist.json")
    assert not report.refines
    text = str(report)
    assert "first sequential node that does not refine: y (neg) at model.py:10" in text, text
    assert "rank node where it goes wrong: y.exp_t@0 at model.py:11" in text, text


def test_stack_source_frames() -> None:
    """The innermost "path:line" outside torch and its backends; the outermost when every
    frame is theirs (as for FX stack traces); entries that are not "path:line" are skipped."""
    from refine.frontends.importer.entangle import _stack_source

    site = "/env/lib/python3.11/site-packages"
    assert _stack_source(["/a/run.py:1", "/a/model.py:2", f"{site}/torch_neuronx/pyhlo/scribe.py:553"]) == "model.py:2"
    assert _stack_source([f"{site}/torch/nn/m.py:1", f"{site}/torch_xla/core.py:2"]) == "m.py:1"
    assert _stack_source(["<frozen>", "/a/model.py:7", "/a/model.py:x"]) == "model.py:7"
    assert _stack_source([]) is None and _stack_source(None) is None


