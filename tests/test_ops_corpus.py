"""The framework ops of the external corpus (apex fused layer norm, XLA HLO ops of AWS
transformers-neuronx, vLLM custom ops, torchgraph's logging hook) as refine ops:

1. each op's decomposition into core ops, lowered by refine, computes what its torch
   reference does, on random inputs of several shapes (size-1 dims included);
2. its shape rule gives the reference's output shapes;
3. where the corpus uses it on a sharded operand in a provable way, a small sequential /
   distributed pair refines (and, with its collective left out, does not);
4. every call target of the corpus is covered by the capture op table, one of these ops, or
   a named, explained allow-list entry.
"""

from __future__ import annotations

import collections
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from refine.build import GraphBuilder, dist_doc, seq_doc
from refine.capture import aten
from refine.check import check
from refine.evaluate import audit, close, eval_graph
from refine.format import load_dist, load_seq
from refine.normalize import lower
from refine.opset import load_registry

REG = load_registry()
CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "entangle"

# ---------------------------------------------------------------------------------------
# 1 + 2: decompositions and shape rules


Build = Callable[[GraphBuilder], None]


def _seq(tmp_path: Path, build: Build) -> Any:
    g = GraphBuilder()
    build(g)
    tmp_path.mkdir(parents=True, exist_ok=True)
    p = tmp_path / "seq.json"
    p.write_text(json.dumps(seq_doc(g)))
    return load_seq(p, REG)


