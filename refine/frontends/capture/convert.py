"""An aten FX graph (refine.frontends.capture.trace) as a document of graph format v1.

Nodes are translated on demand, from the outputs and from every collective (a collective
runs even when its result is unused, and the k-th collective of a group must stay the k-th:
they are emitted in program order), so dead code never reaches refine. Every refine node
keeps the source line of the FX node it comes from. Tensor constants become `full` nodes
when they are one value repeated, else inputs (role buffer) named by a hash of their
contents, so equal constants have one name on every rank.
"""

from __future__ import annotations

import hashlib
import operator
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from refine.frontends.capture import aten
from refine.frontends.capture.errors import CaptureError
from refine.frontends.capture.trace import BATCH, Traced, source_of
from refine.ir.graph import Arg, TensorType
from refine.ops.lower import held, normalize_attrs
from refine.ops.registry import Registry, ShapeError


@dataclass
class Converted:
    graph: dict[str, Any]  # {"inputs", "nodes", "outputs"}
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # constant input -> value
    aten_ops: Counter[str] = field(default_factory=Counter)  # aten ops translated, by qualified name


def _unwrap(n: fx.Node) -> tuple[fx.Node, tuple[int, ...]]:
    """A chain of getitems on a multi-output node: the node and the index path."""
    path: list[int] = []
    while n.op == "call_function" and n.target is operator.getitem:
        path.insert(0, n.args[1])  # type: ignore[arg-type]
        n = n.args[0]  # type: ignore[assignment]
    return n, tuple(path)


def _dtype_class(dt: torch.dtype) -> str:
    if dt == torch.bool:
        return "bool"
    return "float" if dt.is_floating_point else "complex" if dt.is_complex else "int"


def _is_inplace(target: Any) -> bool:
    args = target._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def _is_out(arg: Any) -> bool:
    """An `out=` argument of an out variant (`torch.exp(x, out=y)`): written, keyword-only."""
    return arg.kwarg_only and arg.alias_info is not None and arg.alias_info.is_write


def _returns_out(target: Any) -> bool:
    """An out variant with one `out=` tensor, whose result is that tensor's new value: it
    computes the functional op and writes it there, like an in-place op on `out`."""
    schema = target._schema
    outs = [a for a in schema.arguments if _is_out(a)]
    return len(outs) == 1 and len(schema.returns) == 1 and str(schema.returns[0].type) == "Tensor"


