"""Localization's inputs: the linearity each op declares (`Op.linear`, read to find an op
applied to a partial sum before the reduction) must hold numerically, and an unrelated
sequential tensor reaches its users as an opaque leaf, so relations stay small."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest
import torch

from refine.check import check_files, engine_for
from refine.frontends.graphfile import load_dist, load_seq
from refine.ops.interp import apply_op
from refine.ops.lower import lower
from refine.ops.registry import load_registry
from refine.prove.harness import SeedGen
from refine.prove.walk import infer
from refine.relate.program import build_program, seq_input_relations
from tests.helpers import MODELS

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
    assert not prog.opaque  # the program the walk read is frozen: what it learned is in its own view
    prog = inf.program
    unclean = [n for n in core.nodes if not inf.clean[n.name]]
    # or carried (a small term with one user: refine.prove.walk.infer), then its user's own
    # unclean term is opaque to the users after it
    assert unclean and all(n.name in prog.opaque or n.name in inf.carried for n in unclean)
    assert any(n.name in prog.opaque for n in unclean)
    users = [n for n in core.nodes if any(a in prog.opaque for a in n.tensor_args())]
    # (an opaque node without users is the output its carried input was taken into)
    assert users or all(n.name in {o.ref for o in core.outputs} for n in unclean if n.name in prog.opaque)
    for n in users:
        for a in n.tensor_args():
            if a in prog.opaque:
                # a user sees <a>, never a's own (growing) expression
                assert f"<{a}>" in str(inf.relations[n.name]) or inf.clean[n.name], (n.name, a)
    assert all(len(str(inf.relations[n.name])) < 400 for n in core.nodes)


# ---------------------------------------------------------------------------------------
# a wrong constant factor, found by editing the rank programs (refine.verdict.factor)


def _dp_mean(tmp: Path, extra: list[dict], reduce_op: str = "avg") -> tuple[object, object]:
    """The mean of x (4 x 2), x sharded by rows on 2 ranks: each rank means its rows (f.py:1),
    then `extra` nodes (reading and making "m"), then an all-reduce (f.py:9)."""
    import json

    seq = {"format": "refine-graph", "version": 1, "kind": "sequential", "graph": {
        "inputs": [{"name": "x", "shape": [4, 2], "role": "data"}],
        "nodes": [{"name": "s", "op": "sum", "args": ["x"], "attrs": {"dim": []}, "shape": []},
                  {"name": "m", "op": "mul", "args": ["s", 0.125], "shape": []}],
        "outputs": [{"name": "loss", "ref": "m", "role": "loss"}]}}
    nodes = [{"name": "s", "op": "sum", "args": ["x"], "attrs": {"dim": []}, "shape": [], "source": "f.py:1"},
             {"name": "m", "op": "mul", "args": ["s", 0.25], "shape": [], "source": "f.py:1"}]
    last = "m"
    for n in extra:
        nodes.append({**n, "args": [last if a == "m" else a for a in n["args"]], "shape": []})
        last = n["name"]
    nodes.append({"name": "r", "op": "all_reduce", "args": [last], "shape": [], "source": "f.py:9",
                  "attrs": {"reduce_op": reduce_op, "group": [0, 1]}})
    rank = {"inputs": [{"name": "x", "shape": [2, 2], "role": "data"}], "nodes": nodes,
            "outputs": [{"name": "loss", "ref": "r", "role": "loss"}]}
    dist = {"format": "refine-graph", "version": 1, "kind": "distributed", "mesh": {"axes": [{"name": "dp", "size": 2}]},
            "ranks": [{"rank": r, "graph": rank} for r in (0, 1)],
            "relations": [{"from": "x", "placements": ["Shard(0)"]}],
            "expectations": [{"output": "loss", "local": "loss", "placements": ["Replicate"]}]}
    (tmp / "seq.json").write_text(json.dumps(seq))
    (tmp / "dist.json").write_text(json.dumps(dist))
    s = load_seq(tmp / "seq.json", REG)
    return s, load_dist(tmp / "dist.json", REG, s)


def test_a_wrong_factor_is_found_at_its_line(tmp_path: Path) -> None:
    from refine.verdict.factor import wrong_factor

    seq, dist = _dp_mean(tmp_path, [])
    assert wrong_factor(seq, dist, REG, []) is None  # right: nothing to find
    # divided a second time: the division's 1/2 times 2 is 1, preferred to flipping the AVG
    # (which absorbs the factor as well) though the all-reduce is nearer the output
    seq, dist = _dp_mean(tmp_path, [{"name": "d", "op": "div", "args": ["m", 2], "source": "f.py:5"}])
    found = wrong_factor(seq, dist, REG, ["loss"])
    assert found is not None and (found.source, found.node, found.factor) == ("f.py:5", "d", 2), found
    # a wrong literal that is not a spare division: the mean's 1/4 should be 1/2 (no flip of
    # the AVG can help: the factor is 4, not the world size)
    seq, dist = _dp_mean(tmp_path, [{"name": "d", "op": "mul", "args": ["m", 0.25], "source": "f.py:5"}])
    found = wrong_factor(seq, dist, REG, ["loss"])
    assert found is not None and (found.source, found.factor) == ("f.py:5", 4), found
    # SUM for AVG: no literal line repairs it alone but the reduction's
    seq, dist = _dp_mean(tmp_path, [], reduce_op="sum")
    found = wrong_factor(seq, dist, REG, ["loss"])
    assert found is not None and (found.source, found.node, found.factor) == ("f.py:9", "r", Fraction(1, 2)), found
    # not a constant multiple (a square): nothing is blamed
    seq, dist = _dp_mean(tmp_path, [{"name": "d", "op": "mul", "args": ["m", "m"], "source": "f.py:5"}])
    assert wrong_factor(seq, dist, REG, ["loss"]) is None
    # a line whose node the checker proved right is never blamed: the AVG flip is next
    seq, dist = _dp_mean(tmp_path, [{"name": "d", "op": "div", "args": ["m", 2], "source": "f.py:5"}])
    found = wrong_factor(seq, dist, REG, ["loss"], proven=lambda r, n: n == "d")
    assert found is not None and (found.source, found.node) == ("f.py:9", "r"), found


def test_terms_weighted_wrong_are_found_at_the_mean(tmp_path: Path) -> None:
    """Gradient accumulation over two micro-batches, each loss a mean over its own half (f.py:3)
    added to an accumulator `a`: the sequential loss is a + the mean over the whole batch, so
    the relation weights each micro-batch mean 1/2 and `a` 1, and the output is no multiple of
    what the rank holds. The factor 1/2 is read off the terms weighted differently; editing the
    means' line (its 1/4 times 1/2) repairs the loss, so the culprit is that line."""
    import json

    from refine.check import check_files

    seq = {"format": "refine-graph", "version": 1, "kind": "sequential", "graph": {
        "inputs": [{"name": "x", "shape": [8], "role": "data"}, {"name": "a", "shape": [], "role": "data"}],
        "nodes": [{"name": "sq", "op": "mul", "args": ["x", "x"], "shape": [8], "source": "f.py:3"},
                  {"name": "s", "op": "sum", "args": ["sq"], "attrs": {"dim": []}, "shape": [], "source": "f.py:3"},
                  {"name": "m", "op": "div", "args": ["s", 8], "shape": [], "source": "f.py:4"},
                  {"name": "l", "op": "add", "args": ["a", "m"], "shape": [], "source": "f.py:7"}],
        "outputs": [{"name": "loss", "ref": "l", "role": "loss"}]}}
    nodes = []
    last = "a"
    for i in (0, 1):
        nodes += [{"name": f"sq{i}", "op": "mul", "args": [f"x{i}", f"x{i}"], "shape": [4], "source": "f.py:3"},
                  {"name": f"m{i}", "op": "mean", "args": [f"sq{i}"], "shape": [], "source": "f.py:3"},
                  {"name": f"l{i}", "op": "add", "args": [last, f"m{i}"], "shape": [], "source": "f.py:7"}]
        last = f"l{i}"
    rank = {"inputs": [{"name": "x0", "shape": [4], "role": "data"}, {"name": "x1", "shape": [4], "role": "data"},
                       {"name": "a", "shape": [], "role": "data"}],
            "nodes": nodes, "outputs": [{"name": "loss", "ref": last, "role": "loss"}]}
    dist = {"format": "refine-graph", "version": 1, "kind": "distributed", "mesh": {"axes": [{"name": "dp", "size": 1}]},
            "ranks": [{"rank": 0, "graph": rank}],
            "relations": [{"from": "x", "layout": "cat(x0@0, x1@0, dim=0)"}, {"from": "a", "placements": ["Replicate"]}],
            "expectations": [{"output": "loss", "local": "loss", "placements": ["Replicate"]}]}
    (tmp_path / "seq.json").write_text(json.dumps(seq))
    (tmp_path / "dist.json").write_text(json.dumps(dist))
    report = check_files(tmp_path / "seq.json", tmp_path / "dist.json")
    assert not report.refines
    c = report.culprit
    assert c is not None and c.source == c.rank_source == "f.py:3", c
    assert c.rank_node is not None and c.rank_node.split(".")[0] in ("m0", "m1"), c.rank_node
    assert "1/4 times 1/2 = 1/8" in c.reason and c.seq_source == "f.py:7", c.reason


