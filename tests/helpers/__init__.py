"""What several test modules share and a fixture cannot carry (they read it at import, in
parametrize lists or module constants): the checkout's paths, the Entangle corpus's place,
a writer of hand-made case documents and their nodes, and the stand-in `torchgraph` classes that .gpickle
files name."""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the checkout
MODELS = ROOT / "models"
# the external corpus sits next to the checkout (tests marked `corpus` skip without it)
CORPUS = ROOT.parent / "shared" / "corpus" / "entangle"
RELATIONS = MODELS / "entangle" / "relations"  # refine's relation files for the corpus pairs
NO_CORPUS = "the Entangle corpus is not next to this checkout"


def write_pair(tmp: Path, seq: dict[str, Any], dist: dict[str, Any]) -> tuple[Path, Path]:
    """seq.json and dist.json in tmp (made if missing), as given: no indentation, no checks."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "seq.json").write_text(json.dumps(seq))
    (tmp / "dist.json").write_text(json.dumps(dist))
    return tmp / "seq.json", tmp / "dist.json"


def graph_node(name: str, op: str, args: list[Any], shape: list[int], source: str | None = None,
               **attrs: Any) -> dict[str, Any]:
    """One node of a hand-made graph document: attributes and source line only when given."""
    n: dict[str, Any] = {"name": name, "op": op, "args": args, "shape": shape}
    if attrs:
        n["attrs"] = attrs
    if source:
        n["source"] = source
    return n


@contextmanager
def torchgraph() -> Iterator[types.ModuleType]:
    """A module holding PickleableGraph and PickleableNode under the module and qualified names
    the real dumps use, so pickle writes the same globals; importable (in sys.modules) while
    the block runs, as pickling them needs."""
    mod = types.ModuleType("torchgraph.pgraph.pickleable")

    class PickleableGraph:
        pass

    class PickleableNode:
        pass

    for c in (PickleableGraph, PickleableNode):
        c.__module__, c.__qualname__ = mod.__name__, c.__name__
        setattr(mod, c.__name__, c)
    names = ["torchgraph", "torchgraph.pgraph", mod.__name__]
    for name in names[:-1]:
        sys.modules[name] = types.ModuleType(name)
    sys.modules[mod.__name__] = mod
    try:
        yield mod
    finally:
        for name in names:
            del sys.modules[name]
