"""`refine check --rules DIR` verifies what DIR adds before using it (refine/prove/extra_rules.py).

Each wrong rule directory below makes a buggy bundled example REFINE when its rules are used
unchecked (the premise, shown with `refine.check.check` on the registry, which does not
verify); through `refine check` it is refused with exit 2 naming the rule, its file and why,
with or without --trust-rules. What the harness cannot exercise is refused unless trusted,
and a trusted check says so in its report. A verification is cached by content: a second
check does not run the harness, an edited file is verified again, a corrupted or tampered
cache entry is ignored.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from refine.check import SoundnessFailure, check
from refine.cli import main
from refine.frontends.build import GraphBuilder, dist_doc, seq_doc, write_case
from refine.frontends.graphfile import load_dist, load_seq
from refine.ops.registry import load_registry
from refine.prove import extra_rules, harness
from tests.helpers import ROOT

MODELS = ROOT / "models"
EXAMPLE = MODELS / "rule_example"

CUMPROD = '''import torch

from refine.ops.registry import Op, ShapeError, rewrite


def _shape(ins, attrs):
    (x,) = ins
    if not 0 <= attrs["dim"] < x.ndim:
        raise ShapeError("bad dim")
    return x


OPS = [Op("cumprod", 1, _shape, (("dim", "dim"),), ref=lambda x, dim: torch.cumprod(x, dim), core=True,
          egglog_shape="(rule ((= e (cumprod x d)) (= s (shape x))) ((set (shape e) s)))")]
RULES = [
    rewrite("tmp-cumprod-over-cat", "(cumprod (cat a b d) d2)", "(cat (cumprod a d2) (cumprod b d2) d)", "COND"),
    rewrite("slice-into-cumprod", "(slice (cumprod x d2) d s e)", "(cumprod (slice x d s e) d2)", "(!= d d2)"),
]
'''

VIEW_CAT = '''from refine.ir.term import Term
from refine.ops.registry import rewrite

# wrong: a view of a concat along dim 1 back to the rows' shape is not the concat along dim 0
RULES = [rewrite("tmp-view-cat-rows", "(view (cat a b 1) s)", "(cat a b 0)",
                 "(= s (vec-of (d+ (size a 0) (size b 0)) (size a 1)))", "(= (size a 1) (size b 1))",
                 "(= (ndim a) 2)")]
'''
VIEW_CAT_SEEDS = VIEW_CAT + '''

def SEEDS(gen):
    return [Term("view", (Term("cat", (gen.leaf((2, 3)), gen.leaf((2, 3))), (1,)),), ((4, 3),))]
'''

# name: (rule file, bundled buggy case, the wrong rule)
WRONG = {
    # x + x collected as 1 x: the sum of an all_reduce done twice looks like one
    "constant-factor": ('''from refine.ops.registry import rule

ONE = "(bigrat (bigint 1) (bigint 1))"
RULES = [rule("tmp-sum-duplicate-factor", ["(= e (Sum ms))", "(SumHas e a)", "(= s (shape e))", "(= s (shape a))",
                                           "(multiset-contains ms a)", "(!= e a)",
                                           "(multiset-contains (multiset-remove ms a) a)"],
              [f"(union e (Sum (multiset-insert (multiset-remove (multiset-remove ms a) a) (Scale a {ONE}))))"])]
''', "tp_mlp_bug_double_all_reduce", "tmp-sum-duplicate-factor"),
    # equal pieces of a concat swapped: a gather in the reversed rank order looks right
    "concat-order": ('''from refine.ops.registry import rewrite

RULES = [rewrite("tmp-cat-swap-equal", "(cat a b d)", "(cat b a d)", "(= (size a d) (size b d))")]
''', "sp_mlp_bug_gather_wrong_order", "tmp-cat-swap-equal"),
    # the concat's dim confused (given seed terms that reach it: without them it is untested)
    "wrong-dim": (VIEW_CAT_SEEDS, "sp_mlp_bug_gather_wrong_dim", "tmp-view-cat-rows"),
    # a side condition that holds for the wrong case (it should be (!= d d2)): a running product
    # over the sharded dim looks like one over each shard
    "side-condition": (CUMPROD.replace("COND", "(d<= (size a d) (size b d))"), "rule_example/case_bug",
                       "tmp-cumprod-over-cat"),
}


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of this test's own, and a count of the harnesses built."""
    d = tmp_path / "cache"
    monkeypatch.setenv(extra_rules.CACHE_ENV, str(d))
    return d


