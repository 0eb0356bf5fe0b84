"""Context-parallel (ring) attention with the online-softmax merge, captured end to end.

`models/capture/cp_attention.py`: the sequence is sharded over the ranks, K/V blocks are
all-gathered, each rank merges its per-block outputs and log-sum-exps with the online-softmax
update, and a flash-style backward recomputes the blocks' probabilities from the merged
log-sum-exp. The rules are `rules/lse.py`; the checker fuses softmax into its users
(`Op.fuse`), since the ranks never hold softmax's value.

`refine.oracle.differential.differential` runs both programs (simulated collectives) to show the model
is right and each twin wrong exactly where expected. The steps over the fused softmax search
most of each rank program (the merge lies ~20 ops downstream of the scores), yet their
e-graphs stay near a thousand nodes: the correct case REFINES in ~12 s on 2 shared cores,
and each twin is found at `p @ v` in 6-8 s (measured; 403 s, 29 s and 61 s before the
log-sum-exp rules joined on the sum index).
"""

from __future__ import annotations

import pytest
import torch

from refine import capture
from tests.helpers import capture as helpers
from tests.helpers.capture import MODELS, failing, load_model, wrong_numerically

GRADS = {f"{p}.weight.grad" for p in "qkvo"}


CP = load_model("cp_attention")


def line_of(snippet: str) -> str:
    return helpers.line_of(MODELS / "cp_attention.py", snippet)


@pytest.fixture(scope="module")
def cp_case() -> capture.Case:
    return capture(CP.make_case(world_size=2))


def test_ring_attention_forward_is_softmax_attention() -> None:
    """The merged blocks are softmax attention over the whole sequence, in eager torch."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(8, 4, dtype=torch.float64) for _ in range(3))
    full = torch.softmax(q @ k.t() * CP.SCALE, -1) @ v
    out = lse = None
    for j in range(2):
        s = q @ k[4 * j:4 * j + 4].t() * CP.SCALE
        o, lj = torch.softmax(s, -1) @ v[4 * j:4 * j + 4], torch.logsumexp(s, -1, keepdim=True)
        out, lse = (o, lj) if out is None else CP.merge(out, lse, o, lj, None)
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(lse, torch.logsumexp(q @ k.t() * CP.SCALE, -1, keepdim=True))


def test_capture_holds_the_ring(cp_case: capture.Case) -> None:
    rank0 = cp_case.dist_doc["ranks"][0]["graph"]["nodes"]
    ops = [n["op"] for n in rank0]
    assert ops.count("all_gather") == 2 and ops.count("reduce_scatter") == 2  # K, V and their grads
    merge_line = line_of("return out * torch.exp(lse - new)")
    assert any(n["source"] == merge_line for n in rank0)
    seq_ops = [n["op"] for n in cp_case.seq_doc["graph"]["nodes"]]
    assert "_softmax" in seq_ops and "amax" not in seq_ops  # the sequential model is plain softmax
    assert wrong_numerically(cp_case) == set()


@pytest.mark.parametrize("bug", list(CP.BUGS))
def test_twins_are_wrong_everywhere(bug: str) -> None:
    # the attention output is wrong: the loss and every projection's gradient follow it
    assert wrong_numerically(capture(CP.make_case(world_size=2, bug=bug, **CP.BUGS[bug]))) == {"loss"} | GRADS


def test_ring_attention_refines(cp_case: capture.Case) -> None:
    report = cp_case.check()
    assert report.refines, report
    assert {o.name for o in report.outputs} == {"loss"} | GRADS


@pytest.mark.slow
@pytest.mark.parametrize("bug", list(CP.BUGS))
def test_twins_are_found_at_the_attention_output(bug: str) -> None:
    """The merge no longer equals attention over both blocks: the first sequential node with
    no clean relation is the attention output `p @ v` (softmax itself is fused into it)."""
    report = capture(CP.make_case(world_size=2, bug=bug, **CP.BUGS[bug])).check()
    assert not report.refines
    assert failing(report) == {"loss"} | GRADS
    assert report.culprit is not None, report
    assert report.culprit.source == line_of("return self.o(p @ v)"), report
