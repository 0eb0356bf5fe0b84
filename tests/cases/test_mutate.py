"""Mutation testing (refine/oracle/mutate.py): realistic distributed bugs injected into correct
cases must never REFINE while numerically wrong. Each operator runs at least once on small
built cases (a tensor-parallel MLP with a residual, the sequence-parallel MLP example), and
a few on imported corpus cases (tests/corpus/test_mutate.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from refine.cli import main
from refine.frontends.build import GraphBuilder, dist_doc, seq_doc, write_case
from refine.ir.errors import InputError
from refine.ops.registry import load_registry
from refine.oracle.mutate import OPERATORS, Judge, load_case, mutants, mutate_one
from tests.helpers import ROOT

REG = load_registry()


def _tp_mlp(tmp_path: Path, world: int = 2) -> tuple[Path, Path]:
    """Megatron MLP: column-parallel fc1 with each rank's slice of a replicated bias, row-parallel
    fc2 summed by all_reduce, a residual added after the sum, a replicated tensor subtracted."""
    T, H, F = 4, 8, 16
    s = GraphBuilder()
    x, c = s.input("x", [T, H]), s.input("c", [T, H])
    w1, b1 = s.input("w1", [H, F], role="parameter"), s.input("b1", [F], role="parameter")
    w2 = s.input("w2", [F, H], role="parameter")
    h = s.op("gelu", s.op("add", s.op("matmul", x, w1, name="fc1"), b1, name="fc1_b"), name="act", approximate="none")
    res = s.op("add", s.op("matmul", h, w2, name="fc2"), x, name="res")
    s.output("y", s.op("sub", res, c, name="out"))
    ranks = {}
    f = F // world
    for r in range(world):
        d = GraphBuilder()
        x_, c_ = d.input("x", [T, H]), d.input("c", [T, H])
        w1_, b1_ = d.input("w1", [H, f], role="parameter"), d.input("b1", [F], role="parameter")
        w2_ = d.input("w2", [f, H], role="parameter")
        b = d.op("slice", b1_, name="b1_part", dim=0, start=r * f, end=(r + 1) * f)
        h_ = d.op("gelu", d.op("add", d.op("matmul", x_, w1_, name="fc1"), b, name="fc1_b"), name="act",
                  approximate="none")
        total = d.op("all_reduce", d.op("matmul", h_, w2_, name="fc2"), name="sum", reduce_op="sum",
                     group=list(range(world)))
        res_ = d.op("add", total, x_, name="res")
        d.output("y", d.op("sub", res_, c_, name="out"))
        ranks[r] = d
    rel = [{"from": "x", "placements": ["Replicate"]}, {"from": "c", "placements": ["Replicate"]},
           {"from": "w1", "placements": ["Shard(1)"]}, {"from": "b1", "placements": ["Replicate"]},
           {"from": "w2", "placements": ["Shard(0)"]}]
    write_case(tmp_path, seq_doc(s), dist_doc({"tp": world}, ranks, rel, [{"output": "y", "placements": ["Replicate"]}]))
    return tmp_path / "seq.json", tmp_path / "dist.json"


def _outcome(paths: tuple[Path, Path], operator: str, site: str, ranks: list[int] | None = None) -> str:
    seq, dist, doc = load_case(*paths, REG)
    made = mutate_one(seq, dist, doc, REG, operator, site, ranks)
    assert made is not None, f"{operator} does not apply at {site}"
    return Judge(seq, dist, REG).judge(*made).kind


# (operator, site, ranks): every one a bug the checker must catch
TP_BUGS = [
    ("drop_collective", "sum", None),
    ("drop_collective", "sum", [1]),
    ("wrong_reduce", "sum", None),
    ("swap_operands", "out", None),
    ("slice_offset", "b1_part", [1]),
    ("scale", "fc2", [0]),
    ("add_before_reduce", "res", None),
    ("wrong_shard", "w1", [0]),
    ("swap_input", "out", [1]),
]
SP_BUGS = [
    ("drop_collective", "sp_gather", None),
    ("drop_collective", "sp_scatter", [0]),
    ("wrong_dim", "sp_gather", None),
    ("wrong_order", "sp_scatter", None),
    ("add_before_reduce", "fc2_bias", None),
]


def test_every_operator_is_exercised() -> None:
    assert {o for o, _, _ in TP_BUGS + SP_BUGS} == set(OPERATORS)


@pytest.mark.slow
@pytest.mark.parametrize(("operator", "site", "ranks"), TP_BUGS, ids=[f"{o}-{s}-{r}" for o, s, r in TP_BUGS])
def test_tp_mlp_mutants_are_caught(tmp_path: Path, operator: str, site: str, ranks: list[int] | None) -> None:
    assert _outcome(_tp_mlp(tmp_path), operator, site, ranks) == "caught"


@pytest.mark.parametrize(("operator", "site", "ranks"), SP_BUGS, ids=[f"{o}-{s}-{r}" for o, s, r in SP_BUGS])
def test_sp_mlp_mutants_are_caught(operator: str, site: str, ranks: list[int] | None) -> None:
    case = ROOT / "models" / "sp_mlp"
    assert _outcome((case / "seq.json", case / "dist.json"), operator, site, ranks) == "caught"


@pytest.mark.slow
def test_a_neutral_mutation_refines(tmp_path: Path) -> None:
    """b1 is replicated: rank 0 reading rank 1's copy computes the same (REFINES, equal)."""
    assert _outcome(_tp_mlp(tmp_path), "wrong_shard", "b1", [0]) == "neutral"


