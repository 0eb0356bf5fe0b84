"""`refine rules list` (with fire counts after a check) and `refine rules verify` (the
soundness harness from the command line, catching a wrong rule in an extra rule dir)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from refine.cli import main
from refine.ops.registry import load_registry
from tests.helpers import MODELS

WRONG = '''from refine.ops.registry import rewrite

# a slice of a concat is NOT a slice of its second part at the same offsets
RULES = [rewrite("tmp-wrong-slice-cat", "(slice (cat a b d) d s e)", "(slice b d s e)")]
'''


def _fired(output: str) -> dict[str, int]:
    out = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.split("│") if c.strip()]
        if len(cells) == 4 and cells[3].isdigit():
            out[cells[1]] = int(cells[3])
    return out


def test_rules_list_shows_every_rule_and_what_fired_in_a_check() -> None:
    plain = CliRunner().invoke(main, ["rules", "list"], terminal_width=200)
    assert plain.exit_code == 0, plain.output
    assert f"{len(load_registry().rules)} rules" in plain.output
    case = MODELS / "sp_mlp"
    result = CliRunner().invoke(main, ["rules", "list", "--check", str(case / "seq.json"), str(case / "dist.json")],
                                terminal_width=200)
    assert result.exit_code == 0, result.output
    fired = _fired(result.output)
    assert set(fired) == {r.name for r in load_registry().rules}
    # sequence parallelism: the gathered tokens are a concat, sliced back by the reduce_scatter
    assert fired["slice-cat-left"] > 0 and fired["slice-cat-right"] > 0
    assert fired["embedding-vocab-split"] == 0  # no embedding in an MLP


@pytest.mark.slow
def test_rules_verify_catches_a_wrong_rule_in_an_extra_dir(tmp_path: Path) -> None:
    (tmp_path / "wrong.py").write_text(WRONG)
    bad = CliRunner().invoke(main, ["rules", "verify", "--rules", str(tmp_path), "--only", "tmp-wrong-slice-cat",
                                    "--mode", "concrete"])
    assert bad.exit_code == 1, bad.output
    assert "UNSOUND (concrete): tmp-wrong-slice-cat" in bad.output
    good = CliRunner().invoke(main, ["rules", "verify", "--only", "slice-cat-left", "--only", "scale-factor"])
    assert good.exit_code == 0, good.output
    assert "concrete: 2 of 2 rules sound and fired" in good.output
    assert "symbolic: 2 of 2 rules sound and fired" in good.output
    unknown = CliRunner().invoke(main, ["rules", "verify", "--only", "no-such-rule"])
    assert unknown.exit_code == 2 and "no such rule: no-such-rule" in unknown.output
