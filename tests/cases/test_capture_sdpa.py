"""`F.scaled_dot_product_attention` captured as users call it (causal, a boolean or additive
mask, an explicit scale), and attention written out with a causal mask built inline
(`torch.triu`, compared ranges, `tril` as floats), heads split over tensor-parallel ranks: capture traces it by
torch's math backend (the fused CPU kernel's backward is one opaque aten op), whose safe
softmax asks `any` over the masked rows (rules/reduce.py). The correct step refines and
computes the sequential one; a missing all-reduce after the row-parallel output projection
does not refine, with a counterexample."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from refine import capture
from refine.frontends.build import GraphBuilder, seq_doc
from refine.frontends.graphfile import load_seq
from refine.ops.interp import close, eval_graph
from refine.ops.lower import lower
from refine.ops.registry import load_registry
from tests.helpers.capture import CopyToTP, ReduceFromTP, wrong_numerically

REG = load_registry()
B, S, H, NH = 2, 4, 16, 4
HD = H // NH


# ---------------------------------------------------------------------------------------
# `any`: lowered to a max of x != 0, it computes torch.any


@pytest.mark.parametrize("dtype", ["bool", "float32", "int64"])
@pytest.mark.parametrize("attrs", [{}, {"dim": [1]}, {"dim": [0, 2], "keepdim": True}, {"dim": [2], "keepdim": False}])
def test_any_lowers_to_what_torch_computes(tmp_path: Path, dtype: str, attrs: dict[str, Any]) -> None:
    g = GraphBuilder()
    g.output("out", g.op("any", g.input("x", [3, 1, 4], dtype), **attrs))
    (tmp_path / "seq.json").write_text(json.dumps(seq_doc(g)))
    seq = load_seq(tmp_path / "seq.json", REG)
    core, rename = lower(seq, REG)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randint(0, 3, (3, 1, 4), generator=gen) * (torch.rand(3, 1, 4, generator=gen) < 0.3)
        x = x.bool() if dtype == "bool" else x.to(getattr(torch, dtype))
        dims = attrs.get("dim") or list(range(3))
        want = x.any(dim=tuple(dims), keepdim=attrs.get("keepdim", False))
        got = eval_graph(core, REG, {"x": x})[rename[seq.outputs[0].ref]]
        assert got.dtype == torch.bool and got.shape == want.shape and close(got, want)
        assert eval_graph(seq, REG, {"x": x})[seq.outputs[0].ref].shape == want.shape


# ---------------------------------------------------------------------------------------
# a tensor-parallel attention step through SDPA


def _triu(s: torch.Tensor, diag: int) -> torch.Tensor:
    return s.masked_fill(torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=diag), float("-inf"))


def _arange(s: torch.Tensor, diag: int) -> torch.Tensor:
    i = torch.arange(S)
    return s + torch.where(i[None, :] - i[:, None] >= diag, float("-inf"), 0.0)


def _tril_float(s: torch.Tensor, diag: int) -> torch.Tensor:
    return s + (1.0 - torch.tril(torch.ones(S, S), diagonal=diag - 1)) * -1e9


# causal masks as users write them inline; `diag` 1 is causal, 0 also hides the diagonal
INLINE = {"triu": _triu, "arange": _arange, "tril_float": _tril_float}


class Attention(nn.Module):
    def __init__(self, heads: int, mask: str, tp: bool = False, bug: bool = False, bug_diag: int = 0) -> None:
        super().__init__()
        self.heads, self.mask, self.tp, self.bug, self.bug_diag = heads, mask, tp, bug, bug_diag
        self.q, self.k, self.v = (nn.Linear(H, heads * HD, bias=False) for _ in range(3))
        self.o = nn.Linear(heads * HD, H, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.tp:
            x = CopyToTP.apply(x)
        q, k, v = (p(x).view(B, S, self.heads, HD).transpose(1, 2) for p in (self.q, self.k, self.v))
        if self.mask in INLINE:  # written out, the mask built inline from constants
            scores = q @ k.transpose(-1, -2) / HD ** 0.5
            a = INLINE[self.mask](scores, 1 + self.bug_diag).softmax(-1) @ v
        elif self.mask == "causal":
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.mask == "scale":
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
        else:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = self.o(a.transpose(1, 2).reshape(B, S, self.heads * HD))
        return ReduceFromTP.apply(out) if self.tp and not self.bug else out


def step(model: Attention, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x, mask), y)
    loss.backward()
    return loss


def make_case(mask: str, world_size: int = 2, bug: bool = False, diag_bug: bool = False) -> capture.Spec:
    torch.manual_seed(0)
    seq = Attention(NH, mask)
    x, y = torch.randn(B, S, H), torch.randn(B, S, H)
    keep = torch.rand(S, S) < 0.7
    keep |= torch.eye(S, dtype=torch.bool)  # no fully masked row
    m = keep if mask == "bool" else torch.where(keep, 0.0, -1e4) if mask == "additive" else keep
    inputs = {"x": x, "y": y, "mask": m}

    def rank(r: int) -> capture.Step:
        local = Attention(NH // world_size, mask, tp=True, bug=bug, bug_diag=-1 if diag_bug else 0)
        n = NH // world_size * HD
        with torch.no_grad():
            for p in "qkv":
                getattr(local, p).weight.copy_(getattr(seq, p).weight[r * n:(r + 1) * n])
                capture.shard(getattr(local, p).weight, 0)
            local.o.weight.copy_(seq.o.weight[:, r * n:(r + 1) * n])
            capture.shard(local.o.weight, 1)
        return capture.Step(local, step, inputs)

    return capture.Spec(sequential=capture.Step(seq, step, inputs), rank=rank, world_size=world_size,
                        name=f"sdpa_{mask}{'_bug' if bug else ''}")


@pytest.mark.parametrize("mask", ["causal", "bool", "additive", "scale"])
def test_sdpa_attention_refines(mask: str) -> None:
    case = capture(make_case(mask))
    assert any(n.op == "any" for n in case.seq.nodes) or mask == "additive"
    assert wrong_numerically(case) == set()
    report = case.check()
    assert report.verdict == "REFINES", report


def test_sdpa_attention_missing_reduce_is_found() -> None:
    case = capture(make_case("causal", bug=True))
    assert "loss" in wrong_numerically(case)
    report = case.check()
    assert report.verdict == "DOES NOT REFINE", report
    assert report.search is not None and report.search.found is not None


@pytest.mark.parametrize("mask", sorted(INLINE))
def test_an_inline_causal_mask_refines(mask: str) -> None:
    """The mask is computed from constants alone (torch.triu, arange compared, tril as
    floats), the same on every rank."""
    case = capture(make_case(mask))
    assert wrong_numerically(case) == set()
    assert case.check().verdict == "REFINES"


@pytest.mark.parametrize("mask", sorted(INLINE))
def test_ranks_that_also_hide_the_diagonal_do_not_refine(mask: str) -> None:
    case = capture(make_case(mask, diag_bug=True))
    assert "loss" in wrong_numerically(case)
    assert case.check().verdict == "DOES NOT REFINE"
