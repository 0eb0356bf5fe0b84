"""A running sum (`torch.cumsum`, backward through `flip`) in a captured training step: over
the hidden dim with the batch split over data-parallel ranks it refines; over a sequence
split across ranks, each rank must add the totals of the chunks before its own (a prefix
from an all-gather of chunk totals): that program computes the sequential step, and the
one that forgets the prefix does not refine."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from refine import capture
from tests.helpers.capture import wrong_numerically

B, S, H = 2, 8, 4


class Scan(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(H, H)
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(self.fc(x), self.dim)


class SeqScan(Scan):
    """The running sum over a sequence chunk, offset by the totals of the chunks before it."""

    def __init__(self, rank: int, world: int, prefix: bool) -> None:
        super().__init__(1)
        self.rank, self.world, self.prefix = rank, world, prefix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = torch.cumsum(self.fc(x), 1)
        if not self.prefix:
            return local
        totals = funcol.all_gather_tensor(local[:, -1:], 1, dist.group.WORLD)  # [B, world, H]
        before = totals[:, :self.rank].sum(1, keepdim=True)
        return local + before


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y, reduction="sum")
    loss.backward()
    return loss


def reduced_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = step(model, x, y)
    for p in model.parameters():
        dist.all_reduce(p.grad)
    dist.all_reduce(loss)
    return loss


def make_case(split: str, prefix: bool = True, world: int = 2) -> capture.Spec:
    torch.manual_seed(0)
    seq = Scan(1 if split == "sequence" else 2)
    x, y = torch.randn(B, S, H), torch.randn(B, S, H)

    def rank(r: int) -> capture.Step:
        local = SeqScan(r, world, prefix) if split == "sequence" else Scan(2)
        local.load_state_dict(seq.state_dict())
        for p in local.parameters():
            capture.replicate(p)
        d = 1 if split == "sequence" else 0
        n = (S if d else B) // world
        part = [slice(None)] * 3
        part[d] = slice(r * n, (r + 1) * n)
        return capture.Step(local, reduced_step, {"x": capture.shard(x[tuple(part)], d),
                                                  "y": capture.shard(y[tuple(part)], d)})

    return capture.Spec(sequential=capture.Step(seq, step, {"x": x, "y": y}), rank=rank, world_size=world,
                        name=f"cumsum_{split}{'' if prefix else '_no_prefix'}")


def test_a_running_sum_over_the_hidden_dim_with_the_batch_split_refines() -> None:
    case = capture(make_case("batch"))
    assert {"cumsum", "flip"} <= {n.op for n in case.seq.nodes}
    assert wrong_numerically(case) == set()
    assert case.check().verdict == "REFINES"


def test_a_running_sum_over_a_split_sequence_computes_the_step() -> None:
    assert wrong_numerically(capture(make_case("sequence"))) == set()


def test_a_running_sum_over_a_split_sequence_without_the_prefix_does_not_refine() -> None:
    case = capture(make_case("sequence", prefix=False))
    assert "loss" in wrong_numerically(case)
    assert case.check().verdict == "DOES NOT REFINE"


@pytest.mark.xfail(strict=True, reason="the prover does not yet relate a chunk's running sum plus the gathered "
                                       "totals before it to a slice of the whole running sum")
def test_a_running_sum_over_a_split_sequence_refines() -> None:
    assert capture(make_case("sequence")).check().verdict == "REFINES"
