"""Value-changing casts are never identities (issue 20).

For every op of the registry that takes a `dtype` attribute and every integer or bool
dtype, a hand-written tensor-parallel pair where one side casts (the ranks, or the
sequential program) and the values differ: the verdict is never REFINES (exit 1, or 2 when
refine refuses the cast), and the numbers (refine.ops.interp on the graphs as written) say
the values do differ. Casts within one value class (float32 <-> bfloat16, float16, float64)
and widening ones (int -> float) keep values, and still REFINE.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from refine import capture
from refine.cli import main
from refine.frontends.graphfile import load_dist, load_seq
from refine.ir.graph import Graph, Input, Node, Output, TensorType
from refine.ops.interp import eval_graph
from refine.ops.registry import load_registry
from refine.oracle.differential import differential
from tests.helpers import write_pair

REG = load_registry()
NARROW = ("int64", "int32", "int8", "uint8", "bool")
SHAPE = [4, 6]
Doc = dict[str, Any]
Nodes = list[Doc]


def n(name: str, op: str, args: list[Any], typ: str = "float32", dims: list[int] | None = None,
      **attrs: Any) -> Doc:
    """A node of dtype `typ` and shape `dims` (SHAPE by default); the keywords are attributes."""
    out: Doc = {"name": name, "op": op, "args": args, "shape": SHAPE if dims is None else dims, "dtype": typ}
    if attrs:
        out["attrs"] = attrs
    return out


def graph(nodes: Nodes, inputs: list[tuple[str, str]]) -> Doc:
    return {"inputs": [{"name": x, "shape": SHAPE, "dtype": d} for x, d in inputs], "nodes": nodes,
            "outputs": [{"name": "z", "ref": nodes[-1]["name"]}]}


def write(tmp: Path, seq: Nodes, rank: Nodes, inputs: list[tuple[str, str]]) -> tuple[Path, Path]:
    head = {"format": "refine-graph", "version": 1}
    s = head | {"kind": "sequential", "graph": graph(seq, inputs)}
    d = head | {"kind": "distributed", "mesh": {"axes": [{"name": "tp", "size": 2}]},
                "ranks": [{"rank": r, "graph": graph(rank, inputs)} for r in (0, 1)],
                "relations": [{"from": x, "placements": ["Replicate"]} for x, _ in inputs],
                "expectations": [{"output": "z", "placements": ["Replicate"]}]}
    return write_pair(tmp, s, d)


def ir(nodes: Nodes, inputs: list[tuple[str, str]]) -> Graph:
    """The graph as written, built directly (not through the loader, which may refuse it)."""
    return Graph([Input(x, TensorType(tuple(SHAPE), d)) for x, d in inputs],
                 [Node(x["name"], x["op"], x["args"], x.get("attrs", {}), TensorType(tuple(x["shape"]), x["dtype"]))
                  for x in nodes], [Output("z", nodes[-1]["name"])])


def values_differ(seq: Nodes, rank: Nodes, inputs: list[tuple[str, str]]) -> bool:
    gen = torch.Generator().manual_seed(0)
    vals = {x: 3 * torch.randn(SHAPE, generator=gen, dtype=torch.float64) if d.startswith("float")
            else torch.randint(-3, 4, SHAPE, generator=gen) for x, d in inputs}
    a = eval_graph(ir(seq, inputs), REG, vals)[seq[-1]["name"]]
    b = eval_graph(ir(rank, inputs), REG, vals)[rank[-1]["name"]]
    return not torch.allclose(a.to(torch.float64), b.to(torch.float64))


# one pair per op that takes a dtype: (the nodes computing z with the cast to `dtype`, the
# nodes computing z without it), over the float input x; z is float32 on both sides (x plus
# an integer or bool constant is a float)
def _identity(op: str) -> Callable[[str], tuple[Nodes, Nodes]]:
    def make(dtype: str) -> tuple[Nodes, Nodes]:
        return ([n("y", op, ["x"], dtype, dtype=dtype), n("z", "cast", ["y"], dtype="float32")],
                [n("z", "clone", ["x"])])
    return make


def _full_like(dtype: str) -> tuple[Nodes, Nodes]:
    # 2.5 in an integer dtype is 2; in bool, True (1)
    return ([n("f", "full_like", ["x"], dtype, fill_value=2.5, dtype=dtype), n("z", "add", ["x", "f"])],
            [n("f", "full_like", ["x"], fill_value=2.5), n("z", "add", ["x", "f"])])


def _scalar_tensor(dtype: str) -> tuple[Nodes, Nodes]:
    return ([n("s", "scalar_tensor", [], dtype, [], s=-1.5, dtype=dtype), n("z", "add", ["x", "s"])],
            [n("s", "scalar_tensor", [], "float32", [], s=-1.5), n("z", "add", ["x", "s"])])


def _full(dtype: str) -> tuple[Nodes, Nodes]:
    # `full` states its dtype as the node's own (no attribute): the same hole
    return ([n("f", "full", [], dtype, value=2.5, shape=SHAPE), n("z", "add", ["x", "f"])],
            [n("f", "full", [], value=2.5, shape=SHAPE), n("z", "add", ["x", "f"])])


def _vector_norm(dtype: str) -> tuple[Nodes, Nodes]:
    return ([n("v", "linalg_vector_norm", ["x"], dtype, [], dtype=dtype), n("c", "cast", ["v"], "float32", [], dtype="float32"),
             n("z", "add", ["x", "c"])],
            [n("v", "linalg_vector_norm", ["x"], "float32", []), n("z", "add", ["x", "v"])])


def _cumsum(dtype: str) -> tuple[Nodes, Nodes]:
    # torch casts the input to `dtype` before summing
    return ([n("c", "cumsum", ["x"], dtype, dim=0, dtype=dtype), n("f", "cast", ["c"], "float32", dtype="float32"),
             n("z", "add", ["x", "f"])],
            [n("c", "cumsum", ["x"], dim=0), n("z", "add", ["x", "c"])])


def _arange(dtype: str) -> tuple[Nodes, Nodes]:
    # an arange holds integers: only bool (which torch refuses) would change them
    return ([n("a", "arange", [], dtype, [6], end=6, dtype=dtype), n("z", "add", ["x", "a"])],
            [n("a", "arange", [], "int64", [6], end=6), n("z", "add", ["x", "a"])])


PAIRS: dict[str, Callable[[str], tuple[Nodes, Nodes]]] = {
    **{op: _identity(op) for op in ("clone", "contiguous", "detach", "alias", "wait_tensor", "to_copy",
                                    "lift_fresh_copy", "cast")},
    "full_like": _full_like, "scalar_tensor": _scalar_tensor, "linalg_vector_norm": _vector_norm,
    "arange": _arange, "full": _full, "cumsum": _cumsum,
}
KEEPS_VALUES = {("arange", d) for d in NARROW if d != "bool"}  # integers in an integer dtype


def test_every_op_with_a_dtype_is_covered() -> None:
    """A new op that takes a dtype needs a pair here (recv has its own test below)."""
    with_dtype = {op.name for op in REG.ops.values() if "dtype" in op.attr_kinds()}
    assert with_dtype - {"recv"} <= set(PAIRS), with_dtype - set(PAIRS)


def _check(tmp: Path) -> Any:
    return CliRunner().invoke(main, ["check", str(tmp / "seq.json"), str(tmp / "dist.json")])


@pytest.mark.parametrize("side", ["ranks", "sequential"])
@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize("op", sorted(PAIRS))
def test_a_value_changing_cast_never_refines(tmp_path: Path, op: str, dtype: str, side: str) -> None:
    casting, plain = PAIRS[op](dtype)
    seq, rank = (plain, casting) if side == "ranks" else (casting, plain)
    inputs = [("x", "float32")]
    write(tmp_path, seq, rank, inputs)
    r = _check(tmp_path)
    if (op, dtype) in KEEPS_VALUES:
        assert not values_differ(seq, rank, inputs)
        assert r.exit_code == 0, r.output
        return
    assert values_differ(seq, rank, inputs), "the pair should compute different values"
    assert r.exit_code in (1, 2), r.output
    if r.exit_code == 2:
        # refused at load, naming the file, the node's place, the op and the dtype
        node = next(x for x in casting if dtype in (x["dtype"], x.get("attrs", {}).get("dtype")))
        assert "seq.json" in r.output if side == "sequential" else "dist.json" in r.output, r.output
        assert ".graph.nodes[0]" in r.output and repr(node["name"]) in r.output, r.output
        assert node["op"] in r.output and dtype in r.output, r.output
        return
    # DOES NOT REFINE: the numbers agree (the evaluator finds the output wrong)
    s = load_seq(tmp_path / "seq.json", REG)
    diffs = differential(s, load_dist(tmp_path / "dist.json", REG, s), REG)
    assert [d.ok for d in diffs] == [False], diffs


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64", "float32"])
@pytest.mark.parametrize("op", ["to_copy", "clone", "cast", "contiguous"])
def test_float_to_float_casts_still_refine(tmp_path: Path, op: str, dtype: str) -> None:
    """refine's semantics are real-valued: a change of float precision is an identity."""
    rank = [n("y", op, ["x"], dtype, dtype=dtype), n("z", "relu", ["y"], dtype)]
    seq = [n("z", "relu", ["x"])]
    write(tmp_path, seq, rank, [("x", "float32")])
    r = _check(tmp_path)
    assert r.exit_code == 0, r.output