class Emitter:
    def __init__(self, registry: Registry, traced: Traced, where: str) -> None:
        self.registry, self.traced, self.gm, self.where = registry, traced, traced.gm, where
        self.inputs: list[dict[str, Any]] = []
        self.nodes: list[dict[str, Any]] = []
        self.types: dict[str, TensorType] = {}
        self.taken: set[str] = set()
        self.memo: dict[tuple[fx.Node, tuple[int, ...]], Arg] = {}
        self.node: fx.Node | None = None  # the FX node being translated
        self.constants: dict[str, torch.Tensor] = {}
        self.aten_ops: Counter[str] = Counter()
        self.placeholders: dict[fx.Node, str] = {}
        self.cache: dict[Any, Any] = {}
        self.counted: set[fx.Node] = set()
        self.fills: dict[str, float] = {}  # refine refs known to be one value repeated

    def cached(self, key: Any, make: Any) -> Any:
        """A value handlers share between the outputs of one node (var_mean's moments)."""
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    # -- context and errors

    @property
    def source(self) -> str | None:
        return source_of(self.node) if self.node is not None else None

    def fail(self, message: str) -> CaptureError:
        n = self.node
        if n is None:
            return CaptureError(f"{self.where}: {message}")
        what = str(n.target) if n.op == "call_function" else f"{n.op} {n.target}"
        return CaptureError(f"{self.where}: aten op {what} (FX node {n.name!r}): {message}", self.source)

    @contextmanager
    def at(self, n: fx.Node) -> Iterator[None]:
        saved, self.node = self.node, n
        try:
            yield
        finally:
            self.node = saved

    # -- helpers for the handlers in refine.frontends.capture.aten

    def dtype(self, dt: Any) -> str:
        name = aten.DTYPES.get(dt)
        if name is None:
            raise self.fail(f"dtype {dt} has no refine counterpart (refine knows {', '.join(aten.DTYPES.values())})")
        return name

    def type(self, ref: Arg) -> TensorType:
        if not isinstance(ref, str):
            raise self.fail(f"expected a tensor, got the number {ref!r}")
        return self.types[ref]

    def value(self, a: Any) -> Arg:
        """The refine argument for an FX argument: a tensor reference or a number literal."""
        if isinstance(a, fx.Node):
            root, path = _unwrap(a)
            return self.output(root, path)
        if isinstance(a, bool):
            return float(a)
        if isinstance(a, (int, float)):
            return a
        raise self.fail(f"argument {a!r} ({type(a).__name__}) is neither a tensor nor a number")

    def fresh(self, base: str) -> str:
        base = base.replace("@", "_")
        name, k = base, 1
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name

    def attr_value(self, v: Any) -> Any:
        if isinstance(v, torch.dtype):
            return self.dtype(v)
        if isinstance(v, (list, tuple)):
            return [self.attr_value(x) for x in v]
        if isinstance(v, (bool, int, float, str)):
            return v
        raise self.fail(f"attribute value {v!r} ({type(v).__name__}) has no JSON form")

    def emit(self, op: str, args: list[Arg], attrs: dict[str, Any], *, final: bool = True,
             index: int | None = None, suffix: str = "", dtype: str | None = None, val: Any = None) -> str:
        """A refine node for the current FX node. `final`: it is the FX node's value (output
        `index` of a multi-output node, or the traced value `val`), so its shape must be the
        traced one."""
        spec = self.registry.ops.get(op)
        if spec is None:
            raise self.fail(f"refine has no op {op!r}")
        known = spec.attr_kinds()
        # a dtype by its refine name: shape rules read it (arange's dtype is its value class)
        attrs = {k: self.dtype(v) if isinstance(v, torch.dtype) else v for k, v in attrs.items() if v is not None}
        for k in attrs:
            if k not in known:
                raise self.fail(f"refine op {op!r} has no attribute {k!r} (it has: {', '.join(known) or 'none'})")
        if spec.inputs >= 0 and len(args) != spec.inputs:
            raise self.fail(f"refine op {op!r} takes {spec.inputs} argument(s), the translation gives {len(args)}")
        ins = [self.types[a] for a in args if isinstance(a, str)]
        try:
            typ = spec.shape(ins, normalize_attrs(spec, attrs, ins))
        except Exception as e:
            raise self.fail(f"refine op {op!r} rejects {[list(t.shape) for t in ins]} with {attrs}: {e}") from None
        assert self.node is not None
        root = self.node.name
        name = self.fresh(f"{root}.{suffix}" if suffix else f"{root}.{index}" if index else root)
        out_dtype = dtype or typ.dtype
        if final:
            if val is None:
                val = self.node.meta["val"]
                if index is not None:
                    val = val[index]
            traced = tuple(int(s) for s in val.shape)
            if tuple(typ.shape) != traced:
                raise self.fail(f"refine op {op!r} gives shape {list(typ.shape)} but torch traced {list(traced)}: "
                                "the mapping in refine/frontends/capture/aten.py is wrong for this use")
            out_dtype = self.dtype(val.dtype)
        if "value" in attrs:  # a fill, as the output's dtype holds it (an int truncates it; torch does)
            try:
                attrs = attrs | {"value": held(float(attrs["value"]), out_dtype)}
            except ShapeError as e:
                raise self.fail(str(e)) from None
        node: dict[str, Any] = {"name": name, "op": op, "args": list(args)}
        if attrs:
            node["attrs"] = {k: self.attr_value(v) for k, v in attrs.items()}
        node |= {"shape": list(typ.shape), "dtype": out_dtype}
        if self.source:
            node["source"] = self.source
        self.nodes.append(node)
        self.types[name] = TensorType(tuple(typ.shape), out_dtype)
        if op == "full":
            self.fills[name] = float(attrs["value"])
        return name

    # -- translation

    def output(self, root: fx.Node, path: tuple[int, ...]) -> Arg:
        key = (root, path)
        if key not in self.memo:
            with self.at(root):
                self.memo[key] = self._translate(root, path)
        return self.memo[key]

    def _translate(self, n: fx.Node, path: tuple[int, ...]) -> Arg:
        if n.op == "placeholder":
            return self.placeholders[n]
        if n.op == "get_attr":
            return self._constant(n)
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            raise self.fail("not an aten op: refine capture translates aten ops only")
        qual, overload = aten.qualified(n.target)
        a = aten.bind(n.target, n.args, n.kwargs)
        if n not in self.counted:
            self.counted.add(n)
            self.aten_ops[f"{qual}.{overload}"] += 1
        if qual in aten.FUNCTIONAL_COLLECTIVES or qual in aten.LEGACY_COLLECTIVES or qual in aten.LEGACY_WRITING:
            return self._collective(n, qual, a, path)
        if qual in aten.P2P:
            return self._p2p(n, qual, a)
        if qual in aten.WAITS:
            return self.value(a["tensor"])
        if qual in aten.PRIM_IDENTITY:
            return self._identity(n, qual, a)
        ns, _, name = qual.partition("::")
        if ns != "aten":
            raise self.fail("unknown op: refine has no mapping for this namespace; add one in refine/frontends/capture/aten.py")
        if name.endswith("_") and _is_inplace(n.target):
            name = name[:-1]  # the op's result is the mutated tensor's new value
        if len(path) > 1:
            raise self.fail(f"output {list(path)} of a nested result is not supported")
        if name in aten.IDENTITY:
            return self._identity(n, name, a)
        if name == "copy":
            # copy_(dst, src) reads only dst's shape, and dst may be an uninitialised buffer
            # (autograd's new_empty_strided for a parameter's contiguous grad): do not fold it
            return aten.SPECIAL["copy"](self, n, a)
        folded = self._fold(n, a)
        if folded is not None:
            return folded
        if path or isinstance(n.meta.get("val"), (tuple, list)):
            handler = aten.MULTI.get(name)
            if handler is None:
                raise self.fail("an op with several outputs that refine/frontends/capture/aten.py does not map")
            return handler(self, n, a, path[0] if path else 0)
        handler = aten.SPECIAL_OVERLOAD.get((name, overload)) or aten.SPECIAL.get(name)
        if handler is not None:
            return handler(self, n, a)
        return self._generic(n, name, a)

    def _fold(self, n: fx.Node, a: dict[str, Any]) -> str | None:
        """An op on constant fills whose result is one value repeated becomes a `full`: the
        seed gradient of a mean or sum (expand(ones) / n) is a constant on every rank, and the
        prover relates constants, not the ops that make them. torch computes the value (in
        float64), so folding is exact up to rounding; random ops never fold."""
        if torch.Tag.nondeterministic_seeded in n.target.tags or not isinstance(n.meta.get("val"), torch.Tensor):  # type: ignore[union-attr]
            return None
        tensors = [x for x in n.all_input_nodes]
        if not tensors or any(x.op == "get_attr" and not isinstance(getattr(self.gm, x.target), torch.Tensor)  # type: ignore[arg-type]
                              for x in tensors):
            return None
        refs = {x: self.value(x) for x in tensors}
        if not all(isinstance(r, str) and r in self.fills for r in refs.values()):
            return None

        def real(v: Any) -> Any:
            if isinstance(v, fx.Node):
                val = v.meta["val"]
                dt = torch.float64 if val.dtype.is_floating_point else val.dtype
                return torch.full(tuple(val.shape), self.fills[refs[v]], dtype=dt)  # type: ignore[index]
            if isinstance(v, (list, tuple)):
                return type(v)(real(x) for x in v)
            return v

        try:
            out = n.target(*real(tuple(n.args)), **{k: real(v) for k, v in n.kwargs.items()})  # type: ignore[operator]
        except Exception:  # noqa: BLE001 - not foldable this way: translate the op instead
            return None
        flat = out.reshape(-1) if isinstance(out, torch.Tensor) else None
        if flat is None or not flat.numel() or not bool((flat == flat[0]).all()):
            return None
        return self.emit("full", [], {"value": float(flat[0]), "shape": [int(d) for d in out.shape]})

    def _identity(self, n: fx.Node, name: str, a: dict[str, Any]) -> Arg:
        x = next(v for v in a.values() if isinstance(v, fx.Node))
        src, out = x.meta["val"].dtype, n.meta["val"].dtype
        if src != out and _dtype_class(src) != _dtype_class(out):
            if (_dtype_class(src), _dtype_class(out)) in (("bool", "float"), ("int", "float"), ("bool", "int")):
                # widens the value class: keeps every value as a real number, but is not an
                # identity (rules/cast.py)
                return self.emit("cast", [self.value(x)], {"dtype": self.dtype(out)})
            if _dtype_class(out) == "bool" and _dtype_class(src) in ("int", "float"):
                # x.bool() is exactly x != 0 (GShard's dispatch mask is combine_weights.bool())
                return self.emit("ne", [self.value(x), 0], {})
            raise self.fail(f"a cast from {src} to {out}: refine treats casts within one dtype class "
                            "(floating to floating, integer to integer) as identities, casts from bool "
                            "to integer or from either to floating point as `cast` and casts to bool as "
                            "`x != 0`; other casts change values")
        return self.value(x)

    def _generic(self, n: fx.Node, name: str, a: dict[str, Any]) -> str:
        op = aten.ALIASES.get(name, name)
        spec = self.registry.ops.get(op)
        if spec is None:
            raise self.fail(f"unknown op: refine has no op {op!r} (add it to a rule family, or map the aten op "
                            "in refine/frontends/capture/aten.py)")
        declared = spec.attr_kinds()
        renames = aten.ATTR_ALIASES.get(op, {})
        args: list[Arg] = []
        attrs: dict[str, Any] = {}
        if any(_is_out(arg) for arg in n.target._schema.arguments) and not _returns_out(n.target):  # type: ignore[union-attr]
            raise self.fail("an out variant writing several tensors: refine translates one written with out=")
        for arg in n.target._schema.arguments:  # type: ignore[union-attr]
            v = a[arg.name]
            if arg.name in aten.IGNORED or _is_out(arg):  # the result is the value out= receives
                continue
            key = renames.get(arg.name, arg.name)
            default = arg.default_value if arg.has_default_value() else ...
            if isinstance(v, fx.Node):
                args.append(self.value(v))
            elif isinstance(v, (list, tuple)) and any(isinstance(x, fx.Node) for x in v):
                raise self.fail(f"argument {arg.name!r} is a list of tensors, which refine op {op!r} does not take")
            elif key in declared:
                if v is None or (declared[key].endswith("?") and v == default):
                    continue
                attrs[key] = v
            elif isinstance(v, (int, float)) and not arg.kwarg_only and str(arg.type) in ("Tensor", "number"):
                args.append(self.value(v))
            elif v is None or v == default:
                continue
            else:
                raise self.fail(f"its argument {arg.name}={v!r} has no counterpart in refine op {op!r}")
        return self.emit(op, args, attrs)

    def _group(self, g: Any) -> list[int]:
        if isinstance(g, fx.Node):  # legacy ops take the ProcessGroup as a script object
            pg = dist.ProcessGroup.unbox(getattr(self.gm, g.target))  # type: ignore[arg-type]
        else:
            from torch.distributed.distributed_c10d import _resolve_process_group

            pg = _resolve_process_group(g)
        try:
            return [int(r) for r in dist.get_process_group_ranks(pg)]
        except (KeyError, ValueError, RuntimeError):
            # a group the step destroyed before conversion (a sequential model run in a
            # process group of its own, Megatron at TP 1): only its size is left; one rank is
            # enough to know (its collectives are identities, _collective)
            if pg.size() == 1:
                return [0]
            raise self.fail(f"a collective over a process group of {pg.size()} ranks that no longer exists") from None

    def _reduce_op(self, r: Any) -> str:
        if isinstance(r, fx.Node):
            code = getattr(self.gm, r.target)._get_method("op")()  # type: ignore[arg-type]
            r = dist.ReduceOp.RedOpType(code).name
        name = str(r).lower()
        if name not in aten.REDUCE_OPS:
            raise self.fail(f"reduce op {name!r}: refine's collectives reduce with {', '.join(aten.REDUCE_OPS)}")
        return name

    def _collective(self, n: fx.Node, qual: str, a: dict[str, Any], path: tuple[int, ...]) -> str:
        legacy = qual in aten.LEGACY_COLLECTIVES
        op = (aten.LEGACY_COLLECTIVES.get(qual) or aten.LEGACY_WRITING.get(qual)
              or aten.FUNCTIONAL_COLLECTIVES[qual])
        if qual in aten.LEGACY_WRITING:
            if path:
                raise self.fail(f"output {list(path)} of a legacy collective is used (its work handle?)")
            x, group = a["input"], self._group(a["process_group"])
        elif legacy:
            tensors = a.get("tensors")
            if tensors is not None and len(tensors) != 1:
                raise self.fail(f"a collective over a list of {len(tensors)} tensors: refine takes one")
            want = (0, 0) if tensors is not None else (0,)
            if path != want:
                raise self.fail(f"output {list(path)} of a legacy collective is used (its work handle?)")
            x = tensors[0] if tensors is not None else a["input_tensor"]
            group = self._group(a["process_group"])
        else:
            if path:
                raise self.fail(f"output {list(path)} of a collective with one output")
            x, group = a["input"], self._group(a["group_name"])
        if len(group) == 1:  # over one rank every collective gives back its input
            if op == "all_reduce":
                self._reduce_op(a["reduce_op"])  # refused as for any group if refine has no such reduction
            return self.value(x)
        attrs: dict[str, Any] = {}
        if op in ("all_reduce", "reduce_scatter"):
            attrs["reduce_op"] = self._reduce_op(a["reduce_op"])
        if op in ("all_gather", "reduce_scatter"):
            attrs["dim"] = 0  # the *_into_tensor / *_tensor collectives work on dim 0
            size = a.get("group_size")
            if size is not None and size != len(group):
                raise self.fail(f"group_size {size} but the group has ranks {group}")
        if op == "all_to_all":
            for k in ("output_split_sizes", "input_split_sizes"):
                if a[k] is not None and len(set(a[k])) > 1:
                    raise self.fail(f"uneven all_to_all ({k} {a[k]}): refine's all_to_all splits evenly")
            attrs |= {"split_dim": 0, "concat_dim": 0}
        if op == "broadcast":
            src = a["root_rank"] if legacy else a["src"]  # a rank of the group, not a global rank
            if legacy and a.get("root_tensor", 0) != 0:
                raise self.fail("broadcast of a tensor list")
            if not 0 <= src < len(group):
                raise self.fail(f"broadcast source {src} is not a rank of group {group}")
            attrs["src"] = group[src]
        attrs["group"] = group
        val = a["output"].meta["val"] if qual in aten.LEGACY_WRITING else n.meta["val"]
        for i in path:
            val = val[i]
        return self.emit(op, [self.value(x)], attrs, val=val)

    def _p2p(self, n: fx.Node, qual: str, a: dict[str, Any]) -> str:
        """Legacy `dist.send` / `dist.recv`: the peer is a rank of the group; `recv_` writes
        its buffer, whose later readers check_mutations rewired to read this node."""
        if len(a["tensors"]) != 1:
            raise self.fail(f"a {qual} of {len(a['tensors'])} tensors: refine sends one")
        (x,) = a["tensors"]
        group = self._group(a["process_group"])
        peer = a["dst"] if qual == "c10d::send" else a["src"]
        if not 0 <= peer < len(group):
            raise self.fail(f"peer {peer} is not a rank of group {group}")
        buf = x  # a received buffer sent on is the recv (check_mutations): its type is the buffer's
        while isinstance(buf, fx.Node) and isinstance(buf.target, torch._ops.OpOverload) and \
                buf.target._schema.name == "c10d::recv_":
            buf = aten.bind(buf.target, buf.args, buf.kwargs)["tensors"][0]
        val = buf.meta["val"]
        batch = n.meta.get(BATCH)  # posted by one batch_isend_irecv call (refine.ops.schedule)
        if qual == "c10d::send":
            return self.emit("send", [self.value(x)], {"peer": group[peer], "batch": batch}, val=val)
        return self.emit("recv", [], {"peer": group[peer], "shape": [int(s) for s in val.shape],
                                      "dtype": self.dtype(val.dtype), "batch": batch}, val=val)

    def _constant(self, n: fx.Node) -> str:
        t = getattr(self.gm, n.target)  # type: ignore[arg-type]
        if not isinstance(t, torch.Tensor):
            raise self.fail(f"constant {n.target!r} is a {type(t).__name__}, not a tensor")
        t = t.detach()
        dtype = self.dtype(t.dtype)
        flat = t.reshape(-1)
        if flat.numel() and bool((flat == flat[0]).all()):
            return self.emit("full", [], {"value": float(flat[0]), "shape": list(t.shape)}, final=False, dtype=dtype)
        digest = hashlib.sha1(f"{list(t.shape)}{dtype}".encode() + t.contiguous().numpy().tobytes()).hexdigest()
        name = f"const_{digest[:10]}"
        if name not in self.constants:
            self.taken.add(name)
            self.constants[name] = t
            self.inputs.append({"name": name, "shape": list(t.shape), "dtype": dtype, "role": "buffer"})
            self.types[name] = TensorType(tuple(t.shape), dtype)
        return name


