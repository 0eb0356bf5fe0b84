"""GraphGuard/Entangle graph dumps (`.gpickle`, read by refine.frontends.importer.gpickle) as a refine
case: seq.json and dist.json of graph format v1.

Each dump is rebuilt as a torch.fx graph whose ATen targets are the real `torch.ops`
overloads (looked up by name: nothing from the file is ever called) and whose nodes carry
their dumped shapes and dtypes, so refine.frontends.capture's converter (`Emitter`) and its one op
table (refine/frontends/capture/aten.py) translate the ATen ops. This module adds only what the dumps
need beyond a make_fx trace:

- framework ops (apex fused layer norm, XLA `hlo.*`, vLLM custom ops under
  `auto_functionalized`, `vllm.all_reduce`, torchgraph's `tg.*` logging), mapped as the
  docstrings of rules/apex.py, rules/hlo.py, rules/vllm.py and rules/tg.py say;
- collectives by group name: every collective of a rank is over all ranks of the dump (the
  corpus is tensor parallel only); in the sequential graph they are over a group of one
  rank, the identity;
- values the dump does not hold become inputs, matched across graphs by position: the
  keep-mask of each `native_dropout` (the k-th dropout of every graph), a tensor constant
  (`get_attr`, an `empty` read as a value), unless it is a Python number assigned by the
  source line that made it (`x[mask] = 0`: the FX stack trace holds that line);
- `x[arange(n), ids]` is a gather along dim 1; `x[mask] = v` (index_put with a bool mask)
  is a `where`; `baddbmm(empty, a, b, beta=0)` is `alpha * bmm(a, b)`.

Input relations: placeholders correspond by position (the corpus README); each is placed by
comparing shapes (equal: Replicate; one dim divided by the rank count: Shard(d)) and marked
`"guessed": true`, unless a relation file (`--relations`, format in the README) says
otherwise. Unknown targets and unreadable files are InputError (exit 2) naming the file,
the node and the op.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx

from refine.frontends.capture import aten
from refine.frontends.capture.convert import Emitter
from refine.frontends.capture.errors import CaptureError
from refine.frontends.importer.gpickle import NodeRef, PGraph, PNode, SymbolRef, load_gpickle
from refine.ir.errors import InputError
from refine.ir.graph import TensorType
from refine.ops.registry import Registry, load_registry

_FILE = re.compile(r"(?P<dir>fw|bw|both)\.g(?P<gid>\d+)\.r(?P<rank>\d+)\.gpickle$")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
# torch and its backends (torch_neuronx, torch_xla) when installed, and torch's own tree
_LIBRARY = ("/site-packages/torch", "/torch/_", "/torch/nn/", "/torch/autograd/", "/torch/utils/")
WRAPPERS = ("auto_functionalized", "auto_functionalized_v2")
_BUFFERS = ("empty", "empty_like", "new_empty_strided", "new_empty")


class _Foreign:
    """The FX target of a non-ATen op: named, never called."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.__name__ = name.replace(".", "_")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.name} is a stand-in of a dumped op and is never run")

    def __repr__(self) -> str:
        return self.name


@dataclass
class _Val:
    """What `node.meta["val"]` gives the converter: the dumped shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


_DTYPES = {v: k for k, v in aten.DTYPES.items()} | {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _dtype(name: str | None) -> torch.dtype | None:
    return _DTYPES.get(name) if name is not None else None


def _frame_source(trace: str | None) -> tuple[str | None, str | None]:
    """("file.py:line", the code line) of the innermost frame outside torch."""
    if not trace:
        return None, None
    lines = trace.splitlines()
    best: tuple[str | None, str | None] = (None, None)
    for i, line in enumerate(lines):
        m = _FRAME.search(line)
        if not m:
            continue
        code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.search(lines[i + 1]) else None
        here = (f"{Path(m.group(1)).name}:{m.group(2)}", code)
        if best[0] is None or not any(s in m.group(1) for s in _LIBRARY):
            best = here
    return best


def _stack_source(stack: tuple[str, ...] | None) -> str | None:
    """"file.py:line" of the innermost frame outside torch of a `meta["stack"]` (Neuron dumps:
    "path:line" strings, outermost first, ending in torch_neuronx's HLO tracer)."""
    frames = [(path, line) for path, sep, line in (e.rpartition(":") for e in stack or ()) if sep and line.isdigit()]
    # (as _frame_source: the outermost frame when every frame is torch's)
    path, line = next((f for f in reversed(frames) if not any(s in f[0] for s in _LIBRARY)),
                      frames[0] if frames else ("", ""))
    return f"{Path(path).name}:{line}" if frames else None


def _assigned_number(code: str | None) -> float | None:
    """The number a source line `target[...] = <number>` assigns (parsed, never run)."""
    if not code:
        return None
    try:
        tree = ast.parse(code.strip())
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assign):
        return None
    st = tree.body[0]
    if len(st.targets) != 1 or not isinstance(st.targets[0], ast.Subscript):
        return None
    v = st.value
    sign = 1.0
    if isinstance(v, ast.UnaryOp) and isinstance(v.op, ast.USub):
        v, sign = v.operand, -1.0
    if isinstance(v, ast.Constant) and isinstance(v.value, (int, float)) and not isinstance(v.value, bool):
        return sign * float(v.value)
    return None


# ---------------------------------------------------------------------------------------
# the dump as an FX graph


def _resolve(target: str) -> Any:
    """torch.ops.<ns>.<name>.<overload> for an ATen / c10d / prims target, else a stand-in."""
    if target in ("<built-in function getitem>", "getitem", "_operator.getitem"):
        return operator.getitem
    parts = target.split(".")
    if len(parts) == 3 and parts[0] in ("aten", "_c10d_functional", "prims"):
        try:
            return getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
        except (AttributeError, RuntimeError):
            pass
    return _Foreign(target)


