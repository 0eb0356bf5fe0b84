"""Capture real PyTorch training steps (refine.frontends.capture) and check them end to end.

Verdicts come from refine's checker; `refine.oracle.differential.differential` independently runs the
captured programs (simulated collectives) to show each bug twin computes what it claims.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from click.testing import CliRunner
from torch import nn

from refine import capture, check
from refine.check import check_files
from refine.cli import main
from refine.frontends.capture import CaptureError
from tests.helpers.capture import MODELS, failing, line_of, load_model, wrong_numerically

HERE = Path(__file__)


TP = load_model("tp_mlp")
DDP = load_model("ddp_mlp")
GRADS = {f"{p}.grad" for p in ("ln.weight", "ln.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")}


@pytest.fixture(scope="module")
def tp_case() -> capture.Case:
    return capture(TP.make_case())


# ---------------------------------------------------------------------------------------
# the Megatron MLP: capture, then check


@pytest.mark.slow
def test_tp_mlp_whole_step_refines(tp_case: capture.Case) -> None:
    report = check(*tp_case)
    assert report.refines, report
    assert {o.name for o in report.outputs} == {"loss"} | GRADS
    assert {"x", "target", "ln.weight", "ln.bias"} <= {g.split(":")[0] for g in report.guesses}


def test_tp_mlp_documents(tp_case: capture.Case) -> None:
    rel = {r["from"]: r for r in tp_case.dist_doc["relations"]}
    assert rel["fc1.weight"]["placements"] == ["Shard(0)"]
    assert rel["fc2.weight"]["placements"] == ["Shard(1)"]
    assert rel["fc2.bias"]["placements"] == ["Replicate"]  # annotated: written out
    assert "ln.weight" not in rel and "x" not in rel  # guessed Replicate: the checker guesses and flags it
    exp = {e["output"]: e["placements"] for e in tp_case.dist_doc["expectations"]}
    assert exp == {"loss": ["Replicate"], "ln.weight.grad": ["Replicate"], "ln.bias.grad": ["Replicate"],
                   "fc1.weight.grad": ["Shard(0)"], "fc1.bias.grad": ["Shard(0)"],
                   "fc2.weight.grad": ["Shard(1)"], "fc2.bias.grad": ["Replicate"]}
    path = MODELS / "tp_mlp.py"
    for g in [tp_case.seq_doc["graph"]] + [r["graph"] for r in tp_case.dist_doc["ranks"]]:
        assert all(n.get("source", "").startswith("tp_mlp.py:") for n in g["nodes"]), g["nodes"]
    rank0 = tp_case.dist_doc["ranks"][0]["graph"]["nodes"]
    reduces = [n["source"] for n in rank0 if n["op"] == "all_reduce"]
    # g's functional all_reduce forward; f's legacy in-place all_reduce of the input grad backward
    assert sorted(reduces) == sorted([line_of(path, 'return funcol.all_reduce(x, "sum", group)'),
                                      line_of(path, "dist.all_reduce(grad, group=ctx.group)")])
    ln = [n for n in tp_case.seq_doc["graph"]["nodes"] if n["op"] == "layer_norm"]
    assert [n["source"] for n in ln] == [line_of(path, "h = F.gelu(self.fc1(self.ln(x)))")]


@pytest.mark.slow
def test_tp_mlp_cli_writes_a_pair_that_checks(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["capture", f"{MODELS / 'tp_mlp.py'}:make_case", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "GUESSED" in result.output and "fc1.weight: [Shard(0)]" in result.output
    report = check_files(tmp_path / "seq.json", tmp_path / "dist.json")
    assert report.refines, report


def test_missing_grad_all_reduce_is_found_at_the_layer_norm() -> None:
    case = capture(TP.make_case(bug="missing_grad_all_reduce"))
    report = case.check()
    assert not report.refines
    assert failing(report) == {"ln.weight.grad", "ln.bias.grad"}
    assert report.culprit is not None
    assert report.culprit.source == line_of(MODELS / "tp_mlp.py", "h = F.gelu(self.fc1(self.ln(x)))")
    # the sequential gradient is the sum of the ranks' halves: the all-reduce that is missing
    (ln_w,) = [o for o in report.outputs if o.name == "ln.weight.grad"]
    assert ln_w.relation == "(ln.weight.grad@0 + ln.weight.grad@1)"


@pytest.mark.slow
@pytest.mark.parametrize("module,bug,wrong", [
    ("tp_mlp", "bias_before_sum", {"loss"} | GRADS),
    ("tp_mlp", "missing_grad_all_reduce", {"ln.weight.grad", "ln.bias.grad"}),
    ("tp_mlp", "grad_reduced_twice", GRADS - {"fc2.bias.grad"}),
    ("ddp_mlp", "sum_not_avg", {g for g in GRADS if not g.startswith("ln.")}),
    ("ddp_mlp", "loss_averaged_twice", {"loss"} | {g for g in GRADS if not g.startswith("ln.")}),
])
def test_bug_twins_capture_the_bug(module: str, bug: str, wrong: set[str]) -> None:
    """Run the captured programs (simulated collectives): each twin is wrong where it should be."""
    mod = TP if module == "tp_mlp" else DDP
    assert wrong_numerically(capture(mod.make_case())) == set()
    assert wrong_numerically(capture(mod.make_case(bug=bug))) == wrong


@pytest.mark.slow
def test_bias_before_sum_is_found_where_the_rank_adds_it() -> None:
    report = capture(TP.make_case(bug="bias_before_sum")).check()
    assert not report.refines
    assert failing(report) == {"loss"} | GRADS
    c = report.culprit
    assert c is not None
    # the sequential fc2 (matmul + bias) is where the ranks add the bias to partial sums
    assert c.source == line_of(MODELS / "tp_mlp.py", "return self.fc2(h)")
    assert c.rank_source == line_of(MODELS / "tp_mlp.py", "return ReduceFromTP.apply(y + self.bias, self.group)")
    assert "partial sum" in c.reason


@pytest.mark.slow
def test_grad_reduced_twice_is_found_at_the_input_gradient() -> None:
    report = capture(TP.make_case(bug="grad_reduced_twice")).check()
    assert not report.refines
    assert failing(report) == GRADS - {"fc2.bias.grad"}
    c = report.culprit
    assert c is not None and c.output in GRADS
    # the gradient flowing into fc2 is the first that differs; the all-reduce the
    # functional collective's backward adds is among the rank nodes that read it
    assert c.source == line_of(MODELS / "tp_mlp.py", "return self.fc2(h)")
    reduce_line = line_of(MODELS / "tp_mlp.py", 'y = funcol.all_reduce(y, "sum", self.group)')
    assert any(x.endswith(f"at {reduce_line}") for x in c.rank_nodes), c.rank_nodes


# ---------------------------------------------------------------------------------------
# data parallel


@pytest.mark.slow
def test_ddp_mlp_refines_and_its_twins_do_not() -> None:
    report = check(*capture(DDP.make_case()))
    assert report.refines, report
    sum_not_avg = capture(DDP.make_case(bug="sum_not_avg")).check()
    assert not sum_not_avg.refines and failing(sum_not_avg) == {"fc1.weight.grad", "fc1.bias.grad",
                                                                "fc2.weight.grad", "fc2.bias.grad"}
    # every relation is clean: the rank output itself is wrong, made by the gradient all-reduce
    assert sum_not_avg.culprit is not None
    assert sum_not_avg.culprit.rank_source == line_of(MODELS / "ddp_mlp.py", "dist.all_reduce(p.grad, op=dist.ReduceOp.SUM if")
    # every output off by one factor (the world size): the flip of the reduction to AVG is the edit
    # that repairs them all (refine.verdict.factor), so the culprit is the all-reduce's own line
    assert sum_not_avg.culprit.source == sum_not_avg.culprit.rank_source
    twice = capture(DDP.make_case(bug="loss_averaged_twice")).check()
    assert not twice.refines and "loss" in failing(twice)
    # the spare division (its 1/world times world is 1), not the AVG all-reduces that could absorb it
    assert twice.culprit is not None and twice.culprit.source == line_of(MODELS / "ddp_mlp.py", "loss = loss / world")


@pytest.mark.slow
def test_dp_tp_mesh_of_subgroups() -> None:
    case = capture(TP.make_case(world_size=4, dp=2))
    groups = {r["rank"]: {(tuple(n["attrs"]["group"]), n["attrs"].get("reduce_op")) for n in r["graph"]["nodes"]
                          if n["op"] == "all_reduce"} for r in case.dist_doc["ranks"]}
    assert groups[0] == {((0, 1), "sum"), ((0, 2), "avg")}
    assert groups[3] == {((2, 3), "sum"), ((1, 3), "avg")}
    rel = {r["from"]: r["placements"] for r in case.dist_doc["relations"]}
    assert rel["x"] == ["Shard(0)", "Replicate"] and rel["fc1.weight"] == ["Replicate", "Shard(0)"]
    assert wrong_numerically(case) == set()
    assert wrong_numerically(capture(TP.make_case(world_size=4, dp=2, bug="loss_averaged_twice"))) == {"loss"} | GRADS


@pytest.mark.slow
def test_dp_tp_mesh_refines() -> None:
    report = capture(TP.make_case(world_size=4, dp=2)).check()
    assert report.refines, report


# ---------------------------------------------------------------------------------------
# small programs: annotations, collectives, errors


class Lin(nn.Module):
    def __init__(self, out: int = 4, mode: str = "", rank: int = 0) -> None:
        super().__init__()
        self.fc = nn.Linear(4, out)
        self.mode, self.rank = mode, rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if self.mode == "cumprod":
            y = torch.cumprod(y, 0)
        if self.mode == "branch" and y.sum() > 0:
            y = y * 2
        if self.mode == "extra_reduce" and self.rank == 1:
            y = funcol.all_reduce(y, "sum", dist.group.WORLD)
        return y


def sum_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).sum()
    loss.backward()
    return loss


def spec(rank_model: Any, seq_model: nn.Module | None = None, step: Any = sum_step, seq_step: Any = sum_step,
         **kw: Any) -> capture.Spec:
    torch.manual_seed(0)
    x = torch.randn(2, 4)

    def built(make: Any) -> nn.Module:
        torch.manual_seed(1)  # both sides start from the same weights: capture checks the relations on the values
        return make()

    return capture.Spec(capture.Step(seq_model or built(Lin), seq_step, {"x": x}),
                        lambda r: capture.Step(built(lambda: rank_model(r)), step, {"x": x}), **kw)


def half(r: int) -> nn.Module:
    """Rank r's rows of the sequential Lin (made from the same seed), under the same names."""
    full, model = Lin(), Lin(out=2)
    model.fc.load_state_dict({k: v[2 * r:2 * r + 2] for k, v in full.fc.state_dict().items()})
    return model


