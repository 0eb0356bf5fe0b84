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
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from refine.ir.sexp import (
    Sexp,
    Str,
    dims_prelude,
    head,
    heads_in,
    parse,
    parse_cached,
    parse_one,
    statements,
    with_option,
)
from refine.ir.term import (
    LEAF_OPS,
    NARY,
    OPAQUE,
    Term,
    from_egglog,
    lit,
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
from refine.prove.policy import DEFAULT, Policy
from refine.prove.reuse import Premises, StepResult
from refine.relate.program import DistProgram, term_type

CLEAN_OPS = {"D", "Out"}
# How long a step searches (Policy.iterations, patience, flood) is the search policy's
# (refine.prove.policy); what it may spend whatever the search is bounded here.
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
    policy: Policy = DEFAULT  # the search policy: a step's iterations, early stop; the walk's strategies

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
        """An e-graph declaring what `need` says and maybe a little more, each in the order
        Declarations.program gives. An e-graph is cloned at each step's push and dropped at
        its pop, at a cost that grows with the rules and tables declared (most of a step's
        time with all of them); building one costs a few pushes, so a kept one with up to
        twice the rules is taken."""
        best: Need | None = None
        for key in self._graphs:
            if need.within(key) and len(key.rules) <= 2 * len(need.rules) + GRAPH_SLACK and \
                    (best is None or key.size < best.size):
                best = key
        if best is not None:
            eg = self._graphs.pop(best)
            self._graphs[best] = eg
            return eg
        # none: a fresh one declaring just `need`. A kept one is never given rules it lacks:
        # declared after its others, they would stand in another order than in a fresh
        # e-graph, and egglog's rule iteration depends on that order (which matches it
        # counts, which terms it makes, which of equally cheap terms it extracts: 22 of
        # aws_llama TP6's first 40 steps differed). Which kept e-graph a step finds depends
        # on the steps before it, in this check or an earlier one; declared in one order, a
        # superset gives what a fresh e-graph gives (its other rules never fire), so a
        # step's result depends on its program alone.
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
        proven once and its result renamed, not recomputed. `early`: it may stop early (Policy.patience).
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
            hit = self._solve(program, check_part.split("\n") if check_texts else [], iterations, early)
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

    def _solve(self, program: str, checks: list[str], iterations: int = 0, early: bool = True) -> _Solved:
        # the rules whose queries can match in this e-graph (Declarations.closure): any
        # other never fires, so the step's e-graph and result are the same without them
        told = program + "\n" + "\n".join(checks)
        eg = self._graph(self._decls.closure(record_shapes_text(told) if self.audit_shapes else told))
        self._run("(push)", eg)
        try:
            self._run(program, eg)
            fired, best_out, bounded = self._saturate(iterations or self.policy.iterations,
                                                      early=early and not checks, eg=eg)
            out = self._run("(print-function Found 100000)\n(print-function Same 100000)", eg)
            best = from_egglog(parse_one(best_out.termdag.to_string(best_out.term)), self.sorts)
            cost = int(best_out.cost)
            found = [unquote(str(a)) for (a,) in _rows(str(out[0]), "Found")]
            same = tuple((unquote(str(a)), unquote(str(b))) for a, b in _rows(str(out[1]), "Same"))
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
        """Run up to `iterations` rule iterations (see Policy.patience and NODE_BUDGET); the
        rules' matches, the target's best term and whether the budget stopped it."""
        fired: Counter[str] = Counter()
        policy = self.policy
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
                if best.cost < COMPUTE and (since >= policy.patience and self._plain(best) or since >= 1 and matches > policy.flood):
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


def _rows(printed: str, table: str) -> list[tuple[Sexp, ...]]:
    """The argument tuples of `table`'s rows in egglog's `print-function` output."""
    out: list[tuple[Sexp, ...]] = []
    todo = parse(printed)[::-1]
    while todo:
        x = todo.pop()
        if head(x) == table:
            out.append(x[1:])  # type: ignore[index]
        elif isinstance(x, tuple):
            todo.extend(reversed(x))  # in printed order
    return out
