"""ZeRO-style data parallelism over a flat, padded, sharded parameter, as hand-written ZeRO-3
(and FSDP's flat parameter) code does it.

The sequential model is a 2-layer MLP (fc1 -> gelu -> fc2, MSE loss over the whole batch).
Each rank holds its shard of one flat buffer: every parameter flattened and concatenated,
padded at the end to a multiple of the world size, cut into equal shards (annotated with
`capture.flat`, which states the layout). Forward all-gathers the buffer
(`all_gather_into_tensor`) and unflattens it into the parameters (`split`, `view`);
backward reduce-scatters the flat gradient (`reduce_scatter_tensor`, AVG) so each rank
ends with its shard of the batch-averaged gradient, the shard its optimizer updates; the
sequential gradients are checked against the gradient shards in the layout `capture.flat`
states. In "dp2_sgd" each rank's SGD step updates its shard, the sequential step updates
every parameter, and the updated parameters are checked too. The sizes make the padding
non-trivial (97 elements: 1, 2 and 3 padding elements on 2, 3 and 4 ranks).

Not here: the SGD update on 3 or 4 ranks, where a shard boundary falls inside a parameter
(a row of fc1.weight): the checker does not yet relate the updated parameter, a sum of the
parameter and its scaled gradient viewed out of two shards, to the concat of the two
updated shards (UNPROVEN, a false alarm; the gradients alone refine there).

Bugs (each a kind public trackers record):
- "sum_not_avg": the flat gradient is reduce-scattered with SUM: world times too large
  (the averaging is missing);
- "unreduced_grad": the backward keeps this rank's slice of its own, unreduced flat
  gradient (the reduce-scatter is dropped: the optimizer steps on the local gradient);
- "pad_at_front": the unflatten skips the padding at the front of the gathered buffer
  instead of at its end (the offsets are off by the padding).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed import ReduceOp

from models.zoo import Bug, Program
from refine import capture

REQUIRES = ()
AVG, SUM = ReduceOp.AVG, ReduceOp.SUM
LR = 0.1
B, H, FFN = 12, 6, 7  # batch, hidden size, MLP size: 97 parameters, padded on 2, 3 and 4 ranks

CONFIGS = {"dp2": (2, False), "dp3": (3, False), "dp4": (4, False), "dp2_sgd": (2, True)}  # (ranks, SGD step)
PROGRAM = Program(
    configs={"dp2": "2 ranks, 1 padding element", "dp3": "3 ranks, 2 padding elements",
             "dp4": "4 ranks, 3 padding elements",
             "dp2_sgd": "2 ranks, each updating its shard with SGD; the updated parameters checked too"},
    smoke="dp2",
    bugs={
        "sum_not_avg": Bug("dp2", "the flat gradient is reduce-scattered with SUM, not AVG: the averaging over the "
                           "data-parallel ranks is missing", smoke=True),
        "unreduced_grad": Bug("dp3", "the backward keeps this rank's slice of its local flat gradient: the "
                              "reduce-scatter is missing and each rank steps on an unreduced gradient"),
        "pad_at_front": Bug("dp4", "the unflatten drops the padding from the front of the gathered buffer instead "
                            "of its end: every parameter is read at an offset off by the padding", smoke=True),
    },
)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(H, FFN)
        self.fc2 = nn.Linear(FFN, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class GatherFlat(torch.autograd.Function):
    """All-gather the flat buffer's shards forward; reduce-scatter its gradient backward."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, bug: str | None) -> torch.Tensor:  # noqa: ANN001
        ctx.bug = bug
        full = shard.new_empty(shard.numel() * dist.get_world_size())
        dist.all_gather_into_tensor(full, shard)
        return full

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        world, rank = dist.get_world_size(), dist.get_rank()
        if ctx.bug == "unreduced_grad":
            return grad.chunk(world)[rank].clone(), None  # BUG: unreduced_grad
        shard = grad.new_empty(grad.numel() // world)
        dist.reduce_scatter_tensor(shard, grad.contiguous(), op=SUM if ctx.bug == "sum_not_avg" else AVG)  # BUG: sum_not_avg
        return shard, None


class FlatMLP(nn.Module):
    """The MLP with every parameter in one flat buffer, of which this rank holds a shard."""

    def __init__(self, seq: MLP, rank: int, world: int, bug: str | None) -> None:
        super().__init__()
        params = list(seq.named_parameters())
        self.shapes = [p.shape for _, p in params]
        self.sizes = [p.numel() for _, p in params]
        numel = sum(self.sizes)
        size = -(-numel // world)  # the shard size: the buffer padded to a multiple of the world size
        self.pad = size * world - numel
        flat = F.pad(torch.cat([p.detach().reshape(-1) for _, p in params]), (0, self.pad))
        self.flat = capture.flat(nn.Parameter(flat[rank * size:(rank + 1) * size].clone()),
                                 [(n, p.shape) for n, p in params])
        self.bug = bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = GatherFlat.apply(self.flat, self.bug)
        if self.bug == "pad_at_front":
            pieces = full.split([self.pad, *self.sizes])[1:]  # BUG: pad_at_front
        else:
            pieces = full.split([*self.sizes, self.pad])[:-1]
        w1, b1, w2, b2 = (p.view(s) for p, s in zip(pieces, self.shapes, strict=True))
        return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor, sgd: bool = False) -> torch.Tensor:
    """The whole batch (then, with `sgd`, an SGD step on every parameter)."""
    loss = F.mse_loss(model(x), target)
    loss.backward()
    if sgd:
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(LR * p.grad)
    return loss


def zero_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor, sgd: bool = False) -> torch.Tensor:
    """The gradient is reduce-scattered inside backward (then, with `sgd`, each rank's SGD
    step updates its shard with its shard of the gradient); the loss is averaged for logging."""
    loss = F.mse_loss(model(x), target)
    loss.backward()
    if sgd:
        with torch.no_grad():
            model.flat.sub_(LR * model.flat.grad)
    return funcol.all_reduce(loss.detach(), "avg", dist.group.WORLD)


def make_case(config: str, bug: str | None = None) -> capture.Spec:
    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r} (configurations: {', '.join(CONFIGS)})")
    if bug is not None and bug not in PROGRAM.bugs:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(PROGRAM.bugs)})")
    world, sgd = CONFIGS[config]
    torch.manual_seed(0)
    seq = MLP()
    x, target = torch.randn(B, H), torch.randn(B, H)
    b = B // world

    def rank(r: int) -> capture.Step:
        part = slice(r * b, (r + 1) * b)
        return capture.Step(FlatMLP(seq, r, world, bug), lambda m, **inputs: zero_step(m, **inputs, sgd=sgd),
                            {"x": capture.shard(x[part], 0), "target": capture.shard(target[part], 0)})

    return capture.Spec(sequential=capture.Step(seq, lambda m, **inputs: train_step(m, **inputs, sgd=sgd),
                                                {"x": x, "target": target}), rank=rank,
                        world_size=world, mesh={"dp": world}, name=f"zero_flat_{config}{'_bug_' + bug if bug else ''}")
