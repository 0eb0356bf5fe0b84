"""Hooks change what a step computes; capture traces them or refuses them, never drops them
(issue 20).

Capture traces each step over fresh leaves standing for the parameters, so hooks held by the
parameter objects (`register_hook`, `register_post_accumulate_grad_hook`) used to be dropped
silently: a rank scaling a gradient in a hook REFINED, and a correct program that
synchronises its gradients from hooks did not. Now they are registered again on the leaves
and traced. Module hooks (forward, forward-pre, full backward, global) run inside the traced
call and are traced with it. What cannot be traced is refused with its name: data-parallel
wrappers whose communication runs from hooks the trace cannot see (a DistributedDataParallel
inside a model), hooks held on a parameter's gradient accumulator, gradient hooks on data
inputs. FSDP2's fully_shard, whose hooks all-gather and reduce-scatter, has its communication
written into the trace (refine.frontends.capture.fsdp), and a hook setting of it that glue
does not model is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from refine import capture
from refine.frontends.capture import CaptureError
from tests.helpers.capture import failing

B, H = 4, 4
GRADS = {"fc1.weight.grad", "fc1.bias.grad", "fc2.weight.grad", "fc2.bias.grad"}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).pow(2).sum()
    loss.backward()
    return loss


Setup = Callable[[nn.Module], Any]


def replicated(rank_setup: Setup | None = None, seq_setup: Setup | None = None) -> capture.Spec:
    """Every rank runs the whole step on the whole batch (replicated): correct unless a hook
    changes one side. `*_setup(model)` registers hooks on that side's model."""
    torch.manual_seed(0)
    seq, x = MLP(), torch.randn(B, H)
    if seq_setup is not None:
        seq_setup(seq)

    def rank(r: int) -> capture.Step:
        model = MLP()
        model.load_state_dict(seq.state_dict())
        if rank_setup is not None:
            rank_setup(model)
        return capture.Step(model, step, {"x": x})

    return capture.Spec(capture.Step(seq, step, {"x": x}), rank, world_size=2)


def double(g: torch.Tensor) -> torch.Tensor:
    return g * 2


def same(g: torch.Tensor) -> torch.Tensor:
    return g * 1.0


def verdict(spec: capture.Spec) -> set[str]:
    """The outputs that fail (empty: the pair refines)."""
    report = capture(spec).check()
    assert report.refines == (not failing(report)), report
    return failing(report)


# ---------------------------------------------------------------------------------------
# gradient hooks on parameters: registered on the traced leaves


def test_a_gradient_hook_that_scales_a_gradient_does_not_refine() -> None:
    assert verdict(replicated(lambda m: m.fc1.weight.register_hook(double))) == {"fc1.weight.grad"}


def test_a_post_accumulate_grad_hook_does_not_refine() -> None:
    def scale_in_place(p: torch.Tensor) -> None:
        p.grad.mul_(3)

    assert verdict(replicated(lambda m: m.fc2.bias.register_post_accumulate_grad_hook(scale_in_place))) == \
        {"fc2.bias.grad"}


def test_a_hook_on_the_sequential_side_only_does_not_refine() -> None:
    """The sequential step is traced with its hook too (and replayed eagerly with it)."""
    assert verdict(replicated(seq_setup=lambda m: m.fc2.weight.register_hook(double))) == {"fc2.weight.grad"}


def test_the_same_hook_on_both_sides_refines() -> None:
    def hooks(m: nn.Module) -> None:
        m.fc1.weight.register_hook(double)
        m.fc1.bias.register_hook(same)

    assert verdict(replicated(hooks, hooks)) == set()