def _token_mean(tmp: Path, counted: str) -> object:
    """A loss summed over x (4 x 2, rows sharded on 2 ranks), all-reduced, divided by the count
    of labels t (2 x 4, on every rank whole) that are not -1. `counted`: "batch" counts all of t
    (right); "shard" counts the rank's own columns of t (f.py:5 divides by it): every output
    twice what it should be, and the sequential count of the batch has no rank counterpart."""
    import json

    seq = {"format": "refine-graph", "version": 1, "kind": "sequential", "graph": {
        "inputs": [{"name": "x", "shape": [4, 2], "role": "data"},
                   {"name": "t", "shape": [2, 4], "dtype": "int64", "role": "data"}],
        "nodes": [{"name": "s", "op": "sum", "args": ["x"], "attrs": {"dim": []}, "shape": [], "source": "f.py:1"},
                  {"name": "v", "op": "ne", "args": ["t", -1], "shape": [2, 4], "dtype": "bool", "source": "f.py:2"},
                  {"name": "k", "op": "sum", "args": ["v"], "attrs": {"dim": []}, "shape": [], "dtype": "int64",
                   "source": "f.py:2"},
                  {"name": "m", "op": "div", "args": ["s", "k"], "shape": [], "source": "f.py:5"}],
        "outputs": [{"name": "loss", "ref": "m", "role": "loss"}]}}

    def rank(r: int) -> dict:
        mine = [{"name": "tt", "op": "slice", "args": ["t"], "shape": [2, 2], "dtype": "int64", "source": "f.py:4",
                 "attrs": {"dim": 1, "start": 2 * r, "end": 2 * r + 2}}] if counted == "shard" else []
        n = 2 if counted == "shard" else 4
        nodes = [{"name": "s", "op": "sum", "args": ["x"], "attrs": {"dim": []}, "shape": [], "source": "f.py:1"},
                 {"name": "ss", "op": "all_reduce", "args": ["s"], "shape": [], "source": "f.py:3",
                  "attrs": {"reduce_op": "sum", "group": [0, 1]}}, *mine,
                 {"name": "v", "op": "ne", "args": ["tt" if mine else "t", -1], "shape": [2, n], "dtype": "bool",
                  "source": "f.py:4"},
                 {"name": "k", "op": "sum", "args": ["v"], "attrs": {"dim": []}, "shape": [], "dtype": "int64",
                  "source": "f.py:4"},
                 {"name": "m", "op": "div", "args": ["ss", "k"], "shape": [], "source": "f.py:5"}]
        return {"inputs": [{"name": "x", "shape": [2, 2], "role": "data"},
                           {"name": "t", "shape": [2, 4], "dtype": "int64", "role": "data"}],
                "nodes": nodes, "outputs": [{"name": "loss", "ref": "m", "role": "loss"}]}

    dist = {"format": "refine-graph", "version": 1, "kind": "distributed", "mesh": {"axes": [{"name": "dp", "size": 2}]},
            "ranks": [{"rank": r, "graph": rank(r)} for r in (0, 1)],
            "relations": [{"from": "x", "placements": ["Shard(0)"]}, {"from": "t", "placements": ["Replicate"]}],
            "expectations": [{"output": "loss", "local": "loss", "placements": ["Replicate"]}]}
    (tmp / "seq.json").write_text(json.dumps(seq))
    (tmp / "dist.json").write_text(json.dumps(dist))
    return tmp / "seq.json", tmp / "dist.json"


