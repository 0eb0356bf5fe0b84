"""A residual stack under DTensor TP + sequence parallelism ([B, S, H], torchtitan's plan
shapes; models/capture/sp_residual.py): the residual stream is held in reduce-scattered
sequence pieces, and the proof keeps it as their concat (refine.prove.walk's `_pieces`)
instead of a partial sum whose terms grow with ranks x blocks (at TP 4 the final norm's
square was over a 12-term sum and UNPROVEN)."""

from __future__ import annotations

import pytest

from models.capture import sp_residual as M
from refine import capture
from tests.helpers.capture import wrong_numerically


@pytest.mark.parametrize("world,layers", [(2, 2), (4, 2), pytest.param(4, 3, marks=pytest.mark.slow)])
def test_refines(world: int, layers: int) -> None:
    report = capture(M.make_case(world, layers)).check()
    assert report.verdict == "REFINES", report


def test_the_residual_stream_is_related_as_its_sequence_pieces() -> None:
    """The relations the proof keeps for the forward's stream are over one piece per rank,
    not sums of every rank's partial terms (4 more per block at TP 4)."""
    from refine.check import case_features, engine_for
    from refine.ops.lower import lower
    from refine.prove.copies import join_copies
    from refine.prove.walk import infer, settle
    from refine.relate.program import build_program, seq_input_relations

    c = capture(M.make_case(4, 2))
    core, _ = lower(c.seq, c.registry)
    prog, _ = build_program(c.dist, c.registry, "dist")
    inputs = seq_input_relations(c.dist, c.seq, prog, c.registry, "dist")
    engine = engine_for(c.registry, False, case_features(c.dist))
    join_copies(c.seq, c.dist, prog, engine, c.registry)
    settle(prog, engine, c.registry)
    inf = infer(core, inputs, prog, engine, c.registry)
    loss = core.nodes.index(next(n for n in core.nodes if n.name == core.output("loss").ref))
    adds = [n.name for n in core.nodes[:loss] if n.op == "Sum" and len(n.type.shape) == 3
            and inf.clean.get(n.name) and inf.relations[n.name].op in ("cat", "Sum")]
    assert len(adds) >= 2, "no residual adds related"
    partial = {a: str(inf.relations[a]) for a in adds if len(inf.relations[a].leaves()) > 4}
    assert not partial, partial


def test_norm_grad_not_reduced_does_not_refine() -> None:
    c = capture(M.make_case(4, 2, bug="norm_grad_not_reduced"))
    wrong = wrong_numerically(c)
    assert wrong and all(w.endswith("norm.weight.grad") for w in wrong), wrong
    report = c.check()
    assert report.verdict == "DOES NOT REFINE", report
