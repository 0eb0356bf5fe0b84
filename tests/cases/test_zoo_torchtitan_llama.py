"""The zoo's torchtitan Llama-3 (models/zoo/torchtitan_llama.py): torchtitan's own model and
tensor-parallel sharding, captured and checked. Skipped without torchtitan (see the program's
docstring for the install line)."""

from __future__ import annotations

import pytest

from models.zoo import load, missing
from refine import capture
from refine.frontends.capture import CaptureError

pytestmark = pytest.mark.skipif(bool(missing("torchtitan_llama")), reason="torchtitan is not installed")


@pytest.fixture(scope="module")
def zoo():  # noqa: ANN201 - models.zoo.Entry
    return load("torchtitan_llama")


# the verdicts (each configuration refines, each bug's report): tests/cases/test_zoo.py


def test_parallelize_llama_mixed_precision_is_refused_by_name(zoo) -> None:  # noqa: ANN001
    """parallelize_llama always applies fully_shard, captured through
    refine.frontends.capture.fsdp; torchtitan's default mixed_precision_param (bfloat16
    compute) is a setting that glue does not model: refused by name, never traced without it."""
    with pytest.raises(CaptureError, match="fully_shard-ed with a setting capture does not model: mixed precision"):
        capture(zoo.make_case("tp2_sp", titan_parallelize=True, param_dtype="bfloat16"))


@pytest.mark.slow
def test_parallelize_llama_without_data_parallelism_refines(zoo) -> None:  # noqa: ANN001
    """Its fully_shard over a 1-rank FSDP mesh (TP only) communicates nothing and refines."""
    assert capture(zoo.make_case("tp2_sp", titan_parallelize=True)).check().verdict == "REFINES"


@pytest.mark.slow
def test_loss_parallel_forward_lookup_relates(zoo) -> None:  # noqa: ANN001
    """Loss parallel's target lookup (DTensor's `_MaskPartial`: the masked local target, a gather,
    the result zeroed with the mask unsqueezed, all-reduced) relates to the sequential
    cross-entropy's gather (rules/masked_lookup.py); the proof stops in the backward, at
    nll_loss_backward's one-hot."""
    report = capture(zoo.make_case("tp2_sp", loss_parallel=True)).check()
    assert report.verdict == "UNPROVEN" and report.culprit is not None and report.culprit.node == "scatter", report


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="UNPROVEN backward: the forward's vocab-parallel lookup relates now "
                   "(rules/masked_lookup.py, DTensor's form), but nll_loss_backward's one-hot (a scatter) has no rank "
                   "counterpart: loss parallel writes each rank's window of it at flat indices and only ever holds "
                   "(window + exp(log-probs)) * weight, never the one-hot, its product with the weight or the "
                   "log-softmax backward's sum over the vocab that the sequential backward computes")
def test_loss_parallel_refines(zoo) -> None:  # noqa: ANN001
    assert capture(zoo.make_case("tp2_sp", loss_parallel=True)).check().verdict == "REFINES"
