"""`refine import entangle`: GraphGuard/Entangle graph dumps of the external corpus as refine
cases, imported and checked. Skipped (with a reason) only when the corpus is not next to this
checkout; tests/cases/test_import_entangle.py builds its own dumps."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from refine.check import check_files
from refine.cli import main
from tests.helpers import CORPUS, RELATIONS

pytestmark = pytest.mark.corpus  # the tests marked slow check whole corpus graphs: 15-25 s each


def _import(tmp_path: Path, seq: str, dist: str, rel: str | None = None, *extra: str) -> Any:
    out = tmp_path / "case"
    args = ["import", "entangle", str(CORPUS / seq), str(CORPUS / dist), "--out", str(out), *extra]
    if rel is not None:
        args += ["--relations", str(RELATIONS / rel)]
    r = CliRunner().invoke(main, args)
    return r, out


def _rank_ops(dist: dict[str, Any], rank: int) -> list[str]:
    return [n["op"] for n in dist["ranks"][rank]["graph"]["nodes"]]


def test_gpt_pair_imports(tmp_path: Path) -> None:
    """Megatron GPT, TP2 + sequence parallel: every op maps, collectives match across ranks,
    relations are guessed by position and shape, dropout masks become related inputs."""
    r, out = _import(tmp_path, "gpt/paral1_layer1", "gpt/paral2_layer1")
    assert r.exit_code == 0, r.output
    assert "guessed: primals_4 [Shard(0)]" in r.output and "guessed: primals_6 [Shard(1)]" in r.output
    seq, dist = (json.loads((out / f).read_text()) for f in ("seq.json", "dist.json"))
    assert dist["mesh"] == {"axes": [{"name": "tp", "size": 2}]}
    rel = {x["from"]: x for x in dist["relations"]}
    assert rel["primals_1"]["placements"] == ["Shard(0)"] and rel["primals_1"]["guessed"]  # vocab-parallel table
    assert rel["mask1"]["placements"] == ["Shard(1)"]  # attention dropout: heads split
    ops = _rank_ops(dist, 0)
    assert {"all_gather", "reduce_scatter", "all_reduce", "apex_layer_norm", "dropout_masked", "gather"} <= set(ops)
    assert not any(n["op"] in ("all_reduce", "all_gather") for n in seq["graph"]["nodes"])  # one-rank groups
    # the source lines come from the dump's stack traces
    assert any(n.get("source") == "cross_entropy.py:245" for n in dist["ranks"][1]["graph"]["nodes"])
    # the pair passes refine's loader (collectives matched, relations make the sequential shapes)
    from refine.frontends.graphfile import load_dist, load_seq
    from refine.ops.registry import load_registry

    reg = load_registry()
    load_dist(out / "dist.json", reg, load_seq(out / "seq.json", reg))


def test_qwen2_pair_imports_with_fused_layouts(tmp_path: Path) -> None:
    r, out = _import(tmp_path, "qwen2/paral1_layer1", "qwen2/paral2_layer1", "qwen2.json")
    assert r.exit_code == 0, r.output
    dist = json.loads((out / "dist.json").read_text())
    rel = {x["from"]: x for x in dist["relations"]}
    assert rel["arg4_1"]["layout"].startswith("cat(cat(slice(arg4_1@0, 0, 0, 768), slice(arg4_1@1, 0, 0, 768), "
                                              "dim=0), cat(slice(arg4_1@0, 0, 768, 896)")
    assert "guessed" not in rel["arg4_1"] and "layout" in rel["arg9_1"]
    assert rel["arg7_1"]["placements"] == ["Shard(1)"] and rel["arg7_1"]["guessed"]
    assert {"vllm_rms_norm", "vllm_rotary_embedding", "vllm_attention", "vllm_silu_and_mul",
            "vllm_fused_add_rms_norm", "all_reduce"} <= set(_rank_ops(dist, 1))
    assert dist["expectations"] == [{"output": "hidden", "placements": ["Replicate"]}]


def test_aws_llama_tp2_refines(tmp_path: Path) -> None:
    """Neuron Llama-3 (HLO ops), one layer, TP2, QKV fused along dim 1: the logits refine."""
    r, out = _import(tmp_path, "aws_llama/tp1_layer1", "aws_llama/tp2_layer1", "aws_llama.json")
    assert r.exit_code == 0, r.output
    report = check_files(out / "seq.json", out / "dist.json")
    assert report.refines, str(report)
    assert any("guessed" in g for g in report.guesses)  # the report flags the guessed relations


def test_aws_llama_tp4_refines(tmp_path: Path) -> None:
    """TP4: the ranks' query heads (8) are as many as the sequential key heads, so the key's
    rotary factor relates to a rank's *query* factor (equal value and shape). The key product
    refines because the ranks' own key factors (the same broadcast over the same tensor, to
    their 2 heads) stay available to later steps with their definitions (prove._counterparts)."""
    r, out = _import(tmp_path, "aws_llama/tp1_layer1", "aws_llama/tp4_layer1", "aws_llama.json")
    assert r.exit_code == 0, r.output
    report = check_files(out / "seq.json", out / "dist.json")
    assert report.refines, str(report)


def test_aws_llama_tp6_uneven_is_refused(tmp_path: Path) -> None:
    """TP6 dumps hold zero-padded shards (32 query heads padded to 36, 8192 MLP columns to
    6 x 1366): the fused layout cannot split the sequential weight evenly, and nothing in
    graph format v1 says a rank input's padding is zero, so the import refuses it (exit 2)."""
    r, _ = _import(tmp_path, "aws_llama/tp1_layer1", "aws_llama/tp6_layer1", "aws_llama.json")
    assert r.exit_code == 2 and "does not split evenly over 6 ranks" in r.output, r.output


