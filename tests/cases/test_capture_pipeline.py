"""Pipeline parallelism captured from PyTorch code (models/capture/pp_tied.py): stages hold
their parameters whole, activations and their gradients travel by dist.send/dist.recv, only
the last stage computes the loss, and the tied embedding's two copies have their gradients
all-reduced over the first and last stage.

What the graph format gained for it, tested here too: a relation `layout` may be a list of
replicas (a tensor held whole by some ranks only), and an expectation may be a `layout` over
rank outputs (an output only some ranks make)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from refine import capture
from refine.frontends.build import write_case
from refine.frontends.capture.errors import CaptureError
from refine.frontends.graphfile import load_dist, load_seq
from refine.ir.errors import InputError
from refine.ops.registry import load_registry
from tests.helpers import ROOT
from tests.helpers import capture as helpers
from tests.helpers.capture import MODELS, failing, load_model, wrong_numerically

SCHEMA = ROOT / "refine" / "frontends" / "schema" / "graph-v1.json"


PP = load_model("pp_tied")


def line_of(snippet: str) -> str:
    return helpers.line_of(MODELS / "pp_tied.py", snippet)


@pytest.fixture(scope="module")
def three_stages() -> capture.Case:
    return capture(PP.make_case(world_size=3))


def grads(stages: int) -> set[str]:
    return {"embed.weight.grad"} | {f"blocks.{i}.fc.{p}.grad" for i in range(stages) for p in ("weight", "bias")}


@pytest.mark.slow
def test_stages_hold_their_own_parameters(three_stages: capture.Case) -> None:
    rels = {r["from"]: r for r in three_stages.dist_doc["relations"]}
    assert rels["embed.weight"]["layout"] == ["embed.weight@0", "embed.weight@2"]  # first and last stage
    assert rels["blocks.1.fc.weight"]["layout"] == ["blocks.1.fc.weight@1"]
    assert rels["ids"]["layout"] == ["ids@0"] and rels["labels"]["layout"] == ["labels@2"]
    assert all(r.get("guessed") for r in rels.values())  # from names and shapes: the report flags them
    expect = {e["output"]: e for e in three_stages.dist_doc["expectations"]}
    assert expect["loss"] == {"output": "loss", "layout": ["loss@2"]}  # only the last stage has a loss
    assert expect["embed.weight.grad"]["layout"] == ["embed.weight.grad@0", "embed.weight.grad@2"]
    ops = [[n["op"] for n in g["graph"]["nodes"] if n["op"] in ("send", "recv", "all_reduce")]
           for g in three_stages.dist_doc["ranks"]]
    assert ops == [["send", "recv", "all_reduce"], ["recv", "send", "recv", "send"],
                   ["recv", "send", "all_reduce"]]


def test_documents_match_the_schema(three_stages: capture.Case) -> None:
    from jsonschema import Draft202012Validator

    validator = Draft202012Validator(json.loads(SCHEMA.read_text()))
    assert not list(validator.iter_errors(three_stages.dist_doc))


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3])
def test_pipeline_refines(stages: int, three_stages: capture.Case) -> None:
    case = three_stages if stages == 3 else capture(PP.make_case(world_size=stages))
    assert wrong_numerically(case) == set()
    report = case.check()
    assert report.refines, report
    assert {o.name for o in report.outputs} == {"loss"} | grads(stages)
    assert any("held whole by ranks [0, 2]" in g for g in report.guesses) or stages == 2


@pytest.mark.slow
def test_tied_gradient_not_reduced() -> None:
    case = capture(PP.make_case(world_size=3, bug="tied_grad_not_reduced"))
    assert wrong_numerically(case) == {"embed.weight.grad"}
    report = case.check()
    assert not report.refines
    assert failing(report) == {"embed.weight.grad"}
    c = report.culprit
    assert c is not None, report
    # the sequential sum of the lookup's and the head's gradients, which the two copies hold apart
    (out,) = [o for o in report.outputs if o.name == "embed.weight.grad"]
    assert out.relation == "(embed.weight.grad@0 + embed.weight.grad@2)"
    assert c.source == line_of("h = self.embed(ids)"), report
    assert c.rank_source is not None


def test_wrong_gradient_sent_back_is_found_at_the_send() -> None:
    case = capture(PP.make_case(world_size=2, bug="grad_not_sent_back"))
    wrong = wrong_numerically(case)
    assert "embed.weight.grad" in wrong and "blocks.0.fc.weight.grad" in wrong and "loss" not in wrong
    report = case.check()
    assert not report.refines
    assert failing(report) == wrong
    c = report.culprit
    assert c is not None and c.rank_node is not None, report
    assert c.rank_node.startswith("send@1")
    assert c.rank_source == line_of("dist.send(torch.ones_like(x.grad)"), report


# ---------------------------------------------------------------------------------------
# the format: replicas of a layout, expectations over some ranks' outputs


@pytest.fixture(scope="module")
def docs() -> tuple[dict[str, Any], dict[str, Any]]:
    case = capture(PP.make_case(world_size=2))
    return case.seq_doc, case.dist_doc


def _load(docs: tuple[dict[str, Any], dict[str, Any]], edit: Any, tmp: Path) -> None:
    seq_doc, dist_doc = docs
    dist_doc = copy.deepcopy(dist_doc)
    edit(dist_doc)
    write_case(tmp, seq_doc, dist_doc)
    reg = load_registry()
    load_dist(tmp / "dist.json", reg, load_seq(tmp / "seq.json", reg))


def _relation(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(r for r in doc["relations"] if r["from"] == name)


def _expectation(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(e for e in doc["expectations"] if e["output"] == name)


@pytest.mark.parametrize("edit, where, reason", [
    (lambda d: _relation(d, "ids").update(layout=["ids@0", "labels@1"]), "layout[1]", "no replica of"),
    (lambda d: _relation(d, "ids").update(layout=[]), "layout", "an empty list"),
    (lambda d: _relation(d, "ids").update(layout=["ids@0", "ids@1"]), "layout[1]", "is not an input of rank 1"),
    (lambda d: _relation(d, "ids").update(layout=["ids@0", 3]), "layout[1]", "expected a layout expression"),
    (lambda d: _expectation(d, "loss").update(layout=["loss@0"]), "layout", "is not an output of rank 0"),
    (lambda d: _expectation(d, "loss").update(local="loss"), "local", "either 'layout' or"),
    (lambda d: _expectation(d, "loss").update(layout="blocks.1.fc.bias.grad@1"), "layout",
     "makes shape [8], but the sequential output has []"),
])
def test_bad_layouts_are_refused(docs: tuple[dict[str, Any], dict[str, Any]], edit: Any, where: str,
                                 reason: str, tmp_path: Path) -> None:
    with pytest.raises(InputError) as e:
        _load(docs, edit, tmp_path)
    assert e.value.file.endswith("dist.json")
    assert where in e.value.where and reason in str(e.value), str(e.value)


def test_a_send_nobody_receives_is_refused_at_its_line() -> None:
    """A stage whose send has no matching recv on its peer: capture stops (exit 2 from the
    CLI), naming the send and its line, and writes nothing."""
    def step(stage: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        loss = stage(x).sum()
        loss.backward()
        if dist.get_rank() == 0:
            dist.send(loss.detach(), dst=1)  # rank 1 never receives it
            return None
        return loss.detach()

    spec = capture.Spec(sequential=capture.Step(nn.Linear(4, 4), lambda m, x: _backward(m(x).sum()),
                                                 {"x": torch.randn(2, 4)}),
                        rank=lambda r: capture.Step(nn.Linear(4, 4), step, {"x": torch.randn(2, 4)}), world_size=2)
    with pytest.raises(CaptureError) as e:
        capture(spec)
    text = str(e.value)
    assert "rank 0, node 'send'" in text and "rank 1 has 0 matching recv(s) from rank 0" in text, text
    assert line_of_test("dist.send(loss.detach(), dst=1)") in text


def line_of_test(snippet: str) -> str:
    return helpers.line_of(Path(__file__), snippet)


def _backward(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss
