"""megatron-core's own GPTModel under its own tensor (and sequence) parallelism, trained one step.

    pip install megatron-core==0.16.1      (the `dev` extra)

The model is `megatron.core.models.gpt.GPTModel` with Megatron's local layer spec
(`get_gpt_layer_local_spec`: its ColumnParallelLinear / RowParallelLinear attention and MLP,
its DotProductAttention, rotary embeddings, a VocabParallelEmbedding and a vocab-parallel
output layer), 2 layers, hidden 32, 4 heads, vocab 64, dropout off. Without apex or Transformer
Engine the local spec has no layer norm for sequence parallelism, so the norms are torch's
LayerNorm with their parameters marked as Megatron's own norms mark them
(`sequence_parallel`), which is what `finalize_model_grads` selects.

The step is a Megatron user's: the model's logits gathered over the vocabulary
(`parallel_output=False`: the output layer's ColumnParallelLinear gathers its output), the
per-token cross-entropy over them ([b, s]), averaged over the loss mask, backward, then
Megatron's `finalize_model_grads` (which all-reduces the sequence-parallel norms' gradients
over the TP group). The sequential program is the same step on the same model at TP 1
(`refine.frontends.capture.megatron.sequential_step`). Each rank builds the model under
Megatron's parallel state of its TP rank (`megatron.rank_step`); every parameter's relation
comes from Megatron's marks.

Left out of PROGRAM:

- the model's own loss (`make_case(config, vocab_parallel_loss=True)`: called with labels,
  GPTModel computes Megatron's `vocab_parallel_cross_entropy` on its vocab-parallel logits,
  the pretrain_gpt way). It captures and agrees numerically; the check is UNPROVEN. Against
  the same step at TP 1, the sequential's own range mask `(t < 0) | (t >= V)` (cross_entropy.py,
  `target_mask = ...`) is a node no rank holds (each rank tests its own range). Against a
  plain log-softmax + gather reference (tests/cases/test_capture_megatron.py), the log-softmax
  over the logits handed back transposed now relates (rules/layout_through.py), and the
  target lookup's rank form is known (rules/masked_lookup.py, `masked-lookup-flat-*`:
  `logits_2d[arange, masked_target]` is captured as a lookup at the flat index
  `arange * n + masked`), but the step's frontier does not reach the rank's lookup (its index
  is four ops from the rank's target, Policy.side_depth is 3); and backward, the sequential
  gradient at the log-probs (`nll_loss_backward`'s one-hot times the token weight) has no rank
  counterpart: Megatron computes `(softmax - one_hot) * grad` in one go (rules/loss.py's
  "Limit of the vocab-parallel cross-entropy").

Bugs (`make_case(config, bug)`): see PROGRAM.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.zoo import Bug, Program
from refine import capture

REQUIRES = ("megatron.core",)

S, B, H, HEADS, V = 8, 2, 32, 4, 64

PROGRAM = Program(
    configs={
        "tp2": "TP 2 without sequence parallelism",
        "tp2_sp": "TP 2 with sequence parallelism (norms marked sequence_parallel, finalize_model_grads)",
        "tp4": "TP 4 without sequence parallelism",
    },
    smoke="tp2",
    bugs={
        "norm_not_marked_sp": Bug(
            config="tp2_sp",
            what="a custom layer norm marks its parameters with apex's attribute name "
                 "(`sequence_parallel_enabled`), not Megatron's (`sequence_parallel`): finalize_model_grads "
                 "skips them and each rank keeps the gradient of its own sequence shard (the norm-gradient "
                 "all-reduce Megatron-LM users hit when a norm is not marked for sequence parallelism)"),
        "loss_all_reduced_over_tp": Bug(
            config="tp2",
            what="the per-token losses, already whole on every tensor-parallel rank, summed again over the "
                 "TP group (Megatron's reduce_from_tensor_model_parallel_region) before averaging: the reported "
                 "loss tp times too large, the gradients unchanged (the all-reduce's backward is the identity): "
                 "a loss normalised by the wrong count, the kind of loss-reduction bug Megatron users report"),
    },
)


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm as Megatron's local spec takes a norm: its parameters marked for
    sequence parallelism under the config's `sequence_parallel`, as Megatron's norms are."""

    mark = "sequence_parallel"

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            setattr(p, self.mark, config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)  # BUG: norm_not_marked_sp


