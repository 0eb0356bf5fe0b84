"""Megatron-core's tensor- and sequence-parallel MLP: a whole training step, captured from
the real Megatron layers (megatron-core 0.16, CPU, a fake process group).

    refine capture models/capture/megatron_mlp.py:make_case --out case/
    refine check case/seq.json case/dist.json

The sequential model is plain torch: LayerNorm -> fc1 -> gelu -> fc2, an MSE loss, on
activations in Megatron's [sequence, batch, hidden] layout. Each rank runs Megatron's
ColumnParallelLinear (gather_output=False) and RowParallelLinear (input_is_parallel=True)
with the same weights (Megatron splits the full weight itself, through `init_method`).
With `sequence_parallel=True` (the default) the tokens are split along the sequence dim:
the LayerNorm runs on this rank's tokens, fc1 all-gathers them, fc2 reduce-scatters them
back; the LayerNorm's and fc2's bias's gradients are then partial sums, which Megatron's
`finalize_model_grads` all-reduces over the TP group (parameters marked
`sequence_parallel`). Without it the tokens are replicated and fc2 all-reduces.

The input relations of the parameters are not annotated here: refine derives them from
Megatron's own marks (refine.frontends.capture.megatron). Only the token split of the data (which
Megatron does not mark) is annotated.

`make_case(bug=...)` builds the buggy twins:

- "ln_grad_not_all_reduced": the step skips finalize_model_grads, so the gradients of the
  sequence-parallel parameters (LayerNorm weight and bias, fc2's bias) stay partial;
- "bias_before_all_reduce": a RowParallelLinear that fuses its bias into the GEMM, i.e.
  adds it on every rank before the reduce-scatter (all-reduce without SP): counted tp times.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer import TransformerConfig
from torch import nn

from refine import capture
from refine.frontends.capture import megatron

S, B, H, FFN = 8, 2, 16, 32  # sequence, micro-batch, hidden size, MLP size
BUGS: dict[str, dict[str, object]] = {  # bug -> the make_case arguments of its twin
    "ln_grad_not_all_reduced": {}, "bias_before_all_reduce": {},
}


class MLP(nn.Module):
    """The sequential model."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(H)
        self.fc1 = nn.Linear(H, FFN)
        self.fc2 = nn.Linear(FFN, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(self.ln(x)))
        return self.fc2(h)


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    return loss


class BiasFirstRowParallelLinear(RowParallelLinear):
    """The bug: the bias fused into the GEMM, so every rank adds it before the reduction."""

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = self._forward_impl(input=input_, weight=self.weight, bias=self.bias, gradient_accumulation_fusion=False,  # BUG: bias_before_all_reduce
                                 allreduce_dgrad=False, sequence_parallel=False, tp_group=self.tp_group)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, group=self.tp_group), None
        return reduce_from_tensor_model_parallel_region(out, group=self.tp_group), None


def _copy_from(full: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """An init_method: Megatron builds the full weight with it and keeps this rank's part."""

    def init(master: torch.Tensor) -> None:
        with torch.no_grad():
            master.copy_(full)

    return init


class MegatronMLP(nn.Module):
    """One rank's MLP, built from Megatron's layers with `seq`'s weights."""

    def __init__(self, seq: MLP, config: TransformerConfig, bug: str | None = None) -> None:
        super().__init__()
        self.config = config  # finalize_model_grads reads the model's config
        # Megatron's own LayerNorm (FusedLayerNorm) needs apex; torch's, marked as Megatron
        # marks its norms: under sequence parallelism the gradient is all-reduced over TP
        self.ln = nn.LayerNorm(H)
        self.ln.load_state_dict(seq.ln.state_dict())
        for p in self.ln.parameters():
            p.sequence_parallel = config.sequence_parallel
        self.fc1 = ColumnParallelLinear(H, FFN, config=config, init_method=_copy_from(seq.fc1.weight), bias=True,
                                        gather_output=False)
        row = BiasFirstRowParallelLinear if bug == "bias_before_all_reduce" else RowParallelLinear
        self.fc2 = row(FFN, H, config=config, init_method=_copy_from(seq.fc2.weight), bias=True,
                       input_is_parallel=True, skip_bias_add=False)
        tp, r = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
        with torch.no_grad():  # Megatron zeroes the biases; load them as a checkpoint would
            self.fc1.bias.copy_(seq.fc1.bias.chunk(tp)[r])
            self.fc2.bias.copy_(seq.fc2.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.fc1(self.ln(x))  # BUG: ln_grad_not_all_reduced
        y, _ = self.fc2(F.gelu(h))
        return y


def megatron_train_step(model: MegatronMLP, x: torch.Tensor, target: torch.Tensor, bug: str | None) -> torch.Tensor:
    """Forward, the MSE loss, backward, then Megatron's gradient finalization."""
    y = model(x)
    if model.config.sequence_parallel:
        # this rank's tokens only: sum the squared errors over the TP group, divide by all
        tp_group = parallel_state.get_tensor_model_parallel_group()
        loss = reduce_from_tensor_model_parallel_region(F.mse_loss(y, target, reduction="sum"), group=tp_group)
        loss = loss / (S * B * H)
    else:
        loss = F.mse_loss(y, target)
    loss.backward()
    if bug != "ln_grad_not_all_reduced":
        megatron.finalize_model_grads(model)
    return loss


def make_case(world_size: int = 2, bug: str | None = None, sequence_parallel: bool = True) -> capture.Spec:
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(BUGS)})")
    tp = world_size
    torch.manual_seed(0)
    seq = MLP()
    x, target = torch.randn(S, B, H), torch.randn(S, B, H)

    def rank(r: int) -> capture.Step:
        config = TransformerConfig(num_layers=1, hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=tp,
                                   tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                                   use_cpu_initialization=True)
        if sequence_parallel:  # Megatron's [s, b, h]: this rank's block of the sequence
            inputs = {k: capture.shard(v.chunk(tp)[r].clone(), 0, axis="tp") for k, v in (("x", x), ("target", target))}
        else:
            inputs = {k: capture.replicate(v.clone(), axis="tp") for k, v in (("x", x), ("target", target))}
        return megatron.rank_step(lambda: MegatronMLP(seq, config, bug),
                                  lambda m, **kw: megatron_train_step(m, **kw, bug=bug), inputs, tp=tp)

    name = f"megatron_mlp{'' if sequence_parallel else '_no_sp'}{'_bug_' + bug if bug else ''}"
    return capture.Spec(sequential=capture.Step(seq, train_step, {"x": x, "target": target}), rank=rank,
                        world_size=world_size, mesh={"tp": tp}, name=name)
