"""Which rank tensors a step's e-graph holds: the neighbourhood of a sequential node's
inputs in the rank program (`frontier`), the structural chains that assemble rank outputs
(`structural_ancestry`), and the small predicates the walk (refine.prove.walk) asks about
the rank program. Nothing here proves anything: it only chooses what the e-graph is told,
and every definition told is a true equality.
"""

from __future__ import annotations

from collections.abc import Iterable

from refine.prove.policy import DEFAULT, Policy
from refine.relate.program import DistProgram

_COLLECTIVES = frozenset({"all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast"})
_VIEWS = frozenset({"view", "transpose"})


def _behind(prog: DistProgram, leaves: set[str]) -> set[str]:
    """The tensors leaves are views of (one view deep) and, for those that are a
    collective's result, its inputs."""
    out: set[str] = set()
    for x in leaves:
        todo = [x]
        d = prog.defs.get(x)
        if d is not None and d.op in _VIEWS:
            todo += sorted(d.leaves())
            out.update(d.leaves())
        for y in todo:
            node, dy = prog.nodes.get(y), prog.defs.get(y)
            if node is not None and node.op in _COLLECTIVES and dy is not None:
                out.add(y)
                out.update(dy.leaves())
    return out - set(leaves)


_STRUCTURAL = frozenset({"view", "slice", "cat", "Sum", "Scale", "transpose"})


def structural_ancestry(prog: DistProgram, names: Iterable[str], hops: int) -> list[str]:
    """Rank tensors that `names` are built from by the relation language's own ops (views,
    slices, concats, sums: collectives and the flattening of gradients into one buffer to
    reduce), up to `hops` definitions back, in a deterministic order. Their definitions
    relate an expected rank output back to the tensors a relation is written over."""
    out: list[str] = []
    seen: set[str] = set()
    layer = sorted(set(names))
    for _ in range(hops):
        nxt: set[str] = set()
        for x in layer:
            d = prog.defs.get(x)
            if x in seen or d is None or d.op not in _STRUCTURAL:
                continue
            seen.add(x)
            out.append(x)
            nxt.update(d.leaves())
        layer = sorted(nxt - seen)
        if not layer:
            break
    return out


# ops a structural frontier walks without counting a hop: they move and regroup elements
# only, so what a rank computes from a tensor through them is that tensor, rearranged
_WALK_OPS = frozenset({"view", "slice", "cat", "transpose", "expand"})


def _derive(prog: DistProgram, x: str, avail: set[str], depth: int, out: list[str],
            ops: frozenset[str] | None = _WALK_OPS) -> bool:
    """Whether `x` is computed from available tensors by `ops` only (None: any op but a
    collective) at most `depth` definitions back; appends what it takes, inputs first."""
    canon = prog.same.find
    if canon(x) in avail or is_constant(prog, x):
        return True
    d = prog.defs.get(x)
    if depth == 0 or d is None or (d.op not in ops if ops is not None else x in prog.nodes and
                                   prog.nodes[x].op in _COLLECTIVES):
        return False
    for dep in sorted(d.leaves()):
        if not _derive(prog, dep, avail, depth - 1, out, ops):
            return False
    out.append(x)
    avail.add(canon(x))
    return True


