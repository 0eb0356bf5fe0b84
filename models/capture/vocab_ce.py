"""A tiny LM head with Megatron-style vocab-parallel cross-entropy: a whole training step.

    refine capture models/capture/vocab_ce.py:make_case --out case/
    refine check case/seq.json case/dist.json

The sequential model is a replicated Linear (the last hidden layer), the LM head (hidden ->
vocab logits) and `F.cross_entropy(ignore_index=IGNORE, label_smoothing=...)`. Each rank
holds rows [r*V/W, (r+1)*V/W) of the LM head (column parallel over the vocab, Megatron's
"f" in front of it: identity forward, all-reduce of the input gradient backward) and
computes the loss from its logits' slice as Megatron's `vocab_parallel_cross_entropy` does,
by hand with functional collectives, in an autograd Function with its own backward:

- max over the local vocab, all-reduced (MAX), subtracted; exp; local sum, all-reduced (SUM);
- ignored targets made safe (0) first, as torch's loss_parallel does; targets outside the
  rank's vocab range masked to 0 for the lookup and their predicted logit zeroed; the
  predicted logit all-reduced (SUM); per-token loss `log(sum_exp) - predicted`;
- label smoothing: the mean of the log-probs over the whole vocab (a sum over the local
  vocab, all-reduced, divided by the global vocab size);
- backward: `(softmax - (1 - ls) * one_hot(masked target) - ls / V) * grad`, the one-hot
  zeroed where the target is not on this rank.

The step averages the per-token losses over the tokens that are not ignored.
`make_case(bug=...)` builds the buggy twins:

- "max_not_all_reduced": each rank subtracts its own max (the ranks' exp sums are then in
  different units and their sum is wrong);
- "target_mask_missing": the predicted logit of a target on another rank is not zeroed (the
  lookup at the clamped index 0 is summed in);
- "predicted_not_all_reduced": each rank keeps its own predicted logit (zero when the target
  is elsewhere);
- "ignored_in_denominator": the mean divides by every token, ignored ones included;
- "sum_exp_not_all_reduced": each rank normalizes by its own sum of exps;
- "backward_sum_not_all_reduced": the backward's sum over the vocab is each rank's own;
- "backward_scaled": the backward's gradient at the logits scaled by the ranks' count (an
  average over the tensor-parallel group undone twice).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from refine import capture

T, H, V = 8, 16, 32  # tokens, hidden size, vocab size
IGNORE = -100
BUGS: dict[str, dict[str, object]] = {  # bug -> the make_case arguments of its twin
    "max_not_all_reduced": {},
    "target_mask_missing": {},
    "predicted_not_all_reduced": {},
    "ignored_in_denominator": {},
    "sum_exp_not_all_reduced": {},
    "backward_sum_not_all_reduced": {},
    "backward_scaled": {},
}


class LMHead(nn.Module):
    """The sequential model: hidden layer, then logits over the whole vocab."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(H, H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(x)))


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    loss = F.cross_entropy(model(x), target, ignore_index=IGNORE, label_smoothing=label_smoothing)
    loss.backward()
    return loss


