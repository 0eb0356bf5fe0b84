"""rules/scan.py: `cumsum` lowered to a matmul with a triangular matrix of ones computes
torch.cumsum, over every dim, for floating, integer and boolean inputs."""

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


@pytest.mark.parametrize("dtype", ["float32", "int64", "bool"])
@pytest.mark.parametrize("shape, dim", [([5], 0), ([3, 4], 1), ([3, 4], -2), ([2, 1, 4], 1), ([2, 3, 4], 0)])
def test_cumsum_lowers_to_what_torch_computes(tmp_path: Path, dtype: str, shape: list[int], dim: int) -> None:
    g = GraphBuilder()
    g.output("out", g.op("cumsum", g.input("x", shape, dtype), dim=dim))
    (tmp_path / "seq.json").write_text(json.dumps(seq_doc(g)))
    seq = load_seq(tmp_path / "seq.json", REG)
    core, rename = lower(seq, REG)
    assert {n.op for n in core.nodes} & {"matmul"}, "a cumsum is a matmul with the triangular ones"
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        if dtype == "float32":
            x = torch.randn(shape, generator=gen, dtype=torch.float64)
        else:
            x = torch.randint(-3, 4, shape, generator=gen)
            x = x > 0 if dtype == "bool" else x
        want = torch.cumsum(x, dim)
        got = eval_graph(core, REG, {"x": x})[rename[seq.outputs[0].ref]]
        assert seq.nodes[-1].type.dtype == ("float32" if dtype == "float32" else "int64")
        assert got.shape == want.shape and torch.allclose(got.double(), want.double())