def dp_spec(op: str) -> capture.Spec:
    """Data parallel with the gradients averaged from post-accumulate-grad hooks (what DDP does
    from its reducer): every rank holds the model and its shard of the batch."""
    torch.manual_seed(0)
    seq, x = MLP(), torch.randn(B, H)

    def mean_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    def sync(p: torch.Tensor) -> None:
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM)

    def dp_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = mean_step(model, x)
        return funcol.all_reduce(loss.detach(), "avg", dist.group.WORLD)

    def rank(r: int) -> capture.Step:
        model = MLP()
        model.load_state_dict(seq.state_dict())
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(sync)
        return capture.Step(model, dp_step, {"x": capture.shard(x[r * 2:(r + 1) * 2], 0)})

    return capture.Spec(capture.Step(seq, mean_step, {"x": x}), rank, world_size=2)


def test_gradients_synchronised_from_hooks_are_traced() -> None:
    """A correct program whose all-reduces run in hooks refines (they used to be dropped, so it
    did not); with SUM for AVG every gradient is wrong."""
    case = capture(dp_spec("avg"))
    reduces = [n for n in case.dist_doc["ranks"][0]["graph"]["nodes"] if n["op"] == "all_reduce"]
    assert len(reduces) == 5  # one per parameter, and the loss
    report = case.check()
    assert report.refines, report
    assert verdict(dp_spec("sum")) == GRADS


# ---------------------------------------------------------------------------------------
# module hooks: they run inside the traced call


def test_a_module_forward_hook_that_changes_the_output_does_not_refine() -> None:
    def hook(m: nn.Module) -> None:
        m.fc2.register_forward_hook(lambda mod, args, out: out * 2)

    assert verdict(replicated(hook)) == {"loss"} | GRADS


def test_a_module_forward_pre_hook_does_not_refine() -> None:
    def hook(m: nn.Module) -> None:
        m.fc2.register_forward_pre_hook(lambda mod, args: (args[0] + 1,))

    assert verdict(replicated(hook)) == {"loss"} | GRADS


def test_a_module_backward_hook_does_not_refine() -> None:
    def halve_input_grad(mod: nn.Module, grad_in: tuple[Any, ...], grad_out: tuple[Any, ...]) -> tuple[Any, ...]:
        return (grad_in[0] / 2,)

    assert verdict(replicated(lambda m: m.fc2.register_full_backward_hook(halve_input_grad))) == \
        {"fc1.weight.grad", "fc1.bias.grad"}


def test_a_global_module_hook_is_traced() -> None:
    def hook(mod: nn.Module, args: Any, out: Any) -> Any:
        return out * 2 if dist.is_initialized() and isinstance(mod, nn.Linear) else out  # the ranks only

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        assert "loss" in verdict(replicated())
    finally:
        handle.remove()


# ---------------------------------------------------------------------------------------
# refused: what the trace cannot see


def nested_ddp_spec() -> capture.Spec:
    """A DDP wrapper inside the rank's model (a model that is a DDP is captured through
    refine.frontends.capture.ddp: tests/cases/test_capture_ddp.py)."""
    torch.manual_seed(0)
    seq, x = nn.Module(), torch.randn(B, H)
    seq.inner = MLP()

    def seq_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return step(model.inner, x)

    def rank(r: int) -> capture.Step:
        model = MLP()
        model.load_state_dict(seq.inner.state_dict())
        outer = nn.Module()
        outer.inner = nn.parallel.DistributedDataParallel(model)
        return capture.Step(outer, seq_step, {"x": capture.shard(x[r * 2:(r + 1) * 2], 0)})

    return capture.Spec(capture.Step(seq, seq_step, {"x": x}), rank, world_size=2)


def test_distributed_data_parallel_inside_a_model_is_refused_by_name() -> None:
    """DDP's reducer all-reduces from hooks on the parameters' gradient accumulators, in C++:
    inside a model the trace would drop them."""
    with pytest.raises(CaptureError) as e:
        capture(nested_ddp_spec())
    text = str(e.value)
    assert "rank 0: module 'inner' is a torch.nn.parallel.DistributedDataParallel" in text
    assert "all-reduces the gradients" in text and "dist.all_reduce(p.grad" in text


