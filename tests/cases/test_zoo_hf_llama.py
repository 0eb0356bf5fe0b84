"""The zoo's Hugging Face Llama (models/zoo/hf_llama.py): transformers' own LlamaForCausalLM
under its own tp_plan, default masks, tied embeddings in one configuration: what the plan
gives each parameter."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from models.zoo import load  # noqa: E402
from refine import capture  # noqa: E402
from tests.helpers.capture import wrong_numerically  # noqa: E402

ZOO = load("hf_llama")
# the verdicts (each configuration refines, each bug names its line): tests/cases/test_zoo.py


def test_only_the_data_inputs_are_guessed() -> None:
    """Every parameter's placement comes from the plan; only the step's data is guessed."""
    case = capture(ZOO.make_case(ZOO.program.smoke))
    assert case.guesses and {g.split(":")[0] for g in case.guesses} == {"input_ids", "labels"}


def test_tied_embeddings_stay_tied_under_the_plan() -> None:
    """transformers shards embed_tokens (embedding_rowwise) and lm_head apart; the capture glue
    ties them again as from_pretrained does, so the ranks hold one vocab-parallel table."""
    case = capture(ZOO.make_case("tp2_tied"))
    rel = {r["from"]: r["placements"] for r in case.dist_doc["relations"]}
    assert rel["model.embed_tokens.weight"] == ["Shard(0)"] and "lm_head.weight" not in rel
    outputs = {o["name"] for o in case.seq_doc["graph"]["outputs"]}
    assert "model.embed_tokens.weight.grad" in outputs and "lm_head.weight.grad" not in outputs
    assert wrong_numerically(case) == set()
