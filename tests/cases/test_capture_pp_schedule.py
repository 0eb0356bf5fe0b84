"""Pipeline schedules captured from torch.distributed.pipelining (models/capture/pp_schedule.py),
and what capture gained for them: scalar reads of values the ranks agree on by communicating
(refine.frontends.capture.scalars), resolved by running the traced rank prefixes, and refused
when the value depends on the step's inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from refine import capture
from refine.frontends.capture.errors import CaptureError
from tests.helpers import capture as helpers
from tests.helpers.capture import failing, load_model, wrong_numerically

PP = load_model("pp_schedule")


def grads(stages: int, model: str = "mlp") -> set[str]:
    return {n + ".grad" for n, _ in PP.Stack(stages, model).named_parameters()}


def test_gpipe_refines_and_the_vote_is_resolved() -> None:
    case = capture(PP.make_case())
    # the schedule's shape-inference vote: rank 0 sends its vote on, rank 1 sends the product
    # back, and each branched on its value (1: static shapes) in the trace
    assert case.stats["scalar_reads"] == {0: [1], 1: [1]}
    report = case.check()
    assert report.refines, report
    assert {o.name for o in report.outputs} == {"loss"} | grads(2)
    sends = [[n.op for n in g.nodes if n.op in ("send", "recv")] for _, g in sorted(case.dist.ranks.items())]
    # the vote (send / recv), 2 micro-batches forward, 2 backward
    assert sends[0] == ["send", "recv", "send", "send", "recv", "recv"]
    assert sends[1] == ["recv", "send", "recv", "recv", "send", "send"]


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(schedule="1f1b"), dict(schedule="1f1b", micro=4),
                                dict(world_size=4, schedule="gpipe", micro=4),
                                dict(world_size=4, schedule="1f1b", micro=4),
                                dict(model="transformer"), dict(model="transformer", schedule="1f1b")],
                         ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_schedules_refine(kw: dict[str, object]) -> None:
    case = capture(PP.make_case(**kw))
    assert wrong_numerically(case) == set()
    report = case.check()
    assert report.refines, report
    assert {o.name for o in report.outputs} == {"loss"} | grads(int(kw.get("world_size", 2)), str(kw.get("model", "mlp")))


def test_interleaved_virtual_stages_refine() -> None:
    """ScheduleInterleaved1F1B over 2 ranks, 4 stages (rank r holds stages r and r + 2): each
    rank votes once per stage it holds, both votes read in the trace."""
    case = capture(PP.make_case(schedule="interleaved", micro=4))
    assert case.stats["scalar_reads"] == {0: [1, 1], 1: [1, 1]}
    held = {r: sorted({i["name"].split(".")[1] for i in g["graph"]["inputs"] if i["name"].startswith("blocks.")})
            for r, g in enumerate(case.dist_doc["ranks"])}
    assert held == {0: ["0", "2"], 1: ["1", "3"]}
    report = case.check()
    assert report.refines, report
    assert {o.name for o in report.outputs} == {"loss"} | grads(4)


def test_1f1b_interleaves_forward_and_backward_sends() -> None:
    """At 4 micro-batches, 1F1B's last stage sends a gradient back before it has received the
    last activations (GPipe receives all first)."""
    order = {}
    for schedule in ("gpipe", "1f1b"):
        case = capture(PP.make_case(schedule=schedule, micro=4))
        ops = [n.op for n in case.dist.ranks[1].nodes if n.op in ("send", "recv")][2:]  # past the vote
        order[schedule] = ops
    assert order["gpipe"] == ["recv"] * 4 + ["send"] * 4
    assert order["1f1b"] != order["gpipe"] and order["1f1b"].index("send") < 3


@pytest.mark.parametrize("bug, config", [("zero_grad_after_step", {}), ("grads_not_scaled", {"schedule": "1f1b"})])
def test_twins_do_not_refine(bug: str, config: dict[str, object]) -> None:
    case = capture(PP.make_case(bug=bug, **config))
    wrong = wrong_numerically(case)
    expected = {"blocks.0.fc.weight.grad", "blocks.0.fc.bias.grad"}
    assert wrong == (expected if bug == "zero_grad_after_step" else grads(2))
    report = case.check()
    assert report.verdict == "DOES NOT REFINE", report
    assert failing(report) == wrong


# ---------------------------------------------------------------------------------------
# scalar reads, on hand-written protocols


def _seq() -> capture.Step:
    torch.manual_seed(0)
    return capture.Step(nn.Linear(4, 4), _scaled_step(lambda: 2), {"x": torch.ones(2, 4)})


def _scaled_step(factor: object) -> object:
    def step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = m(x).sum() * factor()  # type: ignore[operator]
        loss.backward()
        return loss.detach()
    return step


def _relay_factor() -> int:
    """The ranks agree on a factor by a relay: rank 0 sends 2, each rank passes on the buffer it
    received (the same tensor), the last sends the result back to rank 0 and everyone reads it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        v = torch.tensor([2])
        dist.send(v, dst=1)
        dist.recv(v, src=world - 1)
        for r in range(1, world - 1):
            dist.send(v, dst=r)
    else:
        v = torch.zeros(1, dtype=torch.int64)
        dist.recv(v, src=rank - 1)
        if rank < world - 1:
            dist.send(v, dst=rank + 1)  # the received buffer, sent on as it is
            dist.recv(v, src=0)
        else:
            dist.send(v, dst=0)
    return int(v.item())


