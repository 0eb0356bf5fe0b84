"""The engine runs each step on an e-graph declaring only the rules that can fire in it
(refine.prove.declarations.Declarations.closure): the step's result must be what an e-graph declaring
everything gives. Programs are parsed a statement at a time (egglog's bindings copy the
whole source into every span), and a check that refines does not import torch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from refine.check import check_files, engine_for
from refine.ir import sexp
from refine.ir.sexp import Sym, head, parse_one, show
from refine.ops.registry import load_registry
from refine.prove import declarations
from refine.prove import engine as prove
from tests.helpers import MODELS


def test_statements_cut_at_top_level_only() -> None:
    text = '(a (b "x)(" ) ; c)\n )\n; a comment (\n(push)\n (d "\\"(")'
    assert sexp.statements(text) == ['(a (b "x)(" ) ; c)\n )', "(push)", '(d "\\"(")']
    # anything but statements between them: the whole text, for egglog to report
    assert sexp.statements("(a) x (b)") == ["(a) x (b)"]
    assert sexp.statements("(a") == ["(a"]


def _decls() -> declarations.Declarations:
    return declarations.Declarations.of("\n".join([
        "(sort T)",
        "(constructor D (String) T)", "(constructor A (T) T)", "(constructor B (T) T)",
        "(constructor C (T) T)", "(constructor E (T) T)", "(relation R (T))",
        "(rewrite (A x) (B x))",  # 0: A -> B
        "(rewrite (B x) (C x) :when ((R x)))",  # 1: needs B and R
        "(rule ((= e (C x))) ((R x)))",  # 2: C -> R
        "(rewrite (E (A x)) (A x))",  # 3: needs E and A
        '(rule ((= e (A x))) ((union e (unstable-app (unstable-fn "E") x))))',  # 4: names E in a string only
    ]))


def test_closure_follows_what_rules_write() -> None:
    d = _decls()
    need = d.closure('(let $x (A (D "t0")))')
    # A enables 0 (makes B) and 4 (names E: counted as written); E and A enable 3; B alone
    # does not enable 1 (R is never written, C never made)
    assert need.rules == {0, 3, 4}
    assert {"A", "B", "D", "E"} <= need.tables and "C" not in need.tables
    # with C present, 2 writes R, and then 1 can fire
    assert d.closure('(let $x (A (D "t0")))\n(let $y (C (D "t1")))').rules == {0, 1, 2, 3, 4}
    assert d.closure('(let $x (D "t0"))').rules == set()


def test_pruned_graph_gives_every_step_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step of a refining and a failing example, solved again on an e-graph declaring
    every rule and table: same best term, cost, tensors found, checks and rules fired."""
    compared = []
    solve = prove.Engine._solve

    def both(self: prove.Engine, program: str, checks: list[str], iterations: int = 0,  # noqa: ANN202
             early: bool = True):
        pruned = solve(self, program, checks, iterations, early)
        need = self._decls.closure(program + "\n" + "\n".join(checks))
        assert len(need.rules) < len(self._decls.rules)
        with monkeypatch.context() as m:
            m.setattr(prove.Engine, "_graph", lambda self, need: self.eg)
            full = solve(self, program, checks, iterations, early)
        compared.append(pruned == full)
        return pruned

    monkeypatch.setattr(prove.Engine, "_solve", both)
    engine = engine_for(load_registry())
    monkeypatch.setattr(engine, "cache", {})  # solve every step, not an earlier test's result
    for case in ("sp_mlp", "sp_mlp_bug_gather_wrong_order"):
        check_files(MODELS / case / "seq.json", MODELS / case / "dist.json")
    assert compared and all(compared)


def test_a_refining_check_does_not_import_torch() -> None:
    """Rule families import torch from refine.ir.lazy (their numeric references import it when
    called): a rule family with a plain `import torch` makes every check pay ~1 s for it."""
    code = ("import sys\nfrom refine.check import check_files\n"
            f"r = check_files({str(MODELS / 'sp_mlp' / 'seq.json')!r}, {str(MODELS / 'sp_mlp' / 'dist.json')!r})\n"
            "assert r.refines\nprint(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    env = {k: v for k, v in os.environ.items() if k != "REFINE_SELF_CHECK"}  # a user's check: no numeric run
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.strip() == "[]"


def test_lazy_torch_calls_torch() -> None:
    from refine.ir.lazy import F, torch

    x = torch.tensor([1.0, -2.0], dtype=torch.float64)  # a dtype read before the call, resolved
    assert x.dtype == torch.float64
    assert F.relu(x).tolist() == [1.0, 0.0]


def _with_lets(program: str) -> str:
    """`program` as the engine wrote it before it inlined terms: every compound term a set
    shape or a union states bound by a `let` first, the mark a `let` too, and every union
    stated twice (the ranks' replicas of a definition used to repeat it)."""
    out: list[str] = []
    k = 0
    for line in program.split("\n"):
        if line == "(Mark $__seq)":
            out.append("(let $__mark (Mark $__seq))")
            continue
        st = parse_one(line) if line.startswith(("(set (shape ", "(union ")) else None
        if st is None:
            out.append(line)
            continue
        # the term a set shape (its shape's argument) or a union (its second side) states
        term = st[1][1] if head(st) == "set" else st[2]
        if head(term) in (None, "D", "Out", "Opq"):
            out.append(line)
        else:
            out.append(f"(let $__l{k} {show(term)})")
            named = (st[0], (st[1][0], Sym(f"$__l{k}")), st[2]) if head(st) == "set" else (*st[:2], Sym(f"$__l{k}"))
            out.append(show(named))
            k += 1
        if head(st) == "union":
            out.append(out[-1])
    return "\n".join(out)


def test_inline_terms_give_every_step_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's program writes its terms out in full (one global, `$__seq`, and one per check
    put in the e-graph) and states a
    repeated definition once: each step solved again from the program with a `let` per
    term and every union twice gives the same best term, cost, tensors found, checks and
    rules fired."""
    compared = []
    solve = prove.Engine._solve

    def both(self: prove.Engine, program: str, checks: list[str], iterations: int = 0,  # noqa: ANN202
             early: bool = True):
        inline = solve(self, program, checks, iterations, early)
        # one global for the step's term, and one per check the e-graph holds too (`both`)
        assert program.count("(let ") == 1 + program.count("(let $__check") and "(let $__seq " in program
        lets = _with_lets(program)
        assert lets.count("(let ") > 1 or "(set (shape (" not in program.replace("(set (shape (D ", "")
        compared.append(inline == solve(self, lets, checks, iterations, early))
        return inline

    monkeypatch.setattr(prove.Engine, "_solve", both)
    engine = engine_for(load_registry())
    monkeypatch.setattr(engine, "cache", {})
    for case in ("tp_attention_4ranks", "vocab_embedding_4ranks", "tp_mlp_bug_bias_before_sum"):
        check_files(MODELS / case / "seq.json", MODELS / case / "dist.json")
    assert len(compared) > 10 and all(compared)