class ApexMarkedLayerNorm(LayerNorm):
    mark = "sequence_parallel_enabled"


def build(tp: int, sequence_parallel: bool, norm: type[LayerNorm] = LayerNorm, parallel_output: bool = True) -> nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    torch.manual_seed(0)  # every TP size builds the same full weights (Megatron's CPU init splits them)
    config = TransformerConfig(num_layers=2, hidden_size=H, ffn_hidden_size=4 * H, num_attention_heads=HEADS,
                               tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                               use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                               bias_dropout_fusion=False, gradient_accumulation_fusion=False,
                               masked_softmax_fusion=False)
    layer = get_gpt_layer_local_spec()
    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = norm
    block = TransformerBlockSubmodules(layer_specs=[layer] * 2, layer_norm=norm)
    return GPTModel(config, block, vocab_size=V, max_sequence_length=S, position_embedding_type="rope",
                    parallel_output=parallel_output)


def per_token_losses(model: nn.Module, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                     labels: torch.Tensor) -> torch.Tensor:
    """[b, s]: the model's own vocab_parallel_cross_entropy when its logits stay vocab-parallel,
    else the cross-entropy over the logits it gathers ([b, s, v])."""
    if model.parallel_output:
        return model(ids, pos, mask, labels=labels)
    return F.cross_entropy(model(ids, pos, mask).transpose(1, 2), labels, reduction="none")


def train_step(model: nn.Module, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor,
               loss_mask: torch.Tensor) -> torch.Tensor:
    from refine.frontends.capture import megatron

    losses = per_token_losses(model, ids, pos, mask, labels)
    loss = (losses * loss_mask).sum() / loss_mask.sum()
    loss.backward()
    megatron.finalize_model_grads(model)
    return loss


def tp_summed_loss_step(model: nn.Module, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                        labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    from refine.frontends.capture import megatron

    losses = per_token_losses(model, ids, pos, mask, labels)
    losses = reduce_from_tensor_model_parallel_region(losses)  # BUG: loss_all_reduced_over_tp
    loss = (losses * loss_mask).sum() / loss_mask.sum()
    loss.backward()
    megatron.finalize_model_grads(model)
    return loss


def inputs() -> dict[str, torch.Tensor]:
    """A batch as Megatron's GPT dataset hands it: token ids, positions, the causal mask
    (True: masked), labels (the ids shifted by one) and the loss mask (the last token has no label)."""
    torch.manual_seed(1)
    ids = torch.randint(0, V, (B, S))
    loss_mask = torch.ones(B, S)
    loss_mask[:, -1] = 0.0
    return {"ids": ids, "pos": torch.arange(S).expand(B, S).clone(),
            "mask": torch.tril(torch.ones(1, 1, S, S)) < 0.5, "labels": torch.roll(ids, -1, dims=1),
            "loss_mask": loss_mask}


def make_case(config: str, bug: str | None = None, *, vocab_parallel_loss: bool = False) -> capture.Spec:
    """`config`: one of PROGRAM's ("tp<N>", "_sp": sequence parallel). `vocab_parallel_loss`:
    the model's own loss (left out of PROGRAM: see the module docstring)."""
    from refine.frontends.capture import megatron

    PROGRAM.validate(config, bug)
    tp = int(config[2])
    sp = config.endswith("_sp")
    batch = inputs()
    norm = ApexMarkedLayerNorm if bug == "norm_not_marked_sp" else LayerNorm
    step = tp_summed_loss_step if bug == "loss_all_reduced_over_tp" else train_step
    po = vocab_parallel_loss  # the output layer's logits stay vocab-parallel for the model's own loss

    def rank(r: int) -> capture.Step:
        local = {k: capture.replicate(v.clone(), axis="tp") for k, v in batch.items()}
        return megatron.rank_step(lambda: build(tp, sp, norm, po), step, local, tp=tp)

    return capture.Spec(lambda: megatron.sequential_step(lambda: build(1, False, LayerNorm, po), train_step, batch), rank,
                        world_size=tp, mesh={"tp": tp}, name=f"megatron_gpt_{config}" + (f"_bug_{bug}" if bug else ""))
