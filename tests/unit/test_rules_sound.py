"""Every rewrite rule, alone in an e-graph of random well-shaped seed terms, only merges
terms that evaluate (torch, float64) to the same tensor; and every rule fires on some seed.
See refine/prove/harness.py for the design."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from refine.ops.registry import Rule, load_registry, rewrite
from refine.prove.harness import Harness, RuleResult

REG = load_registry()
RULE_NAMES = [r.name for r in REG.rules]


@pytest.fixture(scope="module")
def results() -> dict[str, RuleResult]:
    t0 = time.perf_counter()
    h = Harness(REG, seed=0)
    out = {r.rule: r for r in h.run()}
    print(f"rule soundness: {len(out)} rules, {len(h.seed_terms)} seeds, {time.perf_counter() - t0:.1f}s")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", RULE_NAMES)
def test_rule_is_sound(results: dict[str, RuleResult], name: str) -> None:
    r = results[name]
    assert not r.failures, f"rule {name} is unsound on random seeds:\n" + "\n".join(r.failures[:8])


@pytest.mark.slow  # the harness run over every rule it shares with test_rule_is_sound
def test_every_rule_fires(results: dict[str, RuleResult]) -> None:
    missing = sorted(n for n in RULE_NAMES if not results[n].fired)
    assert not missing, f"rules never exercised by the seeds: {missing}"


@pytest.mark.slow  # the harness run over every rule it shares with test_rule_is_sound
def test_every_rule_is_checked(results: dict[str, RuleResult]) -> None:
    assert set(results) == set(RULE_NAMES)
    assert all(r.checked > 0 for r in results.values())


BAD = [
    rewrite("bad-slice-cat", "(slice (cat a b d) d s e)", "(slice b d s e)"),
    rewrite("bad-scale-drop", "(Scale x r)", "x"),
    rewrite("bad-rsum-over-cat", "(rsum (cat a b d) d)", "(cat (rsum a d) (rsum b d) d)"),
    rewrite("bad-transpose-cat", "(transpose (cat a b d) i j)", "(cat (transpose a i j) (transpose b i j) d)"),
    rewrite("bad-matmul-rows", "(matmul (cat p q d) b)", "(cat (matmul p b) (matmul q b) d)"),
    # the second piece of a split index reads the input's later rows; accumulations add up
    rewrite("bad-gather-cat-index", "(gather x (cat p q d) g)", "(cat (gather x p g) (gather x q g) d)"),
    rewrite("bad-index-put-cat", "(index_put_acc (cat p q 0) v sh)",
            "(index_put_acc p (slice v 0 (dim 0) (size p 0)) sh)"),
]


def test_the_harness_catches_unsound_rules() -> None:
    bad = [Rule(r.name, r.text, "bad") for r in BAD]
    reg = replace(REG, rules=list(REG.rules) + bad, ops=dict(REG.ops), decls=list(REG.decls),
                  families=list(REG.families))
    h = Harness(reg, seed=0, instances=1)
    res = {r.rule: r for r in h.run([r.name for r in bad])}
    for r in bad:
        assert res[r.name].fired, r.name
        assert res[r.name].failures, f"{r.name} should have been caught"


# The same rules compiled for symbolic sizes (sizes are PyObjects and every size test calls
# refine.ir.sizes): on concrete seeds they must merge exactly what they merge as i64 rules.
SYMBOLIC_NAMES = [r.name for r in REG.rules if r.symbolic]


@pytest.fixture(scope="module")
def symbolic_results() -> dict[str, RuleResult]:
    h = Harness(REG, seed=1, symbolic=True)
    return {r.rule: r for r in h.run()}


@pytest.mark.slow
def test_symbolic_rules_are_sound_and_fire(symbolic_results: dict[str, RuleResult]) -> None:
    assert set(symbolic_results) == set(SYMBOLIC_NAMES)
    # only rules that turn sizes into numbers (f64 constants, big rationals) are concrete-only
    concrete_only = [r for r in REG.rules if not r.symbolic]
    assert all(any(w in r.text for w in ("to-f64", "bigint")) for r in concrete_only), concrete_only
    # the vocab-offset rules of embedding.py, embedding_grad.py, loss.py and masked_lookup.py
    # (bounds read from f64 constants; masked_lookup.py's DTensor and flat-index forms of the
    # lookup added 4); a new one must be added here knowingly
    assert len(concrete_only) <= 19, [r.name for r in concrete_only]
    unsound = {n: r.failures[:3] for n, r in symbolic_results.items() if r.failures}
    assert not unsound, unsound
    silent = sorted(n for n, r in symbolic_results.items() if not r.fired)
    assert not silent, f"symbolic rules never exercised: {silent}"


def test_family_seeds_reach_the_rules_they_fit() -> None:
    """A family's SHARED_SEEDS go to every rule, of any family, whose query's constructors
    they hold (a view of a concat in reshape.py is merge_view.py's match too); its SEEDS
    (whole formulas) to its own rules only. The harness holds no seed of its own."""
    h = Harness(REG, seed=0, instances=1)
    shared = {t: f for f, ts in h.gen.shared_seeds.items() for t in ts}
    own = {t: f for f, ts in h.gen.family_seeds.items() for t in ts}
    assert {"structure", "reshape", "loss"} <= set(h.gen.shared_seeds)
    assert not set(h.seed_terms) & (set(shared) | set(own))
    across = 0
    for _, r in h.checked_rules:
        given = set(h.seeds_for(r))
        heads = h.heads[r.name]
        for t, f in shared.items():
            if heads <= t.ops():
                assert t in given, (r.name, f, str(t))
                across += f != r.family
        for t, f in own.items():
            assert (t in given) == (f == r.family and heads <= t.ops()), (r.name, f, str(t))
    assert across > 0  # some shared seed exercises another family's rule
