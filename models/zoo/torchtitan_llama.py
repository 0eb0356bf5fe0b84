"""torchtitan's own Llama-3 under its own tensor parallelism, trained one step.

    pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro docstring_parser triton

(`--no-deps`: torchtitan 0.3.0 pins a CUDA torch nightly; its own code needs only these.
triton: `torchtitan.models.llama3` imports `torchtitan.models.common.moe`, which imports
`torchtitan/distributed/minimal_async_ep/kernels.py`, which imports triton at module level;
triton 3.9 is a 286 MB wheel, 1.0 GB installed, 6 s to install from a warm network.)

The model is `torchtitan.models.llama3.Llama3Model`, built from a `Llama3Model.Config` written
like torchtitan's `debugmodel` flavor (its `_build_llama3_layers`, fused wqkv, RMSNorm, GQA
attention, SwiGLU feed-forward, untied `lm_head`), shrunk to 2 layers, dim 32, 4 heads, vocab
64, with `CosSinRoPE` and causal `ScaledDotProductAttention` (the `debugmodel`'s
`ComplexRoPE` holds a complex64 cache, which refine has no dtype for; its flex attention is a
higher-order op capture cannot read). Its sharding is torchtitan's own
(`torchtitan.models.llama3.sharding.set_llama3_sharding_config`, what
`Llama3Model.Config.update_from_config` sets): vocab-parallel `Embedding` (clamped ids, the
in-range mask as a number), colwise wqkv/w1/w3, rowwise wo/w2, sequence-parallel norms (or
not), `lm_head` colwise with vocab-sharded logits. Each rank builds torchtitan's
`ParallelDims` (backend "partial_dtensor": DTensor on the TP axis) on a CPU mesh inside
refine's fake process group and calls `Module.parallelize(parallel_dims)`, the call
`parallelize_llama` makes for TP. The step is torchtitan's trainer's: the valid-token count,
`CrossEntropyLoss` (sum) divided by it, backward; the vocab-sharded logits are gathered
(`full_tensor()`) before the loss.

Left out of PROGRAM:

- TP 4 with sequence parallelism (`make_case("tp4", sequence_parallel=True)`): UNPROVEN, the
  proof stops at the final norm's `pow` (decoder.py:240) over [B, S/4, H] sequence shards
  (issue 23's "[B,S,H] + SP at TP4/TP8 at the RMSNorm pow").

- `parallelize_llama(model, parallel_dims=..., ...)` itself: it always ends with
  `apply_fsdp_to_decoder`, i.e. `fully_shard` on a 1-rank "fsdp" mesh even without data
  parallelism, which capture refuses (its hooks all-gather and reduce-scatter outside the
  trace): `make_case(config, titan_parallelize=True)`.
- loss parallel (torchtitan's `_LossParallelCrossEntropy` on the vocab-sharded logits,
  `make_case(config, loss_parallel=True)`): it captures (its backward's
  `grad_input[row_idx, local_labels] = grad_update` writes distinct positions) and its
  forward relates (the target lookup: rules/masked_lookup.py, DTensor's form), but the check
  is UNPROVEN in the backward: nll_loss_backward's one-hot (loss.py's scatter) has no rank
  counterpart, the ranks holding only (their window of it + exp(log-probs)) * weight.

Bugs (`make_case(config, bug)`): see PROGRAM.
"""

from __future__ import annotations

import copy
from typing import Any
from unittest import mock

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from models.zoo import Bug, Program
from refine import capture
from refine.frontends.capture.precision import float64_reference
from refine.frontends.capture.trace import register_source_library

REQUIRES = ("torchtitan",)

B, T, DIM, HEADS, KV_HEADS, VOCAB = 2, 8, 32, 4, 4, 64

PROGRAM = Program(
    configs={
        "tp2_sp": "TP 2, sequence parallel (torchtitan's default), logits gathered",
        "tp2": "TP 2 without sequence parallel, logits gathered",
        "tp4": "TP 4 without sequence parallel, logits gathered",
    },
    smoke="tp2_sp",
    bugs={
        "logits_gather_grad_summed": Bug(
            config="tp2_sp",
            what="the vocab-sharded logits gathered by hand with the autograd all-gather, whose backward "
                 "reduce-scatters (sums) a gradient every rank already holds whole: every gradient is tp "
                 "times too large (the kind of pytorch #160285's 2x expert gradients at EP=2)",
            smoke=False,
            known_miss="every gradient is off by the factor tp; localization stops at the first backward node "
                       "with no clean relation (the final RMSNorm's, decoder.py:240), before the constant-factor "
                       "search reaches the gather"),
        "loss_shard_tokens": Bug(
            config="tp2_sp",
            what="the summed loss divided by the valid tokens of this rank's sequence shard, not of the "
                 "batch: the loss and every gradient tp times too large (torchtitan's token-count "
                 "normalization, global_valid_tokens, exists for this kind of bug under DP/CP)",
            smoke=False,
            known_miss="the ranks never count the batch's tokens: the report names the sequential count "
                       "(line 151) as the first node with no rank counterpart, not the rank's division by its "
                       "shard's count"),
    },
)


