"""`refine import entangle` without the corpus: the fused layouts the importer writes, the
relation file's checks, and dumps built here (an unknown op, a hostile pickle) refused with
exit 2 naming the file; the imports of the corpus itself are in tests/corpus/."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from click.testing import CliRunner

from refine.cli import main
from refine.frontends.importer.entangle import fused_layout, fused_layouts, import_case
from refine.ir.errors import InputError
from tests.helpers import torchgraph


def test_fused_layout() -> None:
    """Parts split by heads over the ranks; fewer heads than ranks: read from each group's first rank."""
    two = fused_layout("w", [{"size": 12, "heads": 6}, {"size": 4, "heads": 2}], 0, 2)
    assert two == ("cat(cat(slice(w@0, 0, 0, 6), slice(w@1, 0, 0, 6), dim=0), "
                   "cat(slice(w@0, 0, 6, 8), slice(w@1, 0, 6, 8), dim=0), dim=0)")
    four = fused_layout("w", [{"size": 16, "heads": 8}, {"size": 4, "heads": 2}], 1, 4)
    assert four.endswith("slice(w@3, 1, 0, 4), dim=1), cat(slice(w@0, 1, 4, 6), slice(w@2, 1, 4, 6), dim=1), dim=1)"), four
    with pytest.raises(ValueError):
        fused_layout("w", [{"size": 12, "heads": 6}], 0, 4)
    # the replicas: the k-th reads each replicated head from the k-th rank of its group
    first, second = fused_layouts("w", [{"size": 16, "heads": 8}, {"size": 4, "heads": 2}], 1, 4)
    assert first == four
    assert second == four.replace("slice(w@0, 1, 4, 6), slice(w@2, 1, 4, 6)", "slice(w@1, 1, 4, 6), slice(w@3, 1, 4, 6)")
    assert fused_layouts("w", [{"size": 12, "heads": 6}, {"size": 4, "heads": 2}], 0, 2) == [two]


def test_relation_file_constants_are_checked(tmp_path: Path) -> None:
    bad = tmp_path / "rel.json"
    bad.write_text(json.dumps({"format": "refine-entangle-relations", "version": 1,
                               "constants": [{"source": "x.py:1", "values": ["zero"]}]}))
    with pytest.raises(InputError) as e:
        import_case(tmp_path, tmp_path, bad)
    assert "$.constants[0]" in str(e.value)


# ---------------------------------------------------------------------------------------
# bad input: exit 2 naming the file (and the node and op)


def _dump(path: Path, target: str) -> None:
    """A two-node dump, pickled with the torchgraph class names the real files use."""
    import torch
    from torch.fx.passes.shape_prop import TensorMetadata

    with torchgraph() as mod:
        x, y, out = mod.PickleableNode(), mod.PickleableNode(), mod.PickleableNode()
        meta = TensorMetadata((2, 3), torch.float32, False, (3, 1), None, False, {})
        x.__dict__.update(name="x", op="placeholder", target="x", args=(), kwargs={}, meta={"tensor_meta": meta})
        y.__dict__.update(name="y", op="call_function", target=target, args=(x,), kwargs={},
                          meta={"tensor_meta": meta, "stack_trace": 'File "m.py", line 3, in f\n    y = frob(x)\n'})
        out.__dict__.update(name="output", op="output", target="output", args=([y],), kwargs={}, meta={})
        g = mod.PickleableGraph()
        g.__dict__.update(nodes=[x, y, out], node_dict={}, direction="fw", gid=0, rank=0, readable_str="")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pickle.dumps(g, protocol=5))


def test_unknown_op_exits_2_naming_op_node_and_file(tmp_path: Path) -> None:
    for d in ("seq", "dist"):
        _dump(tmp_path / d / "fw.g0.r0.gpickle", "frobnicate.warp.default")
    with pytest.raises(InputError) as e:
        import_case(tmp_path / "seq", tmp_path / "dist")
    assert e.value.file.endswith("seq/fw.g0.r0.gpickle") and "'y'" in e.value.where
    assert "frobnicate.warp.default" in e.value.where and "unknown op" in e.value.reason
    r = CliRunner().invoke(main, ["import", "entangle", str(tmp_path / "seq"), str(tmp_path / "dist"),
                                  "--out", str(tmp_path / "out")])
    assert r.exit_code == 2 and "frobnicate.warp.default" in r.output and not (tmp_path / "out").exists()


def test_bad_pickle_exits_2_naming_the_file(tmp_path: Path) -> None:
    _dump(tmp_path / "seq" / "fw.g0.r0.gpickle", "aten.neg.default")
    bad = tmp_path / "dist" / "fw.g0.r0.gpickle"
    bad.parent.mkdir()

    class Evil:
        def __reduce__(self):  # noqa: ANN204 - the classic exploit shape
            import os

            return (os.system, ("echo pwned > /tmp/refine_entangle_pwned",))

    bad.write_bytes(pickle.dumps(Evil(), protocol=5))
    r = CliRunner().invoke(main, ["import", "entangle", str(tmp_path / "seq"), str(tmp_path / "dist"),
                                  "--out", str(tmp_path / "out")])
    assert r.exit_code == 2 and str(bad) in r.output and "refuses global" in r.output
    assert not Path("/tmp/refine_entangle_pwned").exists()


def test_source_lines_and_assigned_numbers() -> None:
    """A node's source is the innermost frame outside torch; a constant's value is read only
    from a source line that assigns a number through a subscript (parsed, never run)."""
    from refine.frontends.importer.entangle import _assigned_number, _frame_source

    trace = ('  File "/a/model.py", line 10, in forward\n    y = f(x)\n'
             '  File "/a/layers.py", line 255, in forward\n    masked_input[input_mask] = 0\n'
             '  File "/x/site-packages/torch/_library/custom_ops.py", line 506, in __call__\n    return fn()\n')
    assert _frame_source(trace) == ("layers.py:255", "masked_input[input_mask] = 0")
    assert _assigned_number("masked_input[input_mask] = 0") == 0.0
    assert _assigned_number("output_parallel[input_mask, :] = -1.5") == -1.5
    for code in ("x = 0", "x[m] = y", "x[m] = f(0)", "x[m] = True", "__import__('os').system('ls')", None):
        assert _assigned_number(code) is None

