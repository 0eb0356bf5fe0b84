"""Relation inference on egglog.

One `Engine` holds the declarations and every rule. Each `step` pushes a small e-graph:
one sequential term (an op applied to its inputs' relations), the definitions of the rank
tensors near those relations' leaves, and asks for the cheapest equal term. Rank tensors
cost little, the relation language little more, compute ops a lot: the result is a clean
relation exactly when one exists in the e-graph. The walk over the sequential graph in
topological order keeps every e-graph small.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from refine.ir.graph import Graph, Node
from refine.ir.term import (
    LEAF_OPS,
    NARY,
    OPAQUE,
    Term,
    depth,
    from_egglog,
    lit,
    opaque,
    parse_sexp,
    quote,
    unquote,
)
from refine.ops.registry import (
    ATTR_SORTS,
    COMPUTE,
    LEAF,
    LEAF_OUT,
    Registry,
)
from refine.ops.sexp import Sexp, Str, dims_prelude, heads_in, parse_cached, statements, with_option
from refine.prove.declarations import (
    PLAIN_HEADS,
    Declarations,
    Need,
    canonical,
    in_ruleset,
    record_shapes,
    record_shapes_text,
    rename,
)
from refine.prove.egg import bindings
from refine.prove.reuse import Premises, Replayer, StepResult
from refine.relate.program import DistProgram, join_congruent, term_type

CLEAN_OPS = {"D", "Out"}
ITERATIONS = 14
# A step stops before ITERATIONS once its target's best term is plain (rank tensors in
# concats and sums, see Engine._plain) and has not got cheaper for PATIENCE iterations, or
# once the e-graph is saturated: most steps are proven in a few iterations, and the rest of
# the bound only grows the e-graph (most of a step's time). A step with checks
# (expectations) runs the whole bound: what it must prove is not its cheapest term.
PATIENCE = 3
# An iteration with more rule matches than this that made the clean best term no cheaper
# ends the step too, plain or not: each further one costs more (sums of eight micro-batch
# gradients regrouped: 0.3M, 0.7M, 0.6M, 0.3M matches, 230 s, for nothing cheaper)
FLOOD = 200_000
# Every step, early stop or not, is bounded in what it may hold and do (_Budget). Between
# iterations it stops when its e-graph holds more than NODE_BUDGET e-nodes (rows of all its
# tables), when the next iteration, growing as the last one grew over the one before, would
# apply more than MATCH_BUDGET rule matches, or would take the memory the process gained
# over the step past MEMORY_BUDGET. An iteration cannot be cut short, so the bound looks
# one ahead: a rewrite system that runs away does so geometrically or faster (a sum of
# copies regrouped, before rules/structure.py's SumStop: 2.7K, 113K matches, then one
# iteration of more than 20 minutes and 12 GB).
# Why these values: an e-node and what indexes it take about 0.3 KB (GPT TP8's largest
# step: 0.4M e-nodes, 0.1 GB), so 1M e-nodes is well under a GB; egglog applies a match in
# 5-30 us, so 2M matches is under a minute for one iteration. But sums are multisets that
# egglog stores and rebuilds apart from the e-nodes: with long ones an e-node takes 5-50 KB
# and a match 200 us (1 GB at 33K e-nodes), which only the process's memory shows (read
# where it is cheap: /proc/self/statm, else the peak), not deterministically, so it is the
# last of the three. 2 GB for one step of many is what a 16-24 GB laptop holds next to the
# rest; the largest correct steps the tests and the corpus run stay far below all three:
# 0.4M e-nodes (GPT TP8), iterations of 0.8M matches (aws_llama TP6), 0.2 GB.
# A stopped step returns the cheapest term its e-graph holds: every equality in it is
# proven, so a clean term is still a proof. Stopping can only lose proofs: the node is
# then unclean (a culprit), never a REFINES it did not prove; the report says a step was
# cut short (StepResult.bounded).
NODE_BUDGET = 1_000_000
MATCH_BUDGET = 2_000_000
MEMORY_BUDGET = 2 << 30  # bytes
DEEP_HOPS = 24  # the frontier of a step over a fused node's term (Op.fuse)
DEEP_ITERATIONS = 6  # and its rule iterations: it holds most of a rank program
# What a node passes on to its users is a term no deeper than this, else an opaque leaf (no
# clean relation): each walk over a term recurses, and a chain of views of a fused value
# (or a relation no rank tensor stands for) would pass a term one op deeper at every node.
# Relations over rank tensors are a few ops deep (a concat of slices of a fused weight).
TERM_DEPTH = 64
CARRY_OPS = 16  # an unclean mask's term up to this many distinct ops is seen by its users
CARRY_HOPS = 12  # and the frontier of their steps' retry
COUNTERPART_DEPTH = 8  # uses downstream of its step a rank counterpart stays offered (see _counterparts)
FREE_INDEX_OPS = 32  # bool/int rank tensors a frontier takes without counting a hop (see frontier)
INDEX_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8"})
CACHE_SIZE = 20_000  # step results kept for reuse (a few KB each)
# `shape` keeps its first value (:merge old): a union of two classes of different shapes
# would pass silently, and it is either a wrong shape rule or a false equality. With this
# set (REFINE_SHAPE_AUDIT=1), every shape set is also recorded and a step whose e-graph
# holds a class with two shapes raises ShapeConflict: a debugging aid (a second table).
SHAPE_AUDIT = os.environ.get("REFINE_SHAPE_AUDIT", "") not in ("", "0")


class ShapeConflict(RuntimeError):
    """An e-class with two different shapes (Engine.audit_shapes)."""


PARSE_CACHE = 50_000  # parsed statements kept (Engine._parse)
GRAPHS = 48  # e-graphs kept, each declaring the rules some steps can use (Engine._graph)
GRAPH_SLACK = 32  # a step runs on a kept e-graph with up to twice its rules and this many more


@dataclass
class Engine:
    registry: Registry
    symbolic: bool = False  # sizes are PyObjects (ints or refine.ir.sizes.Sym), not i64
    stats: dict[str, float] = field(default_factory=lambda: {"steps": 0, "seconds": 0.0, "reused": 0, "replayed": 0,
                                                             "bounded": 0})
    cache: dict[str, _Solved] = field(default_factory=dict)
    fired: Counter[str] = field(default_factory=Counter)  # rule name -> matches applied, over every step
    audit_shapes: bool = SHAPE_AUDIT
    features: frozenset[str] = frozenset()  # the case's features (Rule.needs): other rules are left out

    def __post_init__(self) -> None:
        reg = self.registry
        self.core = {n: op for n, op in reg.ops.items() if op.core}
        self.sorts = {n: tuple(ATTR_SORTS[k.rstrip("?")] for _, k in op.attrs) for n, op in self.core.items()}
        self.clean_ops = CLEAN_OPS | {n for n, op in self.core.items() if op.clean}
        self._parsed: dict[str, list] = {}
        self._full: bindings.EGraph | None = None
        decls = self.declarations()
        self._decls = Declarations.of(record_shapes(decls) if self.audit_shapes else decls, self.symbolic)
        # e-graphs by the rules and tables they declare, least recently used first
        self._graphs: dict[Need, bindings.EGraph] = {}

    @property
    def eg(self) -> bindings.EGraph:
        """An e-graph with every declaration and rule (steps run on one with the rules they
        can use, see _graph)."""
        if self._full is None:
            self._full = self._declare(self._decls.everything())
        return self._full

    def _declare(self, need: Need) -> bindings.EGraph:
        eg = bindings.EGraph()
        eg.run_program(*self._commands(self._decls.program(need), eg))
        return eg

    def _graph(self, need: Need) -> bindings.EGraph:
        """An e-graph declaring what `need` says and maybe a little more. An e-graph is
        cloned at each step's push and dropped at its pop, at a cost that grows with the
        rules and tables declared (most of a step's time with all of them); building one
        costs a few pushes, so a kept one with up to twice the rules is taken."""
        best: Need | None = None
        for key in self._graphs:
            if need.within(key) and len(key.rules) <= 2 * len(need.rules) + GRAPH_SLACK and \
                    (best is None or key.size < best.size):
                best = key
        if best is not None:
            eg = self._graphs.pop(best)
            self._graphs[best] = eg
            return eg
        # a kept e-graph that lacks some of them is given what it lacks (a rule compiles
        # in 0.1-2 ms, declaring all of a step's costs ten pushes): the one that needs the
        # fewest added rules within the same bound. Its rules are then in another order
        # than in a fresh one: a rule iteration finds the same matches in any order, so
        # the e-graph holds the same equalities; only ties among cheapest terms may differ.
        grow: Need | None = None
        for key in self._graphs:
            union = key.rules | need.rules
            if len(union) <= 2 * len(need.rules) + GRAPH_SLACK and \
                    (grow is None or len(union - key.rules) < len(need.rules - grow.rules)):
                grow = key
        if grow is not None and len(need.rules - grow.rules) < len(need.rules):
            eg = self._graphs.pop(grow)
            best = Need(grow.rules | need.rules, grow.tables | need.tables)
            eg.run_program(*self._commands(self._decls.added(grow, best), eg))
        else:
            if len(self._graphs) >= GRAPHS:
                self._graphs.pop(next(iter(self._graphs)))
            best = need
            eg = self._declare(need)
        self._graphs[best] = eg
        return eg

    def declarations(self) -> list[Sexp]:
        """Every declaration and rule as an expression, size macros unexpanded: the sorts and
        tables, the core ops' constructors, the families' declarations, the shape rules (in
        the `shapes` ruleset) and the rules this engine runs."""
        lines = [
            "(sort T)", "(sort TS (MultiSet T))", "(sort IV (Vec Dim))", "(sort TF (UnstableFn (T) T))",
            f"(constructor D (String) T :cost {LEAF})",
            f"(constructor Out (String) T :cost {LEAF_OUT})",
            f"(constructor {OPAQUE} (String) T :cost {COMPUTE})",
            "(function shape (T) IV :merge old)",
            "(constructor Mark (T) T)", "(relation Found (String))", "(relation Same (String String))",
            "(ruleset shapes)",
        ]
        for name, op in self.core.items():
            args = "TS" if op.kind == "nary" else " ".join(["T"] * op.inputs + list(self.sorts[name]))
            lines.append(f"(constructor {name} ({args}) T :cost {op.cost})")
        out = [x for line in lines for x in parse_cached(line)]
        out += [x for d in self.registry.decls for x in parse_cached(d)]
        out += parse_cached("(rule ((= m (Mark x)) (= x (D n))) ((Found n)))\n"
                            "(rule ((= x (D a)) (= x (D b)) (!= a b)) ((Same a b)))")
        if self.audit_shapes:
            out += parse_cached("(relation ShapeSeen (T IV))\n(relation ShapeConflict (T IV IV))\n(ruleset audit)\n"
                                "(rule ((ShapeSeen e a) (ShapeSeen e b) (!= a b)) ((ShapeConflict e a b)) "
                                ":ruleset audit)")
        for op in self.core.values():
            if op.egglog_shape:
                out += [in_ruleset(x, "shapes") for x in parse_cached(op.egglog_shape)]
            elif op.kind in ("unary", "elementwise"):
                # same-shape ops: the result has its first argument's shape
                xs = " ".join(f"x{i}" for i in range(op.inputs)) + "".join(f" a{i}" for i in range(len(op.attrs)))
                out += parse_cached(f"(rule ((= e ({op.name} {xs})) (= s (shape x0))) ((set (shape e) s)) "
                                    ":ruleset shapes)")
        for r in self.registry.rules:
            if self.symbolic and not r.symbolic or r.needs and r.needs not in self.features:
                continue
            cmd = with_option(r.command, ":name", Str(r.name))  # egglog reports matches by this name
            out.append(in_ruleset(cmd, "shapes") if r.analysis else cmd)
        prelude = [x for line in dims_prelude() for x in parse_cached(line)] if self.symbolic else []
        return prelude + out

    def _run(self, program: str, eg: bindings.EGraph | None = None) -> list:
        eg = self.eg if eg is None else eg
        if self.audit_shapes:
            program = record_shapes_text(program)
        try:
            return eg.run_program(*self._parse(program, eg))
        except bindings.EggSmolError as e:  # pragma: no cover - a bug in a rule file or here
            raise RuntimeError(f"egglog rejected the program: {e}\n--- program ---\n{program[:4000]}") from e

    def _parse(self, program: str, eg: bindings.EGraph) -> list:
        """The program's commands, parsed one top-level statement at a time: egglog's
        Python bindings give every span of a parse its own copy of the whole source text,
        so parsing a program at once costs its length times its size (1 GB of strings for
        the declarations). The engine writes a statement a line: a line that is not a
        whole statement fails to parse, and the program is then cut exactly."""
        try:
            return self._commands(program.split("\n"), eg)
        except bindings.EggSmolError:
            return self._commands(statements(program), eg)

    def _commands(self, statements: Iterable[str], eg: bindings.EGraph) -> list:
        """Statements repeat across steps (canonical leaf names), so their commands are kept."""
        cache = self._parsed
        out: list = []
        for st in statements:
            cmds = cache.get(st)
            if cmds is None:
                cmds = eg.parse_program(st)
                if len(cache) >= PARSE_CACHE:
                    cache.pop(next(iter(cache)))
                cache[st] = cmds
            out.extend(cmds)
        return out

    def step(self, seq: Term, prog: DistProgram, registry: Registry, tensors: Iterable[str],
             checks: Iterable[Term] = (), iterations: int = 0, early: bool = True,
             both: bool = False) -> StepResult:
        """`seq` is a term over rank leaves; `tensors` the rank tensors whose definitions to
        add. Returns the cheapest term equal to `seq`, the rank tensors found equal to it
        and whether each of `checks` was proven equal to it.

        Leaf names only say which tensors are the same, so a step is run on its program
        with the names replaced by their order of appearance, and its result is kept under
        that text: a repeated layer (same ops, shapes and relations over other tensors) is
        proven once and its result renamed, not recomputed. `early`: it may stop early (PATIENCE).
        `both`: the checks are put in the e-graph too, so rules rewrite them as well (an
        equality of two terms that each only reduce to a common form, refine.prove.copies);
        otherwise a check holds when saturation makes `seq`'s class reach it."""
        t0 = time.perf_counter()
        em = _Emitter(self.sorts, prog, registry, self.symbolic)
        for name in tensors:
            em.define(name)
        for out_name, tensor in prog.outputs.items():
            if prog.same.find(tensor) in em.shaped:
                em.outputs = True
                em.lines.append(f"(union (D {quote(prog.same.find(tensor))}) (Out {quote(out_name)}))")
        root = em.term(seq, typed=True)
        checks = list(checks)
        if both:
            for i, c in enumerate(checks):
                em.lines.append(f"(let $__check{i} {em.term(c, typed=True)})")
        told = em.facts()
        em.lines.append(f"(let $__seq {root})")
        em.lines.append("(Mark $__seq)")
        check_texts = [f"$__check{i}" for i in range(len(checks))] if both else \
            [em.term(c, typed=False, inline=True) for c in checks]
        canon, names = canonical("\n".join(em.lines) + "\n;checks\n" + "\n".join(check_texts))
        key = hashlib.sha256(f"{iterations}{'' if early else ' late'}\n{canon}".encode()).hexdigest() \
            if iterations or not early else \
            hashlib.sha256(canon.encode()).hexdigest()
        hit = self.cache.get(key)
        if hit is None:
            program, _, check_part = canon.partition("\n;checks\n")
            hit = self._solve(program, check_part.split("\n") if check_texts else [], iterations or ITERATIONS, early)
            if len(self.cache) >= CACHE_SIZE:
                self.cache.pop(next(iter(self.cache)))
            self.cache[key] = hit
        else:
            self.stats["reused"] += 1
        back = {v: k for k, v in names.items()}
        best = rename(hit.best, back)
        found = [back[f][1] for f in hit.found if f in back and back[f][0] == "D"]
        named = {back[x][1] for x in hit.best.leaves() if back[x][0] == "D"}
        same = [(back[a][1], back[b][1]) for a, b in hit.same if back[a][1] in named]
        self.fired.update(hit.fired)  # a reused step counts as the rules that proved it
        dt = time.perf_counter() - t0
        self.stats["steps"] += 1
        self.stats["bounded"] += hit.bounded
        self.stats["seconds"] += dt
        # the facts told about parts of rank inputs are premises too
        premises = Premises.of(seq, prog, em.defined, em.shaped, em.opaque, em.outputs, hit.fired,
                               [prog.facts[i] for i in told]) if not check_texts else None
        return StepResult(best, hit.cost, found, list(hit.checks), dt, premises, same, hit.bounded)

    def _solve(self, program: str, checks: list[str], iterations: int = ITERATIONS, early: bool = True) -> _Solved:
        # the rules whose queries can match in this e-graph (Declarations.closure): any
        # other never fires, so the step's e-graph and result are the same without them
        told = program + "\n" + "\n".join(checks)
        eg = self._graph(self._decls.closure(record_shapes_text(told) if self.audit_shapes else told))
        self._run("(push)", eg)
        try:
            self._run(program, eg)
            fired, best_out, bounded = self._saturate(iterations, early=early and not checks, eg=eg)
            out = self._run("(print-function Found 100000)\n(print-function Same 100000)", eg)
            best = from_egglog(parse_sexp(best_out.termdag.to_string(best_out.term)), self.sorts)
            cost = int(best_out.cost)
            found = [unquote(f) for f in re.findall(r'\(Found ("[^"]*")\)', str(out[0]))]
            same = tuple((unquote(a), unquote(b)) for a, b in re.findall(r'\(Same ("[^"]*") ("[^"]*")\)', str(out[1])))
            if self.audit_shapes:
                self._audit(program, eg)
            results = []
            for ce in checks:
                try:
                    self._run(f"(check (= $__seq {ce}))", eg)
                    results.append(True)
                except RuntimeError:
                    results.append(False)
        finally:
            self._run("(pop)", eg)
        return _Solved(best, cost, found, tuple(results), fired, same, bounded)

    def _audit(self, program: str, eg: bindings.EGraph) -> None:
        """SHAPE_AUDIT: raise if the step's e-graph holds a class with two shapes, writing
        the step's program (over canonical leaf names) to a file the message names."""
        self._run("(run-schedule (saturate (run shapes)) (run audit))", eg)
        conflicts = str(self._run("(print-function ShapeConflict 20)", eg)[0]).strip()
        if conflicts.strip("()\n "):
            with tempfile.NamedTemporaryFile("w", suffix=".egg", prefix="shape-conflict-", delete=False) as f:
                f.write(program)
            raise ShapeConflict(f"an e-class holds two shapes (a wrong shape rule or a false equality); "
                                f"the step's program is {f.name}:\n{conflicts}")

    def _saturate(self, iterations: int, early: bool,
                  eg: bindings.EGraph) -> tuple[Counter[str], bindings.ExtractBest, bool]:
        """Run up to `iterations` rule iterations (see PATIENCE and NODE_BUDGET); the
        rules' matches, the target's best term and whether the budget stopped it."""
        fired: Counter[str] = Counter()
        best, since, bounded = None, 0, False
        budget = _Budget()
        step = "(run-schedule (saturate (run shapes)) (run))" + ("\n(extract $__seq)" if early else "")
        for _ in range(iterations):
            ran = self._run(step, eg)
            report = ran[-2 if early else -1].report
            matches = sum(report.num_matches_per_rule.values())
            fired.update({k: v for k, v in report.num_matches_per_rule.items() if v})
            if early:
                out = ran[-1]
                if best is None or out.cost < best.cost:
                    best, since = out, 0
                else:
                    since += 1
                if best.cost < COMPUTE and (since >= PATIENCE and self._plain(best) or since >= 1 and matches > FLOOD):
                    break
            if not report.updated:
                break
            if budget.spent(matches, lambda: sum(n for _, n in self._run("(print-size)", eg)[0].sizes)):
                bounded = True
                break
        if best is None:
            best = self._run("(extract $__seq)", eg)[0]
        return fired, best, bounded

    @staticmethod
    def _plain(best: bindings.ExtractBest) -> bool:
        """Whether a term is rank tensors combined by concats and sums only: what the ranks
        hold, as it is. A clean term with another op over rank tensors (a scale, a view, an
        expand of a concat) is often later found to be a concat of other rank tensors, and
        its users then need far fewer rewrites: such a step runs the whole bound."""
        return heads_in(best.termdag.to_string(best.term)) <= PLAIN_HEADS


@dataclass
class _Budget:
    """What a step has spent, iteration by iteration (see NODE_BUDGET)."""

    memory0: int = field(default_factory=lambda: _memory())
    matches: int = 0  # the last iteration's rule matches
    grown: int = 0  # bytes the process gained since the step began
    grew: int = 0  # of which by the last iteration

    def spent(self, matches: int, nodes: Callable[[], int]) -> bool:
        """Whether the next iteration would go past a budget: the matches and the memory
        grow as they grew over the iteration before (the first one's as they are)."""
        ahead = matches * max(1.0, matches / self.matches if self.matches else 1.0)
        self.matches = matches
        if ahead > MATCH_BUDGET or nodes() > NODE_BUDGET:
            return True
        grown = max(_memory() - self.memory0, 0)
        grew, self.grown = grown - self.grown, grown
        more = grew * max(1.0, grew / self.grew if self.grew > 0 else 1.0)
        self.grew = grew
        return grown + more > MEMORY_BUDGET


def _memory() -> int:
    """The process's resident memory in bytes: current where /proc has it, else the peak
    (never lower than the current); 0 where neither can be read (no memory bound)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (ImportError, OSError):
        return 0
    return peak if sys.platform == "darwin" else peak * 1024


@dataclass(frozen=True)
class _Solved:
    """A step's result over canonical leaf names, as the cache keeps it."""

    best: Term
    cost: int
    found: list[str]
    checks: tuple[bool, ...]
    fired: Counter[str]
    same: tuple[tuple[str, str], ...] = ()
    bounded: bool = False


INLINE_CHARS = 2000  # a typed term up to this long is written out in full, a longer one named by a let


class _Emitter:
    """SSA-style egglog text: one `let` per distinct subterm of the sequential term and the
    facts, shapes from Python's types. egglog runs each command at a fixed cost (~40 us; a
    `let` also declares a table that every later push copies), so a definition is one
    `union` with its term inline, and a statement that repeats one already emitted (the
    ranks' replicas of a definition read the same class representatives) is not emitted
    again: adding an e-node or a union the e-graph already holds changes nothing."""

    def __init__(self, sorts: dict[str, tuple[str, ...]], prog: DistProgram, registry: Registry,
                 py: bool = False) -> None:
        self.sorts, self.prog, self.registry, self.py = sorts, prog, registry, py
        self.lines: list[str] = []
        self.emitted: set[str] = set()  # the definitions' unions (define)
        self.names: dict[Term, str] = {}
        self.texts: dict[str, str] = {}  # a let's term text -> its name (two Terms may print alike)
        self.typed: set[str] = set()  # let names and term texts whose shape is set
        self.shaped: set[str] = set()
        self.opaque: set[str] = set()
        self.defined: list[str] = []  # tensors whose definitions the program states, in order
        self.outputs = False  # whether it relates rank outputs (Out leaves)

    def leaf(self, name: str) -> str:
        name = self.prog.same.find(name)
        if name not in self.shaped:
            self.shaped.add(name)
            shape = self.prog.types[name].shape
            self.lines.append(f'(set (shape (D {quote(name)})) {lit(shape, "IV", self.py)})')
        return f"(D {quote(name)})"

    def define(self, name: str) -> None:
        d = self.prog.defs.get(name)
        lhs = self.leaf(name)
        if d is not None:
            self.defined.append(name)
            line = f"(union {lhs} {self.term(d, typed=False, inline=True)})"
            if line not in self.emitted:
                self.emitted.add(line)
                self.lines.append(line)

    def facts(self) -> list[int]:
        """State every fact of the program (DistProgram.facts) that names a rank tensor the
        e-graph holds, until none is left; returns their indices, in the order told."""
        find = self.prog.same.find
        told: list[int] = []
        more = True
        while more:
            more = False
            for i, (a, b) in enumerate(self.prog.facts):
                if i not in told and any(find(x) in self.shaped for x in a.leaves() | b.leaves()):
                    told.append(i)
                    more = True
                    self.lines.append(f"(union {self.term(a, typed=True)} {self.term(b, typed=True)})")
        return told

    def term(self, t: Term, typed: bool, inline: bool = False) -> str:
        if t.op in LEAF_OPS:
            if t.op == "Out":
                return f"(Out {quote(t.attrs[0])})"
            return self.leaf(t.attrs[0])
        if t.op == OPAQUE:
            name = t.attrs[0]
            if name not in self.opaque:
                self.opaque.add(name)
                shape = self.prog.opaque[name].shape
                self.lines.append(f'(set (shape ({OPAQUE} {quote(name)})) {lit(shape, "IV", self.py)})')
            return f"({OPAQUE} {quote(name)})"
        if t in self.names:
            return self.names[t]
        args = [self.term(a, typed, inline) for a in t.args]
        if t.op in NARY:
            text = f"({t.op} (multiset-of {' '.join(args)}))"
        else:
            attrs = [lit(a, s, self.py) for a, s in zip(t.attrs, self.sorts[t.op], strict=True)]
            text = f"({t.op} {' '.join(args + attrs)})" if args or attrs else f"({t.op})"
        if inline:
            return text
        if typed and len(text) <= INLINE_CHARS:
            # stated by setting its shape: the e-node is made where a `let` would make it,
            # and no global (a table each step's e-graph would carry) is declared
            if text not in self.typed:
                self.typed.add(text)
                shape = term_type(t, self.prog, self.registry).shape
                self.lines.append(f"(set (shape {text}) {lit(shape, 'IV', self.py)})")
            self.names[t] = text
            return text
        name = self.texts.get(text)
        if name is None:
            name = self.texts[text] = f"$__t{len(self.texts)}"
            self.lines.append(f"(let {name} {text})")
        self.names[t] = name
        if typed and name not in self.typed:
            self.typed.add(name)
            shape = term_type(t, self.prog, self.registry).shape
            self.lines.append(f"(set (shape {name}) {lit(shape, 'IV', self.py)})")
        return name


# ---------------------------------------------------------------------------------------
# What facts about parts of rank inputs make equal


FACT_DEPTH = 10  # uses after a fact's leaves where a slice may cut out what the facts cover
FACT_RETRY = 12  # definitions back from a failed step's tensors to a fact's leaf (infer's retry)
FACT_ITERATIONS = 24  # and that retry's rule iterations
FACT_RETRY_TENSORS = 128  # no retry over more tensors: aws_llama TP6's scores (266) ran 6 min CPU, 5.6 GB, unfinished


def join_fact_consequences(prog: DistProgram, engine: Engine, registry: Registry) -> int:
    """Rank tensors the facts (refine.ir.layout: a replicated slice of two ranks' fused
    weights) make equal as whole tensors: a slice, on two ranks, of what each computes from
    its own copy (a TP4 rank's key columns of its QKV product, equal to its neighbour's).
    Candidates are the same program position on the two ranks of a fact, a slice within
    `FACT_DEPTH` uses; each is proven by an e-graph over both definitions back to the facts'
    leaves, and joins `prog.same`. Returns how many joined."""
    pairs: set[tuple[str, str]] = set()
    for a, b in prog.facts:
        for x in a.leaves():
            for y in b.leaves():
                if x.rpartition("@")[0] == y.rpartition("@")[0] and x != y:
                    pairs.add((x, y))
    joined = 0
    layer = sorted(pairs)
    seen = set(layer)
    for _ in range(FACT_DEPTH):
        nxt: list[tuple[str, str]] = []
        for x, y in layer:
            ry = y.rpartition("@")[2]
            for u in prog.users.get(x, ()):
                v = f"{u.rpartition('@')[0]}@{ry}"
                if (u, v) in seen or v not in prog.users.get(y, ()) and v not in _users_of_class(prog, y):
                    continue
                if prog.types.get(v) != prog.types[u]:
                    continue
                seen.add((u, v))
                nxt.append((u, v))
                du = prog.defs[u]
                if du is not None and du.op == "slice" and prog.same.find(u) != prog.same.find(v):
                    tensors = _ancestry(prog, [u, v], FACT_DEPTH + 2)
                    res = engine.step(Term("D", (), (u,)), prog, registry, tensors, checks=[Term("D", (), (v,))])
                    if res.checks[0]:
                        prog.same.union(u, v)
                        joined += 1
        layer = sorted(nxt)
    if joined:
        join_congruent(prog)
    return joined


def _users_of_class(prog: DistProgram, x: str) -> set[str]:
    return {u for y in prog.same.group(x) for u in prog.users.get(y, ())}


def _ancestry(prog: DistProgram, names: list[str], depth: int) -> list[str]:
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


# ---------------------------------------------------------------------------------------
# The walk


@dataclass
class Inference:
    relations: dict[str, Term]  # sequential core tensor -> relation over rank tensors
    clean: dict[str, bool]
    steps: dict[str, StepResult]


def node_term(n: Node, rel: dict[str, Term], registry: Registry) -> Term:
    op = registry.ops[n.op]
    args = tuple(rel[a] for a in n.tensor_args())
    if op.kind == "nary":
        return Term(n.op, args)
    return Term(n.op, args, tuple(n.attrs[k] for k, _ in op.attrs if k in n.attrs))


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
STRUCT_FREE = 96  # tensors a structural frontier takes without counting a hop
STRUCT_DEPTH = 4  # how far back an other operand of a walked op may be derived


def _derive(prog: DistProgram, x: str, avail: set[str], depth: int, out: list[str], any_op: bool = False) -> bool:
    """Whether `x` is computed from available tensors by walked ops only (at most `depth`
    definitions back); appends what it takes, inputs first. `any_op`: through every op,
    rank inputs available too."""
    canon = prog.same.find
    if canon(x) in avail or is_constant(prog, x):
        return True
    d = prog.defs.get(x)
    if any_op and d is None:
        return True
    if depth == 0 or d is None or (not any_op and d.op not in _WALK_OPS):
        return False
    for dep in sorted(d.leaves()):
        if not _derive(prog, dep, avail, depth - 1, out, any_op):
            return False
    out.append(x)
    avail.add(canon(x))
    return True


def frontier(prog: DistProgram, leaves: set[str], known: set[str], hops: int,
             defined: frozenset[str] | set[str] = frozenset(), structural: bool = False,
             fact_depth: int = 0) -> list[str]:
    """Rank tensors within `hops` uses of `leaves` whose every input is available, plus the
    leaves' own definitions, in a deterministic order. An input in `defined` (available, like
    the known ones) comes along with its definition, as constants do.

    `structural`: a use by a view, slice, concat, transpose or expand costs no hop, and its
    other operands come along when walked ops compute them from available tensors (a rank
    writing its rotated q back into its fused qkv buffer: a concat with the buffer's
    untouched columns, which are no user of q; then split, viewed and transposed again)."""
    canon = prog.same.find
    avail = {canon(x) for x in known} | {canon(x) for x in leaves}
    chosen: list[str] = [x for x in sorted(leaves) if prog.defs.get(x) is not None]
    seen = set(chosen)
    # the constants the leaves' own definitions read come along too (a rank's comparison
    # with its vocab bound, when the comparison is a leaf)
    for x in list(chosen):
        for dep in sorted(prog.defs[x].leaves()):  # type: ignore[union-attr]
            if is_constant(prog, dep):
                for c in _constant_closure(prog, dep):
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
    free = FREE_INDEX_OPS
    walk = STRUCT_FREE if structural else 0
    for _ in range(hops):
        nxt: set[str] = set()
        todo = sorted(layer)
        while todo:
            x = todo.pop()
            # structural: the users of every tensor equal to x (another rank's copy of a
            # replicated head, joined by join_fact_consequences) are its users too
            # and a copy's users (refine.prove.copies: rank 5's key is rank 4's head) are its tensor's
            for u in sorted(_users_of_class(prog, x)) if structural or x in prog.copies else prog.users.get(x, ()):
                if u in seen or u in nxt:
                    continue
                d = prog.defs[u]
                if walk and d is not None and d.op in _WALK_OPS:
                    trial = set(avail)
                    taken: list[str] = []
                    if all(_derive(prog, dep, trial, STRUCT_DEPTH, taken) for dep in sorted(d.leaves())):
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
                    # a bool/int tensor is index bookkeeping (a vocab range's mask and offset, a
                    # few ops over the ids each): it costs no hop, so the lookup it feeds and
                    # the lookup's users stay as near as they are to the table
                    if free and prog.types[u].dtype in INDEX_DTYPES:
                        free -= 1
                        avail.add(canon(u))
                        todo.append(u)
        # users of any replica of a layer tensor count too
        for u in sorted(nxt):
            # constants (a literal operand becomes `full`; `expand(full)`, ...) come along
            for dep in sorted(prog.defs[u].leaves()):  # type: ignore[union-attr]
                if dep in defined and dep not in seen:
                    seen.add(dep)
                    chosen.append(dep)
                if is_constant(prog, dep):
                    for c in _constant_closure(prog, dep):
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
        _fact_chains(prog, leaves, chosen, seen, fact_depth)
    return chosen


def _fact_chains(prog: DistProgram, leaves: set[str], chosen: list[str], seen: set[str], depth: int = 0) -> None:
    """Append to `chosen` the definitions of the rank tensors the e-graph names without one
    (the leaves, what chosen definitions read) that walked ops compute from a fact's leaf
    (refine.ir.layout), with the chains between. A fact is told only where the e-graph holds
    its leaves, and says nothing of a tensor computed from them whose definition is not
    stated: a relation naming one rank's broadcast of a replicated bias (`addmm.expand@1`)
    next to a rank's sum with its own (`addmm.expand@0`) is proven only through both
    broadcasts' definitions. Definitions are true equalities: this only adds knowledge.

    With `depth`, through every op up to `depth` definitions back (rank inputs available):
    a rank's key heads copied by a define reach the scores through the projection and the
    rotary (FACT_RETRY), with the other operands on the way (the rotary's cos)."""
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
        if _derive(prog, x, trial, depth or STRUCT_DEPTH, taken, any_op=bool(depth)):
            for y in taken:
                if y not in seen:
                    seen.add(y)
                    chosen.append(y)


def _reads_fact(prog: DistProgram, tensors: list[str]) -> bool:
    """Whether a definition among `tensors` reads a fact's leaf."""
    canon, leaves = prog.same.find, _fact_leaves(prog)
    return any(canon(y) in leaves for t in tensors if (d := prog.defs.get(t)) is not None for y in d.leaves())


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


def _constant_closure(prog: DistProgram, name: str) -> list[str]:
    """A constant rank tensor and the constants its definition reads, recursively."""
    out, stack = [], [name]
    while stack:
        x = stack.pop()
        if x in out:
            continue
        out.append(x)
        stack.extend(sorted(prog.defs[x].leaves()))  # type: ignore[union-attr]
    return out


def infer(seq: Graph, inputs: dict[str, Term], prog: DistProgram, engine: Engine, registry: Registry,
          hops: tuple[int, ...] = (3, 8), replay: bool = True) -> Inference:
    """Relate every sequential node, in topological order. A node with no clean relation
    keeps its best term for the report, but the nodes using it see it as an opaque leaf
    (refine.ir.term.OPAQUE): an unclean term carried along would grow with every op after it and
    make each later e-graph larger, while it is already known not to be what the ranks
    hold. A node over an opaque input gets no wider retry: it cannot become clean by
    finding more rank tensors for the inputs that are clean. The exception is a fused op
    (`Op.fuse`: softmax, which blockwise attention never materialises): with no clean
    relation near its inputs, its users see it as the op over its inputs' relations and
    search the rank program `DEEP_HOPS` uses deep for their own counterpart.

    With `replay`, a node whose term has the shape of an earlier clean step's is first
    offered to `refine.prove.reuse.Replayer`: that step's premises renamed onto this node, each
    checked against the rank program, give its result renamed (a repeated layer is proven
    once); when they do not hold, the node is proven as usual."""
    down = dict(inputs)  # what later nodes see: the clean relation, or an opaque leaf
    shown = dict(inputs)  # the best term found, for reports and expectations
    clean = {k: True for k in inputs}
    steps: dict[str, StepResult] = {}
    known: set[str] = {n for n, d in prog.defs.items() if d is None}
    # see _counterparts: available, with their definitions, to the sequential nodes within
    # COUNTERPART_DEPTH uses of the step that found them (kept for every later step, each
    # layer's made every later frontier larger: aws_llama TP8 eight layers took 3.6 GB)
    offered: dict[str, dict[str, int]] = {}  # node -> counterpart -> uses it may still go
    fusing = {name for name, op in registry.ops.items() if op.fuse}
    # a repeated layer's steps are instantiated from an earlier, identical one (refine.prove.reuse)
    replayer = Replayer(prog, engine.stats, engine.fired) if replay else None
    carried: set[str] = set()  # unclean nodes whose users see their term (CARRY_OPS)
    if prog.facts:
        join_fact_consequences(prog, engine, registry)
    for n in seq.nodes:
        term = node_term(n, down, registry)
        leaves = term.leaves()
        ops = term.ops()
        over_fused = any(a.ops() & fusing for a in term.args)
        over_carried = any(a in carried for a in n.args if isinstance(a, str))
        # a fused op's own relation is searched near its inputs only (if there is one
        # further away, it is its users' business: they search deep)
        tries = hops[:1] if OPAQUE in ops or n.op in fusing else hops
        if OPAQUE not in ops and over_fused:
            tries = (hops[0], DEEP_HOPS)  # over a fused term: its rank counterpart lies far downstream
        elif OPAQUE not in ops and over_carried:
            # the ranks' counterpart of a carried term is as far as its chain; a view of one
            # (the rank holds no more of it than of the term) is searched near only
            tries = hops[:1] if n.op in _STRUCTURAL else (hops[0], CARRY_HOPS)
        counterparts = _offered_to(n, offered)
        cps = set(counterparts)
        res = replayer.replay(term) if replayer is not None else None
        tensors: list[str] = []
        if res is None:
            for h in tries:
                tensors = frontier(prog, _with_replicas(prog, leaves), known | cps, h, cps)
                res = engine.step(term, prog, registry, tensors, iterations=DEEP_ITERATIONS if h == DEEP_HOPS else 0)
                if res.clean:
                    break
            assert res is not None
            if not res.clean and OPAQUE not in ops and _writes_back_near(prog, _with_replicas(prog, leaves)):
                # the ranks write what the inputs relate to back into a buffer and read it out
                # again: retried once over the structural chain (only there, so a step that
                # fails elsewhere keeps the search, and the culprit, it had)
                tensors = frontier(prog, _with_replicas(prog, leaves), known | cps, tries[0], cps,
                                   structural=True)
                res = engine.step(term, prog, registry, tensors)
            if not res.clean and OPAQUE not in ops and n.op not in fusing and prog.facts:
                # a fact about rank inputs (a define's copied KV heads) matters far downstream
                # (the scores, through the projection and the rotary): retried once with the
                # chains from the facts' leaves through every op, and more iterations; the
                # first result stays when this one is no better (the culprit's report)
                more = frontier(prog, _with_replicas(prog, leaves), known | cps, tries[-1], cps, fact_depth=FACT_RETRY)
                if len(more) <= FACT_RETRY_TENSORS and _reads_fact(prog, more):
                    # no early stop: the chains' rewrites make the best term no cheaper for
                    # many iterations before the copies meet
                    again = engine.step(term, prog, registry, more, iterations=FACT_ITERATIONS, early=False)
                    if again.clean:
                        tensors, res = more, again
            if replayer is not None and res.clean:
                replayer.record(term, res)
        shown[n.name] = res.best
        steps[n.name] = res
        known |= res.best.leaves()
        if res.clean:
            for c in _counterparts(prog, n.op, leaves, tensors) - known:
                counterparts[c] = COUNTERPART_DEPTH
        offered[n.name] = counterparts
        if res.clean and depth(res.best) <= TERM_DEPTH:
            clean[n.name] = True
            down[n.name] = res.best
        elif OPAQUE not in ops and ((n.op in fusing and not over_fused) or (over_fused and n.op in _PASS_FUSED)) \
                and depth(term) <= TERM_DEPTH:
            # its users see the op over its inputs' relations; left out of `clean`: whether
            # it is right is decided at its users (localization passes over it). Views and
            # concats of a fused term pass it on too (a stack of norms, rules/vector_norm.py)
            down[n.name] = term
        else:
            clean[n.name] = False
            masks = not n.type.dtype.startswith(("float", "bfloat")) or over_carried
            if masks and OPAQUE not in ops and _dag_size(term) <= CARRY_OPS and depth(term) <= TERM_DEPTH:
                # a small unclean mask or index (bool or integer), and what is computed from
                # it, is carried to its users: no rank holds the sequential mask over the
                # whole vocab, only what it selects (Megatron's vocab-parallel target lookup)
                down[n.name] = term
                carried.add(n.name)
            else:
                prog.opaque[n.name] = n.type
                down[n.name] = opaque(n.name)
        for f in res.found:
            if f in prog.types:
                prog.same.union(res.found[0], f)
        if res.clean:
            for a, b in res.same:
                if prog.types.get(a) == prog.types.get(b) is not None:
                    prog.same.union(a, b)
    # a carried node that a clean relation took in (through its users, or carried users of
    # it that were) is, like a fused one, left out of `clean`: what matters about it is
    # proven at that user. One that nothing clean took in stays unclean (a culprit).
    users: dict[str, list[str]] = {}
    for n in seq.nodes:
        for a in n.tensor_args():
            users.setdefault(a, []).append(n.name)
    absorbed: set[str] = set()
    for n in reversed(seq.nodes):
        if n.name in carried and any(clean.get(u) or u in absorbed for u in users.get(n.name, ())):
            absorbed.add(n.name)
            del clean[n.name]
    return Inference(shown, clean, steps)


WRITE_BACK_HOPS = 3  # how many walked ops after a step's leaves a write-back is looked for


def _writes_back_near(prog: DistProgram, leaves: set[str]) -> bool:
    """Whether a rank writes one of `leaves` (through views, slices, concats) into a buffer
    within `WRITE_BACK_HOPS` uses: a concat (what slice_scatter lowers to) that holds a
    slice of a tensor of the concat's own shape, the buffer's untouched part."""
    layer = set(leaves)
    seen = set(layer)
    for _ in range(WRITE_BACK_HOPS):
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


_PASS_FUSED = frozenset({"view", "cat"})  # ops whose result over a fused term stays a term (infer)


def _dag_size(t: Term) -> int:
    """The number of distinct non-leaf subterms of t, concats not counted: how a tensor is
    laid out over the ranks (a concat of n rank pieces is n - 1 binary cats) is no op of
    the computation, and CARRY_OPS must not depend on the rank count."""
    seen: set[Term] = set()
    todo = [t]
    while todo:
        x = todo.pop()
        if x in seen or not x.args:
            continue
        seen.add(x)
        todo.extend(x.args)
    return sum(1 for x in seen if x.op != "cat")


def _offered_to(n: Node, offered: dict[str, dict[str, int]]) -> dict[str, int]:
    """The counterparts offered to `n`: its inputs', one use further on, while within depth."""
    out: dict[str, int] = {}
    for a in n.tensor_args():
        for c, left in offered.get(a, {}).items():
            if left > 0 and left - 1 > out.get(c, -1):
                out[c] = left - 1  # offered at 0 too, but passed on no further
    return out


def _counterparts(prog: DistProgram, op: str, leaves: set[str], tensors: list[str]) -> set[str]:
    """Rank tensors of a step that apply the sequential node's own op to the tensors its
    inputs relate to (with other attributes: a broadcast to a rank's head count). The
    relation found may be another rank tensor of equal value and shape (a query's rotary
    factor standing for the key's, where the ranks' query heads are as many as the key's),
    and the later steps must still reach the ranks' own uses of their counterparts, and know
    what they are. Only makes them (and their definitions) available to later frontiers:
    what is proven stays the e-graph's business."""
    find = prog.same.find
    ins = {find(x) for x in _with_replicas(prog, leaves)}
    out: set[str] = set()
    for u in tensors:
        d = prog.defs.get(u)
        if d is not None and d.op == op and d.leaves() and {find(x) for x in d.leaves()} <= ins:
            out.add(u)
    return out


def _with_replicas(prog: DistProgram, leaves: set[str]) -> set[str]:
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