def _spec(factor: object, world: int = 3) -> capture.Spec:
    def rank(r: int) -> capture.Step:
        torch.manual_seed(0)
        return capture.Step(nn.Linear(4, 4), _scaled_step(factor), {"x": torch.ones(2, 4)})
    return capture.Spec(sequential=_seq(), rank=rank, world_size=world)


def test_a_value_the_ranks_relay_is_read_and_checked() -> None:
    """Every rank reads the relayed 2 (rank 0 after a round trip through every rank): capture
    resolves each read by running the traced prefixes; the data-parallel copies then refine."""
    case = capture(_spec(_relay_factor))
    assert case.stats["scalar_reads"] == {0: [2], 1: [2], 2: [2]}
    report = case.check()
    assert report.refines, report


def test_reading_a_value_that_depends_on_the_inputs_is_refused() -> None:
    """A read of a received value the sender computed from its parameters would hold only for
    the captured parameters: refused as data-dependent control flow, at the read."""
    def factor() -> int:
        w = next(iter(_current.parameters()))
        v = (w.sum() > 0).long().reshape(1)
        if dist.get_rank() == 0:
            dist.send(v, dst=1)
        else:
            dist.recv(v, src=0)
        return int(v.item())  # the read

    def rank(r: int) -> capture.Step:
        global _current
        torch.manual_seed(0)
        _current = nn.Linear(4, 4)
        return capture.Step(_current, _scaled_step(factor), {"x": torch.ones(2, 4)})

    with pytest.raises(CaptureError) as e:
        capture(capture.Spec(sequential=_seq(), rank=rank, world_size=2))
    assert "data-dependent control flow" in str(e.value)
    assert e.value.source == helpers.line_of(Path(__file__), "return int(v.item())  # the read"), e.value.source


def test_reading_a_random_value_is_refused() -> None:
    def factor() -> int:
        return int(torch.randint(1, 3, (1,)).item())

    with pytest.raises(CaptureError, match="data-dependent control flow"):
        capture(_spec(factor, world=2))


def test_reading_uninitialized_memory_is_refused_but_a_received_buffer_is_read() -> None:
    """`torch.empty` holds no constant until something writes it: a read of it is refused; the
    same buffer filled by a recv of a constant is read."""
    def unwritten() -> int:
        return int(torch.empty(1, dtype=torch.int64).item())

    with pytest.raises(CaptureError, match="data-dependent control flow"):
        capture(_spec(unwritten, world=2))

    def received() -> int:
        if dist.get_rank() == 0:
            v = torch.full((1,), 2)
            dist.send(v, dst=1)
        else:
            v = torch.empty(1, dtype=torch.int64)
            dist.recv(v, src=0)  # overwrites the whole buffer
        return int(v.item())

    case = capture(_spec(received, world=2))
    assert case.stats["scalar_reads"] == {0: [2], 1: [2]}
    assert case.check().refines


_current: nn.Module = nn.Linear(4, 4)

