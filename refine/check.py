"""The pipeline: load, lower, relate, infer, check expectations, localize.

    from refine import check_files
    report = check_files("seq.json", "dist.json")      # or check(seq, dist, registry)

Expectations. An output with an explicit expectation must equal the rank outputs `local`
placed by `placements` (every replica must hold it: a Replicate axis means each copy equals
it, not one of them), or each `layout` over rank outputs `name@rank` (an output only some
ranks make, such as the loss of the last pipeline stage: `{"output": "loss", "layout":
["loss@2"]}`). An output without one:

- made by every rank under its own name: it must be one of the standard placements of those
  copies, each mesh axis Replicate, Shard(d), Partial(sum) or the ranks' mean (the first
  that holds is reported). "Reconstructible somehow" is not enough: it would accept a loss
  halved on every rank (`2 * y@0`), or one rank's right copy whatever the others hold;
- made by some ranks only: it must be reconstructible from rank outputs by a clean relation.

An expectation is met when the best term equals the expected one up to concat nesting and
sum order (concat is associative, sums are unordered): a step's e-graph may hold
`cat(a, cat(b, cat(c, d)))` while the expectation is built balanced. An expectation (or
relation) a frontend wrote `"guessed": true` is listed in the report; so is a sequential
input taken as replicated because every rank has an input of its name and shape.

Opaque leaves. A node with no clean relation keeps its best term for the report, but its
users see it as an opaque leaf `<name>` (never clean, no definition): what is proven over it
holds whatever its value, and a buggy program's relations do not grow with every op after
the bug.

Nothing to check. When every output is an input, or a view or copy of one, on both sides,
the check proves nothing about a computation: exit 2, "nothing to check" (an import without
its relation file, say). When only some outputs pass inputs through, the report names them
and the JSON marks them `"computed": false`.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from refine.frontends.graphfile import load_dist, load_seq
from refine.ir.errors import InputError
from refine.ir.graph import Dist, Graph, Node, Placement, Relation, case_symbols, tensor_name
from refine.ir.term import LEAF_OPS, NARY, Term
from refine.ops.lower import UnsupportedOp, lower
from refine.ops.registry import Registry, ShapeError, load_registry
from refine.ops.schedule import ScheduleError, Stuck, deadlock
from refine.prove.copies import join_copies
from refine.prove.engine import Engine
from refine.prove.extra_rules import require_verified
from refine.prove.frontier import frontier, structural_ancestry
from refine.prove.policy import DEFAULT, STRATEGIES, Policy
from refine.prove.reuse import StepResult
from refine.prove.walk import infer, settle
from refine.relate.program import DistProgram, build_program, seq_input_relations
from refine.verdict.expect import expectation_options, expected_terms
from refine.verdict.localize import localize
from refine.verdict.report import Culprit, OutputResult, Report

if TYPE_CHECKING:
    from refine.verdict.counterexample import Counterexample

_ENGINES: dict[tuple[int, bool, frozenset[str], Policy], Engine] = {}


def engine_for(registry: Registry, symbolic: bool = False, features: frozenset[str] = frozenset(),
               policy: Policy = DEFAULT) -> Engine:
    """One engine per rule set, size mode, case features (`Rule.needs`) and search policy
    (its step cache holds what that policy found): concrete sizes are i64 in the e-graph,
    symbolic ones PyObjects whose comparisons are proven (see refine.ir.sizes)."""
    key = (id(registry), symbolic, features, policy)
    if key not in _ENGINES:
        _ENGINES[key] = Engine(registry, symbolic=symbolic, features=features, policy=policy)
    return _ENGINES[key]


def case_features(dist: Dist) -> frozenset[str]:
    """What the case needs rules for beyond the common ones (Rule.needs): layouts stated by
    defines; an all_to_all exchange on some rank."""
    exchange = any(n.op == "all_to_all" for g in dist.ranks.values() for n in g.nodes)
    return frozenset({"defines"} if dist.defines else set()) | frozenset({"exchange"} if exchange else set())


def is_symbolic(seq: Graph, dist: Dist) -> bool:
    return bool(case_symbols(seq, dist))


def check_files(seq_path: str | Path, dist_path: str | Path, rules: Iterable[str | Path] = (),
                trust_rules: bool = False, policy: Policy = DEFAULT, tries: int | None = None,
                self_check: bool | None = None) -> Report:
    """Check the pair of files. The extra rule directories `rules` are verified first
    (refine.prove.extra_rules, cached): a wrong rule or op raises RulesRefused (an InputError), an
    untested one too unless `trust_rules`, and the report then lists it as unverified.
    `policy`: the prover's search policy (refine.prove.policy)."""
    t0 = time.perf_counter()
    rules = list(rules)
    registry = load_registry(rules)
    seq = load_seq(seq_path, registry)
    dist = load_dist(dist_path, registry, seq)
    unverified = require_verified(registry, [str(d) for d in rules], is_symbolic(seq, dist), trust_rules)
    report = check(seq, dist, registry, str(seq_path), str(dist_path), t0, policy, tries, self_check)
    report.unverified_rules = unverified
    return report


