"""`refine` command line. Exit codes: 0 refines (a proof), 1 does not refine (a counterexample,
or ranks that deadlock), 2 bad input/unsupported, 3 unproven (neither)."""

from __future__ import annotations

import sys
from typing import NoReturn

import click
from rich.console import Console

from refine.ir.errors import InputError


@click.group()
def main() -> None:
    """Prove a distributed training step refines its sequential model, or find where not."""


NUMERIC_FORMATS = ("bf16", "fp16", "fp8", "fp8e4m3", "fp8e5m2")  # refine.oracle.precision.CHOICES, without importing torch


@main.command("check")
@click.argument("seq")
@click.argument("dist")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
@click.option("--rules", "rules", multiple=True, type=click.Path(file_okay=False),
              help="a directory of extra rule files (repeatable). Its Python files are imported and run as "
                   "trusted code, like a plugin. Before use, its new rules and ops are verified by the "
                   "soundness harness (cached by content in $REFINE_CACHE_DIR, else $XDG_CACHE_HOME/refine "
                   "or ~/.cache/refine): a wrong one refuses the check (exit 2), and so does one the harness "
                   "cannot exercise, unless --trust-rules")
@click.option("--trust-rules", "trust_rules", is_flag=True,
              help="use extra rules or ops the soundness harness could not exercise; the report lists them "
                   "as unverified (a rule with a counterexample is refused regardless)")
@click.option("--stats", "stats", is_flag=True,
              help="print, per search strategy of the prover, how many nodes it ran on and how many times its "
                   "result was the relation kept (the JSON report has them always, under stats.strategies)")
@click.option("--numeric", "numeric", type=click.Choice(NUMERIC_FORMATS), default=None,
              help="also run both sides with every floating tensor rounded to this format (fp8: fp8e4m3) on random "
                   "inputs and report, per output, the error against float64 and its tolerance (derived from what "
                   "the sequential program loses in the format and the collectives' extra roundings); a warning "
                   "beyond it does not change the verdict or the exit code")
@click.option("--tries", "tries", type=click.IntRange(min=0), default=None,
              help="random draws the counterexample search makes when the proof stops "
                   "[default: refine.verdict.counterexample.TRIES]; 0: no search (UNPROVEN)")
@click.option("--counterexample", "cex_dir", type=click.Path(file_okay=False), default=None,
              help="write the counterexample's inputs here (counterexample.json and raw tensor files; "
                   "refine.verdict.counterexample.load reads them back)")
@click.option("--self-check", "self_check", is_flag=True,
              help="run a REFINES once on random inputs too: outputs that differ are a soundness failure "
                   "of refine (exit 2, loudly)")
def check_cmd(seq: str, dist: str, fmt: str, rules: tuple[str, ...], trust_rules: bool, stats: bool,
              tries: int | None, cex_dir: str | None, self_check: bool, numeric: str | None) -> None:
    """Check that DIST (per-rank graphs) refines SEQ (the sequential graph).

    Exit 0: REFINES (a proof). 1: DOES NOT REFINE (inputs on which the outputs differ, or
    ranks that deadlock). 2: bad input or unsupported. 3: UNPROVEN (the proof stopped and
    the search found no counterexample)."""
    from refine.check import check_files
    from refine.verdict.report import print_report

    try:
        report = check_files(seq, dist, rules, trust_rules,
                             tries=tries,
                             self_check=True if self_check else None)
        found = report.search.found if report.search is not None else None
        if cex_dir is not None and found is not None:
            from refine.verdict import counterexample

            counterexample.write(found, cex_dir)
    except LOAD_ERRORS as e:
        _load_error(e, fmt)
    except Exception as e:  # noqa: BLE001 - a crash is no verdict: exit 2, never Python's 1 ("does not refine")
        _bad_input(f"internal error, no verdict ({type(e).__name__}): {e}", fmt)
        return
    if numeric:
        from refine.oracle.precision import numeric_check_files, print_numerics

        report.numerics = numeric_check_files(seq, dist, rules, numeric)
    if fmt == "json":
        click.echo(report.to_json())
    else:
        print_report(report, Console(emoji=False), strategies=stats)
        if report.numerics is not None:
            print_numerics(report.numerics, Console(emoji=False))
    sys.exit(report.exit_code)


@main.command("capture")
@click.argument("target", metavar="FILE.py:FUNC")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False),
              help="directory for seq.json and dist.json")
@click.option("--world-size", "world_size", type=int, default=None,
              help="passed to FUNC as world_size= (or checked against its Spec)")
@click.option("--check", "then_check", is_flag=True, help="check the captured pair right away")
def capture_cmd(target: str, out: str, world_size: int | None, then_check: bool) -> None:
    """Capture a PyTorch training step: FUNC returns a refine.capture.Spec (sequential step and
    per-rank steps); write OUT/seq.json and OUT/dist.json."""
    from refine.frontends.capture import CaptureError, Case, capture, load_target

    try:
        spec = load_target(target, world_size)
        case = spec if isinstance(spec, Case) else capture(spec)
        case.write(out)
    except CaptureError as e:
        _bad_input(str(e), "text")
        return
    except OSError as e:
        _bad_input(f"cannot write {out}: {e}", "text")
        return
    click.echo(case.summary())
    click.echo(f"wrote {out}/seq.json and {out}/dist.json")
    if not then_check:
        return
    from refine.verdict.report import print_report

    try:
        report = case.check()
    except InputError as e:
        _bad_input(str(e), "text")
        return
    print_report(report, Console(emoji=False))
    sys.exit(report.exit_code)


