"""Dropless MoE under expert parallelism: all_to_all split sizes that are the routing's token
counts, so depend on the data (models/zoo/moe_gshard.py `make_dropless_case`, and a small
hand-written token dispatch here: tokens sorted by expert, the counts exchanged, an uneven
all_to_all_single there and back, the experts applied, the rows put back in token order).

What refine does with them: capture refuses each, sequential side or rank side, at the user's
line that reads the counts, naming the inputs the counts are computed from (the router's
weights, the tokens). A graph traced with the captured counts would hold for the inputs that
route as the captured ones only, so it could never prove the program: no verdict is given
rather than a REFINES for one routing. Every bug twin is refused too, never REFINES.

What the programs do: run on real gloo process groups (tests/helpers/gloo.py), the correct
dropless program matches its sequential model and each bug twin does not: the ground truth a
proof for every routing will have to meet."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models.zoo import load
from refine import capture
from refine.frontends.capture import CaptureError
from tests.helpers import gloo

ZOO = load("moe_gshard")
MOE = ZOO.module
DATA_DEPENDENT = "depends on the step's inputs"


def _zoo_line(snippet: str) -> str:
    return next(f"moe_gshard.py:{i}" for i, t in enumerate(ZOO.path.read_text().splitlines(), 1) if snippet in t)


def _refusal(spec: capture.Spec) -> CaptureError:
    with pytest.raises(CaptureError) as e:
        capture(spec)
    return e.value


# ---------------------------------------------------------------------------------------
# the zoo program


@pytest.mark.parametrize("config", ["ep2", "ep4"])
@pytest.mark.parametrize("bug", [None, *MOE.DROPLESS_BUGS])
def test_the_zoo_dropless_program_is_refused_at_its_first_count_read(config: str, bug: str | None) -> None:
    """The sequential model is dense (static shapes); the ranks' first data-dependent read is the
    send sizes: refused there, naming the routing's inputs, for the correct program and its twins."""
    e = _refusal(MOE.make_dropless_case(config, bug))
    assert DATA_DEPENDENT in str(e), e
    assert "data-dependent control flow or sizes" in str(e)
    assert e.source == _zoo_line("send = counts.reshape(w, local).sum(1).tolist()"), e.source
    assert str(e).startswith("rank 0:"), e
    # the routing's inputs: the tokens and the first layer's norm and router
    assert "(x, layers.0.norm.weight, layers.0.norm.bias, layers.0.moe.gate.weight)" in str(e), e


def _compare(expected: dict[str, torch.Tensor], ranks: dict[int, dict[str, torch.Tensor]]) -> set[str]:
    """The outputs the ranks get wrong: the loss and the replicated gradients on every rank, the
    experts' gradients Shard(0) over the ranks."""
    wrong = set()
    for name, want in expected.items():
        if ".experts." in name or name == "w.grad":
            got = [torch.cat([ranks[r][name] for r in sorted(ranks)])]
        else:
            got = [ranks[r][name] for r in sorted(ranks)]
        if not all(torch.allclose(g, want, rtol=1e-4, atol=1e-6) for g in got):
            wrong.add(name)
    return wrong


EXPERTS = {f"layers.{i}.moe.experts.{w}.grad" for i in range(2) for w in ("wi", "wo")}


def test_the_zoo_dropless_program_matches_its_sequential_model_on_gloo() -> None:
    expected, ranks = gloo.run("models.zoo.moe_gshard:make_dropless_case", "ep2")
    assert len(expected) == 1 + 2 * 5  # the loss, per layer the norm's two, the router's, two experts'
    assert _compare(expected, ranks) == set()


@pytest.mark.slow
@pytest.mark.parametrize(("config", "bug", "wrong"), [
    ("ep4", None, set()),
    ("ep2", "dropless_expert_grad_not_scaled", EXPERTS),
    ("ep4", "dropless_expert_grad_not_scaled", EXPERTS),
    ("ep2", "dropless_counts_read_expert_major", None),  # None: the loss and every gradient
])
def test_the_zoo_dropless_twins_on_gloo(config: str, bug: str | None, wrong: set[str] | None) -> None:
    expected, ranks = gloo.run("models.zoo.moe_gshard:make_dropless_case", config, bug)
    assert _compare(expected, ranks) == (set(expected) if wrong is None else wrong)