def check(seq: Graph, dist: Dist, registry: Registry, seq_file: str = "seq", dist_file: str = "dist",
          t0: float | None = None, policy: Policy = DEFAULT, tries: int | None = None,
          self_check: bool | None = None) -> Report:
    """The verdict on `seq` and `dist`: REFINES (a proof), or, when the proof stops, a search
    of `tries` random draws (default refine.verdict.counterexample.TRIES) for a
    counterexample (DOES NOT REFINE) or none (UNPROVEN).
    `self_check` (default: REFINE_SELF_CHECK) runs a REFINES once on random inputs too and
    raises SoundnessFailure when its outputs differ."""
    limit = None
    if self_check is None:  # asked for by the environment (a test session): small cases only
        self_check, limit = self_check_enabled(), SELF_CHECK_ELEMENTS
    # What the process holds already (the loaded graphs, the rule families, torch when a
    # capture or an import ran first) is left out of the collector's full passes while the
    # check runs: each one otherwise walks all of it again, and their number grows with the
    # objects a check allocates (0.25-0.35 s of aws_llama TP4/TP8 eight layers after an
    # import). Only a frozen object that becomes cyclic garbage meanwhile waits for the end.
    own = gc.get_freeze_count() == 0
    if own:
        gc.freeze()
    try:
        return _check(seq, dist, registry, seq_file, dist_file, t0, policy, tries, self_check, limit)
    finally:
        if own:
            gc.unfreeze()


