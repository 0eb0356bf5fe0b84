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


def _bad_input(message: str, fmt: str) -> None:
    if fmt == "json":
        import json

        click.echo(json.dumps({"verdict": "BAD INPUT", "error": message}))
    else:
        click.echo(f"error: {message}", err=True)
    sys.exit(2)


if __name__ == "__main__":
    main()