def test_an_int_to_float_cast_keeps_values_and_refines(tmp_path: Path) -> None:
    """int -> float keeps every value (the integers are real numbers): x * float(i) is x * i."""
    inputs = [("i", "int64"), ("x", "float32")]
    rank = [n("y", "to_copy", ["i"], "float32", dtype="float32"), n("z", "mul", ["x", "y"])]
    seq = [n("z", "mul", ["x", "i"])]
    write(tmp_path, seq, rank, inputs)
    assert not values_differ(seq, rank, inputs)
    r = _check(tmp_path)
    assert r.exit_code == 0, r.output


def test_a_bool_to_int_cast_is_no_identity(tmp_path: Path) -> None:
    """A bool's + is an or: two masks cast to int64 and added count to 2 where the bools'
    sum is True. The cast is a `cast_float_t`, which no rule moves across a sum."""
    inputs = [("a", "bool"), ("b", "bool")]
    rank = [n("p", "to_copy", ["a"], "int64", dtype="int64"), n("q", "to_copy", ["b"], "int64", dtype="int64"),
            n("s", "add", ["p", "q"], "int64"), n("z", "cast", ["s"], dtype="float32")]
    seq = [n("s", "add", ["a", "b"], "bool"), n("z", "cast", ["s"], dtype="float32")]
    write(tmp_path, seq, rank, inputs)
    r = _check(tmp_path)
    assert r.exit_code in (1, 3), r.output