class CopyToTP(torch.autograd.Function):
    """Megatron's "f": the identity forward; the input gradient is all-reduced backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return funcol.all_reduce(grad, "sum", ctx.group), None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token terms from this rank's slice of the logits [T, V/W]: the negative log-prob
    of the target and the negative sum of the log-probs over the whole vocab (label
    smoothing's term), Megatron's collectives and masks."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup,  # noqa: ANN001
                bug: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        part = logits.shape[-1]
        start = dist.get_rank(group) * part
        end = start + part
        local_max = logits.amax(-1, keepdim=True)  # BUG: max_not_all_reduced
        if bug != "max_not_all_reduced":
            local_max = funcol.all_reduce(local_max, "max", group)
        shifted = logits - local_max
        sum_exp = shifted.exp().sum(-1, keepdim=True)  # BUG: sum_exp_not_all_reduced
        if bug != "sum_exp_not_all_reduced":
            sum_exp = funcol.all_reduce(sum_exp, "sum", group)
        log_probs = shifted - sum_exp.log()
        # ignored targets point at 0, then everything outside [start, end) is masked
        safe = torch.where(target != IGNORE, target, 0).unsqueeze(-1)
        mask = (safe < start) | (safe >= end)
        local_target = (safe - start).masked_fill(mask, 0)
        predicted = log_probs.gather(-1, local_target)  # BUG: target_mask_missing
        if bug != "target_mask_missing":
            predicted = predicted.masked_fill(mask, 0.0)  # BUG: predicted_not_all_reduced
        if bug != "predicted_not_all_reduced":
            predicted = funcol.all_reduce(predicted, "sum", group)
        nll = -predicted.squeeze(-1)
        smooth = -funcol.all_reduce(log_probs.sum(-1), "sum", group)
        ctx.save_for_backward(log_probs, local_target, mask)
        ctx.group, ctx.bug = group, bug
        return nll, smooth

    @staticmethod
    def backward(ctx, grad_nll: torch.Tensor, grad_smooth: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        """The log-softmax backward over the sharded vocab: the gradient at the log-probs is
        the masked one-hot of the target (times the nll gradient) minus the smoothing
        gradient on every class; its sum over the whole vocab is all-reduced."""
        log_probs, local_target, mask = ctx.saved_tensors
        one_hot = torch.zeros_like(log_probs).scatter(-1, local_target, -1.0).masked_fill(mask, 0.0)
        grad_lp = one_hot * grad_nll.unsqueeze(-1) - grad_smooth.unsqueeze(-1)
        total = grad_lp.sum(-1, keepdim=True)  # BUG: backward_sum_not_all_reduced
        if ctx.bug != "backward_sum_not_all_reduced":
            total = funcol.all_reduce(total, "sum", ctx.group)
        grad = grad_lp - log_probs.exp() * total
        if ctx.bug == "backward_scaled":
            grad = grad * dist.get_world_size(ctx.group)  # BUG: backward_scaled
        return grad, None, None, None


class VocabParallelLMHead(nn.Module):
    """One rank: the hidden layer replicated, the head's rows of this rank's vocab range."""

    def __init__(self, seq: LMHead, rank: int, world: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.fc = nn.Linear(H, H)
        self.fc.load_state_dict(seq.fc.state_dict())
        capture.replicate(self.fc.weight)
        capture.replicate(self.fc.bias)
        rows = V // world
        w = seq.head.weight.detach()[rank * rows:(rank + 1) * rows].clone()
        self.head_weight = capture.shard(nn.Parameter(w), 0, "tp", seq="head.weight")
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = CopyToTP.apply(torch.tanh(self.fc(x)), self.group)
        return F.linear(h, self.head_weight)


def rank_step(model: VocabParallelLMHead, x: torch.Tensor, target: torch.Tensor, label_smoothing: float,
              bug: str | None, fused: bool = False) -> torch.Tensor:
    """The mean over the tokens that are not ignored, label smoothing mixed in as
    F.cross_entropy defines it (`fused`: per token first, as Megatron does, then masked)."""
    nll, smooth = VocabParallelCrossEntropy.apply(model(x), target, model.group, bug)
    valid = target != IGNORE
    count = target.numel() if bug == "ignored_in_denominator" else valid.sum().float()  # BUG: ignored_in_denominator
    if fused:
        nll = (1.0 - label_smoothing) * nll + label_smoothing / V * smooth
    loss = torch.where(valid, nll, 0.0).sum() / count  # BUG: ignored_in_denominator
    if label_smoothing > 0 and not fused:
        ignored = target == IGNORE
        smooth_loss = torch.where(ignored, 0.0, smooth).sum() / (~ignored).sum()
        loss = (1.0 - label_smoothing) * loss + label_smoothing / V * smooth_loss
    loss.backward()
    return loss


def make_case(world_size: int = 2, bug: str | None = None, label_smoothing: float = 0.1,
              fused: bool = False) -> capture.Spec:
    """`fused=True`: the step mixes the smoothing term in per token before masking, as
    Megatron does (same values; refine does not relate it: see rules/loss.py)."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(BUGS)})")
    torch.manual_seed(0)
    seq = LMHead()
    x = torch.randn(T, H)
    target = torch.randint(0, V, (T,))
    target[torch.tensor([2, 5])] = IGNORE  # padding tokens
    inputs = {"x": x, "target": target}
    name = f"vocab_ce{'_bug_' + bug if bug else ''}"

    def rank(r: int) -> capture.Step:
        model = VocabParallelLMHead(seq, r, world_size, dist.group.WORLD)  # type: ignore[arg-type]
        return capture.Step(model, lambda m, **kw: rank_step(m, **kw, label_smoothing=label_smoothing, bug=bug,
                                                                    fused=fused),
                            inputs)

    return capture.Spec(
        sequential=capture.Step(seq, lambda m, **kw: train_step(m, **kw, label_smoothing=label_smoothing), inputs),
        rank=rank, world_size=world_size, mesh={"tp": world_size}, name=name)
