"""Program order (refine.ops.schedule): a distributed program whose ranks issue their collectives
and sends/receives in an order that deadlocks computes nothing, so it does NOT refine, even
when matching the k-th op of each group or pair relates every output correctly.

Each family comes in a deadlocking and a correct order of the same ops: a 2-rank exchange
where both ranks receive first, a 3-rank ring where every rank receives first, all-reduces
over the overlapping pairs of 3 ranks issued in an order that cycles, and a pipeline stage
that waits for its gradient before sending its activation (captured from PyTorch). Sends
are rendezvous (the conservative model): an exchange or a ring where every rank sends first
deadlocks too, unless the sends and receives are one batch (`batch_isend_irecv`).
`refine.ops.interp.eval_ranks` runs in an order the program allows and raises on a deadlock
instead of reading a tensor before its send runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from refine import capture
from refine.check import check, check_files
from refine.frontends.graphfile import load_dist, load_seq
from refine.ir.errors import InputError
from refine.ir.graph import Graph, Input, Node, Output, TensorType
from refine.ops.interp import EvalError, eval_ranks, random_inputs
from refine.ops.registry import load_registry
from refine.ops.schedule import simulate
from refine.verdict.report import Report
from tests.helpers import capture as helpers

REG = load_registry()
SRC = "order.py"
Doc = dict[str, Any]


def node(name: str, op: str, args: list[str], out: list[int], line: int, **attrs: Any) -> Doc:
    n: Doc = {"name": name, "op": op, "args": args, "shape": out, "source": f"{SRC}:{line}"}
    if attrs:
        n["attrs"] = attrs
    return n


def send(name: str, x: str, peer: int, line: int, **attrs: Any) -> Doc:
    return node(name, "send", [x], [4], line, peer=peer, **attrs)


def recv(name: str, peer: int, line: int, **attrs: Any) -> Doc:
    return node(name, "recv", [], [4], line, peer=peer, shape=[4], **attrs)


def all_reduce(name: str, x: str, group: list[int], line: int) -> Doc:
    return node(name, "all_reduce", [x], [4], line, group=group)


def seq_doc(inputs: list[str], outputs: dict[str, tuple[str, str]]) -> Doc:
    """Sequential graph: each output is the sum of two inputs."""
    nodes = [node(f"s_{o}", "add", list(ab), [4], 1) for o, ab in outputs.items()]
    return {"format": "refine-graph", "version": 1, "kind": "sequential",
            "graph": {"inputs": [{"name": x, "shape": [4]} for x in inputs], "nodes": nodes,
                      "outputs": [{"name": o, "ref": f"s_{o}"} for o in outputs]}}


def dist_doc(ranks: list[tuple[list[str], list[Doc], list[str]]], relations: list[Doc],
             expectations: list[Doc]) -> Doc:
    graphs = [{"rank": r, "graph": {"inputs": [{"name": x, "shape": [4]} for x in ins], "nodes": nodes,
                                    "outputs": [{"name": o} for o in outs]}}
              for r, (ins, nodes, outs) in enumerate(ranks)]
    return {"format": "refine-graph", "version": 1, "kind": "distributed",
            "mesh": {"axes": [{"name": "x", "size": len(ranks)}]}, "ranks": graphs,
            "relations": relations, "expectations": expectations}


# ---------------------------------------------------------------------------------------
# the families: each builds (seq, dist) for an order


def exchange(order0: str, order1: str, batch: bool = False) -> tuple[Doc, Doc]:
    """Two ranks each hold one addend and swap them: y = a + b on both. `order` is "rs"
    (recv, then send) or "sr"."""
    def rank(r: int, order: str) -> tuple[list[str], list[Doc], list[str]]:
        extra = {"batch": 0} if batch else {}
        ops = {"r": recv("rx", 1 - r, 10 + 10 * r, **extra), "s": send("tx", "own", 1 - r, 11 + 10 * r, **extra)}
        add = node("y", "add", ["own", "rx"] if r == 0 else ["rx", "own"], [4], 12 + 10 * r)
        return ["own"], [ops[c] for c in order] + [add], ["y"]

    seq = seq_doc(["a", "b"], {"y": ("a", "b")})
    dist = dist_doc([rank(0, order0), rank(1, order1)],
                    [{"from": "a", "layout": "own@0"}, {"from": "b", "layout": "own@1"}],
                    [{"output": "y", "local": "y", "placements": ["Replicate"]}])
    return seq, dist


def ring(orders: list[str]) -> tuple[Doc, Doc]:
    """Rank r sends its x to rank r+1 and receives rank r-1's: y_r = x_r + x_{r-1}."""
    n = len(orders)

    def rank(r: int, order: str) -> tuple[list[str], list[Doc], list[str]]:
        ops = {"r": recv("rx", (r - 1) % n, 10 * r + 1), "s": send("tx", "own", (r + 1) % n, 10 * r + 2)}
        return ["own"], [ops[c] for c in order] + [node("y", "add", ["own", "rx"], [4], 10 * r + 3)], ["y"]

    seq = seq_doc([f"x{r}" for r in range(n)], {f"y{r}": (f"x{r}", f"x{(r - 1) % n}") for r in range(n)})
    dist = dist_doc([rank(r, o) for r, o in enumerate(orders)],
                    [{"from": f"x{r}", "layout": f"own@{r}"} for r in range(n)],
                    [{"output": f"y{r}", "layout": f"y@{r}"} for r in range(n)])
    return seq, dist