@pytest.mark.parametrize("dtype", NARROW)
def test_a_node_dtype_that_narrows_its_op_is_refused(tmp_path: Path, dtype: str) -> None:
    """No dtype attribute: the node's own dtype would truncate (the evaluator casts every
    node to its dtype); refused at load, naming the node, the op and both dtypes."""
    rank = [n("y", "exp", ["x"], dtype), n("z", "cast", ["y"], dtype="float32")]
    seq = [n("y", "exp", ["x"]), n("z", "cast", ["y"], dtype="float32")]
    write(tmp_path, seq, rank, [("x", "float32")])
    assert values_differ(seq, rank, [("x", "float32")])
    r = _check(tmp_path)
    assert r.exit_code == 2, r.output
    assert "$.ranks[0].graph.nodes[0].dtype" in r.output and "'y' (exp)" in r.output, r.output
    assert dtype in r.output and "float32" in r.output, r.output


def test_a_dtype_attribute_the_node_contradicts_is_refused(tmp_path: Path) -> None:
    rank = [n("y", "to_copy", ["x"], "float32", dtype="int64"), n("z", "relu", ["y"])]
    write(tmp_path, [n("z", "relu", ["x"])], rank, [("x", "float32")])
    r = _check(tmp_path)
    assert r.exit_code == 2 and "$.ranks[0].graph.nodes[0]" in r.output and "int64" in r.output, r.output


@pytest.mark.parametrize("dtype", NARROW)
def test_a_recv_of_another_dtype_is_refused(tmp_path: Path, dtype: str) -> None:
    """recv's dtype is what its send sent, exactly: a float sent, an int received, is refused."""
    seq = [n("z", "relu", ["x"])]
    write(tmp_path, seq, seq, [("x", "float32")])
    d = json.loads((tmp_path / "dist.json").read_text())
    d["ranks"][0]["graph"]["nodes"].insert(0, n("tx", "send", ["x"], peer=1))
    d["ranks"][1]["graph"]["nodes"].insert(0, n("rx", "recv", [], dtype, peer=0, shape=SHAPE, dtype=dtype))
    (tmp_path / "dist.json").write_text(json.dumps(d))
    r = _check(tmp_path)
    assert r.exit_code == 2 and "$.ranks[1].graph.nodes[0]" in r.output and dtype in r.output, r.output