def test_qwen2_tp2_refines(tmp_path: Path) -> None:
    """vLLM Qwen2, one layer, TP2: the vocab-parallel embedding, the fused QKV projection, the
    in-place rotary written back into the fused qkv buffer (slice_scatter) and read out again
    for attention (the structural retry of prove.infer), the MLP and the final norm."""
    r, out = _import(tmp_path, "qwen2/paral1_layer1", "qwen2/paral2_layer1", "qwen2.json")
    assert r.exit_code == 0, r.output
    report = check_files(out / "seq.json", out / "dist.json")
    assert report.refines, str(report)
    (hidden,) = report.outputs
    assert hidden.ok and "<" not in hidden.relation, hidden.relation  # no opaque leaf: every node related


@pytest.mark.slow
def test_qwen2_tp4_refines(tmp_path: Path) -> None:
    """TP4: 12 query heads over 4 ranks (3 each), 2 KV heads each replicated on two ranks.
    The fused layout lists both copies (importer.fused_layouts); the replica facts prove each
    rank's own key and value columns equal to its group's first rank's
    (prove.join_fact_consequences). The value relation names one rank's broadcast of the
    replicated bias next to another's product; attn @ v relates through the ranks' own
    broadcasts, whose definitions the frontier states (refine.prove.frontier._fact_chains)."""
    r, out = _import(tmp_path, "qwen2/paral1_layer1", "qwen2/paral4_layer1", "qwen2.json")
    assert r.exit_code == 0, r.output
    rel = {x["from"]: x for x in json.loads((out / "dist.json").read_text())["relations"]}
    assert isinstance(rel["arg4_1"]["layout"], list) and len(rel["arg4_1"]["layout"]) == 2
    report = check_files(out / "seq.json", out / "dist.json")
    assert report.refines, str(report)
    (hidden,) = report.outputs
    assert hidden.ok and "<" not in hidden.relation, hidden.relation  # no opaque leaf: every node related