def _fx_graph(pg: PGraph) -> tuple[fx.Graph, dict[str, fx.Node], fx.Node]:
    import torch.distributed._functional_collectives  # noqa: F401 - registers _c10d_functional ops

    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    users: dict[str, list[PNode]] = {}
    for n in pg.nodes:
        for a in _refs(n.args) + _refs(list(n.kwargs.values())):
            users.setdefault(a, []).append(n)

    def conv(v: Any, key: str | None = None) -> Any:
        if isinstance(v, NodeRef):
            return env[v.name]
        if isinstance(v, SymbolRef):
            raise InputError(pg.path, "$", f"symbolic size {v.name}: refine imports concrete sizes only")
        if isinstance(v, list):
            return [conv(x) for x in v]
        if isinstance(v, tuple):
            return tuple(conv(x) for x in v)
        if isinstance(v, dict):
            return {k: conv(x, k) for k, x in v.items()}
        if key == "dtype" and isinstance(v, str) and v in _DTYPES:
            return _DTYPES[v]
        return v

    output = None
    for n in pg.nodes:
        where = f"node {n.name!r} ({n.target})"
        if n.op == "output":
            output = g.output(conv(n.args[0] if len(n.args) == 1 else n.args))
            continue
        if n.op == "placeholder":
            node = g.placeholder(n.name)
        elif n.op == "get_attr":
            node = g.create_node("get_attr", n.target, (), {}, name=n.name)
        elif n.op == "call_function":
            node = g.create_node("call_function", _resolve(n.target), conv(tuple(n.args)), conv(dict(n.kwargs)),
                                 name=n.name)
        else:
            raise InputError(pg.path, where, f"FX opcode {n.op!r}: refine imports placeholder, get_attr, "
                                             "call_function and output nodes")
        node.meta["pnode"] = n
        node.meta["stack_trace"] = n.stack_trace
        node.meta["stack"] = n.stack
        if n.shape is not None:
            dt = _dtype(n.dtype)
            if dt is None:
                raise InputError(pg.path, where, f"dtype {n.dtype}: refine knows {', '.join(_DTYPES)}")
            if any(not isinstance(d, int) for d in n.shape):
                raise InputError(pg.path, where, f"shape {list(n.shape)}: refine imports concrete sizes only")
            node.meta["val"] = _Val(tuple(n.shape), dt)
        else:
            # a multi-output node: its getitem users carry the shapes
            outs: dict[int, _Val] = {}
            for u in users.get(n.name, []):
                if "getitem" in u.target and u.shape is not None and len(u.args) == 2 and isinstance(u.args[1], int):
                    dt = _dtype(u.dtype)
                    if dt is not None and all(isinstance(d, int) for d in u.shape):
                        outs[u.args[1]] = _Val(tuple(u.shape), dt)
            if outs:
                node.meta["val"] = [outs.get(i) for i in range(max(outs) + 1)]
        env[n.name] = node
    if output is None:
        raise InputError(pg.path, "$", "the graph has no output node")
    for node in g.nodes:  # a constant the dump gives no shape: its identity user (lift_fresh_copy) does
        if node.op in ("placeholder", "get_attr") and "val" not in node.meta:
            for u in node.users:
                if isinstance(u.target, torch._ops.OpOverload) and isinstance(u.meta.get("val"), _Val) and \
                        aten.base_name(u.target) in aten.IDENTITY:
                    node.meta["val"] = u.meta["val"]
                    break
    return g, env, output


def _refs(xs: Any) -> list[str]:
    out: list[str] = []
    for x in xs:
        if isinstance(x, NodeRef):
            out.append(x.name)
        elif isinstance(x, (list, tuple)):
            out += _refs(x)
        elif isinstance(x, dict):
            out += _refs(list(x.values()))
    return out


# ---------------------------------------------------------------------------------------
# conversion


@dataclass
class Lifted:
    """An input refine adds for a value the dump does not hold."""

    name: str
    kind: str  # "mask" (a dropout's keep-mask) or "const" (a tensor constant, or an uninitialised buffer read)
    shape: tuple[int, ...]
    dtype: str


@dataclass
class Imported:
    path: str
    graph: dict[str, Any]
    placeholders: list[str]  # refine input names of the dump's placeholders, in order
    lifted: list[Lifted] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)  # the dump's output values (refs), in order
    nodes: int = 0  # FX nodes in the dump


class _Stub:
    gm = None