def frontier(prog: DistProgram, leaves: set[str], known: set[str], hops: int,
             defined: frozenset[str] | set[str] = frozenset(), structural: bool = False,
             policy: Policy = DEFAULT, side: bool = False) -> list[str]:
    """Rank tensors within `hops` uses of `leaves` whose every input is available, plus the
    leaves' own definitions, in a deterministic order. An input in `defined` (available, like
    the known ones) comes along with its definition, as constants do.

    `structural`: a use by a view, slice, concat, transpose or expand costs no hop, and its
    other operands come along when walked ops compute them from available tensors (a rank
    writing its rotated q back into its fused qkv buffer: a concat with the buffer's
    untouched columns, which are no user of q; then split, viewed and transposed again).

    `side`: a use whose other operands are computed from available tensors by a few ops
    (Policy.side_depth) comes along with them."""
    canon = prog.same.find
    avail = {canon(x) for x in known} | {canon(x) for x in leaves}
    chosen: list[str] = [x for x in sorted(leaves) if prog.defs.get(x) is not None]
    seen = set(chosen)
    # the constants the leaves' own definitions read come along too (a rank's comparison
    # with its vocab bound, when the comparison is a leaf)
    for x in list(chosen):
        for dep in sorted(prog.defs[x].leaves()):  # type: ignore[union-attr]
            if is_constant(prog, dep):
                for c in constant_closure(prog, dep):
                    if c not in seen:
                        seen.add(c)
                        chosen.append(c)
    layer = set(leaves)
    # what a leaf is a view of, and the pieces of a collective it is (a view of), come
    # along with their users: a sum of the whole where the ranks sum its pieces before
    # viewing or gathering (a 3-d Linear's bias gradient, a gathered gradient)
    for x in sorted(_behind(prog, leaves)):
        if x not in seen and prog.defs.get(x) is not None:
            seen.add(x)
            chosen.append(x)
        layer.add(x)
        avail.add(canon(x))
    walk = policy.struct_free if structural else 0
    for _ in range(hops):
        nxt: set[str] = set()
        todo = sorted(layer)
        while todo:
            x = todo.pop()
            # structural: the users of every tensor equal to x (another rank's copy of a
            # replicated head, joined by join_fact_consequences) are its users too
            # and a copy's users (refine.prove.copies: rank 5's key is rank 4's head) are its tensor's
            for u in sorted(users_of_class(prog, x)) if structural or x in prog.copies else prog.users.get(x, ()):
                if u in seen or u in nxt:
                    continue
                d = prog.defs[u]
                if walk and d is not None and d.op in _WALK_OPS:
                    trial = set(avail)
                    taken: list[str] = []
                    if all(_derive(prog, dep, trial, policy.struct_depth, taken) for dep in sorted(d.leaves())):
                        walk -= 1
                        for y in taken:  # the other operands, with their definitions
                            if y not in seen:
                                seen.add(y)
                                chosen.append(y)
                        avail.update(trial)
                        nxt.add(u)
                        avail.add(canon(u))
                        todo.append(u)
                        continue
                # a copy's form may read its own tensor (rank 5's key: rank 4's head, then its
                # own padding heads): that is the tensor the form makes available, not an input
                if d is not None and all(canon(dep) in avail or is_constant(prog, dep)
                                         or (u in prog.copies and canon(dep) == canon(u)) for dep in d.leaves()):
                    nxt.add(u)
                elif d is not None and side and policy.side_depth:
                    # its other operands computed from what is available (rank inputs
                    # among it) by a few ops: a mask a rank makes from its labels per
                    # micro-batch, beside the value it masks; they come along with u
                    trial, taken = set(avail), []
                    if all(_derive(prog, dep, trial, policy.side_depth, taken, None) for dep in sorted(d.leaves())):
                        for y in taken:  # with the constants they read (the literal of a comparison)
                            for c in [c for dep in sorted(prog.defs[y].leaves()) if is_constant(prog, dep)  # type: ignore[union-attr]
                                      for c in constant_closure(prog, dep)] + [y]:
                                if c not in seen:
                                    seen.add(c)
                                    chosen.append(c)
                        avail.update(trial)
                        nxt.add(u)
        # users of any replica of a layer tensor count too
        for u in sorted(nxt):
            # constants (a literal operand becomes `full`; `expand(full)`, ...) come along
            for dep in sorted(prog.defs[u].leaves()):  # type: ignore[union-attr]
                if dep in defined and dep not in seen:
                    seen.add(dep)
                    chosen.append(dep)
                if is_constant(prog, dep):
                    for c in constant_closure(prog, dep):
                        if c not in seen:
                            seen.add(c)
                            chosen.append(c)
            seen.add(u)
            chosen.append(u)
            avail.add(canon(u))
        layer = nxt
        if not layer:
            break
    if prog.facts:
        _fact_chains(prog, leaves, chosen, seen, policy.struct_depth)
    return chosen


