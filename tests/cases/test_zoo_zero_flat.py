"""models/zoo/zero_flat.py: ZeRO-style flat, padded, sharded parameters stated by
`capture.flat`. Each sequential parameter's relation is derived as a view of a slice of the
shards' concat, the flat gradient and the updated shard are expected in the same layout, the layout is checked
against the values (a wrong one is an error at capture), and what `capture.flat` cannot
state is refused. The verdicts of every configuration and bug: tests/cases/test_zoo.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.zoo import load
from refine import capture
from refine.frontends.capture import CaptureError
from tests.helpers.capture import wrong_numerically

ZOO = load("zero_flat")
zero_flat = ZOO.module


@pytest.mark.parametrize("config, world, sgd", [("dp2_sgd", 2, True), ("dp3", 3, False)])
def test_each_parameter_is_a_slice_of_the_shards_and_its_gradient_and_update_too(config: str, world: int,
                                                                                  sgd: bool) -> None:
    case = capture(ZOO.make_case(config))
    shards = ", ".join(f"flat@{r}" for r in range(world))
    grads = ", ".join(f"flat.grad@{r}" for r in range(world))
    updated = ", ".join(f"flat.updated@{r}" for r in range(world))
    relations = {r["from"]: r.get("layout") for r in case.dist_doc["relations"]}
    expected = {e["output"]: e.get("layout") for e in case.dist_doc["expectations"]}
    offset = 0
    for name, p in zero_flat.MLP().named_parameters():
        n, shape = p.numel(), ", ".join(map(str, p.shape))
        assert relations[name] == f"view(slice(cat({shards}, dim=0), 0, {offset}, {offset + n}), [{shape}])"
        assert expected[f"{name}.grad"] == [f"view(slice(cat({grads}, dim=0), 0, {offset}, {offset + n}), [{shape}])"]
        if sgd:
            assert expected[f"{name}.updated"] == [f"view(slice(cat({updated}, dim=0), 0, {offset}, {offset + n}), "
                                                   f"[{shape}])"]
        else:
            assert f"{name}.updated" not in expected
        offset += n
    assert not case.guesses
    ops = [n.op for g in case.dist.ranks.values() for n in g.nodes]
    assert "all_gather" in ops and "reduce_scatter" in ops
    assert wrong_numerically(case) == set()


@pytest.mark.parametrize("bug", ["sum_not_avg", "unreduced_grad", "pad_at_front"])
def test_each_bug_makes_the_gradients_wrong(bug: str) -> None:
    case = capture(ZOO.make_case(ZOO.program.bugs[bug].config, bug=bug))
    assert {o for o in wrong_numerically(case) if o.endswith(".grad")}


def _spec(annotate: object, mesh: dict[str, int] | None = None) -> capture.Spec:
    torch.manual_seed(0)
    seq = zero_flat.MLP()
    x, target = torch.randn(zero_flat.B, zero_flat.H), torch.randn(zero_flat.B, zero_flat.H)
    b = zero_flat.B // 2

    def rank(r: int) -> capture.Step:
        model = zero_flat.FlatMLP(seq, r, 2, None)
        flat = nn.Parameter(model.flat.detach().clone())
        model.flat = annotate(flat)  # type: ignore[operator]
        part = slice(r * b, (r + 1) * b)
        return capture.Step(model, zero_flat.zero_step,
                            {"x": capture.shard(x[part], 0), "target": capture.shard(target[part], 0)})

    return capture.Spec(sequential=capture.Step(seq, zero_flat.train_step, {"x": x, "target": target}), rank=rank,
                        world_size=2, mesh=mesh or {"dp": 2})


def test_a_flat_layout_that_does_not_hold_the_values_is_an_error() -> None:
    parts = list(zero_flat.MLP().named_parameters())
    swapped = [(n, p.shape) for n, p in [parts[1], parts[0], *parts[2:]]]  # the bias stated before the weight
    with pytest.raises(CaptureError, match="fc1"):
        capture(_spec(lambda t: capture.flat(t, swapped)))


def test_a_flat_shard_annotated_twice_is_an_error() -> None:
    parts = [(n, p.shape) for n, p in zero_flat.MLP().named_parameters()]
    with pytest.raises(CaptureError, match="flat shard"):
        capture(_spec(lambda t: capture.shard(capture.flat(t, parts), 0)))


def test_a_flat_shard_along_one_axis_of_several_is_refused() -> None:
    parts = [(n, p.shape) for n, p in zero_flat.MLP().named_parameters()]
    with pytest.raises(CaptureError, match="several axes"):
        capture(_spec(lambda t: capture.flat(t, parts, axis="dp"), mesh={"dp": 2, "tp": 1}))


def test_an_offset_off_by_the_padding_is_named_at_the_line_that_slices() -> None:
    """The parameters are read at offsets off by the padding: the report names the rank
    slice taking the wrong piece of the gathered buffer (refine.verdict.localize._wrong_slice)."""
    report = capture(ZOO.make_case("dp2", bug="pad_at_front")).check()
    assert report.verdict == "DOES NOT REFINE", report
    assert report.culprit is not None and report.culprit.rank_source in ZOO.culprit_lines("pad_at_front"), report
    assert "offset off by 1" in report.culprit.reason
