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

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from refine.build import GraphBuilder, dist_doc, seq_doc
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
