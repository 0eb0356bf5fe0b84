"""Pictures of a verdict: the localized subgraph around the culprit, and a relations table.

`culprit_graph(report)` builds a small `networkx.DiGraph` from a `Report`: the culprit
sequential node, its inputs (each with its relation over rank tensors), the rank tensors
those relations use, and the rank nodes that consume them. Given the `seq.json` /
`dist.json` paths it recomputes the rank side from the distributed program instead of
parsing the report's strings, and adds one hop downstream (e.g. the collective that sums
a wrongly placed bias twice). `draw` renders it with matplotlib; `relations_table`
returns an HTML table that Jupyter displays.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import networkx as nx

from refine.verdict.report import Culprit, Report

if TYPE_CHECKING:
    from matplotlib.axes import Axes

# A rank tensor in a printed relation: `name@rank`, as the layout language spells it.
RANK_TENSOR = re.compile(r"[A-Za-z_][\w.]*@\d+")
# A `Culprit.rank_nodes` entry: "tensor@rank: op(args) [origin] at source".
_RANK_NODE = re.compile(
    r"^(?P<tensor>\S+?@(?P<rank>\d+)): (?P<op>[^(\s]+)\((?P<args>.*?)\)"
    r"(?: \[(?P<origin>[^\]]*)\])?(?: at (?P<source>.+))?$")

# Node kinds of the culprit graph, and how `draw` shows them: (shape, face colour, legend).
STYLE: dict[str, tuple[str, str, str]] = {
    "seq_node": ("s", "#d62728", "sequential node (culprit)"),
    "seq_input": ("o", "#ff9f40", "its inputs (with relation)"),
    "rank_tensor": ("D", "#9ecae1", "rank tensors in the relations"),
    "rank_node": ("h", "#2ca02c", "rank nodes consuming them"),
    "rank_downstream": ("h", "#bcbd22", "rank nodes one hop further"),
}
# Edge kinds: (line style, colour).
EDGE_STYLE: dict[str, tuple[str, str]] = {
    "arg": ("solid", "#444444"),  # sequential input -> culprit
    "relation": ("dashed", "#1f77b4"),  # rank tensor -> the sequential input it relates to
    "consumes": ("solid", "#2ca02c"),  # rank tensor -> rank node using it
    "feeds": ("solid", "#bcbd22"),  # rank node -> downstream rank node
    "origin": ("dotted", "#d62728"),  # rank node -> the sequential node it was written for
}


@dataclass(frozen=True)
class RankNode:
    """One node of one rank's program, named by the tensor it defines (`name@rank`)."""

    tensor: str
    rank: int
    op: str
    args: tuple[str, ...]  # its arguments on its own rank (`name@rank`)
    origin: str | None = None  # the user's node it was lowered from
    source: str | None = None
    reads: tuple[str, ...] = ()  # every rank tensor it depends on (a collective reads all members)

    def label(self) -> str:
        local = ", ".join(a.rpartition("@")[0] or a for a in self.args)
        return f"{self.tensor}\n{self.op}({local})"


def parse_rank_node(text: str) -> RankNode:
    """A `Culprit.rank_nodes` string as structured data (args qualified with the rank)."""
    m = _RANK_NODE.match(text.strip())
    if m is None:  # unknown layout: keep what precedes the colon as the tensor
        tensor = text.split(":", 1)[0].strip()
        rank = tensor.rpartition("@")[2]
        return RankNode(tensor, int(rank) if rank.isdigit() else -1, "?", ())
    rank = int(m["rank"])
    args = tuple(f"{a.strip()}@{rank}" for a in m["args"].split(",") if a.strip())
    return RankNode(m["tensor"], rank, m["op"], args, m["origin"] or None, m["source"])


def rank_tensors(relation: str) -> list[str]:
    """The rank tensors a printed relation mentions, in order of first appearance."""
    return list(dict.fromkeys(RANK_TENSOR.findall(relation)))


@dataclass
class RankContext:
    """The rank side of the localized subgraph, recomputed from the distributed program."""

    consumers: list[RankNode]  # rank nodes reading the tensors the relations use
    producers: dict[str, RankNode]  # rank tensor -> the node defining it (absent for inputs)
    downstream: list[RankNode]  # rank nodes reading the consumers' outputs


