"""models/zoo/ddp_accum.py: torch's DistributedDataParallel with no_sync() gradient
accumulation, captured as users write it. What the reducer does is in the trace (one
all-reduce per parameter, at the backward that synchronises), the sequential step is the
whole batch at once, and each bug makes the gradients wrong. The verdicts of every
configuration and bug: tests/cases/test_zoo.py."""

from __future__ import annotations

import pytest

from models.zoo import load
from refine import capture
from tests.helpers.capture import wrong_numerically

ZOO = load("ddp_accum")
PARAMS = 4  # fc1 and fc2, weight and bias


def _all_reduces(case: capture.Case) -> dict[int, int]:
    return {r: sum(n.op == "all_reduce" for n in g.nodes) for r, g in case.dist.ranks.items()}


def test_the_reducer_averages_each_gradient_once_at_the_last_micro_batch() -> None:
    case = capture(ZOO.make_case("dp2_m2"))
    assert _all_reduces(case) == {0: PARAMS, 1: PARAMS}
    assert not case.guesses or all("same name and shape" in g for g in case.guesses)
    assert sum(n.op == "matmul" or n.op == "addmm" for n in case.seq.nodes) < \
        sum(n.op == "matmul" or n.op == "addmm" for n in case.dist.ranks[0].nodes)  # one pass over the whole batch
    assert wrong_numerically(case) == set()


@pytest.mark.parametrize("bug, config, reduces", [("never_synced", "dp2_m2", 0), ("synced_first", "dp2_m4", PARAMS),
                                                   ("loss_not_divided", "dp4_m2", PARAMS)])
def test_each_bug_makes_the_gradients_wrong(bug: str, config: str, reduces: int) -> None:
    case = capture(ZOO.make_case(config, bug=bug))
    assert set(_all_reduces(case).values()) == {reduces}
    assert {o for o in wrong_numerically(case) if o.endswith(".grad")}
