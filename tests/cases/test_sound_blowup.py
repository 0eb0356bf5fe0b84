"""A sum that holds the same term more than once gets a fast verdict, and no e-graph step
grows without limit.

Ranks that compute 3x as `a = x + x; y = a + x` put a sum into the e-graph that holds a
multiple of itself: y = a + x with x = y/3 (refine.prove.engine relates rank tensors both ways,
rules/structure.py scale-inverse). Distributing a scale over such a sum (scale-sum) made a
new multiple of it at every iteration, x/9, x/27, ..., and flattening sums and collecting
like terms made every grouping of the factors: more than 20 minutes and 12 GB for this
3-node program. rules/structure.py now indexes the sums the expanding rules (scale-sum,
sum-flatten) leave alone (`SumStop`: like terms, a multiple of the sum itself, a zero; their
collected form is in the same class), and terms that cancel are the zero constant. Each
family here (a repeated term, a repeated sum, terms that cancel, under an all-reduce, a
reduction, a matmul) must REFINE, and its buggy twin (a wrong factor) must not.

And a bound, whatever the rules do: a step stops between iterations when its e-graph holds
more than prove.NODE_BUDGET e-nodes or the next iteration would apply more than
prove.MATCH_BUDGET matches; it then keeps the cheapest term found so far. Stopping can only
lose proofs: a step forced past a small budget gives no REFINES it did not prove, and the
runaway above, with the expanding rules unguarded again, stops at the default budget."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from pathlib import Path

import pytest

from refine.check import check, check_files
from refine.frontends.build import GraphBuilder, dist_doc, seq_doc, write_case
from refine.frontends.graphfile import load_dist, load_seq
from refine.ops.registry import Registry, load_registry, rule
from refine.prove import engine as prove
from refine.prove.harness import Harness

check_mod = importlib.import_module("refine.check")  # the module (refine exports its `check` function)
SHAPE = [4, 4]
Build = Callable[[GraphBuilder, int], str]  # a graph's body over its inputs -> its output (rank index, -1 sequential)


def _case(tmp_path: Path, seq: Build, rank: Build, inputs: dict[str, tuple[list[int], str]], expect: str,
          world: int = 2) -> tuple[Path, Path]:
    """Inputs name -> (sequential shape, placement); each rank's inputs are its pieces."""
    s = GraphBuilder()
    for name, (shape, _) in inputs.items():
        s.input(name, shape)
    s.output("y", seq(s, -1))
    ranks = {}
    for r in range(world):
        d = GraphBuilder()
        for name, (shape, placement) in inputs.items():
            local = list(shape)
            if placement.startswith("Shard("):
                dim = int(placement[6:-1])
                local[dim] //= world
            d.input(name, local)
        d.output("y", rank(d, r))
        ranks[r] = d
    rel = [{"from": name, "placements": [p]} for name, (_, p) in inputs.items()]
    write_case(tmp_path, seq_doc(s), dist_doc({"tp": world}, ranks, rel, [{"output": "y", "placements": [expect]}]))
    return tmp_path / "seq.json", tmp_path / "dist.json"


def _times(k: float) -> Build:
    return lambda g, r: g.op("mul", "x", k)


def _adds(*terms: str) -> Build:
    """x + x + ..., left to right, each partial sum a node."""
    def build(g: GraphBuilder, r: int) -> str:
        out = terms[0]
        for t in terms[1:]:
            out = g.op("add", out, t)
        return out
    return build


def _pairs(g: GraphBuilder, r: int) -> str:
    """(x + x) + (x + x), two nodes for the two sums."""
    return g.op("add", g.op("add", "x", "x"), g.op("add", "x", "x"))


def _shared_pair(g: GraphBuilder, r: int) -> str:
    """a + a with a = x + x."""
    a = g.op("add", "x", "x")
    return g.op("add", a, a)


def _x_plus_pair(g: GraphBuilder, r: int) -> str:
    """x + (x + x)."""
    return g.op("add", "x", g.op("add", "x", "x"))


def _minus_x(body: Build) -> Build:
    return lambda g, r: g.op("sub", body(g, r), "x")


def _rowsum(body: Build) -> Build:
    return lambda g, r: g.op("sum", body(g, r), dim=[1])


def _cancel_then(body: Build) -> Build:
    """(x - x) + body: terms that cancel."""
    return lambda g, r: g.op("add", g.op("sub", "x", "x"), body(g, r))