def rank_context(report: Report, seq_path: str | Path, dist_path: str | Path,
                 rules: Iterable[str | Path] = ()) -> RankContext:
    """Reload the case and read the culprit's neighbourhood off the distributed program."""
    from refine.frontends.graphfile import load_dist, load_seq
    from refine.ops.registry import load_registry
    from refine.relate.program import build_program

    c = _culprit(report)
    registry = load_registry(rules)
    seq = load_seq(seq_path, registry)
    prog, _ = build_program(load_dist(dist_path, registry, seq), registry, str(dist_path))

    def node(t: str) -> RankNode | None:
        n = prog.nodes.get(t)
        if n is None:
            return None
        rank = int(t.rpartition("@")[2])
        d = prog.defs.get(t)
        reads = tuple(sorted(d.leaves())) if d is not None else ()
        return RankNode(t, rank, n.op, tuple(f"{a}@{rank}" for a in n.tensor_args()),
                        n.origin or n.name, n.source, reads)

    leaves = [t for _, rel in c.inputs for t in rank_tensors(rel)]
    producers = {t: n for t in leaves if (n := node(t)) is not None}
    consumers = _unique(n for t in leaves for u in prog.users.get(t, []) if (n := node(u)))
    seen = {n.tensor for n in consumers}
    downstream = _unique(n for c_ in consumers for u in prog.users.get(c_.tensor, [])
                         if u not in seen and (n := node(u)))
    return RankContext(consumers, producers, downstream)


def _unique(nodes: Iterable[RankNode]) -> list[RankNode]:
    return sorted({n.tensor: n for n in nodes}.values(), key=lambda n: (n.rank, n.tensor))


def _culprit(report: Report) -> Culprit:
    if report.culprit is None:
        raise ValueError("the report refines: there is no culprit to localize")
    return report.culprit


def culprit_graph(report: Report, seq_path: str | Path | None = None,
                  dist_path: str | Path | None = None) -> nx.DiGraph:
    """The localized subgraph (empty when the report refines).

    Node ids are prefixed by side (`seq:`, `in:`, `rank:`) so sequential and rank names
    never collide; every node has `kind`, `label` and `layer` (its column in `draw`),
    sequential inputs a `relation`, rank nodes `rank`/`op`/`args`/`origin`/`source`;
    every edge has a `kind` (see `EDGE_STYLE`). With both paths, the rank side comes from
    the distributed program (`rank_context`), else from parsing `Culprit.rank_nodes`.
    """
    g = nx.DiGraph()
    c = report.culprit
    if c is None:
        return g
    g.graph.update(node=c.node, op=c.op, source=c.source, reason=c.reason, output=c.output,
                   relation=c.relation)
    seq_id = f"seq:{c.node}"
    g.add_node(seq_id, kind="seq_node", layer=1, side="seq", label=f"{c.node}\n({c.op})",
               op=c.op, source=c.source, relation=c.relation)

    if seq_path is not None and dist_path is not None:
        ctx = rank_context(report, seq_path, dist_path)
    else:
        ctx = RankContext([parse_rank_node(s) for s in c.rank_nodes], {}, [])

    for name, rel in c.inputs:
        in_id = f"in:{name}"
        g.add_node(in_id, kind="seq_input", layer=0, side="seq", label=f"{name}\n= {_short(rel)}",
                   relation=rel)
        g.add_edge(in_id, seq_id, kind="arg")
        for t in rank_tensors(rel):
            prod = ctx.producers.get(t)
            label = t if prod is None else f"{t}\n{prod.op}"
            g.add_node(f"rank:{t}", kind="rank_tensor", layer=0, side="rank", label=label,
                       rank=int(t.rpartition("@")[2]), op=prod.op if prod else None,
                       source=prod.source if prod else None)
            g.add_edge(f"rank:{t}", in_id, kind="relation", relation=rel)

    for kind, layer, nodes in (("rank_node", 1, ctx.consumers), ("rank_downstream", 2, ctx.downstream)):
        for n in nodes:
            nid = f"rank:{n.tensor}"
            if nid in g:  # already drawn as a tensor some relation uses
                continue
            g.add_node(nid, kind=kind, layer=layer, side="rank", label=n.label(), rank=n.rank,
                       op=n.op, args=n.args, origin=n.origin, source=n.source)
            for a in n.reads or n.args:
                src = f"rank:{a}"
                if src in g:
                    g.add_edge(src, nid, kind="consumes" if kind == "rank_node" else "feeds")
            if n.origin == c.node:
                g.add_edge(nid, seq_id, kind="origin")
    return g


def _short(text: str, width: int = 38) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _positions(g: nx.DiGraph) -> dict[str, tuple[float, float]]:
    """Columns by `layer`; sequential nodes in the top band, rank nodes in the bottom one.
    Rank tensors sit left of the sequential inputs so the relation edges fan out visibly."""
    pos: dict[str, tuple[float, float]] = {}
    for side, top, shift in (("seq", 1.0, 0.0), ("rank", -0.5, -0.9)):
        for layer in sorted({d["layer"] for _, d in g.nodes(data=True)}):
            col = sorted((n for n, d in g.nodes(data=True) if d["side"] == side and d["layer"] == layer),
                         key=lambda n: (g.nodes[n].get("rank", 0), n))
            for i, n in enumerate(col):
                pos[n] = (layer * 2.0 + (shift if layer == 0 else 0.0), top - i * 0.6)
    return pos