@pytest.fixture
def harnesses(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    built: list[bool] = []
    real = harness.Harness

    def counting(*args: Any, **kwargs: Any) -> harness.Harness:
        built.append(bool(kwargs.get("symbolic")))
        return real(*args, **kwargs)

    monkeypatch.setattr(harness, "Harness", counting)
    return built


def _rules_dir(tmp_path: Path, name: str, text: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / f"{name.replace('-', '_')}.py").write_text(text)
    return d


def _case(case: str | Path) -> list[str]:
    d = case if isinstance(case, Path) else MODELS / case
    return [str(d / "seq.json"), str(d / "dist.json")]


def _check(case: str | Path, *args: str) -> Result:
    return CliRunner().invoke(main, ["check", *_case(case), *args], terminal_width=400)


def _refines_unverified(case: str | Path, rules: Path) -> bool:
    """The verdict with the directory's rules used unchecked (what `refine check` did before),
    without the self check; with it, that false REFINES is a SoundnessFailure."""
    reg = load_registry([rules])
    seq_path, dist_path = _case(case)
    seq = load_seq(seq_path, reg)
    dist = load_dist(dist_path, reg, seq)
    refines = check(seq, dist, reg, self_check=False).refines
    if refines:
        with pytest.raises(SoundnessFailure):
            check(seq, dist, reg, self_check=True)
    return refines


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(WRONG))
def test_a_wrong_rule_is_refused_naming_it(tmp_path: Path, shape: str) -> None:
    text, case, rule = WRONG[shape]
    rules = _rules_dir(tmp_path, shape, text)
    assert _refines_unverified(case, rules), "premise: the wrong rule makes the bug REFINE"
    plain = _check(case, *(["--rules", str(EXAMPLE)] if case.startswith("rule_example") else []))
    assert plain.exit_code == 1, plain.output  # with the right rules the bug is found
    for extra in ([], ["--trust-rules"], ["--format", "json"]):
        r = _check(case, "--rules", str(rules), *extra)
        assert r.exit_code == 2, r.output
        assert f"{rules / (shape.replace('-', '_') + '.py')}: rule {rule}: unsound: the soundness harness found a " \
               "counterexample" in r.output
        assert "REFINES" not in r.output