def _fact_chains(prog: DistProgram, leaves: set[str], chosen: list[str], seen: set[str], depth: int) -> None:
    """Append to `chosen` the definitions of the rank tensors the e-graph names without one
    (the leaves, what chosen definitions read) that walked ops compute from a fact's leaf
    (refine.ir.layout), with the chains between. A fact is told only where the e-graph holds
    its leaves, and says nothing of a tensor computed from them whose definition is not
    stated: a relation naming one rank's broadcast of a replicated bias (`addmm.expand@1`)
    next to a rank's sum with its own (`addmm.expand@0`) is proven only through both
    broadcasts' definitions. Definitions are true equalities: this only adds knowledge.
    At most `depth` (Policy.struct_depth) definitions back."""
    fact_leaves = _fact_leaves(prog)
    named = set(leaves)
    for x in chosen:
        d = prog.defs.get(x)
        if d is not None:
            named |= d.leaves()
    for x in sorted(named):
        if x in seen or prog.defs.get(x) is None:
            continue
        trial, taken = set(fact_leaves), []
        if _derive(prog, x, trial, depth, taken):
            for y in taken:
                if y not in seen:
                    seen.add(y)
                    chosen.append(y)


def _fact_leaves(prog: DistProgram) -> set[str]:
    """The rank tensors facts are told about, as class representatives."""
    return {prog.same.find(x) for x in prog.fact_index}


def is_constant(prog: DistProgram, name: str) -> bool:
    """A rank tensor computed from constants only (`full`, `expand(full)`, ...): it is
    available to every step, whatever the relations found so far."""
    memo = prog.constant
    opened: set[str] = set()
    stack = [name]  # a walk, not a recursion: definitions chain thousands deep
    while stack:
        x = stack[-1]
        if x in memo:
            stack.pop()
            continue
        d = prog.defs.get(x)
        deps = d.leaves() if d is not None else set()
        pending = [y for y in deps if y not in memo]
        if d is None or any(not memo[y] for y in deps if y in memo):
            memo[x] = False
        elif not pending:
            memo[x] = True
        elif x in opened:  # revisited with a dependency still open: a cycle (impossible in a valid program)
            memo[x] = False
        else:
            opened.add(x)
            stack.extend(pending)
            continue
        stack.pop()
    return memo[name]


def constant_closure(prog: DistProgram, name: str) -> list[str]:
    """A constant rank tensor and the constants its definition reads, recursively."""
    out, stack = [], [name]
    while stack:
        x = stack.pop()
        if x in out:
            continue
        out.append(x)
        stack.extend(sorted(prog.defs[x].leaves()))  # type: ignore[union-attr]
    return out


def writes_back_near(prog: DistProgram, leaves: set[str], hops: int) -> bool:
    """Whether a rank writes one of `leaves` (through views, slices, concats) into a buffer
    within `hops` uses: a concat (what slice_scatter lowers to) that holds a
    slice of a tensor of the concat's own shape, the buffer's untouched part."""
    layer = set(leaves)
    seen = set(layer)
    for _ in range(hops):
        nxt: set[str] = set()
        for x in sorted(layer):
            for u in prog.users.get(x, ()):
                d = prog.defs.get(u)
                # a sum too: a relation may name the pieces of what the ranks add (a bias and a product)
                if u in seen or d is None or (d.op not in _WALK_OPS and d.op != "Sum"):
                    continue
                if d.op == "cat" and _cat_of_own_buffer(prog, u):
                    return True
                seen.add(u)
                nxt.add(u)
        layer = nxt
    return False


def exchanges_near(prog: DistProgram, leaves: set[str], hops: int) -> bool:
    """Whether a rank sends one of `leaves` (through views, slices, concats) through an
    all_to_all within `hops` uses: a re-layout (DeepSpeed-Ulysses' heads for sequence, an
    expert-parallel dispatch), whose chunks, stacks, concats and views around the exchange
    put the counterpart many uses away though no op but the exchange computes anything.
    So does a reduce_scatter or all_gather reached through a slice: its operand re-laid out
    (funcol's reduce_scatter_tensor over a dim other than 0 chunks that dim and concatenates
    the chunks along dim 0 for the collective)."""
    layer = {x: False for x in leaves}  # tensor -> reached through a slice
    seen = set(layer)
    for _ in range(hops):
        nxt: dict[str, bool] = {}
        for x, sliced in sorted(layer.items()):
            for u in prog.users.get(x, ()):
                node, d = prog.nodes.get(u), prog.defs.get(u)
                if node is not None and (node.op == "all_to_all" or
                                         (sliced and node.op in ("reduce_scatter", "all_gather"))):
                    return True
                if u in seen or d is None or d.op not in _WALK_OPS:
                    continue
                seen.add(u)
                nxt[u] = sliced or d.op == "slice"
        layer = nxt
    return False