def _values(seq: Any, seed: int, ints: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in seq.inputs:
        shape = tuple(i.type.shape)
        if i.type.dtype == "bool":
            out[i.name] = torch.rand(shape, generator=gen) < 0.5
        elif i.type.dtype.startswith("int"):
            lo, hi = ints[i.name]
            out[i.name] = torch.randint(lo, hi, shape, generator=gen)
        else:
            out[i.name] = torch.randn(shape, generator=gen, dtype=torch.float64)
    return out


def _faithful(tmp_path: Path, build: Build, ints: dict[str, tuple[int, int]] | None = None) -> set[str]:
    """Every node's reference value has the node's shape (the shape rule's), and every
    output of the lowered graph equals it; returns the core ops the lowering used."""
    seq = _seq(tmp_path, build)
    core, rename = lower(seq, REG)
    for seed in range(3):
        vals = _values(seq, seed, ints or {})
        user = eval_graph(seq, REG, vals)
        for n in seq.nodes:
            assert tuple(user[n.name].shape) == tuple(n.type.shape), (n.name, n.op)
        low = eval_graph(core, REG, vals)
        for o in seq.outputs:
            a, b = user[o.ref], low[rename[o.ref]]
            assert a.shape == b.shape and close(a, b), f"{o.name}: lowering differs from the reference"
    ops = {n.op for n in core.nodes}
    assert all(REG.ops[o].core or REG.ops[o].kind == "collective" for o in ops), ops
    return ops


@pytest.mark.parametrize("shape, ns", [([3, 4], [4]), ([2, 1, 5], [5]), ([2, 3, 4], [3, 4]), ([1, 1, 3], [3]),
                                       ([4, 1], [1])])
def test_apex_layer_norm(tmp_path: Path, shape: list[int], ns: list[int]) -> None:
    n1 = math.prod(shape[:len(shape) - len(ns)])

    def build(g: GraphBuilder) -> None:
        x, w, b = g.input("x", shape), g.input("w", ns), g.input("b", ns)
        g.output("y", g.op("apex_layer_norm", x, w, b, normalized_shape=ns, eps=1e-5))
        g.output("y_noaffine", g.op("apex_layer_norm", x, normalized_shape=ns, eps=1e-3))
        mean = g.op("apex_layer_norm_mean", x, normalized_shape=ns, eps=1e-5)
        invvar = g.op("apex_layer_norm_invvar", x, normalized_shape=ns, eps=1e-5)
        g.output("mean", mean)
        g.output("invvar", invvar)
        dy = g.input("dy", shape)
        g.output("dx", g.op("apex_layer_norm_grad_input", dy, mean, invvar, x, w, normalized_shape=ns))
        g.output("dw", g.op("apex_layer_norm_grad_weight", dy, mean, invvar, x, normalized_shape=ns))
        g.output("db", g.op("apex_layer_norm_grad_bias", dy, normalized_shape=ns))
        # the statistics as free inputs: the backward reads them, it does not recompute them
        m, r = g.input("m", [n1]), g.input("r", [n1])
        g.output("dx_free", g.op("apex_layer_norm_grad_input", dy, m, r, x, w, normalized_shape=ns))
        g.output("dw_free", g.op("apex_layer_norm_grad_weight", dy, m, r, x, normalized_shape=ns))

    _faithful(tmp_path, build)


def test_apex_backward_is_layer_norm_autograd(tmp_path: Path) -> None:
    """The apex backward ops, fed the forward's statistics, are torch autograd of layer_norm."""
    x = torch.randn(3, 2, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(3, 2, 5, dtype=torch.float64)
    torch.nn.functional.layer_norm(x, (5,), w, b, 1e-5).backward(dy)
    refs = {n: REG.ops[f"apex_layer_norm_{n}"].ref for n in ("mean", "invvar", "grad_input", "grad_weight",
                                                               "grad_bias")}
    xd = x.detach()
    mean, invvar = refs["mean"](xd, normalized_shape=(5,)), refs["invvar"](xd, normalized_shape=(5,), eps=1e-5)
    assert mean.shape == invvar.shape == (6,)
    assert close(refs["grad_input"](dy, mean, invvar, xd, w.detach(), normalized_shape=(5,)), x.grad)
    assert close(refs["grad_weight"](dy, mean, invvar, xd, normalized_shape=(5,)), w.grad)
    assert close(refs["grad_bias"](dy, normalized_shape=(5,)), b.grad)


@pytest.mark.parametrize("shape, dim", [([6, 3, 2], 0), ([4, 1, 2], 0), ([3, 5], 1), ([2, 4, 3], 1), ([1, 1], 0)])
def test_hlo_rms_norm(tmp_path: Path, shape: list[int], dim: int) -> None:
    def build(g: GraphBuilder) -> None:
        x, w = g.input("x", shape), g.input("w", [shape[dim]])
        g.output("y", g.op("hlo_rms_norm", x, w, eps=1e-5, dim=dim))

    assert "rms_norm_c" in _faithful(tmp_path, build)


@pytest.mark.parametrize("shape, bd, out", [([4, 3], [0, 3], [4, 2, 1, 3]), ([5], [1], [5, 5]), ([5], [0], [5, 2]),
                                            ([3, 1], [2, 0], [2, 4, 3]), ([1, 2], [0, 1], [3, 2]), ([], [], [2, 3])])
def test_hlo_broadcast(tmp_path: Path, shape: list[int], bd: list[int], out: list[int]) -> None:
    def build(g: GraphBuilder) -> None:
        g.output("y", g.op("hlo_broadcast", g.input("x", shape), broadcast_dimensions=bd, shape=out))

    _faithful(tmp_path, build)


DOTS = [  # lhs, rhs, lc, rc, lb, rb (the corpus's forms, and more)
    ([6, 4], [6, 5], [0], [0], [], []),
    ([4, 6], [5, 6], [1], [1], [], []),
    ([3, 1], [1, 2], [1], [0], [], []),
    ([2, 3, 4, 4], [4, 2, 3, 5], [3], [0], [0, 1], [1, 2]),
    ([4, 2, 3, 5], [4, 2, 3, 5], [3], [3], [1, 2], [1, 2]),
    ([2, 3, 4], [3, 4, 5], [1, 2], [0, 1], [], []),
    ([1, 3, 2], [2, 1, 3], [1], [2], [0], [1]),
]


@pytest.mark.parametrize("l, r, lc, rc, lb, rb", DOTS)
def test_hlo_dot(tmp_path: Path, l: list[int], r: list[int], lc: list[int], rc: list[int], lb: list[int],
                 rb: list[int]) -> None:
    def build(g: GraphBuilder) -> None:
        a, b = g.input("a", l), g.input("b", r)
        g.output("y", g.op("hlo_dot", a, b, lhs_contracting_dims=lc, rhs_contracting_dims=rc, lhs_batch_dims=lb,
                           rhs_batch_dims=rb))

    assert "matmul" in _faithful(tmp_path, build)


@pytest.mark.parametrize("shape, d, idx, offset", [([5, 3, 2], 0, [1], [1, 2]), ([5, 3, 2], 0, [4], [0, 1]),
                                                   ([3, 6, 2], 1, [2, 2], [0, 3]), ([4, 1], 1, [3], [0])])
def test_hlo_gather(tmp_path: Path, shape: list[int], d: int, idx: list[int], offset: list[int]) -> None:
    sizes = [1 if i == d else s for i, s in enumerate(shape)]

    def build(g: GraphBuilder) -> None:
        x, i = g.input("x", shape), g.input("i", idx, "int32")
        g.output("y", g.op("hlo_gather", x, i, offset_dims=offset, collapsed_slice_dims=[d], start_index_map=[d],
                           index_vector_dim=len(idx), slice_sizes=sizes))

    # indices out of range on both sides: XLA clamps them
    _faithful(tmp_path, build, {"i": (-2, shape[d] + 2)})


@pytest.mark.parametrize("shape", [[3, 4], [1, 1, 5], [2, 3, 1]])
def test_hlo_elementwise_and_reduce(tmp_path: Path, shape: list[int]) -> None:
    def build(g: GraphBuilder) -> None:
        x, y, p = g.input("x", shape), g.input("y", shape), g.input("p", shape, "bool")
        g.output("sig", g.op("hlo_logistic", x))
        g.output("sel", g.op("hlo_select", p, x, y))
        g.output("max_last", g.op("hlo_reduce_max", x, dims=len(shape) - 1))
        g.output("max_two", g.op("hlo_reduce_max", x, dims=[0, len(shape) - 1]))

    _faithful(tmp_path, build)


@pytest.mark.parametrize("shape", [[4, 6], [1, 3], [2, 1, 4]])
def test_vllm_norms_and_silu(tmp_path: Path, shape: list[int]) -> None:
    def build(g: GraphBuilder) -> None:
        x, res, w = g.input("x", shape), g.input("res", shape), g.input("w", shape[-1:])
        g.output("rms", g.op("vllm_rms_norm", x, w, eps=1e-6))
        g.output("fused", g.op("vllm_fused_add_rms_norm", x, res, w, eps=1e-6))
        g.output("residual", g.op("vllm_fused_add_rms_norm_residual", x, res))
        g.output("silu_mul", g.op("vllm_silu_and_mul", g.op("concat", x, res, dim=-1)))

    _faithful(tmp_path, build)


@pytest.mark.parametrize("t, heads, hs, rot, neox, three_d", [
    (5, 3, 4, 4, True, False), (5, 2, 4, 4, False, False), (1, 1, 6, 4, True, False), (3, 2, 6, 2, False, True),
    (4, 1, 2, 2, True, True)])
def test_vllm_rotary_embedding(tmp_path: Path, t: int, heads: int, hs: int, rot: int, neox: bool,
                               three_d: bool) -> None:
    positions = 7

    def build(g: GraphBuilder) -> None:
        pos = g.input("pos", [t], "int64")
        x = g.input("x", [t, heads, hs] if three_d else [t, heads * hs])
        cache = g.input("cache", [positions, rot])
        g.output("y", g.op("vllm_rotary_embedding", pos, x, cache, head_size=hs, is_neox=neox))

    _faithful(tmp_path, build, {"pos": (0, positions)})


def test_vllm_rotary_is_a_rotation() -> None:
    """Each pair is rotated by the position's angle: norms are kept, and angle 0 is the identity."""
    ref = REG.ops["vllm_rotary_embedding"].ref
    theta = torch.rand(4, 3, dtype=torch.float64)
    cache = torch.cat([theta.cos(), theta.sin()], -1)
    x = torch.randn(2, 2 * 6, dtype=torch.float64)
    pos = torch.tensor([0, 3])
    for neox in (True, False):
        y = ref(pos, x, cache, head_size=6, is_neox=neox)
        pairs = (lambda z: torch.stack(z.reshape(2, 2, 6).chunk(2, -1), -1)) if neox else \
            (lambda z: z.reshape(2, 2, 3, 2))
        assert close(pairs(y).norm(dim=-1), pairs(x).norm(dim=-1))
    zero = torch.cat([torch.ones(1, 3), torch.zeros(1, 3)], -1).double()
    assert close(ref(torch.tensor([0, 0]), x, zero, head_size=6, is_neox=True), x)


@pytest.mark.parametrize("t, heads, kv, d", [(5, 4, 2, 3), (1, 2, 1, 2), (4, 3, 3, 1), (3, 3, 1, 4)])
def test_vllm_attention(tmp_path: Path, t: int, heads: int, kv: int, d: int) -> None:
    def build(g: GraphBuilder) -> None:
        q, k, v = g.input("q", [t, heads, d]), g.input("k", [t, kv, d]), g.input("v", [t, kv, d])
        g.output("y", g.op("vllm_attention", q, k, v, scale=d ** -0.5))

    _faithful(tmp_path, build)


def test_vllm_attention_matches_torch_sdpa() -> None:
    ref = REG.ops["vllm_attention"].ref
    q, k, v = (torch.randn(6, h, 4, dtype=torch.float64) for h in (4, 2, 2))
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        is_causal=True).transpose(0, 1)
    assert close(ref(q, k, v, scale=0.5), want)


def test_tg_log_tensor_is_the_identity(tmp_path: Path) -> None:
    def build(g: GraphBuilder) -> None:
        g.output("y", g.op("tg_log_tensor", g.input("x", [3, 2]), name="tokens"))

    seq = _seq(tmp_path, build)
    core, rename = lower(seq, REG)
    assert not core.nodes and rename[seq.outputs[0].ref] == "x"
