"""Write graph-format documents from Python, with shapes inferred by the ops' shape rules.

    g = GraphBuilder()
    x = g.input("x", [4, 8])
    w = g.input("w", [8, 16], role="parameter")
    y = g.op("matmul", x, w)
    g.output("y", y)
    seq_doc(g)  # -> a dict ready for json.dump

Each node records the line of Python that built it as its `source`.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

from refine.frontends.graphfile import FORMAT, VERSION
from refine.ir import sizes
from refine.ir.graph import TensorType
from refine.ops.lower import normalize_attrs
from refine.ops.registry import Registry, load_registry


class GraphBuilder:
    def __init__(self, registry: Registry | None = None, prefix: str = "") -> None:
        self.registry = registry or load_registry()
        self.inputs: list[dict[str, Any]] = []
        self.nodes: list[dict[str, Any]] = []
        self.outputs: list[dict[str, Any]] = []
        self.types: dict[str, TensorType] = {}
        self.prefix = prefix
        self._count: dict[str, int] = {}

    def input(self, name: str, shape: list[Any], dtype: str = "float32", role: str = "data") -> str:
        self.inputs.append({"name": name, "shape": _json(list(shape)), "dtype": dtype, "role": role})
        self.types[name] = TensorType(tuple(shape), dtype)
        return name

    def op(self, op: str, *args: Any, name: str | None = None, **attrs: Any) -> str:
        spec = self.registry.ops[op]
        ins = [self.types[a] for a in args if isinstance(a, str)]
        typ = spec.shape(ins, normalize_attrs(spec, attrs, ins))
        if name is None:
            k = self._count.get(op, 0)
            self._count[op] = k + 1
            name = f"{self.prefix}{op}_{k}" if k else f"{self.prefix}{op}"
        frame = inspect.stack()[1]
        node = {"name": name, "op": op, "args": list(args), "shape": _json(list(typ.shape)), "dtype": typ.dtype,
                "source": f"{Path(frame.filename).name}:{frame.lineno}"}
        if attrs:
            node["attrs"] = {k: _json(v) for k, v in attrs.items()}
        self.nodes.append(node)
        self.types[name] = typ
        return name

    def output(self, name: str, ref: str, role: str = "activation", of: str | None = None) -> None:
        o: dict[str, Any] = {"name": name, "ref": ref, "role": role}
        if of:
            o["of"] = of
        self.outputs.append(o)

    def graph(self) -> dict[str, Any]:
        return {"inputs": self.inputs, "nodes": self.nodes, "outputs": self.outputs}


def _json(v: Any) -> Any:
    """Sizes as the format writes them: ints, or symbolic expressions as text."""
    if isinstance(v, (list, tuple)):
        return [_json(x) for x in v]
    return str(v) if isinstance(v, sizes.Sym) else v


def _symbols(symbols: list[sizes.Sym]) -> dict[str, Any]:
    out = {}
    for s in symbols:
        for name, a in sizes.atoms_of(s).items():
            if a.floor is None:
                out[name] = {"min": a.min, "multiple_of": a.multiple}
    return out


def seq_doc(g: GraphBuilder, symbols: list[sizes.Sym] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    doc: dict[str, Any] = {"format": FORMAT, "version": VERSION, "kind": "sequential"}
    declared = _symbols(list(symbols))
    if declared:
        doc["symbols"] = declared
    return doc | {"graph": g.graph()}


def dist_doc(mesh: dict[str, int], ranks: dict[int, GraphBuilder], relations: list[dict[str, Any]],
             expectations: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "kind": "distributed",
        "mesh": {"axes": [{"name": k, "size": v} for k, v in mesh.items()]},
        "ranks": [{"rank": r, "graph": g.graph()} for r, g in sorted(ranks.items())],
        "relations": relations,
    }
    if expectations:
        doc["expectations"] = expectations
    return doc


def write_case(directory: str | Path, seq: dict[str, Any], dist: dict[str, Any]) -> None:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "seq.json").write_text(json.dumps(seq, indent=1) + "\n")
    (d / "dist.json").write_text(json.dumps(dist, indent=1) + "\n")
