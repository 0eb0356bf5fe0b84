"""End to end through the CLI: verdicts, exit codes and localization on the bundled examples."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import MODELS


def run_check(case: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "refine.cli", "check", str(MODELS / case / "seq.json"),
         str(MODELS / case / "dist.json"), *extra],
        capture_output=True, text=True, timeout=600,
    )


def test_tp_mlp_refines_with_relation_printed() -> None:
    p = run_check("tp_mlp")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "REFINES" in p.stdout
    assert "y@0" in p.stdout


@pytest.mark.parametrize("case,node", [
    ("tp_mlp_bug_bias_before_sum", "fc2_bias"),
    ("tp_mlp_bug_missing_all_reduce", "fc2_bias"),
])
def test_tp_mlp_bugs_are_localized(case: str, node: str) -> None:
    p = run_check(case, "--format", "json")
    assert p.returncode == 1, p.stdout + p.stderr
    report = json.loads(p.stdout)
    assert report["verdict"] == "DOES NOT REFINE"
    assert report["culprit"]["node"] == node
    assert report["culprit"]["source"].startswith("make_examples.py:")
