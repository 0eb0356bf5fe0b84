"""The import graph of refine/ and rules/, read from the source with `ast`: no cycle among
modules, no module importing a later pipeline stage, and the top-level `refine` package
(the public API) imported by no internal module.

Every import statement counts, at module level or inside a function or an
`if TYPE_CHECKING:` block: a deferred import still ties the two modules together, and
deferred imports are what used to hold a circle of ten modules in place."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from tests.helpers import ROOT

# Pipeline stages, low to high: a module may import its own stage and lower ones only.
# rules/*.py are op families the registry loads: they may use ir and ops, nothing higher.
LAYERS: list[tuple[str, ...]] = [
    ("refine.ir",),
    ("refine.ops", "rules"),
    ("refine.frontends",),
    ("refine.relate",),
    ("refine.prove",),
    ("refine.verdict",),
    ("refine.check",),
    ("refine.oracle",),
    ("refine.testing",),
    ("refine.bench",),
    ("refine.cli",),
]
# Modules placed apart from their package's stage. capture's `Case` offers `case.check()`,
# which runs the pipeline: the module defining it and the package re-exporting it sit at
# the pipeline's stage, above the rest of capture (tracing and translation), which the
# importer uses and which imports neither.
# `refine` itself (the public API's re-exports) is at the top, beside the CLI; as a prefix
# it would place any module under refine/ that no stage names.
PLACED = {"refine.frontends.capture": "refine.check", "refine.frontends.capture.case": "refine.check",
          "refine": "refine.cli"}


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file for every Python module under refine/ and rules/ of `root`."""
    names: dict[str, Path] = {}
    for top in ("refine", "rules"):
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            names[".".join(parts)] = path
    return names


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The known module `name` is, or the closest known package it lies in."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def imports_of(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules `module` imports anywhere in its source. `from pkg import name`
    counts as importing the submodule `pkg.name` when there is one, else `pkg`."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (target := _resolve(alias.name, known)) is not None:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `from . import x`, `from ..y import z`
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                target = sub if sub in known else _resolve(source, known)
                if target is not None:
                    found.add(target)
    found.discard(module)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = module_names(root)
    return {m: imports_of(m, p, known) for m, p in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        # iterative depth-first search: the graph is small, but recursion depth is no concern then
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def layer_of(module: str) -> int:
    """The index in LAYERS of the most specific prefix naming `module`'s stage."""
    module = PLACED.get(module, module)
    best, depth = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and p.count(".") > depth:
                best, depth = i, p.count(".")
    if best is None:
        raise AssertionError(f"{module} belongs to no layer: add its package to LAYERS")
    return best


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} imports {t}" for m, targets in graph.items() for t in targets
                  if layer_of(t) > layer_of(m))


def top_level_imports(graph: dict[str, set[str]]) -> list[str]:
    allowed = {"refine", "refine.cli"}
    return sorted(m for m, targets in graph.items()
                  if "refine" in targets and m not in allowed and m.startswith("refine"))


def test_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    # the walk itself: relative, deferred, `from pkg import submodule`, TYPE_CHECKING
    pkg = tmp_path / "refine" / "a"
    pkg.mkdir(parents=True)
    (tmp_path / "rules").mkdir()
    (tmp_path / "refine" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "x.py").write_text("from . import y\n")
    (pkg / "y.py").write_text("def f():\n    from refine.a.z import g\n")
    (pkg / "z.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from refine.a import x\n")
    (tmp_path / "rules" / "r.py").write_text("import refine.a.x as x\nfrom refine import a\n")
    graph = import_graph(tmp_path)
    assert graph["refine.a.x"] == {"refine.a.y"}
    assert graph["refine.a.y"] == {"refine.a.z"}
    assert graph["refine.a.z"] == {"refine.a.x"}
    assert graph["rules.r"] == {"refine.a.x", "refine.a"}
    assert cycles(graph) == [["refine.a.x", "refine.a.y", "refine.a.z"]]


def test_no_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_module_imports_a_later_stage() -> None:
    bad = layer_violations(import_graph())
    assert not bad, "imports of a later pipeline stage:\n" + "\n".join(bad)


def test_internal_modules_never_import_the_public_package() -> None:
    # `refine/__init__.py` re-exports the API: importing it from inside would pull in the
    # whole pipeline and tie every stage to it
    bad = top_level_imports(import_graph())
    assert not bad, f"modules importing the top-level `refine` package: {bad}"


def test_every_package_is_installed() -> None:
    # pyproject lists the packages by hand (rules/ installs as refine.rules_builtin): a new
    # package under refine/ must be listed, or an installed refine lacks it
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "refine").rglob("__init__.py")}
    assert packages - set(conf["packages"]) == set()
    schema = next((ROOT / "refine").rglob("graph-v1.json")).parent.parent
    assert "schema/*.json" in conf["package-data"][".".join(schema.relative_to(ROOT).parts)]
