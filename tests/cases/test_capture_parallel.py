"""Capture expert-parallel and FSDP-style training steps (refine.frontends.capture) and check them end to end.

Two hand-written torch.distributed programs in the style of models/capture/tp_mlp.py:

- models/capture/moe_router.py: a dense-softmax mixture of experts, the router replicated and
  the stacked experts Shard(0) over ranks; the partial outputs are all-reduced ("g") and the
  router's gradient is summed over ranks after backward. Twin: the router gradient is never
  summed.
- models/capture/fsdp_mlp.py: ZeRO-3, every parameter Shard(0), all-gathered forward, its
  gradient reduce-scattered with AVG backward; the batch is sharded. Twin: SUM, not AVG.

Verdicts come from refine's checker; `refine.oracle.differential.differential` independently runs the
captured programs (simulated collectives) to show each twin is wrong exactly where expected.
"""

from __future__ import annotations

import pytest

from refine import capture, check
from tests.helpers.capture import (
    MODELS,
    failing,
    line_of,
    load_model,
    timed_capture,
    wrong_numerically,
)

EXPERTS = {f"experts.{p}.grad" for p in ("w1", "b1", "w2", "b2")}
MOE_GRADS = {"ln.weight.grad", "ln.bias.grad", "gate.weight.grad"} | EXPERTS
FSDP_GRADS = {f"{p}.grad" for p in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")}


MOE = load_model("moe_router")
FSDP = load_model("fsdp_mlp")


@pytest.fixture(scope="module")
def moe_case() -> capture.Case:
    return timed_capture(MOE.make_case())


@pytest.fixture(scope="module")
def moe_bug_case() -> capture.Case:
    return timed_capture(MOE.make_case(bug="router_grad_not_summed"))


@pytest.fixture(scope="module")
def fsdp_case() -> capture.Case:
    return timed_capture(FSDP.make_case())


# ---------------------------------------------------------------------------------------
# expert parallelism: a replicated router, experts split over the ranks


@pytest.mark.slow
def test_moe_router_refines(moe_case: capture.Case) -> None:
    report = check(*moe_case)
    assert report.refines, report
    assert {o.name for o in report.outputs} == {"loss"} | MOE_GRADS
    by_name = {o.name: o for o in report.outputs}
    assert by_name["experts.w1.grad"].relation == "cat(experts.w1.grad@0, experts.w1.grad@1, dim=0)"


def test_moe_router_documents(moe_case: capture.Case) -> None:
    rel = {r["from"]: r["placements"] for r in moe_case.dist_doc["relations"]}
    assert rel["gate.weight"] == ["Replicate"]
    assert {rel[f"experts.{p}"][0] for p in ("w1", "b1", "w2", "b2")} == {"Shard(0)"}
    exp = {e["output"]: e["placements"] for e in moe_case.dist_doc["expectations"]}
    assert exp["gate.weight.grad"] == ["Replicate"] and exp["experts.w2.grad"] == ["Shard(0)"]
    path = MODELS / "moe_router.py"
    rank0 = moe_case.dist_doc["ranks"][0]["graph"]["nodes"]
    # "g" forward, "f" backward, and the router gradient's sum after backward
    assert sorted(n["source"] for n in rank0 if n["op"] == "all_reduce") == sorted([
        line_of(path, 'return funcol.all_reduce(x, "sum", group)'),
        line_of(path, "dist.all_reduce(grad, group=ctx.group)"),
        line_of(path, "dist.all_reduce(model.gate.weight.grad, group=model.group)")])
    # the rank's slice of the router's probabilities: its gradient is padded with zeros
    assert any(n["op"] == "concat" for n in rank0)


def test_router_grad_not_summed_is_wrong_only_in_the_router_gradient(moe_case: capture.Case,
                                                                     moe_bug_case: capture.Case) -> None:
    assert wrong_numerically(moe_case) == set()
    assert wrong_numerically(moe_bug_case) == {"gate.weight.grad"}


def test_router_grad_not_summed_does_not_refine(moe_bug_case: capture.Case) -> None:
    report = moe_bug_case.check()
    assert not report.refines
    assert failing(report) == {"gate.weight.grad"}
    culprit = report.culprit
    assert culprit is not None and culprit.output == "gate.weight.grad"
    # the router's weight gradient, at the model's line that runs the gate; its sequential
    # value is the sum of the ranks' gradients: the all-reduce that is missing
    assert culprit.source == line_of(MODELS / "moe_router.py", "probs = torch.softmax(self.gate(h), dim=-1)")
    (gate,) = [o for o in report.outputs if o.name == "gate.weight.grad"]
    assert gate.relation == "(gate.weight.grad@0 + gate.weight.grad@1)"


# ---------------------------------------------------------------------------------------
# FSDP (ZeRO-3): parameters sharded, gathered for use, gradients reduce-scattered


@pytest.mark.slow
def test_fsdp_mlp_refines(fsdp_case: capture.Case) -> None:
    report = check(*fsdp_case)
    assert report.refines, report
    assert {o.name for o in report.outputs} == {"loss"} | FSDP_GRADS
    exp = {e["output"]: e["placements"] for e in fsdp_case.dist_doc["expectations"]}
    assert exp == {"loss": ["Replicate"]} | {g: ["Shard(0)"] for g in FSDP_GRADS}
    rank0 = fsdp_case.dist_doc["ranks"][0]["graph"]["nodes"]
    path = MODELS / "fsdp_mlp.py"
    gathers = [n for n in rank0 if n["op"] == "all_gather"]
    scatters = [n for n in rank0 if n["op"] == "reduce_scatter"]
    assert len(gathers) == len(scatters) == 4
    assert {n["source"] for n in gathers} == {line_of(path, "return funcol.all_gather_tensor(shard, dim, group)")}
    assert {n["attrs"]["reduce_op"] for n in scatters} == {"avg"}


@pytest.mark.slow
def test_fsdp_reduce_scatter_sum_not_avg() -> None:
    case = timed_capture(FSDP.make_case(bug="reduce_scatter_sum_not_avg"))
    assert wrong_numerically(case) == FSDP_GRADS
    report = case.check()
    assert not report.refines
    assert failing(report) == FSDP_GRADS
    culprit = report.culprit
    assert culprit is not None
    # every relation is clean and every gradient is world times too large: flipping the
    # reduce-scatters to AVG repairs them all (refine.verdict.factor), so the culprit is their line; the
    # sequential node of the first failing gradient keeps its line (fc1's), and the rank nodes
    # computing it are those reduce-scatters of the gather's backward
    path = MODELS / "fsdp_mlp.py"
    assert culprit.output == "fc1.weight.grad"
    scatter = line_of(path, "funcol.reduce_scatter_tensor(grad.contiguous()")
    assert culprit.source == culprit.rank_source == scatter, report
    assert culprit.seq_source == line_of(path, "return self.fc2(F.gelu(self.fc1(x)))")
    assert [n for n in culprit.rank_nodes if f"at {scatter}, computes fc1.weight.grad@" in n], culprit.rank_nodes


@pytest.mark.slow
def test_fsdp_mlp_on_four_ranks_refines() -> None:
    report = timed_capture(FSDP.make_case(world_size=4)).check()
    assert report.refines, report
