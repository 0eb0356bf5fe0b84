"""`refine` command line. Exit codes: 0 refines, 1 does not refine, 2 bad input/unsupported."""

from __future__ import annotations

import sys

import click
from rich.console import Console

from refine.format import InputError


@click.group()
def main() -> None:
    """Prove a distributed training step refines its sequential model, or find where not."""


@main.command("check")
@click.argument("seq")
@click.argument("dist")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
@click.option("--rules", "rules", multiple=True, type=click.Path(file_okay=False),
              help="a directory of extra rule files (repeatable)")
def check_cmd(seq: str, dist: str, fmt: str, rules: tuple[str, ...]) -> None:
    """Check that DIST (per-rank graphs) refines SEQ (the sequential graph)."""
    from refine.check import check_files
    from refine.report import print_report

    try:
        report = check_files(seq, dist, rules)
    except InputError as e:
        _bad_input(str(e), fmt)
        return
    except (FileNotFoundError, ImportError, ValueError) as e:
        _bad_input(f"{type(e).__name__}: {e}", fmt)
        return
    if fmt == "json":
        click.echo(report.to_json())
    else:
        print_report(report, Console())
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
    from refine.capture import CaptureError, Case, capture, load_target

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
    from refine.report import print_report

    try:
        report = case.check()
    except InputError as e:
        _bad_input(str(e), "text")
        return
    print_report(report, Console())
    sys.exit(report.exit_code)


def _bad_input(message: str, fmt: str) -> None:
    if fmt == "json":
        import json

        click.echo(json.dumps({"verdict": "BAD INPUT", "error": message}))
    else:
        click.echo(f"error: {message}", err=True)
    sys.exit(2)


if __name__ == "__main__":
    main()
