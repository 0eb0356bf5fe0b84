"""An output the case gives no expectation: made by every rank, it must sit on the ranks'
copies in a standard placement (Replicate, Shard, Partial sum or the ranks' mean), not merely
be reconstructible from them (a loss halved on every rank is `2 * y@0`, one rank's right copy
reconstructs it whatever the others hold)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from refine.check import check
from refine.frontends.graphfile import load_dist, load_seq
from refine.ops.registry import load_registry
from tests.helpers import MODELS

REG = load_registry()


def _run(tmp: Path, case: str, edit: Any = None, seq_doc: dict | None = None) -> Any:
    doc = json.loads((MODELS / case / "dist.json").read_text())
    doc.pop("expectations")
    if edit is not None:
        edit(doc)
    (tmp / "dist.json").write_text(json.dumps(doc))
    seq_path = MODELS / case / "seq.json"
    if seq_doc is not None:
        seq_path = tmp / "seq.json"
        seq_path.write_text(json.dumps(seq_doc))
    seq = load_seq(seq_path, REG)
    return check(seq, load_dist(tmp / "dist.json", REG, seq), REG)


def _scale_output(ranks: list[int], by: float) -> Any:
    """Each listed rank's output `y` times `by` (a new last node the output refers to)."""
    def edit(doc: dict) -> None:
        for r in doc["ranks"]:
            if r["rank"] not in ranks:
                continue
            g = r["graph"]
            out = g["outputs"][0]
            last = next(n for n in g["nodes"] if n["name"] == out["ref"])
            g["nodes"].append({**copy.deepcopy(last), "name": "y_scaled", "op": "mul", "args": [out["ref"], by],
                               "attrs": {}})
            out["ref"] = "y_scaled"
    return edit


@pytest.mark.parametrize("case, placed", [("tp_mlp", "[Replicate]"), ("sp_mlp", "[Shard(0)]"),
                                          ("tp_attention_4ranks", "[Replicate]")])
def test_correct_case_without_expectation_refines_in_a_standard_placement(tmp_path: Path, case: str,
                                                                         placed: str) -> None:
    rep = _run(tmp_path, case)
    assert rep.refines
    (out,) = rep.outputs
    assert out.ok and placed in out.expectation and out.local == "y"


@pytest.mark.parametrize("ranks", [[0, 1], [1]])
def test_output_halved_on_some_ranks_without_expectation_does_not_refine(tmp_path: Path, ranks: list[int]) -> None:
    """Both ranks: `y = 2 * y@0`, which "reconstructible from rank outputs" accepted.
    Rank 1 only: `y@0` alone reconstructs it."""
    rep = _run(tmp_path, "tp_mlp", _scale_output(ranks, 0.5))
    assert not rep.refines
    (out,) = rep.outputs
    assert not out.ok and "standard" in out.expectation


def test_partial_outputs_without_expectation_refine_as_a_sum(tmp_path: Path) -> None:
    """The missing all-reduce twin's bias added after the sum, dropped: every rank returns its
    partial product, whose sum is the sequential output."""
    def edit(doc: dict) -> None:
        for r in doc["ranks"]:
            g = r["graph"]
            g["nodes"] = [n for n in g["nodes"] if n["name"] not in ("fc2_sum", "fc2_bias")]
            g["outputs"][0]["ref"] = "fc2"

    doc_seq = json.loads((MODELS / "tp_mlp" / "seq.json").read_text())
    doc_seq["graph"]["nodes"] = [n for n in doc_seq["graph"]["nodes"] if n["name"] != "fc2_bias"]
    doc_seq["graph"]["outputs"][0]["ref"] = "fc2"
    rep = _run(tmp_path, "tp_mlp", edit, doc_seq)
    assert rep.refines, rep.outputs
    assert "[Partial(sum)]" in rep.outputs[0].expectation


def test_expected_concat_matches_the_best_term_in_any_nesting() -> None:
    """The e-graph may hold the ranks' concat nested otherwise than the expectation builds it
    (of equally cheap nestings, which one is extracted is egglog's choice: MoE EP on four
    ranks got another one when kept e-graphs still grew out of order); concat is
    associative, so that is the same tensor. Other dims, orders or pieces are not."""
    from refine.check import _held
    from refine.ir.term import Term, cat, leaf, nary

    a, b, c, d = (leaf(f"g@{r}") for r in range(4))
    right = Term("cat", (a, Term("cat", (b, Term("cat", (c, d), (0,))), (0,))), (0,))
    assert _held([False], right, [cat([a, b, c, d], 0)]) == [True]
    assert _held([False], right, [cat([a, b, d, c], 0)]) == [False]
    assert _held([False], right, [cat([a, b, c, d], 1)]) == [False]
    assert _held([False], right, [cat([a, b, c], 0)]) == [False]
    assert _held([False], nary("Sum", [b, a]), [nary("Sum", [a, b])]) == [True]
    assert _held([True], a, [b]) == [True]  # a check the e-graph proved stands
