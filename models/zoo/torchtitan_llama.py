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
`parallelize_llama` makes for TP. The FSDP configurations ("fsdp2", "fsdp2_tp2") call
torchtitan's own `parallelize_llama` (TP, then `apply_fsdp_to_decoder`: `fully_shard` per block,
grouped `[norm, lm_head]`, the root, gradient division disabled), with
`mixed_precision_param="float32"` (bfloat16 compute is refused), the batch split over the
"fsdp" axis and the valid tokens summed over the batch mesh as torchtitan's trainer does;
capture writes FSDP2's communication into the trace (refine.frontends.capture.fsdp).
`make_case(config, titan_parallelize=True)` runs parallelize_llama for a TP configuration too
(fully_shard over a 1-rank FSDP mesh). The step is torchtitan's trainer's: the valid-token count,
`CrossEntropyLoss` (sum) divided by it, backward; the vocab-sharded logits are gathered
(`full_tensor()`) before the loss.

Left out of PROGRAM:

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
import functools
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
        "tp4_sp": "TP 4, sequence parallel, logits gathered",
        "fsdp2": "torchtitan's parallelize_llama: FSDP2 over dp_shard 2 (padded shards), the batch split over it",
        "fsdp2_tp2": "torchtitan's parallelize_llama: FSDP2 over dp_shard 2 x TP 2 with sequence parallel",
    },
    smoke="tp2_sp",
    bugs={
        "logits_gather_grad_summed": Bug(
            config="tp2_sp",
            what="the vocab-sharded logits gathered by hand with the autograd all-gather, whose backward "
                 "reduce-scatters (sums) a gradient every rank already holds whole: every gradient is tp "
                 "times too large (the kind of pytorch #160285's 2x expert gradients at EP=2)",
            smoke=False),
        "loss_shard_tokens": Bug(
            config="tp2_sp",
            what="the summed loss divided by the valid tokens of this rank's sequence shard, not of the "
                 "batch: the loss and every gradient tp times too large (torchtitan's token-count "
                 "normalization, global_valid_tokens, exists for this kind of bug under DP/CP)",
            smoke=False),
        "loss_local_tokens": Bug(
            config="fsdp2",
            what="each data-parallel rank divides its summed loss by its own valid tokens, not the batch's "
                 "(dist_sum of the counts over the batch mesh left out), while parallelize_llama disables "
                 "FSDP's gradient division: the reduce-scatter sums per-rank means, every gradient dp times too "
                 "large (the gradient-accumulation normalization bug of transformers #34191 / torchtitan's "
                 "global_valid_tokens)",
            smoke=False),
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


def dp_step(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, *, dims: Any,
            bug: str | None = None) -> torch.Tensor:
    """torchtitan's trainer's step under data parallelism: the valid tokens of the batch are
    the sum over the batch mesh of each rank's (`dist_sum_tensor`, as Trainer.train_step)."""
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import utils as dist_utils

    local_valid_tokens = (labels != IGNORE_INDEX).sum()
    global_valid_tokens = dist_utils.dist_sum_tensor(local_valid_tokens, dims.get_mesh("batch"))
    if bug == "loss_local_tokens":  # the rank's own count, not the batch's
        global_valid_tokens = (labels != IGNORE_INDEX).sum()  # BUG: loss_local_tokens
    return _step(model, tokens, labels, gather_logits=True, valid_tokens=global_valid_tokens)


def _step(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, gather_logits: bool,
          by_hand: bool = False, valid_tokens: torch.Tensor | None = None) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss

    global_valid_tokens = (labels != IGNORE_INDEX).sum() if valid_tokens is None else valid_tokens
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


def dims_config(tp: int, sequence_parallel: bool, dp: int = 1) -> Any:
    from torchtitan.config import ParallelismConfig

    return ParallelismConfig(data_parallel_shard_degree=dp, tensor_parallel_degree=tp,
                             enable_sequence_parallel=sequence_parallel, spmd_backend="partial_dtensor")


def parallel_dims(tp: int, sequence_parallel: bool, dp: int = 1) -> Any:
    """torchtitan's ParallelDims and its meshes, built as its trainer does (in the rank's process group)."""
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    par = dims_config(tp, sequence_parallel, dp)
    dist_utils.set_spmd_backend(par.spmd_backend)
    dims = ParallelDims.from_config(par, tp * dp)
    with mock.patch.object(titan_dims, "device_type", "cpu"):  # torchtitan picks "cuda" on a CPU-only host
        dims.build_mesh()
    return dims


def make_case(config: str, bug: str | None = None, *, loss_parallel: bool = False,
              titan_parallelize: bool = False, sequence_parallel: bool | None = None,
              param_dtype: str = "float32") -> capture.Spec:
    """`config`: one of PROGRAM's ("tp<N>", "_sp": sequence parallel; "fsdp<N>[_tp<M>]":
    parallelize_llama with FSDP2 over N ranks, TP M with sequence parallel). The variants left
    out of PROGRAM (see the module docstring): `loss_parallel`, the loss on the vocab-sharded
    logits; `titan_parallelize`, `parallelize_llama` instead of `Module.parallelize`;
    `sequence_parallel` overrides the configuration's; `param_dtype`, torchtitan's
    `mixed_precision_param` (its default, bfloat16, is mixed precision capture refuses)."""
    import torchtitan

    register_source_library(torchtitan)  # nodes are reported at torchtitan's lines
    PROGRAM.validate(config, bug)
    dp = int(config[4]) if config.startswith("fsdp") else 1
    tp = int(config.rpartition("tp")[2][0]) if "tp" in config else 1
    titan_parallelize = titan_parallelize or dp > 1  # parallelize_llama applies fully_shard
    default_sp = config.endswith("_sp") or (dp > 1 and tp > 1)
    sp = default_sp if sequence_parallel is None else sequence_parallel
    lp = loss_parallel
    torch.manual_seed(0)
    seq = model_config(sp).build()
    seq.init_states()
    tokens = torch.randint(0, VOCAB, (B, T))
    labels = torch.randint(0, VOCAB, (B, T))
    inputs = {"tokens": tokens, "labels": labels}

    def rank(r: int) -> capture.Step:
        dims = parallel_dims(tp, sp, dp)
        model = copy.deepcopy(seq)
        if titan_parallelize:
            from torchtitan.config import CompileConfig, TrainingConfig
            from torchtitan.models.llama3 import parallelize_llama

            parallelize_llama(model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param=param_dtype),
                              parallelism=dims_config(tp, sp, dp), compile_config=CompileConfig(), ac_config=None,
                              dump_folder="")
        else:
            model.parallelize(dims)
        if dp > 1:  # the batch split over the data-parallel ranks
            b = B // dp
            mine = slice((r // tp) * b, (r // tp + 1) * b)
            rank_inputs = {n: capture.shard(t[mine], 0, "fsdp") for n, t in inputs.items()}
            return capture.Step(model, functools.partial(dp_step, dims=dims, bug=bug), rank_inputs)
        for name in inputs:
            capture.replicate(name)
        for name, p in model.named_parameters():
            if not hasattr(p, "placements"):
                capture.replicate(name)
        step = {"logits_gather_grad_summed": summed_gather_step, "loss_shard_tokens": shard_tokens_step}.get(
            bug or "", train_step if lp else gathered_step)
        return capture.Step(model, step, inputs)

    mesh = {"fsdp": dp, "tp": tp} if titan_parallelize else {"tp": tp}
    return capture.Spec(capture.Step(seq, train_step, inputs), rank, world_size=tp * dp, mesh=mesh,
                        name=f"torchtitan_llama_{config}" + (f"_bug_{bug}" if bug else ""))
