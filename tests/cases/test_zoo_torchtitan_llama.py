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


def _check(zoo, config: str, bug: str | None = None):  # noqa: ANN001, ANN202
    return capture(zoo.make_case(config, bug)).check()


def test_smoke_configuration_refines(zoo) -> None:  # noqa: ANN001
    """TP 2 with sequence parallelism: every gradient relates, the vocab-parallel embedding's
    (rules/embedding.py's EmbGradRows) included."""
    report = _check(zoo, zoo.program.smoke)
    assert report.verdict == "REFINES", report
    grad = next(o for o in report.outputs if o.name == "tok_embeddings.weight.grad")
    assert grad.relation.startswith("cat("), grad.relation


@pytest.mark.slow
@pytest.mark.parametrize("config", ["tp2", "tp4"])
def test_other_configurations_refine(zoo, config: str) -> None:  # noqa: ANN001
    report = _check(zoo, config)
    assert report.verdict == "REFINES", report


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["logits_gather_grad_summed", "loss_shard_tokens"])
def test_bugs_do_not_refine(zoo, bug: str) -> None:  # noqa: ANN001
    report = _check(zoo, zoo.program.bugs[bug].config, bug)
    assert report.verdict == "DOES NOT REFINE", report
    lines = zoo.culprit_lines(bug)
    assert lines
    c = report.culprit
    if c is None or c.rank_source not in lines:
        # known: every output is off by the factor tp, but localization stops at the first
        # sequential node without a clean relation (the vocab-parallel embedding backward's
        # clamped ids for the gather bug, the batch's token count for the other)
        pytest.xfail(f"culprit {c and (c.node, c.source, c.rank_source)}, not {sorted(lines)}")


def test_parallelize_llama_is_refused_for_its_fully_shard(zoo) -> None:  # noqa: ANN001
    """parallelize_llama always applies fully_shard (a 1-rank FSDP mesh without data
    parallelism): refused by name, never traced without its communication."""
    with pytest.raises(CaptureError, match="fully_shard"):
        capture(zoo.make_case("tp2_sp", titan_parallelize=True))


def test_loss_parallel_is_refused_at_its_index_write(zoo) -> None:  # noqa: ANN001
    """torchtitan's vocab-parallel cross-entropy writes its backward by integer indices
    without accumulate: refused at that line of torchtitan's loss.py."""
    with pytest.raises(CaptureError, match="without accumulate") as e:
        capture(zoo.make_case("tp2_sp", loss_parallel=True))
    assert "loss.py:" in str(e.value)
