"""Localization: which sequential node is the bug, and the smallest subgraph around it."""

from __future__ import annotations

from refine.ir import Graph
from refine.opset import Registry
from refine.prove import Inference, is_constant
from refine.relate import DistProgram
from refine.report import Culprit, OutputResult

UNCLEAN = "no clean relation: no expression over rank tensors built from concat/slice/sum/scale/views equals it"


def localize(seq: Graph, core: Graph, results: list[OutputResult], inf: Inference, prog: DistProgram,
             registry: Registry) -> Culprit:
    """Among the ancestors of a failing output: the first node where a rank applies the
    node's op to pieces of its inputs and makes something that is no part of the node's
    value (a bias added to a partial sum before the reduction, say); else the first node,
    in topological order, with no clean relation; else the node producing the output.

    The first rule matters because such a misplaced op often leaves a clean relation (the
    bias plus the sum of partials is still a sum of rank tensors) that no rank holds; the
    relations stay clean until the next non-linear op, which is not where the bug is."""
    order = {n.name: i for i, n in enumerate(core.nodes)}
    failing = [r for r in results if not r.ok]
    refs = {o.name: o.ref for o in core.outputs}
    ancestors: set[str] = set()
    for r in failing:
        ancestors |= _ancestors(core, refs[r.name])
    unclean = sorted((n for n in ancestors if n in order and not inf.clean.get(n, True)), key=order.get)
    first = failing[0]
    limit = order[unclean[0]] if unclean else max(order.get(refs[r.name], -1) for r in failing)
    rank_node = rank_source = None
    misplaced = _misplaced(core, inf, prog, registry, {n for n in ancestors if order.get(n, limit + 1) <= limit})
    if misplaced:
        name = min(misplaced, key=order.get)  # type: ignore[arg-type]
        node = core.index()[name]
        rank_node = misplaced[name]
        rank_source = prog.nodes[rank_node].source
        at = f" at {rank_source}" if rank_source else ""
        reason = (f"a rank applies this op ({node.op}) to pieces of a partial sum, but what it makes ({rank_node}{at}) "
                  f"is no part of the sequential value {inf.relations[name]}: the op runs before the pieces "
                  "are summed")
        first = next((r for r in failing if name in _ancestors(core, refs[r.name])), first)
    elif unclean:
        node = core.index()[unclean[0]]
        reason = UNCLEAN
    else:
        target = min((refs[r.name] for r in failing), key=lambda n: order.get(n, -1))
        first = next(r for r in failing if refs[r.name] == target)
        node = core.index().get(target)
        reason = (f"the sequential value of output {first.name!r} is {first.relation} over rank tensors, "
                  f"but the rank outputs do not hold it: {first.detail} (expectation: {first.expectation})")
        # the rank program's own output is where it goes wrong (a reduction with the wrong
        # op or group, a missing one): name the rank node that makes it
        made = next((t for k, t in sorted(prog.outputs.items()) if k.rpartition("@")[0] == first.local), None)
        if made is not None and made in prog.nodes:
            rank_node, rank_source = made, prog.nodes[made].source
        if node is None:  # the output is an input of the sequential graph
            return Culprit(target, "input", None, None, [], [], first.relation, reason, first.name,
                           rank_node, rank_source)
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
    return Culprit(user, user_node.op if user_node else node.op, node.source, node.name, inputs,
                   sorted(set(rank_nodes)), str(inf.relations.get(node.name, "")), reason, first.name,
                   rank_node, rank_source)


def _misplaced(core: Graph, inf: Inference, prog: DistProgram, registry: Registry,
               candidates: set[str]) -> dict[str, str]:
    """Sequential nodes (among `candidates`, with a clean relation no rank tensor was found
    to hold) whose op some rank applies, outside a collective, to the pieces of an input
    that is a partial sum in a way that is not linear in them (`Op.linear`): a bias added
    to a partial sum, a gelu before the all-reduce, two partial sums multiplied. The
    tensor it makes must be neither the node's value nor a part of its relation (the
    relation is cleanly found, so no rank may have computed it another way)."""
    find = prog.same.find
    out: dict[str, str] = {}
    for n in core.nodes:
        if n.name not in candidates or not inf.clean.get(n.name, False) or n.name not in inf.steps:
            continue
        if inf.steps[n.name].found:
            continue
        partial: set[str] = set()  # the rank pieces of the inputs that are partial sums
        ins: set[str] = set()  # the rank tensors of every input's relation
        for a in n.tensor_args():
            leaves = {find(x) for x in inf.relations[a].leaves()}
            ins |= leaves
            if inf.relations[a].op == "Sum":
                partial |= leaves
        held = {find(x) for x in inf.relations[n.name].leaves()}
        for x in sorted(partial):
            for y in prog.same.group(x):
                for u in prog.users.get(y, []):
                    d, rn = prog.defs.get(u), prog.nodes.get(u)
                    if d is None or rn is None or d.op != n.op or registry.ops[rn.op].kind == "collective":
                        continue
                    if find(u) in held or not all(find(z) in ins or is_constant(prog, z) for z in d.leaves()):
                        continue
                    if _breaks_partial(registry.ops[d.op].linear, [a.op == "D" and find(a.attrs[0]) in partial
                                                                   for a in d.args]):
                        out.setdefault(n.name, u)
    return out


def _breaks_partial(linear: str, is_piece: list[bool]) -> bool:
    """Whether an op applied to these arguments (True: a piece of a partial sum) makes
    something other than a piece of its value on the whole sum."""
    k = sum(is_piece)
    if k == 0:
        return False
    if linear == "joint":  # Sum, cat: pieces combine with pieces only
        return k < len(is_piece)
    if linear == "each":  # a product: one partial factor at a time
        return k > 1
    if linear == "first":
        return k > 1 or not is_piece[0]
    return True


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
