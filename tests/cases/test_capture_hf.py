"""A Hugging Face transformers Llama under transformers' own tensor-parallel plan, captured
(models/capture/hf_llama.py, refine/frontends/capture/hf.py) and checked."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.helpers.capture import load_model, wrong_numerically

pytest.importorskip("transformers")

from refine import capture  # noqa: E402

PARAMS = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
          "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
          "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight",
          "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight",
          "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
          "model.norm.weight", "lm_head.weight"]


LLAMA = load_model("hf_llama")


@pytest.fixture(scope="module")
def llama() -> tuple[capture.Case, float]:
    t0 = time.perf_counter()
    case = capture(LLAMA.make_case())
    return case, time.perf_counter() - t0


@pytest.fixture(scope="module")
def twin() -> capture.Case:
    return capture(LLAMA.make_case(bug="o_proj_partial"))


def modeling_line(snippet: str, occurrence: int | None = None) -> str:
    """The line of `snippet` in transformers' modeling_llama.py (unique, or the given occurrence)."""
    import transformers.models.llama.modeling_llama as m

    lines = Path(m.__file__).read_text().splitlines()
    found = [i for i, text in enumerate(lines, 1) if snippet in text]
    if occurrence is None:
        (n,) = found
    else:
        n = found[occurrence]
    return f"modeling_llama.py:{n}"


@pytest.mark.slow
def test_capture_follows_transformers_plan(llama: tuple[capture.Case, float]) -> None:
    case, seconds = llama
    print(f"hf_llama capture: {seconds:.1f}s")
    rel = {r["from"]: r["placements"] for r in case.dist_doc["relations"]}
    # derived from the plan (DTensor placements transformers gave each parameter), not guessed
    for p in ("q_proj", "k_proj", "v_proj"):
        assert rel[f"model.layers.0.self_attn.{p}.weight"] == ["Shard(0)"]
    assert rel["model.layers.0.self_attn.o_proj.weight"] == ["Shard(1)"]
    assert rel["model.layers.0.mlp.gate_proj.weight"] == rel["model.layers.0.mlp.up_proj.weight"] == ["Shard(0)"]
    assert rel["model.layers.0.mlp.down_proj.weight"] == ["Shard(1)"]
    assert rel["lm_head.weight"] == ["Shard(0)"]
    # parameters and buffers outside the plan are replicated: annotated too, written out; only
    # the step's inputs are matched by name (and guessed replicated)
    for p in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight",
              "model.rotary_emb.inv_freq"):
        assert rel[p] == ["Replicate"], p
    assert not {"input_ids", "labels", "attention_mask", "position_ids"} & set(rel)
    assert {g.split(":")[0] for g in case.guesses} == {"input_ids", "labels", "attention_mask", "position_ids"}
    assert {o["name"] for o in case.seq_doc["graph"]["outputs"]} == {"loss"} | {f"{p}.grad" for p in PARAMS}
    ops = {n["op"] for n in case.seq_doc["graph"]["nodes"]}
    assert {"cast", "log_softmax_stable", "embedding", "rsqrt", "sigmoid", "cos", "sin"} <= ops
    rank1 = case.dist_doc["ranks"][1]["graph"]["nodes"]
    reduces = [n for n in rank1 if n["op"] == "all_reduce"]
    gathers = [n for n in rank1 if n["op"] == "all_gather"]
    # forward: o_proj's and down_proj's partial sums; backward: the input gradient of each
    # colwise module (q, k, v, gate, up, lm_head: each redistributes its own input)
    assert len(reduces) == 8 and len(gathers) == 1  # lm_head's gathered logits
    assert all(n["source"].startswith("tensor_parallel.py:") for n in reduces + gathers)
    seq_sources = {n.get("source", "") for n in case.seq_doc["graph"]["nodes"]}
    assert modeling_line("attn_output = self.o_proj(attn_output)") in seq_sources
    # the captured programs compute the same thing (simulated collectives, random inputs)
    assert wrong_numerically(case) == set()