@main.group("import")
def import_group() -> None:
    """Turn graphs captured by other tools into refine's graph format."""


@import_group.command("entangle")
@click.argument("seq_dir", type=click.Path())
@click.argument("dist_dir", type=click.Path())
@click.option("--out", "out", required=True, type=click.Path(file_okay=False),
              help="directory for seq.json and dist.json")
@click.option("--relations", "relations", type=click.Path(dir_okay=False), default=None,
              help="a relation file (fused layouts, placements, checked outputs); format: the README's "
                   "CLI reference, in full `pydoc refine.frontends.importer.entangle`")
@click.option("--direction", type=click.Choice(["fw", "bw", "both"]), default=None,
              help="which dumps to read when a directory holds several (default: both, else fw)")
@click.option("--graph-id", "graph_id", type=click.IntRange(min=0), default=0, show_default=True,
              help="which graph's dumps to read (<dir>.g<ID>.r<rank>.gpickle): a directory may also hold "
                   "another graph, such as a loss-scale graph 1")
def import_entangle_cmd(seq_dir: str, dist_dir: str, out: str, relations: str | None, direction: str | None,
                        graph_id: int) -> None:
    """Read GraphGuard/Entangle .gpickle dumps: SEQ_DIR (the sequential graph) and DIST_DIR
    (one graph per rank); write OUT/seq.json and OUT/dist.json."""
    from refine.frontends.importer.entangle import import_case

    try:
        case = import_case(seq_dir, dist_dir, relations, direction, graph_id=graph_id)
        case.write(out)
    except InputError as e:
        _bad_input(str(e), "text")
        return
    except OSError as e:
        _bad_input(f"cannot write {out}: {e}", "text")
        return
    except Exception as e:  # noqa: BLE001 - the importer names the file; a crash past it is still no case: exit 2
        _bad_input(f"{seq_dir}, {dist_dir}: internal error, no case written ({type(e).__name__}): {str(e)[:200]}",
                   "text")
        return
    for g in case.guesses:
        click.echo(f"guessed: {g}")
    click.echo(f"wrote {out}/seq.json and {out}/dist.json ({case.nodes} FX nodes over "
               f"{len(case.dist['ranks'])} ranks and the sequential graph)")


@main.group("rules")
def rules_group() -> None:
    """List the rewrite rules, or verify them numerically."""


RULES_OPTION = click.option("--rules", "rules", multiple=True, type=click.Path(file_okay=False),
                            help="a directory of extra rule files (repeatable)")


@rules_group.command("list")
@RULES_OPTION
@click.option("--check", "pair", nargs=2, metavar="SEQ DIST", default=None,
              help="check this pair first and show how often each rule fired in it")
def rules_list_cmd(rules: tuple[str, ...], pair: tuple[str, str] | None) -> None:
    """Every rule with its family (and, after --check, its matches)."""
    from collections import Counter

    from rich.table import Table

    from refine.check import _ENGINES, check_files
    from refine.ops.registry import load_registry

    try:
        registry = load_registry(rules)
        fired = None
        if pair is not None:
            # engines live for the process: count only what this check adds
            before = {k: Counter(e.fired) for k, e in _ENGINES.items()}
            report = check_files(*pair, rules)
            symbolic = bool(report.symbols)
            fired = Counter()
            for k, e in _ENGINES.items():
                if k[:2] == (id(registry), symbolic):
                    fired += e.fired - before.get(k, Counter())
    except LOAD_ERRORS as e:
        _load_error(e, "text")
    table = Table(title=f"{len(registry.rules)} rules in {len(registry.families)} families")
    for col in ("family", "rule", "symbolic", *(("fired",) if fired is not None else ())):
        table.add_column(col)
    for r in registry.rules:
        row = [r.family, r.name, "yes" if r.symbolic else "no"]
        if fired is not None:
            row.append(str(fired.get(r.name, 0)))
        table.add_row(*row)
    Console(width=120).print(table)


@rules_group.command("verify")
@RULES_OPTION
@click.option("--only", "only", multiple=True, help="verify only this rule (repeatable)")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--mode", type=click.Choice(["concrete", "symbolic", "both"]), default="both", show_default=True,
              help="sizes as i64, as symbolic PyObjects, or both")
