"""The ops a traced training step (make_fx with core_aten_decompositions) needs: each user
op's lowering to core ops computes what its torch reference does, on random inputs with
duplicate indices, negative indices, infinite literals and integer tensors."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from refine.frontends.build import GraphBuilder, seq_doc
from refine.frontends.graphfile import load_seq
from refine.ir import sizes
from refine.ir.errors import InputError
from refine.ops.interp import close, eval_graph
from refine.ops.lower import UnsupportedOp, lower
from refine.ops.registry import ShapeError, load_registry

REG = load_registry()


def _graph(tmp_path: Path, build: Any, symbols: list[Any] = ()) -> Any:  # type: ignore[assignment]
    g = GraphBuilder()
    build(g)
    p = tmp_path / "seq.json"
    import json

    p.write_text(json.dumps(seq_doc(g, list(symbols))))
    return load_seq(p, REG)


def _values(seq: Any, seed: int = 0, bound: int = 5) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in seq.inputs:
        shape = tuple(i.type.shape)
        if i.type.dtype == "bool":
            out[i.name] = torch.rand(shape, generator=gen) < 0.5
        elif i.type.dtype.startswith("int"):
            out[i.name] = torch.randint(-2, bound, shape, generator=gen)
        else:
            out[i.name] = torch.randn(shape, generator=gen, dtype=torch.float64)
    return out


def _faithful(seq: Any, seed: int = 0, bound: int = 5) -> None:
    """Every output of the user graph equals its value in the lowered core graph."""
    vals = _values(seq, seed, bound)
    user = eval_graph(seq, REG, vals)
    core, rename = lower(seq, REG)
    low = eval_graph(core, REG, vals)
    for o in seq.outputs:
        a, b = user[o.ref], low[rename[o.ref]]
        assert close(a, b), f"{o.name}: {a} != {b}"


def _ops(seq: Any) -> set[str]:
    return {n.op for n in lower(seq, REG)[0].nodes}


def test_concat_is_a_right_nested_cat(tmp_path: Path) -> None:
    def build(g: GraphBuilder) -> None:
        xs = [g.input(f"x{i}", [2, i + 1]) for i in range(3)]
        g.output("y", g.op("concat", *xs, dim=-1))
        g.output("one", g.op("concat", xs[0], dim=0))

    seq = _graph(tmp_path, build)
    _faithful(seq)
    core, rename = lower(seq, REG)
    cats = [n for n in core.nodes if n.op == "cat"]
    assert len(cats) == 2 and cats[-1].args[0] == "x0" and cats[0].args == ["x1", "x2"]
    assert rename[seq.outputs[1].ref] == "x0"


@pytest.mark.parametrize("shape, ns", [([3, 4], [4]), ([2, 3, 4], [3, 4])])
def test_layer_norm_statistics(tmp_path: Path, shape: list[int], ns: list[int]) -> None:
    def build(g: GraphBuilder) -> None:
        x = g.input("x", shape)
        g.output("mean", g.op("layer_norm_mean", x, normalized_shape=ns, eps=1e-5))
        g.output("rstd", g.op("layer_norm_rstd", x, normalized_shape=ns, eps=1e-3))

    seq = _graph(tmp_path, build)
    assert [tuple(n.type.shape) for n in seq.nodes] == [tuple(shape[:len(shape) - len(ns)] + [1] * len(ns))] * 2
    _faithful(seq)
    # one core op per statistic (the mean over the merged normalized dims), no formula
    assert _ops(seq) <= {"rmean", "layer_norm_rstd_c", "view"}


def test_mean_over_a_symbolic_size_is_an_rmean(tmp_path: Path) -> None:
    H = sizes.sym("H")

    def build(g: GraphBuilder) -> None:
        x = g.input("x", [4, H, 3])
        g.output("mean", g.op("mean", x, dim=[1, 2]))

    seq = _graph(tmp_path, build, [H])
    core, _ = lower(seq, REG)
    assert [n.op for n in core.nodes] == ["rmean", "rsum", "Scale", "view"]


def test_elementwise_aten_ops(tmp_path: Path) -> None:
    def build(g: GraphBuilder) -> None:
        x = g.input("x", [3, 4])
        ids = g.input("ids", [3, 4], "int64")
        m = g.input("m", [3, 4], "bool")
        g.output("clamp", g.op("clamp", x, min=-0.5, max=0.5))
        g.output("clamp_lo", g.op("clamp", x, min=0.0))
        g.output("clamp_ids", g.op("clamp", ids, min=-1, max=3))
        a = g.op("bitwise_and", m, g.op("ge", ids, 0))
        g.output("and", a)
        g.output("or", g.op("bitwise_or", m, g.op("lt", ids, 2)))
        g.output("not", g.op("bitwise_not", a))
        s = g.op("scalar_tensor", s=-math.inf)
        g.output("where_scalar", g.op("where", m, s, x))
        g.output("where_literal", g.op("where", m, -math.inf, x, name="where_literal"))
        g.output("where_ids", g.op("where", g.op("ne", ids, -2), ids, 0))
        g.output("full_like", g.op("full_like", x, fill_value=2.5, name="fl"))
        g.output("softmax", g.op("_softmax", x, dim=-1, half_to_float=False))
        g.output("log_softmax", g.op("_log_softmax", x, dim=0, half_to_float=False))
        g.output("pow", g.op("pow", x, 2))
        g.output("div", g.op("div", x, 8))
        g.output("mul", g.op("mul", x, -0.5))
        g.output("squeeze", g.op("squeeze", g.op("unsqueeze", x, dim=1), dim=[1]))
        g.output("sum_all", g.op("sum", m, dim=[]))

    seq = _graph(tmp_path, build)
    _faithful(seq)
    assert seq.index()["where_literal"].type.dtype == "float32"
    core, rename = lower(seq, REG)
    assert core.index()[rename["fl"]].op == "full"  # a constant: x's values are never read


def test_bitwise_ops_on_integers_are_refused(tmp_path: Path) -> None:
    def build(g: GraphBuilder) -> None:
        ids = g.input("ids", [3], "int64")
        g.output("y", g.op("bitwise_and", ids, ids))

    with pytest.raises(ShapeError):
        _graph(tmp_path, build)


def test_arange(tmp_path: Path) -> None:
    def build(g: GraphBuilder) -> None:
        g.output("a", g.op("arange", end=6))
        g.output("b", g.op("arange", start=2, end=9, step=3))
        g.input("x", [1])

    seq = _graph(tmp_path, build)
    assert [n.type.shape for n in seq.nodes] == [(6,), (3,)]
    _faithful(seq)


def test_arange_symbolic_shape(tmp_path: Path) -> None:
    T = sizes.sym("T", multiple=2)

    def build(g: GraphBuilder) -> None:
        g.input("x", [T])
        g.output("a", g.op("arange", start=T // 2, end=T))

    seq = _graph(tmp_path, build, [T])
    assert seq.nodes[0].type.shape == (T // 2,)


def test_gather_and_scatter(tmp_path: Path) -> None:
    def build(g: GraphBuilder) -> None:
        x = g.input("x", [4, 5])
        idx = g.input("idx", [4, 2], "int64")
        g.output("gather", g.op("gather", x, idx, dim=1, name="g1"))
        g.output("gather0", g.op("gather", x, g.input("idx0", [3, 5], "int64"), dim=0))
        g.output("scatter", g.op("scatter_value", x, idx, dim=-1, value=-1.0, name="s1"))
        g.output("scatter_aten", g.op("scatter", x, idx, dim=1, value=-1.0, name="s2"))

    seq = _graph(tmp_path, build)
    for seed in range(3):
        vals = _values(seq, seed)
        vals["idx"] = vals["idx"].clamp(0, 4)
        vals["idx0"] = vals["idx0"].clamp(0, 3)
        user = eval_graph(seq, REG, vals)
        assert close(user["g1"], torch.gather(vals["x"], 1, vals["idx"]))
        assert close(user["s1"], vals["x"].scatter(1, vals["idx"], -1.0))
        core, rename = lower(seq, REG)
        assert close(eval_graph(core, REG, vals)[rename["s2"]], user["s1"])


@pytest.mark.parametrize("zero_base", [True, False])
def test_index_put_accumulates_duplicates(tmp_path: Path, zero_base: bool) -> None:
    def build(g: GraphBuilder) -> None:
        ids = g.input("ids", [2, 6], "int64")
        dy = g.input("dy", [2, 6, 3])
        base = g.op("full", value=0.0, shape=[5, 3]) if zero_base else g.input("base", [5, 3])
        c = g.op("clamp", ids, min=-5, max=4)  # as the embedding backward: negative ids wrap
        g.output("grad", g.op("index_put", base, c, dy, accumulate=True))

    seq = _graph(tmp_path, build)
    for seed in range(3):
        _faithful(seq, seed)
    ops = _ops(seq)
    assert "index_put_acc" in ops and (("Sum" in ops) != zero_base)


def test_index_put_without_accumulate_fails_closed(tmp_path: Path) -> None:
    def build(g: GraphBuilder) -> None:
        ids = g.input("ids", [4], "int64")
        g.output("y", g.op("index_put", g.input("base", [5, 3]), ids, g.input("v", [4, 3]), accumulate=False))

    seq = _graph(tmp_path, build)
    with pytest.raises(UnsupportedOp):
        lower(seq, REG)


def test_index_put_with_two_index_tensors_is_refused(tmp_path: Path) -> None:
    def build(g: GraphBuilder) -> None:
        i = g.input("i", [4], "int64")
        g.op("index_put", g.input("base", [5, 3]), i, i, g.input("v", [4]), accumulate=True)

    with pytest.raises((ShapeError, InputError)):
        _graph(tmp_path, build)
