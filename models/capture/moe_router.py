"""Expert parallelism with a replicated router: a whole training step captured from PyTorch code.

    refine capture models/capture/moe_router.py:make_case --out case/
    refine check case/seq.json case/dist.json

The sequential model is LayerNorm -> a mixture of `experts` small MLPs with an MSE loss. The
gate is dense (softmax over all experts, no top-k: models/capture/moe_ep.py routes top-k with
static-capacity dispatch), and the output is the softmax-weighted sum of every expert's
output. The experts' weights are stacked along a leading expert dim.

Each rank keeps the LayerNorm and the gate replicated and holds experts
[r*E/W, (r+1)*E/W): the stacked expert parameters are Shard(0) over the "ep" axis. A rank
weights its experts' outputs by its slice of the gate's probabilities and the partial sums
are all-reduced (Megatron's "g", whose backward is the identity). The gradient flowing back
into the LayerNorm is then only this rank's experts' share, so "f" (identity forward,
all-reduce of the input gradient backward) sits in front of the layer. The gate's weight
gradient also only sees this rank's experts, so after `loss.backward()` it is all-reduced
(summed), as Megatron does for replicated router weights under expert parallelism.
`make_case(bug=...)` builds the buggy twin:

- "router_grad_not_summed": the router's gradient is never summed over ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from refine import capture

T, H, FFN = 8, 16, 8  # tokens, hidden size, each expert's MLP size
BUGS: dict[str, dict[str, object]] = {  # bug -> the make_case arguments of its twin
    "router_grad_not_summed": {},
}


class Experts(nn.Module):
    """`n` small MLPs (fc1 -> gelu -> fc2), their weights stacked along dim 0."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n, FFN, H) / H ** 0.5)
        self.b1 = nn.Parameter(torch.randn(n, FFN) * 0.1)
        self.w2 = nn.Parameter(torch.randn(n, H, FFN) / FFN ** 0.5)
        self.b2 = nn.Parameter(torch.randn(n, H) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> every expert's output, [n, T, H]."""
        xs = x.expand(self.w1.shape[0], *x.shape)
        h = F.gelu(torch.bmm(xs, self.w1.transpose(1, 2)) + self.b1.unsqueeze(1))
        return torch.bmm(h, self.w2.transpose(1, 2)) + self.b2.unsqueeze(1)


def combine(probs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """probs [T, n] weights ys [n, T, H]: the weighted sum over the experts, [T, H]."""
    return (probs.t().unsqueeze(-1) * ys).sum(0)


class MoE(nn.Module):
    """The sequential model."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(H)
        self.gate = nn.Linear(H, experts, bias=False)
        self.experts = Experts(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        probs = torch.softmax(self.gate(h), dim=-1)
        return combine(probs, self.experts(h))


class CopyToEP(torch.autograd.Function):
    """Megatron's "f": the identity forward; the input gradient is all-reduced backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromEP(torch.autograd.Function):
    """Megatron's "g": all-reduce forward; the gradient passes through backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        return funcol.all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return grad, None


class EPMoE(nn.Module):
    """One rank's part of MoE: the LayerNorm and the gate replicated, its experts local."""

    def __init__(self, seq: MoE, rank: int, world: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        n = seq.gate.out_features // world
        self.lo, self.hi, self.group = rank * n, (rank + 1) * n, group
        self.ln = nn.LayerNorm(H)
        self.ln.load_state_dict(seq.ln.state_dict())
        self.gate = nn.Linear(H, seq.gate.out_features, bias=False)
        self.gate.load_state_dict(seq.gate.state_dict())
        capture.replicate(self.gate.weight)
        self.experts = Experts(n)
        for name, p in self.experts.named_parameters():
            p.data = getattr(seq.experts, name).detach()[self.lo:self.hi].clone()
            capture.shard(p, 0, "ep")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = CopyToEP.apply(self.ln(x), self.group)
        probs = torch.softmax(self.gate(h), dim=-1)  # BUG: router_grad_not_summed (over all experts: the gate is replicated)
        mine = combine(probs[:, self.lo:self.hi], self.experts(h))
        return ReduceFromEP.apply(mine, self.group)


def train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    return loss


def ep_train_step(model: EPMoE, x: torch.Tensor, target: torch.Tensor, bug: str | None) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    if bug != "router_grad_not_summed":
        # each rank's router gradient only saw its own experts: sum the shares
        dist.all_reduce(model.gate.weight.grad, group=model.group)
    return loss


def make_case(world_size: int = 2, experts: int = 4, bug: str | None = None) -> capture.Spec:
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(BUGS)})")
    if experts % world_size:
        raise ValueError(f"{experts} experts do not split over {world_size} ranks")
    torch.manual_seed(0)
    seq = MoE(experts)
    x, target = torch.randn(T, H), torch.randn(T, H)
    return capture.Spec(
        sequential=capture.Step(seq, train_step, {"x": x, "target": target}),
        rank=lambda r: capture.Step(EPMoE(seq, r, world_size, dist.group.WORLD),  # type: ignore[arg-type]
                                    lambda m, **kw: ep_train_step(m, **kw, bug=bug), {"x": x, "target": target}),
        world_size=world_size, mesh={"ep": world_size},
        name=f"moe_router{'_bug_' + bug if bug else ''}",
    )
