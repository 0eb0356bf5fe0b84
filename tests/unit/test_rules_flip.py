"""rules/flip.py: `flip` lowered to a matmul with the exchange matrix computes torch.flip
(autograd's backward of a cumsum flips the gradient)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from refine.frontends.build import GraphBuilder, seq_doc
from refine.frontends.graphfile import load_seq
from refine.ops.interp import eval_graph
from refine.ops.lower import lower
from refine.ops.registry import load_registry

REG = load_registry()


@pytest.mark.parametrize("dtype", ["float32", "int64"])
@pytest.mark.parametrize("shape, dims", [([5], [0]), ([3, 4], [1]), ([3, 4], [0, 1]), ([2, 1, 4], [-1, 0])])
def test_flip_lowers_to_what_torch_computes(tmp_path: Path, dtype: str, shape: list[int], dims: list[int]) -> None:
    g = GraphBuilder()
    g.output("out", g.op("flip", g.input("x", shape, dtype), dims=dims))
    (tmp_path / "seq.json").write_text(json.dumps(seq_doc(g)))
    seq = load_seq(tmp_path / "seq.json", REG)
    core, rename = lower(seq, REG)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(shape, generator=gen, dtype=torch.float64) if dtype == "float32" else \
            torch.randint(-5, 5, shape, generator=gen)
        got = eval_graph(core, REG, {"x": x})[rename[seq.outputs[0].ref]]
        assert torch.equal(got.to(x.dtype), torch.flip(x, dims))