PAIRS = {"01": (0, 1), "02": (0, 2), "12": (1, 2)}


def pairs(orders: list[list[str]]) -> tuple[Doc, Doc]:
    """Three ranks, an all-reduce over each pair of them: rank r takes part in the two pairs
    holding r, in the order `orders[r]` gives (names "01", "02", "12")."""
    def rank(r: int, order: list[str]) -> tuple[list[str], list[Doc], list[str]]:
        nodes = [all_reduce(f"o{p}", f"x{p}", list(PAIRS[p]), 10 * (r + 1) + i) for i, p in enumerate(order)]
        return [f"x{p}" for p in sorted(order)], nodes, [f"o{p}" for p in sorted(order)]

    seq = seq_doc([f"{u}{p}" for p in PAIRS for u in "uv"], {f"o{p}": (f"u{p}", f"v{p}") for p in PAIRS})
    rels = [{"from": f"{u}{p}", "layout": f"x{p}@{PAIRS[p][i]}"} for p in PAIRS for i, u in enumerate("uv")]
    expect = [{"output": f"o{p}", "layout": [f"o{p}@{r}" for r in PAIRS[p]]} for p in PAIRS]
    return seq, dist_doc([rank(r, o) for r, o in enumerate(orders)], rels, expect)


CYCLE = [["01", "02"], ["12", "01"], ["02", "12"]]  # 0 waits for 1, 1 for 2, 2 for 0
CONSISTENT = [["01", "02"], ["01", "12"], ["02", "12"]]

DEADLOCKS = {
    "exchange, both receive first": lambda: exchange("rs", "rs"),
    "exchange, both send first (rendezvous sends)": lambda: exchange("sr", "sr"),
    "ring of 3, every rank receives first": lambda: ring(["rs", "rs", "rs"]),
    "ring of 3, every rank sends first (rendezvous sends)": lambda: ring(["sr", "sr", "sr"]),
    "ring of 4, every rank receives first": lambda: ring(["rs"] * 4),
    "all-reduces over overlapping pairs, cyclic order": lambda: pairs(CYCLE),
}
CORRECT = {
    "exchange, rank 0 sends first": lambda: exchange("sr", "rs"),
    "exchange, rank 1 sends first": lambda: exchange("rs", "sr"),
    "exchange as one batch each": lambda: exchange("sr", "sr", batch=True),
    "exchange as one batch each, receives first": lambda: exchange("rs", "rs", batch=True),
    "ring of 3, rank 0 sends first": lambda: ring(["sr", "rs", "rs"]),
    "ring of 4, even ranks send first": lambda: ring(["sr", "rs", "sr", "rs"]),
    "all-reduces over overlapping pairs, consistent order": lambda: pairs(CONSISTENT),
}


def write(tmp: Path, seq: Doc, dist: Doc) -> tuple[Path, Path]:
    s, d = tmp / "seq.json", tmp / "dist.json"
    s.write_text(json.dumps(seq, indent=1))
    d.write_text(json.dumps(dist, indent=1))
    return s, d


def run(tmp: Path, case: tuple[Doc, Doc]) -> Report:
    return check_files(*write(tmp, *case))


@pytest.mark.parametrize("name", list(DEADLOCKS))
def test_a_deadlocking_order_does_not_refine(name: str, tmp_path: Path) -> None:
    report = run(tmp_path, DEADLOCKS[name]())
    assert not report.refines, report
    assert report.deadlock, report
    assert all(not o.ok and "deadlock" in o.detail for o in report.outputs)
    assert "the ranks deadlock" in str(report)


