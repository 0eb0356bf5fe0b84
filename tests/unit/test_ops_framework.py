"""The framework ops of the external corpus (apex fused layer norm, XLA HLO ops of AWS
transformers-neuronx, vLLM custom ops, torchgraph's logging hook) as refine ops:

1. each op's decomposition into core ops, lowered by refine, computes what its torch
   reference does, on random inputs of several shapes (size-1 dims included);
2. its shape rule gives the reference's output shapes;
3. where the corpus uses it on a sharded operand in a provable way, a small sequential /
   distributed pair refines (and, with its collective left out, does not);
4. every call target of the corpus is covered by the capture op table, one of these ops, or
   a named, explained allow-list entry (the tables here; the corpus is read by
   tests/corpus/test_gpickle.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from refine.check import check
from refine.frontends.build import GraphBuilder, dist_doc, seq_doc
from refine.frontends.capture import aten
from refine.frontends.graphfile import load_dist, load_seq
from refine.ir import sizes
from refine.ops.interp import close, eval_graph
from refine.ops.lower import lower
from refine.ops.registry import load_registry
from refine.oracle.differential import audit

REG = load_registry()

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


@pytest.mark.parametrize("lhs, rhs, lc, rc, lb, rb", DOTS)
def test_hlo_dot(tmp_path: Path, lhs: list[int], rhs: list[int], lc: list[int], rc: list[int], lb: list[int],
                 rb: list[int]) -> None:
    def build(g: GraphBuilder) -> None:
        a, b = g.input("a", lhs), g.input("b", rhs)
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


# ---------------------------------------------------------------------------------------
# 3: the corpus's sharded uses, as small pairs that refine (and, missing a collective, not)

Case = tuple[GraphBuilder, dict[int, GraphBuilder], list[dict[str, Any]], list[dict[str, Any]]]


def _check(tmp_path: Path, case: Case, ints: int | None = None) -> Any:
    s, ranks, rel, exp = case
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "seq.json").write_text(json.dumps(seq_doc(s)))
    (tmp_path / "dist.json").write_text(json.dumps(dist_doc({"tp": len(ranks)}, ranks, rel, exp)))
    seq = load_seq(tmp_path / "seq.json", REG)
    dist = load_dist(tmp_path / "dist.json", REG, seq)
    report = check(seq, dist, REG)
    bad = audit(seq, dist, REG, seed=1, int_bound=ints)
    assert not bad, [f"{m.tensor}: {m.relation} ({m.detail})" for m in bad]
    return report


def _pair(program: Callable[[GraphBuilder, int | None], None], rel: list[dict[str, Any]],
          exp: list[dict[str, Any]], n: int = 2) -> Case:
    s = GraphBuilder()
    program(s, None)
    ranks = {}
    for r in range(n):
        ranks[r] = GraphBuilder()
        program(ranks[r], r)
    return s, ranks, rel, exp


def _failing(report: Any) -> set[str]:
    return {o.name for o in report.outputs if not o.ok}


def test_hlo_rms_norm_hidden_first_with_tokens_sharded(tmp_path: Path) -> None:
    """aws_llama's AwsNeuronRmsNorm normalises dim 0 of [hidden, tokens, batch]: with the
    tokens split across ranks and the weight replicated, each rank's norm is its piece."""
    H, T, B = 6, 4, 2

    def program(g: GraphBuilder, r: int | None) -> None:
        x, w = g.input("x", [H, T if r is None else T // 2, B]), g.input("w", [H], role="parameter")
        g.output("y", g.op("hlo_rms_norm", x, w, eps=1e-5, dim=0))

    report = _check(tmp_path, _pair(program, [{"from": "x", "placements": ["Shard(1)"]},
                                              {"from": "w", "placements": ["Replicate"]}],
                                    [{"output": "y", "placements": ["Shard(1)"]}]))
    assert report.refines, str(report)


def test_vllm_rms_norms_with_rows_sharded(tmp_path: Path) -> None:
    T, H = 4, 6

    def program(g: GraphBuilder, r: int | None) -> None:
        t = T if r is None else T // 2
        x, res, w = g.input("x", [t, H]), g.input("res", [t, H]), g.input("w", [H], role="parameter")
        g.output("y", g.op("vllm_fused_add_rms_norm", x, res, w, eps=1e-6))
        g.output("res_out", g.op("vllm_fused_add_rms_norm_residual", x, res))
        g.output("z", g.op("vllm_rms_norm", x, w, eps=1e-6))

    rel = [{"from": "x", "placements": ["Shard(0)"]}, {"from": "res", "placements": ["Shard(0)"]},
           {"from": "w", "placements": ["Replicate"]}]
    exp = [{"output": o, "placements": ["Shard(0)"]} for o in ("y", "res_out", "z")]
    report = _check(tmp_path, _pair(program, rel, exp))
    assert report.refines, str(report)


def _dot_row_parallel(bug: bool) -> Case:
    """aws_llama's output projection: hlo.dot of [tokens, F/n] and [H, F/n] contracting the
    sharded F (dims 1 and 1), then the all-reduce: the sum of the partial products."""
    T, F, H = 3, 4, 5

    def program(g: GraphBuilder, r: int | None) -> None:
        f = F if r is None else F // 2
        a, w = g.input("a", [T, f]), g.input("w", [H, f], role="parameter")
        y = g.op("hlo_dot", a, w, lhs_contracting_dims=[1], rhs_contracting_dims=[1], lhs_batch_dims=[],
                 rhs_batch_dims=[])
        if r is not None and not bug:
            y = g.op("all_reduce", y, reduce_op="sum", group=[0, 1])
        g.output("y", y)

    return _pair(program, [{"from": "a", "placements": ["Shard(1)"]}, {"from": "w", "placements": ["Shard(1)"]}],
                 [{"output": "y", "placements": ["Replicate"]}])


def test_hlo_dot_with_the_contraction_dim_sharded(tmp_path: Path) -> None:
    good = _check(tmp_path / "good", _dot_row_parallel(False))
    assert good.refines, str(good)
    bug = _check(tmp_path / "bug", _dot_row_parallel(True))
    assert _failing(bug) == {"y"}, str(bug)


def test_hlo_dot_column_parallel_hidden_first(tmp_path: Path) -> None:
    """aws_llama's MLP up projection: [H, tokens] x [H, F/n] contracting dim 0 of both
    (hidden first, replicated): each rank holds its columns of the [tokens, F] result."""
    H, T, F = 4, 3, 6

    def program(g: GraphBuilder, r: int | None) -> None:
        x, w = g.input("x", [H, T]), g.input("w", [H, F if r is None else F // 2], role="parameter")
        y = g.op("hlo_dot", x, w, lhs_contracting_dims=[0], rhs_contracting_dims=[0], lhs_batch_dims=[],
                 rhs_batch_dims=[])
        g.output("y", g.op("mul", g.op("hlo_logistic", y), y))

    report = _check(tmp_path, _pair(program, [{"from": "x", "placements": ["Replicate"]},
                                              {"from": "w", "placements": ["Shard(1)"]}],
                                    [{"output": "y", "placements": ["Shard(1)"]}]))
    assert report.refines, str(report)


def _apex_sp(bug: bool) -> Case:
    """Megatron sequence parallelism (the corpus's bug_missing_layernorm_allreduce): the
    apex layer norm runs on token shards [S/n, B, H]; its weight/bias grads sum over the
    tokens, so they need an all-reduce over the group; the input grad stays sharded."""
    S, B, H = 4, 2, 3

    def program(g: GraphBuilder, r: int | None) -> None:
        s = S if r is None else S // 2
        x, dy = g.input("x", [s, B, H]), g.input("dy", [s, B, H])
        w, b = g.input("w", [H], role="parameter"), g.input("b", [H], role="parameter")
        g.output("y", g.op("apex_layer_norm", x, w, b, normalized_shape=[H], eps=1e-5))
        mean = g.op("apex_layer_norm_mean", x, normalized_shape=[H], eps=1e-5)
        invvar = g.op("apex_layer_norm_invvar", x, normalized_shape=[H], eps=1e-5)
        dx = g.op("apex_layer_norm_grad_input", dy, mean, invvar, x, w, normalized_shape=[H])
        dw = g.op("apex_layer_norm_grad_weight", dy, mean, invvar, x, normalized_shape=[H])
        db = g.op("apex_layer_norm_grad_bias", dy, normalized_shape=[H])
        if r is not None:
            db = g.op("all_reduce", db, reduce_op="sum", group=[0, 1])
            if not bug:
                dw = g.op("all_reduce", dw, reduce_op="sum", group=[0, 1])
        g.output("dx", dx, role="gradient", of="x")
        g.output("dw", dw, role="gradient", of="w")
        g.output("db", db, role="gradient", of="b")

    rel = [{"from": "x", "placements": ["Shard(0)"]}, {"from": "dy", "placements": ["Shard(0)"]},
           {"from": "w", "placements": ["Replicate"]}, {"from": "b", "placements": ["Replicate"]}]
    exp = [{"output": "y", "placements": ["Shard(0)"]}, {"output": "dx", "placements": ["Shard(0)"]},
           {"output": "dw", "placements": ["Replicate"]}, {"output": "db", "placements": ["Replicate"]}]
    return _pair(program, rel, exp)


def test_apex_layer_norm_under_sequence_parallelism(tmp_path: Path) -> None:
    good = _check(tmp_path / "good", _apex_sp(False))
    assert good.refines, str(good)
    bug = _check(tmp_path / "bug", _apex_sp(True))
    assert _failing(bug) == {"dw"}, str(bug)


def test_vllm_silu_and_mul_on_fused_gate_up_shards(tmp_path: Path) -> None:
    """qwen2's MLP: each rank's fused gate/up projection holds [gate_r | up_r]; silu_and_mul
    of it is rank r's columns of the sequential silu(gate) * up."""
    T, F = 3, 8  # F: gate and up, 4 each; 2 per rank
    h = F // 4

    def program(g: GraphBuilder, r: int | None) -> None:
        x = g.input("gu", [T, F if r is None else F // 2])
        g.output("y", g.op("vllm_silu_and_mul", x))

    parts = [f"slice(gu@{r}, 1, {k * h}, {(k + 1) * h})" for k in (0, 1) for r in (0, 1)]
    layout = f"cat({parts[0]}, {parts[1]}, {parts[2]}, {parts[3]}, dim=1)"
    report = _check(tmp_path, _pair(program, [{"from": "gu", "layout": layout}],
                                    [{"output": "y", "placements": ["Shard(1)"]}]))
    assert report.refines, str(report)


def test_vllm_rotary_with_heads_sharded(tmp_path: Path) -> None:
    """qwen2's rotary embedding: query/key heads split across ranks (one kv head per rank,
    as in the corpus's TP2), positions and cache replicated: each rank rotates its heads."""
    T, NH, NKV, D, P = 4, 4, 2, 4, 6

    def program(g: GraphBuilder, r: int | None) -> None:
        n = 1 if r is None else 2
        pos, cache = g.input("pos", [T], "int64"), g.input("cache", [P, D])
        q, k = g.input("q", [T, NH // n * D]), g.input("k", [T, NKV // n * D])
        g.output("qr", g.op("vllm_rotary_embedding", pos, q, cache, head_size=D, is_neox=True))
        g.output("kr", g.op("vllm_rotary_embedding", pos, k, cache, head_size=D, is_neox=False))

    rel = [{"from": "pos", "placements": ["Replicate"]}, {"from": "cache", "placements": ["Replicate"]},
           {"from": "q", "placements": ["Shard(1)"]}, {"from": "k", "placements": ["Shard(1)"]}]
    exp = [{"output": "qr", "placements": ["Shard(1)"]}, {"output": "kr", "placements": ["Shard(1)"]}]
    report = _check(tmp_path, _pair(program, rel, exp), ints=P)
    assert report.refines, str(report)


def test_vllm_attention_with_heads_sharded(tmp_path: Path) -> None:
    """qwen2's attention with query and kv heads split across ranks (grouped: 2 query heads
    per kv head): each rank's causal attention is its heads of the sequential one."""
    T, NH, NKV, D = 4, 4, 2, 3

    def program(g: GraphBuilder, r: int | None) -> None:
        n = 1 if r is None else 2
        q, k, v = g.input("q", [T, NH // n, D]), g.input("k", [T, NKV // n, D]), g.input("v", [T, NKV // n, D])
        g.output("y", g.op("vllm_attention", q, k, v, scale=D ** -0.5))

    rel = [{"from": x, "placements": ["Shard(1)"]} for x in ("q", "k", "v")]
    report = _check(tmp_path, _pair(program, rel, [{"output": "y", "placements": ["Shard(1)"]}]))
    assert report.refines, str(report)


# ---------------------------------------------------------------------------------------
# ATen ops the corpus uses that refine's own capture never produces (rules/aten_extra.py)


@pytest.mark.parametrize("shape, dim", [([3, 4], -1), ([2, 1, 5], 2), ([3, 2], 0), ([1, 1], 1)])
def test_aten_backward_ops(tmp_path: Path, shape: list[int], dim: int) -> None:
    def build(g: GraphBuilder) -> None:
        dy, x = g.input("dy", shape), g.input("x", shape)
        y = g.op("softmax", x, dim=dim)
        g.output("dsoftmax", g.op("_softmax_backward_data", dy, y, dim=dim, input_dtype="float32"))
        g.output("dgelu", g.op("gelu_backward", dy, x))
        g.output("dgelu_none", g.op("gelu_backward", dy, x, approximate="none"))

    _faithful(tmp_path, build)


@pytest.mark.parametrize("ids, v, h, pad", [([2, 3], 5, 4, -1), ([4], 3, 1, 1), ([1, 1], 2, 3, 0)])
def test_embedding_dense_backward(tmp_path: Path, ids: list[int], v: int, h: int, pad: int) -> None:
    def build(g: GraphBuilder) -> None:
        dy, i = g.input("dy", ids + [h]), g.input("i", ids, "int64")
        g.output("dw", g.op("embedding_dense_backward", dy, i, num_weights=v, padding_idx=pad,
                            scale_grad_by_freq=False))

    _faithful(tmp_path, build, {"i": (0, v)})


@pytest.mark.parametrize("shape, dim, start, end", [([4, 6], 1, 0, 2), ([4, 6], 1, 2, 5), ([4, 6], 0, 0, 2**63 - 1),
                                                    ([3, 5], -1, 3, 5), ([2, 3], 0, -1, 2**63 - 1), ([1, 3], 1, 1, 2)])
def test_slice_scatter(tmp_path: Path, shape: list[int], dim: int, start: int, end: int) -> None:
    n = shape[dim]
    s = start + n if start < 0 else start
    e = min(end, n)
    src = list(shape)
    src[dim] = e - s

    def build(g: GraphBuilder) -> None:
        x, y = g.input("x", shape), g.input("y", src)
        g.output("z", g.op("slice_scatter", x, y, dim=dim, start=start, end=end))

    _faithful(tmp_path, build)


@pytest.mark.parametrize("shape, ids", [([5, 3], [2, 4]), ([4, 2, 3], [3]), ([3], [2, 2]), ([1, 2], [1])])
def test_index_rows(tmp_path: Path, shape: list[int], ids: list[int]) -> None:
    def build(g: GraphBuilder) -> None:
        g.output("y", g.op("index_rows", g.input("x", shape), g.input("i", ids, "int64")))

    _faithful(tmp_path, build, {"i": (0, shape[0])})


# ---------------------------------------------------------------------------------------
# 4: every call target of the corpus, and how refine covers it

# the non-ATen targets: the refine ops an importer maps each one (or each wrapped op) to
FRAMEWORK_OPS: dict[str, list[str]] = {
    "apex.fused_layer_norm_affine_fwd.default": ["apex_layer_norm", "apex_layer_norm_mean", "apex_layer_norm_invvar"],
    "apex.fused_layer_norm_affine_bwd.default": ["apex_layer_norm_grad_input", "apex_layer_norm_grad_weight",
                                                 "apex_layer_norm_grad_bias"],
    "hlo.AwsNeuronRmsNorm": ["hlo_rms_norm"],
    "hlo.broadcast": ["hlo_broadcast"],
    "hlo.dot": ["hlo_dot"],
    "hlo.gather": ["hlo_gather"],
    "hlo.logistic": ["hlo_logistic"],
    "hlo.reduce_max": ["hlo_reduce_max"],
    "hlo.select": ["hlo_select"],
    "vllm.all_reduce.default": ["all_reduce"],  # refine's collective, reduce_op sum over the TP group
    "tg.log_tensor.default": ["tg_log_tensor"],
    # auto_functionalized(op, ...) / auto_functionalized_v2: by the wrapped op
    "_C.rms_norm.default": ["vllm_rms_norm"],
    "_C.fused_add_rms_norm.default": ["vllm_fused_add_rms_norm", "vllm_fused_add_rms_norm_residual"],
    "_C.rotary_embedding.default": ["vllm_rotary_embedding"],
    "_C.silu_and_mul.default": ["vllm_silu_and_mul"],
    "vllm.unified_attention_with_output.default": ["vllm_attention"],
    "tg.inplace_log_tensor.default": ["tg_log_tensor"],
}
WRAPPERS = {"auto_functionalized", "auto_functionalized_v2"}

# ATen targets that capture's op table refuses but the corpus importer translates
# (refine/frontends/importer/entangle.py), each by the mechanism named here; every entry is exercised
# on a small dump by test_importer_mechanism below (IMPORTER_CASES has the same keys)
IMPORTED: dict[str, str] = {
    "aten.native_dropout.default": "EntangleEmitter._dropout: the keep-mask (getitem 1) is lifted to a bool input "
    "(the k-th dropout's mask matched by position across graphs), getitem 0 is dropout_masked(x, mask, p); "
    "train=False or p=0 is the identity",
    "aten.empty.memory_format": "uninitialised buffers are translated only where read as values: a copy's target "
    "reads only its shape (aten copy), baddbmm with beta=0 ignores it (EntangleEmitter._baddbmm), a vLLM op's "
    "`out` is never read (auto_functionalized maps the op); read as a value (aws_llama's lost HLO constant) it "
    "is lifted to an input (EntangleEmitter._empty, matched by position)",
    "aten.empty_like.default": "an uninitialised buffer passed as a vLLM op's `result`/`output` (or a view of one): "
    "never read, auto_functionalized maps the op over its real inputs (EntangleEmitter._functionalized)",
    "aten.new_empty_strided.default": "an uninitialised buffer, the target of a full copy: aten copy reads only "
    "its shape",
    "aten.index.Tensor[2 indices]": "x[arange(n), ids] on a 2-d x is gather(x, ids[:, None], dim=1) "
    "(EntangleEmitter._index; any other pair of index tensors is refused, exit 2)",
    "aten.index_put.default[bool mask]": "x[mask] = v with a bool mask over x's leading dims and one value is "
    "where(mask, v, x), masked_fill for a constant v (EntangleEmitter._index_put)",
    "aten.index_put.default[2 indices]": "x[arange(n), ids] = v on a 2-d x is where(column == ids[:, None], v, x) "
    "(EntangleEmitter._index_put; other pairs refused)",
}


def _aten_coverage(target: str, getitems: set[int]) -> str | None:
    """How capture's op table maps an ATen/c10d target (resolved by name), or None."""
    ns, name, overload = target.split(".")
    op = getattr(getattr(getattr(torch.ops, ns), name), overload)
    qual, ov = aten.qualified(op)
    if qual in aten.FUNCTIONAL_COLLECTIVES or qual in aten.LEGACY_COLLECTIVES:
        return "collective"
    if qual in aten.WAITS:
        return "wait (identity)"
    base = qual.partition("::")[2]
    if base in aten.IDENTITY:
        return "identity"
    if getitems:  # a multi-output op: every used output must be mapped
        supported = {"max": {0}}.get(base)
        ok = base in aten.MULTI and (supported is None or getitems <= supported)
        return f"multi-output {base}" if ok else None
    if (base, ov) in aten.SPECIAL_OVERLOAD or base in aten.SPECIAL:
        return f"special {base}"
    op_name = aten.ALIASES.get(base, base)
    return f"op {op_name}" if op_name in REG.ops else None


def _coverage(target: str, getitems: set[int]) -> str | None:
    """How refine covers a corpus call target, or None (uncovered)."""
    if target == "getitem":
        return "an output of a multi-output op (mapped with the op)"
    if target in FRAMEWORK_OPS:
        assert all(o in REG.ops for o in FRAMEWORK_OPS[target]), target
        return ", ".join(FRAMEWORK_OPS[target])
    if target in IMPORTED:
        return f"importer: {IMPORTED[target]}"
    if "[" not in target and target.startswith(("aten.", "_c10d_functional.")):
        return _aten_coverage(target, getitems)
    return None


def test_an_uncovered_target_is_reported() -> None:
    """The coverage test fails for what refine does not cover: an ATen op no table maps, an
    index with three index tensors, an unknown framework op; and the importer's entries are
    needed (capture's op table alone refuses each of them)."""
    for t in ("aten.fft_fft.default", "aten.index.Tensor[3 indices]", "hlo.custom_call", "_C.frobnicate.default"):
        assert _coverage(t, set()) is None, t
    assert _coverage("aten.index.Tensor[2 indices]", set()) == f"importer: {IMPORTED['aten.index.Tensor[2 indices]']}"
    for t in IMPORTED:
        if "[" not in t:
            assert _aten_coverage(t, {0, 1} if "dropout" in t else set()) is None, t


# ---------------------------------------------------------------------------------------
# the importer's mechanisms for IMPORTED, each on a small dump (refine.frontends.importer.gpickle's
# plain PNode/PGraph, as load_gpickle makes them), translated by the importer and run by
# refine's interpreter against torch


class _Dump:
    def __init__(self) -> None:
        self.nodes: list[Any] = []

    def _add(self, name: str, op: str, target: str, args: tuple[Any, ...], kwargs: dict[str, Any],
             shape: list[int] | None, dtype: str | None) -> Any:
        from refine.frontends.importer.gpickle import NodeRef, PNode

        self.nodes.append(PNode(name, op, target, args, kwargs, None if shape is None else tuple(shape), dtype))
        return NodeRef(name)

    def input(self, name: str, shape: list[int], dtype: str = "float32") -> Any:
        return self._add(name, "placeholder", name, (), {}, shape, dtype)

    def call(self, name: str, target: str, *args: Any, shape: list[int] | None, dtype: str = "float32",
             **kwargs: Any) -> Any:
        return self._add(name, "call_function", target, args, kwargs, shape, dtype if shape is not None else None)

    def getitem(self, name: str, src: Any, i: int, shape: list[int], dtype: str = "float32") -> Any:
        return self.call(name, "<built-in function getitem>", src, i, shape=shape, dtype=dtype)

    def graph(self, *outs: Any) -> Any:
        from refine.frontends.importer.gpickle import PGraph

        self._add("output", "output", "output", (list(outs),), {}, None, None)
        return PGraph("test.gpickle", self.nodes, "fw", 0, 0)


Reference = Callable[[dict[str, torch.Tensor]], list[torch.Tensor]]


def _dropout_case() -> tuple[Any, dict[str, torch.Tensor], Reference]:
    d = _Dump()
    x = d.input("x", [4, 6])
    nd = d.call("native_dropout", "aten.native_dropout.default", x, 0.25, True, shape=None)
    y, m = d.getitem("y", nd, 0, [4, 6]), d.getitem("m", nd, 1, [4, 6], "bool")
    off = d.call("native_dropout_1", "aten.native_dropout.default", x, 0.5, False, shape=None)
    y_off = d.getitem("y_off", off, 0, [4, 6])
    xv = torch.randn(4, 6, dtype=torch.float64)
    ref_y, ref_m = torch.native_dropout(xv, 0.25, True)  # torch draws the mask; refine takes it as an input
    return d.graph(y, m, y_off), {"x": xv, "mask0": ref_m}, lambda v: [ref_y, ref_m, v["x"]]


def _empty_case() -> tuple[Any, dict[str, torch.Tensor], Reference]:
    d = _Dump()
    x, a, b, g = d.input("x", [3, 4]), d.input("a", [2, 3, 4]), d.input("b", [2, 4, 5]), d.input("g", [3, 4])
    e = d.call("empty", "aten.empty.memory_format", [3, 4], shape=[3, 4], dtype="float32", pin_memory=False)
    c = d.call("copy", "aten.copy.default", e, x, shape=[3, 4])  # a copy's target: its shape only
    twice = d.call("add", "aten.add.Tensor", c, x, shape=[3, 4])
    e1 = d.call("empty_1", "aten.empty.memory_format", [2, 3, 5], shape=[2, 3, 5], pin_memory=False)
    bmm = d.call("baddbmm", "aten.baddbmm.default", e1, a, b, shape=[2, 3, 5], beta=0.0, alpha=0.5)
    e2 = d.call("empty_2", "aten.empty.memory_format", [3, 2], shape=[3, 2], pin_memory=False)
    af = d.call("auto_functionalized", "auto_functionalized", "_C.silu_and_mul.default", shape=None, out=e2, input=g)
    silu = d.getitem("getitem_1", af, 1, [3, 2])
    e3 = d.call("constant", "aten.empty.memory_format", [32], shape=[32], pin_memory=False)  # read: a lost constant
    w = d.call("view", "aten.view.default", e3, [4, 8], shape=[4, 8])
    mm = d.call("mm", "aten.mm.default", x, w, shape=[3, 8])
    vals = {k: torch.randn(*s, dtype=torch.float64) for k, s in (("x", (3, 4)), ("a", (2, 3, 4)), ("b", (2, 4, 5)),
                                                                  ("g", (3, 4)), ("const0", (32,)))}

    def ref(v: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        nan = torch.full((2, 3, 5), float("nan"), dtype=torch.float64)  # torch ignores it with beta=0
        return [2 * v["x"], torch.baddbmm(nan, v["a"], v["b"], beta=0.0, alpha=0.5),
                torch.nn.functional.silu(v["g"][:, :2]) * v["g"][:, 2:], v["x"] @ v["const0"].view(4, 8)]

    return d.graph(twice, bmm, silu, mm), vals, ref


def _empty_like_case() -> tuple[Any, dict[str, torch.Tensor], Reference]:
    d = _Dump()
    x, w = d.input("x", [3, 4]), d.input("w", [4])
    q, k, v = d.input("q", [3, 4, 2]), d.input("k", [3, 2, 2]), d.input("v", [3, 2, 2])
    el = d.call("empty_like", "aten.empty_like.default", x, shape=[3, 4], pin_memory=False)
    af = d.call("auto_functionalized", "auto_functionalized", "_C.rms_norm.default", shape=None, result=el, input=x,
                weight=w, epsilon=1e-6)
    rms = d.getitem("getitem", af, 1, [3, 4])
    el1 = d.call("empty_like_1", "aten.empty_like.default", q, shape=[3, 4, 2], pin_memory=False)
    out = d.call("view_1", "aten.view.default", el1, [3, 8], shape=[3, 8])
    att = d.call("auto_functionalized_1", "auto_functionalized", "vllm.unified_attention_with_output.default",
                 shape=None, query=q, key=k, value=v, output=out, layer_name="attn")
    y = d.getitem("getitem_1", att, 1, [3, 4, 2])
    vals = {"x": torch.randn(3, 4, dtype=torch.float64), "w": torch.randn(4, dtype=torch.float64),
            "q": torch.randn(3, 4, 2, dtype=torch.float64), "k": torch.randn(3, 2, 2, dtype=torch.float64),
            "v": torch.randn(3, 2, 2, dtype=torch.float64)}

    def ref(t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        x = t["x"]
        norm = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * t["w"]
        kk, vv = (t[n].repeat_interleave(2, 1).transpose(0, 1) for n in ("k", "v"))
        att = torch.nn.functional.scaled_dot_product_attention(t["q"].transpose(0, 1), kk, vv, is_causal=True,
                                                               scale=2 ** -0.5)
        return [norm, att.transpose(0, 1)]

    return d.graph(rms, y), vals, ref


def _new_empty_strided_case() -> tuple[Any, dict[str, torch.Tensor], Reference]:
    d = _Dump()
    x = d.input("x", [3, 4])
    ne = d.call("new_empty_strided", "aten.new_empty_strided.default", x, [3, 4], [4, 1], shape=[3, 4])
    y = d.call("mul", "aten.mul.Tensor", x, 3.0, shape=[3, 4])
    c = d.call("copy", "aten.copy.default", ne, y, shape=[3, 4])
    return d.graph(c), {"x": torch.randn(3, 4, dtype=torch.float64)}, lambda v: [3 * v["x"]]


def _two_index_case() -> tuple[Any, dict[str, torch.Tensor], Reference]:
    d = _Dump()
    x, ids = d.input("x", [4, 5]), d.input("ids", [4], "int64")
    ar = d.call("arange", "aten.arange.start", 0, 4, shape=[4], dtype="int64", pin_memory=False)
    y = d.call("index", "aten.index.Tensor", x, [ar, ids], shape=[4])
    vals = {"x": torch.randn(4, 5, dtype=torch.float64), "ids": torch.tensor([4, 0, 2, 2])}
    return d.graph(y), vals, lambda v: [v["x"][torch.arange(4), v["ids"]]]


def _index_put_mask_case() -> tuple[Any, dict[str, torch.Tensor], Reference]:
    d = _Dump()
    x, mask, v = d.input("x", [4, 3]), d.input("mask", [4], "bool"), d.input("v", [])
    y = d.call("index_put", "aten.index_put.default", x, [mask], v, shape=[4, 3])
    zero = d.call("full", "aten.full.default", [], 0.0, shape=[], dtype="float32", pin_memory=False)
    z = d.call("index_put_1", "aten.index_put.default", x, [mask], zero, shape=[4, 3])
    vals = {"x": torch.randn(4, 3, dtype=torch.float64), "mask": torch.tensor([True, False, False, True]),
            "v": torch.tensor(2.5, dtype=torch.float64)}

    def ref(t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [t["x"].index_put((t["mask"],), t["v"]), t["x"].index_put((t["mask"],), torch.tensor(0.0).double())]

    return d.graph(y, z), vals, ref


def _index_put_two_case() -> tuple[Any, dict[str, torch.Tensor], Reference]:
    d = _Dump()
    x, ids, v = d.input("x", [4, 5]), d.input("ids", [4], "int64"), d.input("v", [4])
    ar = d.call("arange", "aten.arange.start", 0, 4, shape=[4], dtype="int64", pin_memory=False)
    y = d.call("index_put", "aten.index_put.default", x, [ar, ids], v, shape=[4, 5])
    vals = {"x": torch.randn(4, 5, dtype=torch.float64), "ids": torch.tensor([4, 0, 2, 2]),
            "v": torch.randn(4, dtype=torch.float64)}
    return d.graph(y), vals, lambda t: [t["x"].index_put((torch.arange(4), t["ids"]), t["v"])]


IMPORTER_CASES: dict[str, Callable[[], tuple[Any, dict[str, torch.Tensor], Reference]]] = {
    "aten.native_dropout.default": _dropout_case,
    "aten.empty.memory_format": _empty_case,
    "aten.empty_like.default": _empty_like_case,
    "aten.new_empty_strided.default": _new_empty_strided_case,
    "aten.index.Tensor[2 indices]": _two_index_case,
    "aten.index_put.default[bool mask]": _index_put_mask_case,
    "aten.index_put.default[2 indices]": _index_put_two_case,
}
LIFTED = {"aten.native_dropout.default": [("mask0", "mask", (4, 6), "bool")],
          "aten.empty.memory_format": [("const0", "const", (32,), "float32")]}
TRANSLATED_TO = {"aten.native_dropout.default": "dropout_masked", "aten.empty.memory_format": "vllm_silu_and_mul",
                 "aten.empty_like.default": "vllm_attention", "aten.index.Tensor[2 indices]": "gather",
                 "aten.index_put.default[bool mask]": "masked_fill", "aten.index_put.default[2 indices]": "where"}


def test_every_importer_entry_has_a_case() -> None:
    assert set(IMPORTER_CASES) == set(IMPORTED)


@pytest.mark.parametrize("target", sorted(IMPORTER_CASES))
def test_importer_mechanism(tmp_path: Path, target: str) -> None:
    """The dump translates (the buffers are never inputs unless read as values), and the
    translation computes what torch does."""
    from refine.frontends.importer.entangle import convert_dump

    pg, vals, ref = IMPORTER_CASES[target]()
    imp = convert_dump(pg, REG, [0], sequential=True)
    assert [(x.name, x.kind, tuple(x.shape), x.dtype) for x in imp.lifted] == LIFTED.get(target, [])
    assert {i["name"] for i in imp.graph["inputs"]} == set(vals)
    ops = {n["op"] for n in imp.graph["nodes"]}
    assert not any(o in ops for o in ("empty", "empty_like", "new_empty_strided", "native_dropout", "index",
                                      "index_put"))
    if target in TRANSLATED_TO:
        assert TRANSLATED_TO[target] in ops, ops
    imp.graph["outputs"] = [{"name": f"out{i}", "ref": r, "role": "other"} for i, r in enumerate(imp.outputs)]
    (tmp_path / "seq.json").write_text(json.dumps({"format": "refine-graph", "version": 1, "kind": "sequential",
                                                   "graph": imp.graph}))
    seq = load_seq(tmp_path / "seq.json", REG)
    got = eval_graph(seq, REG, vals)
    want = ref(vals)
    assert len(want) == len(seq.outputs)
    for o, w in zip(seq.outputs, want, strict=True):
        g = got[o.ref]
        assert g.shape == w.shape and (torch.equal(g, w) if w.dtype == torch.bool else close(g, w.double())), o.name


def test_importer_refuses_other_two_index_gathers() -> None:
    """Only x[arange(n), ids] is a row-wise gather: any other pair of index tensors fails closed."""
    from refine.frontends.importer.entangle import convert_dump
    from refine.ir.errors import InputError

    d = _Dump()
    x, ids = d.input("x", [4, 5]), d.input("ids", [4], "int64")
    y = d.call("index", "aten.index.Tensor", x, [ids, ids], shape=[4])
    with pytest.raises(InputError, match="not x\\[arange\\(n\\), ids\\]"):
        convert_dump(d.graph(y), REG, [0], sequential=True)


def test_symbolic_sizes(tmp_path: Path) -> None:
    """The shape rules and decompositions take symbolic sizes, and a sharded contraction of
    hlo_dot and the sequence-parallel apex layer norm refine for every token count T."""
    T = sizes.sym("T", multiple=2)

    def program_dot(g: GraphBuilder, r: int | None) -> None:
        f = 4 if r is None else 2
        a, w = g.input("a", [T, f]), g.input("w", [3, f], role="parameter")
        y = g.op("hlo_dot", a, w, lhs_contracting_dims=[1], rhs_contracting_dims=[1], lhs_batch_dims=[],
                 rhs_batch_dims=[])
        g.output("y", y if r is None else g.op("all_reduce", y, reduce_op="sum", group=[0, 1]))

    def program_ln(g: GraphBuilder, r: int | None) -> None:
        t = T if r is None else T // 2
        x, dy, w = g.input("x", [t, 3]), g.input("dy", [t, 3]), g.input("w", [3], role="parameter")
        g.output("y", g.op("vllm_rms_norm", g.op("apex_layer_norm", x, w, normalized_shape=[3], eps=1e-5), w,
                           eps=1e-6))
        mean = g.op("apex_layer_norm_mean", x, normalized_shape=[3], eps=1e-5)
        invvar = g.op("apex_layer_norm_invvar", x, normalized_shape=[3], eps=1e-5)
        dw = g.op("apex_layer_norm_grad_weight", dy, mean, invvar, x, normalized_shape=[3])
        g.output("dw", dw if r is None else g.op("all_reduce", dw, reduce_op="sum", group=[0, 1]))

    cases = [(program_dot, [{"from": "a", "placements": ["Shard(1)"]}, {"from": "w", "placements": ["Shard(1)"]}],
              [{"output": "y", "placements": ["Replicate"]}]),
             (program_ln, [{"from": "x", "placements": ["Shard(0)"]}, {"from": "dy", "placements": ["Shard(0)"]},
                           {"from": "w", "placements": ["Replicate"]}],
              [{"output": "y", "placements": ["Shard(0)"]}, {"output": "dw", "placements": ["Replicate"]}])]
    for i, (program, rel, exp) in enumerate(cases):
        s, ranks, rel, exp = _pair(program, rel, exp)
        d = tmp_path / str(i)
        d.mkdir()
        (d / "seq.json").write_text(json.dumps(seq_doc(s, [T])))
        (d / "dist.json").write_text(json.dumps(dist_doc({"tp": 2}, ranks, rel, exp)))
        seq = load_seq(d / "seq.json", REG)
        report = check(seq, load_dist(d / "dist.json", REG, seq), REG)
        assert report.refines and report.symbols, str(report)