@pytest.mark.slow
def test_qwen2_tp4_value_from_the_key_columns_is_found(tmp_path: Path) -> None:
    """The same TP4 case with rank 1 reading its key columns where attention wants its value
    columns (one rank of a KV group wrong): DOES NOT REFINE, at attn @ v. Slow: localization
    evaluates the 32768-token attention (~8.6 GB peak RSS)."""
    r, out = _import(tmp_path, "qwen2/paral1_layer1", "qwen2/paral4_layer1", "qwen2.json")
    assert r.exit_code == 0, r.output
    dist = json.loads((out / "dist.json").read_text())
    (v,) = [n for n in dist["ranks"][1]["graph"]["nodes"] if n["name"] == "split_with_sizes_6.2"]
    assert v["attrs"] == {"dim": 1, "start": 512, "end": 640}, v
    v["attrs"].update(start=384, end=512)
    (out / "dist.json").write_text(json.dumps(dist))
    report = check_files(out / "seq.json", out / "dist.json")
    assert not report.refines and report.culprit is not None
    c = report.culprit
    assert c.op == "vllm_attention" and c.core_node == "auto_functionalized_2.1.matmul2", c


def test_bug_grad_accumulation(tmp_path: Path) -> None:
    """Two micro-batches each averaged over 4, then added: the loss is twice the sequential
    one's mean. The relation shows each micro-batch mean taken with weight 1/2, next to a term
    (the accumulator's start) weighted right; the culprit is the per-micro-batch mean's line,
    whose 1/4 times 1/2 makes the loss right (refine.verdict.factor, the factor read off the terms)."""
    r, out = _import(tmp_path, "bug_grad_accumulation/1step", "bug_grad_accumulation/2step.bug",
                     "bug_grad_accumulation.json")
    assert r.exit_code == 0, r.output
    report = check_files(out / "seq.json", out / "dist.json")
    assert not report.refines
    (loss,) = report.outputs
    assert not loss.ok and "1/2 * mean.view@0" in loss.relation and "1/2 * mean_1.view@0" in loss.relation
    c = report.culprit
    assert c is not None and c.output == "loss"
    # the per-micro-batch mean, named at its line; the sequential node is the accumulating add
    assert c.source == c.rank_source == "test_trainer_simple.py:100", c
    assert c.rank_node.split(".")[0] in ("mean", "mean_1") and c.rank_node.endswith("@0"), c.rank_node
    assert c.seq_source == "trace_trainer.py:2487" and c.node == "add_1"
    assert "1/4 times 1/2 = 1/8" in c.reason and "weight differently" in c.reason, c.reason
    assert any("mean.Scale@0" in n and "test_trainer_simple.py:100" in n for n in c.rank_nodes), c.rank_nodes


def test_bug_missing_layernorm_allreduce_imports(tmp_path: Path) -> None:
    """The joint forward+backward dumps import (the loss is divided by the token count cast
    to int32: rules/trunc.py); on every rank the checked layer-norm weight gradient is the
    accumulated main_grad plus the apex backward's weight gradient of the rank's own tokens,
    with no collective in between: the missing all-reduce."""
    r, out = _import(tmp_path, "bug_missing_layernorm_allreduce/tp1", "bug_missing_layernorm_allreduce/tp2.bug",
                     "bug_missing_layernorm_allreduce.json")
    assert r.exit_code == 0, r.output
    dist = json.loads((out / "dist.json").read_text())
    assert dist["expectations"] == [{"output": "ln_weight_grad", "placements": ["Replicate"]}]
    for rank in dist["ranks"]:
        g = rank["graph"]
        nodes = {n["name"]: n for n in g["nodes"]}
        (o,) = g["outputs"]
        add = nodes[o["ref"]]
        assert add["op"] == "add" and "tangents_3" in add["args"]
        grad = nodes[next(a for a in add["args"] if a != "tangents_3")]
        assert grad["op"] == "apex_layer_norm_grad_weight" and grad["shape"] == [1536]
        dy = nodes[grad["args"][0]]
        assert dy["op"] != "all_reduce" and dy["shape"][0] == 512  # the rank's half of the 1024 tokens
    assert any(n["op"] == "cast_trunc_t" for n in dist["ranks"][0]["graph"]["nodes"])