def test_the_counts_twin_is_silent_only_where_counts_differ() -> None:
    """The expert-major reading is a bug only when the counts matrix is not symmetric: at ep2 on
    the zoo's data the ranks' per-expert counts differ (else the gloo twin would pass)."""
    spec = MOE.make_case("ep2")
    seq = spec.sequential.model
    x = spec.sequential.inputs["x"]
    h = seq.layers[0].norm(x)
    counts = F.one_hot(seq.layers[0].moe.gate(h).argmax(-1), 4).reshape(2, MOE.S, 4).sum(1)  # [rank, expert]
    got = counts.reshape(2, 2, 2).transpose(0, 1)  # on rank j: [source, local expert]
    assert not torch.equal(got, got.transpose(1, 2)), counts


# ---------------------------------------------------------------------------------------
# a small hand-written token dispatch: one MoE layer, top-1, each expert a linear map

M, S = 4, 6  # model dim, tokens per rank


class _Dispatch(nn.Module):
    """`group` None: the sequential model, "dense" (every expert on every token, masked) or
    "sorted" (the tokens sorted by expert and split by the counts on one device)."""

    def __init__(self, experts: int, local: int, group: dist.ProcessGroup | None = None,
                 sequential: str = "dense", bug: str | None = None) -> None:
        super().__init__()
        self.experts, self.group, self.sequential, self.bug = experts, group, sequential, bug
        self.router = nn.Linear(M, experts, bias=False)
        self.w = nn.Parameter(torch.randn(local, M, M) / 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.router(x), dim=-1)
        choice = torch.argmax(probs, dim=-1)
        weight = probs.gather(1, choice[:, None])
        if self.group is None and self.sequential == "dense":
            return sum((x @ self.w[e]) * (choice == e)[:, None].to(x.dtype) for e in range(self.experts)) * weight
        order = torch.argsort(choice, stable=True)
        counts = F.one_hot(choice, self.experts).sum(0)
        if self.group is None:
            rows = x[order].split(counts.tolist())  # the sorted sequential read
            y = torch.cat([t @ self.w[e] for e, t in enumerate(rows)])
        else:
            w = dist.get_world_size(self.group)
            local = self.experts // w
            send = counts.reshape(w, local).sum(1)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=self.group)
            got = torch.empty_like(counts)
            dist.all_to_all_single(got, counts, group=self.group)
            ins = send.tolist()  # the dispatch read
            outs = ins if self.bug == "splits_of_the_wrong_rank" else recv.tolist()  # as if routing were symmetric
            tokens = MOE.AllToAllV.apply(self.group, x[order], outs, ins)
            sizes = got.tolist()
            chunks = tokens.split(sizes)
            out = list(chunks)
            for e in range(local):
                mine = [s * local + e for s in range(w)]
                for k, part in zip(mine, (torch.cat([chunks[k] for k in mine]) @ self.w[e]).split(
                        [sizes[k] for k in mine]), strict=True):
                    out[k] = part
            y = MOE.AllToAllV.apply(self.group, torch.cat(out), ins, outs)
        return torch.zeros_like(y).index_copy(0, order, y) * weight


def _dispatch_step(model: _Dispatch, x: torch.Tensor, target: torch.Tensor, bug: str | None = None) -> torch.Tensor:
    loss = F.mse_loss(model(x), target)
    loss.backward()
    if model.group is not None:
        w = dist.get_world_size()
        dist.all_reduce(model.router.weight.grad)
        model.router.weight.grad.div_(w)
        if bug != "expert_grad_not_scaled":
            model.w.grad.div_(w)
        dist.all_reduce(loss := loss.detach().clone())
        loss = loss / w
    return loss