def test_annotation_names_another_sequential_input_and_layouts(tmp_path: Path) -> None:
    class Col(nn.Module):  # fc split by output rows, under other names
        def __init__(self, r: int, how: str) -> None:
            super().__init__()
            full = Lin().fc  # the sequential weights (the same seed): this rank's rows of them
            self.w = nn.Parameter(full.weight.detach()[2 * r:2 * r + 2].clone())
            self.b = capture.shard(nn.Parameter(full.bias.detach()[2 * r:2 * r + 2].clone()), 0, seq="fc.bias")
            if how == "shard":
                capture.shard(self.w, 0, seq="fc.weight")
            else:
                capture.layout(self.w, "cat(w@0, w@1, dim=0)", seq="fc.weight")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, self.w, self.b)

    def seq_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), x, reduction="sum")
        loss.backward()
        return loss

    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        r = dist.get_rank()
        loss = F.mse_loss(model(x), x[:, 2 * r:2 * r + 2], reduction="sum")  # this rank's columns' part
        loss.backward()
        return funcol.all_reduce(loss.detach(), "sum", dist.group.WORLD)

    shard = capture(spec(lambda r: Col(r, "shard"), step=step, seq_step=seq_step))
    assert {"from": "fc.weight", "input": "w", "placements": ["Shard(0)"]} in shard.dist_doc["relations"]
    assert {"output": "fc.weight.grad", "local": "w.grad", "placements": ["Shard(0)"]} in \
        shard.dist_doc["expectations"]
    assert shard.check().refines
    laid = capture(spec(lambda r: Col(r, "layout"), step=step, seq_step=seq_step))
    assert {"from": "fc.weight", "layout": "cat(w@0, w@1, dim=0)"} in laid.dist_doc["relations"]
    assert any("fc.weight.grad" in n for n in laid.notes)  # no placement to expect: reconstructible
    assert laid.check().refines
    # not annotated: same names, the rows halved, so Shard(0) is guessed and the report says so
    guessed = capture(spec(half, step=step, seq_step=seq_step))
    assert {"from": "fc.weight", "placements": ["Shard(0)"], "guessed": True} in guessed.dist_doc["relations"]
    report = guessed.check()
    assert report.refines, report
    assert any(g.startswith("fc.weight: [Shard(0)] (dim 0 is 1/2") for g in report.guesses), report.guesses
    # the written documents keep the flag: a check from the files reports the guess too
    guessed.write(tmp_path)
    from_files = check_files(tmp_path / "seq.json", tmp_path / "dist.json")
    assert any(g.startswith("fc.weight: [Shard(0)] (guessed") for g in from_files.guesses), from_files.guesses