@pytest.mark.parametrize("name", list(CORRECT))
def test_the_same_ops_in_a_runnable_order_refine(name: str, tmp_path: Path) -> None:
    report = run(tmp_path, CORRECT[name]())
    assert report.refines, report
    assert not report.deadlock


def test_the_exchange_names_each_rank_op_and_line(tmp_path: Path) -> None:
    report = run(tmp_path, exchange("rs", "rs"))
    by_rank = {s.rank: s for s in report.deadlock}
    assert set(by_rank) == {0, 1}
    s0, s1 = by_rank[0], by_rank[1]
    assert (s0.node, s0.op, s0.source, s0.waits_for) == ("rx", "recv", f"{SRC}:10", [1])
    assert (s1.node, s1.op, s1.source, s1.waits_for) == ("rx", "recv", f"{SRC}:20", [0])
    assert "recv #0 from rank 1" in s0.waits_at
    assert s0.because == "rank 1, which waits at recv 'rx' (recv #0 from rank 0) at order.py:20"
    text = str(report)
    assert "rank 0 waits at recv 'rx' (recv #0 from rank 1) at order.py:10 for rank 1, which waits at" in text, text


def test_the_cycle_of_all_reduces_names_the_cycle(tmp_path: Path) -> None:
    report = run(tmp_path, pairs(CYCLE))
    got = {s.rank: (s.node, s.waits_for) for s in report.deadlock}
    assert got == {0: ("o01", [1]), 1: ("o12", [2]), 2: ("o02", [0])}
    s0 = next(s for s in report.deadlock if s.rank == 0)
    assert s0.waits_at == "all_reduce 'o01' (#0 of group [0, 1])"
    assert s0.because == "rank 1, which waits at all_reduce 'o12' (#0 of group [1, 2]) at order.py:20"


