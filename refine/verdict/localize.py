"""Localization: which sequential node is the bug, and the smallest subgraph around it.

`localize(...)` runs inside `refine.check` when an output fails, and its `Culprit` is the
report's. The culprit, among the ancestors of a failing output, in this order:

1. the first node whose op a rank applies to the pieces of a partial sum in a way that is not
   linear in them (each op declares `Op.linear`, which the suite checks numerically), making
   a tensor that is no part of the node's value: a bias added before the all-reduce, a gelu
   before the reduce-scatter, two partial sums multiplied; or a collective that sums copies
   of one tensor;
2. else the first node (topological order) with no clean relation, unless a failing output
   whose relation is clean comes before it: that output is proven wrong there (a loss over
   each rank's own tokens, before a backward pass the prover cannot follow). When a rank
   combines the tensors the node's inputs relate to with a received tensor (a pipeline
   `recv`) that is none of them, the rank node named is that `send`, with its line;
3. else the node that produces the failing output, and the rank node that makes the rank
   output (a reduction with the wrong op, say);
4. then, when every failing output is one constant `c != 1` times what its expectation
   wants, the wrong-constant search of `refine.verdict.factor` (after rule 3, and after rule
   2 too: a scale is a clean relation, so a wrong factor is carried along until an op where
   the scaled pieces no longer combine, far from where it entered); and when the node of
   rule 2 is over a fused value no rank holds (a global norm), the missing-reduction search
   of `refine.verdict.missing_reduce`, then `refine.verdict.terms`'s search for a term one
   rank sums into its piece of a reduction over ranks that it should not (a tied weight's
   squares counted on two pipeline stages). Each names the rank line at fault as `source`,
   `rank_node`, `rank_source`, and keeps the sequential node's own line as `seq_source`.

Fused nodes (`Op.fuse`) and carried nodes (a mask every rank computes only for its own
range, an intermediate the ranks only hold fused into its users) that a clean relation takes in are left out of the clean/unclean table, so
localization names their users. The report shows the node's source line, its inputs'
relations and the rank nodes that consume them; `refine.verdict.draw` turns the same data
into a picture.
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

from refine.ir.graph import Dist, Graph, Node, tensor_name
from refine.ir.term import Term
from refine.ops.lower import lower
from refine.ops.registry import Registry
from refine.prove.walk import Inference
from refine.relate.program import DistProgram
from refine.verdict.report import Culprit, OutputResult

UNCLEAN = "no clean relation: no expression over rank tensors built from concat/slice/sum/scale/views equals it"


def localize(seq: Graph, core: Graph, results: list[OutputResult], inf: Inference, prog: DistProgram,
             registry: Registry, dist: Dist | None = None) -> Culprit:
    """Among the ancestors of a failing output: the first node whose input is a partial sum
    some rank uses in a way not linear in its pieces (a bias added to a partial sum before
    the reduction, say); else the first node, in topological order, with no clean
    relation (unless a failing output with a clean relation comes first); else the node
    producing the output, and, when every failing output is off by
    one constant factor, the rank program line whose constant is wrong (`refine.verdict.factor`,
    found by evaluating edited rank programs: needs `dist`).

    The first rule matters because such a misplaced op often leaves a clean relation (the
    bias plus the sum of partials is still a sum of rank tensors) that no rank holds; the
    relations stay clean until the next non-linear op, which is not where the bug is."""
    order = {n.name: i for i, n in enumerate(core.nodes)}
    failing = [r for r in results if not r.ok]
    refs = {o.name: o.ref for o in core.outputs}
    ancestors: set[str] = set()
    for r in failing:
        ancestors |= core.ancestors(refs[r.name])
    unclean = sorted((n for n in ancestors if n in order and not inf.clean.get(n, True)), key=order.get)
    first = failing[0]
    limit = order[unclean[0]] if unclean else max(order.get(refs[r.name], -1) for r in failing)
    # a failing output whose relation is clean is proven wrong right there: when it comes before
    # every lost relation (a loss over the wrong tokens, then a backward pass the prover cannot
    # follow), the divergence is at that output, not at the later node with no clean relation
    proven_wrong = [order[refs[r.name]] for r in failing if refs[r.name] in order and inf.clean.get(refs[r.name], False)]
    if unclean and proven_wrong and min(proven_wrong) < limit:
        unclean, limit = [], min(proven_wrong)
    rank_node = rank_source = None
    wrong: tuple[str, str, str] | None = None
    region = {n for n in ancestors if order.get(n, limit + 1) <= limit}
    misplaced = _misplaced(core, inf, prog, registry, region)
    copies = None if misplaced else _copies_summed(core, inf, prog, registry, region)
    if misplaced or copies:
        if misplaced:
            name = min(misplaced, key=order.get)  # type: ignore[arg-type]
            rank_node = misplaced[name]
        else:
            name, rank_node = copies  # type: ignore[misc]
        node = core.index()[name]
        rank_source = prog.nodes[rank_node].source
        did = f"{rank_node}: {prog.nodes[rank_node].op}" + (f" at {rank_source}" if rank_source else "")
        if misplaced:
            reason = (f"a rank uses a piece of a partial sum in a way that is not linear in it ({did}): the op "
                      f"runs before the pieces are summed; this node's input is that sum, "
                      f"{', '.join(str(inf.relations[a]) for a in node.tensor_args())}")
        else:
            reason = (f"a collective sums copies of one tensor ({did}, over {prog.defs[rank_node]}): every rank "
                      f"holds a multiple of the value from here on, {inf.relations[name]}")
        first = next((r for r in failing if name in core.ancestors(refs[r.name])), first)
    elif unclean:
        node = core.index()[unclean[0]]
        reason = UNCLEAN
        sent = _wrong_message(node, inf, prog) or _wrong_slice(node, inf, prog)
        if sent is not None:
            rank_node, rank_source, why = sent
            reason += f"; {why}"
        elif dist is not None and any(registry.ops[core.index()[a].op].fuse for a in node.tensor_args()
                                      if isinstance(core.index().get(a), Node)):
            # over a fused value no rank holds (a global norm): a missing reduction shows
            # only in the values, so try adding one (refine.verdict.missing_reduce)
            missing = _missing_reduce(seq, dist, registry, failing)
            if missing is None:  # or pieces made on lines of their own, never summed
                missing = _held_apart(seq, dist, registry, failing, node, inf)
            if missing is None:  # or one rank sums a term it should not (refine.verdict.terms)
                missing = _wrong_term(seq, dist, registry, failing)
            if missing is not None:
                rank_node, rank_source, why = missing
                reason += f"; {why}"
                wrong = (rank_node, rank_source, why)
        if sent is None and wrong is None and dist is not None:
            # every failing output off by one constant: a scale is a clean relation, so the
            # relations carry the wrong factor on (1/2 * x@0) until an op where the scaled
            # pieces no longer combine, which is not where the factor entered; a single line
            # whose constant, edited, makes every output right is (rule 4)
            found = _wrong_factor(seq, dist, registry, failing, inf, prog)
            if found is not None:
                rank_node, rank_source, edit, lead = found
                reason += f"; {lead}, and the rank programs scale by a wrong constant at {rank_source}: {edit}"
                wrong = (rank_node, rank_source, edit)
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
        wrong = _wrong_factor(seq, dist, registry, failing, inf, prog) if dist is not None else None
        if wrong is not None:
            rank_node, rank_source, edit, lead = wrong
            reason = (f"{lead}, and the rank programs scale by a wrong "
                      f"constant at {rank_source}: {edit}. The sequential value of output {first.name!r} is "
                      f"{first.relation} over rank tensors, but the rank outputs do not hold it: {first.detail}")
        if not isinstance(node, Node):
            # the output is a sequential input, or lowers to one (x + 0.0, a copy): no core
            # node computes it, so name the user's node the output refers to, else the input
            own = seq.index().get(seq.output(first.name).ref)
            op, source = (own.op, own.source) if isinstance(own, Node) else ("input", None)
            return Culprit(own.name if own is not None else target, op, wrong[1] if wrong else source, None,
                           [(target, str(inf.relations.get(target, "")))], _makers(prog, first), first.relation,
                           reason, first.name, rank_node, rank_source, source if wrong else None)
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
        rank_nodes += _makers(prog, first)
    # a wrong constant is the rank line's bug: name that line, and keep the sequential node's own
    wrong_line = wrong[1] if wrong is not None else None
    return Culprit(user, user_node.op if user_node else node.op, wrong_line or node.source, node.name, inputs,
                   sorted(set(rank_nodes)), str(inf.relations.get(node.name, "")), reason, first.name,
                   rank_node, rank_source, node.source if wrong_line else None)


def _makers(prog: DistProgram, out: OutputResult) -> list[str]:
    """The rank nodes that produce the rank outputs named like the failing output."""
    made = []
    for key, tensor in sorted(prog.outputs.items()):
        n = prog.nodes.get(tensor)
        if key.rpartition("@")[0] == out.name and n is not None:
            made.append(f"{tensor}: {n.op}({', '.join(n.tensor_args())}) [{n.origin or n.name}]"
                        + (f" at {n.source}" if n.source else "") + f", computes {key}")
    return made


def _missing_reduce(seq: Graph, dist: Dist, registry: Registry,
                    failing: list[OutputResult]) -> tuple[str, str, str] | None:
    """`refine.verdict.missing_reduce.missing_reduce` for the failing outputs: (the rank node, its
    source line, what the edit was), or None."""
    from refine.verdict.missing_reduce import missing_reduce

    found = missing_reduce(seq, dist, registry, [r.name for r in failing])
    if found is None:
        return None
    made = tensor_name(found.rank, lower(dist.ranks[found.rank], registry)[1].get(found.node, found.node))
    what = (f"a SUM all-reduce over ranks {found.group} after {found.node}@{found.rank} ({made}) and the other "
            f"nodes of its line makes every output right on random inputs: the reduction is missing there")
    return made, found.source, what


def _held_apart(seq: Graph, dist: Dist, registry: Registry, failing: list[OutputResult], node: Node,
                inf: Inference) -> tuple[str, str, str] | None:
    """`refine.verdict.missing_reduce.held_apart` for each sum of one piece per rank in the
    node's input relations (the ranks' pieces of a tensor the sequence holds whole): (the
    first rank's piece as the checker names it, its line, what the edit showed), or None."""
    # runs rank programs: imports torch, only here
    from refine.verdict.missing_reduce import held_apart

    tried: list[dict[int, str]] = []
    for a in node.tensor_args():
        for t in _subterms(inf.relations[a]):
            if t.op != "Sum" or not all(x.op == "D" for x in t.args):
                continue
            pieces: dict[int, str] = {}
            for x in t.args:
                base, _, r = x.attrs[0].rpartition("@")
                pieces.setdefault(int(r), base)
            if len(pieces) != len(t.args) or len(pieces) < 2 or pieces in tried:
                continue  # one piece per rank only
            tried.append(pieces)
            found = held_apart(seq, dist, registry, [r.name for r in failing], pieces)
            if found is None:
                continue
            first = next((r for r in sorted(found.sources) if found.sources[r]), None)
            if first is None:
                return None
            held = ", ".join(f"{tensor_name(r, x)}" + (f" at {found.sources[r]}" if found.sources[r] else "")
                             for r, x in sorted(found.pieces.items()))
            what = (f"the ranks hold this value in pieces ({held}) that no collective sums: with each piece set to "
                    f"their sum every output is right on random inputs, so a SUM reduction over ranks "
                    f"{sorted(found.pieces)} is missing after them")
            return tensor_name(first, found.pieces[first]), found.sources[first], what  # type: ignore[return-value]
    return None


def _wrong_term(seq: Graph, dist: Dist, registry: Registry,
                failing: list[OutputResult]) -> tuple[str, str, str] | None:
    """`refine.verdict.terms.wrong_term` for the failing outputs: (the rank `Sum` node as the
    checker names it, its source line, what the edit showed), or None."""
    from refine.verdict.terms import wrong_term  # runs rank programs: imports torch, only here

    found = wrong_term(seq, dist, registry, [r.name for r in failing])
    if found is None:
        return None
    made = tensor_name(found.rank, found.sum)
    term = f"{found.term}@{found.rank}" + (f" (made at {found.term_source})" if found.term_source else "")
    if found.twin is None:
        twice = ""
    elif found.twin == (found.rank, found.term):
        twice = "; the sum takes that term twice: it is counted twice"
    else:
        twice = (f"; {found.twin[1]}@{found.twin[0]}, summed too, has the same value and the programs without it "
                 "are right as well: the value is counted twice")
    what = (f"rank {found.rank} sums the term {term} into its piece of the reduction over ranks "
            f"{found.reduction}@{found.rank}" + (f" at {found.reduction_source}" if found.reduction_source else "")
            + f"; the programs without that term make every output right on random inputs{twice}")
    return made, found.source, what


def _wrong_factor(seq: Graph, dist: Dist, registry: Registry, failing: list[OutputResult], inf: Inference,
                  prog: DistProgram) -> tuple[str, str, str, str] | None:
    """`refine.verdict.factor.wrong_factor` for the failing outputs: (the rank node as the
    checker names it, its source line, what the edit was, what was off), or None. A rank node
    the relations prove equal to a sequential tensor is right, so its line is not edited."""
    from refine.verdict.factor import wrong_factor  # runs rank programs: imports torch, only here

    find = prog.same.find
    renames: dict[int, dict[str, str]] = {}

    def core_name(r: int, name: str) -> str:
        if r not in renames:
            renames[r] = lower(dist.ranks[r], registry)[1]
        return tensor_name(r, renames[r].get(name, name))

    exact = {find(rel.attrs[0]) for n, rel in inf.relations.items() if rel.op == "D" and inf.clean.get(n, False)}
    names = [r.name for r in failing]
    found = wrong_factor(seq, dist, registry, names, proven=lambda r, name: find(core_name(r, name)) in exact)
    terms = found is None and (c := _term_factor(failing, core_refs(seq, registry), inf, prog)) is not None
    if terms:
        found = wrong_factor(seq, dist, registry, names, proven=lambda r, name: find(core_name(r, name)) in exact,
                             factor=c)
    if found is None or not found.source:
        return None
    made = core_name(found.rank, found.node)
    held = "the terms the ranks weight otherwise are" if terms else "the outputs are"
    what = (f"{found.node}@{found.rank} ({made}) and the other nodes of that line, edited ({found.edit}), make "
            f"every output right on random inputs, while {held} {found.factor} times what the ranks hold")
    lead = ("the terms that every failing output and the rank outputs weight differently are all off by one "
            "constant factor") if terms else "every failing output is off by one constant factor"
    if found.right:
        lead += (f" or, as {', '.join(found.right[:3])}{' ...' if len(found.right) > 3 else ''}, right on random "
                 "inputs to within the counterexample search's precision")
    return made, found.source, what, lead


def core_refs(seq: Graph, registry: Registry) -> dict[str, str]:
    """Each sequential output's core tensor."""
    core = lower(seq, registry)[0]
    return {o.name: o.ref for o in core.outputs}


def _linear(t: Term, prog: DistProgram, c: Fraction, out: dict[str, Fraction]) -> None:
    """The coefficient of each term of t read as a weighted sum (Sum and Scale, through the
    definitions of rank tensors that are sums or scales; anything else is one term).

    Coefficients flow down the sums' DAG in topological order, each part once all its
    sums' shares are in: a rank's chain of thousands of sums is a walk, not a recursion,
    and a tensor summed twice (x + x, again and again) is not expanded once per path."""

    def parts(x: Term) -> list[tuple[Term, Fraction]]:
        if x.op == "Scale":
            return [(x.args[0], Fraction(x.attrs[0]))]
        if x.op == "Sum":
            return [(a, Fraction(1)) for a in x.args]
        if x.op == "D" and (d := prog.defs.get(x.attrs[0])) is not None and d.op in ("Sum", "Scale"):
            return [(d, Fraction(1))]
        return []

    waiting: Counter[Term] = Counter()  # how many sums a part is in, counted over the DAG
    seen, todo = {t}, [t]
    while todo:
        for y, _ in parts(todo.pop()):
            waiting[y] += 1
            if y not in seen:
                seen.add(y)
                todo.append(y)
    coef, ready = {t: c}, [t]
    while ready:
        x = ready.pop()
        inner = parts(x)
        if not inner:
            key = prog.same.find(x.attrs[0]) if x.op == "D" else str(x.rename(prog.same.find))
            out[key] = out.get(key, Fraction(0)) + coef[x]
        for y, f in inner:
            coef[y] = coef.get(y, Fraction(0)) + coef[x] * f
            waiting[y] -= 1
            if waiting[y] == 0:
                ready.append(y)


def _term_factor(failing: list[OutputResult], refs: dict[str, str], inf: Inference,
                 prog: DistProgram) -> Fraction | None:
    """When each failing output's clean relation and the rank output expected to hold it are
    weighted sums of the same terms, and the terms whose weights differ are all off by one
    factor c (a loss adding micro-batch means where the sequential mean halves each, next to a
    term that is right): c. The rank line that scales those terms by a wrong constant is then
    found as for a wrong factor of the whole output (`refine.verdict.factor`)."""
    ratios: set[Fraction] = set()
    for r in failing:
        rel = inf.relations.get(refs.get(r.name, ""))
        if rel is None or not inf.clean.get(refs[r.name], False) or r.local is None:
            return None
        want: dict[str, Fraction] = {}
        _linear(rel, prog, Fraction(1), want)
        held = [t for k, t in sorted(prog.outputs.items()) if k.rpartition("@")[0] == r.local]
        if not held:
            return None
        for tensor in held:
            got: dict[str, Fraction] = {}
            _linear(Term("D", (), (tensor,)), prog, Fraction(1), got)
            if set(got) != set(want) or any(v == 0 for v in got.values()):
                return None
            ratios |= {want[k] / got[k] for k in want if want[k] != got[k]}
    return ratios.pop() if len(ratios) == 1 else None


def _wrong_message(node: Node, inf: Inference, prog: DistProgram) -> tuple[str, str | None, str] | None:
    """A rank node that combines the tensors the node's input relations name with a tensor
    received from another rank that is none of them: the sender sent the wrong tensor (a
    pipeline stage sending its output's gradient back instead of its input's, say). Returns
    the send node, its source and why."""
    leaves: set[str] = set()
    for a in node.tensor_args():
        leaves |= inf.relations[a].leaves()
    known = {prog.same.find(x) for x in leaves}
    for x in sorted(leaves):
        for u in prog.users.get(x, []):
            n = prog.nodes.get(u)
            if n is None:
                continue
            rank = u.rpartition("@")[2]
            for arg in n.tensor_args():
                got = f"{arg}@{rank}"
                recv = prog.nodes.get(got)
                d = prog.defs.get(got)
                if recv is None or recv.op != "recv" or d is None or d.op != "D" or prog.same.find(got) in known:
                    continue
                src = d.attrs[0]
                base, _, peer = src.rpartition("@")
                send = next((k for k, m in prog.nodes.items() if m.op == "send" and k.endswith(f"@{peer}")
                             and m.tensor_args() and m.tensor_args()[0] == base), None)
                if send is None:
                    continue
                where = prog.nodes[send].source
                return send, where, (f"rank {rank} uses them with {got}, received from rank {peer} "
                                     f"({send}{' at ' + where if where else ''} sends {src}), which is none of "
                                     "the tensors the sequential inputs relate to")
    return None


def _wrong_slice(node: Node, inf: Inference, prog: DistProgram) -> tuple[str, str | None, str] | None:
    """A rank node that slices a tensor the node's input relations slice, as long a piece
    along the same dim but at other offsets, while no rank takes the piece the relation
    names: the rank reads the wrong part of it (an offset off by a flat buffer's padding,
    by a shard). Returns that rank node, its source and why."""
    wanted: list[Term] = []
    for a in node.tensor_args():
        wanted += [t for t in _subterms(inf.relations[a]) if t.op == "slice" and t.args and t.args[0].op == "D"]
    for t in wanted:
        base = t.args[0].attrs[0]
        dim, start, end = t.attrs[:3]
        cuts = [(u, d) for u in prog.users.get(base, []) if (d := prog.defs.get(u)) is not None
                and d.op == "slice" and d.args and d.args[0].op == "D" and prog.same.find(d.args[0].attrs[0])
                == prog.same.find(base) and d.attrs[0] == dim]
        if any(tuple(d.attrs[1:3]) == (start, end) for _, d in cuts):
            continue
        for u, d in cuts:
            s2, e2 = d.attrs[1:3]
            if all(isinstance(v, int) for v in (s2, e2, start, end)) and e2 - s2 == end - start:
                where = prog.nodes[u].source if u in prog.nodes else None
                return u, where, (f"{u} takes {base}[{s2}:{e2}] along dim {dim}, where the sequential tensor is "
                                  f"its [{start}:{end}]: the rank reads the wrong part of it (an offset off by "
                                  f"{s2 - start})")
    return None


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
    pieces: dict[str, list[str]] = {}  # rank piece -> the sequential tensors whose relations sum it
    for name, rel in inf.relations.items():
        if not inf.clean.get(name, False):
            continue
        if rel.op != "Sum" or name not in candidates:
            continue
        # the partial terms: one tensor of the rank programs summed over several ranks (a
        # term held once is a whole tensor added to the sum, a replicated bias, say)
        by_base: dict[str, list[str]] = {}
        own: dict[str, str] = {}  # a term no other rank holds a replica of -> its rank
        for a in rel.args:
            t = a.args[0] if a.op == "Scale" else a
            if t.op == "D":
                by_base.setdefault(t.attrs[0].rpartition("@")[0], []).append(t.attrs[0])
                ranks = {y.rpartition("@")[2] for y in prog.same.group(t.attrs[0])}
                if len(ranks) == 1:
                    own[t.attrs[0]] = ranks.pop()
        groups = [g for g in by_base.values() if len(g) > 1]
        # ... or tensors of several ranks, each its own (rank 0 adds more terms to its partial,
        # so its tensor has another name)
        if len(set(own.values())) > 1:
            groups.append(list(own))
        for group in groups:
            for x in group:
                pieces.setdefault(find(x), []).append(name)
    # a rank's view, slice, transpose or scale of a piece is a piece too (of the same
    # transform of the sum): a bias added after the rank views its partial product
    for u, d in prog.defs.items():
        rn = prog.nodes.get(u)
        if (d is not None and rn is not None and registry.ops[rn.op].kind != "collective"
                and registry.ops[d.op].linear == "first" and len(d.args) == 1 and d.args[0].op == "D"
                and (src := pieces.get(find(d.args[0].attrs[0]))) is not None):
            pieces.setdefault(find(u), src)
        # and a concat of pieces (zeros among them: padding) is a piece of the concat of the sums
        elif (d is not None and rn is not None and registry.ops[rn.op].kind != "collective"
              and registry.ops[d.op].linear == "joint" and d.op != "Sum"
              and (srcs := [pieces.get(find(a.attrs[0])) for a in d.args if a.op == "D"])
              and all(x is not None or _zero(a, prog) for x, a in
                      zip([pieces.get(find(a.attrs[0])) if a.op == "D" else None for a in d.args], d.args, strict=True))
              and any(srcs)):
            pieces.setdefault(find(u), next(x for x in srcs if x is not None))
    users = core.users()
    out: dict[str, str] = {}
    for u, d in prog.defs.items():
        rn = prog.nodes.get(u)
        if d is None or rn is None or registry.ops[rn.op].kind == "collective":
            continue
        flags = [a.op == "D" and find(a.attrs[0]) in pieces for a in d.args]
        # a zero tensor is a piece of zero (its sum over the ranks is zero too): padding a
        # partial sum with zeros (a flat gradient buffer's padding) keeps it a partial sum
        flags = [f or (any(flags) and _zero(a, prog)) for f, a in zip(flags, d.args, strict=True)]
        if not any(flags) or not _breaks_partial(registry.ops[d.op].linear, flags):
            continue
        summed = pieces[find(next(a for a, f in zip(d.args, flags, strict=True) if f).attrs[0])]
        near = sorted({n.name: n for t in summed for n in users.get(t, []) if n.name in candidates}.values(),
                      key=lambda n: order[n.name])
        if not near:
            continue
        at = next((n for n in near if n.op == d.op), near[0])
        if registry.ops[at.op].fuse:
            continue  # no rank holds a fused op's value: its users decide (a shard's norm, squared again)
        # the sequential sum as its inputs' relations give it (its own relation may be the
        # rank tensor found equal to it, which says nothing of how often a term is in it)
        whole = (Term("Sum", tuple(inf.relations[a] for a in at.tensor_args())) if at.op == "Sum"
                 else inf.relations[at.name])
        if d.op == "Sum" and not _overcounted(prog, u, d, pieces, whole):
            continue  # the whole terms are counted as often as the sequential sum has them
        if at.name not in out or order.get(u, 0) < order.get(out[at.name], 0):
            out.setdefault(at.name, u)
    return out


def _copies_summed(core: Graph, inf: Inference, prog: DistProgram, registry: Registry,
                   candidates: set[str]) -> tuple[str, str] | None:
    """Collectives summing copies of one tensor (an all-reduce of a replicated input, a
    gradient all-reduced a second time): each rank then holds the world size times the
    value. Returns the first sequential node among `candidates` whose relation is written
    over such a collective's result or a rank tensor computed from it directly, and the
    collective. k copies of x / k summed (a replicated bias halved on every rank of two,
    DTensor's Replicate -> Partial) are the whole value: not reported."""
    find = prog.same.find
    doubled: dict[str, str] = {}  # a rank tensor the collective makes or its direct user -> collective
    for u, d in prog.defs.items():
        rn = prog.nodes.get(u)
        if d is None or rn is None or registry.ops[rn.op].kind != "collective":
            continue
        for t in _subterms(d):
            if t.op != "Sum":
                continue
            leaves = [find(a.attrs[0]) for a in t.args if a.op == "D"]
            # k copies of x / k are x (a replicated tensor made Partial): only other multiples
            dup = {x for x in leaves if leaves.count(x) > 1}
            if any((dx := prog.defs.get(x)) is None or dx.op != "Scale"
                   or Fraction(dx.attrs[0]) * leaves.count(x) != 1 for x in dup):
                for v in (u, *prog.users.get(u, [])):
                    doubled.setdefault(find(v), u)
                break
    if not doubled:
        return None
    for n in core.nodes:
        rel = inf.relations.get(n.name)
        if n.name not in candidates or rel is None or not inf.clean.get(n.name, False):
            continue
        hit = sorted({doubled[find(x)] for x in rel.leaves() if find(x) in doubled})
        if hit:
            return n.name, hit[0]
    return None


def _subterms(t: Term) -> list[Term]:
    out, stack = [], [t]
    while stack:
        x = stack.pop()
        out.append(x)
        stack.extend(x.args)
    return out


def _overcounted(prog: DistProgram, u: str, d: Term, pieces: dict[str, list[str]], rel: Term) -> bool:
    """Whether the whole (non-piece) terms rank tensor `u` adds to a piece are counted, over
    the ranks that add them the same way, more or less often than the sequential relation
    `rel` has them: a bias added on every rank before the sum is counted once per rank
    where the sequence has it once; a bias halved on each of two ranks, or a term one rank
    alone adds (the replicated gradients' squares in a norm), is counted right."""
    find = prog.same.find
    def key(t: Term) -> str:  # a rank tensor, or a term over rank tensors, up to replicas
        return find(t.attrs[0]) if t.op == "D" else str(t.rename(find))

    want: dict[str, Fraction] = {}
    stack = [(rel, Fraction(1))]
    while stack:  # the coefficient of each term (a rank tensor, an expand of one, ...) in the sum
        t, c = stack.pop()
        if t.op == "Scale":
            stack.append((t.args[0], c * Fraction(t.attrs[0])))
        elif t.op == "Sum":
            stack.extend((a, c) for a in t.args)
        else:
            want[key(t)] = want.get(key(t), Fraction(0)) + c
    for a in d.args:
        x = find(a.attrs[0]) if a.op == "D" else None
        if x is None or x in pieces:
            continue
        adders = {v.rpartition("@")[2] for y in prog.same.group(x) for v in prog.users.get(y, [])
                  if (dv := prog.defs.get(v)) is not None and dv.op == d.op
                  and any(b.op == "D" and find(b.attrs[0]) in pieces for b in dv.args)}
        # one rank adding a whole term is how a sum over ranks takes it once (rank 0 adds the
        # bias); several ranks must add it as often as the sequential sum has it
        dx = prog.defs.get(x)
        wanted = want.get(x, Fraction(0)) + (want.get(key(dx), Fraction(0)) if dx is not None else 0)
        if len(adders) > 1 and len(adders) != wanted:
            return True
    return False


def _zero(t: Term, prog: DistProgram) -> bool:
    """Whether `t` (an argument of a rank node's definition) is a tensor of zeros."""
    if t.op == "D":
        d = prog.defs.get(prog.same.find(t.attrs[0]))
        if d is None:
            return False
        t = d
    return t.op == "full" and bool(t.attrs) and t.attrs[0] == 0


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
