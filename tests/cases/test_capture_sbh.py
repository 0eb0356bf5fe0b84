"""Megatron's [s, b, h] layout under data parallelism (models/capture/sbh_dp.py): the batch
is the inner factor of a Linear's merged [s*b, h] rows, so a rank's rows are no block of
them. rules/merge_view.py moves the merge out of the product (`matmul-rows-of-merged-view`)
and reorders the merged rows of a weight gradient's contraction alike on both sides
(`contract-merged-rows-reordered`); without them the first Linear is UNPROVEN."""

from __future__ import annotations

import pytest

from refine import capture
from tests.helpers.capture import load_model, wrong_numerically

SBH = load_model("sbh_dp")


def test_sbh_under_data_parallelism_refines() -> None:
    case = capture(SBH.make_case(world_size=2))
    assert wrong_numerically(case) == set()
    assert case.check().verdict == "REFINES"


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "micro_batches"), [(4, 1), (2, 2)])
def test_sbh_over_more_ranks_and_micro_batches_refines(world_size: int, micro_batches: int) -> None:
    assert capture(SBH.make_case(world_size=world_size, micro_batches=micro_batches)).check().verdict == "REFINES"


def test_sbh_gradients_summed_does_not_refine() -> None:
    case = capture(SBH.make_case(bug="grads_summed"))
    assert wrong_numerically(case) >= {"fc1.weight.grad", "fc2.weight.grad", "ln.weight.grad"}
    report = case.check()
    assert report.verdict == "DOES NOT REFINE"
    assert report.culprit is not None and report.culprit.rank_source == "sbh_dp.py:56"