_SAME_TENSOR = ("aten::alias", "aten::detach")  # another name for the same view of a storage


def _whole_in_order(n: fx.Node) -> bool:
    """Whether n's tensor is its whole storage in row-major order (contiguous, offset 0,
    every element of the storage): two such aliases of one storage hold the same elements in
    the same order, whatever their shapes."""
    v = n.meta.get("val")
    if not isinstance(v, torch.Tensor) or not v.is_contiguous() or v.storage_offset() != 0:
        return False
    try:
        return v.untyped_storage().nbytes() == v.numel() * v.element_size()
    except (NotImplementedError, RuntimeError):
        return False


LEGACY = "legacy"  # a legacy collective's written tensor: its new value is output (0, 0)


def _written_value(graph: fx.Graph, m: fx.Node, returns: bool | str) -> fx.Node | None:
    """The node holding the value in-place op m wrote: m itself, or for a legacy collective
    over one tensor (`dist.all_reduce(t)`: ([t], work)) its first output's first tensor."""
    if returns is True:
        return m
    if returns != LEGACY:
        return None
    for u in m.users:  # the trace's own getitems, when the result is read
        if u.target is operator.getitem and u.args[1] == 0:
            for w in u.users:
                if w.target is operator.getitem and w.args[1] == 0:
                    return w
    return None