def test_a_loss_over_the_wrong_count_is_found_at_its_division(tmp_path: Path) -> None:
    """The wrong constant can be data: a division by a computed count whose quotient, scaled
    by the factor every output is off by, repairs every output is the culprit line."""
    from refine.verdict.factor import wrong_factor

    assert check_files(*_token_mean(tmp_path, "batch")).refines
    paths = _token_mean(tmp_path, "shard")
    report = check_files(*paths)
    assert not report.refines and report.culprit is not None and report.culprit.source == "f.py:5", report.culprit
    seq = load_seq(paths[0], REG)
    found = wrong_factor(seq, load_dist(paths[1], REG, seq), REG, ["loss"])
    assert found is not None and (found.source, found.node, found.factor) == ("f.py:5", "m", Fraction(1, 2)), found
    assert found.edit.startswith("its quotient by k times 1/2"), found.edit


def _mean_and_ratio(tmp: Path, factor: float) -> tuple[object, object]:
    """The mean of x (4 x 2, rows on 2 ranks: each rank means its rows, f.py:1 scales by
    `factor`, 0.25 right, then an AVG all-reduce, f.py:9) and a second output nearly invariant
    to the mean's scale, q = m / (m + 1e-9) (f.py:10): a mean twice too large leaves q wrong by
    far less than a counterexample can see, as gradients clipped by a norm twice too large but
    for its epsilon."""
    import json

    def nodes(mean: list[dict], m: str) -> list[dict]:
        return [*mean, {"name": "d", "op": "add", "args": [m, 1e-9], "shape": [], "source": "f.py:10"},
                {"name": "q", "op": "div", "args": [m, "d"], "shape": [], "source": "f.py:10"}]

    seq = {"format": "refine-graph", "version": 1, "kind": "sequential", "graph": {
        "inputs": [{"name": "x", "shape": [4, 2], "role": "data"}],
        "nodes": nodes([{"name": "s", "op": "sum", "args": ["x"], "attrs": {"dim": []}, "shape": []},
                        {"name": "m", "op": "mul", "args": ["s", 0.125], "shape": []}], "m"),
        "outputs": [{"name": "loss", "ref": "m", "role": "loss"}, {"name": "ratio", "ref": "q", "role": "other"}]}}
    rank = {"inputs": [{"name": "x", "shape": [2, 2], "role": "data"}],
            "nodes": nodes([{"name": "s", "op": "sum", "args": ["x"], "attrs": {"dim": []}, "shape": [], "source": "f.py:1"},
                            {"name": "m", "op": "mul", "args": ["s", factor], "shape": [], "source": "f.py:1"},
                            {"name": "r", "op": "all_reduce", "args": ["m"], "shape": [], "source": "f.py:9",
                             "attrs": {"reduce_op": "avg", "group": [0, 1]}}], "r"),
            "outputs": [{"name": "loss", "ref": "r", "role": "loss"}, {"name": "ratio", "ref": "q", "role": "other"}]}
    dist = {"format": "refine-graph", "version": 1, "kind": "distributed", "mesh": {"axes": [{"name": "dp", "size": 2}]},
            "ranks": [{"rank": r, "graph": rank} for r in (0, 1)],
            "relations": [{"from": "x", "placements": ["Shard(0)"]}],
            "expectations": [{"output": "loss", "local": "loss", "placements": ["Replicate"]},
                             {"output": "ratio", "local": "ratio", "placements": ["Replicate"]}]}
    (tmp / "seq.json").write_text(json.dumps(seq))
    (tmp / "dist.json").write_text(json.dumps(dist))
    s = load_seq(tmp / "seq.json", REG)
    return s, load_dist(tmp / "dist.json", REG, s)