@pytest.mark.slow
def test_bug_missing_layernorm_allreduce_verdict(tmp_path: Path) -> None:
    """DOES NOT REFINE, localized at the layer-norm weight gradient: each rank adds its own
    tokens' apex weight gradient to main_grad (add_24), and the relation of that gradient is
    the sum of the two ranks' pieces, which no all-reduce ever forms. The whole forward and
    backward before it (attention over merged batch*heads, q/k layer norms per head, the
    vocab-parallel cross-entropy and its backward) relates cleanly."""
    _, out = _import(tmp_path, "bug_missing_layernorm_allreduce/tp1", "bug_missing_layernorm_allreduce/tp2.bug",
                     "bug_missing_layernorm_allreduce.json")
    report = check_files(out / "seq.json", out / "dist.json")
    assert not report.refines and report.culprit is not None
    c = report.culprit
    assert c.node == "add_24" and c.source == "fused_layer_norm.py:172", (c.node, c.source)
    assert "not linear" in c.reason and c.rank_node == "add_24.Sum@0"
    # the weight gradient's relation: the sum of the ranks' partial gradients
    grad = dict(c.inputs)["fused_layer_norm_affine_bwd_3.1.view3"]
    assert grad == "(fused_layer_norm_affine_bwd_3.1.view3@0 + fused_layer_norm_affine_bwd_3.1.view3@1)", grad
    (o,) = report.outputs
    assert o.name == "ln_weight_grad" and not o.ok


def test_gpt_tp2_refines(tmp_path: Path) -> None:
    """Megatron GPT, one layer, TP2 + sequence parallelism: the loss refines. The attention
    bmm merges batch and heads (rules/merge_view.py), the vocab-parallel cross-entropy masks
    its target per rank (rules/masked_lookup.py) with the two constants the dump lost given
    by the relation file."""
    r, out = _import(tmp_path, "gpt/paral1_layer1", "gpt/paral2_layer1", "gpt.json")
    assert r.exit_code == 0, r.output
    seq = json.loads((out / "seq.json").read_text())
    assert not any(x["name"].startswith("const") for x in seq["graph"]["inputs"])  # the constants are known
    report = check_files(out / "seq.json", out / "dist.json")
    assert report.refines, str(report)
    (o,) = report.outputs
    assert o.ok and o.relation == "output@0"


@pytest.mark.slow
def test_gpt_tp8_refines(tmp_path: Path) -> None:
    """Megatron GPT, one layer, TP8: the cross-entropy's softmax sums exp over a concat of 8
    vocab shards. The concat is a balanced tree (refine.ir.term.cat), so splitting the sum over
    it reaches the ranks' pieces in 3 levels of rewrites within a step's iteration bound (a
    right-nested chain needed 7), and the carried vocab lookup's term (a concat of 8 pieces)
    stays within Policy.carry_ops, which counts no concats."""
    r, out = _import(tmp_path, "gpt/paral1_layer1", "gpt/paral8_layer1", "gpt.json")
    assert r.exit_code == 0, r.output
    report = check_files(out / "seq.json", out / "dist.json")
    assert report.refines, str(report)
    (o,) = report.outputs
    assert o.ok and o.relation == "output@0"
    assert report.stats["ranks"] == 8


def test_gpt_without_the_constants_does_not_refine(tmp_path: Path) -> None:
    """Without the relation file the cross-entropy's two constants are unknown inputs: the
    masked lookup is not provably the ranks' (a nonzero fill would be summed over ranks), so
    the check must not claim REFINES."""
    _, out = _import(tmp_path, "gpt/paral1_layer1", "gpt/paral2_layer1")
    report = check_files(out / "seq.json", out / "dist.json")
    assert not report.refines and report.culprit is not None
    assert report.culprit.source == "cross_entropy.py:245"


