"""The .gpickle reader never runs code from a file: only plain-data globals resolve, to inert
stand-ins; anything else is an exit-2 style InputError naming the global."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from refine.frontends.importer.gpickle import NodeRef, load_gpickle
from refine.ir.errors import InputError
from tests.helpers import torchgraph


def _write_graph(path: Path) -> None:
    with torchgraph() as mod:
        x, y = mod.PickleableNode(), mod.PickleableNode()
        x.__dict__.update(name="x", op="placeholder", target="x", args=(), kwargs={}, meta={})
        y.__dict__.update(name="y", op="call_function", target="aten.neg.default", args=(x,), kwargs={},
                          meta={"stack_trace": 'File "m.py", line 3, in f'})
        g = mod.PickleableGraph()
        g.__dict__.update(nodes=[x, y], node_dict={}, direction="fw", gid=0, rank=1, readable_str="")
        path.write_bytes(pickle.dumps(g, protocol=5))


def test_reads_a_graph(tmp_path: Path) -> None:
    p = tmp_path / "fw.g0.r1.gpickle"
    _write_graph(p)
    g = load_gpickle(p)
    assert [n.name for n in g.nodes] == ["x", "y"] and g.rank == 1 and g.direction == "fw"
    assert g.index["y"].args == (NodeRef("x"),) and g.index["y"].target == "aten.neg.default"


class _Evil:
    def __reduce__(self):  # noqa: ANN204 - the classic pickle exploit shape
        import os

        return (os.system, ("echo pwned > /tmp/refine_pwned",))


def test_hostile_pickle_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "evil.gpickle"
    p.write_bytes(pickle.dumps(_Evil(), protocol=5))
    with pytest.raises(InputError) as e:
        load_gpickle(p)
    assert e.value.file == str(p) and "refuses global" in e.value.reason
    assert "system" in e.value.reason
    assert not Path("/tmp/refine_pwned").exists()


@pytest.mark.parametrize("payload, reason", [
    (b"not a pickle", "not a readable graph pickle"),
    (pickle.dumps([1, 2, 3], protocol=5), "expected a PickleableGraph"),
    (pickle.dumps({"nodes": []}, protocol=5)[:-3], "not a readable graph pickle"),
])
def test_malformed_files(tmp_path: Path, payload: bytes, reason: str) -> None:
    p = tmp_path / "bad.gpickle"
    p.write_bytes(payload)
    with pytest.raises(InputError) as e:
        load_gpickle(p)
    assert reason in e.value.reason and e.value.where == "$"


