"""Graph format v1: load and validate `seq.json` / `dist.json` (see schema/graph-v1.json).

Every problem is an `InputError` that names the file, the JSON path in it and the reason;
the CLI turns it into exit code 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from refine.expr import LayoutSyntaxError, parse_layout
from refine.ir import (
    DTYPES,
    Dist,
    Expectation,
    Graph,
    Input,
    Mesh,
    Node,
    Output,
    Placement,
    Relation,
    TensorType,
)
from refine.normalize import normalize_attrs
from refine.opset import Registry, ShapeError

FORMAT = "refine-graph"
VERSION = 1
ROLES_IN = ("parameter", "data", "buffer")
ROLES_OUT = ("loss", "gradient", "activation", "other")


class InputError(ValueError):
    def __init__(self, file: str, where: str, reason: str) -> None:
        super().__init__(f"{file}: {where}: {reason}")
        self.file, self.where, self.reason = file, where, reason


class _Ctx:
    def __init__(self, file: str) -> None:
        self.file = file

    def fail(self, where: str, reason: str) -> InputError:
        return InputError(self.file, where or "$", reason)

    def get(self, obj: Any, key: str, where: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        if not isinstance(obj, dict):
            raise self.fail(where, f"expected an object, got {type(obj).__name__}")
        if key not in obj:
            if default is not ...:
                return default
            raise self.fail(where, f"missing field {key!r}")
        v = obj[key]
        if not isinstance(v, kind) or (kind in (int, (int,)) and isinstance(v, bool)):
            names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise self.fail(f"{where}.{key}", f"expected {names}, got {type(v).__name__}")
        return v


def read_json(path: str | Path) -> Any:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise InputError(str(path), "$", f"cannot read: {e.strerror or e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(str(path), f"line {e.lineno} column {e.colno}", f"malformed JSON: {e.msg}") from None


def _header(c: _Ctx, doc: Any, kind: str) -> None:
    if not isinstance(doc, dict):
        raise c.fail("$", "the document must be a JSON object")
    if doc.get("format") != FORMAT:
        raise c.fail("$.format", f"expected {FORMAT!r}, got {doc.get('format')!r}")
    if doc.get("version") != VERSION:
        raise c.fail("$.version", f"unsupported version {doc.get('version')!r} (this refine reads {VERSION})")
    if doc.get("kind") != kind:
        raise c.fail("$.kind", f"expected {kind!r}, got {doc.get('kind')!r}")


def _type(c: _Ctx, obj: dict[str, Any], where: str) -> TensorType:
    shape = c.get(obj, "shape", where, list)
    for i, s in enumerate(shape):
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise c.fail(f"{where}.shape[{i}]", f"a dim must be a non-negative integer, got {s!r}")
    dtype = c.get(obj, "dtype", where, str, "float32")
    if dtype not in DTYPES:
        raise c.fail(f"{where}.dtype", f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    return TensorType(tuple(shape), dtype)


def load_graph(c: _Ctx, obj: Any, where: str, registry: Registry) -> Graph:
    g = Graph(name=where)
    seen: dict[str, str] = {}

    def define(name: str, at: str) -> None:
        if not name:
            raise c.fail(at, "a name must not be empty")
        if name in seen:
            raise c.fail(at, f"name {name!r} is already defined at {seen[name]}")
        seen[name] = at

    for i, inp in enumerate(c.get(obj, "inputs", where, list)):
        at = f"{where}.inputs[{i}]"
        name = c.get(inp, "name", at, str)
        define(name, at)
        role = c.get(inp, "role", at, str, "data")
        if role not in ROLES_IN:
            raise c.fail(f"{at}.role", f"role must be one of {list(ROLES_IN)}, got {role!r}")
        g.inputs.append(Input(name, _type(c, inp, at), role, inp.get("source")))

    raw_nodes = c.get(obj, "nodes", where, list)
    # every name first, so that a reference to a later node is reported as a cycle/order error
    later: dict[str, int] = {}
    for i, n in enumerate(raw_nodes):
        name = n.get("name") if isinstance(n, dict) else None
        if isinstance(name, str):
            later.setdefault(name, i)
    for i, n in enumerate(raw_nodes):
        at = f"{where}.nodes[{i}]"
        name = c.get(n, "name", at, str)
        define(name, at)
        op_name = c.get(n, "op", at, str)
        op = registry.ops.get(op_name)
        if op is None:
            raise c.fail(f"{at}.op", f"unknown op {op_name!r} in node {name!r}: no rule family defines it")
        args = c.get(n, "args", at, list, [])
        for j, a in enumerate(args):
            if isinstance(a, str):
                if a not in seen or a == name:
                    if a in later:
                        kind = "a cycle" if later[a] >= i else "an ordering error"
                        raise c.fail(f"{at}.args[{j}]", f"{name!r} uses {a!r}, defined later: {kind} (nodes must be in topological order)")
                    raise c.fail(f"{at}.args[{j}]", f"{name!r} refers to {a!r}, which is not defined")
            elif not isinstance(a, (int, float)) and a is not None:
                raise c.fail(f"{at}.args[{j}]", f"an argument is a name or a number, got {type(a).__name__}")
        attrs = c.get(n, "attrs", at, dict, {})
        known = op.attr_kinds()
        for k in attrs:
            if k not in known:
                raise c.fail(f"{at}.attrs.{k}", f"op {op_name!r} has no attribute {k!r} (it has: {', '.join(known) or 'none'})")
        tensors = [a for a in args if isinstance(a, str)]
        if op.inputs >= 0 and len(args) != op.inputs:
            raise c.fail(f"{at}.args", f"op {op_name!r} takes {op.inputs} argument(s), got {len(args)}")
        if op.decompose is None and len(tensors) != len(args):
            raise c.fail(f"{at}.args", f"op {op_name!r} takes tensors only, not number literals")
        typ = _type(c, n, at)
        ins = [g.type_of(a) for a in tensors]
        try:
            norm = normalize_attrs(op, attrs, ins)
            if op.kind == "collective":
                norm = {**norm, "group": tuple(norm.get("group", ()))} if "group" in known else norm
            inferred = op.shape(ins, norm)
        except ShapeError as e:
            raise c.fail(at, f"node {name!r} ({op_name}): {e}") from None
        except (TypeError, KeyError, ValueError) as e:
            raise c.fail(at, f"node {name!r} ({op_name}): bad arguments or attributes: {e}") from None
        if inferred.shape != typ.shape:
            raise c.fail(f"{at}.shape", f"node {name!r} ({op_name}) has shape {list(typ.shape)} but its inputs give {list(inferred.shape)}")
        src = n.get("source")
        if src is not None and not isinstance(src, str):
            raise c.fail(f"{at}.source", "source must be a string like 'file.py:12'")
        g.nodes.append(Node(name, op_name, list(args), attrs, typ, src))

    outs = c.get(obj, "outputs", where, list)
    if not outs:
        raise c.fail(f"{where}.outputs", "a graph needs at least one output")
    names: set[str] = set()
    for i, o in enumerate(outs):
        at = f"{where}.outputs[{i}]"
        name = c.get(o, "name", at, str)
        ref = c.get(o, "ref", at, str, name)
        if ref not in seen:
            raise c.fail(f"{at}.ref", f"output {name!r} refers to {ref!r}, which is not defined")
        if name in names:
            raise c.fail(f"{at}.name", f"output name {name!r} is used twice")
        names.add(name)
        role = c.get(o, "role", at, str, "other")
        if role not in ROLES_OUT:
            raise c.fail(f"{at}.role", f"role must be one of {list(ROLES_OUT)}, got {role!r}")
        g.outputs.append(Output(name, ref, role, o.get("of")))
    return g


def load_seq(path: str | Path, registry: Registry) -> Graph:
    c = _Ctx(str(path))
    doc = read_json(path)
    _header(c, doc, "sequential")
    g = load_graph(c, c.get(doc, "graph", "$", dict), "$.graph", registry)
    for i, n in enumerate(g.nodes):
        if registry.ops[n.op].kind == "collective":
            raise c.fail(f"$.graph.nodes[{i}].op", f"the sequential graph has a collective ({n.op}) in node {n.name!r}")
    g.name = "seq"
    return g


def parse_placement(c: _Ctx, text: Any, where: str) -> Placement:
    if not isinstance(text, str):
        raise c.fail(where, f"a placement is a string like 'Shard(0)', got {text!r}")
    t = text.strip()
    if t in ("Replicate", "Replicate()", "R"):
        return Placement("replicate")
    if t in ("Partial", "Partial()", "Partial(sum)", "P"):
        return Placement("partial", reduce="sum")
    if t in ("Partial(max)",):
        return Placement("partial", reduce="max")
    if t.startswith("Shard(") and t.endswith(")"):
        try:
            return Placement("shard", dim=int(t[6:-1]))
        except ValueError:
            pass
    raise c.fail(where, f"unknown placement {text!r} (Replicate, Shard(d), Partial(sum), Partial(max))")


def _placements(c: _Ctx, obj: dict[str, Any], where: str, mesh: Mesh) -> tuple[Placement, ...]:
    raw = obj["placements"]
    if isinstance(raw, dict):
        unknown = set(raw) - {a for a, _ in mesh.axes}
        if unknown:
            raise c.fail(f"{where}.placements", f"unknown mesh axis {sorted(unknown)[0]!r}")
        raw = [raw.get(a, "Replicate") for a, _ in mesh.axes]
    if not isinstance(raw, list) or len(raw) != len(mesh.axes):
        raise c.fail(f"{where}.placements", f"expected one placement per mesh axis ({len(mesh.axes)})")
    return tuple(parse_placement(c, p, f"{where}.placements[{i}]") for i, p in enumerate(raw))


def load_dist(path: str | Path, registry: Registry, seq: Graph) -> Dist:
    c = _Ctx(str(path))
    doc = read_json(path)
    _header(c, doc, "distributed")
    mesh_obj = c.get(doc, "mesh", "$", dict)
    axes = []
    for i, ax in enumerate(c.get(mesh_obj, "axes", "$.mesh", list)):
        at = f"$.mesh.axes[{i}]"
        name = c.get(ax, "name", at, str)
        size = c.get(ax, "size", at, int)
        if size < 1:
            raise c.fail(f"{at}.size", "an axis size must be at least 1")
        axes.append((name, size))
    if not axes:
        raise c.fail("$.mesh.axes", "the mesh needs at least one axis")
    mesh = Mesh(tuple(axes))

    ranks: dict[int, Graph] = {}
    for i, r in enumerate(c.get(doc, "ranks", "$", list)):
        at = f"$.ranks[{i}]"
        rank = c.get(r, "rank", at, int)
        if not 0 <= rank < mesh.size:
            raise c.fail(f"{at}.rank", f"rank {rank} is outside the mesh of {mesh.size} ranks")
        if rank in ranks:
            raise c.fail(f"{at}.rank", f"rank {rank} appears twice")
        g = load_graph(c, c.get(r, "graph", at, dict), f"{at}.graph", registry)
        g.name = f"rank{rank}"
        for j, n in enumerate(g.nodes):
            group = n.attrs.get("group")
            if group is not None:
                bad = [x for x in group if not isinstance(x, int) or not 0 <= x < mesh.size]
                if bad:
                    raise c.fail(f"{at}.graph.nodes[{j}].attrs.group", f"rank {bad[0]!r} is not in the mesh")
                if rank not in group:
                    raise c.fail(f"{at}.graph.nodes[{j}].attrs.group", f"rank {rank} runs a collective of group {list(group)} it is not in")
        ranks[rank] = g
    missing = sorted(set(range(mesh.size)) - set(ranks))
    if missing:
        raise c.fail("$.ranks", f"no graph for rank {missing[0]} (the mesh has {mesh.size} ranks)")

    seq_inputs = {i.name: i for i in seq.inputs}
    relations: list[Relation] = []
    for i, rel in enumerate(c.get(doc, "relations", "$", list, [])):
        at = f"$.relations[{i}]"
        src = c.get(rel, "from", at, str)
        if src not in seq_inputs:
            raise c.fail(f"{at}.from", f"{src!r} is not an input of the sequential graph")
        if "layout" in rel:
            text = c.get(rel, "layout", at, str)
            try:
                term = parse_layout(text)
            except LayoutSyntaxError as e:
                raise c.fail(f"{at}.layout", str(e)) from None
            for leaf in sorted(term.leaves()):
                name, _, r = leaf.rpartition("@")
                if int(r) not in ranks or name not in {x.name for x in ranks[int(r)].inputs}:
                    raise c.fail(f"{at}.layout", f"{leaf!r} is not an input of rank {r}")
            relations.append(Relation(src, layout=term, where=at))
            continue
        local = c.get(rel, "input", at, str, src)
        if "placements" not in rel:
            raise c.fail(at, "a relation needs 'placements' or 'layout'")
        pl = _placements(c, rel, at, mesh)
        for r, g in ranks.items():
            if local not in {x.name for x in g.inputs}:
                raise c.fail(f"{at}.input", f"{local!r} is not an input of rank {r}")
        relations.append(Relation(src, local, pl, where=at))

    expectations: list[Expectation] = []
    seq_outs = {o.name for o in seq.outputs}
    for i, ex in enumerate(c.get(doc, "expectations", "$", list, [])):
        at = f"$.expectations[{i}]"
        out = c.get(ex, "output", at, str)
        if out not in seq_outs:
            raise c.fail(f"{at}.output", f"{out!r} is not an output of the sequential graph")
        local = c.get(ex, "local", at, str, out)
        for r, g in ranks.items():
            if local not in {o.name for o in g.outputs}:
                raise c.fail(f"{at}.local", f"{local!r} is not an output of rank {r}")
        pl = _placements(c, ex, at, mesh) if "placements" in ex else tuple(Placement("replicate") for _ in mesh.axes)
        expectations.append(Expectation(out, local, pl, where=at))
    return Dist(mesh, ranks, relations, expectations)
