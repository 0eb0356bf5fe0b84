"""Localization's inputs: the linearity each op declares (`Op.linear`, read to find an op
applied to a partial sum before the reduction) must hold numerically, and an unrelated
sequential tensor reaches its users as an opaque leaf, so relations stay small."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from refine.check import check_files, engine_for
from refine.evaluate import apply_op
from refine.format import load_dist, load_seq
from refine.normalize import lower
from refine.opset import load_registry
from refine.prove import infer
from refine.relate import build_program, seq_input_relations
from refine.soundness import SeedGen

MODELS = Path(__file__).resolve().parent.parent / "models"

REG = load_registry()
LINEAR = sorted(n for n, op in REG.ops.items() if op.core and op.linear)


def _value(shape: tuple[int, ...], kind: str, bound: int, g: torch.Generator) -> torch.Tensor:
    if kind == "i":
        return torch.randint(0, max(bound, 1), shape, generator=g)
    if kind == "b":
        return torch.rand(shape, generator=g, dtype=torch.float64) < 0.5
    if kind == "p":
        return torch.rand(shape, generator=g, dtype=torch.float64) + 0.5
    return torch.randn(shape, generator=g, dtype=torch.float64)


def test_the_common_linear_ops_declare_it() -> None:
    assert {"Sum", "cat", "slice", "view", "transpose", "expand", "Scale", "matmul", "mul_t", "div_t",
            "rsum"} <= set(LINEAR)
    assert not REG.ops["gelu_t"].linear and not REG.ops["exp_t"].linear


@pytest.mark.parametrize("name", LINEAR)
def test_declared_linearity_holds(name: str) -> None:
    """f(a + b, y) = f(a, y) + f(b, y) at each linear position ("joint": all at once)."""
    op = REG.ops[name]
    gen = SeedGen(REG, seed=1)
    g = torch.Generator().manual_seed(0)
    checked = 0
    for _ in range(12):
        gen.rng.seed(f"linear:{name}:{checked}")
        inst = gen.instance(name)
        assert inst is not None, name
        specs, attrs = inst
        named = {k: v for (k, _), v in zip(op.attrs, attrs, strict=False)}
        base = [_value(s, k, b, g) for s, k, b in specs]
        positions = {"first": [[0]], "each": [[i] for i in range(len(specs))],
                     "joint": [list(range(len(specs)))]}[op.linear]
        for pos in positions:
            a, b = list(base), list(base)
            for i in pos:
                a[i], b[i] = _value(specs[i][0], "f", 0, g), _value(specs[i][0], "f", 0, g)
            both = list(base)
            for i in pos:
                both[i] = a[i] + b[i]
            lhs = apply_op(REG, name, both, named)
            rhs = apply_op(REG, name, a, named) + apply_op(REG, name, b, named)
            assert torch.allclose(lhs, rhs, atol=1e-9), (name, pos, attrs)
            checked += 1
    assert checked >= 12


def test_an_unrelated_tensor_is_opaque_to_its_users() -> None:
    case = MODELS / "sp_mlp_bug_gather_wrong_dim"
    report = check_files(f"{case}/seq.json", f"{case}/dist.json")
    assert not report.refines
    seq = load_seq(f"{case}/seq.json", REG)
    dist = load_dist(f"{case}/dist.json", REG, seq)
    core, _ = lower(seq, REG)
    prog, _ = build_program(dist, REG, "dist")
    inf = infer(core, seq_input_relations(dist, seq, prog, REG, "dist"), prog, engine_for(REG), REG)
    unclean = [n for n in core.nodes if not inf.clean[n.name]]
    assert unclean and all(n.name in prog.opaque for n in unclean)
    users = [n for n in core.nodes if any(a in prog.opaque for a in n.tensor_args())]
    assert users
    for n in users:
        for a in n.tensor_args():
            if a in prog.opaque:
                # a user sees <a>, never a's own (growing) expression
                assert f"<{a}>" in str(inf.relations[n.name]) or inf.clean[n.name], (n.name, a)
    assert all(len(str(inf.relations[n.name])) < 400 for n in core.nodes)
