"""A tiny Hugging Face transformers Llama, trained one step, under its own tensor-parallel plan.

    refine capture models/capture/hf_llama.py:make_case --out case/
    refine check case/seq.json case/dist.json

The model is `LlamaForCausalLM` built from a small `LlamaConfig` (1 layer, hidden 16, 4
attention heads, 2 key/value heads (GQA), vocab 32, eager attention), no download. The step
is the model's own causal-LM loss (cross-entropy over the vocab, labels shifted inside the
model) and its backward. An explicit 4-d additive causal mask is passed, so no mask is built
from the data.

Each rank is the same model parallelized by transformers itself
(`transformers.distributed.tensor_parallel.apply_tensor_parallelism`) with the model's
`tp_plan` (q/k/v/gate/up colwise, o/down rowwise, lm_head colwise with the logits gathered)
on a 2-rank CPU DeviceMesh, inside refine's fake process group; refine.frontends.capture.hf turns the
DTensor parameters into annotated local shards (placements from the plan).

`make_case(bug=...)`:

- "o_proj_partial": the plan marks `o_proj` with a custom rowwise style whose output stays
  Partial (no all-reduce): each rank adds only its heads' share of the attention output to
  the residual stream.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from refine import capture
from refine.frontends.capture.hf import float64_reference, tensor_parallel

BUGS: dict[str, dict[str, object]] = {  # bug -> the make_case arguments of its twin
    "o_proj_partial": {},
}
B, T, VOCAB = 1, 6, 32


def config(layers: int = 1) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                       attn_implementation="eager", tie_word_embeddings=False)


def causal_lm_step(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor,
                   position_ids: torch.Tensor) -> torch.Tensor:
    with float64_reference():  # only changes the float64 reference run (see refine.frontends.capture.hf)
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels,
                    use_cache=False)
    out.loss.backward()
    return out.loss


def forward_step(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor) -> torch.Tensor:
    """The loss alone (no backward): a quick check of the forward pass."""
    with float64_reference():
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels,
                     use_cache=False).loss


def _plan(model: nn.Module, bug: str | None) -> dict[str, str] | None:
    if bug != "o_proj_partial":
        return None
    from torch.distributed.tensor import Partial, Shard
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, RowwiseParallel

    ALL_PARALLEL_STYLES["rowwise_partial_output"] = RowwiseParallel(input_layouts=Shard(-1),
                                                                    output_layouts=Partial())
    plan = dict(model.tp_plan)  # type: ignore[arg-type]
    plan["model.layers.*.self_attn.o_proj"] = "rowwise_partial_output"  # BUG: o_proj_partial
    return plan


def make_case(world_size: int = 2, bug: str | None = None, layers: int = 1, backward: bool = True) -> capture.Spec:
    from transformers import LlamaForCausalLM

    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(BUGS)})")
    torch.manual_seed(0)
    seq = LlamaForCausalLM(config(layers))
    ids = torch.randint(0, VOCAB, (B, T))
    labels = torch.randint(0, VOCAB, (B, T))
    mask = torch.full((T, T), float("-inf")).triu(1).expand(B, 1, T, T).clone()  # additive causal mask
    inputs = {"input_ids": ids, "labels": labels, "attention_mask": mask,
              "position_ids": torch.arange(T).expand(B, T).clone()}

    def rank(r: int) -> capture.Step:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world_size,))
        return capture.Step(tensor_parallel(seq, mesh, _plan(seq, bug)), step, inputs)

    step = causal_lm_step if backward else forward_step
    return capture.Spec(capture.Step(seq, step, inputs), rank, world_size=world_size,
                        mesh={"tp": world_size})