@pytest.mark.slow
def test_o_proj_partial_twin_is_wrong_numerically(twin: capture.Case) -> None:
    # every output downstream of the first residual add is wrong; the embedding's and the
    # first norm's gradients too (their gradients flow back through it)
    assert wrong_numerically(twin) == {"loss"} | {f"{p}.grad" for p in PARAMS}


@pytest.mark.slow
def test_llama_whole_step_refines(llama: tuple[capture.Case, float]) -> None:
    case, _ = llama
    t0 = time.perf_counter()
    report = case.check()
    print(f"hf_llama check: {time.perf_counter() - t0:.1f}s")
    assert report.refines, report
    assert {o.name for o in report.outputs} == {"loss"} | {f"{p}.grad" for p in PARAMS}


@pytest.mark.slow
@pytest.mark.parametrize("backward", [False, True])
def test_o_proj_partial_twin_does_not_refine(twin: capture.Case, backward: bool) -> None:
    report = (twin if backward else capture(LLAMA.make_case(bug="o_proj_partial", backward=False))).check()
    assert not report.refines
    assert "loss" in {o.name for o in report.outputs if not o.ok}
    c = report.culprit
    assert c is not None
    # the residual add: each rank adds the residual to its heads' partial attention output,
    # which o_proj left un-reduced; the residual then counts once per rank
    residual_add = modeling_line("hidden_states = residual + hidden_states", occurrence=0)  # after attention
    assert (c.op, c.source) == ("add", residual_add), c
    assert "partial sum" in c.reason, c
    # the numbers go further back: o_proj's output, held in pieces, makes every output right
    # whole: the all-reduce the plan leaves out belongs after o_proj's matmul, which runs in
    # transformers' row-parallel forward
    d = c.divergence
    assert d is not None and d.held == "placed [Partial(sum)]" and d.op == "mm", c
    assert c.rank_source == d.source and d.source.startswith("tensor_parallel.py:"), c
    assert any("@0 + " in rel and "@1" in rel for _, rel in c.inputs), c.inputs


# ---------------------------------------------------------------------------------------
# the model called as most users call it: no mask, no positions (transformers builds the
# causal mask from its packed-sequence ids, a `cumsum` over position breaks looked up by
# (batch, query) pairs, and the rotary positions from `arange().float()`)


def _default_masks_case(attn: str, bug: str | None = None) -> capture.Spec:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM

    from refine.frontends.capture.hf import float64_reference, tensor_parallel

    def step(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with float64_reference():
            out = model(input_ids=input_ids, labels=labels, use_cache=False)
        out.loss.backward()
        return out.loss

    torch.manual_seed(0)
    config = LLAMA.config(1)
    config._attn_implementation = attn
    seq = LlamaForCausalLM(config)
    inputs = {"input_ids": torch.randint(0, LLAMA.VOCAB, (LLAMA.B, LLAMA.T)),
              "labels": torch.randint(0, LLAMA.VOCAB, (LLAMA.B, LLAMA.T))}

    def rank(r: int) -> capture.Step:
        mesh = init_device_mesh("cpu", (2,))
        return capture.Step(tensor_parallel(seq, mesh, LLAMA._plan(seq, bug)), step, inputs)

    return capture.Spec(capture.Step(seq, step, inputs), rank, world_size=2, mesh={"tp": 2},
                        name=f"hf_llama_default_masks_{attn}")


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_llama_with_default_masks_refines(attn: str) -> None:
    case = capture(_default_masks_case(attn))
    assert {"cumsum", "index_rows"} <= {n.op for n in case.seq.nodes}  # the mask is built, not passed
    assert wrong_numerically(case) == set()
    report = case.check()
    assert report.verdict == "REFINES", report


@pytest.mark.slow
def test_llama_with_default_masks_o_proj_partial_twin_is_found() -> None:
    case = capture(_default_masks_case("sdpa", bug="o_proj_partial"))
    assert "loss" in wrong_numerically(case)
    report = case.check()
    assert report.verdict == "DOES NOT REFINE", report
