"""Pipeline parallelism with torch.distributed.pipelining, as its users write it, with a tied
embedding and gradient-norm clipping as Megatron-LM does them.

The model: a token embedding, 2 pre-norm residual MLP blocks, a final LayerNorm and an output
head whose weight is the embedding's (tied), cross-entropy loss. The sequential step runs the
whole batch, then `clip_grad_norm_(model.parameters(), MAX_NORM)`.

The pipeline (2 stages): each rank copies the model and deletes what its stage does not hold
(torch's pipelining tutorial's manual split): stage 0 keeps the embedding and block 0, stage
1 block 1, the final norm and the head, which keeps its own copy of the embedding weight (as
Megatron does for tied embeddings on different stages). A `PipelineStage` per rank (the
micro-batch's input and output given: static shapes) and a schedule (`ScheduleGPipe` or
`Schedule1F1B`, micro-batches, a `loss_fn` rescaled to the whole batch and `scale_grads=False`,
as torchtitan builds it) run the step. Then,
as Megatron's finalize_model_grads and get_grad_norm_fp32 do: the two copies of the embedding
gradient are all-reduced over the group of the first and last stage; each stage sums the
squares of its gradients' norms, leaving out the last stage's copy of the tied weight (it is
the same parameter: counted once), all-reduces the sum over the pipeline, and clips with
`clip_grads_with_norm_`.

Bugs (each a kind public trackers record):
- "tied_norm_counted_twice": Megatron-LM #7227: the tied embedding's gradient is counted in
  the grad norm on both the first and the last stage, so the norm is too large and every
  gradient is clipped too much;
- "tied_grad_not_reduced": the embedding-gradient all-reduce between the first and last
  stage is missing, so each copy only has its own part (lookup or head);
- "zero_grad_after_step": the first stage zeroes its gradients after the schedule's step
  instead of before it (its gradients are lost, and the norm is the last stage's alone);
- "loss_not_rescaled": the loss function divides each micro-batch's summed loss by its own
  token count rather than the batch's, while the schedule does not scale the gradients
  (`scale_grads=False`, as torchtitan builds it): gradients `micro` times too large.

`make_case(config, tp=2)` adds tensor parallelism inside each stage (a 2-D mesh {"pp": 2, "tp": 2}, ranks
row-major), as torchtitan composes them: a DeviceMesh whose "tp" sub-mesh each stage's block is
`parallelize_module`d over (`up` ColwiseParallel, `down` RowwiseParallel) and whose "pp" groups
carry the `PipelineStage`s; the norms, the tied embedding and the data are replicated within a
stage's tensor-parallel group. So every parameter is held by one or two stages' groups only,
sharded or replicated within each (refine.frontends.capture.annotate.submesh_layouts). The tied
weight's copies are all-reduced over each tensor-parallel rank's first-and-last-stage group,
and the grad norm counts each sharded gradient's local squares on every rank and each
replicated one on tensor-parallel rank 0 only (Megatron's `param_is_not_tensor_parallel_duplicate`),
summed over every rank (Megatron's model-parallel group).

Not covered here (reported, not dodged): the schedule's default `scale_grads=True` with a
per-micro-batch mean cross-entropy is UNPROVEN: the ranks' cross-entropy backward holds
`where(valid, 1/tokens_per_micro_batch, 0)`, the sequential one `where(valid, 1/tokens, 0)`,
and no rule relates a `full` constant to a Scale of another (rules/mask.py's scale-full-one
takes only full(1.0)). Labels are passed flattened: micro-batched cross-entropy over (batch,
tokens) labels flattened inside the loss is UNPROVEN too (the backward's scatter over the
concatenated index is not split; models/capture's DP twin with 2-D labels refines). The
tensor-parallel stages (`tp=2`) capture, every relation derived and the values right, but are
UNPROVEN at the final LayerNorm: RowwiseParallel adds bias / tp to each rank's partial sum
before the all-reduce, and over 2 micro-batches the last stage's residual stream (received
activations plus the all-reduced halves, per micro-batch) is not joined to the sequential
residual's clean relation (the same blocks with the bias added after the all-reduce refine:
models/capture/pp_tp.py), so they stay out of PROGRAM (a strict xfail in
tests/cases/test_zoo_pipeline.py).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from models.zoo import Bug, Program
from refine import capture

REQUIRES = ()
B, T, V, H = 4, 4, 16, 8  # batch, tokens, vocabulary, hidden size
# below the gradients' global norm (about 2.3 at these shapes and seed): clipping really scales them
MAX_NORM = 0.5
STAGES = 2

# every bug makes the clip's global norm wrong before anything else: the localization stops at
# the sequential clip_grad_norm_ (its total norm, a value fused over every rank's gradients that
# no rank holds); a term one stage sums into its piece of the norm that it should not
# (tied_norm_counted_twice) is then found by dropping terms (refine.verdict.terms), and the tied
# gradient's two pieces never summed (tied_grad_not_reduced) by setting each to their sum
# (refine.verdict.missing_reduce.held_apart); zero_grad_after_step names none
_NORM_FIRST = "the report stops at the sequential clip_grad_norm_'s total norm, which no rank holds: "

CONFIGS = {"pp2_gpipe": (ScheduleGPipe, 2), "pp2_1f1b": (Schedule1F1B, 2), "pp2_m4": (Schedule1F1B, 4)}
PROGRAM = Program(
    configs={"pp2_gpipe": "2 stages, GPipe, 2 micro-batches",
             "pp2_1f1b": "2 stages, 1F1B, 2 micro-batches",
             "pp2_m4": "2 stages, 1F1B, 4 micro-batches"},
    smoke="pp2_gpipe",
    bugs={
        "tied_norm_counted_twice": Bug("pp2_1f1b", "the tied embedding's gradient counted in the grad norm on both "
                                       "the first and the last pipeline stage (Megatron-LM #7227)"),
        "tied_grad_not_reduced": Bug("pp2_gpipe", "the tied embedding's gradient not all-reduced between the first "
                                     "and last stage (Megatron's _allreduce_word_embedding_grads left out)"),
        "zero_grad_after_step": Bug("pp2_1f1b", "the first stage's zero_grad() placed after the schedule's step "
                                    "instead of before it: its gradients are dropped (the misplaced zero_grad "
                                    "forum threads and trackers record)",
                                    known_miss=_NORM_FIRST + "the first stage's squared norms are of zeroed gradients, "
                                    "which the trace folds into constants made on the norm's line (grad_norm's "
                                    "get_total_norm), with no link to the zero_grad line; no single term dropped "
                                    "repairs the norm (refine.verdict.terms), and no repair of one line's values "
                                    "reaches both the gradients and the folded norms"),
        "loss_not_rescaled": Bug("pp2_1f1b", "each micro-batch's loss divided by its own token count, not the "
                                 "batch's, with the schedule's gradient scaling off: gradients `micro` times too large "
                                 "(the loss-scaling kind of gradient-accumulation bug trackers record); the clipped "
                                 "gradients are wrong only through the norm's epsilon, the loss is `micro` times too large"),
    },
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class LM(nn.Module):
    """The whole model; a stage is a copy that looks tokens up only if it is the first
    (`pre_process`, Megatron's name) and computes the logits only if it is the last
    (`post_process`), with the parts it does not hold deleted."""

    def __init__(self) -> None:
        super().__init__()
        self.pre_process = self.post_process = True
        self.embed = nn.Embedding(V, H)
        self.blocks = nn.ModuleDict({str(i): Block() for i in range(STAGES)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.pre_process else x  # BUG: tied_grad_not_reduced
        for block in self.blocks.values():
            h = block(h)
        if not self.post_process:
            return h
        return self.norm(h) @ self.embed.weight.t()  # BUG: tied_grad_not_reduced


def loss_fn(logits: torch.Tensor, labels: torch.Tensor, tokens: int, bug: str | None = None) -> torch.Tensor:
    """Cross-entropy summed over the micro-batch's tokens, divided by the whole batch's `tokens`
    (torchtitan's rescaled loss for accumulation: the micro-batch losses add up to the batch
    mean, so the schedule must not scale the gradients again). `labels` come flattened (batch x
    tokens), the rows of `logits.reshape(-1, V)`."""
    total = F.cross_entropy(logits.reshape(-1, V), labels, reduction="sum")
    if bug == "loss_not_rescaled":
        return total / labels.numel()  # BUG: loss_not_rescaled
    return total / tokens


def train_step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    loss = loss_fn(model(ids), labels, labels.numel())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    return loss


def stage_model(seq: LM, stage: int, tp_mesh: object | None = None) -> LM:
    """A stage's copy of the model without the parts the stage does not hold; under tensor
    parallelism its block parallelized over `tp_mesh`, the rest replicated over it."""
    m = LM()
    m.load_state_dict(seq.state_dict())
    for k in list(m.blocks):
        if k != str(stage):
            del m.blocks[k]
    m.pre_process, m.post_process = stage == 0, stage == STAGES - 1
    if not m.post_process:
        m.norm = None
    if tp_mesh is not None:
        parallelize_module(m.blocks[str(stage)], tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        for p in m.parameters():
            if not isinstance(p, DTensor):
                capture.replicate(p, "tp")
    return m


def _duplicate(p: torch.Tensor) -> bool:
    """A tensor-parallel duplicate: a gradient every rank of the group holds whole."""
    return not isinstance(p, DTensor) or all(isinstance(x, Replicate) for x in p.placements)


def grad_norm(stage: LM, last: bool, tp_rank: int, bug: str | None) -> torch.Tensor:
    """The global 2-norm of the pipeline's gradients (Megatron's get_grad_norm_fp32): the last
    stage's copy of the tied embedding is the first stage's parameter, counted there; a
    sharded gradient's local squares are counted on every tensor-parallel rank, a replicated
    one on tensor-parallel rank 0 only."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for n, p in stage.named_parameters()
             if p.grad is not None and (bug == "tied_norm_counted_twice" or not (last and n == "embed.weight"))
             and (tp_rank == 0 or not _duplicate(p))]
    total = torch.nn.utils.get_total_norm(grads) ** 2  # BUG: tied_norm_counted_twice
    dist.all_reduce(total)
    return total ** 0.5