def test_a_mutant_that_does_not_type_check_is_rejected(tmp_path: Path) -> None:
    seq, dist, doc = load_case(*_tp_mlp(tmp_path), REG)
    # fc2 is [4, 16] x [8, 8] with its operands swapped
    with pytest.raises(InputError):
        mutate_one(seq, dist, doc, REG, "swap_operands", "fc2", [0])
    assert mutate_one(seq, dist, doc, REG, "wrong_reduce", "out") is None  # not a collective


def test_mutants_are_deterministic_and_load(tmp_path: Path) -> None:
    seq, dist, doc = load_case(*_tp_mlp(tmp_path), REG)
    a = [m.name for m, _ in mutants(seq, dist, doc, REG, 8, seed=5)]
    b = [json.dumps(m.doc, sort_keys=True) for m, _ in mutants(seq, dist, doc, REG, 8, seed=5)]
    assert a == [m.name for m, _ in mutants(seq, dist, doc, REG, 8, seed=5)]
    assert len(a) == 8 and len(set(b)) == 8  # all different documents
    assert a != [m.name for m, _ in mutants(seq, dist, doc, REG, 8, seed=6)]


def test_cli_mutate_exits_0_without_unsound_mutants(tmp_path: Path) -> None:
    seq, dist = _tp_mlp(tmp_path)
    r = CliRunner().invoke(main, ["mutate", str(seq), str(dist), "--count", "4", "--seed", "1"])
    assert r.exit_code == 0, r.output
    assert "none: the case as given" in r.output and "UNSOUND: 0" in r.output
    bad = CliRunner().invoke(main, ["mutate", str(seq), str(dist), "--operator", "no_such_op"])
    assert bad.exit_code == 2


def test_cli_mutate_exits_1_on_an_unsound_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checker that says REFINES to everything: the numerically wrong mutants make exit 1."""
    import importlib

    from refine.verdict.report import Report

    monkeypatch.setattr(importlib.import_module("refine.check"), "check", lambda *a, **k: Report(True, []))
    seq, dist = _tp_mlp(tmp_path)
    r = CliRunner().invoke(main, ["mutate", str(seq), str(dist), "--count", "3", "--operator", "wrong_reduce",
                                  "--operator", "scale"])
    assert r.exit_code == 1, r.output
    assert "UNSOUND" in r.output


def test_a_dead_site_is_neutral_and_too_large_a_case_is_unjudged(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Above the evaluation budget nothing is evaluated (refine.ops.interp.random_inputs raises
    EvalError, which localization's counterfactual edits also meet); a mutation whose site
    reaches no rank output is neutral without evaluation."""
    from refine.ops.interp import EvalError, random_inputs

    paths = _tp_mlp(tmp_path)
    seq, dist, doc = load_case(*paths, REG)
    monkeypatch.setenv("REFINE_EVAL_BUDGET", "100")
    with pytest.raises(EvalError, match="too large to evaluate"):
        random_inputs(seq, dist, 0, REG)
    judge = Judge(seq, dist, REG)
    assert not judge.evaluate
    assert judge.judge(*mutate_one(seq, dist, doc, REG, "scale", "fc2", [0])).kind == "unjudged"
    # a dead node: a copy of fc1 that nothing reads
    for r in doc["ranks"]:
        r["graph"]["nodes"].append({"name": "unused", "op": "mul", "args": ["fc1", 1.0], "shape": [4, 8],
                                    "dtype": "float32"})
    dist2 = load_mutant_doc(doc, seq)
    o = Judge(seq, dist2, REG).judge(*mutate_one(seq, dist2, doc, REG, "scale", "unused", None))
    assert o.verdict == "REFINES" and o.kind == "neutral"


def load_mutant_doc(doc: dict, seq: object) -> object:
    from refine.oracle.mutate import load_mutant

    return load_mutant(doc, seq, REG)  # type: ignore[arg-type]


