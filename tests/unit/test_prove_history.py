"""A check's verdict does not depend on what the process checked before it (issue 21).

The engine keeps e-graphs across steps and checks (refine.prove.engine.Engine._graph); it
used to grow a kept one with the rules a step lacked, declared after its others. egglog's
rule iteration depends on the order its rules were declared in (which matches it counts,
which terms it makes, which of equally cheap terms it extracts), so such an e-graph gave
aws_llama TP6's steps other results after other checks than alone, and its scores `dot_91`
no clean relation. Here: every e-graph a step runs on declares its rules and tables in the
one order of a fresh e-graph, and a check after others steps, relates and concludes as it
does alone in a fresh engine."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from refine.check import check_files
from refine.prove import declarations
from refine.prove import engine as prove
from tests.helpers import MODELS

check_mod = sys.modules["refine.check"]  # the package exports the function `check` under the same name
EARLIER = ("tp_attention_4ranks", "vocab_embedding_4ranks")  # their kept e-graphs are grown by the last one's steps
LAST = "tp_mlp_bug_bias_before_sum"


def _steps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Every step's result from now on, as the walk sees it."""
    seen: list[tuple[Any, ...]] = []
    step = prove.Engine.step

    def recorded(self: prove.Engine, *args: Any, **kwargs: Any) -> Any:
        r = step(self, *args, **kwargs)
        seen.append((str(r.best), r.cost, r.found, r.checks, r.same, r.bounded))
        return r

    monkeypatch.setattr(prove.Engine, "step", recorded)
    return seen


def _check(case: str) -> tuple[Any, ...]:
    report = check_files(MODELS / case / "seq.json", MODELS / case / "dist.json")
    culprit = (report.culprit.node, report.culprit.output) if report.culprit else None
    return (report.refines, culprit, [(o.name, str(o.relation)) for o in report.outputs],
            {k: report.stats[k] for k in ("steps", "replayed", "bounded")})


def test_a_check_after_others_is_the_check_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check_mod, "_ENGINES", {})  # a fresh engine: no kept e-graph, no cached step
    alone_steps = _steps(monkeypatch)
    alone = _check(LAST)
    alone_steps = list(alone_steps)

    monkeypatch.setattr(check_mod, "_ENGINES", {})
    for case in EARLIER:
        _check(case)
    after_steps = _steps(monkeypatch)
    assert _check(LAST) == alone
    assert after_steps == alone_steps


def test_every_kept_e_graph_declares_in_the_fresh_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each e-graph a step runs on has declared exactly `Declarations.program` of what it
    holds, in that order, and a kept one is never given more rules (declared after its
    others, they would stand in another order); kept ones are reused."""
    declared: dict[int, list[str]] = {}  # id of an e-graph -> the statements it was given, in order
    declare = prove.Engine._declare

    def tracked_declare(self: prove.Engine, need: declarations.Need) -> Any:
        eg = declare(self, need)
        declared[id(eg)] = list(self._decls.program(need))
        return eg

    graph = prove.Engine._graph
    wrong: list[int] = []
    reused: list[int] = []  # steps on an e-graph an earlier step declared

    def checked(self: prove.Engine, need: declarations.Need) -> Any:
        before = {id(eg): key for key, eg in self._graphs.items()}
        eg = graph(self, need)
        key = next(k for k, e in self._graphs.items() if e is eg)
        if id(eg) in before:
            reused.append(len(key.rules))
            if before[id(eg)] != key:  # grown: what it lacked declared after what it held
                wrong.append(len(key.rules))
        if declared[id(eg)] != self._decls.program(key):
            wrong.append(len(key.rules))
        return eg

    monkeypatch.setattr(prove.Engine, "_declare", tracked_declare)
    monkeypatch.setattr(prove.Engine, "_graph", checked)
    monkeypatch.setattr(check_mod, "_ENGINES", {})
    for case in (*EARLIER, LAST):
        check_files(MODELS / case / "seq.json", MODELS / case / "dist.json")
    assert not wrong, wrong
    assert reused