def make_dispatch_case(world: int = 2, local: int = 1, sequential: str = "dense",
                       bug: str | None = None) -> capture.Spec:
    experts = world * local
    torch.manual_seed(0)
    seq = _Dispatch(experts, experts, sequential=sequential)
    x, target = torch.randn(world * S, M), torch.randn(world * S, M)

    def rank(r: int) -> capture.Step:
        m = _Dispatch(experts, local, dist.group.WORLD, bug=bug)  # type: ignore[arg-type]
        m.router.weight.data = capture.replicate(seq.router.weight.data.clone())
        m.w.data = capture.shard(seq.w.data[r * local:(r + 1) * local].clone(), 0)
        rows = slice(r * S, (r + 1) * S)
        return capture.Step(m, lambda mm, **kw: _dispatch_step(mm, **kw, bug=bug),
                            {"x": capture.shard(x[rows], 0), "target": capture.shard(target[rows], 0)})

    return capture.Spec(sequential=capture.Step(seq, _dispatch_step, {"x": x, "target": target}), rank=rank,
                        world_size=world, name=f"dispatch_w{world}_l{local}_{sequential}{'_' + bug if bug else ''}")


def _line(snippet: str) -> str:
    path = Path(__file__)
    return next(f"{path.name}:{i}" for i, t in enumerate(path.read_text().splitlines(), 1) if snippet in t)


@pytest.mark.parametrize(("world", "local"), [(2, 1), (2, 2), (4, 1)])
@pytest.mark.parametrize("bug", [None, "splits_of_the_wrong_rank", "expert_grad_not_scaled"])
def test_the_dispatch_family_is_refused_at_the_dispatch_read(world: int, local: int, bug: str | None) -> None:
    e = _refusal(make_dispatch_case(world, local, bug=bug))
    assert DATA_DEPENDENT in str(e) and "(x, router.weight)" in str(e), e
    assert e.source == _line("ins = send.tolist()  # the dispatch read"), e.source


def test_a_sorted_sequential_model_is_refused_at_its_own_read() -> None:
    """Left to make_fx, the sequential `counts.tolist()` traced as torch's unbacked size symbols
    and conversion crashed on them (a TypeError); now the sequential step's reads are resolved as
    the ranks' are: this one is data-dependent, refused at its line."""
    e = _refusal(make_dispatch_case(2, 1, sequential="sorted"))
    assert e.source == _line("rows = x[order].split(counts.tolist())  # the sorted sequential read"), e.source
    assert str(e).startswith("the sequential step:") and DATA_DEPENDENT in str(e), e


def test_the_dispatch_matches_its_sequential_models_on_gloo() -> None:
    for sequential in ("dense", "sorted"):
        expected, ranks = gloo.run("tests.cases.test_zoo_moe_dropless:make_dispatch_case", 2, 2, sequential)
        assert _compare(expected, ranks) == set(), sequential
    expected, ranks = gloo.run("tests.cases.test_zoo_moe_dropless:make_dispatch_case", 2, 2, "dense",
                               "expert_grad_not_scaled")
    assert _compare(expected, ranks) == {"w.grad"}


# ---------------------------------------------------------------------------------------
# what the refusal rests on: the runner runs collectives, so a count the ranks exchange is
# known when it is a constant of the program and refused only when it depends on the inputs


def _scaled(factor: object) -> object:
    def step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = m(x).sum() * factor()  # type: ignore[operator]
        loss.backward()
        return loss.detach()
    return step


def _exchange_spec(factor: object, world: int) -> capture.Spec:
    def rank(r: int) -> capture.Step:
        torch.manual_seed(0)
        return capture.Step(nn.Linear(4, 4), _scaled(factor), {"x": torch.ones(2, 4)})

    torch.manual_seed(0)
    return capture.Spec(sequential=capture.Step(nn.Linear(4, 4), _scaled(lambda: world), {"x": torch.ones(2, 4)}),
                        rank=rank, world_size=world)


def _constant_counts() -> int:
    """Constant counts (rank r sends r + 1 + j to rank j) exchanged by a legacy
    all_to_all_single, summed by an all_reduce (w^3 in all) and gathered by a functional
    all_gather (each rank's first received count, j + 1 from rank 0): the factor w."""
    import torch.distributed._functional_collectives as funcol

    r, w = dist.get_rank(), dist.get_world_size()
    counts = torch.arange(w) + r + 1
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts)
    total = got.sum().reshape(1)
    dist.all_reduce(total)
    firsts = funcol.all_gather_tensor(got[:1], 0, dist.group.WORLD)
    if int(firsts.sum().item()) != w * (w + 1) // 2:
        raise AssertionError("the gathered counts were misread")
    return int(total.item()) // w ** 2


