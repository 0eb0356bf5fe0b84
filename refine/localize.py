"""Localization: which sequential node is the bug, and the smallest subgraph around it."""

from __future__ import annotations

from refine.ir import Graph
from refine.opset import Registry
from refine.prove import Inference
from refine.relate import DistProgram
from refine.report import Culprit, OutputResult


def localize(seq: Graph, core: Graph, results: list[OutputResult], inf: Inference, prog: DistProgram,
             registry: Registry) -> Culprit:
    """The first sequential node, in topological order, with no clean relation among the
    ancestors of a failing output; else the node producing the failing output."""
    order = {n.name: i for i, n in enumerate(core.nodes)}
    failing = [r for r in results if not r.ok]
    refs = {o.name: o.ref for o in core.outputs}
    ancestors: set[str] = set()
    for r in failing:
        ancestors |= _ancestors(core, refs[r.name])
    unclean = sorted((n for n in ancestors if n in order and not inf.clean.get(n, True)), key=order.get)
    first = failing[0]
    if unclean:
        node = core.index()[unclean[0]]
        reason = "no clean relation: no expression over rank tensors built from concat/slice/sum/scale/views equals it"
    else:
        target = min((refs[r.name] for r in failing), key=lambda n: order.get(n, -1))
        first = next(r for r in failing if refs[r.name] == target)
        node = core.index().get(target)
        reason = (f"the sequential value of output {first.name!r} is {first.relation} over rank tensors, "
                  f"but the rank outputs do not hold it: {first.detail} (expectation: {first.expectation})")
        if node is None:  # the output is an input of the sequential graph
            return Culprit(target, "input", None, None, [], [], first.relation, reason, first.name)
    user = node.origin or node.name
    user_node = next((n for n in seq.nodes if n.name == user), None)
    inputs = [(a, str(inf.relations[a])) for a in node.tensor_args()]
    leaves: set[str] = set()
    for a in node.tensor_args():
        leaves |= inf.relations[a].leaves()
    rank_nodes = []
    for x in sorted(leaves):
        for u in prog.users.get(x, []):
            n = prog.nodes.get(u)
            if n is not None:
                rank_nodes.append(f"{u}: {n.op}({', '.join(n.tensor_args())}) [{n.origin or n.name}]"
                                  + (f" at {n.source}" if n.source else ""))
    if not unclean:
        # every relation is clean, so the rank program computes a wrong value in the open: show
        # the rank nodes that produce the failing output (a collective with the wrong reduce op, say)
        for key, tensor in sorted(prog.outputs.items()):
            n = prog.nodes.get(tensor)
            if key.rpartition("@")[0] == first.name and n is not None:
                rank_nodes.append(f"{tensor}: {n.op}({', '.join(n.tensor_args())}) [{n.origin or n.name}]"
                                  + (f" at {n.source}" if n.source else "") + f", computes {key}")
    return Culprit(user, user_node.op if user_node else node.op, node.source, node.name, inputs,
                   sorted(set(rank_nodes)), str(inf.relations.get(node.name, "")), reason, first.name)


def _ancestors(g: Graph, ref: str) -> set[str]:
    idx = g.index()
    out: set[str] = set()
    stack = [ref]
    while stack:
        x = stack.pop()
        if x in out:
            continue
        out.add(x)
        n = idx.get(x)
        if n is not None and hasattr(n, "args"):
            stack.extend(n.tensor_args())  # type: ignore[union-attr]
    return out
