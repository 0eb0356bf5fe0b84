"""A token count under data parallelism, as training loops write it: the count of targets not
ignored, all-reduced, divides the summed loss. Cast to float before the all-reduce or after,
both refine (a cast passes over a sum of counts, rules/cast.py's Numeric analysis); a count
averaged instead of summed over the ranks does not."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from refine import capture
from tests.helpers.capture import wrong_numerically

B, S, V, H = 4, 3, 8, 6
IGNORE = -100


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(V, H), nn.Linear(H, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids))


def summed_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids).view(-1, V), labels.view(-1), ignore_index=IGNORE, reduction="sum")


def seq_step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    loss = summed_loss(model, ids, labels) / (labels != IGNORE).sum().float()
    loss.backward()
    return loss


def rank_step(how: str) -> Callable[..., torch.Tensor]:
    def step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        n = (labels != IGNORE).sum()
        if how == "cast_then_sum":
            n = n.float()
            dist.all_reduce(n)
        elif how == "sum_then_cast":
            dist.all_reduce(n)
            n = n.float()
        else:  # "averaged": the mean count over the ranks, world times too small
            n = n.float()
            dist.all_reduce(n, op=dist.ReduceOp.AVG)
        loss = summed_loss(model, ids, labels) / n
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        dist.all_reduce(loss)
        return loss
    return step


def _spec(seq_step: Callable[..., torch.Tensor], step: Callable[..., torch.Tensor], name: str,
          world: int = 2) -> capture.Spec:
    """The LM on a batch with one ignored target, its batch split over data-parallel ranks."""
    torch.manual_seed(0)
    seq = LM()
    ids, labels = torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))
    labels[0, 1] = IGNORE
    b = B // world

    def rank(r: int) -> capture.Step:
        model = LM()
        model.load_state_dict(seq.state_dict())
        for p in model.parameters():
            capture.replicate(p)
        part = slice(r * b, (r + 1) * b)
        return capture.Step(model, step, {"ids": capture.shard(ids[part], 0), "labels": capture.shard(labels[part], 0)})

    return capture.Spec(capture.Step(seq, seq_step, {"ids": ids, "labels": labels}), rank, world_size=world, name=name)


def make_case(how: str) -> capture.Spec:
    return _spec(seq_step, rank_step(how), f"token_count_{how}")


@pytest.mark.parametrize("how", ["cast_then_sum", "sum_then_cast"])
def test_a_token_count_summed_over_the_ranks_refines(how: str) -> None:
    case = capture(make_case(how))
    assert wrong_numerically(case) == set()
    assert case.check().verdict == "REFINES"


def test_a_token_count_averaged_over_the_ranks_does_not_refine() -> None:
    case = capture(make_case("averaged"))
    assert "loss" in wrong_numerically(case)
    assert case.check().verdict == "DOES NOT REFINE"


# ---------------------------------------------------------------------------------------
# a masked NLL over micro-batches: each micro-batch's masked sum divided by the global count


def masked_sum(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logp = F.log_softmax(model(ids), -1)
    nll = -logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (nll * (labels != IGNORE)).sum()


def masked_seq_step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    loss = masked_sum(model, ids, labels) / (labels != IGNORE).sum()
    loss.backward()
    return loss


def micro_step(local_count: bool, micro: int = 2) -> Callable[..., torch.Tensor]:
    def step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        n = (labels != IGNORE).sum()
        dist.all_reduce(n)
        total = torch.zeros(())
        for xs, ys in zip(ids.chunk(micro), labels.chunk(micro), strict=True):
            # the mask computed again per micro-batch; the bug divides by the micro-batch's count
            loss = masked_sum(model, xs, ys) / ((ys != IGNORE).sum() if local_count else n)
            loss.backward()
            total = total + loss.detach()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        dist.all_reduce(total)
        return total
    return step


def make_micro_case(local_count: bool = False) -> capture.Spec:
    return _spec(masked_seq_step, micro_step(local_count), f"masked_nll_micro{'_local_count' if local_count else ''}")


def test_a_masked_nll_over_micro_batches_refines() -> None:
    """Each micro-batch masks its own labels: the prover takes that mask along with the
    losses it masks (Policy.side_depth)."""
    case = capture(make_micro_case())
    assert wrong_numerically(case) == set()
    assert case.check().verdict == "REFINES"


def test_a_masked_nll_divided_by_each_micro_batchs_count_does_not_refine() -> None:
    case = capture(make_micro_case(local_count=True))
    assert "loss" in wrong_numerically(case)
    assert case.check().verdict == "DOES NOT REFINE"


# ---------------------------------------------------------------------------------------
# a causal-LM count: the sequential loss counts its targets as transformers' ForCausalLMLoss
# sees them (the labels padded with the ignore index, shifted, flattened); the training loop
# counts the targets of labels[:, 1:]


def padded_count_seq_step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    targets = F.pad(labels, (0, 1), value=IGNORE)[..., 1:].reshape(-1)
    loss = summed_loss(model, ids, labels) / (targets != IGNORE).sum()
    loss.backward()
    return loss


def shifted_count_rank_step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    n = (labels[:, 1:] != IGNORE).sum()  # the padded end is never a target
    dist.all_reduce(n)
    loss = summed_loss(model, ids, labels) / n
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    dist.all_reduce(loss)
    return loss


def test_a_count_over_the_unpadded_labels_is_the_count_over_the_padded_ones() -> None:
    """A comparison of the pad with the ignore index is constant (rules/constants.py) and a
    count over a flattened mask is the count over the mask (rules/reduce.py)."""
    case = capture(_spec(padded_count_seq_step, shifted_count_rank_step, "padded_count"))
    assert wrong_numerically(case) == set()
    assert case.check().verdict == "REFINES"