def test_json_report_and_exit_code(tmp_path: Path) -> None:
    s, d = write(tmp_path, *pairs(CYCLE))
    p = subprocess.run([sys.executable, "-m", "refine.cli", "check", str(s), str(d), "--format", "json"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stdout + p.stderr
    doc = json.loads(p.stdout)
    assert doc["verdict"] == "DOES NOT REFINE"
    assert {(x["rank"], x["node"], x["source"]) for x in doc["deadlock"]} == \
        {(0, "o01", f"{SRC}:10"), (1, "o12", f"{SRC}:20"), (2, "o02", f"{SRC}:30")}
    p = subprocess.run([sys.executable, "-m", "refine.cli", "check", str(s), str(d)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 1 and "the ranks deadlock" in p.stdout, p.stdout + p.stderr


# ---------------------------------------------------------------------------------------
# two collectives of one group in swapped orders: matched by position, never a deadlock


def test_swapped_kinds_of_one_group_are_refused_at_load(tmp_path: Path) -> None:
    """The k-th op of a group pairs an all_reduce with an all_gather: the loader refuses it
    (exit 2), naming both nodes; there is no order to check."""
    seq, dist = pairs(CONSISTENT)
    g0 = dist["ranks"][0]["graph"]
    g0["nodes"].append(node("g", "all_gather", ["x01"], [8], 5, dim=0, group=[0, 1]))
    g1 = dist["ranks"][1]["graph"]
    g1["nodes"].insert(0, node("g", "all_gather", ["x01"], [8], 15, dim=0, group=[0, 1]))
    with pytest.raises(InputError) as e:
        run(tmp_path, (seq, dist))
    assert e.value.where == "$.ranks[1].graph.nodes[0]", str(e.value)
    assert "collective #0 of group [0, 1] is all_gather" in e.value.reason and "'o01'" in e.value.reason


def test_swapped_same_kind_of_one_group_pairs_the_wrong_tensors(tmp_path: Path) -> None:
    """Rank 1 all-reduces its two tensors of group [0, 1] in the other order: matched by
    position, rank 0's first sums its x01 with rank 1's y01. No deadlock (the ops are the
    same kind), but the outputs are wrong: DOES NOT REFINE by the relations."""
    seq = seq_doc(["u01", "v01", "p01", "q01"], {"o01": ("u01", "v01"), "m01": ("p01", "q01")})

    def rank(r: int, swapped: bool) -> tuple[list[str], list[Doc], list[str]]:
        ops = [all_reduce("o01", "x01", [0, 1], 10 * r), all_reduce("m01", "y01", [0, 1], 10 * r + 1)]
        return ["x01", "y01"], ops[::-1] if swapped else ops, ["o01", "m01"]

    rels = [{"from": "u01", "layout": "x01@0"}, {"from": "v01", "layout": "x01@1"},
            {"from": "p01", "layout": "y01@0"}, {"from": "q01", "layout": "y01@1"}]
    expect = [{"output": o, "layout": [f"{o}@0", f"{o}@1"]} for o in ("o01", "m01")]
    good = run(tmp_path, (seq, dist_doc([rank(0, False), rank(1, False)], rels, expect)))
    assert good.refines, good
    bad = run(tmp_path, (seq, dist_doc([rank(0, False), rank(1, True)], rels, expect)))
    assert not bad.refines and not bad.deadlock, bad


# ---------------------------------------------------------------------------------------
# batches


def test_a_send_in_a_batch_cannot_carry_what_the_batch_receives(tmp_path: Path) -> None:
    seq, dist = exchange("sr", "rs", batch=True)
    g1 = dist["ranks"][1]["graph"]
    g1["nodes"] = [g1["nodes"][0], node("z", "add", ["rx", "own"], [4], 30), send("tx", "z", 0, 31, batch=0),
                   g1["nodes"][2]]
    with pytest.raises(InputError) as e:
        run(tmp_path, (seq, dist))
    assert "send 'tx' of batch 0 sends a value computed from a recv of the same batch" in str(e.value)


# ---------------------------------------------------------------------------------------
# the interpreter runs in a schedule order, and stops on a deadlock


@pytest.mark.parametrize("name", list(DEADLOCKS))
def test_eval_ranks_raises_on_a_deadlock(name: str, tmp_path: Path) -> None:
    s, d = write(tmp_path, *DEADLOCKS[name]())
    seq = load_seq(s, REG)
    dist = load_dist(d, REG, seq)
    _, rank_in = random_inputs(seq, dist, 0, REG)
    with pytest.raises(EvalError, match="deadlock") as e:
        eval_ranks(dist.ranks, REG, rank_in)
    assert "rank 0 waits at" in str(e.value)


@pytest.mark.parametrize("name", list(CORRECT))
def test_eval_ranks_runs_a_runnable_order(name: str, tmp_path: Path) -> None:
    s, d = write(tmp_path, *CORRECT[name]())
    seq = load_seq(s, REG)
    dist = load_dist(d, REG, seq)
    _, rank_in = random_inputs(seq, dist, 0, REG)
    vals = eval_ranks(dist.ranks, REG, rank_in)
    for r, g in dist.ranks.items():
        for o in g.outputs:
            assert torch.isfinite(vals[r][o.ref]).all()
    assert check(seq, dist, REG).refines


# ---------------------------------------------------------------------------------------
# captured from PyTorch: a ring of sends, and a pipeline stage waiting too early

B, WORLD = 2, 3


def _ring_seq(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (x * torch.cat([x[-B:], x[:-B]])).sum()  # each block times the block before it


def _ring_rank(m: nn.Module, x: torch.Tensor, how: str) -> torch.Tensor:
    r, w = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(x)
    nxt, prv = (r + 1) % w, (r - 1) % w
    if how == "batch":
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, buf, prv)]):
            work.wait()
    elif how == "isend":  # not batched: the waits are not in the trace, read as blocking at once
        works = [dist.isend(x, dst=nxt), dist.irecv(buf, src=prv)]
        for work in works:
            work.wait()
    elif how == "send first" or (how == "rank 0 sends first" and r == 0):
        dist.send(x, dst=nxt)
        dist.recv(buf, src=prv)
    else:
        dist.recv(buf, src=prv)
        dist.send(x, dst=nxt)
    loss = (x * buf).sum()
    dist.all_reduce(loss)
    return loss


def ring_spec(how: str) -> capture.Spec:
    x = torch.randn(B * WORLD, 4, generator=torch.Generator().manual_seed(0))
    return capture.Spec(sequential=capture.Step(nn.Identity(), _ring_seq, {"x": x}),
                        rank=lambda r: capture.Step(nn.Identity(), lambda m, x: _ring_rank(m, x, how),
                                                    {"x": x[r * B:(r + 1) * B]}),
                        world_size=WORLD, name=f"ring_{how.replace(' ', '_')}")


@pytest.mark.parametrize("how, deadlocks", [("receive first", True), ("send first", True), ("isend", True),
                                            ("rank 0 sends first", False), ("batch", False)])
def test_a_captured_ring(how: str, deadlocks: bool) -> None:
    case = capture(ring_spec(how))
    report = case.check()
    assert report.refines is not deadlocks, report
    assert bool(report.deadlock) is deadlocks
    if deadlocks:
        assert {s.rank for s in report.deadlock} == set(range(WORLD))
        assert all(s.source is not None and s.source.startswith("test_sound_order.py:") for s in report.deadlock)
        with pytest.raises(EvalError, match="deadlock"):
            helpers.wrong_numerically(case)
    else:
        assert helpers.wrong_numerically(case) == set()
    batches = {n["attrs"].get("batch") for g in case.dist_doc["ranks"] for n in g["graph"]["nodes"]
               if n["op"] in ("send", "recv")}
    assert batches == ({0} if how == "batch" else {None})


PP = helpers.load_model("pp_tied")


def _early_grad_recv(stage: nn.Module, ids: torch.Tensor | None = None, labels: torch.Tensor | None = None
                     ) -> torch.Tensor | None:
    """pp_tied's pipeline step, but a stage before the last posts the recv of its output's
    gradient before it sends the output: the next stage waits for that output forever."""
    rank = dist.get_rank()
    if stage.first:
        x = ids
    else:
        x = torch.empty(PP.B, PP.T, PP.H)
        dist.recv(x, src=rank - 1)
        x.requires_grad_()
    out = stage(x)
    loss = None
    if stage.last:
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, PP.V), labels.reshape(-1))
        loss.backward()
    else:
        grad = torch.empty_like(out)
        dist.recv(grad, src=rank + 1)  # too early
        dist.send(out.detach(), dst=rank + 1)
        out.backward(grad)
    if not stage.first:
        dist.send(x.grad, dst=rank - 1)
    group = dist.new_group([0, dist.get_world_size() - 1])
    if stage.first or stage.last:
        dist.all_reduce(stage.embed.weight.grad, group=group)
    return loss.detach() if loss is not None else None


