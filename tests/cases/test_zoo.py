"""The model zoo (models/zoo): every program states its configurations and bugs consistently,
every correct configuration REFINES and every bug gives DOES NOT REFINE naming its line.

The quick tier (CI) checks each program's smoke configuration and its smoke bugs; the slow
tier checks everything else. A program whose packages are not installed is skipped, naming
them. Program-specific facts (which relations a plan gives, which collectives a rank runs)
are the programs' own test files' (tests/cases/test_zoo_<name>.py).
"""

from __future__ import annotations

import inspect

import pytest

from models.zoo import Entry, Program, load, missing, names
from refine import capture


def _entry(name: str) -> Entry:
    absent = missing(name)
    if absent:
        pytest.skip(f"zoo program {name} needs {', '.join(absent)} (not installed)")
    return load(name)


def _cases() -> list[object]:
    """(program, config, bug) for every correct configuration and every bug; the smoke ones
    quick, the rest slow. Read without importing the programs (their packages may be absent)."""
    out = []
    for name in names():
        if missing(name):
            out.append(pytest.param(name, None, None, id=f"{name}:(not installed)"))
            continue
        p: Program = load(name).program
        for config in p.configs:
            marks = [] if config == p.smoke else [pytest.mark.slow]
            out.append(pytest.param(name, config, None, marks=marks, id=f"{name}:{config}"))
        for bug, b in p.bugs.items():
            marks = [] if b.smoke else [pytest.mark.slow]
            out.append(pytest.param(name, b.config, bug, marks=marks, id=f"{name}:{bug}"))
    return out


def test_ci_checks_bugs() -> None:
    """The quick tier checks some bugs (a bug whose search takes minutes is left to the slow tier)."""
    assert any(b.smoke for n in names() if not missing(n) for b in load(n).program.bugs.values())


@pytest.mark.parametrize("name", names())
def test_each_program_states_its_configurations_and_marks_its_bugs(name: str) -> None:
    e = _entry(name)
    p = e.program
    assert len(p.configs) >= 2, "each zoo program runs in at least two parallel configurations"
    assert p.bugs, "each zoo program carries at least one realistic bug"
    signature = inspect.signature(e.make_case)
    for config in p.configs:
        signature.bind(config)
    marked = e.marked()
    for bug, b in p.bugs.items():
        assert b.what, bug
        if b.upstream is None:
            assert bug in marked, f"bug {bug!r}: no line of {e.path.name} is marked `# BUG: {bug}`"
        else:
            assert e.culprit_lines(bug), f"bug {bug!r}: no line of {b.upstream[0]} holds {b.upstream[1]!r}"
    with pytest.raises(ValueError, match="unknown bug"):
        e.make_case(p.smoke, bug="no_such_bug")
    with pytest.raises(ValueError, match="unknown configuration"):
        e.make_case("no_such_config")



@pytest.mark.parametrize(("name", "config", "bug"), _cases())
def test_the_zoo_verdicts(name: str, config: str | None, bug: str | None) -> None:
    e = _entry(name)
    assert config is not None
    report = capture(e.make_case(config, bug=bug)).check()
    if bug is None:
        assert report.verdict == "REFINES", str(report)
        return
    assert report.verdict == "DOES NOT REFINE", str(report)
    c = report.culprit
    named = c is not None and c.rank_source in e.culprit_lines(bug)
    miss = e.program.bugs[bug].known_miss
    if miss:
        assert not named, f"the report names the bug's line now: drop Bug.known_miss ({miss})"
        pytest.xfail(f"{miss} (names {c.rank_source if c else None})")
    assert named, (c.rank_source if c else None, str(report))
