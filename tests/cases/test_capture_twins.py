"""Every captured twin (models/capture/*.py, one per `BUGS` entry): how it is built, and the
rank line its report names.

Each module's `BUGS` maps a bug to the `make_case` keyword arguments its twin is built with
(`{}`: the defaults); everything that iterates the twins builds each with them. The planted
bug's line carries `# BUG: <name>` at its end: the line whose code the bug changes, or, for
a statement the bug leaves out (a missing all-reduce, a skipped mask), the line making the
value that statement should have taken (a gradient is made by the backward of its forward
line, and refine reports it at that line). The report's rank line (`Culprit.rank_source`:
the localization's numeric repair, else the rank node the counterexample shows going wrong
first) must be a marked line.
"""

from __future__ import annotations

import inspect
import re
from types import ModuleType

import pytest

from models.zoo import marked_lines
from refine import capture
from tests.helpers.capture import MODELS, load_model

MODULES = sorted(p.stem for p in MODELS.glob("*.py"))
_LOADED: dict[str, ModuleType] = {}


def module(name: str) -> ModuleType:
    if name not in _LOADED:
        _LOADED[name] = load_model(name)
    return _LOADED[name]


def marked(name: str) -> dict[str, set[str]]:
    """bug -> the "file.py:N" lines of models/capture/<name>.py marked `# BUG: <bug>`."""
    return marked_lines(MODELS / f"{name}.py")


TWINS = [(m, b) for m in MODULES for b in module(m).BUGS]

# twins whose report names no marked line, and why: the divergence search repairs rank values
# with placements of sequential values, one node (with its recomputations and the nodes of its
# line with its op) at a time, and a backward pass has no node the forward's repair reaches
CANNOT: dict[tuple[str, str], str] = {
    ("cp_attention", "wrong_block_max"):
        "the wrong value is a block's log-sum-exp (line 92), which holds no sequential tensor (the sequential "
        "softmax has none); the attention output it corrupts does, but the ring's backward reads the saved "
        "log-sum-exp, so no repair of a value with a sequential counterpart makes the gradients right",
    ("dtensor_mlp", "grad_placements_partial"):
        "the declaration's nodes (to_local's reshapes, line 98) hold right values; what is wrong is how DTensor's "
        "backward treats them: a reduce-scatter in fc2's backward (line 75) sums copies of a gradient every rank "
        "holds whole, which the localization names",
    ("gqa_tp", "kv_heads_tiled"):
        "the tiled repeat (line 149) makes four wrong values: keys and values, and in the backward their "
        "gradients summed over the wrong copies (another op, the same line); a repair of one op's nodes leaves "
        "the other's wrong",
    ("gqa_tp", "wrong_kv_head"):
        "the wrong head is picked on two lines, keys (158) and values (159): a repair of either leaves the other "
        "wrong, and the search repairs one line at a time",
    ("hf_llama", "o_proj_partial"):
        "the bug is a plan entry (hf_llama.py, applied when the model is built): every rank node it affects is "
        "made in transformers' code, so the report names transformers' row-parallel forward (tensor_parallel.py, "
        "o_proj's matmul, whose partial sum is never reduced), no line of hf_llama.py",
    ("moe_ep", "combine_wrong_expert_order"):
        "the wrong permutation (line 160) runs forward and again, transposed, in the backward (another op, the "
        "same line): repairing the forward values cannot make the gradients right",
    ("moe_ep", "gate_not_renormalized"):
        "the left-out op is a division of the gate weights (after line 83): repairing their value fixes the "
        "forward, but not the router's gradient, which misses the division's backward",
    ("pp_schedule", "grads_not_scaled"):
        "the missing 1/micro is torch's own gradient scaling (scale_grads, a div_ inside the schedule, no user "
        "line): the wrong-constant repair names the loss function's line (line 82), where dividing each "
        "micro-batch loss by micro is the equivalent fix",
    ("vocab_ce", "sum_exp_not_all_reduced"):
        "the sum of exponentials is carried into its one user (refine.prove.walk.infer: no rank holds it "
        "reduced), so the proof stops at the log-probabilities' line (110), where the missing all-reduce is "
        "first read, not at the line making the partial sum (107)",
    ("pp_tp", "stage1_missing_all_reduce"):
        "the report names the schedule's step line: localize's wrong-message rule fires (the loss's relation "
        "takes rank 2's partial residual while rank 3 adds its own partial to the activation it received) and "
        "the partial-sum repair reads only relations whose top is a Sum, here a concat over micro-batches of "
        "Sums (tests/cases/test_capture_pp_tp.py's strict xfail)",
    ("vocab_ce", "ignored_in_denominator"):
        "the draws never hit the ignore index -100, so the outputs agree (UNPROVEN); on draws that do, the wrong "
        "count is a constant of the division (target.numel(), line 154) that also scales its backward, so no "
        "value repair makes the gradients right",
}
# more than ~5 s each (capture and check): the whole suite runs them; the quick run keeps the
# rest (one ring-attention twin, cp_attention:no_rescale, among them)
SLOW: set[tuple[str, str]] = {
    ("accum_mlp", "loss_divided_twice"), ("clip_mlp", "norm_not_all_reduced"),
    ("clip_norm", "replicated_norm_all_reduced"), ("clip_norm", "bias_counted_on_two_ranks"),
    ("clip_norm", "shard_left_out"), ("dtensor_mlp", "partial_output_loss"),
    ("dtensor_mlp", "grad_placements_partial"), ("dtensor_mlp", "local_loss"), ("gqa_tp", "kv_heads_tiled"),
    ("gqa_tp", "wrong_kv_head"), ("hf_llama", "o_proj_partial"), ("megatron_mlp", "ln_grad_not_all_reduced"),
    ("megatron_mlp", "bias_before_all_reduce"), ("moe_ep", "router_grad_not_summed"),
    ("moe_ep", "combine_wrong_expert_order"), ("moe_ep", "gate_not_renormalized"),
    ("moe_router", "router_grad_not_summed"), ("pp_tied", "tied_grad_not_reduced"), ("tp_mlp", "bias_before_sum"),
    ("pp_tp", "stage1_missing_all_reduce"), ("pp_tp", "grads_averaged_over_pp"),
    ("sp_residual", "norm_grad_not_reduced"),
}


