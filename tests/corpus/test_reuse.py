"""Replay of repeated layers (refine/prove/reuse.py) on the corpus's multi-layer dumps: a
second Llama layer is replayed, and eight GPT layers cost the e-graph steps of one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from refine.frontends.importer.entangle import import_case
from refine.ir.term import Term
from refine.prove.reuse import Replayer
from tests.helpers import CORPUS, RELATIONS
from tests.unit.test_prove_reuse import _check

pytestmark = pytest.mark.corpus


def test_aws_llama_second_layer_is_replayed(tmp_path: Path) -> None:
    """Neuron Llama-3, two layers, TP2: the second layer's 75 sequential nodes are replayed
    from the first's steps (measured: 126 e-graph steps, 87 replayed; one layer alone takes
    125 e-graph steps), and the logits still refine."""
    case = import_case(CORPUS / "aws_llama" / "tp1_layer2", CORPUS / "aws_llama" / "tp2_layer2",
                       RELATIONS / "aws_llama.json")
    case.write(tmp_path)
    report, replayed, steps = _check((tmp_path / "seq.json", tmp_path / "dist.json"))
    assert report.refines, str(report)
    assert replayed >= 60, (replayed, steps)
    assert report.stats["replayed"] == replayed


def test_gpt_eight_layers_cost_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron GPT, TP2: eight layers run exactly the e-graph steps one layer runs, and
    every sequential node the seven further layers add is replayed (with the rank tensors
    each replayed step proved equal, `StepResult.same`: without them, steps over the masked
    attention scores of layers 2-4 were proven again, 115 e-graph steps against 112)."""
    offered: list[bool] = []  # one entry per sequential node the walk relates: replayed or not
    original = Replayer.replay

    def counted(self: Replayer, term: Term) -> Any:
        res = original(self, term)
        offered.append(res is not None)
        return res

    monkeypatch.setattr(Replayer, "replay", counted)
    counts = {}
    for layers in (1, 8):
        case = import_case(CORPUS / "gpt" / f"paral1_layer{layers}", CORPUS / "gpt" / f"paral2_layer{layers}",
                           RELATIONS / "gpt.json")
        case.write(tmp_path / str(layers))
        offered.clear()
        report, replayed, steps = _check((tmp_path / str(layers) / "seq.json", tmp_path / str(layers) / "dist.json"))
        assert report.refines, str(report)
        assert replayed == sum(offered)
        counts[layers] = (len(offered), replayed, steps)
    (nodes1, replayed1, steps1), (nodes8, replayed8, steps8) = counts[1], counts[8]
    assert nodes8 - nodes1 >= 7 * 40, counts  # a gpt layer is ~60 lowered sequential nodes
    assert steps8 == steps1, counts
    assert replayed8 - replayed1 == nodes8 - nodes1, counts
