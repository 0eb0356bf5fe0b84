"""The zoo's Hugging Face Llama (models/zoo/hf_llama.py): transformers' own LlamaForCausalLM
under its own tp_plan, default masks, tied embeddings in one configuration. Each correct
configuration refines; each bug does not, naming its line."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from models.zoo import load  # noqa: E402
from refine import capture  # noqa: E402
from tests.helpers.capture import wrong_numerically  # noqa: E402

ZOO = load("hf_llama")
SLOW = sorted(set(ZOO.program.configs) - {ZOO.program.smoke})


def check_refines(config: str) -> None:
    case = capture(ZOO.make_case(config))
    report = case.check()
    assert report.refines, report
    assert case.guesses and {g.split(":")[0] for g in case.guesses} == {"input_ids", "labels"}


def test_smoke_config_refines() -> None:
    check_refines(ZOO.program.smoke)


@pytest.mark.slow
@pytest.mark.parametrize("config", SLOW)
def test_config_refines(config: str) -> None:
    check_refines(config)


def test_tied_embeddings_stay_tied_under_the_plan() -> None:
    """transformers shards embed_tokens (embedding_rowwise) and lm_head apart; the capture glue
    ties them again as from_pretrained does, so the ranks hold one vocab-parallel table."""
    case = capture(ZOO.make_case("tp2_tied"))
    rel = {r["from"]: r["placements"] for r in case.dist_doc["relations"]}
    assert rel["model.embed_tokens.weight"] == ["Shard(0)"] and "lm_head.weight" not in rel
    outputs = {o["name"] for o in case.seq_doc["graph"]["outputs"]}
    assert "model.embed_tokens.weight.grad" in outputs and "lm_head.weight.grad" not in outputs
    assert wrong_numerically(case) == set()


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(ZOO.program.bugs))
def test_bug_does_not_refine_at_its_line(bug: str) -> None:
    case = capture(ZOO.make_case(ZOO.program.bugs[bug].config, bug))
    assert "loss" in wrong_numerically(case)
    report = case.check()
    assert report.verdict == "DOES NOT REFINE", report
    assert report.culprit is not None and report.culprit.rank_source in ZOO.culprit_lines(bug), report.culprit