def draw(report: Report, ax: Axes | None = None, seq_path: str | Path | None = None,
         dist_path: str | Path | None = None, graph: nx.DiGraph | None = None) -> Axes:
    """Draw the localized subgraph; returns the axes. A refining report gets a short note."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    g = graph if graph is not None else culprit_graph(report, seq_path, dist_path)
    pos = _positions(g)
    ys = [y for _, y in pos.values()] or [0.0]
    if ax is None:  # about 2.4 inches per unit of height keeps labels clear of each other
        _, ax = plt.subplots(figsize=(14, 2.5 + 2.4 * (max(ys) - min(ys))))
    ax.set_axis_off()
    c = report.culprit
    if c is None or g.number_of_nodes() == 0:
        ax.set_title("REFINES: nothing to localize", color="#2ca02c", fontweight="bold")
        return ax

    for kind, (style, color) in EDGE_STYLE.items():
        edges = [(u, v) for u, v, d in g.edges(data=True) if d["kind"] == kind]
        if edges:
            nx.draw_networkx_edges(g, pos, edgelist=edges, ax=ax, style=style, edge_color=color,
                                   arrows=True, arrowsize=14, node_size=1400,
                                   connectionstyle=f"arc3,rad={0.3 if kind == 'origin' else 0.06}")
    for kind, (shape, color, _) in STYLE.items():
        nodes = [n for n, d in g.nodes(data=True) if d["kind"] == kind]
        if nodes:
            nx.draw_networkx_nodes(g, pos, nodelist=nodes, ax=ax, node_shape=shape, node_color=color,
                                   node_size=1400 if kind == "seq_node" else 900,
                                   edgecolors="black", linewidths=0.8)
    for n, (x, y) in pos.items():
        above = g.nodes[n]["side"] == "seq"  # edges reach the sequential band from below
        ax.annotate(g.nodes[n]["label"], (x, y), xytext=(0, 22 if above else -24), textcoords="offset points",
                    ha="center", va="bottom" if above else "top", fontsize=8, family="monospace",
                    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.8})
    ax.margins(x=0.25, y=0.25)
    ax.set_ylim(min(ys) - 0.6, max(ys) + 0.5)

    where = f" at {c.source}" if c.source else ""
    stop = "proof stopped at" if report.verdict == "UNPROVEN" else "first failing node"
    ax.set_title(f"{report.verdict}: {stop} {c.node} ({c.op}){where}\n"
                 f"failing output {c.output!r}: {_short(c.relation, 90)}", fontsize=10, loc="left")
    kinds = {d["kind"] for _, d in g.nodes(data=True)}
    handles = [Line2D([], [], marker=shape, color="w", markerfacecolor=color, markeredgecolor="black",
                      markersize=10, label=text)
               for kind, (shape, color, text) in STYLE.items() if kind in kinds]
    handles += [Line2D([], [], linestyle=style, color=color, label=kind)
                for kind, (style, color) in EDGE_STYLE.items()
                if any(d["kind"] == kind for _, _, d in g.edges(data=True))]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return ax


class HTML(str):
    """HTML that Jupyter renders as HTML; `repr` (terminals, text/plain) shows a plain version."""

    text: str

    def __new__(cls, html_text: str, text: str = "") -> HTML:
        obj = super().__new__(cls, html_text)
        obj.text = text or html_text
        return obj

    def _repr_html_(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return self.text


def relations_table(report: Report) -> HTML:
    """Every output's relation and expectation, then the culprit inputs' relations."""
    rows: list[tuple[str, str, str, bool | None]] = [
        (f"output {o.name} ({o.role})", o.relation, o.expectation + (f"; {o.detail}" if o.detail else ""),
         o.ok) for o in report.outputs]
    c = report.culprit
    if c is not None:
        rows += [(f"input {name} of culprit {c.node}", rel, "", None) for name, rel in c.inputs]
        if c.relation:
            rows.append((f"culprit {c.node} ({c.op})", c.relation, c.reason, False))
    verdict = report.verdict
    heads = ("tensor", "relation over rank tensors", "expectation", "ok")
    ok = {True: '<span style="color:#2ca02c">yes</span>', False: '<b style="color:#d62728">no</b>', None: ""}
    e = html.escape
    body = "".join(f"<tr><td>{e(t)}</td><td><code>{e(r)}</code></td><td>{e(x)}</td><td>{ok[k]}</td></tr>"
                   for t, r, x, k in rows)
    head = "".join(f"<th style='text-align:left'>{h}</th>" for h in heads)
    table = (f"<table><caption style='text-align:left'><b>{verdict}</b></caption>"
             f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
    word = {True: "yes", False: "no", None: ""}
    text = "\n".join([verdict, " | ".join(heads)] + [f"{t} | {r} | {x} | {word[k]}" for t, r, x, k in rows])
    return HTML(table, text)