def pipeline_step(schedule: object, first: bool, last: bool, tp_rank: int, embedding_group: object,
                  bug: str | None) -> object:
    def step(stage: LM, ids: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        if first:
            schedule.step(ids)  # type: ignore[attr-defined]
        else:
            schedule.step(target=labels, losses=losses)  # type: ignore[attr-defined]
        if bug == "zero_grad_after_step" and first:
            stage.zero_grad(set_to_none=False)  # BUG: zero_grad_after_step
        # finalize_model_grads: the tied embedding's two copies take the sum of their gradients
        if bug != "tied_grad_not_reduced":
            dist.all_reduce(stage.embed.weight.grad, group=embedding_group)  # type: ignore[arg-type]
        norm = grad_norm(stage, last, tp_rank, bug)
        dtensors = [p for p in stage.parameters() if isinstance(p, DTensor)]
        torch.nn.utils.clip_grads_with_norm_([p for p in stage.parameters() if not isinstance(p, DTensor)],
                                             MAX_NORM, norm)
        if dtensors:
            torch.nn.utils.clip_grads_with_norm_(dtensors, MAX_NORM, norm)
        return torch.stack(losses).sum() if last else None
    return step


def make_case(config: str, bug: str | None = None, *, tp: int = 1) -> capture.Spec:
    """`tp=2`: each stage tensor parallel over 2 ranks (left out of PROGRAM: UNPROVEN with
    micro-batches, see the module docstring)."""
    PROGRAM.validate(config, bug)
    schedule, micro = CONFIGS[config]
    torch.manual_seed(0)
    seq = LM()
    # the labels flattened by the data pipeline: refine does not prove micro-batched
    # cross-entropy over (batch, tokens) labels flattened in the loss (see the module docstring)
    ids, labels = torch.randint(0, V, (B, T)), torch.randint(0, V, (B * T,))
    mb = B // micro

    def rank(r: int) -> capture.Step:
        s, t = divmod(r, tp)
        first, last = s == 0, s == STAGES - 1
        if tp > 1:
            mesh = init_device_mesh("cpu", (STAGES, tp), mesh_dim_names=("pp", "tp"))
            pp_group, tp_mesh = mesh["pp"].get_group(), mesh["tp"]
        else:
            pp_group, tp_mesh = None, None
        # the first and last stage's ranks of each tensor-parallel rank: every rank makes them all
        embedding_group = [dist.new_group([k, (STAGES - 1) * tp + k]) for k in range(tp)][t]
        m = stage_model(seq, s, tp_mesh)
        stage = PipelineStage(m, s, STAGES, torch.device("cpu"), group=pp_group,
                              input_args=ids[:mb] if first else torch.empty(mb, T, H, requires_grad=True),
                              output_args=torch.empty(mb, T, V if last else H, requires_grad=True))
        sched = schedule(stage, n_microbatches=micro, loss_fn=functools.partial(loss_fn, tokens=B * T, bug=bug),
                         scale_grads=False)
        data = {"ids": ids.clone()} if first else {"labels": labels.clone()}
        if tp > 1:
            data = {k: capture.replicate(v, "tp") for k, v in data.items()}
        return capture.Step(m, pipeline_step(sched, first, last, t, embedding_group, bug), data)

    mesh = {"pp": STAGES, "tp": tp} if tp > 1 else {"pp": STAGES}
    return capture.Spec(sequential=capture.Step(seq, train_step, {"ids": ids, "labels": labels}), rank=rank,
                        world_size=STAGES * tp, mesh=mesh,
                        name=f"pipeline_{config}{f'_tp{tp}' if tp > 1 else ''}{'_bug_' + bug if bug else ''}")