class _Fill(nn.Module):
    """x * w plus 2.5, either as a float or as a constant of an integer dtype (which holds 2)."""

    def __init__(self, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1.0, 1.0, 4))
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fill = torch.full_like(x, 2.5, dtype=self.dtype) if self.dtype is not None else 2.5
        return (x * self.w + fill).sum()


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x)
    loss.backward()
    return loss


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_a_captured_fill_is_held_as_its_dtype_holds_it(dtype: torch.dtype) -> None:
    """Capture writes torch's fill (2 in an integer dtype, True in bool), and the verdict
    follows the numbers: a sequential float 2.5 against it does not refine."""
    x = torch.randn(6, 4)
    seq = capture.Step(_Fill(None), _step, {"x": x})
    case = capture(capture.Spec(seq, lambda r: capture.Step(_Fill(dtype), _step, {"x": x}), world_size=1))
    name = str(dtype).removeprefix("torch.")
    fills = [n for n in case.dist_doc["ranks"][0]["graph"]["nodes"] if n["op"] == "full" and n["dtype"] == name]
    assert [n["attrs"]["value"] for n in fills] == [1.0 if dtype == torch.bool else 2.0], fills
    assert [d.ok for d in differential(case.seq, case.dist, case.registry) if d.output == "loss"] == [False]
    assert not case.check().refines


@pytest.mark.parametrize("dtype", ["int64", "int32", "bool"])
def test_a_fractional_literal_promotes(tmp_path: Path, dtype: str) -> None:
    """An integer (or bool) tensor times 0.5 is a float tensor in torch; declared integer,
    the evaluator truncates it and the prover would not: refused at the node."""
    inputs = [("i", dtype), ("x", "float32")]
    rank = [n("h", "mul", ["i", 0.5], dtype), n("z", "add", ["x", "h"])]
    seq = [n("h", "mul", ["i", 0.5]), n("z", "add", ["x", "h"])]
    write(tmp_path, seq, rank, inputs)
    assert values_differ(seq, rank, inputs)
    r = _check(tmp_path)
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and "$.ranks[0].graph.nodes[0].dtype" in text and "'h' (mul)" in text, text
    assert "gives float32" in text and dtype in text, text


@pytest.mark.parametrize("op,args,dtype", [
    ("exp", ["i"], "int64"),  # torch.exp of an int64 tensor is float32
    ("sqrt", ["i"], "int32"),
    ("div", ["i", "j"], "int64"),  # true division
    ("div", ["i", 2], "int64"),
    ("add", ["i", "x"], "int64"),  # int with float promotes to float
    ("mul", ["m", "x"], "bool"),
    ("add", ["m", "i"], "bool"),  # bool with int promotes to int
])
def test_a_node_dtype_narrower_than_torch_gives_is_refused(tmp_path: Path, op: str, args: list[Any],
                                                          dtype: str) -> None:
    """The node's dtype is what torch makes of its inputs' classes; a narrower one truncates
    in the evaluator and not in the prover."""
    inputs = [("i", "int64"), ("j", "int64"), ("m", "bool"), ("x", "float32")]
    rank = [n("h", op, args, dtype), n("z", "add", ["x", "h"])]
    seq = [n("h", op, args, "int64" if dtype == "bool" and op == "add" else "float32"), n("z", "add", ["x", "h"])]
    write(tmp_path, seq, rank, inputs)
    assert values_differ(seq, rank, inputs)
    r = _check(tmp_path)
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and "$.ranks[0].graph.nodes[0].dtype" in text and f"'h' ({op})" in text, text


def test_a_sum_of_bools_is_their_or(tmp_path: Path) -> None:
    """torch adds two bools to their logical or (True + True is True), so m + m is m, not
    2 * m: as numbers the two differ, and the verdict must say so."""
    inputs = [("m", "bool"), ("x", "float32")]
    seq = [n("h", "add", ["m", "m"], "bool"), n("c", "cast", ["h"], dtype="float32"), n("z", "add", ["x", "c"])]
    rank = [n("h", "mul", ["m", 2], "int64"), n("c", "cast", ["h"], dtype="float32"), n("z", "add", ["x", "c"])]
    write(tmp_path, seq, rank, inputs)
    assert values_differ(seq, rank, inputs)
    r = _check(tmp_path)
    assert r.exit_code in (1, 3), r.output
    # and an or is an or: the ranks' logical_or of the same masks refines
    rank = [n("h", "logical_or", ["m", "m"], "bool"), n("c", "cast", ["h"], dtype="float32"),
            n("z", "add", ["x", "c"])]
    write(tmp_path, seq, rank, inputs)
    assert not values_differ(seq, rank, inputs)
    r = _check(tmp_path)
    assert r.exit_code == 0, r.output
