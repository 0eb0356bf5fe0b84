"""Localization: which sequential node is the bug, and the smallest subgraph around it."""

from __future__ import annotations

from fractions import Fraction

from refine.expr import Term
from refine.ir import Graph
from refine.opset import Registry
from refine.prove import Inference
from refine.relate import DistProgram
from refine.report import Culprit, OutputResult

UNCLEAN = "no clean relation: no expression over rank tensors built from concat/slice/sum/scale/views equals it"


def localize(seq: Graph, core: Graph, results: list[OutputResult], inf: Inference, prog: DistProgram,
             registry: Registry) -> Culprit:
    """Among the ancestors of a failing output: the first node whose input is a partial sum
    some rank uses in a way not linear in its pieces (a bias added to a partial sum before
    the reduction, say); else the first node, in topological order, with no clean
    relation; else the node producing the output.

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
        reason = (f"a rank uses a piece of a partial sum in a way that is not linear in it ({rank_node}: "
                  f"{prog.nodes[rank_node].op}{at}): the op runs before the pieces are summed; this node's "
                  f"input is that sum, {', '.join(str(inf.relations[a]) for a in node.tensor_args())}")
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
    if not unclean:
        # every relation is clean, so the rank program computes a wrong value in the open: show
        # the rank nodes that produce the failing output (a collective with the wrong reduce op, say)
        for key, tensor in sorted(prog.outputs.items()):
            n = prog.nodes.get(tensor)
            if key.rpartition("@")[0] == first.name and n is not None:
                rank_nodes.append(f"{tensor}: {n.op}({', '.join(n.tensor_args())}) [{n.origin or n.name}]"
                                  + (f" at {n.source}" if n.source else "") + f", computes {key}")
    return Culprit(user, user_node.op if user_node else node.op, node.source, node.name, inputs,
                   sorted(set(rank_nodes)), str(inf.relations.get(node.name, "")), reason, first.name,
                   rank_node, rank_source)


def _misplaced(core: Graph, inf: Inference, prog: DistProgram, registry: Registry,
               candidates: set[str]) -> dict[str, str]:
    """Rank nodes (outside collectives) that use a piece of a partial sum in a way that is
    not linear in it (`Op.linear`): a bias added to a partial product before the
    reduction, a gelu before the all-reduce, two partial sums multiplied. A piece is a
    rank tensor summed with its twins of other ranks in the clean relation of a sequential
    tensor among `candidates`; a rank node that makes a piece itself (a bias halved on every rank
    before the sum) is fine. Each is reported at the sequential node that uses the
    summed tensor (preferably one with the rank node's op): sequential node -> rank node."""
    find = prog.same.find
    order = {n.name: i for i, n in enumerate(core.nodes)}
    pieces: dict[str, str] = {}  # rank piece -> the sequential tensor whose relation sums it
    held: set[str] = set()  # every rank tensor of a clean relation
    for name, rel in inf.relations.items():
        if not inf.clean.get(name, False):
            continue
        held |= {find(x) for x in rel.leaves()}
        if rel.op != "Sum" or name not in candidates:
            continue
        # the partial terms: one tensor of the rank programs summed over several ranks (a
        # term held once is a whole tensor added to the sum, a replicated bias, say)
        by_base: dict[str, list[str]] = {}
        for a in rel.args:
            t = a.args[0] if a.op == "Scale" else a
            if t.op == "D":
                by_base.setdefault(t.attrs[0].rpartition("@")[0], []).append(t.attrs[0])
        for group in by_base.values():
            if len(group) > 1:
                for x in group:
                    pieces.setdefault(find(x), name)
    users = core.users()
    out: dict[str, str] = {}
    for u, d in prog.defs.items():
        rn = prog.nodes.get(u)
        if d is None or rn is None or registry.ops[rn.op].kind == "collective" or find(u) in held:
            continue
        flags = [a.op == "D" and find(a.attrs[0]) in pieces for a in d.args]
        if not any(flags) or not _breaks_partial(registry.ops[d.op].linear, flags):
            continue
        summed = pieces[find(next(a for a, f in zip(d.args, flags, strict=True) if f).attrs[0])]
        near = sorted((n for n in users.get(summed, []) if n.name in candidates), key=lambda n: order[n.name])
        if not near:
            continue
        at = next((n for n in near if n.op == d.op), near[0])
        if d.op == "Sum" and not _overcounted(prog, u, d, pieces, inf.relations[at.name]):
            continue  # the whole terms are counted as often as the sequential sum has them
        if at.name not in out or order.get(u, 0) < order.get(out[at.name], 0):
            out.setdefault(at.name, u)
    return out


def _overcounted(prog: DistProgram, u: str, d: Term, pieces: dict[str, str], rel: Term) -> bool:
    """Whether the whole (non-piece) terms rank tensor `u` adds to a piece are counted, over
    the ranks that add them the same way, more or less often than the sequential relation
    `rel` has them: a bias added on every rank before the sum is counted once per rank
    where the sequence has it once; a bias halved on each of two ranks, or a term one rank
    alone adds (the replicated gradients' squares in a norm), is counted right."""
    find = prog.same.find
    want: dict[str, Fraction] = {}
    for a in rel.args if rel.op == "Sum" else (rel,):
        t, c = (a.args[0], Fraction(a.attrs[0])) if a.op == "Scale" else (a, Fraction(1))
        if t.op == "D":
            want[find(t.attrs[0])] = want.get(find(t.attrs[0]), Fraction(0)) + c
    for a in d.args:
        x = find(a.attrs[0]) if a.op == "D" else None
        if x is None or x in pieces:
            continue
        adders = {v.rpartition("@")[2] for y in prog.same.group(x) for v in prog.users.get(y, [])
                  if (dv := prog.defs.get(v)) is not None and dv.op == d.op
                  and any(b.op == "D" and find(b.attrs[0]) in pieces for b in dv.args)}
        # one rank adding a whole term is how a sum over ranks takes it once (rank 0 adds the
        # bias); several ranks must add it as often as the sequential sum has it
        if len(adders) > 1 and len(adders) != want.get(x, Fraction(0)):
            return True
    return False


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