def test_a_pipeline_stage_waiting_for_its_gradient_first_deadlocks() -> None:
    spec = PP.make_case(world_size=3)
    rank = spec.rank
    spec.rank = lambda r: capture.Step(rank(r).model, _early_grad_recv, rank(r).inputs)
    report = capture(spec).check()
    assert not report.refines and report.deadlock, report
    line = helpers.line_of(Path(__file__), "dist.recv(grad, src=rank + 1)  # too early")
    got = {s.rank: (s.op, s.source) for s in report.deadlock}
    recv_act = helpers.line_of(Path(__file__), "dist.recv(x, src=rank - 1)")
    # stage 0 waits for its gradient before sending its output; 1 and 2 wait for their inputs
    assert got == {0: ("recv", line), 1: ("recv", recv_act), 2: ("recv", recv_act)}, report.deadlock
    (s0,) = [s for s in report.deadlock if s.rank == 0]
    assert s0.waits_for == [1] and s0.because == f"rank 1, which waits at recv 'recv_' (recv #0 from rank 0) at {recv_act}"


def test_a_long_ping_pong_is_simulated_op_by_op() -> None:
    """Two ranks bounce a tensor 2000 times (rank 0 sends first): every send meets its recv,
    in one pass over each rank's ops. Both sending first deadlocks at the first op (sends are
    rendezvous)."""
    t = TensorType((4,))

    def ranks(rank1_first: str) -> dict[int, Graph]:  # rank 0 sends first
        out = {}
        for r in (0, 1):
            nodes, x = [], "x"
            for i in range(2000):
                s = Node(f"s{i}", "send", [x], {"peer": 1 - r}, t)
                v = Node(f"v{i}", "recv", [], {"peer": 1 - r, "shape": [4]}, t)
                nodes += [s, v] if r == 0 or rank1_first == "send" else [v, s]
                x = f"v{i}"
            out[r] = Graph([Input("x", t)], nodes, [Output("y", x)])
        return out

    sched = simulate(ranks("recv"), REG)
    assert not sched.stuck and len(sched.order) == 4000
    assert [c.node.name for c in sched.order[0]] == ["s0", "v0"]
    stuck = simulate(ranks("send"), REG).stuck
    assert [(s.rank, s.node) for s in stuck] == [(0, "s0"), (1, "s0")]
