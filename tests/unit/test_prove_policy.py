"""The prover's search policy (refine.prove.policy) and its strategy counts (`refine check
--stats`): each strategy's count of nodes it ran on and of relations it gave that were kept
is consistent, a case that needs a strategy shows it, and a policy leaving that strategy out
makes the case fail honestly (no REFINES it did not prove)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from refine.check import check_files
from refine.cli import main
from refine.frontends.build import GraphBuilder, dist_doc, seq_doc, write_case
from refine.prove.policy import DEFAULT, STRATEGIES, Policy
from tests.helpers import MODELS


def _without(*names: str) -> Policy:
    return replace(DEFAULT, strategies=tuple(s for s in STRATEGIES if s not in names))


def _far(tmp_path: Path, transposes: int = 4) -> tuple[Path, Path]:
    """y = -exp(x), x sharded by rows; each rank transposes its rows `transposes` times
    before the exp: the ranks' exp is further from their x than the near try reaches
    (Policy.near_hops uses), within the wide one's."""
    T, H = 4, 8
    s = GraphBuilder()
    s.output("y", s.op("neg", s.op("exp", s.input("x", [T, H]), name="e"), name="n"))
    ranks = {}
    for r in range(2):
        d = GraphBuilder()
        v = d.input("x", [T // 2, H])
        for i in range(transposes):
            v = d.op("transpose", v, name=f"t{i}", dim0=0, dim1=1)
        d.output("y", d.op("neg", d.op("exp", v, name="e"), name="n"))
        ranks[r] = d
    write_case(tmp_path, seq_doc(s), dist_doc({"tp": 2}, ranks, [{"from": "x", "placements": ["Shard(0)"]}],
                                              [{"output": "y", "placements": ["Shard(0)"]}]))
    return tmp_path / "seq.json", tmp_path / "dist.json"


@pytest.mark.parametrize("case", ["tp_attention", "tp_attention_bug_reduce_replicated_input",
                                  "sp_mlp_bug_gather_wrong_dim", "vocab_embedding_bug_wrong_offset"])
def test_counts_are_consistent_on_the_bundled_examples(case: str) -> None:
    report = check_files(MODELS / case / "seq.json", MODELS / case / "dist.json")
    counts = report.stats["strategies"]
    assert list(counts) == list(STRATEGIES)
    assert all(0 <= c["kept"] <= c["ran"] for c in counts.values()), counts
    # every node is replayed or tried near first, and keeps at most one strategy's relation
    nodes = counts["near"]["ran"] + counts["replay"]["kept"]
    assert sum(c["kept"] for c in counts.values()) <= nodes
    # a retry runs only where the near try (or the retry before it) gave no clean relation
    retries = sum(counts[s]["ran"] for s in ("wide", "deep", "carried", "write_back"))
    assert retries <= 3 * (counts["near"]["ran"] - counts["near"]["kept"])


def test_a_far_counterpart_needs_the_wide_try(tmp_path: Path) -> None:
    report = check_files(*_far(tmp_path))
    assert report.refines, str(report)
    counts = report.stats["strategies"]
    assert counts["wide"] == {"ran": 1, "kept": 1}, counts
    assert counts["near"]["ran"] == 2 and counts["near"]["kept"] == 1, counts


def test_leaving_a_needed_strategy_out_does_not_refine(tmp_path: Path) -> None:
    """Without the wide try the ranks' exp is never reached: the node is unclean, and the
    check says so at it instead of a REFINES it did not prove. (With only wide left out, exp
    is carried into its one user, the output, whose expectation's step reaches the ranks'
    neg: that refines; carry_ops=0 carries nothing.)"""
    assert check_files(*_far(tmp_path), policy=_without("wide")).refines
    report = check_files(*_far(tmp_path), policy=replace(_without("wide"), carry_ops=0))
    assert not report.refines
    assert report.culprit is not None and report.culprit.node == "e", str(report)
    assert report.stats["strategies"]["wide"] == {"ran": 0, "kept": 0}
    # a strategy the case does not need changes nothing
    assert check_files(*_far(tmp_path), policy=_without("write_back")).refines


def test_leaving_replay_out_proves_the_same(tmp_path: Path) -> None:
    """replay only saves work: without it every node is proven by a step, same relations."""
    case = MODELS / "tp_attention"
    full = check_files(case / "seq.json", case / "dist.json")
    plain = check_files(case / "seq.json", case / "dist.json", policy=_without("replay"))
    assert full.stats["strategies"]["replay"]["kept"] > 0
    assert plain.stats["strategies"]["replay"] == {"ran": 0, "kept": 0}
    assert plain.refines and [o.relation for o in plain.outputs] == [o.relation for o in full.outputs]


def test_the_cli_prints_the_counts_with_stats(tmp_path: Path) -> None:
    seq, dist = _far(tmp_path)
    out = CliRunner().invoke(main, ["check", str(seq), str(dist), "--stats"])
    assert out.exit_code == 0, out.output
    assert "search strategies" in out.output and "write_back" in out.output
    plain = CliRunner().invoke(main, ["check", str(seq), str(dist)])
    assert "search strategies" not in plain.output
    js = CliRunner().invoke(main, ["check", str(seq), str(dist), "--format", "json"])
    assert json.loads(js.output)["stats"]["strategies"]["wide"] == {"ran": 1, "kept": 1}