def _check(seq: Graph, dist: Dist, registry: Registry, seq_file: str, dist_file: str, t0: float | None,
           policy: Policy, tries: int | None, self_check: bool, limit: int | None = None) -> Report:
    t0 = time.perf_counter() if t0 is None else t0
    try:
        seq_core, rename = lower(seq, registry)
    except ShapeError as e:
        raise InputError(seq_file, "$.graph", str(e)) from None
    except UnsupportedOp as e:
        raise InputError(seq_file, "$.graph", str(e)) from None
    try:
        prog, _ = build_program(dist, registry, dist_file)
    except UnsupportedOp as e:
        raise InputError(dist_file, "$.ranks", str(e)) from None
    inputs = seq_input_relations(dist, seq, prog, registry, dist_file)
    try:
        stuck = deadlock(dist.ranks, registry)
    except ScheduleError as e:
        raise InputError(dist_file, "$.ranks", str(e)) from None
    if stuck:  # the ranks never finish: nothing to relate
        return _deadlocked(seq, dist, stuck, t0)
    engine = engine_for(registry, is_symbolic(seq, dist), case_features(dist), policy)
    steps0, replayed0, bounded0 = engine.stats["steps"], engine.stats["replayed"], engine.stats["bounded"]
    # the pre-walk pass: what the program's facts make equal, then frozen
    join_copies(seq, dist, prog, engine, registry)
    settle(prog, engine, registry)
    inf = infer(seq_core, inputs, prog, engine, registry)
    prog = inf.program  # the walk's view: the frozen program and what the walk learned

    explicit = {e.output: e for e in dist.expectations}
    results: list[OutputResult] = []
    compared: list[list[str]] = []  # per output, the rank outputs its check compares it with
    for out in seq_core.outputs:
        rel = inf.relations[out.ref]
        ex = explicit.get(out.name)
        if ex is not None:
            wanted = [_as_out(t) for t in expected_terms(dist, out.name)]
            compared.append(sorted({x for t in wanted for x in t.leaves()}))
            if ex.layout is not None:
                expect = " and ".join(map(str, ex.layout))
                names = {x.rpartition("@")[0] for t in ex.layout for x in t.leaves()}
                local = names.pop() if len(names) == 1 else None  # the rank output it is expected at
            else:
                local = ex.local or out.name
                expect = f"{local} on every rank, placed [{', '.join(map(str, ex.placements or ()))}]"
            results.append(_explicit(out.name, out.role, rel, wanted, expect, local, prog, engine, registry))
        else:
            compared.append([tensor_name(r, out.name) for r in sorted(dist.ranks)
                             if tensor_name(r, out.name) in prog.outputs])
            results.append(_default(out.name, out.role, rel, prog, engine, registry, dist, seq_core))
    for r, out, ranks in zip(results, seq_core.outputs, compared, strict=True):
        r.computed = not (_passes_through(seq_core, out.ref) and _rank_passes_through(prog, ranks))
    refines = all(r.ok for r in results)
    if refines and not any(r.computed for r in results):
        raise InputError(seq_file, "$.graph.outputs", _nothing_to_check(seq, seq_core, results))
    culprit = None if refines else localize(seq, seq_core, results, inf, prog, registry, dist)
    t_search = time.perf_counter()
    search = None
    if not refines:  # the proof stopped: look for inputs on which the outputs differ
        from refine.verdict import counterexample  # torch, only now

        search = counterexample.search(seq, dist, registry, counterexample.TRIES if tries is None else tries)
        # a rank line the localization confirmed by a numeric repair of its own (a wrong
        # constant scaled back, a missing reduction inserted: `seq_source` set) needs no
        # divergence search, whose counterfactual runs cost most of a failing check's search
        if search.found is not None and culprit is not None and culprit.seq_source is None:
            _diverge(seq, dist, registry, search.found, culprit, prog)
    elif self_check and (limit is None or _elements(seq, dist) <= limit):
        _self_check(seq, dist, registry)
    guesses = [_guess(r) for r in dist.relations if r.guessed]
    guesses += [f"output {e.output}: [{', '.join(map(str, e.placements or ()))}] (guessed from shapes)"
                for e in dist.expectations if e.guessed]
    stats = {"seconds": round(time.perf_counter() - t0, 3), "steps": int(engine.stats["steps"] - steps0),
             "replayed": int(engine.stats["replayed"] - replayed0),
             "bounded": int(engine.stats["bounded"] - bounded0),
             "seq_nodes": len(seq.nodes), "rank_nodes": sum(len(g.nodes) for g in dist.ranks.values()),
             "ranks": len(dist.ranks),
             # per strategy of the walk (refine.prove.policy.STRATEGIES): the nodes it ran on,
             # and how many times its result was the relation kept
             "strategies": {s: {"ran": inf.ran[s], "kept": inf.kept[s]} for s in STRATEGIES},
             "search_seconds": round(time.perf_counter() - t_search, 3)}
    return Report(refines, results, culprit, guesses, stats, _describe_symbols(seq, dist), search=search)


def _diverge(seq: Graph, dist: Dist, registry: Registry, found: Counterexample, culprit: Culprit,
             prog: DistProgram) -> None:
    """Name the rank node the counterexample shows going wrong first: the numbers are ground
    truth over the localization's rank node, which stays only where the numbers implicate it
    too (the divergence itself, or a value it is computed from that holds no sequential
    tensor: the divergence search can only replace values that have a sequential counterpart,
    so it names the first such value after the bug, and the rank node the rewrite localization
    names may sit before it)."""
    from refine.ops.interp import EvalError
    from refine.verdict import counterexample

    try:
        d = counterexample.diverge(seq, dist, registry, found)
    except EvalError:
        d = None
    culprit.divergence = d
    if d is None:
        return
    own = prog.nodes.get(culprit.rank_node) if culprit.rank_node else None
    implicated = {d.rank_node, *d.names.values(), *d.also, *(n for n, _ in d.chain)}
    if own is None or (own.origin or own.name) not in implicated:
        culprit.rank_node = tensor_name(d.ranks[0], d.rank_node)
        culprit.rank_source = d.source