class EntangleEmitter(Emitter):
    def __init__(self, registry: Registry, path: str, ranks: list[int], sequential: bool,
                 constants: dict[str, list[float]] | None = None) -> None:
        super().__init__(registry, _Stub(), path)  # type: ignore[arg-type]
        self.path, self.group, self.sequential = path, ranks, sequential
        self.lifted: list[Lifted] = []
        self.dropouts = 0
        # values of lost scalar constants by source line, in dump order (the relation file's
        # `constants`: facts read from the framework's code), and how many each line used
        self.constants = constants or {}
        self.constants_used: dict[str, int] = {}

    # -- context

    @property
    def source(self) -> str | None:
        if self.node is None:
            return None
        meta = self.node.meta
        if "stack_source" not in meta:  # once per node (each emitted node asks)
            meta["stack_source"] = _stack_source(meta.get("stack"))
        return _frame_source(meta.get("stack_trace"))[0] or meta["stack_source"]

    def fail(self, message: str) -> CaptureError:
        n = self.node
        if n is None:
            return CaptureError(message)
        pn = n.meta.get("pnode")
        target = pn.target if pn is not None else str(n.target)
        return CaptureError(f"node {pn.name if pn else n.name!r} ({target}): {message}", self.source)

    def lift(self, kind: str, shape: tuple[int, ...], dtype: str) -> str:
        k = sum(1 for x in self.lifted if x.kind == kind)
        name = self.fresh(f"{kind}{k}")
        self.lifted.append(Lifted(name, kind, shape, dtype))
        self.inputs.append({"name": name, "shape": list(shape), "dtype": dtype, "role": "data" if kind == "mask"
                            else "buffer"})
        self.types[name] = TensorType(shape, dtype)
        return name

    # -- translation

    def _translate(self, n: fx.Node, path: tuple[int, ...]) -> Any:
        try:
            return self._translate_dumped(n, path)
        except CaptureError:
            raise
        except Exception as e:  # noqa: BLE001 - arguments of a kind or count the op never takes (a damaged dump)
            raise self.fail(f"cannot translate its arguments ({type(e).__name__}: {str(e)[:200]})") from None

    def _translate_dumped(self, n: fx.Node, path: tuple[int, ...]) -> Any:
        if n.op == "get_attr":
            return self._constant_value(n)
        if isinstance(n.target, _Foreign):
            return self._foreign(n, n.target.name, path)
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            if "val" not in n.meta:
                raise self.fail("the dump gives this node no shape (and no getitem user carries one)")
            qual, overload = aten.qualified(n.target)
            if qual in aten.FUNCTIONAL_COLLECTIVES and self.sequential:
                return self._single_rank_collective(n, qual)
            name = qual.partition("::")[2]
            a = aten.bind(n.target, n.args, n.kwargs)
            special = {"native_dropout": self._dropout, "index": self._index, "index_put": self._index_put,
                       "baddbmm": self._baddbmm, "empty": self._empty, "empty_like": self._empty,
                       "new_empty_strided": self._empty, "new_empty": self._empty}.get(name)
            if special is not None:
                out = special(n, a, path)
                if out is not None:
                    return out
        return super()._translate(n, path)

    def _identity(self, n: fx.Node, name: str, a: dict[str, Any]) -> Any:
        """Capture's identities and casts, plus float -> int casts (truncation, rules/trunc.py)."""
        x = next((v for v in a.values() if isinstance(v, fx.Node)), None)
        if x is not None and "val" in x.meta and "val" in n.meta:
            src, out = x.meta["val"].dtype, n.meta["val"].dtype
            if src.is_floating_point and not out.is_floating_point and out != torch.bool and not out.is_complex:
                return self.emit("cast_trunc_t", [self.value(x)], {})
        return super()._identity(n, name, a)

    def _group(self, g: Any) -> list[int]:
        return list(self.group)

    def _single_rank_collective(self, n: fx.Node, qual: str) -> Any:
        """The sequential program's collectives run over a group of one rank: identities."""
        a = aten.bind(n.target, n.args, n.kwargs)
        size = a.get("group_size")
        if size not in (None, 1):
            raise self.fail(f"a collective over {size} ranks in the sequential graph")
        x = a["input"]
        if tuple(self.type(self.value(x)).shape) != tuple(n.meta["val"].shape):
            raise self.fail("a collective that changes its input's shape in the sequential graph")
        return self.value(x)

    # -- values the dump does not hold

    def _constant_value(self, n: fx.Node) -> Any:
        """A get_attr tensor: the number its source line assigns, else a lifted input."""
        users = list(n.users)
        val = n.meta.get("val")
        if val is None:
            raise self.fail("a tensor constant whose shape the dump does not give")
        for u in users:
            number = _assigned_number(_frame_source(u.meta.get("stack_trace"))[1])
            if number is not None and val.shape == ():
                return self.emit("full", [], {"value": number, "shape": []}, final=False, dtype=self.dtype(val.dtype))
        src = self.source
        if src is not None and src in self.constants and val.shape == ():
            k = self.constants_used.get(src, 0)
            if k >= len(self.constants[src]):
                raise self.fail(f"tensor constant {k} at {src}, but the relation file gives {len(self.constants[src])}")
            self.constants_used[src] = k + 1
            return self.emit("full", [], {"value": float(self.constants[src][k]), "shape": []}, final=False,
                             dtype=self.dtype(val.dtype))
        return self.lift("const", val.shape, self.dtype(val.dtype))

    def _empty(self, n: fx.Node, a: dict[str, Any], path: tuple[int, ...]) -> Any:
        """An uninitialised buffer read as a value (aws_llama's rotary frequencies: an HLO
        constant whose values the dump lost): an input, equal on every rank by position."""
        val = n.meta["val"]
        return self.lift("const", val.shape, self.dtype(val.dtype))

    def _dropout(self, n: fx.Node, a: dict[str, Any], path: tuple[int, ...]) -> Any:
        if path not in ((0,), (1,)):
            raise self.fail(f"output {list(path)} of native_dropout")
        p, train = float(a["p"]), a.get("train")
        x = self.value(a["input"])
        if train is False or p == 0.0:
            return x if path == (0,) else self.emit("full", [], {"value": 1.0, "shape": list(self.type(x).shape)},
                                                    final=False, dtype="bool")
        mask = self.cached((n, "mask"), lambda: self.lift("mask", tuple(self.type(x).shape), "bool"))
        if path == (1,):
            return mask
        return self.emit("dropout_masked", [x, mask], {"p": p}, index=0)

    def _index(self, n: fx.Node, a: dict[str, Any], path: tuple[int, ...]) -> Any:
        """x[arange(n), ids] (a row's entry picked per row) is gather(x, ids, dim=1)."""
        idx = a["indices"]
        if len(idx) != 2 or any(not isinstance(i, fx.Node) for i in idx):
            return None  # one index tensor: capture's mapping (index_rows)
        first, ids = idx
        x = self.value(a["self"])
        shape = self.type(x).shape
        if len(shape) != 2 or not _is_arange(first, shape[0]) or tuple(ids.meta["val"].shape) != (shape[0],):
            raise self.fail("an index with two index tensors that is not x[arange(n), ids] on a 2-d x")
        col = self.emit("reshape", [self.value(ids)], {"shape": [shape[0], 1]}, final=False, suffix="ids")
        g = self.emit("gather", [x, col], {"dim": 1}, final=False, suffix="gather")
        return self.emit("reshape", [g], {"shape": [shape[0]]})

    def _index_put(self, n: fx.Node, a: dict[str, Any], path: tuple[int, ...]) -> Any:
        """x[mask] = v with a bool mask over x's leading dims and one value: where(mask, v, x).
        x[arange(n), ids] = v (one entry per row, the cross-entropy backward): where the
        column equals the row's id, v; elsewhere x."""
        idx = a["indices"]
        if len(idx) == 2 and all(isinstance(i, fx.Node) for i in idx) and not a.get("accumulate"):
            x = self.value(a["self"])
            shape = tuple(self.type(x).shape)
            first, ids = idx
            if len(shape) != 2 or not _is_arange(first, shape[0]) or tuple(ids.meta["val"].shape) != shape[:1]:
                raise self.fail("an index_put with two index tensors that is not x[arange(n), ids] = v on a 2-d x")
            col = self.emit("reshape", [self.value(ids)], {"shape": [shape[0], 1]}, final=False, suffix="ids")
            cols = self.emit("arange", [], {"end": shape[1]}, final=False, suffix="cols", dtype="int64")
            hit = self.emit("eq", [col, cols], {}, final=False, suffix="hit")
            v = self.value(a["values"])
            if isinstance(v, str) and self.type(v).shape == shape[:1]:
                v = self.emit("reshape", [v], {"shape": [shape[0], 1]}, final=False, suffix="values")
            return self.emit("where", [hit, v, x], {})
        if len(idx) != 1 or not isinstance(idx[0], fx.Node) or idx[0].meta["val"].dtype != torch.bool:
            return None
        if a.get("accumulate"):
            raise self.fail("index_put with a bool mask and accumulate=True")
        x = self.value(a["self"])
        shape = tuple(self.type(x).shape)
        mask = self.value(idx[0])
        mshape = tuple(self.type(mask).shape)
        v = self.value(a["values"])
        if shape[:len(mshape)] != mshape or (isinstance(v, str) and self.type(v).shape not in ((), (1,))):
            raise self.fail(f"index_put of {list(shape)} with a bool mask {list(mshape)} and a value that is not one "
                            "number")
        if mshape != shape:
            view = self.emit("reshape", [mask], {"shape": list(mshape) + [1] * (len(shape) - len(mshape))},
                             final=False, suffix="mask")
            mask = self.emit("expand_as_shape", [view], {"shape": list(shape)}, final=False, suffix="mask_full")
        if isinstance(v, str) and v in self.fills:
            return self.emit("masked_fill", [x, mask], {"value": self.fills[v]})
        return self.emit("where", [mask, v, x], {})

    def _baddbmm(self, n: fx.Node, a: dict[str, Any], path: tuple[int, ...]) -> Any:
        """baddbmm(c, a, b, beta=0, alpha): torch ignores c (NaNs too), so alpha * a @ b."""
        if float(a.get("beta", 1)) != 0.0:
            return None
        prod = self.emit("bmm", [self.value(a["batch1"]), self.value(a["batch2"])], {}, final=False, suffix="bmm")
        alpha = float(a.get("alpha", 1))
        return prod if alpha == 1.0 else self.emit("mul", [prod, alpha], {})

    # -- framework ops

    def _foreign(self, n: fx.Node, target: str, path: tuple[int, ...]) -> Any:
        if target in WRAPPERS:
            return self._functionalized(n, path)
        args, kw = list(n.args), dict(n.kwargs)
        index = path[0] if path else None
        if len(path) > 1:
            raise self.fail(f"output {list(path)} of a nested result")
        if target == "apex.fused_layer_norm_affine_fwd.default":
            x, w, b, ns, eps = (args + [None] * 5)[:5]
            ns, eps = list(ns), float(eps if eps is not None else kw.get("eps", 1e-5))
            xv = self.value(x)
            if index == 0:
                tensors = [xv] + [self.value(t) for t in (w, b) if t is not None]
                return self.emit("apex_layer_norm", tensors, {"normalized_shape": ns, "eps": eps}, index=0)
            op = {1: "apex_layer_norm_mean", 2: "apex_layer_norm_invvar"}.get(index)  # type: ignore[arg-type]
            if op is None:
                raise self.fail(f"output {index} of the apex layer norm")
            return self.emit(op, [xv], {"normalized_shape": ns, "eps": eps}, index=index)
        if target == "apex.fused_layer_norm_affine_bwd.default":
            dy, mean, invvar, x, ns, w = args[:6]
            ns = list(ns)
            if index == 0:
                ins = [self.value(t) for t in (dy, mean, invvar, x, w)]
                return self.emit("apex_layer_norm_grad_input", ins, {"normalized_shape": ns}, index=0)
            if index == 1:
                ins = [self.value(t) for t in (dy, mean, invvar, x)]
                return self.emit("apex_layer_norm_grad_weight", ins, {"normalized_shape": ns}, index=1)
            if index == 2:
                return self.emit("apex_layer_norm_grad_bias", [self.value(dy)], {"normalized_shape": ns}, index=2)
            raise self.fail(f"output {index} of the apex layer norm backward")
        if index is not None:
            raise self.fail(f"output {index} of an op with one output")
        if target == "hlo.AwsNeuronRmsNorm":
            x, w = self.value(args[0]), self.value(args[1])
            xs, ws = self.type(x).shape, self.type(w).shape
            dims = [d for d, s in enumerate(xs) if (s,) == tuple(ws)]
            if len(dims) != 1:
                raise self.fail(f"the normalised dim of {list(xs)} for a weight {list(ws)} is not unique")
            return self.emit("hlo_rms_norm", [x, w], {"eps": float(args[2]), "dim": dims[0]})
        if target == "hlo.broadcast":
            x, bd, shape = args[:3]
            if isinstance(x, (int, float)):
                return self.emit("full", [], {"value": float(x), "shape": list(shape)})
            return self.emit("hlo_broadcast", [self.value(x)], {"broadcast_dimensions": list(bd), "shape": list(shape)})
        if target == "hlo.dot":
            lhs, rhs, lc, rc, lb, rb = args[:6]
            return self.emit("hlo_dot", [self.value(lhs), self.value(rhs)],
                             {"lhs_contracting_dims": list(lc), "rhs_contracting_dims": list(rc),
                              "lhs_batch_dims": list(lb), "rhs_batch_dims": list(rb)})
        if target == "hlo.gather":
            x, i, offset, collapsed, start_map, ivd, sizes = args[:7]
            return self.emit("hlo_gather", [self.value(x), self.value(i)],
                             {"offset_dims": list(offset), "collapsed_slice_dims": list(collapsed),
                              "start_index_map": list(start_map), "index_vector_dim": int(ivd),
                              "slice_sizes": list(sizes)})
        if target == "hlo.logistic":
            return self.emit("hlo_logistic", [self.value(args[0])], {})
        if target == "hlo.reduce_max":
            d = args[1]
            return self.emit("hlo_reduce_max", [self.value(args[0])], {"dims": list(d) if isinstance(d, (list, tuple))
                                                                       else d})
        if target == "hlo.select":
            return self.emit("hlo_select", [self.value(t) for t in args[:3]], {})
        if target == "vllm.all_reduce.default":
            x = self.value(args[0])
            if self.sequential:
                return x
            return self.emit("all_reduce", [x], {"reduce_op": "sum", "group": list(self.group)})
        if target == "tg.log_tensor.default":
            return self.emit("tg_log_tensor", [self.value(args[0])], {})
        raise self.fail("unknown op: refine has no mapping for this target (see refine/frontends/importer/entangle.py)")

    def _functionalized(self, n: fx.Node, path: tuple[int, ...]) -> Any:
        """auto_functionalized(op, **kwargs)[k]: the k-th mutated argument after the call."""
        op = str(n.args[0])
        kw = dict(n.kwargs)
        if len(path) != 1 or path[0] < 1:
            raise self.fail(f"output {list(path)} of auto_functionalized({op}): refine maps the mutated arguments")
        k = path[0]
        v = self.value
        if op == "_C.rms_norm.default" and k == 1:
            return self.emit("vllm_rms_norm", [v(kw["input"]), v(kw["weight"])], {"eps": float(kw["epsilon"])}, index=1)
        if op == "_C.fused_add_rms_norm.default" and k in (1, 2):
            ins = [v(kw["input"]), v(kw["residual"])]
            if k == 1:
                return self.emit("vllm_fused_add_rms_norm", ins + [v(kw["weight"])], {"eps": float(kw["epsilon"])},
                                 index=1)
            return self.emit("vllm_fused_add_rms_norm_residual", ins, {}, index=2)
        if op == "_C.rotary_embedding.default" and k in (1, 2):
            x = kw["query"] if k == 1 else kw["key"]
            return self.emit("vllm_rotary_embedding", [v(kw["positions"]), v(x), v(kw["cos_sin_cache"])],
                             {"head_size": int(kw["head_size"]), "is_neox": bool(kw["is_neox"])}, index=k)
        if op == "_C.silu_and_mul.default" and k == 1:
            return self.emit("vllm_silu_and_mul", [v(kw["input"])], {}, index=1)
        if op == "vllm.unified_attention_with_output.default" and k == 1:
            q = v(kw["query"])
            head = self.type(q).shape[-1]
            # Qwen2's scale (rules/vllm.py): the layer's own scale is not in the dump
            return self.emit("vllm_attention", [q, v(kw["key"]), v(kw["value"])], {"scale": head ** -0.5}, index=1)
        if op == "tg.inplace_log_tensor.default" and k == 1:
            bases = kw.get("_all_bases") or []
            if len(bases) != 1:
                raise self.fail("inplace_log_tensor over several bases")
            return self.emit("tg_log_tensor", [v(bases[0])], {}, index=1)
        raise self.fail(f"unknown op: auto_functionalized({op}) output {k} has no refine mapping")