@pytest.mark.parametrize("after", ["squeeze", "detach", "in_step"])
def test_an_annotation_on_a_tensor_the_step_never_receives_is_an_error(after: str) -> None:
    """An op after the annotation makes a new tensor with none: refused at the annotating
    line, never an annotation lost (the input would be guessed, or taken as replicated)."""
    x = torch.randn(1, 2, 4)

    def rank(r: int) -> capture.Step:
        piece = x[:, r:r + 1].clone()
        if after == "squeeze":
            data = capture.shard(piece, 0).squeeze(0)  # the annotated tensor is `piece`
        elif after == "detach":
            data = capture.shard(piece, 0).detach()
        else:
            data = piece.squeeze(0)

        def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
            x = capture.shard(x, 0) if after == "in_step" else x  # a traced value, not an input
            return sum_step(model, x)

        return capture.Step(Lin(), step, {"x": data})

    with pytest.raises(CaptureError) as e:
        capture(capture.Spec(capture.Step(Lin(), sum_step, {"x": x.squeeze(0)}), rank))
    msg = str(e.value)
    assert "rank 0" in msg and "Shard(0)" in msg and "test_capture.py:" in msg and "not a parameter" in msg, msg


def test_annotating_the_tensor_the_step_receives_is_kept() -> None:
    x = torch.randn(1, 2, 4)

    def lin() -> nn.Module:
        torch.manual_seed(1)  # the same weights on both sides
        return Lin()

    case = capture(capture.Spec(capture.Step(lin(), sum_step, {"x": x.squeeze(0)}),
                                lambda r: capture.Step(lin(), sum_step,
                                                       {"x": capture.shard(x[:, r:r + 1].clone().squeeze(0), 0)})))
    assert {"from": "x", "placements": ["Shard(0)"]} in case.dist_doc["relations"], case.dist_doc["relations"]


