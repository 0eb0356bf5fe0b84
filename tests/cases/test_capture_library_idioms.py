"""Idioms model libraries use, captured from plain PyTorch programs: a vocab-parallel lookup
written with clamped ids and the in-range mask as a number (torchtitan's `Embedding`), an
attention module that picks its own SDPA backends (torchtitan's `ScaledDotProductAttention`),
and a write by integer indices without accumulation (refused at the program's line)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from refine import capture
from refine.frontends.capture import CaptureError

V, H, T = 16, 4, 6


class Lookup(nn.Module):
    """A table, then a linear layer, both trained."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(V, H))
        self.fc = nn.Linear(H, H)


def seq_step(model: Lookup, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model.fc(F.embedding(ids, model.table)), target)
    loss.backward()
    return loss


class _SumOverRanks(torch.autograd.Function):
    """The ranks' pieces summed; each piece's gradient is the sum's (Megatron's reduce region)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x, "sum", dist.group.WORLD)

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        return g


def clamped_lookup(table: torch.Tensor, ids: torch.Tensor, off_by_one: bool = False) -> torch.Tensor:
    """This rank's rows [lo, lo + n) of the table: ids clamped into them, rows of other ids zeroed
    by the in-range mask as a number; the ranks' pieces summed."""
    n = table.shape[0]
    lo = dist.get_rank() * n
    hi = lo + n + (1 if off_by_one else 0)  # the twin: one id past the rank's rows counts as its own
    inside = (ids >= lo) & (ids < hi)
    out = F.embedding((ids - lo).clamp(0, n - 1), table) * inside.unsqueeze(-1).to(table.dtype)
    return _SumOverRanks.apply(out)


def make_lookup_case(world_size: int, off_by_one: bool = False) -> capture.Spec:
    torch.manual_seed(0)
    seq = Lookup()
    ids, target = torch.randint(0, V, (2, T)), torch.randn(2, T, H)

    def rank_step(model: Lookup, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model.fc(clamped_lookup(model.table, ids, off_by_one)), target)
        loss.backward()
        return loss

    def rank(r: int) -> capture.Step:
        model = Lookup()
        model.load_state_dict(seq.state_dict())
        rows = V // world_size
        model.table = nn.Parameter(seq.table[r * rows:(r + 1) * rows].detach().clone())
        capture.shard(model.table, 0)
        for name in ("fc.weight", "fc.bias", "ids", "target"):
            capture.replicate(name)
        return capture.Step(model, rank_step, {"ids": ids, "target": target})

    return capture.Spec(capture.Step(seq, seq_step, {"ids": ids, "target": target}), rank, world_size=world_size,
                        name=f"clamped_lookup{world_size}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_clamped_vocab_parallel_lookup_refines(world_size: int) -> None:
    """The lookup and the table's gradient (each rank's rows of torch's embedding backward of
    its own lookup) both relate: the gradient is the concat of the ranks'."""
    report = capture(make_lookup_case(world_size)).check()
    assert report.verdict == "REFINES", report
    grad = next(o for o in report.outputs if o.name == "table.grad")
    assert grad.relation.startswith("cat("), grad.relation


def test_clamped_lookup_with_a_wrong_bound_does_not_refine() -> None:
    report = capture(make_lookup_case(2, off_by_one=True)).check()
    assert report.verdict == "DOES NOT REFINE", report


class Attention(nn.Module):
    """Causal self-attention whose module picks SDPA backends itself, in priority order."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(1, T, 3, 2, 4).permute(2, 0, 3, 1, 4)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH], set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def test_an_attention_module_choosing_fused_backends_is_traced_by_the_math_backend() -> None:
    torch.manual_seed(0)
    model, x = Attention(), torch.randn(1, T, 8)

    def step(m: Attention, x: torch.Tensor) -> torch.Tensor:
        loss = m(x)
        loss.backward()
        return loss

    def rank(r: int) -> capture.Step:
        for name in ("qkv.weight", "qkv.bias", "x"):
            capture.replicate(name)
        return capture.Step(model, step, {"x": x})

    case = capture(capture.Spec(capture.Step(model, step, {"x": x}), rank, world_size=1, name="attn"))
    assert case.check().verdict == "REFINES"
    ops = {n["op"] for n in case.seq_doc["graph"]["nodes"]}
    assert not any("flash" in op or "attention" in op for op in ops), ops


def test_a_write_by_integer_indices_is_refused_at_its_line() -> None:
    torch.manual_seed(0)
    w, rows = nn.Parameter(torch.randn(4, 3)), torch.tensor([0, 2, 2])

    def step(m: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        x = torch.zeros(4, 3)
        x[rows, torch.tensor([0, 1, 2])] = 1.0  # rows repeat: which write wins is unspecified
        loss = (m.w * x).sum()
        loss.backward()
        return loss

    model = nn.Module()
    model.w = w

    def rank(r: int) -> capture.Step:
        capture.replicate("w")
        capture.replicate("rows")
        return capture.Step(model, step, {"rows": rows})

    with pytest.raises(CaptureError, match="without accumulate") as e:
        capture(capture.Spec(capture.Step(model, step, {"rows": rows}), rank, world_size=1, name="put"))
    assert "test_capture_library_idioms.py" in str(e.value)