_VIEWS = ("view", "_unsafe_view", "reshape", "alias", "as_strided", "expand", "permute", "transpose", "t", "slice",
          "select", "unsqueeze", "squeeze")


def _buffer_view(n: fx.Node) -> bool:
    """An uninitialised buffer, or a view of one."""
    while isinstance(n, fx.Node) and isinstance(n.target, torch._ops.OpOverload):
        name = aten.base_name(n.target)
        if name in _BUFFERS:
            return True
        if name not in _VIEWS or not n.args:
            return False
        n = n.args[0]
    return False


def _is_arange(node: Any, n: int) -> bool:
    if not isinstance(node, fx.Node) or not isinstance(node.target, torch._ops.OpOverload):
        return False
    qual, overload = aten.qualified(node.target)
    if qual != "aten::arange":
        return False
    args = list(node.args)
    if overload == "default":
        args = [0] + args
    start, end = args[0], args[1]
    step = args[2] if len(args) > 2 else node.kwargs.get("step", 1)
    return start == 0 and end == n and step in (1, None)


def _where_of(message: str) -> str:
    return message.split(": ", 1)[0] if message.startswith("node ") else "$"


def _what_of(message: str) -> str:
    return message.split(": ", 1)[1] if message.startswith("node ") else message


def convert_dump(pg: PGraph, registry: Registry, ranks: list[int], sequential: bool,
                 wanted: set[int] | None = None, constants: dict[str, list[float]] | None = None) -> Imported:
    g, env, output = _fx_graph(pg)
    em = EntangleEmitter(registry, pg.path, ranks, sequential, constants)
    placeholders = []
    for n in g.nodes:
        if n.op != "placeholder":
            continue
        val = n.meta.get("val")
        if val is None:
            raise InputError(pg.path, f"placeholder {n.name!r}", "no shape in the dump or in an identity user")
        with em.at(n):
            dtype = em.dtype(val.dtype)
        name = em.fresh(n.name)
        em.placeholders[n] = name
        placeholders.append(name)
        role = "parameter" if val.dtype.is_floating_point else "data"
        em.inputs.append({"name": name, "shape": list(val.shape), "dtype": dtype, "role": role})
        em.types[name] = TensorType(tuple(val.shape), dtype)
    # Only the checked outputs are translated, and with them the collectives they depend on:
    # every rank runs the same program, so each drops the same dead collectives and the k-th
    # collective of a group stays the k-th on every rank.
    results = output.args[0]
    results = list(results) if isinstance(results, (list, tuple)) else [results]
    refs: list[Any] = []
    live: set[fx.Node] = set()
    todo = [r for i, r in enumerate(results) if isinstance(r, fx.Node) and (wanted is None or i in wanted)]
    while todo:
        x = todo.pop()
        if x not in live:
            live.add(x)
            todo += x.all_input_nodes
    try:
        # in program order, so each node's inputs are translated already (no deep recursion)
        for n in g.nodes:
            # (buffers and their views are translated only where read as values: most are only
            # written to, like a vLLM op's `output=view(empty_like(q))`)
            if n in live and n.op == "call_function" and not isinstance(n.meta.get("val"), list) and \
                    not _buffer_view(n):
                em.value(n)
        for i, r in enumerate(results):
            refs.append(em.value(r) if isinstance(r, fx.Node) and (wanted is None or i in wanted) else None)
    except CaptureError as e:
        raise InputError(pg.path, _where_of(e.message), _what_of(e.message) + (f" (at {e.source})" if e.source
                                                                                  else "")) from None
    graph = {"inputs": em.inputs, "nodes": em.nodes, "outputs": []}
    return Imported(pg.path, graph, placeholders, em.lifted, refs, len(pg.nodes))


