"""refine.frontends.capture.annotate.submesh_layouts: the relation of a tensor only some ranks
hold (a pipeline stage's tensor-parallel group), placed within the holders' groups."""

from __future__ import annotations

import re

import pytest
import torch

from refine.frontends.capture.annotate import submesh_layouts
from refine.frontends.capture.errors import CaptureError
from refine.ir.term import parse_layout

PP_TP = {"pp": 2, "tp": 2}


@pytest.mark.parametrize("mesh, holders, placements, want", [
    # one stage's TP group: sharded, replicated (a copy per rank), a partial sum
    (PP_TP, [0, 1], ["Replicate", "Shard(0)"], ["cat(w@0, w@1, dim=0)"]),
    (PP_TP, [2, 3], ["Replicate", "Shard(1)"], ["cat(w@2, w@3, dim=1)"]),
    (PP_TP, [2, 3], ["Replicate", "Replicate"], ["w@2", "w@3"]),
    (PP_TP, [0, 1], ["Replicate", "Partial(sum)"], ["sum(w@0, w@1)"]),
    # a tied weight on the first and last of 4 stages, each copy sharded over its group
    ({"pp": 4, "tp": 2}, [0, 1, 6, 7], ["Replicate", "Shard(0)"], ["cat(w@0, w@1, dim=0)", "cat(w@6, w@7, dim=0)"]),
    # dp x pp x tp: stage 0's ranks, sharded over dp and tp (the first mesh axis outermost)
    ({"dp": 2, "pp": 2, "tp": 2}, [0, 1, 4, 5], ["Shard(0)", "Replicate", "Shard(1)"],
     ["cat(cat(w@0, w@1, dim=1), cat(w@4, w@5, dim=1), dim=0)"]),
    ({"dp": 2, "pp": 2, "tp": 2}, [2, 3, 6, 7], ["Replicate", "Replicate", "Shard(0)"],
     ["cat(w@2, w@3, dim=0)", "cat(w@6, w@7, dim=0)"]),
    # one rank of a stage that is not tensor parallel
    ({"pp": 2, "tp": 1}, [1], ["Replicate", "Shard(0)"], ["w@1"]),
])
def test_layouts(mesh: dict[str, int], holders: list[int], placements: list[str], want: list[str]) -> None:
    got = submesh_layouts("w", placements, mesh, holders, "'w'")
    assert got == want
    for text in got:
        parse_layout(text)  # the relation language reads every one


def test_layouts_hold_the_tensor() -> None:
    """Cut a tensor as the placements say on the holders, evaluate each layout: the tensor."""
    w = torch.randn(4, 6)
    mesh, holders = {"dp": 2, "pp": 2, "tp": 2}, [0, 1, 4, 5]
    pieces = {0: w[:2, :3], 1: w[:2, 3:], 4: w[2:, :3], 5: w[2:, 3:]}
    (layout,) = submesh_layouts("w", ["Shard(0)", "Replicate", "Shard(1)"], mesh, holders, "'w'")

    def ev(t: object) -> torch.Tensor:
        if t.op in ("D", "Out"):  # type: ignore[attr-defined]
            return pieces[int(t.attrs[0].rpartition("@")[2])]  # type: ignore[attr-defined]
        assert t.op == "cat"  # type: ignore[attr-defined]
        return torch.cat([ev(a) for a in t.args], dim=t.attrs[0])  # type: ignore[attr-defined]

    assert torch.equal(ev(parse_layout(layout)), w)


@pytest.mark.parametrize("holders, placements, why", [
    ([0, 1], ["Shard(0)", "Replicate"], "only ranks [0, 1] hold it, not whole lines along 'pp'"),
    ([0], ["Replicate", "Shard(0)"], "not whole lines along 'tp'"),
    ([0, 1], ["Replicate", "Partial(max)"], "Partial(max)"),
])
def test_refused(holders: list[int], placements: list[str], why: str) -> None:
    with pytest.raises(CaptureError, match=re.escape(why)):
        submesh_layouts("w", placements, PP_TP, holders, "'w'")