class SoundnessFailure(AssertionError):
    """A REFINES whose programs compute different outputs when run: a defect of the prover
    (a wrong rule, a wrong lowering), never of the user's input."""


# Elements (float64) a self check asked for by the environment may evaluate: the suite
# self-checks every REFINES, two test processes at once on a laptop-sized machine, and a
# 1e9-element import of a real model would hold 8 GB each. `--self-check` has no such limit
# (REFINE_EVAL_BUDGET only).
SELF_CHECK_ELEMENTS = 50_000_000


def self_check_enabled() -> bool:
    """REFINE_SELF_CHECK=1: every REFINES is run on random inputs too (the suite sets it)."""
    return os.environ.get("REFINE_SELF_CHECK", "") not in ("", "0")


def _elements(seq: Graph, dist: Dist) -> int:
    from refine.ops.interp import eval_elements

    return eval_elements(seq, dist)


def _self_check(seq: Graph, dist: Dist, registry: Registry) -> None:
    """Run a proven case once on random inputs (integer inputs partly drawn from the values
    the programs compare them with, refine.ops.special); a difference is a SoundnessFailure."""
    from refine.verdict import counterexample

    found = counterexample.search(seq, dist, registry, tries=1, plain=0).found
    if found is not None:
        bad = found.failing()[0]
        raise SoundnessFailure(f"REFINES, but output {bad.output} differs on random inputs (seed {found.seed}, "
                               f"sizes {found.sizes}{f', integers mixed with {found.mixed}' if found.mixed else ''}): max abs error {bad.abs_err:.3g}, relative {bad.rel_err:.3g}, "
                               f"against {bad.expectation}")


# The core op that only reinterprets its input's elements (reshape, flatten, unsqueeze lower
# to it): its value is its input's, given the shape the loader checked. Copies, detaches,
# x + 0.0 and x * 1.0 are gone at lowering. Anything else (a transpose, a slice, a broadcast,
# a concat, a constant, arithmetic) is something a program can get wrong.
REINTERPRET = frozenset({"view"})


def _passes_through(g: Graph, ref: str) -> bool:
    """Whether the (core) graph's `ref` is an input seen through views only."""
    index = g.index()
    n = index.get(ref)
    while isinstance(n, Node) and n.op in REINTERPRET:
        n = index.get(n.tensor_args()[0])
    return n is not None and not isinstance(n, Node)


def _rank_passes_through(prog: DistProgram, outputs: list[str]) -> bool:
    """Whether each of these rank outputs is a rank input seen through views only (or moved
    to another rank as it is)."""
    for o in outputs:
        x = prog.outputs[o]
        while (d := prog.defs.get(x)) is not None:
            if d.op in LEAF_OPS:
                x = d.attrs[0]
            elif d.op in REINTERPRET and d.args[0].op in LEAF_OPS:
                x = d.args[0].attrs[0]
            else:
                return False
    return True


def _nothing_to_check(seq: Graph, core: Graph, results: list[OutputResult]) -> str:
    """Why a check whose outputs all pass inputs through proves nothing."""
    shown = []
    for r in results[:4]:
        ref = seq.output(r.name).ref
        node = seq.index()[ref]
        if not isinstance(node, Node):
            shown.append(f"{r.name!r} is input {ref!r}")
            continue
        index, x = core.index(), core.output(r.name).ref
        while isinstance(n := index.get(x), Node):  # views down to the input
            x = n.tensor_args()[0]
        shown.append(f"{r.name!r} is {ref!r} ({node.op}) of input {x!r}")
    more = f", and {len(results) - 4} more" if len(results) > 4 else ""
    return ("nothing to check: no output depends on a computation. Every sequential output is an input, or a "
            f"view or copy of one ({'; '.join(shown)}{more}), and so is every rank output it is compared with, "
            "so a REFINES would only say that the relations place the inputs as the expectations do. "
            "Were the wrong outputs exported (an import without its relation file, say)?")


