"""The torch interpreter: collectives simulated across ranks agree with their lowering in
refine.relate.program, random inputs satisfy the input relations, every inferred relation holds
numerically on every example, and the differential test agrees with the verdict."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from refine.check import check
from refine.frontends.graphfile import load_dist, load_seq
from refine.ir.graph import Dist, Graph, Input, Mesh, Node, Output, Placement, Relation, TensorType
from refine.ir.layout import placed_terms
from refine.ir.term import Term, leaf, parse_layout
from refine.ops.interp import close, eval_graph, eval_ranks, eval_term, random_inputs
from refine.ops.registry import load_registry
from refine.oracle.differential import audit, differential
from refine.relate.program import build_program
from tests.helpers import MODELS

CASES = sorted(p.name for p in MODELS.iterdir() if (p / "seq.json").is_file() and (p / "dist.json").is_file())
REG = load_registry()


def load_case(case: str) -> tuple[Graph, Dist]:
    seq = load_seq(MODELS / case / "seq.json", REG)
    return seq, load_dist(MODELS / case / "dist.json", REG, seq)


def graph(inputs: list[tuple[str, tuple[int, ...], str]], nodes: list[Node], outputs: list[str]) -> Graph:
    return Graph([Input(n, TensorType(s, d)) for n, s, d in inputs], nodes, [Output(o, o) for o in outputs])


def node(name: str, op: str, args: list, out: tuple[int, ...], dtype: str = "float32", **attrs) -> Node:
    return Node(name, op, args, attrs, TensorType(out, dtype))


# ---------------------------------------------------------------------------------------
# collectives: simulation == relate's lowering


COLLECTIVES = [
    ("all_reduce", {"reduce_op": "sum"}, lambda s, n: s),
    ("all_reduce", {"reduce_op": "avg"}, lambda s, n: s),
    ("all_reduce", {"reduce_op": "max"}, lambda s, n: s),
    ("all_gather", {"dim": 1}, lambda s, n: (s[0], s[1] * n)),
    ("reduce_scatter", {"dim": 0, "reduce_op": "sum"}, lambda s, n: (s[0] // n, s[1])),
    ("reduce_scatter", {"dim": 0, "reduce_op": "max"}, lambda s, n: (s[0] // n, s[1])),
    ("all_to_all", {"split_dim": 0, "concat_dim": 1}, lambda s, n: (s[0] // n, s[1] * n)),
    ("broadcast", {"src": 1}, lambda s, n: s),
]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("op,attrs,out_shape", COLLECTIVES, ids=[f"{c[0]}-{i}" for i, c in enumerate(COLLECTIVES)])
def test_collective_simulation_matches_relate_lowering(op, attrs, out_shape, world) -> None:
    shape = (4, 3)
    ranks = {}
    for r in range(world):
        ranks[r] = graph([("x", shape, "float32")],
                         [node("y", op, ["x"], out_shape(shape, world), group=list(range(world)), **attrs),
                          node("z", "exp", ["y"], out_shape(shape, world))], ["z"])
    dist = Dist(Mesh((("tp", world),)), ranks, [], [])
    gen = torch.Generator().manual_seed(1)
    inputs = {r: {"x": torch.randn(shape, generator=gen, dtype=torch.float64)} for r in range(world)}
    vals = eval_ranks(ranks, REG, inputs)
    prog, cores = build_program(dist, REG, "dist")
    flat = {f"{k}@{r}": v for r, vs in eval_ranks(cores, REG, inputs).items() for k, v in vs.items()}
    for r in range(world):
        lowered = eval_term(prog.defs[f"y@{r}"], REG, flat)
        assert close(vals[r]["y"], lowered), (op, attrs, r)
        assert close(vals[r]["z"], torch.exp(lowered))


def test_send_recv_in_program_order() -> None:
    r0 = graph([("a", (2,), "float32"), ("b", (2,), "float32")],
               [node("s1", "send", ["a"], (2,), peer=1), node("s2", "send", ["b"], (2,), peer=1)], ["s2"])
    r1 = graph([("c", (2,), "float32")],
               [node("u", "recv", [], (2,), peer=0, shape=[2]), node("v", "recv", [], (2,), peer=0, shape=[2]),
                node("w", "add", ["u", "c"], (2,))], ["w"])
    a, b, c = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]), torch.tensor([5.0, 6.0])
    vals = eval_ranks({0: r0, 1: r1}, REG, {0: {"a": a, "b": b}, 1: {"c": c}})
    assert torch.equal(vals[1]["u"], a.double()) and torch.equal(vals[1]["v"], b.double())
    assert torch.equal(vals[1]["w"], (a + c).double())


def test_deadlock_is_reported() -> None:
    ranks = {r: graph([("x", (2,), "float32")], [node("y", "all_reduce", ["x"], (2,), group=[0, 1])], ["y"])
             for r in range(2)}
    ranks[1].nodes.clear()
    ranks[1].outputs = [Output("y", "x")]
    with pytest.raises(Exception, match="partner|deadlock"):
        eval_ranks(ranks, REG, {r: {"x": torch.zeros(2)} for r in range(2)})


# ---------------------------------------------------------------------------------------
# random inputs


def test_random_inputs_satisfy_placements_on_a_2d_mesh() -> None:
    mesh = Mesh((("dp", 2), ("tp", 2)))
    seq = graph([("a", (4, 6), "float32"), ("p", (3,), "float32"), ("m", (2, 2), "float32"),
                 ("u", (5, 2), "float32")], [], ["a"])
    rank_in = [("a", (2, 3), "float32"), ("p", (3,), "float32"), ("m", (2, 2), "float32"), ("u", (3, 2), "float32")]
    ranks = {r: graph(rank_in if r % 2 == 0 else rank_in[:3] + [("u", (2, 2), "float32")], [], ["a"])
             for r in range(4)}
    rels = [Relation("a", "a", (Placement("shard", 0), Placement("shard", 1))),
            Relation("p", "p", (Placement("partial"), Placement("replicate"))),
            Relation("m", "m", (Placement("partial", reduce="max"), Placement("partial"))),
            Relation("u", "u", (Placement("replicate"), Placement("shard", 0)))]
    dist = Dist(mesh, ranks, rels, [])
    seq_v, rank_v = random_inputs(seq, dist, seed=3, registry=REG)
    flat = {f"{k}@{r}": v for r, vs in rank_v.items() for k, v in vs.items()}
    for rel in rels:
        terms = placed_terms(lambda r, n=rel.local: f"{n}@{r}", rel.placements, mesh)
        for t in terms:
            assert close(eval_term(t, REG, flat), seq_v[rel.source]), rel


def test_random_inputs_layout_and_embedding_ids() -> None:
    seq = graph([("w", (4, 2), "float32"), ("ids", (5,), "int64")],
                [node("e", "embedding", ["w", "ids"], (5, 2))], ["e"])
    ranks = {r: graph([("q", (2, 2), "float32"), ("ids", (5,), "int64")], [], ["q"]) for r in range(2)}
    layout = parse_layout("cat(slice(q@1, 0, 0, 2), q@0, dim=0)")
    dist = Dist(Mesh((("tp", 2),)), ranks, [Relation("w", layout=layout)], [])
    seq_v, rank_v = random_inputs(seq, dist, seed=0, registry=REG)
    assert torch.equal(seq_v["w"], torch.cat([rank_v[1]["q"], rank_v[0]["q"]]))
    assert seq_v["ids"].dtype == torch.int64 and int(seq_v["ids"].max()) < 4 and int(seq_v["ids"].min()) >= 0
    assert torch.equal(rank_v[0]["ids"], seq_v["ids"])  # guessed replicated
    out = eval_graph(seq, REG, seq_v)
    assert out["e"].dtype == torch.float64


def test_eval_term_helpers_and_literals() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    t = Term("ScaleBy", (leaf("x@0"),), (Fraction(1, 2),))
    assert torch.equal(eval_term(t, REG, {"x@0": x}), x.double() / 2)
    rows = Term("EmbRows", (leaf("w@0"), leaf("i@0")), (2,))
    w = torch.arange(4.0).reshape(2, 2)
    got = eval_term(rows, REG, {"w@0": w, "i@0": torch.tensor([0, 2, 3, 4])})
    assert torch.equal(got, torch.tensor([[0.0, 0.0], [0.0, 1.0], [2.0, 3.0], [0.0, 0.0]], dtype=torch.float64))


# ---------------------------------------------------------------------------------------
# the examples: relations hold, the differential test agrees with the verdict


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_every_inferred_relation_holds_numerically(case: str, seed: int) -> None:
    seq, dist = load_case(case)
    mismatches = audit(seq, dist, REG, seed=seed)
    assert mismatches == [], "\n".join(f"{m.tensor}: {m.relation} (error {m.error:.3g}) {m.detail}"
                                       for m in mismatches)


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("tp_mlp")])
def test_differential_agrees_with_verdict(case: str) -> None:
    seq, dist = load_case(case)
    report = check(seq, dist, REG)
    seq, dist = load_case(case)
    results = differential(seq, dist, REG, seed=0)
    assert all(r.ok is not None for r in results)
    assert all(r.ok for r in results) == report.refines, results
    assert report.refines == ("_bug_" not in case)


def test_audit_flags_a_wrong_relation() -> None:
    from refine.check import engine_for
    from refine.ops.lower import lower
    from refine.oracle.differential import audit_relations
    from refine.prove.walk import infer
    from refine.relate.program import seq_input_relations

    seq, dist = load_case("tp_mlp")
    core, _ = lower(seq, REG)
    prog, cores = build_program(dist, REG, "dist")
    inf = infer(core, seq_input_relations(dist, seq, prog, REG, "dist"), prog, engine_for(REG), REG)
    rels = dict(inf.relations)
    assert audit_relations(seq, dist, rels, prog, cores, REG) == []
    rels["w1"] = Term("cat", (leaf("w1@1"), leaf("w1@0")), (1,))  # pieces swapped
    rels["fc2.matmul"] = leaf("fc2.matmul@0")  # one partial sum only
    bad = {m.tensor for m in audit_relations(seq, dist, rels, prog, cores, REG)}
    assert bad == {"w1", "fc2.matmul"}
