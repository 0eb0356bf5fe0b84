"""Advanced indexing by several integer tensors, or over a later dim (`t[i, j]`, `t[:, i, j]`,
`t[i, :, j]`, broadcast index shapes; HF transformers' masks look up packed-sequence ids
this way) and its backward (`index_put` with accumulation), captured: each pattern is one
row lookup over the indexed dims merged (refine.frontends.capture.aten._Rows). Capture
replays the translated step against the real one in float64, so a wrong layout fails there;
the step, on replicated ranks and on ranks that split a batch of lookups, refines."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from refine import capture
from tests.helpers.capture import wrong_numerically

N = 8  # every indexed dim: the search draws integer inputs below 8
Index = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
PATTERNS: dict[str, Index] = {
    "first_two": lambda t, i, j: t[i, j],  # [K, 3]
    "after_a_slice": lambda t, i, j: t.permute(2, 0, 1)[:, i, j].t(),  # [3, K] -> [K, 3]
    "apart": lambda t, i, j: t.permute(0, 2, 1)[i, :, j],  # [K, 3]
    "broadcast": lambda t, i, j: t[i[:, None], j[None, :]].sum(1),  # [K, K, 3] -> [K, 3]
    "three": lambda t, i, j: t.reshape(N, 2, 4, 3)[i, j.clamp(0, 1), j.clamp(0, 3)],  # three tensors, [K, 3]
}


class Table(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.randn(N, N, 3))


def make_case(pattern: str, split: bool) -> capture.Spec:
    torch.manual_seed(0)
    seq = Table()
    i, j, y = torch.randint(0, N, (4,)), torch.randint(0, N, (4,)), torch.randn(4, 3)
    look = PATTERNS[pattern]

    def step(model: Table, i: torch.Tensor, j: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(look(model.t, i, j), y, reduction="sum")
        loss.backward()
        return loss

    def split_step(model: Table, i: torch.Tensor, j: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = step(model, i, j, y)  # each rank looked up half the batch: gradients and loss are summed
        dist.all_reduce(model.t.grad)
        dist.all_reduce(loss)
        return loss

    def rank(r: int) -> capture.Step:
        local = Table()
        with torch.no_grad():
            local.t.copy_(seq.t)
        capture.replicate(local.t)
        if not split:
            return capture.Step(local, step, {"i": i, "j": j, "y": y})
        part = slice(2 * r, 2 * r + 2)
        return capture.Step(local, split_step, {"i": capture.shard(i[part], 0), "j": capture.shard(j[part], 0),
                                          "y": capture.shard(y[part], 0)})

    return capture.Spec(sequential=capture.Step(seq, step, {"i": i, "j": j, "y": y}), rank=rank, world_size=2,
                        name=f"index_{pattern}")


@pytest.mark.parametrize("pattern, split", [(p, s) for p in sorted(PATTERNS) for s in (False, True)
                                            if not (s and p == "broadcast")])
def test_advanced_indexing_captures_and_refines(pattern: str, split: bool) -> None:
    case = capture(make_case(pattern, split))
    assert wrong_numerically(case) == set()
    report = case.check()
    assert report.verdict == "REFINES", report


def test_a_batch_split_that_loses_cross_terms_does_not_refine() -> None:
    """t[i[:, None], j[None, :]] pairs every i with every j: ranks that each pair only their
    own halves miss the cross pairs."""
    case = capture(make_case("broadcast", True))
    assert wrong_numerically(case) == {"loss", "t.grad"}
    report = case.check()
    assert report.verdict == "DOES NOT REFINE", report


def test_a_boolean_mask_index_is_refused() -> None:
    class Masked(Table):
        pass

    def step(model: Table, m: torch.Tensor) -> torch.Tensor:
        loss = model.t[m].sum()
        loss.backward()
        return loss

    m = torch.rand(N, N) < 0.5
    spec = capture.Spec(sequential=capture.Step(Masked(), step, {"m": m}),
                        rank=lambda r: capture.Step(Masked(), step, {"m": m}), world_size=2)
    with pytest.raises(capture.CaptureError, match="bool"):
        capture(spec)


# ---------------------------------------------------------------------------------------
# writes through a boolean mask: x[mask] = v where v is the same for every selected element
# or row is a `where` (a masked_fill for a constant), no size depending on the data

PUTS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "scalar": lambda t, m, row: _put(t, m, lambda u: u.__setitem__(m, 0.0)),
    "rows": lambda t, m, row: _put(t, m[:, 0], lambda u: u.__setitem__((m[:, 0], slice(None)), 0.0)),
    "one_row": lambda t, m, row: _put(t, m[:, 0], lambda u: u.__setitem__(m[:, 0], row)),
    "accumulate": lambda t, m, row: t.index_put((m,), torch.tensor(2.0), accumulate=True),
}


def _put(t: torch.Tensor, m: torch.Tensor, write: Callable[[torch.Tensor], None]) -> torch.Tensor:
    u = t.clone()
    write(u)
    return u


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))
        # a buffer: the gradient of a row written through a mask reads the mask's rows (x[mask])
        self.register_buffer("row", torch.randn(3))


def make_put_case(put: str) -> capture.Spec:
    torch.manual_seed(0)
    seq = Masked()
    x, y = torch.randn(4, 3), torch.randn(4, 3)

    def step(model: Masked, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(PUTS[put](model.w * x, x > 0, model.row), y)
        loss.backward()
        return loss

    def rank(r: int) -> capture.Step:
        local = Masked()
        local.load_state_dict(seq.state_dict())
        for t in (local.w, local.row):
            capture.replicate(t)
        return capture.Step(local, step, {"x": x, "y": y})

    return capture.Spec(capture.Step(seq, step, {"x": x, "y": y}), rank, world_size=2, name=f"put_{put}")


@pytest.mark.parametrize("put", sorted(PUTS))
def test_a_write_through_a_boolean_mask_captures_and_refines(put: str) -> None:
    case = capture(make_put_case(put))  # capture's float64 replay checks the translation
    assert not {n.op for n in case.seq.nodes} & {"index_put", "index_rows"}
    assert case.check().verdict == "REFINES"