@pytest.mark.slow
def test_aws_llama_tp6_padding_is_defined(tmp_path: Path) -> None:
    """With relations/aws_llama_tp6.json (written by models/entangle/make_aws_llama_tp6.py)
    the TP6 dumps import: the real parts of the padded shards are layouts, every rank's
    QKV weight and the last rank's output projection and MLP weights are defines (zero
    padding, one KV head copy per local query head), and the loader checks them against
    the layouts. A define that puts other columns where a layout reads real ones
    contradicts them: exit 2 at its path. (The check itself: test_aws_llama_tp6_refines below;
    the case is told in the docstring of refine/prove/copies.py.)"""
    sys.path.insert(0, str(RELATIONS.parent))
    try:
        import make_aws_llama_tp6
    finally:
        sys.path.pop(0)
    assert json.loads((RELATIONS / "aws_llama_tp6.json").read_text()) == make_aws_llama_tp6.relations()
    r, out = _import(tmp_path, "aws_llama/tp1_layer1", "aws_llama/tp6_layer1", "aws_llama_tp6.json")
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "dist.json").read_text())
    defines = {d["define"]: d["as"] for d in doc["relations"] if "define" in d}
    assert sorted(defines) == sorted([f"p9_10@{k}" for k in range(6)] + ["p10_11@5", "p12_13@5", "p13_14@5", "p14_15@5"])
    assert defines["p10_11@5"] == "cat(slice(p10_11, 1, 1920, 2048), zeros([2048, 256]), dim=1)"
    from refine.frontends.graphfile import load_dist, load_seq
    from refine.ops.registry import load_registry
    reg = load_registry()
    seq = load_seq(out / "seq.json", reg)
    assert len(load_dist(out / "dist.json", reg, seq).defines) == 10
    # rank 5's output projection with other heads' columns where the layout reads its own
    k = next(i for i, d in enumerate(doc["relations"]) if d.get("define") == "p10_11@5")
    doc["relations"][k]["as"] = "cat(slice(p10_11, 1, 1664, 1920), slice(p10_11, 1, 1920, 2048), dim=1)"
    (out / "dist.json").write_text(json.dumps(doc))
    r = CliRunner().invoke(main, ["check", str(out / "seq.json"), str(out / "dist.json")])
    assert r.exit_code == 2 and f"$.relations[{k}].as" in r.output and "contradicts" in r.output, r.output


@pytest.mark.slow
def test_aws_llama_tp6_refines(tmp_path: Path) -> None:
    """TP6 one layer: each rank's key and value heads are copies of
    the KV heads its query heads read (the defines), found and proven by refine.prove.copies;
    the sequential repeat of the KV heads becomes a concat of broadcast heads
    (rules/repeat.py), which the ranks' 6-head blocks cut; rank 5's two real heads relate
    as slices of its own scores, mask and softmax (rules/fused.py). Slow: ~1 min CPU."""
    r, out = _import(tmp_path, "aws_llama/tp1_layer1", "aws_llama/tp6_layer1", "aws_llama_tp6.json")
    assert r.exit_code == 0, r.output
    report = check_files(out / "seq.json", out / "dist.json")
    assert report.refines, str(report)


