"""torch's FSDP2 (`fully_shard`) as users write it: `fully_shard` per layer and on the root in
the rank factory, the step calling `loss.backward()` and nothing else,
`set_requires_gradient_sync` for gradient accumulation. Capture writes FSDP's all-gathers and
reduce-scatters into the trace (refine.frontends.capture.fsdp), reading its settings: the
correct programs refine at dp 2 and dp 4 with padded shards (odd sizes), under HSDP and
composed with tensor parallelism; a gradient FSDP would leave wrong (a wrong divide factor,
gradient sync left off on the last micro-batch) does not refine; settings capture does not
model are refused by name."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from refine import capture
from refine.frontends.capture import CaptureError
from tests.helpers.capture import wrong_numerically

B, H, FFN = 8, 5, 7  # odd sizes: FSDP pads the last ranks' shards


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, FFN), nn.Linear(FFN, H)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, H))  # the root's own FSDP group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale


def train_step(micro: int, bug: str | None = None) -> Callable[..., torch.Tensor]:
    """Gradient accumulation over `micro` micro-batches, the FSDP2 way: gradient sync off but on
    the last micro-batch."""
    def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(())
        for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            if micro > 1 and hasattr(model, "set_requires_gradient_sync"):
                last = i == micro - 1
                model.set_requires_gradient_sync(not last if bug == "sync_off_on_last" else last)
            loss = F.mse_loss(model(xs), ys) / micro
            loss.backward()
            total = total + loss.detach()
        return total
    return step


def shard_model(model: nn.Module, mesh: object, **kwargs: object) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in (model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


def make_case(world: int = 2, micro: int = 1, bug: str | None = None, hsdp: bool = False,
              configure: Callable[[nn.Module], None] | None = None, **kwargs: object) -> capture.Spec:
    torch.manual_seed(0)
    seq = MLP()
    x, y = torch.randn(B, H), torch.randn(B, H)
    b = B // world

    def rank(r: int) -> capture.Step:
        from torch.distributed.device_mesh import init_device_mesh

        if hsdp:
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
        else:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        model = MLP()
        model.load_state_dict(seq.state_dict())
        model = shard_model(model, mesh, **kwargs)
        if bug == "divide_factor_world_squared":
            model.set_gradient_divide_factor(float(world * world))  # BUG: divide_factor_world_squared
        if configure is not None:
            configure(model)
        part = slice(r * b, (r + 1) * b)
        inputs = {"x": x[part], "y": y[part]}
        for t in inputs.values():  # the batch split over every rank (both axes under HSDP)
            for axis in ("rep", "shard") if hsdp else ("dp",):
                capture.shard(t, 0, axis)
        return capture.Step(model, train_step(micro, bug), inputs)

    mesh = {"rep": 2, "shard": world // 2} if hsdp else {"dp": world}
    return capture.Spec(sequential=capture.Step(seq, train_step(micro), {"x": x, "y": y}), rank=rank,
                        world_size=world, mesh=mesh, name=f"fsdp2_{world}_{micro}_{bug}")


@pytest.mark.parametrize("world, micro", [(2, 1), (4, 1), (2, 2)])
def test_fsdp2_refines(world: int, micro: int) -> None:
    case = capture(make_case(world, micro))
    assert wrong_numerically(case) == set()
    ops = [n.op for g in case.dist.ranks.values() for n in g.nodes]
    assert "all_gather" in ops and "reduce_scatter" in ops
    report = case.check()
    assert report.verdict == "REFINES", report


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_hsdp_refines(world: int) -> None:
    """HSDP: a 2-D (replicate, shard) mesh; the gradient is reduce-scattered over the shard
    axis and all-reduced over the replicate axis."""
    case = capture(make_case(world, hsdp=True))
    assert wrong_numerically(case) == set()
    ops = [n.op for g in case.dist.ranks.values() for n in g.nodes]
    assert "all_reduce" in ops and ("all_gather" in ops) == (world > 2)  # a 1-rank shard axis gathers nothing
    report = case.check()
    assert report.verdict == "REFINES", report


def test_reduce_dtype_refines() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    case = capture(make_case(2, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float64)))
    assert wrong_numerically(case) == set()
    assert case.check().verdict == "REFINES"


@pytest.mark.parametrize("bug, micro", [("divide_factor_world_squared", 1), ("sync_off_on_last", 2)])
def test_fsdp2_bugs_do_not_refine(bug: str, micro: int) -> None:
    case = capture(make_case(2, micro, bug))
    assert {o for o in wrong_numerically(case) if o.endswith(".grad")}
    report = case.check()
    assert report.verdict == "DOES NOT REFINE", report


def test_a_divide_factor_of_the_world_size_refines() -> None:
    """set_gradient_divide_factor(world): the average, as FSDP's default (reduce-scatter AVG)."""
    case = capture(make_case(2, configure=lambda m: m.set_gradient_divide_factor(2.0)))
    assert case.check().verdict == "REFINES"


