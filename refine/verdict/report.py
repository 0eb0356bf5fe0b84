"""Verdicts: the data a check produces, printed with rich or as JSON."""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from refine.ops.schedule import Stuck


@dataclass
class OutputResult:
    name: str
    role: str
    relation: str  # the inferred relation of the sequential output, over rank tensors
    clean: bool
    expectation: str
    ok: bool
    detail: str = ""
    local: str | None = None  # the rank output it is expected at, when the expectation names one
    # whether the check compares a computation: the sequential output, or the rank outputs it
    # is compared with, depends on one; else both pass inputs through (a view, a copy)
    computed: bool = True


@dataclass
class Culprit:
    """Where the distributed program stops computing what the sequential one does."""

    node: str  # the user's sequential node
    op: str
    source: str | None
    core_node: str | None
    inputs: list[tuple[str, str]]  # the node's inputs and their relations
    rank_nodes: list[str]  # rank nodes that consume the tensors those relations use
    relation: str  # the best (unclean) expression found for the node
    reason: str
    output: str  # the failing output that led here
    rank_node: str | None = None  # the rank node that went wrong, when one is known
    rank_source: str | None = None  # its source line
    seq_source: str | None = None  # the sequential node's own line, when `source` is the rank line at fault


@dataclass
class Report:
    refines: bool
    outputs: list[OutputResult]
    culprit: Culprit | None = None
    guesses: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    symbols: list[str] = field(default_factory=list)  # e.g. "T: multiple of 2, >= 1": the verdict holds for all
    deadlock: list[Stuck] = field(default_factory=list)  # the ranks' program order cannot run to the end
    # extra rules or ops used without verification (--trust-rules): the verdict assumes them sound
    unverified_rules: list[str] = field(default_factory=list)
    # refine check --numeric: per-output errors in a low-precision format (refine.oracle.precision), a warning
    # apart from the verdict; None when not asked for
    numerics: dict[str, Any] | None = None

    @property
    def exit_code(self) -> int:
        return 0 if self.refines else 1

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": "REFINES" if self.refines else "DOES NOT REFINE", **asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        console = Console(record=True, width=120, force_terminal=False, file=io.StringIO(), emoji=False)
        print_report(self, console)
        return console.export_text()


def print_report(r: Report, console: Console | None = None, strategies: bool = False) -> None:
    """`strategies`: with the table of the prover's search strategies (refine check --stats)."""
    console = console or Console(emoji=False)
    table = Table(title="sequential outputs", show_lines=False)
    for col in ("output", "role", "relation over rank tensors", "expectation", "ok"):
        table.add_column(col, overflow="fold")
    for o in r.outputs:
        table.add_row(escape(o.name), o.role, escape(o.relation),
                      escape(o.expectation + (f"\n{o.detail}" if o.detail else "")),
                      "[green]yes[/]" if o.ok else "[red]no[/]")
    console.print(table)
    passed = [o.name for o in r.outputs if not o.computed]
    if passed:
        console.print(f"[yellow]passed through[/] {escape(', '.join(passed))}: an input, or a view or copy of one, on "
                      f"both sides (a check of how the inputs are placed only); {len(r.outputs) - len(passed)} of "
                      f"{len(r.outputs)} outputs check a computation")
    for g in r.guesses:
        console.print(f"[yellow]guessed relation[/] {escape(g)}")
    if r.symbols:
        console.print(f"[cyan]for every value of[/] {escape('; '.join(r.symbols))}")
    if r.unverified_rules:
        console.print("[bold yellow]unverified rules used[/] (--trust-rules: the verdict holds only if they are "
                      "sound): " + escape("; ".join(r.unverified_rules)))
    if r.refines:
        console.print(Panel("[bold green]REFINES[/]: every output relates to the rank outputs as expected"))
    else:
        c = r.culprit
        lines = ["[bold red]DOES NOT REFINE[/]"]
        if r.deadlock:
            lines.append("the ranks deadlock: each waits at a communication op that a partner never reaches "
                         "(collectives, sends and receives block until every partner reaches the matching op)")
            lines += [f"rank {s.rank} waits at {s.waits_at}" + (f" at {s.source}" if s.source else "")
                      + f" for {s.because}" for s in r.deadlock]
        if c is not None:
            where = f" at {c.seq_source or c.source}" if c.seq_source or c.source else ""
            lines += [f"first sequential node that does not refine: {c.node} ({c.op}){where}",
                      *([f"the bug's line (rank program): {c.source}"] if c.seq_source else []),
                      f"reason: {c.reason}", f"failing output: {c.output}"]
            if c.rank_node:
                lines.append(f"rank node where it goes wrong: {c.rank_node}"
                             + (f" at {c.rank_source}" if c.rank_source else ""))
            lines.append("inputs and their relations:")
            lines += [f"  {name} = {rel}" for name, rel in c.inputs]
            if c.relation:
                lines.append(f"best expression found for it: {c.relation}")
            if c.rank_nodes:
                lines.append("rank nodes consuming those tensors:")
                lines += [f"  {x}" for x in c.rank_nodes[:24]]
                if len(c.rank_nodes) > 24:
                    lines.append(f"  ... {len(c.rank_nodes) - 24} more")
        console.print(Panel("\n".join(lines[:1] + [escape(x) for x in lines[1:]])))
    if r.stats.get("bounded") and not r.refines:
        console.print(f"[yellow]search cut short[/]: {r.stats['bounded']} e-graph step(s) stopped at the e-graph "
                      "budget (refine.prove.engine.NODE_BUDGET, MATCH_BUDGET) with the best term found so far; a proof "
                      "may exist that the search did not reach")
    s = r.stats
    if s:
        console.print(f"[dim]{s.get('seq_nodes')} sequential nodes, {s.get('rank_nodes')} rank nodes on "
                      f"{s.get('ranks')} ranks, {s.get('steps')} e-graph steps, {s.get('replayed', 0)} replayed, {s.get('seconds')} s[/]")
    if strategies and s.get("strategies"):
        table = Table(title="search strategies (refine.prove.policy)", show_lines=False)
        for col in ("strategy", "ran on nodes", "kept"):
            table.add_column(col, justify="left" if col == "strategy" else "right")
        for name, n in s["strategies"].items():
            table.add_row(name, str(n["ran"]), str(n["kept"]))
        console.print(table)