class Attention(nn.Module):
    """Fused qkv split into heads, softmax, a residual: a broad sample of the op mapping."""

    def __init__(self) -> None:
        super().__init__()
        self.ln, self.qkv, self.out = nn.LayerNorm(8), nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(2, 4, 2, 4).transpose(1, 2) for t in self.qkv(self.ln(x)).split(8, dim=-1))
        a = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1)
        return self.out((a @ v).transpose(1, 2).reshape(2, 4, 8)) + x


def test_a_rank_running_the_sequential_step_refines() -> None:
    """One rank, the same code: the captured pair must refine (mean loss, attention backward);
    the seed gradient of the mean is folded to a constant on both sides."""

    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    x = torch.randn(2, 4, 8)
    model = Attention()
    case = capture(capture.Spec(capture.Step(model, step, {"x": x}), lambda r: capture.Step(model, step, {"x": x}),
                                world_size=1))
    assert case.check().refines
    ops = {n["op"] for n in case.seq_doc["graph"]["nodes"]}
    assert {"layer_norm", "_softmax", "bmm", "slice", "permute", "full"} <= ops


@pytest.mark.filterwarnings("ignore:.*autograd kernel was not registered")  # backprop through broadcast
def test_collectives_map_with_group_ranks() -> None:
    def rank_model(r: int) -> nn.Module:
        class M(Lin):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                pair = dist.new_group([0, 1])
                y = self.fc(x)
                z = y.clone()
                dist.broadcast(z, 1, group=pair)  # a global rank for the legacy op
                g = funcol.all_gather_tensor(y, 1, pair)  # along dim 1: gather, split, concat
                out = torch.empty(2, 4)
                dist.reduce_scatter_tensor(out, g.reshape(4, 4), group=pair)
                return z + funcol.broadcast(y, 0, pair) + out  # funcol's src is a group rank
        return M()

    case = capture(spec(rank_model, world_size=2))
    ops = [(n["op"], n["attrs"]) for n in case.dist_doc["ranks"][1]["graph"]["nodes"]
           if n["op"] in ("broadcast", "all_gather", "reduce_scatter", "concat")]
    assert ops == [("broadcast", {"src": 1, "group": [0, 1]}), ("all_gather", {"dim": 0, "group": [0, 1]}),
                   ("concat", {"dim": 1}), ("reduce_scatter", {"dim": 0, "reduce_op": "sum", "group": [0, 1]}),
                   ("broadcast", {"src": 0, "group": [0, 1]}),
                   # backward: the autograd-aware functional all_gather's gradient is a reduce_scatter
                   ("reduce_scatter", {"dim": 0, "reduce_op": "sum", "group": [0, 1]})]