@pytest.mark.slow
def test_aws_llama_tp6_second_layer_is_replayed(tmp_path: Path) -> None:
    """TP6 two layers: every step of the second layer is replayed from the first's, those
    told the defines' facts too (refine.prove.reuse), and the copies' proofs hit the engine's
    cache; a wrong KV copy in the second layer alone is found at that layer's scores.
    Measured: 212 nodes related, 85 replayed, 132 e-graph steps of the walk (130 for one
    layer). Slow: ~2.5 min CPU."""
    r, out = _import(tmp_path, "aws_llama/tp1_layer2", "aws_llama/tp6_layer2", "aws_llama_tp6.json")
    assert r.exit_code == 0, r.output
    report = check_files(out / "seq.json", out / "dist.json")
    assert report.refines, str(report)
    assert report.stats["replayed"] >= 80, report.stats
    doc = json.loads((out / "dist.json").read_text())
    layer2 = max({d["define"].split("@")[0] for d in doc["relations"] if "define" in d and d["define"].endswith("@1")},
                 key=lambda s: int(s[1:].split("_")[0]))
    k = next(i for i, d in enumerate(doc["relations"]) if d.get("define") == f"{layer2}@1")
    right = f"cat(slice({layer2}, 1, 384, 768), slice({layer2}, 1, 2112, 2176),"
    assert right in doc["relations"][k]["as"]
    doc["relations"][k]["as"] = doc["relations"][k]["as"].replace(
        right, f"cat(slice({layer2}, 1, 384, 768), slice({layer2}, 1, 2176, 2240),")
    (out / "dist.json").write_text(json.dumps(doc))
    bad = check_files(out / "seq.json", out / "dist.json")
    assert not bad.refines and bad.culprit is not None
    assert bad.culprit.node == "dot_202", bad.culprit


@pytest.mark.slow
def test_aws_llama_tp6_wrong_kv_copy_is_found(tmp_path: Path) -> None:
    """Rank 1's first key head a copy of KV head 2 instead of 1 (its define): the scores
    `dot_91` do not refine. Slow: ~2 min CPU (the localization)."""
    r, out = _import(tmp_path, "aws_llama/tp1_layer1", "aws_llama/tp6_layer1", "aws_llama_tp6.json")
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "dist.json").read_text())
    k = next(i for i, d in enumerate(doc["relations"]) if d.get("define") == "p9_10@1")
    right = "cat(slice(p9_10, 1, 384, 768), slice(p9_10, 1, 2112, 2176),"
    assert right in doc["relations"][k]["as"]
    doc["relations"][k]["as"] = doc["relations"][k]["as"].replace(
        right, "cat(slice(p9_10, 1, 384, 768), slice(p9_10, 1, 2176, 2240),")
    (out / "dist.json").write_text(json.dumps(doc))
    report = check_files(out / "seq.json", out / "dist.json")
    assert not report.refines and report.culprit is not None
    assert report.culprit.node == "dot_91", report.culprit


# ---------------------------------------------------------------------------------------
# source lines and an import without its relation file


def test_aws_llama_nodes_have_source_lines(tmp_path: Path) -> None:
    """The aws_llama (Neuron) dumps keep their frames in meta["stack"]: every translated
    node of the imported case has a source line (none had one before)."""
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["import", "entangle", str(CORPUS / "aws_llama" / "tp1_layer1"),
                                  str(CORPUS / "aws_llama" / "tp2_layer1"), "--out", str(out), "--relations",
                                  str(RELATIONS / "aws_llama.json")])
    assert r.exit_code == 0, r.output
    nodes = json.loads((out / "seq.json").read_text())["graph"]["nodes"]
    assert nodes and all(n.get("source") for n in nodes), [n for n in nodes if not n.get("source")][:3]
    assert all("scribe.py" not in n["source"] for n in nodes)


def test_entangle_import_without_its_relation_file_is_nothing_to_check(tmp_path: Path) -> None:
    """Without bug_missing_layernorm_allreduce.json the importer keeps one output, a logged copy
    of a parameter (tg_log_tensor), on both sides; the check said REFINES."""
    out = tmp_path / "case"
    r = CliRunner().invoke(main, ["import", "entangle", str(CORPUS / "bug_missing_layernorm_allreduce" / "tp1"),
                                  str(CORPUS / "bug_missing_layernorm_allreduce" / "tp2.bug"), "--out", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["check", str(out / "seq.json"), str(out / "dist.json")])
    assert r.exit_code == 2, r.output
    assert f"{out / 'seq.json'}: $.graph.outputs: nothing to check" in " ".join(r.output.split())
    assert "tg_log_tensor" in r.output
