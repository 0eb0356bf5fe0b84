"""refine in a team's own test suite: one call that fails a test with the report's reasons.

    from refine.testing import assert_refines

    def test_tensor_parallel_mlp_refines():
        assert_refines(my_models.make_spec())          # a capture.Spec: captured, then checked
        assert_refines(("case/seq.json", "case/dist.json"))

`assert_refines` passes only on REFINES (a proof). Otherwise it raises `AssertionError` whose
message is the report as `refine check` prints it (the verdict, each output's relation and
expectation, the first node that does not refine with its source line, the counterexample
when there is one), followed by a line saying how to reproduce it; with `counterexample=DIR`
the counterexample's inputs are written there to load again (`refine.verdict.counterexample`).
Bad input still raises `refine.InputError` (or a capture error), never an assertion: a test
that cannot state its case is broken, not red. `assert_does_not_refine` is the converse for
a buggy twin kept in the suite: it passes only on DOES NOT REFINE, a counterexample found.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from refine.check import check_files
from refine.verdict.report import Report

Case = Any  # a refine.capture.Spec or Case, a (seq.json, dist.json) pair, or a Report


def report_of(case: Case, rules: list[str | Path] | None = None) -> Report:
    """The report for what a test holds: captured first when it is a Spec."""
    if isinstance(case, Report):
        return case
    if isinstance(case, (tuple, list)) and len(case) == 2:
        return check_files(Path(case[0]), Path(case[1]), rules=[Path(r) for r in rules or []])
    from refine.frontends import capture

    if isinstance(case, capture.Spec):
        case = capture.capture(case)
    if isinstance(case, capture.Case):
        if rules:
            raise TypeError("rules= applies to graph files; a captured case uses the registry it was captured with")
        return case.check()
    raise TypeError(f"assert_refines takes a capture.Spec, a capture.Case, a (seq.json, dist.json) pair or a Report, "
                    f"not {type(case).__name__}")


def _fail(report: Report, want: str, counterexample: str | Path | None) -> None:
    lines = [f"expected {want}, got {report.verdict}", str(report).rstrip()]
    search = report.search
    if search is not None and search.found is not None:
        if counterexample is not None:
            from refine.verdict import counterexample as cex

            cex.write(search.found, counterexample)
            lines.append(f"counterexample inputs written to {counterexample} (refine.verdict.counterexample.load)")
        else:
            lines.append("pass counterexample=DIR to write the counterexample's inputs")
    raise AssertionError("\n".join(lines))


def assert_refines(case: Case, *, rules: list[str | Path] | None = None,
                   counterexample: str | Path | None = None) -> Report:
    """Pass on REFINES and return the report; raise AssertionError with the report otherwise."""
    report = report_of(case, rules)
    if report.verdict != "REFINES":
        _fail(report, "REFINES", counterexample)
    return report


def assert_does_not_refine(case: Case, *, rules: list[str | Path] | None = None) -> Report:
    """Pass on DOES NOT REFINE (a counterexample found) and return the report: a buggy twin
    a suite keeps to show the check catches it. UNPROVEN fails: no evidence."""
    report = report_of(case, rules)
    if report.verdict != "DOES NOT REFINE":
        _fail(report, "DOES NOT REFINE", None)
    return report
