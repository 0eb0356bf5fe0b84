"""Mutation testing on imported corpus cases (refine/oracle/mutate.py; the operators on small
built cases are in tests/cases/test_mutate.py): the mutants of a real distributed layer are
caught, a loss scaled on every rank is refuted, and so is it when the relation file leaves the
loss's placement to the importer's guess."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refine.ops.registry import load_registry
from refine.oracle.mutate import Judge, load_case, mutate_one
from tests.helpers import CORPUS, ROOT

pytestmark = pytest.mark.corpus
REG = load_registry()


@pytest.mark.slow
def test_corpus_mutants_are_caught(tmp_path: Path) -> None:
    """aws_llama TP2 one layer (a check is a few CPU seconds): a dropped all_reduce on one
    rank and a residual added before the sum on every rank."""
    from refine.frontends.importer.entangle import import_case

    case = import_case(CORPUS / "aws_llama" / "tp1_layer1", CORPUS / "aws_llama" / "tp2_layer1",
                       ROOT / "models" / "entangle" / "relations" / "aws_llama.json")
    case.write(tmp_path)
    seq, dist, doc = load_case(tmp_path / "seq.json", tmp_path / "dist.json", REG)
    judge = Judge(seq, dist, REG)
    for operator, site, ranks in [("drop_collective", "all_reduce_146", [0]), ("add_before_reduce", "add_152", None)]:
        made = mutate_one(seq, dist, doc, REG, operator, site, ranks)
        assert made is not None
        assert judge.judge(*made).kind == "caught", made[0].name


def test_corpus_gpt_loss_scaled_on_every_rank_does_not_refine(tmp_path: Path) -> None:
    """Megatron GPT TP2: the per-token losses halved on every rank (a loss divided twice).
    Without an expectation the loss need only be reconstructible from the rank outputs, and
    `2 * output@0` is: the check said REFINES. models/entangle/relations/gpt.json now says the
    loss is Replicate. Too large to evaluate as imported (above REFINE_EVAL_BUDGET): the
    check's search finds its counterexample at reduced sizes (refine.verdict.reduce), so the
    mutant is caught although the sweep itself cannot evaluate it."""
    from refine.frontends.importer.entangle import import_case

    case = import_case(CORPUS / "gpt" / "paral1_layer1", CORPUS / "gpt" / "paral2_layer1",
                       ROOT / "models" / "entangle" / "relations" / "gpt.json")
    assert case.dist["expectations"] == [{"output": "output", "placements": ["Replicate"]}]
    case.write(tmp_path)
    seq, dist, doc = load_case(tmp_path / "seq.json", tmp_path / "dist.json", REG)
    made = mutate_one(seq, dist, doc, REG, "scale", "transpose_6", None, seed=1)
    assert made is not None and "scaled by 0.5" in made[0].name
    o = Judge(seq, dist, REG).judge(*made)
    assert o.verdict == "DOES NOT REFINE" and o.kind == "caught"


def test_corpus_output_expectation_is_guessed_from_shapes(tmp_path: Path) -> None:
    """A relation file that names no expectation for the checked output: the importer places
    it by shape like an input (the loss: Replicate) and flags the guess, so the loss halved on
    every rank is still DOES NOT REFINE (a counterexample at reduced sizes), and the correct
    case still refines."""
    from refine.check import check_files
    from refine.frontends.importer.entangle import import_case

    rel = json.loads((ROOT / "models" / "entangle" / "relations" / "gpt.json").read_text())
    del rel["outputs"]
    (tmp_path / "gpt.json").write_text(json.dumps(rel))
    case = import_case(CORPUS / "gpt" / "paral1_layer1", CORPUS / "gpt" / "paral2_layer1", tmp_path / "gpt.json")
    assert case.dist["expectations"] == [{"output": "output", "placements": ["Replicate"], "guessed": True}]
    assert "output output [Replicate]" in case.guesses
    case.write(tmp_path / "case")
    report = check_files(tmp_path / "case" / "seq.json", tmp_path / "case" / "dist.json")
    assert report.refines, str(report)
    assert "output output: [Replicate] (guessed from shapes)" in report.guesses
    seq, dist, doc = load_case(tmp_path / "case" / "seq.json", tmp_path / "case" / "dist.json", REG)
    made = mutate_one(seq, dist, doc, REG, "scale", "transpose_6", None, seed=1)
    assert made is not None
    assert Judge(seq, dist, REG).judge(*made).verdict == "DOES NOT REFINE"
