"""Verdicts: the data a check produces, printed with rich or as JSON.

`refine check --format json` prints `Report.to_dict()`: `verdict` (`REFINES`, `DOES NOT
REFINE`, `UNPROVEN`, or `BAD INPUT` with `error`), `outputs` (per output its relation,
expectation, `ok`, `computed`), `culprit` (`node`, `op`, `source`, `rank_node`,
`rank_source`, `seq_source`, `reason`, `divergence`, ...), `search` (`tries`, `agreed`,
`counterexample` with `seed`, `sizes` and per-output `abs_err`, `rel_err`), `guesses`,
`symbols`, `deadlock`, `unverified_rules`, `numerics` (`null` without `--numeric`) and
`stats` (`stats.strategies`: what `--stats` prints); `BAD INPUT` is written by refine.cli.
From Python: `report = refine.check_files("seq.json", "dist.json")`; `report.verdict`,
`report.exit_code`, `report.culprit`, `report.search`, `str(report)`.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from refine.ops.schedule import Stuck

if TYPE_CHECKING:  # torch is imported only when a search runs
    from refine.verdict.counterexample import Divergence, Search

REFINES, DOES_NOT_REFINE, UNPROVEN = "REFINES", "DOES NOT REFINE", "UNPROVEN"
EXIT_CODES = {REFINES: 0, DOES_NOT_REFINE: 1, UNPROVEN: 3}  # 2: bad input or unsupported (refine.cli)


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
    # where the counterexample shows the ranks going wrong first (refine.verdict.counterexample)
    divergence: Divergence | None = None


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
    # when the proof stopped: the counterexample search (refine.verdict.counterexample)
    search: Search | None = None

    @property
    def verdict(self) -> str:
        """REFINES (a proof), DOES NOT REFINE (a counterexample, or ranks that deadlock) or
        UNPROVEN (neither)."""
        if self.refines:
            return REFINES
        if self.deadlock or (self.search is not None and self.search.found is not None):
            return DOES_NOT_REFINE
        return UNPROVEN

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["search"] = self.search.to_dict() if self.search is not None else None
        return {"verdict": self.verdict, **d}

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
        unproven = r.verdict == UNPROVEN
        lines = ["[bold yellow]UNPROVEN[/]: no proof, and no counterexample found" if unproven
                 else "[bold red]DOES NOT REFINE[/]"]
        if r.deadlock:
            lines.append("the ranks deadlock: each waits at a communication op that a partner never reaches "
                         "(collectives, sends and receives block until every partner reaches the matching op)")
            lines += [f"rank {s.rank} waits at {s.waits_at}" + (f" at {s.source}" if s.source else "")
                      + f" for {s.because}" for s in r.deadlock]
        lines += _search_lines(r.search)
        if c is not None:
            where = f" at {c.seq_source or c.source}" if c.seq_source or c.source else ""
            lines += [f"{'the proof stopped at' if unproven else 'first sequential node that does not refine'}: "
                      f"{c.node} ({c.op}){where}",
                      *([f"the bug's line (rank program): {c.source}"] if c.seq_source else []),
                      f"reason: {c.reason}", f"failing output: {c.output}"]
            if c.rank_node:
                lines.append(f"rank node where it goes wrong: {c.rank_node}"
                             + (f" at {c.rank_source}" if c.rank_source else ""))
            if c.divergence is not None:
                lines += _divergence_lines(c.divergence)
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


def _search_lines(search: Search | None) -> list[str]:
    """What the counterexample search found, or how much it tried."""
    if search is None:
        return []
    cex = search.found
    if cex is not None:
        at = f", sizes {', '.join(f'{k}={v}' for k, v in cex.sizes.items())}" if cex.sizes else ""
        if cex.reduced:  # refine.verdict.reduce: the programs at smaller sizes
            at += ", at reduced sizes " + ", ".join(
                f"{k}->{v}" if isinstance(v, int) else f"{k}->{'|'.join(map(str, sorted(set(v))))} (by role)"
                for k, v in sorted(cex.reduced.items()))
        out = [f"counterexample: random inputs consistent with the input relations (seed {cex.seed}{at}) on which "
               "the outputs differ:"]
        if cex.mixed:  # refine.ops.special: the values the programs compare the integer inputs with
            out.insert(1, "  integer inputs drawn partly from the values the programs compare them with: "
                       + "; ".join(f"{k}: {', '.join(map(str, v))}" for k, v in sorted(cex.mixed.items())))
        out += [f"  {o.output}: max abs error {o.abs_err:.3g}, max rel error {o.rel_err:.3g} against {o.expectation}"
                for o in cex.failing()]
        return out
    if search.skipped:
        return [f"no counterexample search: {search.skipped}"]
    out = [f"the outputs agreed on {search.agreed} random input(s) consistent with the input relations"]
    if search.unchecked:
        out.append(f"not compared (no expectation, not made by every rank): {', '.join(search.unchecked)}")
    return out


def _divergence_lines(d: Divergence) -> list[str]:
    at = f" at {d.source}" if d.source else ""
    others = "".join(f" (rank {r}: {n})" for r, n in sorted(d.names.items()) if n != d.rank_node)
    others += f" (with {', '.join(d.also)}, of the same line)" if d.also else ""
    if d.held is not None:
        out = [f"on the counterexample, the first rank value that is wrong: {d.rank_node} ({d.op}){at}{others} on "
               f"rank(s) {', '.join(map(str, d.ranks))}: it holds {d.seq_node} {d.held}, and had it held it "
               f"{d.placement}, every output would be right: a collective is missing after it"]
    else:
        out = [f"on the counterexample, the first rank value that is wrong: {d.rank_node} ({d.op}){at}{others} on "
               f"rank(s) {', '.join(map(str, d.ranks))}: it holds no sequential value, and had it held {d.seq_node} "
               f"{d.placement}, every output would be right"]
    if d.chain:
        out.append("computed from rank values that hold no sequential tensor (where a wrong offset, mask or "
                   "layout may sit): " + ", ".join(f"{n}" + (f" at {s}" if s else "") for n, s in d.chain[:12])
                   + (f", ... {len(d.chain) - 12} more" if len(d.chain) > 12 else ""))
    return out
