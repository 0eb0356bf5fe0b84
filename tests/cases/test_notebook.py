"""Execute the notebooks headlessly and check what they show.

The kernel is this interpreter: a throwaway kernelspec (argv[0] = sys.executable) is put
first on JUPYTER_PATH, so neither a user-level `python3` kernelspec nor whatever `python`
is on PATH can pick another environment. A cell prepended in memory prints the kernel's
sys.prefix, which must be ours.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import nbclient
import nbformat
import pytest

from tests.helpers import ROOT

NOTEBOOKS = ROOT / "notebooks"
KERNEL = "refine-test-venv"


def _texts(outputs: list[dict[str, Any]]) -> list[str]:
    out = []
    for o in outputs:
        if o.get("output_type") == "stream":
            out.append(o.get("text", ""))
        data = o.get("data", {})
        out += [data[k] for k in ("text/plain", "text/html") if k in data]
    return out


def _execute(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
             timeout: int = 120) -> tuple[list[dict[str, Any]], str]:
    """Run notebooks/<name> in a kernel of this interpreter: its code cells' outputs, and their text."""
    spec = tmp_path / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "refine (test venv)", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("MPLBACKEND", "Agg")  # the notebook's %matplotlib inline still yields PNGs

    path = NOTEBOOKS / name
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        "commit the notebook with its outputs cleared"
    nb.cells.insert(0, nbformat.v4.new_code_cell("import sys, refine\nprint('KERNEL-PREFIX', sys.prefix)"))

    client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=timeout,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError on the first failing cell

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, "\n".join("\n".join(o.get("traceback", [])) for o in errors)
    text = "\n".join(_texts(outputs))
    assert f"KERNEL-PREFIX {sys.prefix}" in text
    return outputs, text


def test_localize_bug_notebook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outputs, text = _execute("localize_bug.ipynb", tmp_path, monkeypatch)
    assert "verdict: DOES NOT REFINE" in text
    assert "culprit: fc2_bias (add)" in text
    assert "verdict: REFINES" in text  # the correct model at the end
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure was drawn"


def test_author_rules_notebook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From the refusal of an unknown op to a proof: the harness rejects the rules written
    without their side condition and accepts them with it; then REFINES, and the twin does not."""
    _, text = _execute("author_rules.ipynb", tmp_path, monkeypatch)
    assert "unknown op: refine has no op 'cumprod'" in text
    assert "UNSOUND (concrete): cumprod-over-cat" in text and "UNSOUND (concrete): slice-into-cumprod" in text
    assert "concrete: 0 of 2 rules sound and fired" in text and "concrete: 2 of 2 rules sound and fired" in text
    assert "verdict: REFINES" in text
    assert "verdict: DOES NOT REFINE" in text and "culprit: cumprod (cumprod)" in text


@pytest.mark.slow
def test_zoo_bug_notebook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A zoo program's bug (transformers' Llama, o_proj left Partial by a plan entry) localized
    at the residual add, with the counterexample and the drawing; the program as written refines."""
    pytest.importorskip("transformers")
    outputs, text = _execute("zoo_bug.ipynb", tmp_path, monkeypatch, timeout=900)
    assert "verdict: DOES NOT REFINE" in text and "rank line: modeling_llama.py:" in text
    assert "hidden_states = residual + hidden_states" in text  # the line's text, shown
    assert "counterexample (seed" in text and "WRONG" in text
    assert "verdict: REFINES" in text
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure was drawn"