def _deadlocked(seq: Graph, dist: Dist, stuck: list[Stuck], t0: float) -> Report:
    """DOES NOT REFINE: the ranks' program order deadlocks (refine.ops.schedule), so no output is
    ever computed."""
    results = [OutputResult(o.name, o.role, "", False, "computed by the ranks", False,
                            "never computed: the ranks deadlock") for o in seq.outputs]
    stats = {"seconds": round(time.perf_counter() - t0, 3), "steps": 0, "replayed": 0, "seq_nodes": len(seq.nodes),
             "rank_nodes": sum(len(g.nodes) for g in dist.ranks.values()), "ranks": len(dist.ranks)}
    return Report(False, results, None, [], stats, _describe_symbols(seq, dist), deadlock=stuck)


def _guess(r: Relation) -> str:
    if r.where and r.layout is not None:
        return f"{r.source}: {' and '.join(map(str, (r.layout, *r.replicas)))} (guessed from names and shapes)"
    if r.where:  # written in the document, flagged as a guess by whoever wrote it
        pl = ", ".join(map(str, r.placements or ()))
        local = f" (rank input {r.local})" if r.local != r.source else ""
        return f"{r.source}{local}: [{pl}] (guessed from names and shapes)"
    return f"{r.source}: replicated (same name and shape on every rank)"


def _describe_symbols(seq: Graph, dist: Dist) -> list[str]:
    from refine.ir import sizes

    syms = case_symbols(seq, dist)
    out = []
    for name in sorted(syms):
        a = sizes.atoms_of(syms[name])[name]
        out.append(f"{name} >= {a.min}" + (f", a multiple of {a.multiple}" if a.multiple > 1 else ""))
    return out


def _output_tensors(prog: DistProgram) -> list[str]:
    return sorted(set(prog.outputs.values()))


def _explicit(name: str, role: str, rel: Term, wanted: list[Term], expect: str, local: str | None,
              prog: DistProgram, engine: Engine, registry: Registry) -> OutputResult:
    hops = engine.policy.expect_hops
    tensors = frontier(prog, rel.leaves(), set(), hops, policy=engine.policy) + _output_tensors(prog)
    # how the expected outputs are assembled (an all-reduce of flattened gradients, sliced)
    wanted_leaves = sorted({prog.outputs.get(x, x) for t in wanted for x in t.leaves()})
    tensors += [x for x in structural_ancestry(prog, wanted_leaves, hops) if x not in set(tensors)]
    res = _expect_step(rel, prog, registry, tensors, wanted, engine,
                       lambda r: all(_held(r.checks, r.best, wanted)))
    held = _held(res.checks, res.best, wanted)
    ok = all(held)
    detail = "" if ok else f"expected {wanted[held.index(False)]}"
    return OutputResult(name, role, str(res.best), res.clean, expect, ok, detail, local)