# ---------------------------------------------------------------------------------------
# the case: files, relations, expectations


def dumps_in(directory: str | Path, direction: str | None = None, graph_id: int = 0) -> tuple[str, list[Path]]:
    """(direction, files by rank) of the dumps of graph `graph_id` in a directory (a
    directory may hold several graphs: a training step's loss-scale graph is graph 1)."""
    d = Path(directory)
    if not d.is_dir():
        raise InputError(str(d), "$", "not a directory of .gpickle graph dumps")
    found: dict[str, dict[int, Path]] = {}
    gids: set[int] = set()
    for f in sorted(d.glob("*.gpickle")):
        m = _FILE.search(f.name)
        if m is None:
            raise InputError(str(f), "$", "not named <fw|bw|both>.g<gid>.r<rank>.gpickle")
        gids.add(int(m.group("gid")))
        if int(m.group("gid")) == graph_id:
            found.setdefault(m.group("dir"), {})[int(m.group("rank"))] = f
    if not found:
        there = f" (there are graphs {', '.join(map(str, sorted(gids)))}; --graph-id chooses one)" if gids else ""
        raise InputError(str(d), "$", f"no .gpickle dumps of graph {graph_id} here{there}")
    if direction is None:
        # the joint graph, when there is one, has the program's own inputs (parameters, batch)
        direction = "both" if "both" in found else "fw" if "fw" in found else sorted(found)[0]
    if direction not in found:
        raise InputError(str(d), "$", f"no {direction} dumps of graph {graph_id} here (there are: "
                                      f"{', '.join(sorted(found))})")
    files = found[direction]
    if sorted(files) != list(range(len(files))):
        raise InputError(str(d), "$", f"ranks {sorted(files)} of the {direction} dumps are not 0..{len(files) - 1}")
    return direction, [files[r] for r in range(len(files))]