def test_an_output_right_on_the_draw_says_nothing_of_the_factor(tmp_path: Path) -> None:
    """The ratio output, wrong over the reals but right on random inputs to within the
    counterexample's precision, is no evidence of the factor (its measured ratio is 1 up to
    1e-10): the loss's 1/2 is, and the edit of f.py:1 keeps the ratio right too."""
    from refine.verdict.factor import wrong_factor

    seq, dist = _mean_and_ratio(tmp_path, 0.5)
    found = wrong_factor(seq, dist, REG, ["loss", "ratio"])
    assert found is not None and (found.source, found.factor) == ("f.py:1", Fraction(1, 2)), found
    assert found.right == ["ratio"], found
    # only outputs right on the draw: no factor to read, nothing is blamed
    assert wrong_factor(seq, dist, REG, ["ratio"]) is None


def test_a_line_making_two_constants_is_edited_whole(tmp_path: Path) -> None:
    """One line (f.py:1) makes the loss's mean and a gradient's scale, two constants both twice
    what they should be (a micro-batch loss left undivided: mse_loss's forward mean and its
    backward's scale): neither edited alone repairs both outputs, the line's whole scaling does."""
    import json

    from refine.verdict.factor import wrong_factor

    def program(mean: float, scale: float) -> dict:
        return {"inputs": [{"name": "x", "shape": [2, 2], "role": "data"}],
                "nodes": [{"name": "s", "op": "sum", "args": ["x"], "attrs": {"dim": []}, "shape": [], "source": "f.py:2"},
                          {"name": "m", "op": "mul", "args": ["s", mean], "shape": [], "source": "f.py:1"},
                          {"name": "r", "op": "all_reduce", "args": ["m"], "shape": [], "source": "f.py:9",
                           "attrs": {"reduce_op": "avg", "group": [0, 1]}},
                          {"name": "g", "op": "mul", "args": ["x", scale], "shape": [2, 2], "source": "f.py:1"}],
                "outputs": [{"name": "loss", "ref": "r", "role": "loss"}, {"name": "grad", "ref": "g", "role": "other"}]}

    seq = {"format": "refine-graph", "version": 1, "kind": "sequential", "graph": {
        "inputs": [{"name": "x", "shape": [4, 2], "role": "data"}],
        "nodes": [{"name": "s", "op": "sum", "args": ["x"], "attrs": {"dim": []}, "shape": []},
                  {"name": "m", "op": "mul", "args": ["s", 0.125], "shape": []},
                  {"name": "g", "op": "mul", "args": ["x", 0.75], "shape": [4, 2]}],
        "outputs": [{"name": "loss", "ref": "m", "role": "loss"}, {"name": "grad", "ref": "g", "role": "other"}]}}

    def dist(mean: float, scale: float) -> dict:
        return {"format": "refine-graph", "version": 1, "kind": "distributed",
                "mesh": {"axes": [{"name": "dp", "size": 2}]},
                "ranks": [{"rank": r, "graph": program(mean, scale)} for r in (0, 1)],
                "relations": [{"from": "x", "placements": ["Shard(0)"]}],
                "expectations": [{"output": "loss", "local": "loss", "placements": ["Replicate"]},
                                 {"output": "grad", "local": "grad", "placements": ["Shard(0)"]}]}

    (tmp_path / "seq.json").write_text(json.dumps(seq))
    (tmp_path / "dist.json").write_text(json.dumps(dist(0.25, 0.75)))
    assert check_files(tmp_path / "seq.json", tmp_path / "dist.json").refines
    (tmp_path / "dist.json").write_text(json.dumps(dist(0.5, 1.5)))
    s = load_seq(tmp_path / "seq.json", REG)
    found = wrong_factor(s, load_dist(tmp_path / "dist.json", REG, s), REG, ["loss", "grad"])
    assert found is not None and (found.source, found.factor) == ("f.py:1", Fraction(1, 2)), found
    assert found.edit.startswith("each constant factor of the line times 1/2"), found.edit
    report = check_files(tmp_path / "seq.json", tmp_path / "dist.json")
    assert not report.refines and report.culprit is not None and report.culprit.rank_source == "f.py:1", report
