"""Hugging Face transformers' `LlamaForCausalLM` (2 layers) trained one step under its own
tensor-parallel plan, written as its users write it: the model's own causal-LM loss with the
default masks (no attention mask or positions passed: transformers builds the causal mask
and the positions), optionally tied input and output embeddings.

Each rank is the same model parallelized by transformers' `apply_tensor_parallelism` with the
model's `tp_plan` (q/k/v/gate/up colwise, o/down rowwise, lm_head colwise with gathered
logits; with tied embeddings transformers adds a vocab-parallel `embedding_rowwise`
embed_tokens and the two are tied again after sharding, as `from_pretrained` does), through
refine.frontends.capture.hf.

Configurations:
- tp2, tp4: tensor parallel over 2 / 4 ranks (GQA: 8 query heads, 4 key/value heads);
- tp2_tied: tp2 with `tie_word_embeddings=True`.

Bugs:
- o_proj_partial (tp2): the user's plan marks o_proj with a rowwise style whose output stays
  Partial, so the attention output is never all-reduced (each rank adds only its heads'
  share to the residual stream.

Not yet here: gradient accumulation over micro-batches of padded sequences with
`num_items_in_batch` (the correct step is UNPROVEN: the sequential loss's masked target
`where(labels != -100, labels, 0)` over the whole padded batch finds no clean relation to
the micro-batches' own masked targets), so its bug (the micro-batches' mean losses averaged,
huggingface/transformers PR #34191) waits for it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.zoo import Bug, Program
from refine import capture
from refine.frontends.capture.hf import float64_reference, tensor_parallel

REQUIRES = ("transformers",)

PROGRAM = Program(
    configs={
        "tp2": "tensor parallel, 2 ranks, transformers' own tp_plan",
        "tp4": "tensor parallel, 4 ranks, transformers' own tp_plan",
        "tp2_tied": "tensor parallel, 2 ranks, tied embeddings (vocab-parallel embed_tokens and lm_head)",
    },
    smoke="tp2",
    bugs={
        "o_proj_partial": Bug(
            config="tp2", smoke=True,
            what="a custom plan entry leaves o_proj's output Partial: the row-parallel partial sums are never "
                 "all-reduced",
            upstream=("modeling_llama.py", "hidden_states = residual + hidden_states")),
    },
)

B, T, VOCAB = 2, 8, 32


def llama_config(tied: bool) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=16,
                       attn_implementation="eager", tie_word_embeddings=tied)


def train_step(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The model's own causal-LM loss over the batch, then backward."""
    with float64_reference():  # only changes the float64 reference run (see refine.frontends.capture.hf)
        loss = model(input_ids=input_ids, labels=labels).loss
    loss.backward()
    return loss


def _plan(model: nn.Module, bug: str | None) -> dict[str, str] | None:
    if bug != "o_proj_partial":
        return None
    from torch.distributed.tensor import Partial, Shard
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, RowwiseParallel

    ALL_PARALLEL_STYLES["rowwise_partial_output"] = RowwiseParallel(input_layouts=Shard(-1), output_layouts=Partial())
    plan = dict(model.tp_plan)  # type: ignore[arg-type]
    plan["model.layers.*.self_attn.o_proj"] = "rowwise_partial_output"  # BUG: o_proj_partial
    return plan


def make_case(config: str, bug: str | None = None) -> capture.Spec:
    from transformers import LlamaForCausalLM

    PROGRAM.validate(config, bug)
    tp = 4 if config == "tp4" else 2
    torch.manual_seed(0)
    seq = LlamaForCausalLM(llama_config(tied=config == "tp2_tied"))
    ids = torch.randint(0, VOCAB, (B, T))
    inputs = {"input_ids": ids, "labels": ids.clone()}

    def rank(r: int) -> capture.Step:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (tp,))
        return capture.Step(tensor_parallel(seq, mesh, _plan(seq, bug)), train_step, inputs)

    name = f"hf_llama_{config}" + (f"_bug_{bug}" if bug else "")
    return capture.Spec(capture.Step(seq, train_step, inputs), rank, world_size=tp, mesh={"tp": tp}, name=name)