def load_dump(path: Path) -> PGraph:
    """A dump whose own direction, graph id and rank (when it gives them) are its file name's."""
    pg = load_gpickle(path)
    m = _FILE.search(path.name)
    if m is not None:
        for what, said, named in (("direction", pg.direction, m.group("dir")), ("gid", pg.gid, int(m.group("gid"))),
                                  ("rank", pg.rank, int(m.group("rank")))):
            if said is not None and said != named:
                raise InputError(str(path), f"$.{what}", f"the dump says {said!r} but its file name says {named!r}")
    return pg


def _output_shape(graph: dict[str, Any], name: str) -> tuple[int, ...]:
    ref = next(o["ref"] for o in graph["outputs"] if o["name"] == name)
    return next(tuple(x["shape"]) for x in [*graph["nodes"], *graph["inputs"]] if x["name"] == ref)


def _placement(seq: tuple[int, ...], local: tuple[int, ...], n: int) -> str | None:
    """Replicate for equal shapes, Shard(d) for one dim divided by the rank count."""
    if seq == local:
        return "Replicate"
    if len(seq) != len(local):
        return None
    diff = [d for d, (a, b) in enumerate(zip(seq, local, strict=True)) if a != b]
    if len(diff) == 1 and local[diff[0]] * n == seq[diff[0]]:
        return f"Shard({diff[0]})"
    return None


def fused_layout(name: str, parts: list[dict[str, int]], dim: int, n: int) -> str:
    """The layout expression of a sequential weight cat(part_0, part_1, ..., dim) whose rank r
    holds cat(part_0[r], part_1[r], ...) along `dim`: each part split evenly by heads across
    the ranks, or (fewer heads than ranks) each head on a group of n / heads ranks (the
    layout reads it from the group's first rank; `fused_layouts` lists the other members'
    copies too)."""
    return fused_layouts(name, parts, dim, n)[0]


