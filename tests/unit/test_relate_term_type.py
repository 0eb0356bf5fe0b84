"""Term typing (refine.relate.program.term_type): a constant `full` term holds no dtype, so
beside a typed operand of an elementwise op it takes that operand's dtype, as the lowering
made it. An integer target made safe by `where(target != ignore, target, 0)` stays integer,
and a scatter over it types (captured vocab-parallel cross-entropy built such a term)."""

from __future__ import annotations

from refine.ir.graph import TensorType
from refine.ir.term import Term, leaf
from refine.ops.registry import load_registry
from refine.relate.program import DistProgram, term_type

REG = load_registry()


def _prog() -> DistProgram:
    prog = DistProgram()
    prog.add("ids@0", TensorType((8, 1), "int64"), None, None)
    prog.add("x@0", TensorType((8, 1), "float32"), None, None)
    return prog


def _full(v: float) -> Term:
    return Term("full", (), (v, (8, 1)))


def test_a_constant_branch_takes_the_other_branchs_dtype() -> None:
    ids = leaf("ids@0")
    cond = Term("ne_t", (ids, _full(-100.0)))
    safe = Term("where_t", (cond, ids, _full(0.0)))
    assert term_type(cond, _prog(), REG).dtype == "bool"
    assert term_type(safe, _prog(), REG).dtype == "int64"
    assert term_type(Term("where_t", (cond, _full(0.0), ids)), _prog(), REG).dtype == "int64"
    scattered = Term("scatter_value", (Term("full", (), (0.0, (8, 32))), safe), (1, -1.0))
    assert term_type(scattered, _prog(), REG).shape == (8, 32)


def test_constants_alone_or_beside_floats_stay_float() -> None:
    x, ids = leaf("x@0"), leaf("ids@0")
    assert term_type(Term("maximum_t", (_full(1.0), _full(2.0))), _prog(), REG).dtype == "float32"
    assert term_type(Term("mul_t", (x, _full(2.0))), _prog(), REG).dtype == "float32"
    # the mask of a masked fill is no operand whose dtype the filled tensor shares
    mask = Term("eq_t", (ids, _full(3.0)))
    assert term_type(Term("masked_fill_t", (_full(1.0), mask), (0.0,)), _prog(), REG).dtype == "float32"