@pytest.mark.parametrize("mode,words", [
    ("cumprod", ["aten.cumprod.default", "FX node 'cumprod'", "unknown op"]),
    ("branch", ["data-dependent control flow"]),
])
def test_untraceable_or_unknown_code_is_refused_at_its_line(mode: str, words: list[str]) -> None:
    with pytest.raises(CaptureError) as e:
        capture(spec(lambda r: Lin(mode=mode), seq_model=Lin(mode=mode)))
    for w in words:
        assert w in str(e.value)
    snippet = "torch.cumprod(y, 0)" if mode == "cumprod" else "y.sum() > 0"
    assert e.value.source == line_of(HERE, snippet)


def test_mismatched_collectives_are_reported_by_the_loader() -> None:
    with pytest.raises(CaptureError) as e:
        capture(spec(lambda r: Lin(mode="extra_reduce", rank=r)))
    text = str(e.value)
    assert "rank 1, node 'all_reduce'" in text and "has no partner on rank 0" in text
    assert line_of(HERE, 'y = funcol.all_reduce(y, "sum", dist.group.WORLD)') in text


def test_a_gradient_missing_on_a_rank_is_named() -> None:
    class Frozen(Lin):
        def __init__(self) -> None:
            super().__init__()
            self.fc.bias.requires_grad_(False)

    with pytest.raises(CaptureError, match=r"gradient for 'fc.bias' but rank 0 has none"):
        capture(spec(lambda r: Frozen()))


def test_a_stale_alias_after_an_in_place_op_is_refused() -> None:
    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).sum()
        loss.backward()
        row = model.fc.weight.grad[0]
        dist.all_reduce(model.fc.weight.grad)
        return loss + row.sum()  # a part of the storage the all-reduce wrote, viewed before it

    with pytest.raises(CaptureError, match="reads afterwards through another alias"):
        capture(spec(lambda r: Lin(), step=step))


def test_a_whole_alias_reads_what_a_legacy_collective_wrote() -> None:
    """A flattened view of a gradient, all-reduced in place, read back through the gradient
    (Megatron's finalize_model_grads on one sequence-parallel parameter: the flat buffer of a
    single gradient is a view of it): the gradient holds the reduced values."""
    torch.manual_seed(0)
    x = torch.randn(4, 4)

    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = (model(x) ** 2).sum()
        loss.backward()
        for p in model.parameters():
            flat = p.grad.view(-1)
            dist.all_reduce(flat)  # the batch is split: the gradients' sum is the whole batch's
            p.grad.mul_(2.0)  # reads the gradient through its own name after the write to flat
        dist.all_reduce(loss)
        return loss

    def seq_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = (model(x) ** 2).sum()
        loss.backward()
        for p in model.parameters():
            p.grad.mul_(2.0)
        return loss

    def rank(r: int) -> capture.Step:
        torch.manual_seed(1)
        model = Lin()
        for p in model.parameters():
            capture.replicate(p)
        return capture.Step(model, step, {"x": capture.shard(x[2 * r:2 * r + 2].clone(), 0)})

    torch.manual_seed(1)
    case = capture(capture.Spec(capture.Step(Lin(), seq_step, {"x": x}), rank))
    reduces = [n for n in case.dist_doc["ranks"][0]["graph"]["nodes"] if n["op"] == "all_reduce"]
    assert len(reduces) == 3
    assert wrong_numerically(case) == set()
    assert case.check().refines