def fused_layouts(name: str, parts: list[dict[str, int]], dim: int, n: int) -> list[str]:
    """`fused_layout` and its replicas: the k-th reads each replicated head from the k-th
    rank of its group. Without them a group's other ranks hold free values where they use
    their copy of the head (a TP4 rank's KV head, shared with its neighbour)."""
    local_sizes, groups = [], []
    for p in parts:
        size, heads = int(p["size"]), int(p.get("heads", n))
        if heads >= n:
            if heads % n or size % n:
                raise ValueError(f"part {p} does not split evenly over {n} ranks")
            local_sizes.append(size // n)
            groups.append(1)
        else:
            if n % heads or size % heads:
                raise ValueError(f"part {p}: {heads} heads do not divide {n} ranks")
            local_sizes.append(size // heads)
            groups.append(n // heads)
    out = []
    for k in range(max(groups)):
        pieces = []
        for i, g in enumerate(groups):
            start = sum(local_sizes[:i])
            owners = range(n) if g == 1 else range(k % g, n, g)
            part = [f"slice({name}@{r}, {dim}, {start}, {start + local_sizes[i]})" for r in owners]
            # one concat per part: the program slices the parts apart again, and a part is then
            # one element of the outer concat (a wide flat concat of every piece proves slowly)
            pieces.append(part[0] if len(part) == 1 else f"cat({', '.join(part)}, dim={dim})")
        out.append(pieces[0] if len(pieces) == 1 else f"cat({', '.join(pieces)}, dim={dim})")
    return out


def load_relations(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise InputError(str(p), "$", f"cannot read the relation file: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != "refine-entangle-relations" or doc.get("version") != 1:
        raise InputError(str(p), "$", 'expected {"format": "refine-entangle-relations", "version": 1, ...}')
    extra = set(doc) - {"format", "version", "inputs", "outputs", "constants", "comment"}
    if extra:
        raise InputError(str(p), "$", f"unknown fields {sorted(extra)}")
    for k, c in enumerate(doc.get("constants", [])):
        if not (isinstance(c, dict) and isinstance(c.get("source"), str) and isinstance(c.get("values"), list)
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in c["values"])
                and set(c) <= {"source", "values", "comment"}):
            raise InputError(str(p), f"$.constants[{k}]", 'expected {"source": "file.py:line", "values": [numbers]}')
    return doc


def _constants(doc: dict[str, Any] | None) -> dict[str, list[float]]:
    """Scalar tensor constants the dumps lost, by the source line that reads them: their
    values in dump order (read from the framework's code, stated in the relation file)."""
    return {c["source"]: [float(v) for v in c["values"]] for c in (doc or {}).get("constants", [])}


def _named(text: str, seq: str, local: str) -> str:
    """A relation file's expression with `{seq}` (the sequential placeholder) and `{local}`
    (the ranks' placeholder) filled in: an entry by shape serves every layer."""
    return text.replace("{seq}", seq).replace("{local}", local)


def _reads(graph: dict[str, Any], name: str) -> bool:
    return any(a == name for n in graph["nodes"] for a in n["args"]) or any(o["ref"] == name for o in graph["outputs"])


def _explicit(doc: dict[str, Any] | None, seq: Imported, path: Any) -> dict[int, dict[str, Any]]:
    """Relation-file entries by sequential placeholder position: an entry names its
    placeholder by `index`, or applies to every placeholder of a `shape` (a fused weight
    has the same shape in every layer, wherever the layer's inputs sit)."""
    out: dict[int, dict[str, Any]] = {}
    for k, e in enumerate((doc or {}).get("inputs", [])):
        if not isinstance(e, dict) or ("index" in e) == ("shape" in e):
            raise InputError(str(path), f"$.inputs[{k}]", "an entry names its placeholder by index or by shape")
        if "index" in e:
            hits = [int(e["index"])]
        else:
            hits = [i for i, x in enumerate(seq.graph["inputs"][:len(seq.placeholders)])
                    if list(x["shape"]) == list(e["shape"])]
        if not hits or any(not 0 <= i < len(seq.placeholders) for i in hits):
            raise InputError(str(path), f"$.inputs[{k}]", "names no placeholder of the sequential graph")
        for i in hits:
            out[i] = e
    return out


def _convert_file(path: Path, registry: Registry, ranks: list[int], sequential: bool, wanted: set[int],
                  constants: dict[str, list[float]]) -> Imported:
    """One dump read and converted; any failure is an InputError naming the file (the
    converter checks what it reads, this is the last line of defence)."""
    try:
        return convert_dump(load_dump(path), registry, ranks, sequential, wanted, constants)
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 - no traceback for a bad file: exit 2 naming it
        raise InputError(str(path), "$", f"cannot convert this dump ({type(e).__name__}: {str(e)[:200]})") from None


@dataclass
class Case:
    seq: dict[str, Any]
    dist: dict[str, Any]
    guesses: list[str]
    nodes: int  # FX nodes over the sequential graph and every rank

    def write(self, out: str | Path) -> None:
        d = Path(out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "seq.json").write_text(json.dumps(self.seq, indent=1))
        (d / "dist.json").write_text(json.dumps(self.dist, indent=1))


def _output_spec(doc: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Which of the dump's outputs the case checks: the relation file's, else the first
    (the loss of a training graph, the final hidden state or logits of an inference one)."""
    if doc is not None and "outputs" in doc:
        return list(doc["outputs"])
    return [{"index": 0, "name": "output"}]


def import_case(seq_dir: str | Path, dist_dir: str | Path, relations: str | Path | None = None,
                direction: str | None = None, registry: Registry | None = None, graph_id: int = 0) -> Case:
    registry = registry or load_registry()
    relations_path = relations
    rel_doc = load_relations(relations) if relations is not None else None
    seq_direction, seq_files = dumps_in(seq_dir, direction, graph_id)
    _, dist_files = dumps_in(dist_dir, direction or seq_direction, graph_id)
    if len(seq_files) != 1:
        raise InputError(str(seq_dir), "$", f"{len(seq_files)} ranks of sequential dumps: expected one")
    n = len(dist_files)
    group = list(range(n))
    specs = _output_spec(rel_doc)
    wanted = {int(s["index"]) for s in specs}
    consts = _constants(rel_doc)
    seq = _convert_file(seq_files[0], registry, [0], sequential=True, wanted=wanted, constants=consts)
    ranks = [_convert_file(f, registry, group, sequential=False, wanted=wanted, constants=consts) for f in dist_files]

    # outputs: by the dump's output position
    for imp in [seq, *ranks]:
        outs = []
        for s in specs:
            i = int(s["index"])
            if i >= len(imp.outputs) or imp.outputs[i] is None or not isinstance(imp.outputs[i], str):
                raise InputError(imp.path, "$", f"output {i} ({s['name']}) is not a tensor of this graph")
            o = {"name": s["name"], "ref": imp.outputs[i], "role": s.get("role", "other")}
            if o["role"] == "gradient":
                o["of"] = seq.placeholders[int(s["of"])]
            outs.append(o)
        imp.graph["outputs"] = outs

    # relations
    guesses: list[str] = []
    explicit = _explicit(rel_doc, seq, relations_path)
    relations: list[dict[str, Any]] = []
    unread: list[tuple[Imported, str]] = []
    for i, name in enumerate(seq.placeholders):
        seq_shape = tuple(seq.graph["inputs"][i]["shape"])
        locals_ = [r.placeholders[i] if i < len(r.placeholders) else None for r in ranks]
        if any(x is None for x in locals_) or len(set(locals_)) != 1:
            raise InputError(str(dist_files[0]), "$", f"the ranks have fewer placeholders than the sequential "
                                                      f"graph ({len(seq.placeholders)})")
        if i in explicit:
            spec = explicit[i]
            if "fused" in spec:
                f = spec["fused"]
                try:
                    layouts = fused_layouts(locals_[0], f["parts"], int(f["dim"]), n)
                    relations.append({"from": name, "layout": layouts[0] if len(layouts) == 1 else layouts})
                except (ValueError, KeyError, TypeError) as e:
                    raise InputError(str(relations_path), f"input {i} ({name})", f"fused layout: {e}") from None
            elif "layout" in spec:
                relations.append({"from": name, "layout": _named(spec["layout"], name, locals_[0])})
            elif "placements" in spec:
                relations.append({"from": name, "input": locals_[0], "placements": list(spec["placements"])})
            elif spec.get("unrelated"):
                continue
            else:
                raise InputError(str(relations_path), f"input {i} ({name})", "needs fused, layout, placements or unrelated")
            defines = spec.get("defines", {})
            if not isinstance(defines, dict) or not all(isinstance(v, str) and k.isdigit() and int(k) < n
                                                        for k, v in defines.items()):
                raise InputError(str(relations_path), f"input {i} ({name})",
                                 f'"defines" maps ranks (0..{n - 1}) to expressions over the sequential input')
            for r, text in sorted(defines.items(), key=lambda kv: int(kv[0])):
                relations.append({"define": f"{locals_[0]}@{r}", "as": _named(text, name, locals_[0])})
            continue
        local_shapes = {tuple(r.graph["inputs"][i]["shape"]) for r in ranks}
        pl = _placement(seq_shape, next(iter(local_shapes)), n) if len(local_shapes) == 1 else None
        readers = [(seq, name), *zip(ranks, locals_, strict=True)]
        if pl is None and not any(_reads(imp.graph, x) for imp, x in readers):
            # no checked output reads it (a KV cache the step only returns): it needs no
            # relation, and is left out of the case (nothing there could relate it)
            unread.extend(readers)
            continue
        if pl is None:
            raise InputError(str(dist_files[0]), f"placeholder {i} ({name})",
                             f"no placement by shape: sequential {list(seq_shape)}, ranks {sorted(map(list, local_shapes))}"
                             "; give it in a relation file (--relations)")
        relations.append({"from": name, "input": locals_[0], "placements": [pl], "guessed": True})
        guesses.append(f"{name} [{pl}]")
    for imp, x in unread:
        imp.graph["inputs"] = [i for i in imp.graph["inputs"] if i["name"] != x]
    # lifted inputs (dropout masks, lost constants): by position among their kind
    for kind in ("mask", "const"):
        sl = [x for x in seq.lifted if x.kind == kind]
        rl = [[x for x in r.lifted if x.kind == kind] for r in ranks]
        if any(len(x) != len(sl) for x in rl):
            continue  # no correspondence by position: they stay unrelated (never clean)
        for j, x in enumerate(sl):
            names = {r[j].name for r in rl}
            shapes = {r[j].shape for r in rl}
            pl = _placement(x.shape, next(iter(shapes)), n) if len(shapes) == 1 and len(names) == 1 else None
            if pl is None:
                continue
            relations.append({"from": x.name, "input": rl[0][j].name, "placements": [pl], "guessed": True})
            guesses.append(f"{x.name} [{pl}]")
    # the lifted input names must agree across graphs: rename rank ones to the sequential names
    expectations: list[dict[str, Any]] = []
    for s in specs:
        if "placements" in s:
            expectations.append({"output": s["name"], "placements": list(s["placements"])})
            continue
        # none given: placed by shape like an input, and flagged. Left without one, an output
        # need only be reconstructible from rank outputs, so a loss halved on every rank
        # (2 * loss@0) or a wrong loss on one rank (the other's is right) would refine
        want = _output_shape(seq.graph, s["name"])
        got = {_output_shape(r.graph, s["name"]) for r in ranks}
        pl = _placement(want, next(iter(got)), n) if len(got) == 1 else None
        if pl is not None:
            expectations.append({"output": s["name"], "placements": [pl], "guessed": True})
            guesses.append(f"output {s['name']} [{pl}]")
    seq_doc = {"format": "refine-graph", "version": 1, "kind": "sequential", "graph": seq.graph}
    dist_doc: dict[str, Any] = {
        "format": "refine-graph", "version": 1, "kind": "distributed",
        "mesh": {"axes": [{"name": "tp", "size": n}]},
        "ranks": [{"rank": r, "graph": imp.graph} for r, imp in enumerate(ranks)],
        "relations": relations,
    }
    if expectations:
        dist_doc["expectations"] = expectations
    return Case(seq_doc, dist_doc, guesses, seq.nodes + sum(r.nodes for r in ranks))