def test_gradient_sync_never_on_leaves_no_gradient() -> None:
    """FSDP leaves the shards without a gradient when no backward syncs: capture says so."""
    with pytest.raises(CaptureError, match="has none"):
        capture(make_case(2, 1, configure=lambda m: m.set_requires_gradient_sync(False)))


@pytest.mark.parametrize("kwargs, configure, name", [
    ("mixed", None, "param_dtype"),
    ("offload", None, "CPU offload"),
    ("dim1", None, "dim 1"),
    (None, lambda m: m.set_requires_all_reduce(False), "set_requires_all_reduce"),
    (None, lambda m: m.set_all_reduce_hook(lambda t: None), "all-reduce hook"),
])
def test_unmodelled_settings_are_refused_by_name(kwargs: str | None, configure: Callable[[nn.Module], None] | None,
                                                 name: str) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    from torch.distributed.tensor import Shard

    extra: dict[str, object] = {
        "mixed": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)},
        "offload": {"offload_policy": CPUOffloadPolicy(pin_memory=False)},
        "dim1": {"shard_placement_fn": lambda p: Shard(1) if p.ndim == 2 else None},
        None: {},
    }[kwargs]
    hsdp = name == "set_requires_all_reduce"
    with pytest.raises(CaptureError, match=name):
        capture(make_case(4 if hsdp else 2, hsdp=hsdp, configure=configure, **extra))


def make_tp_case(dp: int = 2, tp: int = 2, bug: str | None = None) -> capture.Spec:
    """fully_shard over the dp axis of a (dp, tp) mesh, composed with tensor parallelism on the
    tp axis (fc1 colwise, fc2 rowwise: FSDP shards their TP-local DTensors), torchtitan's way."""
    torch.manual_seed(0)
    seq = TPMLP()
    x, y = torch.randn(B, H), torch.randn(B, H)
    b = B // dp

    def rank(r: int) -> capture.Step:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        world = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        model = TPMLP()
        model.load_state_dict(seq.state_dict())
        parallelize_module(model, world["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        for layer in (model.fc1, model.fc2):
            fully_shard(layer, mesh=world["dp"])
        fully_shard(model, mesh=world["dp"])
        if bug == "divide_factor_world_squared":
            model.set_gradient_divide_factor(float(dp * dp))  # BUG: divide_factor_world_squared
        part = slice((r // tp) * b, (r // tp + 1) * b)
        inputs = {"x": capture.shard(x[part], 0, "dp"), "y": capture.shard(y[part], 0, "dp")}
        return capture.Step(model, train_step(1), inputs)

    return capture.Spec(sequential=capture.Step(seq, train_step(1), {"x": x, "y": y}), rank=rank,
                        world_size=dp * tp, mesh={"dp": dp, "tp": tp}, name=f"fsdp2_tp_{dp}x{tp}_{bug}")


class TPMLP(MLP):
    def __init__(self) -> None:  # an FFN size the tp ranks split evenly, padded by FSDP over dp
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, 6), nn.Linear(6, H)


@pytest.mark.parametrize("bug", [pytest.param(None, marks=pytest.mark.slow), "divide_factor_world_squared"])
def test_fsdp2_with_tensor_parallel(bug: str | None) -> None:
    case = capture(make_tp_case(bug=bug))
    assert (wrong_numerically(case) == set()) == (bug is None)
    report = case.check()
    assert report.verdict == ("REFINES" if bug is None else "DOES NOT REFINE"), report


def test_a_parameter_used_outside_its_module_forward_is_refused() -> None:
    """Outside its forward FSDP holds a layer's parameter as a sharded DTensor: a step that
    computes with it there is not modelled, so it is refused, never traced as something else."""
    def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y) + 1e-3 * (model.fc1.weight ** 2).sum()
        loss.backward()
        return loss

    spec = make_case(2)
    rank = spec.rank
    spec.rank = lambda r: (lambda s: capture.Step(s.model, step, s.inputs))(rank(r))
    with pytest.raises(CaptureError, match="used outside the forward"):
        capture(spec)


def test_an_update_within_the_step_is_refused() -> None:
    def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = train_step(1)(model, x, y)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(0.1 * p.grad)
        return loss

    spec = make_case(2)
    rank = spec.rank
    spec.rank = lambda r: (lambda s: capture.Step(s.model, step, s.inputs))(rank(r))
    with pytest.raises(CaptureError, match="updated in place within the step"):
        capture(spec)
