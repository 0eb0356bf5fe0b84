"""refine.testing: the helper a team calls from its own pytest suite. It passes on the verdict
asked for and returns the report; otherwise its AssertionError carries the report (the
verdict, the culprit's line, the counterexample) and can write the counterexample's inputs;
bad input is an InputError, never an assertion."""

from __future__ import annotations

from pathlib import Path

import pytest

from refine import InputError
from refine.testing import assert_does_not_refine, assert_refines
from refine.verdict import counterexample
from tests.helpers import MODELS
from tests.helpers.capture import load_model


def _pair(name: str) -> tuple[Path, Path]:
    return MODELS / name / "seq.json", MODELS / name / "dist.json"


def test_a_correct_pair_passes_and_returns_its_report() -> None:
    assert assert_refines(_pair("tp_mlp")).refines


def test_a_bug_fails_with_the_report_and_writes_the_counterexample(tmp_path: Path) -> None:
    with pytest.raises(AssertionError) as e:
        assert_refines(_pair("tp_mlp_bug_bias_before_sum"), counterexample=tmp_path / "cex")
    text = str(e.value)
    assert text.startswith("expected REFINES, got DOES NOT REFINE")
    assert "fc2_bias" in text and "counterexample inputs written to" in text
    assert counterexample.load(tmp_path / "cex").failing()


def test_a_kept_buggy_twin_passes_the_converse() -> None:
    assert assert_does_not_refine(_pair("tp_mlp_bug_bias_before_sum")).verdict == "DOES NOT REFINE"
    with pytest.raises(AssertionError, match="expected DOES NOT REFINE, got REFINES"):
        assert_does_not_refine(_pair("tp_mlp"))


def test_a_capture_spec_is_captured_then_checked() -> None:
    tp = load_model("tp_mlp")
    assert assert_refines(tp.make_case()).refines
    with pytest.raises(AssertionError, match="DOES NOT REFINE"):
        assert_refines(tp.make_case(bug="bias_before_sum"))


def test_bad_input_is_an_input_error_not_a_failed_assertion(tmp_path: Path) -> None:
    (tmp_path / "seq.json").write_text("{not json")
    with pytest.raises(InputError):
        assert_refines((tmp_path / "seq.json", MODELS / "tp_mlp" / "dist.json"))
    with pytest.raises(TypeError, match="capture.Spec"):
        assert_refines(42)