def model_config(sequence_parallel: bool) -> Any:
    from torchtitan.models.common import (
        CosSinRoPE,
        Embedding,
        Linear,
        RMSNorm,
        compute_ffn_hidden_dim,
    )
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    layers = _build_llama3_layers(
        n_layers=2, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, fuse_qkv=True,
        hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=32),
        rope=CosSinRoPE.Config(dim=DIM // HEADS, max_seq_len=T, theta=500000),
        attn_backend="flex")
    for layer in layers:  # causal SDPA: no mask built from document positions
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init={"weight": nn.init.normal_}),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": nn.init.ones_}),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                              param_init={"weight": nn.init.normal_, "bias": nn.init.zeros_}),
        layers=layers)
    set_llama3_sharding_config(config, enable_sp=sequence_parallel)
    return config


def train_step(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return _step(model, tokens, labels, gather_logits=False)


def gathered_step(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return _step(model, tokens, labels, gather_logits=True)


def shard_tokens_step(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed loss normalized by the tokens of this rank's sequence shard (as if each rank
    held only its sequence-parallel piece of the batch)."""
    import torch.distributed as dist
    from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss

    with float64_reference():
        pred = model(tokens).full_tensor()
        loss_sum, _ = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=VOCAB))(pred, labels)
    mine = labels.chunk(dist.get_world_size(), dim=1)[dist.get_rank()]
    loss = loss_sum / (mine != IGNORE_INDEX).sum()  # BUG: loss_shard_tokens
    loss.backward()
    return loss


def summed_gather_step(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return _step(model, tokens, labels, gather_logits=True, by_hand=True)


def _step(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, gather_logits: bool,
          by_hand: bool = False) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss

    global_valid_tokens = (labels != IGNORE_INDEX).sum()
    with float64_reference():  # only changes capture's float64 reference run (the loss's .float())
        pred = model(tokens)
        if gather_logits and by_hand:
            group = pred.device_mesh.get_group()
            pred = funcol.all_gather_single_autograd(pred.to_local(), 2, group)  # BUG: logits_gather_grad_summed
        elif gather_logits and isinstance(pred, DTensor):
            pred = pred.full_tensor()
        loss, _ = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=VOCAB))(pred, labels, global_valid_tokens)
    loss.backward()
    return loss


def dims_config(tp: int, sequence_parallel: bool) -> Any:
    from torchtitan.config import ParallelismConfig

    return ParallelismConfig(tensor_parallel_degree=tp, enable_sequence_parallel=sequence_parallel,
                             spmd_backend="partial_dtensor")


def parallel_dims(tp: int, sequence_parallel: bool) -> Any:
    """torchtitan's ParallelDims and its meshes, built as its trainer does (in the rank's process group)."""
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    par = dims_config(tp, sequence_parallel)
    dist_utils.set_spmd_backend(par.spmd_backend)
    dims = ParallelDims.from_config(par, tp)
    with mock.patch.object(titan_dims, "device_type", "cpu"):  # torchtitan picks "cuda" on a CPU-only host
        dims.build_mesh()
    return dims


def make_case(config: str, bug: str | None = None, *, loss_parallel: bool = False,
              titan_parallelize: bool = False, sequence_parallel: bool | None = None) -> capture.Spec:
    """`config`: one of PROGRAM's ("tp<N>", "_sp": sequence parallel). The variants left out
    of PROGRAM (see the module docstring): `loss_parallel`, the loss on the vocab-sharded
    logits; `titan_parallelize`, `parallelize_llama` instead of `Module.parallelize`;
    `sequence_parallel` overrides the configuration's."""
    import torchtitan

    register_source_library(torchtitan)  # nodes are reported at torchtitan's lines
    PROGRAM.validate(config, bug)
    tp = int(config[2])
    sp = config.endswith("_sp") if sequence_parallel is None else sequence_parallel
    lp = loss_parallel
    torch.manual_seed(0)
    seq = model_config(sp).build()
    seq.init_states()
    tokens = torch.randint(0, VOCAB, (B, T))
    labels = torch.randint(0, VOCAB, (B, T))
    inputs = {"tokens": tokens, "labels": labels}

    def rank(r: int) -> capture.Step:
        dims = parallel_dims(tp, sp)
        model = copy.deepcopy(seq)
        if titan_parallelize:
            from torchtitan.config import CompileConfig, TrainingConfig
            from torchtitan.models.llama3 import parallelize_llama

            parallelize_llama(model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param="float32"),
                              parallelism=dims_config(tp, sp), compile_config=CompileConfig(), ac_config=None,
                              dump_folder="")
        else:
            model.parallelize(dims)
        for name in inputs:
            capture.replicate(name)
        for name, p in model.named_parameters():
            if not hasattr(p, "placements"):
                capture.replicate(name)
        step = {"logits_gather_grad_summed": summed_gather_step, "loss_shard_tokens": shard_tokens_step}.get(
            bug or "", train_step if lp else gathered_step)
        return capture.Step(model, step, inputs)

    return capture.Spec(capture.Step(seq, train_step, inputs), rank, world_size=tp, mesh={"tp": tp},
                        name=f"torchtitan_llama_{config}" + (f"_bug_{bug}" if bug else ""))