@pytest.mark.parametrize("world", [2, 4])
def test_constant_counts_exchanged_by_collectives_are_read(world: int) -> None:
    case = capture(_exchange_spec(_constant_counts, world))
    assert case.stats["scalar_reads"] == {r: [world * (world + 1) // 2, world ** 3] for r in range(world)}
    report = case.check()
    assert report.refines, report


def test_a_count_exchanged_after_a_parameter_read_is_refused() -> None:
    """The same exchange of a value computed from the parameters: refused, naming them."""
    def factor() -> int:
        counts = (torch.arange(2) + (_current.weight.sum() > 0).long())
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts)
        return int(got.sum().item())  # the read

    def rank(r: int) -> capture.Step:
        global _current
        torch.manual_seed(0)
        _current = nn.Linear(4, 4)
        return capture.Step(_current, _scaled(factor), {"x": torch.ones(2, 4)})

    torch.manual_seed(0)
    e = _refusal(capture.Spec(sequential=capture.Step(nn.Linear(4, 4), _scaled(lambda: 2), {"x": torch.ones(2, 4)}),
                              rank=rank, world_size=2))
    assert DATA_DEPENDENT in str(e) and "(weight)" in str(e), e
    assert e.source == _line("return int(got.sum().item())  # the read"), e.source


_current: nn.Linear = nn.Linear(4, 4)


def test_a_sequential_step_logging_its_loss_still_captures() -> None:
    """A read of an input-dependent value that nothing uses (`print(loss.item())`) is no size
    and no branch: the sequential step traces as make_fx traces it (the read a dead node)."""
    logged: list[object] = []

    def step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = m(x).pow(2).sum()
        logged.append(loss.item())
        loss.backward()
        return loss

    def plain(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = m(x).pow(2).sum()
        loss.backward()
        return loss

    torch.manual_seed(0)
    m, x = nn.Linear(4, 4), torch.randn(4, 4)
    case = capture(capture.Spec(sequential=capture.Step(m, step, {"x": x}),
                                rank=lambda r: capture.Step(m, plain, {"x": capture.replicate(x)}), world_size=1))
    assert logged and case.check().refines


def test_collectives_of_subgroups_are_matched_per_group() -> None:
    """Two groups of two ranks each all-reduce their ranks' numbers: each group its own sum."""
    def factor() -> int:
        r = dist.get_rank()
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        v = torch.tensor([r])
        dist.all_reduce(v, group=pairs[r // 2])
        return int(v.item())

    case = capture(_exchange_spec(factor, 4))
    assert case.stats["scalar_reads"] == {0: [1], 1: [1], 2: [5], 3: [5]}


@pytest.mark.parametrize("functional", [False, True])
def test_an_uneven_exchange_of_constants_is_run_as_torch_runs_it(functional: bool) -> None:
    """Rank 0 sends [0 | 1, 2] (splits [1, 2]), rank 1 [10, 11 | 12] (splits [2, 1]): rank 0
    receives [0, 10, 11], rank 1 [1, 2, 12] (each source's chunk, in source order, as gloo does);
    the read digits them, and the step checks them (a wrong value stops its trace). The uneven
    exchange is then refused by conversion (refine's all_to_all splits evenly)."""
    import torch.distributed._functional_collectives as funcol

    def factor() -> int:
        r = dist.get_rank()
        x = torch.arange(3) + 10 * r
        send = [1, 2] if r == 0 else [2, 1]
        if functional:
            got = funcol.all_to_all_single(x, send, send, dist.group.WORLD)
        else:
            got = torch.empty(3, dtype=torch.int64)
            dist.all_to_all_single(got, x, send, send)
        v = int((got * torch.tensor([1, 100, 10000])).sum().item())
        if v != [110000 + 1000 + 0, 120000 + 200 + 1][r]:
            raise AssertionError(f"rank {r} read {v}")
        return 2

    with pytest.raises(CaptureError, match="uneven all_to_all"):  # reached only once every read was right
        capture(_exchange_spec(factor, 2))
