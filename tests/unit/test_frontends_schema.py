"""refine/frontends/schema/graph-v1.json: a valid draft 2020-12 schema that accepts every bundled
case and rejects what the loader rejects (for what a schema can say)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from refine.frontends.graphfile import load_dist, load_seq
from refine.ir.errors import InputError
from refine.ir.graph import DTYPES
from refine.ops.registry import load_registry
from tests.helpers import ROOT

SCHEMA = json.loads((ROOT / "refine" / "frontends" / "schema" / "graph-v1.json").read_text())
VALIDATOR = Draft202012Validator(SCHEMA)
DOCS = sorted((ROOT / "models").glob("*/*.json"))
SEQ = json.loads((ROOT / "models" / "tp_mlp" / "seq.json").read_text())
DIST = json.loads((ROOT / "models" / "tp_mlp" / "dist.json").read_text())


def test_schema_is_valid_draft_2020_12() -> None:
    Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_schema_dtypes_match_the_loader() -> None:
    assert tuple(SCHEMA["$defs"]["dtype"]["enum"]) == DTYPES


def test_there_are_cases() -> None:
    assert {p.name for p in DOCS} == {"seq.json", "dist.json"}
    assert len(DOCS) >= 6


@pytest.mark.parametrize("path", DOCS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_model_validates(path: Path) -> None:
    doc = json.loads(path.read_text())
    errors = [f"{e.json_path}: {e.message}" for e in VALIDATOR.iter_errors(doc)]
    assert not errors, errors


def test_layout_relation_and_placements_by_axis_validate() -> None:
    d = copy.deepcopy(DIST)
    d["relations"][1] = {"from": "w1", "layout": "cat(w1@0, w1@1, dim=1)"}
    d["relations"][2] = {"from": "b1", "input": "b1", "placements": {"tp": "Shard(0)"}}
    assert VALIDATOR.is_valid(d)


Mutation = Callable[[dict[str, Any]], Any]

INVALID: list[tuple[str, Mutation]] = [
    ("seq", lambda s: s.pop("kind")),
    ("seq", lambda s: s.update(kind="pipeline")),
    ("seq", lambda s: s.update(version=2)),
    ("seq", lambda s: s.update(version=True)),
    ("seq", lambda s: s.update(format="onnx")),
    ("seq", lambda s: s.update(mesh={"axes": []})),  # a sequential document has no mesh
    ("seq", lambda s: s.pop("graph")),
    ("seq", lambda s: s["graph"].update(outputs=[])),
    ("seq", lambda s: s["graph"]["inputs"][0].update(shape=[-8, 16])),
    ("seq", lambda s: s["graph"]["inputs"][0].update(shape="8x16")),
    ("seq", lambda s: s["graph"]["inputs"][0].update(dtype="float8")),
    ("seq", lambda s: s["graph"]["inputs"][0].update(role="weights")),
    ("seq", lambda s: s["graph"]["inputs"][0].update(name="x@0")),
    ("seq", lambda s: s["graph"]["nodes"][0].pop("op")),
    ("seq", lambda s: s["graph"]["nodes"][0].update(args=["x", True])),
    ("seq", lambda s: s["graph"]["nodes"][0].update(args=["x", None])),
    ("seq", lambda s: s["graph"]["nodes"][0].update(attrs=[])),
    ("seq", lambda s: s["graph"]["nodes"][0].update(shapes=[8, 32])),
    ("seq", lambda s: s["graph"]["outputs"][0].update(role="logits")),
    ("dist", lambda d: d.update(kind="sequential")),
    ("dist", lambda d: d.pop("mesh")),
    ("dist", lambda d: d.update(expectation=[])),
    ("dist", lambda d: d["mesh"].update(axes=[])),
    ("dist", lambda d: d["mesh"]["axes"][0].update(size=0)),
    ("dist", lambda d: d["ranks"][0].update(rank="0")),
    ("dist", lambda d: d["ranks"][0]["graph"]["nodes"][4]["attrs"].update(group=[0, 0])),
    ("dist", lambda d: d["ranks"][0]["graph"]["nodes"][4]["attrs"].update(group="01")),
    ("dist", lambda d: d["relations"][0].pop("from")),
    ("dist", lambda d: d["relations"][0].pop("placements")),
    ("dist", lambda d: d["relations"][0].update(layout="x@0")),
    ("dist", lambda d: d["relations"][0].update(placements=["Sharded(0)"])),
    ("dist", lambda d: d["relations"][0].update(placements="Replicate")),
    ("dist", lambda d: d["relations"][0].update(placements={"tp": 1})),
    ("dist", lambda d: d["expectations"][0].pop("output")),
    ("dist", lambda d: d["expectations"][0].update(local="")),
]


@pytest.mark.parametrize("which,mutate", INVALID)
def test_invalid_documents_are_rejected(which: str, mutate: Mutation) -> None:
    doc = copy.deepcopy(SEQ if which == "seq" else DIST)
    mutate(doc)
    assert not VALIDATOR.is_valid(doc)


def test_the_loader_rejects_them_too(tmp_path: Path) -> None:
    """The schema is no stricter than the loader: what it rejects, the loader rejects."""
    registry = load_registry()
    for i, (which, mutate) in enumerate(INVALID):
        seq, dist = copy.deepcopy(SEQ), copy.deepcopy(DIST)
        mutate(seq if which == "seq" else dist)
        s, d = tmp_path / f"seq{i}.json", tmp_path / f"dist{i}.json"
        s.write_text(json.dumps(seq))
        d.write_text(json.dumps(dist))
        with pytest.raises(InputError) as info:
            load_dist(d, registry, load_seq(s, registry))
        assert info.value.file == str(s if which == "seq" else d), (i, str(info.value))


def test_schema_is_packaged() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"schema/*.json"' in pyproject and '"jsonschema>=4"' in pyproject
