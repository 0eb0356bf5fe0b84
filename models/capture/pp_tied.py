"""Pipeline parallel language model with tied embeddings: a whole training step captured.

    refine capture models/capture/pp_tied.py:make_case --out case/

The sequential model: a token embedding, `stages` residual MLP blocks, and an output head
whose weight is the embedding's (tied), cross-entropy loss. The pipeline puts block i on
rank i; the first stage also holds the embedding, the last one the head, and so (as
Megatron does) a copy of the tied embedding weight. Activations go forward with
`dist.send`/`dist.recv`, their gradients come back the same way; the last stage computes
the loss, the others return None. Then, as Megatron's finalize_model_grads does for shared
weights, the two copies of the embedding gradient are all-reduced over the group of the
first and last stage, so both copies take the same update.

The ranks hold their parameters whole (same names as the sequential model's), so capture
relates each to the ranks that hold it (a layout over those ranks) and expects its gradient
on each of them. `make_case(bug=...)` builds the buggy twins:

- "tied_grad_not_reduced": the embedding-gradient all-reduce is missing: each stage's copy
  only has its own part of the gradient (lookup or head), and the copies drift apart;
- "grad_not_sent_back": the last stage sends back its output's gradient instead of its
  input's, so the earlier stages train on the wrong signal.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from refine import capture

B, T, V, H = 2, 4, 16, 8  # batch, tokens, vocabulary, hidden size
BUGS: dict[str, dict[str, object]] = {  # bug -> the make_case arguments of its twin
    "tied_grad_not_reduced": {}, "grad_not_sent_back": {},
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(H, H)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.gelu(self.fc(h))


class LM(nn.Module):
    def __init__(self, stages: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(Block() for _ in range(stages))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return h @ self.embed.weight.t()  # the tied output head


def train_step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(ids).reshape(-1, V), labels.reshape(-1))
    loss.backward()
    return loss


class Stage(nn.Module):
    """Block `index` of the LM, with the embedding on the first and the last stage. The
    blocks sit in a ModuleDict keyed by their index, so parameters keep the sequential names."""

    def __init__(self, index: int, stages: int) -> None:
        super().__init__()
        self.first, self.last = index == 0, index == stages - 1
        if self.first or self.last:
            self.embed = nn.Embedding(V, H)
        self.blocks = nn.ModuleDict({str(index): Block()})

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.first:
            h = self.embed(h)  # BUG: tied_grad_not_reduced
        (block,) = self.blocks.values()
        h = block(h)
        return h @ self.embed.weight.t() if self.last else h  # BUG: tied_grad_not_reduced


def pipeline_step(stage: Stage, ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                  bug: str | None = None) -> torch.Tensor | None:
    """One step of one stage (a single micro-batch: forward all the way, then backward)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if stage.first:
        x = ids
    else:
        x = torch.empty(B, T, H)
        dist.recv(x, src=rank - 1)
        x.requires_grad_()
    out = stage(x)
    loss = None
    if stage.last:
        loss = F.cross_entropy(out.reshape(-1, V), labels.reshape(-1))
        loss.backward()
    else:
        dist.send(out.detach(), dst=rank + 1)
        grad = torch.empty_like(out)
        dist.recv(grad, src=rank + 1)
        out.backward(grad)
    if not stage.first:
        if bug == "grad_not_sent_back" and stage.last:
            dist.send(torch.ones_like(x.grad), dst=rank - 1)  # BUG: grad_not_sent_back
        else:
            dist.send(x.grad, dst=rank - 1)
    embedding_group = dist.new_group([0, world - 1])  # every rank takes part in creating it
    if (stage.first or stage.last) and bug != "tied_grad_not_reduced":
        dist.all_reduce(stage.embed.weight.grad, group=embedding_group)
    return loss.detach() if loss is not None else None


def make_case(world_size: int = 2, bug: str | None = None) -> capture.Spec:
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(BUGS)})")
    torch.manual_seed(0)
    seq = LM(world_size)
    ids, labels = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))

    def rank(r: int) -> capture.Step:
        stage = Stage(r, world_size)
        stage.load_state_dict({k: v for k, v in seq.state_dict().items() if k in stage.state_dict()})
        inputs = {"ids": ids} if r == 0 else {}
        if r == world_size - 1:
            inputs["labels"] = labels
        return capture.Step(stage, lambda m, **kw: pipeline_step(m, **kw, bug=bug), inputs)

    return capture.Spec(sequential=capture.Step(seq, train_step, {"ids": ids, "labels": labels}), rank=rank,
                        world_size=world_size, mesh={"pp": world_size},
                        name=f"pp_tied_{world_size}stages{'_bug_' + bug if bug else ''}")