def test_a_whole_alias_reads_an_in_place_write_through_a_view() -> None:
    """`scores.view(...).masked_fill_(mask, v)` then reading `scores` again (Megatron's
    attention mask function): the read sees the masked values; an out= op writing its input
    (`torch.exp(x, out=x)`, Megatron's cross-entropy) is the op."""

    def masked(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        s = model(x) * 2
        s.view(4, 2).masked_fill_(torch.tensor([[True, False]] * 4), -3.0)
        with torch.no_grad():  # out= ops do not differentiate (Megatron's run in a Function's forward)
            e = x * 1.0
            torch.exp(e, out=e)
        loss = (s.view(2, 4) * e).sum()
        loss.backward()
        return loss

    def plain(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        s = (model(x) * 2).view(4, 2).masked_fill(torch.tensor([[True, False]] * 4), -3.0).view(2, 4)
        loss = (s * x.exp()).sum()
        loss.backward()
        return loss

    case = capture(spec(lambda r: Lin(), step=masked, seq_step=plain))
    assert wrong_numerically(case) == set()
    assert case.check().refines


def test_a_decrement_at_distinct_positions_is_an_accumulation() -> None:
    """`g[arange(n), t] -= u` (Megatron's cross-entropy backward) writes each row once, so
    refine takes it as the accumulation of -u; at positions that may repeat it is refused
    (an unspecified write wins)."""
    t = torch.tensor([1, 3])

    def step(distinct: bool) -> Any:
        def run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
            g = model(x) * 1.0
            rows = torch.arange(2) if distinct else torch.zeros(2, dtype=torch.long)
            g[rows, t] -= x[:, 0]
            loss = g.sum()
            loss.backward()
            return loss
        return run

    # the captured sequential graph is replayed against the eager step: a wrong translation fails
    case = capture(spec(lambda r: Lin(), step=step(True), seq_step=step(True)))
    puts = [n for n in case.seq_doc["graph"]["nodes"] if n["op"] == "index_put"]
    assert puts and all(n["attrs"].get("accumulate") for n in puts)
    assert case.check().refines
    with pytest.raises(CaptureError, match=r"without accumulate .* at positions that may repeat.*test_capture\.py:"):
        capture(spec(lambda r: Lin(), step=step(False), seq_step=step(False)))


def test_an_in_place_write_through_another_name_is_followed() -> None:
    """`p.grad.data.copy_(...)` then reading `p.grad` (as Megatron's finalize_model_grads
    does): the read follows the write. The replay against the eager step checks the value."""

    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).sum()
        loss.backward()
        g = model.fc.weight.grad
        g.data.copy_(g * 3)
        return loss

    case = capture(spec(lambda r: Lin(), step=step, seq_step=step))
    assert any(n["op"] == "Scale" or (n["op"] == "mul" and 3 in n["args"]) for n in case.seq_doc["graph"]["nodes"])
    assert case.check().refines


def test_ambiguous_guesses_ask_for_an_annotation() -> None:
    with pytest.raises(CaptureError, match=r"mesh axes \['a', 'b'\] all have 2 ranks.*annotate"):
        capture(spec(lambda r: Lin(out=2), seq_model=Lin(out=4), world_size=4, mesh={"a": 2, "b": 2}))


def test_replay_catches_a_wrong_translation(monkeypatch: pytest.MonkeyPatch) -> None:
    from refine.frontends.capture import aten

    def ones_as_twos(em: Any, node: Any, a: dict[str, Any]) -> str:
        return em.emit("full", [], {"value": 2.0, "shape": [int(s) for s in node.meta["val"].shape]})

    monkeypatch.setitem(aten.SPECIAL, "full_like", ones_as_twos)
    with pytest.raises(CaptureError, match="computes output 'fc.weight.grad' differently"):
        capture(spec(lambda r: Lin()))


def test_cli_errors_exit_2_and_write_nothing(tmp_path: Path) -> None:
    case = tmp_path / "bad.py"
    case.write_text("import torch\n\ndef make_case():\n    return torch.zeros(1)\n")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["capture", f"{case}:make_case", "--out", str(out)])
    assert result.exit_code == 2
    assert "error:" in result.output and "must return a refine.capture.Spec" in result.output
    assert not out.exists()
    result = CliRunner().invoke(main, ["capture", f"{case}:nope", "--out", str(out)])
    assert result.exit_code == 2 and "has no function 'nope'" in result.output


def test_case_write_round_trips(tp_case: capture.Case, tmp_path: Path) -> None:
    tp_case.write(tmp_path)
    assert json.loads((tmp_path / "seq.json").read_text()) == tp_case.seq_doc
    assert json.loads((tmp_path / "dist.json").read_text()) == tp_case.dist_doc