def scatters_near(prog: DistProgram, leaves: set[str], hops: int) -> list[tuple[int, ...]]:
    """The rank groups of the reduce_scatters, all_gathers and all_to_alls a rank sends one of
    `leaves` to (through views, slices, concats, sums) within `hops` uses: where what the
    leaves make is held in
    pieces, one per rank, around an exchange (sequence parallelism's reduce-scatter, its
    gradient's all-gather)."""
    layer, seen = set(leaves), set(leaves)
    groups: list[tuple[int, ...]] = []
    for _ in range(hops):
        nxt: set[str] = set()
        for x in sorted(layer):
            for u in prog.users.get(x, ()):
                node, d = prog.nodes.get(u), prog.defs.get(u)
                if node is not None and node.op in ("reduce_scatter", "all_gather", "all_to_all"):
                    g = tuple(node.attrs["group"])
                    if g not in groups:
                        groups.append(g)
                    continue
                if u in seen or d is None or d.op not in _WALK_OPS | {"Sum"}:
                    continue
                seen.add(u)
                nxt.add(u)
        layer = nxt
    return groups


def _cat_of_own_buffer(prog: DistProgram, x: str) -> bool:
    d = prog.defs[x]
    assert d is not None
    shape = prog.types[x].shape
    for a in d.args:
        if a.op != "D":
            continue
        da = prog.defs.get(a.attrs[0])
        if da is not None and da.op == "slice" and da.args[0].op == "D" and \
                prog.types[da.args[0].attrs[0]].shape == shape:
            return True
    return False


def counterparts(prog: DistProgram, op: str, leaves: set[str], tensors: list[str]) -> set[str]:
    """Rank tensors of a step that apply the sequential node's own op to the tensors its
    inputs relate to (with other attributes: a broadcast to a rank's head count). The
    relation found may be another rank tensor of equal value and shape (a query's rotary
    factor standing for the key's, where the ranks' query heads are as many as the key's),
    and the later steps must still reach the ranks' own uses of their counterparts, and know
    what they are. Only makes them (and their definitions) available to later frontiers:
    what is proven stays the e-graph's business."""
    find = prog.same.find
    ins = {find(x) for x in with_replicas(prog, leaves)}
    out: set[str] = set()
    for u in tensors:
        d = prog.defs.get(u)
        if d is not None and d.op == op and d.leaves() and {find(x) for x in d.leaves()} <= ins:
            out.add(u)
    return out


def with_replicas(prog: DistProgram, leaves: set[str]) -> set[str]:
    """The leaves, the rank tensors equal to them, and those a fact relates a part of them
    to (refine.ir.layout): a rank's use of its copy of a replicated slice is in reach."""
    out: set[str] = set()
    for x in leaves:
        out.update(prog.same.group(x))
    for x in list(out):
        for i in prog.fact_index.get(x, ()):
            a, b = prog.facts[i]
            for y in a.leaves() | b.leaves():
                out.update(prog.same.group(y))
    return out


def users_of_class(prog: DistProgram, x: str) -> set[str]:
    return {u for y in prog.same.group(x) for u in prog.users.get(y, ())}


def ancestry(prog: DistProgram, names: list[str], depth: int) -> list[str]:
    """`names` and the rank tensors their definitions read, `depth` definitions back, inputs
    first; not past a tensor whose class every name reaches (two ranks' products of one
    replicated activation need nothing behind it: past layer one, that is the layers before)."""
    find = prog.same.find

    def walk(roots: list[str], stop: set[str]) -> list[str]:
        out: list[str] = []
        seen: set[str] = set()

        def go(x: str, k: int) -> None:
            if x in seen:
                return
            seen.add(x)
            d = prog.defs.get(x)
            if d is not None and k > 0 and find(x) not in stop:
                for dep in sorted(d.leaves()):
                    go(dep, k - 1)
            out.append(x)

        for n in roots:
            go(n, depth)
        return out

    shared = set.intersection(*({find(x) for x in walk([n], set())} for n in names)) if len(names) > 1 else set()
    return walk(names, shared)