def _default(name: str, role: str, rel: Term, prog: DistProgram, engine: Engine, registry: Registry,
             dist: Dist, seq: Graph) -> OutputResult:
    """An output without an expectation. Made by every rank under its own name, it must be
    placed on the ranks' copies in one of the standard ways (each mesh axis Replicate,
    Shard, Partial sum or the ranks' mean): "reconstructible somehow" would accept a loss
    halved on every rank (`2 * loss@0`) or one rank's copy alone with the others wrong.
    Otherwise (only some ranks make it) it must be reconstructible from rank outputs."""
    tensors = frontier(prog, rel.leaves(), set(), engine.policy.expect_hops, policy=engine.policy) + \
        _output_tensors(prog)
    ndim = len(seq.type_of(seq.output(name).ref).shape)
    made = {f"{o.name}@{r}" for r, g in dist.ranks.items() for o in g.outputs}
    standard = expectation_options(dist, name, ndim, made)
    copies_equal = len({prog.same.find(prog.outputs.get(f"{name}@{r}", f"{name}@{r}")) for r in dist.ranks}) == 1
    if standard is not None and copies_equal:
        # every rank makes the same tensor: summing those copies makes world times one of
        # them, no partial sum of the output (a value halved on every rank is a bug)
        standard = [(pl, ts) for pl, ts in standard
                    if not any(p.kind == "partial" and p.reduce == "sum" for p in pl or ())]
    if standard is not None:
        options = [(pl, [_as_out(t) for t in ts]) for pl, ts in standard]
        # how the ranks' copies are made from what the relation names (as _explicit does)
        copies = sorted({prog.outputs.get(x, x) for _, ts in standard for t in ts for x in t.leaves()})
        tensors += [x for x in structural_ancestry(prog, copies, engine.policy.expect_hops) if x not in set(tensors)]
        def standard_held(r: StepResult) -> tuple[Placement, ...] | None:
            found, i = None, 0
            for pl, ts in options:
                if found is None and all(_held(r.checks[i:i + len(ts)], r.best, ts)):
                    found = pl or ()
                i += len(ts)
            return found

        res = _expect_step(rel, prog, registry, tensors, [t for _, ts in options for t in ts], engine,
                           lambda r: standard_held(r) is not None)
        got = standard_held(res)
        expect = "placed on every rank's copy in a standard way (no expectation given)"
        if got is None:
            detail = "no clean relation" if not res.clean else \
                f"not {name} on every rank placed Replicate, Shard, Partial or as the ranks' mean"
            return OutputResult(name, role, str(res.best), res.clean, expect, False, detail, name)
        return OutputResult(name, role, str(res.best), res.clean,
                            f"{name} on every rank, placed [{', '.join(_placement_name(p) for p in got)}] "
                            "(no expectation given: the first standard placement that holds)", True, "", name)
    res = engine.step(rel, prog, registry, tensors)
    from_outputs = res.clean and all(t == "Out" for t in _leaf_ops(res.best))
    detail = "" if from_outputs else (
        "no clean relation" if not res.clean else "only related to rank intermediates, not to rank outputs")
    return OutputResult(name, role, str(res.best), res.clean, "reconstructible from rank outputs", from_outputs, detail)


def _expect_step(rel: Term, prog: DistProgram, registry: Registry, tensors: list[str], checks: list[Term],
                 engine: Engine, holds: Callable[[StepResult], bool]) -> StepResult:
    """The e-graph step checking an output's relation against what the rank outputs must make.
    Saturating from the relation alone reaches a check only when the relation's class grows
    into it; a check that only meets the relation in a common form (the sequential loss a
    Sum over every micro-batch of every rank, the ranks' mean a Sum of per-rank Sums) needs
    its own terms rewritten too: when the first step does not show it, the checks go into
    the e-graph as well (the same proof, from both sides; still only equalities proven)."""
    res = engine.step(rel, prog, registry, tensors, checks=checks)
    if holds(res) or not res.clean:
        return res
    # the relation's side reduced too: how its rank tensors are built by the relation
    # language's ops (a rank's view of its gathered flat buffer, the buffer a concat of shards)
    back = [x for x in structural_ancestry(prog, sorted(res.best.leaves()), engine.policy.expect_hops)
            if x not in set(tensors)]
    both = engine.step(rel, prog, registry, tensors + back, checks=checks, both=True)
    return both if holds(both) else res


def _held(checks: list[bool], best: Term, wanted: list[Term]) -> list[bool]:
    """Each check, or the best term equal to that wanted term up to how its concats nest and
    its sums order their terms: the e-graph holds a concat of four in the nesting its rules
    built (which can depend on the order rules were declared in), and concat is associative
    (cat(a, cat(b, c)) = cat(cat(a, b), c)), so either nesting is the same tensor."""
    flat = _flat_cats(best)
    return [ok or _flat_cats(w) == flat for ok, w in zip(checks, wanted, strict=True)]


def _flat_cats(t: Term) -> Term:
    args = tuple(_flat_cats(a) for a in t.args)
    if t.op == "cat":
        args = tuple(x for a in args for x in (a.args if a.op == "cat" and a.attrs == t.attrs else (a,)))
    if t.op in NARY:  # unordered
        args = tuple(sorted(args, key=repr))
    return Term(t.op, args, t.attrs)


def _placement_name(p: Placement) -> str:
    return "mean" if p.reduce == "avg" else str(p)


def _leaf_ops(t: Term) -> list[str]:
    if t.op in ("D", "Out"):
        return [t.op]
    return [x for a in t.args for x in _leaf_ops(a)]


def _as_out(t: Term) -> Term:
    if t.op == "D":
        return Term("Out", (), t.attrs)
    return Term(t.op, tuple(_as_out(a) for a in t.args), t.attrs)