def _reshaped_after(graph: fx.Graph, value: fx.Node, inp: fx.Node,
                    made: dict[tuple[fx.Node, fx.Node], fx.Node]) -> fx.Node:
    """The value of alias `inp` after an in-place op wrote `value` over its whole storage in
    order: `value` viewed as inp's shape (functionalization's replay of a view, for views that
    keep the storage's order)."""
    key = (value, inp)
    if key not in made:
        with graph.inserting_after(value):
            node = graph.call_function(torch.ops.aten.view.default, (value, list(inp.meta["val"].shape)))
        node.meta = {**value.meta, "val": value.meta["val"].view(inp.meta["val"].shape)}
        made[key] = node
    return made[key]


def check_mutations(traced: Traced, where: str) -> None:
    """Tracing gives a mutated tensor's later readers the in-place op's result, but a reader
    holding another alias of it (a view taken before) would read a stale value. A reader
    holding the very tensor that was written, under another name (`alias`/`detach` of it,
    e.g. `p.grad.data`), reads exactly the in-place op's result: it is rewired to read that.
    A reader holding another alias that, like the written tensor, covers its whole storage in
    row-major order (a flattened gradient, `scores.view(...)` of a masked_fill_) reads the
    written value viewed as its shape; this holds for a legacy collective over one tensor
    too (Megatron's all-reduce of one parameter's flattened gradient). Any other stale
    reader (a slice, a permuted view) is refused."""
    nodes = list(traced.gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    storage: dict[fx.Node, fx.Node] = {}
    same: dict[fx.Node, fx.Node] = {}  # the tensor a node is another name of (alias, detach, in-place)
    # (op, mutated tensor, whether the op returns its new value: True, False or LEGACY)
    mutations: list[tuple[fx.Node, fx.Node, bool | str]] = []
    for n in nodes:
        storage[n], same[n] = n, n
        if n.op != "call_function":
            continue
        if n.target is operator.getitem:
            # an output of a view-returning or in-place op shares its storage; the outputs of
            # an op returning fresh tensors (native_layer_norm_backward's) are distinct ones
            parent = storage.get(n.args[0], n)  # type: ignore[arg-type]
            storage[n] = parent if parent is not n.args[0] else n
            continue
        if not isinstance(n.target, torch._ops.OpOverload):
            continue
        schema = n.target._schema
        a = aten.bind(n.target, n.args, n.kwargs)
        if schema.name == "c10d::recv_" or schema.name in aten.LEGACY_WRITING:
            # writes its buffer and returns nothing: readers are rewired to it
            (buf,) = a["tensors"] if schema.name == "c10d::recv_" else (a["output"],)
            mutations.append((n, buf, True))
            storage[n], same[n] = storage[buf], same[buf]
            continue
        if schema.name in aten.LEGACY_COLLECTIVES:
            written = a["tensors"] if a.get("tensors") is not None else [a["output_tensor"]]
            one = a.get("tensors") is not None and len(written) == 1
            mutations += [(n, w, LEGACY if one else False) for w in written if isinstance(w, fx.Node)]
            if isinstance(written[0], fx.Node):
                storage[n] = storage[written[0]]
            continue
        inplace = _is_inplace(n.target)
        for arg in schema.arguments:
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(a.get(arg.name), fx.Node):
                returns = (inplace and arg is schema.arguments[0]) or (_is_out(arg) and _returns_out(n.target))
                mutations.append((n, a[arg.name], returns))
            elif arg.alias_info is not None and arg.alias_info.is_write and isinstance(a.get(arg.name), (list, tuple)):
                # a list op writing in place (a foreach op refine.frontends.capture.foreach does not
                # expand) returns no tensor to rewire readers to: any later read is stale
                mutations += [(n, w, False) for w in a[arg.name] if isinstance(w, fx.Node)]
        ret = schema.returns[0].alias_info if schema.returns else None
        if ret is not None:  # a view, or an in-place op: the result shares its argument's storage
            for arg in schema.arguments:
                v = a.get(arg.name)
                if arg.alias_info is not None and isinstance(v, fx.Node) and \
                        set(arg.alias_info.before_set) & set(ret.before_set):
                    storage[n] = storage[v]
                    if inplace or schema.name in _SAME_TENSOR or (_is_out(arg) and _returns_out(n.target)):
                        same[n] = same[v]
                    break
    replayed: dict[tuple[fx.Node, fx.Node], fx.Node] = {}
    for m, x, returns_value in mutations:
        p = pos[m]
        root = storage[x]
        # a tensor from outside the step (a plain attribute, a global) is a constant to the
        # trace, fetched anew at each read: a later read would not see the write, and a
        # collective into it would be communication silently dropped
        if root.op == "get_attr" and (m.target._schema.name in {**aten.LEGACY_COLLECTIVES,  # type: ignore[union-attr]
                                                                 **aten.LEGACY_WRITING}
                                      or any(u.op == "get_attr" and u.target == root.target for u in nodes[p + 1:])):
            raise CaptureError(
                f"{where}: {m.target} (FX node {m.name!r}, at {source_of(m)}) writes in place to a tensor that is not "
                "a parameter, buffer or input of the step (a plain attribute or a global, a constant to the trace), "
                "which capture cannot follow; register it as a buffer or pass it as an input", source_of(m))
        for u in nodes[p + 1:]:
            for inp in u.all_input_nodes:
                if pos[inp] < p and storage.get(inp) is storage[x]:
                    if returns_value is True and same[inp] is same[x]:
                        u.replace_input_with(inp, m)  # that tensor's value after the write
                        continue
                    value = _written_value(traced.gm.graph, m, returns_value)
                    if value is not None and all(map(_whole_in_order, (inp, x, root))):
                        view = _reshaped_after(traced.gm.graph, value, inp, replayed)
                        # a later write to the storage makes this view stale like any alias
                        pos.setdefault(view, pos[value] if value in pos else p)
                        storage[view], same[view] = storage[x], view
                        u.replace_input_with(inp, view)
                        continue
                    raise CaptureError(
                        f"{where}: in-place {m.target} (FX node {m.name!r}, at {source_of(m)}) changes a tensor that "
                        f"{u.name!r} (at {source_of(u)}) reads afterwards through another alias ({inp.name!r}); "
                        "capture follows only the tensor the in-place op returns", source_of(m))


def updated_name(param: str) -> str:
    """The output holding a parameter's value after the step updated it in place."""
    return f"{param}.updated"


def convert(traced: Traced, registry: Registry, where: str) -> Converted:
    check_mutations(traced, where)
    em = Emitter(registry, traced, where)
    placeholders = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(traced.inputs):
        raise CaptureError(f"{where}: the trace has {len(placeholders)} inputs, expected {len(traced.inputs)}")
    for ph, (name, role, _) in zip(placeholders, traced.inputs, strict=True):
        val = ph.meta["val"]
        with em.at(ph):
            dtype = em.dtype(val.dtype)
        em.taken.add(name)
        em.placeholders[ph] = name
        shape = [int(s) for s in val.shape]
        em.inputs.append({"name": name, "shape": shape, "dtype": dtype, "role": role})
        em.types[name] = TensorType(tuple(shape), dtype)
    nodes = list(traced.gm.graph.nodes)
    for n in nodes:  # collectives first, in program order: their order is how ranks match them
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            qual = n.target._schema.name
            if qual in aten.LEGACY_COLLECTIVES:
                tensors = aten.bind(n.target, n.args, n.kwargs).get("tensors")
                em.output(n, (0, 0) if tensors is not None else (0,))
            elif qual in aten.FUNCTIONAL_COLLECTIVES or qual in aten.P2P or qual in aten.LEGACY_WRITING:
                em.output(n, ())
    (out,) = [n for n in nodes if n.op == "output"]
    results = out.args[0]
    assert isinstance(results, (tuple, list))
    outputs = [{"name": "loss", "ref": em.value(results[0]), "role": "loss"}] if traced.has_loss else []
    rest = list(results[1:] if traced.has_loss else results)
    finals = rest[len(rest) - len(traced.finals):]
    for p, g in zip(traced.grads, rest[:len(rest) - len(traced.finals)], strict=True):
        outputs.append({"name": f"{p}.grad", "ref": em.value(g), "role": "gradient", "of": p})
    for p, v in zip(traced.finals, finals, strict=True):
        ref = em.value(v)
        if ref != p:  # changed in place by the step (an optimizer's update): its new value is an output
            traced.updated.append(p)
            outputs.append({"name": updated_name(p), "ref": ref, "role": "other"})
    for o in outputs:
        if not isinstance(o["ref"], str):
            raise CaptureError(f"{where}: output {o['name']!r} is the number {o['ref']!r}, not a tensor")
    graph = {"inputs": em.inputs, "nodes": em.nodes, "outputs": outputs}
    return Converted(graph, em.constants, em.aten_ops)