def rules_verify_cmd(rules: tuple[str, ...], only: tuple[str, ...], seed: int, mode: str) -> None:
    """Check every rule alone on random seed terms: each merge it makes must hold in torch
    (float64), and each rule must fire. Exit 1 if any rule is unsound or never fires."""
    from refine.ops.registry import load_registry
    from refine.prove.harness import Harness

    try:
        registry = load_registry(rules)
    except (FileNotFoundError, ImportError, ValueError) as e:
        _bad_input(f"{type(e).__name__}: {e}", "text")
        return
    names = {r.name for r in registry.rules}
    unknown = sorted(set(only) - names)
    if unknown:
        _bad_input(f"no such rule: {', '.join(unknown)}", "text")
        return
    bad = 0
    for symbolic in {"concrete": [False], "symbolic": [True], "both": [False, True]}[mode]:
        h = Harness(registry, seed=seed + symbolic, symbolic=symbolic)
        results = h.run([r.name for r in registry.rules if (not only or r.name in only) and (r.symbolic or not symbolic)])
        kind = "symbolic" if symbolic else "concrete"
        for r in results:
            if r.failures or not r.fired:
                bad += 1
                why = "UNSOUND" if r.failures else "NEVER FIRES"
                click.echo(f"{why} ({kind}): {r.rule}")
                for f in r.failures[:4]:
                    click.echo(f"  {f}")
        ok = sum(1 for r in results if r.fired and not r.failures)
        click.echo(f"{kind}: {ok} of {len(results)} rules sound and fired")
    sys.exit(1 if bad else 0)


@main.command("mutate")
@click.argument("seq")
@click.argument("dist")
@click.option("--count", type=int, default=10, show_default=True, help="how many mutants (that load) to check")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--operator", "operators", multiple=True,
              help="only this mutation operator (repeatable); see refine/oracle/mutate.py")
@click.option("--no-eval", "no_eval", is_flag=True,
              help="do not run the programs in torch (cases too large to evaluate): verdicts only")
@RULES_OPTION
def mutate_cmd(seq: str, dist: str, count: int, seed: int, operators: tuple[str, ...], no_eval: bool,
               rules: tuple[str, ...]) -> None:
    """Inject small distributed-training bugs into DIST, check and evaluate each mutant, and
    print a table. Exit 1 if a numerically wrong mutant REFINES (a soundness failure) or the
    check crashes on one."""
    from collections import Counter

    from rich.table import Table

    from refine.ops.registry import load_registry
    from refine.oracle.mutate import ALL_OPERATORS, load_case, read_doc, run

    unknown = sorted(set(operators) - set(ALL_OPERATORS))
    if unknown:
        _bad_input(f"no such operator: {', '.join(unknown)} (known: {', '.join(ALL_OPERATORS)})", "text")
        return
    try:
        registry = load_registry(rules)
        seq_g, dist_g, doc = load_case(seq, dist, registry)
        seq_doc = read_doc(seq)
    except LOAD_ERRORS as e:
        _load_error(e, "text")
    console = Console(emoji=False, width=160)
    explicit = {e.output for e in dist_g.expectations}
    for o in seq_g.outputs:
        if o.name not in explicit:
            console.print(f"note: output {o.name!r} has no expectation in {dist}: the check only asks that it be "
                          "placed on every rank's copy in some standard way (Replicate, Shard, Partial or the mean), "
                          "so a bug the placement cannot tell (a loss scaled into a partial sum) can REFINE; the evaluation compares every rank's "
                          f"{o.name!r} (Replicate)", highlight=False, markup=False)

    def show(o: object) -> None:
        console.print(f"{o.kind:10} {o.verdict:16} {o.mutant.name}", highlight=False, markup=False)  # type: ignore[attr-defined]

    outcomes = run(seq_g, dist_g, doc, registry, count, seed, list(operators) or None, show, evaluate=not no_eval,
                   seq_doc=seq_doc)
    table = Table(title=f"{len(outcomes)} mutants of {dist} (seed {seed})")
    for col in ("mutant", "verdict", "numerically wrong?", "outcome", "culprit"):
        table.add_column(col)
    for o in outcomes:
        wrong = "?" if o.wrong is None else ("yes" if o.wrong else "no")
        table.add_row(o.mutant.name, o.verdict, wrong, o.kind, o.culprit)
    console.print(table)
    counts = Counter(o.kind for o in outcomes)
    kinds = ("caught", "refused", "neutral", "incomplete", "missed", "UNSOUND", "crashed", "timeout", "unjudged")
    console.print(", ".join(f"{k}: {counts[k]}" for k in kinds))
    sys.exit(1 if counts["UNSOUND"] or counts["crashed"] else 0)


LOAD_ERRORS = (InputError, FileNotFoundError, ImportError, ValueError)  # a case that cannot be loaded


def _load_error(e: Exception, fmt: str) -> NoReturn:
    """Exit 2 with the loader's message (an InputError names the file, place and reason)."""
    _bad_input(str(e) if isinstance(e, InputError) else f"{type(e).__name__}: {e}", fmt)


def _bad_input(message: str, fmt: str) -> NoReturn:
    if fmt == "json":
        import json

        click.echo(json.dumps({"verdict": "BAD INPUT", "error": message}))
    else:
        click.echo(f"error: {message}", err=True)
    sys.exit(2)


if __name__ == "__main__":
    main()