def test_an_untested_rule_is_refused_unless_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrong-dim rule without its seed terms: no seed makes it fire, so it is untested.
    Trusted, it gives a false REFINES, which only a self check (numbers) can catch."""
    monkeypatch.setenv("REFINE_SELF_CHECK", "0")  # the CLI as users run it
    rules = _rules_dir(tmp_path, "view_cat", VIEW_CAT)
    case = "sp_mlp_bug_gather_wrong_dim"
    assert _refines_unverified(case, rules)
    r = _check(case, "--rules", str(rules))
    assert r.exit_code == 2, r.output
    assert f"{rules / 'view_cat.py'}: rule tmp-view-cat-rows: untested: no seed term" in r.output
    assert "--trust-rules" in r.output
    # trusted, the verdict is the wrong rule's, and the report says it rests on it
    trusted = _check(case, "--rules", str(rules), "--trust-rules", "--format", "json")
    assert trusted.exit_code == 0, trusted.output
    report = json.loads(trusted.output)
    assert report["verdict"] == "REFINES"
    assert len(report["unverified_rules"]) == 1 and "rule tmp-view-cat-rows: untested" in report["unverified_rules"][0]
    text = _check(case, "--rules", str(rules), "--trust-rules")
    assert text.exit_code == 0 and "unverified rules used" in text.output and "tmp-view-cat-rows" in text.output
    checked = _check(case, "--rules", str(rules), "--trust-rules", "--self-check")
    assert checked.exit_code == 2 and "SoundnessFailure" in checked.output, checked.output


# ops and declarations the harness cannot check: each refused unless trusted
UNTESTED = {
    "collective": ('''from refine.ops.registry import Op

OPS = [Op("tmp_all_reduce_half", 1, lambda ins, a: ins[0], (("group", "ints"),), kind="collective",
          lower=lambda xs, i, a, size: xs[0])]
''', "op tmp_all_reduce_half", "a new collective"),
    "unsampled-op": ('''from fractions import Fraction

from refine.ops.registry import Op

OPS = [Op("tmp_scaled", 1, lambda ins, a: ins[0], (("k", "float"),), ref=lambda x, k: k * x,
          decompose=lambda b, args, attrs, t: b.scale(args[0], Fraction(attrs["k"])))]
''', "op tmp_scaled", "could not try its decomposition"),
    "decl-rule": ('''DECLS = ["(relation TmpSeen (i64))", "(rule ((TmpSeen n)) ((TmpSeen (+ n 0))))"]
''', "DECLS", "is not only declarations (rule)"),
    "shape-rule-union": ('''from refine.ops.registry import Op

# right, but a rewrite hidden in the shape rule would never be verified
OPS = [Op("tmp_neg", 1, lambda ins, a: ins[0], ref=lambda x: -x, core=True,
          egglog_shape="(rule ((= e (tmp_neg x)) (= s (shape x))) ((set (shape e) s))) "
                       "(rewrite (tmp_neg (tmp_neg x)) x)")]
''', "op tmp_neg", "does more than set (shape e)"),
}


@pytest.mark.parametrize("shape", sorted(UNTESTED))
def test_unchecked_ops_and_declarations_are_refused_unless_trusted(tmp_path: Path, shape: str) -> None:
    text, item, why = UNTESTED[shape]
    rules = _rules_dir(tmp_path, shape, text)
    r = _check("tp_mlp", "--rules", str(rules))
    assert r.exit_code == 2, r.output
    assert f"{rules / (shape.replace('-', '_') + '.py')}: {item}: untested: " in r.output and why in r.output
    trusted = _check("tp_mlp", "--rules", str(rules), "--trust-rules", "--format", "json")
    assert trusted.exit_code == 0, trusted.output
    assert any(item in u and why in u for u in json.loads(trusted.output)["unverified_rules"])


def _double_case(tmp_path: Path, rules: Path) -> Path:
    """seq: double(x); each rank: x * 3 (a bug)."""
    reg = load_registry([rules])
    s = GraphBuilder(reg)
    s.output("y", s.op("tmp_double", s.input("x", [4, 3]), name="d"))
    ranks = {}
    for r in range(2):
        g = GraphBuilder(reg)
        x = g.input("x", [4, 3])
        g.output("y", g.op("mul", x, 3.0, name="triple"))
        ranks[r] = g
    case = tmp_path / "double_case"
    write_case(case, seq_doc(s), dist_doc({"tp": 2}, ranks, [{"from": "x", "placements": ["Replicate"]}],
                                          [{"output": "y", "placements": ["Replicate"]}]))
    return case


def test_a_wrong_decomposition_is_refused(tmp_path: Path) -> None:
    """An op's lowering is checked against its torch reference: `tmp_double` (2x) decomposed
    as 3x would make a rank computing 3x refine."""
    rules = _rules_dir(tmp_path, "double", '''from fractions import Fraction

from refine.ops.registry import Op

OPS = [Op("tmp_double", 1, lambda ins, a: ins[0], ref=lambda x: 2 * x,
          decompose=lambda b, args, attrs, t: b.scale(args[0], Fraction(3)))]
''')
    case = _double_case(tmp_path, rules)
    assert _refines_unverified(case, rules)
    for extra in ([], ["--trust-rules"]):
        r = _check(case, "--rules", str(rules), *extra)
        assert r.exit_code == 2, r.output
        assert f"{rules / 'double.py'}: op tmp_double: unsound: its decomposition differs from its torch reference" \
            in r.output


@pytest.mark.slow
def test_a_new_op_declared_elementwise_wrongly_is_refused(tmp_path: Path) -> None:
    """The built-in templates make rules for every unary op (through concats, into slices):
    for a new op they are new rules, verified like the family's own. A reversal declared
    `kind="unary"` is not elementwise, and the template's rule for it is refused."""
    rules = _rules_dir(tmp_path, "flip", '''from refine.ops.registry import Op

OPS = [Op("tmp_flip", 1, lambda ins, a: ins[0], ref=lambda x: x.flip(0), core=True, kind="unary")]
''')
    r = _check("tp_mlp", "--rules", str(rules), "--trust-rules")
    assert r.exit_code == 2, r.output
    assert "rules/elementwise.py: rule tmp_flip-over-cat: unsound: the soundness harness found a counterexample " \
           "(concrete sizes) (a built-in template made it for a new op)" in r.output
    # declared right, the same op's template rules pass
    (rules / "flip.py").write_text((rules / "flip.py").read_text().replace("x.flip(0)", "x.flip(0).flip(0)"))
    ok = _check("tp_mlp", "--rules", str(rules), "--format", "json")
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["unverified_rules"] == []


def _cache_files(cache: Path) -> list[Path]:
    return sorted((cache / "verified-rules").glob("*.json"))