def fully_shard_spec(configure: Callable[[nn.Module], None] | None = None) -> capture.Spec:
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    seq, x = MLP(), torch.randn(B, H)

    def rank(r: int) -> capture.Step:
        model = MLP()
        model.load_state_dict(seq.state_dict())
        fsdp.fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        if configure is not None:
            configure(model)
        return capture.Step(model, step, {"x": x})

    return capture.Spec(capture.Step(seq, step, {"x": x}), rank, world_size=2)


def test_fully_shard_communication_is_traced_not_dropped() -> None:
    case = capture(fully_shard_spec())
    ops = {n.op for g in case.dist.ranks.values() for n in g.nodes}
    assert {"all_gather", "reduce_scatter"} <= ops


def test_a_fully_shard_hook_capture_does_not_model_is_refused_by_name() -> None:
    with pytest.raises(CaptureError, match=r"rank 0: FSDP parameter '.*' is reduced with a setting capture does not "
                                           r"model: an all-reduce hook"):
        capture(fully_shard_spec(lambda m: m.set_all_reduce_hook(lambda t: None)))


def test_a_hook_on_a_gradient_accumulator_is_refused() -> None:
    kept: list[Any] = []

    def hook_accumulator(m: nn.Module) -> None:  # what DDP-style wrappers do for each parameter
        acc = m.fc1.bias.view_as(m.fc1.bias).grad_fn.next_functions[0][0]
        acc.register_hook(lambda grad_in, grad_out: None)
        kept.append(acc)

    with pytest.raises(CaptureError, match=r"rank 0: parameter 'fc1.bias' has its gradient accumulator"):
        capture(replicated(hook_accumulator))


def test_a_gradient_hook_on_a_data_input_is_refused() -> None:
    torch.manual_seed(0)
    seq, x = MLP(), torch.randn(B, H)

    def rank(r: int) -> capture.Step:
        model = MLP()
        model.load_state_dict(seq.state_dict())
        mine = x.clone().requires_grad_(True)
        mine.register_hook(double)
        return capture.Step(model, step, {"x": mine})

    with pytest.raises(CaptureError, match=r"rank 0: input 'x' has a gradient hook \(register_hook: double "
                                           r"\(test_sound_capture_hooks.py:\d+\)\)"):
        capture(capture.Spec(capture.Step(seq, step, {"x": x}), rank, world_size=2))


# ---------------------------------------------------------------------------------------
# communication into a tensor the step does not take as an input


class Scaled(MLP):
    def __init__(self, as_buffer: bool) -> None:
        super().__init__()
        if as_buffer:
            self.register_buffer("scale", torch.ones(H))
        else:
            self.scale = torch.ones(H)  # a plain attribute: a constant to the trace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def scaled_spec(as_buffer: bool) -> capture.Spec:
    """The ranks all-reduce `scale` (ones) before the forward: it is 2 on every rank."""
    torch.manual_seed(0)
    seq, x = Scaled(as_buffer), torch.randn(B, H)

    def reduce_then_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(model.scale)
        return step(model, x)

    def rank(r: int) -> capture.Step:
        model = Scaled(as_buffer)
        model.load_state_dict(seq.state_dict())
        return capture.Step(model, reduce_then_step, {"x": x})

    return capture.Spec(capture.Step(seq, step, {"x": x}), rank, world_size=2)


def test_a_collective_into_a_plain_attribute_is_refused() -> None:
    """make_fx fetches a tensor from outside the step anew at each read, so the all-reduce's
    result never reached the forward: the pair used to refine."""
    with pytest.raises(CaptureError, match=r"rank 0: c10d.allreduce_.default .* writes in place to a tensor that is "
                                           r"not a parameter, buffer or input of the step"):
        capture(scaled_spec(as_buffer=False))
    assert "loss" in verdict(scaled_spec(as_buffer=True))  # as a buffer: followed, and twice the output
