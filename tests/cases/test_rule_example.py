"""The worked example of rules/README.md, executed: a new op (`cumprod`) is unknown without
its rule file, its rules pass the soundness harness (and a wrong one does not), and with
`--rules` the example model refines while its buggy twin is localized."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from refine.ops.registry import load_registry, rewrite
from refine.prove.harness import Harness
from tests.helpers import ROOT

EXAMPLE = ROOT / "models" / "rule_example"


def _refine(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "refine.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def _case(name: str) -> tuple[str, str]:
    return str(EXAMPLE / name / "seq.json"), str(EXAMPLE / name / "dist.json")


def test_checked_in_cases_are_regenerated() -> None:
    spec = importlib.util.spec_from_file_location("make_case", EXAMPLE / "_make_case.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name, bug in (("case", False), ("case_bug", True)):
        seq, dist = mod.make(bug)
        assert json.loads((EXAMPLE / name / "seq.json").read_text()) == seq
        assert json.loads((EXAMPLE / name / "dist.json").read_text()) == dist


def test_without_the_rule_file_the_op_is_unknown() -> None:
    r = _refine("check", *_case("case"))
    assert r.returncode == 2
    assert "unknown op 'cumprod'" in r.stderr and "$.graph.nodes[0].op" in r.stderr


@pytest.mark.slow
def test_the_new_rules_are_sound_and_fire() -> None:
    reg = load_registry([EXAMPLE])
    results = {r.rule: r for r in Harness(reg, seed=0).run(["cumprod-over-cat", "slice-into-cumprod"])}
    assert set(results) == {"cumprod-over-cat", "slice-into-cumprod"}
    for r in results.values():
        assert r.fired and r.checked > 0 and not r.failures, r


@pytest.mark.slow
def test_a_wrong_cumprod_rule_is_caught() -> None:
    reg = load_registry([EXAMPLE])
    # wrong: along its own dim a running product does not split (the second block needs the first's total)
    bad = rewrite("cumprod-over-cat-same-dim", "(cumprod (cat a b d) d)", "(cat (cumprod a d) (cumprod b d) d)")
    reg = replace(reg, rules=[*reg.rules, replace(bad, family="bad")], ops=dict(reg.ops), decls=list(reg.decls),
                  families=list(reg.families))
    (res,) = Harness(reg, seed=0).run(["cumprod-over-cat-same-dim"])
    assert res.fired and res.failures


@pytest.mark.slow
def test_with_the_rule_file_the_model_refines_and_the_bug_is_found() -> None:
    ok = _refine("check", *_case("case"), "--rules", str(EXAMPLE))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "REFINES" in ok.stdout
    bug = _refine("check", *_case("case_bug"), "--rules", str(EXAMPLE), "--format", "json")
    assert bug.returncode == 1, bug.stdout + bug.stderr
    report = json.loads(bug.stdout)
    assert report["culprit"]["node"] == "running" and report["culprit"]["op"] == "cumprod"