def _neg_cancel(g: GraphBuilder, r: int) -> str:
    """(x + (-x)) + (-(-x)): a negation, its cancelling sum and its double negation."""
    a = g.op("neg", "x")
    return g.op("add", g.op("add", "x", a), g.op("neg", a))


def _kx_plus_y(k: float) -> Build:
    return lambda g, r: g.op("add", g.op("mul", "x", k), "y")


def _all_reduced(body: Build) -> Build:
    return lambda g, r: g.op("all_reduce", body(g, r), reduce_op="sum", group=[0, 1])


def _matmul_of(body: Build) -> Build:
    return lambda g, r: g.op("matmul", body(g, r), "w")


X = {"x": (SHAPE, "Replicate")}
XY = {"x": (SHAPE, "Replicate"), "y": (SHAPE, "Replicate")}
X_PARTIAL = {"x": (SHAPE, "Partial")}
X_W = {"x": (SHAPE, "Replicate"), "w": ([4, 6], "Shard(1)")}

# name -> (sequential, rank, inputs, expected placement of y, a wrong sequential factor's twin)
FAMILIES: dict[str, tuple[Build, Build, dict[str, tuple[list[int], str]], str, Build]] = {
    "x+x+x vs 3x": (_times(3.0), _adds("x", "x", "x"), X, "Replicate", _times(2.0)),
    "x+x vs 2x": (_times(2.0), _adds("x", "x"), X, "Replicate", _times(3.0)),
    "x+x+x+x vs 4x": (_times(4.0), _adds("x", "x", "x", "x"), X, "Replicate", _times(3.0)),
    "x+y+x vs 2x+y": (_kx_plus_y(2.0), _adds("x", "y", "x"), XY, "Replicate", _kx_plus_y(3.0)),
    "(x+x)+(x+x) vs 4x": (_times(4.0), _pairs, X, "Replicate", _times(2.0)),
    "a+a, a=x+x vs 4x": (_times(4.0), _shared_pair, X, "Replicate", _times(3.0)),
    "3x vs x+x+x": (_adds("x", "x", "x"), _times(3.0), X, "Replicate", _adds("x", "x")),
    # the ranks' all-reduce sums repeated terms: every rank's x + x + x of its part
    "partial x+x+x all-reduced vs 3x": (_times(3.0), _all_reduced(_adds("x", "x", "x")), X_PARTIAL, "Replicate",
                                        _times(2.0)),
    "partial x+x+x vs 3x, left partial": (_times(3.0), _adds("x", "x", "x"), X_PARTIAL, "Partial", _times(6.0)),
    # a replicated x + x all-reduced over two ranks: x + x + x + x
    "replicated x+x all-reduced vs 4x": (_times(4.0), _all_reduced(_adds("x", "x")), X, "Replicate", _times(2.0)),
    "matmul of x+x+x vs (3x) @ w": (_matmul_of(_times(3.0)), _matmul_of(_adds("x", "x", "x")), X_W, "Shard(1)",
                                    _matmul_of(_times(2.0))),
    "x+(x+x) vs 3x": (_times(3.0), _x_plus_pair, X, "Replicate", _times(2.0)),
    "x+x+x+x+x vs 5x": (_times(5.0), _adds("x", "x", "x", "x", "x"), X, "Replicate", _times(4.0)),
    "x+x+x+y vs 3x+y": (_kx_plus_y(3.0), _adds("x", "x", "x", "y"), XY, "Replicate", _kx_plus_y(2.0)),
    "x+x+x-x vs 2x": (_times(2.0), _minus_x(_adds("x", "x", "x")), X, "Replicate", _times(3.0)),
    "(x-x)+y+y vs 2y": (lambda g, r: g.op("mul", "y", 2.0), _cancel_then(_adds("y", "y")), XY, "Replicate",
                        lambda g, r: g.op("mul", "y", 3.0)),
    "partial -((x-x)+(x+x)) vs -2x": (_times(-2.0), lambda g, r: g.op("neg", _cancel_then(_adds("x", "x"))(g, r)),
                                      X_PARTIAL, "Partial", _times(2.0)),
    "(x+(-x))+(-(-x)) vs 1.0 x": (_times(1.0), _neg_cancel, X, "Replicate", _times(-1.0)),
    "row sums of x+x+x vs 3 rowsum x": (lambda g, r: g.op("mul", g.op("sum", "x", dim=[1]), 3.0),
                                        _rowsum(_adds("x", "x", "x")), X, "Replicate",
                                        lambda g, r: g.op("mul", g.op("sum", "x", dim=[1]), 2.0)),
    "matmul of (x+x)+(x+x) vs 4 (x @ w)": (lambda g, r: g.op("mul", g.op("matmul", "x", "w"), 4.0), _matmul_of(_pairs),
                                           X_W, "Shard(1)", lambda g, r: g.op("mul", g.op("matmul", "x", "w"), 2.0)),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_repeated_terms_refine(tmp_path: Path, family: str) -> None:
    seq, rank, inputs, expect, _ = FAMILIES[family]
    report = check_files(*_case(tmp_path, seq, rank, inputs, expect))
    assert report.refines, str(report)
    assert report.stats["bounded"] == 0, report.stats  # proven by the rules, not cut short


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_wrong_factor_does_not_refine(tmp_path: Path, family: str) -> None:
    _, rank, inputs, expect, wrong = FAMILIES[family]
    report = check_files(*_case(tmp_path, wrong, rank, inputs, expect))
    assert not report.refines, str(report)
    assert report.culprit is not None and report.culprit.output == "y", str(report)


def _load(tmp_path: Path, seq: Build, rank: Build, inputs: dict[str, tuple[list[int], str]], expect: str,
          registry: Registry) -> tuple:
    s, d = _case(tmp_path, seq, rank, inputs, expect)
    sg = load_seq(s, registry)
    return sg, load_dist(d, registry, sg)


def test_a_step_past_a_small_budget_stops_and_proves_nothing_more(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With a budget of a few e-nodes every step stops after its first iteration: x + x + x
    is not yet 3x there, so the correct program is not proven (a proof lost, said so in the
    report's stats) and the buggy one is not either. Never a REFINES."""
    monkeypatch.setattr(check_mod, "_ENGINES", {})  # no step results cached under the default budget
    monkeypatch.setattr(prove, "NODE_BUDGET", 10)
    for i, seq in enumerate((_times(3.0), _times(2.0))):
        report = check_files(*_case(tmp_path / str(i), seq, _adds("x", "x", "x"), X, "Replicate"))
        assert not report.refines, str(report)
        assert report.stats["bounded"] > 0 and "search cut short" in str(report), report.stats


@pytest.mark.parametrize("budget, value", [("MATCH_BUDGET", 3), ("MEMORY_BUDGET", -1)])
def test_the_other_budgets_stop_a_step_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: str,
                                           value: int) -> None:
    monkeypatch.setattr(check_mod, "_ENGINES", {})
    monkeypatch.setattr(prove, budget, value)
    report = check_files(*_case(tmp_path, _times(3.0), _adds("x", "x", "x"), X, "Replicate"))
    assert not report.refines, str(report)
    assert report.stats["bounded"] > 0, report.stats


@pytest.mark.slow
def test_a_runaway_rule_stops_at_the_default_budget(tmp_path: Path) -> None:
    """scale-sum and sum-flatten without their guard are the runaway this file is about (the
    expectation's step: 2.7K, 113K matches, then an iteration of more than 20 minutes): the
    bound stops it one iteration ahead, and the proof, found before the e-graph ran away,
    stands."""
    base = load_registry()
    rules = [dataclasses.replace(r, text=r.text.replace(" (= (SumStop ms) false)", "").replace(" (= (SumStop ms2) false)", ""))
             for r in base.rules]
    assert rules != base.rules
    registry = dataclasses.replace(base, rules=rules)
    report = check(*_load(tmp_path, _times(3.0), _adds("x", "x", "x"), X, "Replicate", registry), registry)
    assert report.refines, str(report)
    assert report.stats["bounded"] > 0, report.stats


@pytest.mark.slow
def test_the_harness_checks_the_self_sum_index() -> None:
    """A wrong SumStop index (every sum said to hold like terms) is caught by the soundness
    harness, which reads its true entries back (refine/prove/harness.py)."""
    reg = load_registry()
    bad = dataclasses.replace(rule("bad-sum-self", ["(= e (Sum ms))"], ["(set (SumStop ms) true)"], analysis=True),
                              family="bad")
    reg = dataclasses.replace(reg, rules=[*reg.rules, bad], ops=dict(reg.ops), decls=list(reg.decls),
                              families=list(reg.families))
    (res,) = Harness(reg, seed=0, instances=1).run(["scale-sum"])
    assert any(f.startswith("SumStop: ") for f in res.failures), res.failures
