"""Symbolic sizes end to end: a relation is inferred once for every value of the symbols,
and a rule whose side condition holds only for some values must not fire."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refine.check import check, engine_for, is_symbolic
from refine.frontends.build import GraphBuilder, dist_doc, seq_doc, write_case
from refine.frontends.graphfile import load_dist, load_seq
from refine.ir import sizes
from refine.ops.interp import instantiate, valuation
from refine.ops.lower import lower
from refine.ops.registry import load_registry
from refine.oracle.differential import audit
from refine.prove.walk import infer
from refine.relate.program import build_program, seq_input_relations
from tests.helpers import MODELS

REG = load_registry()


def _first_rows(tmp_path: Path, tokens: object, k: int) -> tuple[object, object]:
    """seq: y = x[0:k]; two ranks hold x sharded by rows and output it unchanged."""
    s = GraphBuilder()
    x = s.input("x", [tokens, 4])
    s.output("y", s.op("slice", x, name="first", dim=0, start=0, end=k))
    ranks = {}
    for r in range(2):
        d = GraphBuilder()
        xr = d.input("x", [tokens // 2, 4])
        d.output("x", d.op("clone", xr, name="keep"))
        ranks[r] = d
    syms = [tokens] if isinstance(tokens, sizes.Sym) else []
    write_case(tmp_path, seq_doc(s, syms), dist_doc({"tp": 2}, ranks, [{"from": "x", "placements": ["Shard(0)"]}]))
    seq = load_seq(tmp_path / "seq.json", REG)
    return seq, load_dist(tmp_path / "dist.json", REG, seq)


def _relation_of_first(seq, dist) -> str:  # noqa: ANN001
    core, _ = lower(seq, REG)
    prog, _ = build_program(dist, REG, "dist")
    inf = infer(core, seq_input_relations(dist, seq, prog, REG, "dist"), prog, engine_for(REG, is_symbolic(seq, dist)),
                REG)
    return str(inf.relations["first"])


@pytest.mark.parametrize("low, within_first_shard", [(4, True), (2, False)])
def test_slice_falls_into_one_shard_only_when_provable(tmp_path: Path, low: int, within_first_shard: bool) -> None:
    # x[0:2] lies in rank 0's rows iff T/2 >= 2: provable when T >= 4, not when T may be 2
    T = sizes.sym("T", min=low, multiple=2)
    seq, dist = _first_rows(tmp_path, T, 2)
    rel = _relation_of_first(seq, dist)
    if within_first_shard:
        assert rel == "slice(x@0, dim=0, 0:2)"
    else:
        assert "x@1" in rel, rel  # still a correct relation, over both shards
    # either way the relation holds numerically, at several values of T
    for seed in range(3):
        assert audit(seq, dist, REG, seed=seed) == []


def test_concrete_twin_agrees(tmp_path: Path) -> None:
    seq, dist = _first_rows(tmp_path, 8, 2)
    assert _relation_of_first(seq, dist) == "slice(x@0, dim=0, 0:2)"


def test_symbolic_verdict_names_the_symbols(tmp_path: Path) -> None:
    root = MODELS / "sp_mlp_symbolic"
    seq = load_seq(root / "seq.json", REG)
    dist = load_dist(root / "dist.json", REG, seq)
    report = check(seq, dist, REG)
    assert report.refines
    assert report.symbols == ["H >= 1", "T >= 1, a multiple of 2"]
    assert "for every value of H >= 1; T >= 1, a multiple of 2" in str(report)
    assert json.loads(report.to_json())["symbols"] == report.symbols


def test_instantiate_replaces_every_symbol() -> None:
    root = MODELS / "sp_mlp_symbolic"
    seq = load_seq(root / "seq.json", REG)
    dist = load_dist(root / "dist.json", REG, seq)
    values = valuation(seq.symbols, seed=5)
    assert values["T"] % 2 == 0 and values["T"] >= 2 and values["H"] >= 2
    cseq, cdist = instantiate(seq, dist, values)
    shapes = [i.type.shape for i in cseq.inputs] + [n.type.shape for g in cdist.ranks.values() for n in g.nodes]
    assert all(isinstance(d, int) for s in shapes for d in s)
    assert cseq.inputs[0].type.shape == (values["T"], values["H"])