@pytest.mark.slow
def test_a_correct_family_is_verified_once_and_cached(tmp_path: Path, cache: Path, harnesses: list[bool]) -> None:
    rules = tmp_path / "cumprod_rules"
    rules.mkdir()
    shutil.copy(EXAMPLE / "cumprod.py", rules / "cumprod.py")
    case = EXAMPLE / "case"
    first = _check(case, "--rules", str(rules))
    assert first.exit_code == 0 and "REFINES" in first.output, first.output
    assert "unverified" not in first.output
    assert harnesses == [False, True]  # concrete and symbolic sizes, once each
    (entry,) = _cache_files(cache)
    assert json.loads(entry.read_text())["body"]["rules"] == ["cumprod-over-cat", "slice-into-cumprod"]
    second = _check(case, "--rules", str(rules))
    assert second.exit_code == 0 and "REFINES" in second.output
    assert harnesses == [False, True]  # the cache answered
    # the buggy twin with the same verified rules: found, from the cache
    bug = _check(EXAMPLE / "case_bug", "--rules", str(rules))
    assert bug.exit_code == 1, bug.output
    assert harnesses == [False, True]

    # an edit verifies again (a comment too: the key is the content)
    (rules / "cumprod.py").write_text((rules / "cumprod.py").read_text() + "\n# edited\n")
    third = _check(case, "--rules", str(rules))
    assert third.exit_code == 0, third.output
    assert len(harnesses) == 4 and len(_cache_files(cache)) == 2

    # a corrupted entry is ignored: verified again and written whole
    for entry in _cache_files(cache):
        entry.write_text('{"body": {"format": 1, "key": "')
    again = _check(case, "--rules", str(rules))
    assert again.exit_code == 0, again.output
    assert len(harnesses) == 6
    key = extra_rules.verification_key(load_registry([rules]), [str(rules)])
    stored = extra_rules.read_cached(key)
    assert stored is not None and stored.findings == [] and stored.rules == ["cumprod-over-cat", "slice-into-cumprod"]


@pytest.mark.slow
def test_an_edited_rule_file_is_read_again_in_the_same_process(tmp_path: Path, harnesses: list[bool]) -> None:
    """A long-lived process (a notebook) that edits a verified family into a wrong one gets
    the new rules verified, not the old registry under the new content's key."""
    rules = tmp_path / "cumprod_rules"
    rules.mkdir()
    (rules / "cumprod.py").write_text(CUMPROD.replace("COND", "(!= d d2)"))
    ok = _check(EXAMPLE / "case", "--rules", str(rules))
    assert ok.exit_code == 0, ok.output
    (rules / "cumprod.py").write_text(CUMPROD.replace("COND", "(d<= (size a d) (size b d))"))
    bad = _check(EXAMPLE / "case_bug", "--rules", str(rules))
    assert bad.exit_code == 2, bad.output
    assert "rule tmp-cumprod-over-cat: unsound" in bad.output


@pytest.mark.slow
def test_a_tampered_cache_entry_is_not_trusted(tmp_path: Path, cache: Path) -> None:
    """An entry claiming a wrong rule verified, without a matching checksum or under another
    key, is ignored: the rule is verified again and refused."""
    text, case, rule = WRONG["side-condition"]
    rules = _rules_dir(tmp_path, "side", text)
    assert _check(case, "--rules", str(rules)).exit_code == 2
    (entry,) = _cache_files(cache)
    doc = json.loads(entry.read_text())
    assert doc["body"]["findings"]
    doc["body"]["findings"] = []  # "verified", but the checksum is the old one
    entry.write_text(json.dumps(doc))
    r = _check(case, "--rules", str(rules))
    assert r.exit_code == 2 and f"rule {rule}: unsound" in r.output, r.output
    # a whole, intact entry of another directory's verification put under this key
    good = tmp_path / "good"
    good.mkdir()
    shutil.copy(EXAMPLE / "cumprod.py", good / "cumprod.py")
    assert _check(EXAMPLE / "case", "--rules", str(good)).exit_code == 0
    key = extra_rules.verification_key(load_registry([rules]), [str(rules)])
    other = next(e for e in _cache_files(cache) if e.stem != key)
    shutil.copy(other, extra_rules.cache_path(key))
    r = _check(case, "--rules", str(rules))
    assert r.exit_code == 2 and f"rule {rule}: unsound" in r.output, r.output


def test_help_says_a_rules_dir_is_trusted_code() -> None:
    r = CliRunner().invoke(main, ["check", "--help"], terminal_width=200)
    assert r.exit_code == 0
    text = " ".join(r.output.split())
    assert "imported and run as trusted code" in text and "--trust-rules" in text