def _param(m: str, b: str) -> object:
    marks = []
    if (m, b) in CANNOT:
        marks.append(pytest.mark.xfail(strict=True, reason=CANNOT[(m, b)]))
    if (m, b) in SLOW:
        marks.append(pytest.mark.slow)
    return pytest.param(m, b, marks=marks, id=f"{m}:{b}")


@pytest.mark.parametrize("name", MODULES)
def test_every_module_states_each_twins_arguments_and_marks_its_line(name: str) -> None:
    mod = module(name)
    assert isinstance(mod.BUGS, dict) and mod.BUGS, name
    signature = inspect.signature(mod.make_case)
    for bug, kwargs in mod.BUGS.items():
        assert isinstance(kwargs, dict) and "bug" not in kwargs, (bug, kwargs)
        signature.bind(bug=bug, **kwargs)  # every argument is one make_case takes
    assert set(marked(name)) == set(mod.BUGS), "each bug marks its line(s), and only bugs of BUGS are marked"
    with pytest.raises(ValueError, match="unknown bug"):
        mod.make_case(bug="no_such_bug")


@pytest.mark.parametrize(("name", "bug"), [(m, b) for m, b in TWINS if module(m).BUGS[b]],
                         ids=[f"{m}:{b}" for m, b in TWINS if module(m).BUGS[b]])
def test_a_twin_built_without_its_arguments_is_refused_saying_which(name: str, bug: str) -> None:
    """The arguments a twin states are the ones it needs: without them make_case does not
    build a program without the bug, it says how to build the twin."""
    with pytest.raises(ValueError, match=re.escape(f"make_case(bug={bug!r}")):
        module(name).make_case(bug=bug)


def test_the_tables_name_twins_that_exist() -> None:
    assert set(CANNOT) <= set(TWINS) and SLOW <= set(TWINS)


@pytest.mark.parametrize(("name", "bug"), [_param(m, b) for m, b in TWINS])
def test_the_report_names_the_marked_bug_line(name: str, bug: str) -> None:
    mod = module(name)
    report = capture(mod.make_case(bug=bug, **mod.BUGS[bug])).check()
    assert not report.refines and report.search is not None and report.search.found is not None, report
    c = report.culprit
    assert c is not None and c.rank_source in marked(name)[bug], (c.rank_source if c else None, str(report))
