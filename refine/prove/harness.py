"""Numerical soundness check of every rewrite rule, one rule at a time.

1. **Seeds.** `SeedGen` builds random, well-shaped terms over leaves `D("x0")`, ... from the
   core op grammar, biased toward what rules match: every core op applied to random
   arguments, with each tensor argument in turn replaced by a concat of two or three
   pieces (uneven, size-1 pieces included), a slice, a transpose, a view, an expand, a
   constant, a sum (of one, two or three terms), a scale or a max; each op result sliced.
   Shapes are small (1 to 4 per dim), so edge shapes come up often. Each op's seeds come
   from a random stream of its own, so a new op leaves the others' seeds as they were;
   index arguments hold integers below the indexed size. The rule families add their own
   seeds, each list from a random stream of its own too: `SHARED_SEEDS(gen)`, small terms
   the generic forms rarely make (nested structure, the helper constructors applied
   directly, sure matches), given to every rule whose query they fit, and `SEEDS(gen)`,
   whole formulas, given to the family's own rules.
2. **One rule at a time.** One egglog e-graph holds every declaration, the shape analysis
   (ruleset `shapes`, as in `refine.prove.engine.Engine`) and each rule in a ruleset of its own.
   For each rule: push, insert the seeds whose ops cover the rule's query (its family's
   SEEDS and every family's SHARED_SEEDS that do, then generic ones), run the rule a
   few times (saturating the shape analysis in between), serialize the e-graph, pop.
3. **Check.** Leaves get random float64 values (ids: int64 below the table size, masks:
   bool, operands of log/sqrt/div: positive). Every e-node of the e-graph read back is
   evaluated with the ops' torch references, its children taken by their e-class; every
   e-node must equal (allclose, float64) the e-class's value, the shape analysis must agree
   with the evaluated shape of its e-class, and the analyses must be right: prefix products
   (`pp`), the index of the terms of each sum (`SumHas`: a term of a sum of that class;
   `SumPair`: a class holding the sum of two terms) and the facts the families' FACTS
   say (`NonNeg`, rules/vector_norm.py: no element negative). Any difference can only come from the one
   rule in the e-graph.
4. **Coverage.** A rule that never changed its e-graph was not tested: it is reported.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

import torch
from egglog import bindings

from refine.ir.graph import TensorType
from refine.ir.sexp import Sexp, Sym, emit
from refine.ir.term import Term, lit, quote
from refine.ops.interp import close, eval_term, helper_sorts, max_err
from refine.ops.registry import ArgSpec, Registry, Rule, ShapeError
from refine.prove.declarations import heads, in_ruleset
from refine.prove.engine import Engine

ITERATIONS = 3

# ---------------------------------------------------------------------------------------
# Seeds


@dataclass(frozen=True)
class LeafSpec:
    shape: tuple[int, ...]
    kind: str  # f: any float, p: positive float, b: bool, i: int ids below `bound`
    bound: int = 0


@dataclass
class SeedGen:
    registry: Registry
    seed: int = 0
    instances: int = 3  # random instances of each op
    leaves: dict[str, LeafSpec] = field(default_factory=dict)
    # leaves that stand for a rank tensor with a definition: the harness unions the leaf
    # with its term and gives it the term's value (rules guarded to rank tensors fire)
    defined: dict[str, Term] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.aux = random.Random(f"{self.seed}:aux")
        self.core = {n: op for n, op in self.registry.ops.items() if op.core}

    # -- leaves and shapes

    def leaf(self, shape: Iterable[int], kind: str = "f", bound: int = 0) -> Term:
        name = f"x{len(self.leaves)}"
        self.leaves[name] = LeafSpec(tuple(shape), kind, bound)
        return Term("D", (), (name,))

    def defined_leaf(self, t: Term) -> Term:
        x = self.leaf(self.shape(t), self.kind(t))
        self.defined[x.attrs[0]] = t
        return x

    def shape(self, t: Term) -> tuple[int, ...]:
        return self.type(t).shape

    def type(self, t: Term) -> TensorType:
        if t.op == "D":
            spec = self.leaves[t.attrs[0]]
            return TensorType(spec.shape, {"i": "int64", "b": "bool"}.get(spec.kind, "float32"))
        op = self.registry.ops[t.op]
        attrs = {k: v for (k, _), v in zip(op.attrs, t.attrs, strict=False)}
        return op.shape([self.type(a) for a in t.args], attrs)

    def kind(self, t: Term) -> str:
        if t.op == "D":
            return self.leaves[t.attrs[0]].kind
        return "f"

    def dims(self, n: int | None = None, lo: int = 1) -> tuple[int, ...]:
        n = self.rng.choice([1, 2, 2, 3, 3]) if n is None else n
        return tuple(self.rng.choice([1, 2, 3, 3, 4, 4]) if i >= lo - 1 else 2 for i in range(n))

    # -- tensors of a given shape and kind, in many forms

    def like(self, shape: tuple[int, ...], kind: str, form: str, bound: int = 0, dim: int | None = None) -> Term | None:
        """A term of this shape and kind built as `form` (None if the form does not fit)."""
        r = self.rng
        nd = len(shape)
        structural = kind in ("b", "i")
        if form == "leaf":
            return self.leaf(shape, kind, bound)
        if form in ("cat", "cat3"):
            ds = [d for d in range(nd) if shape[d] >= (3 if form == "cat3" else 2)]
            if dim is not None:
                ds = [d for d in ds if d == dim]
            if not ds:
                return None
            d = r.choice(ds)
            n = shape[d]
            cuts = sorted(r.sample(range(1, n), 2 if form == "cat3" else 1))
            sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
            parts = [self.leaf(shape[:d] + (s,) + shape[d + 1:], kind, bound) for s in sizes]
            out = parts[-1]
            for p in reversed(parts[:-1]):
                out = Term("cat", (p, out), (d,))
            return out
        if form == "slice":
            if nd == 0:
                return None
            d = r.randrange(nd)
            extra = r.choice([0, 1, 2])
            s = r.randint(0, extra)
            big = shape[:d] + (shape[d] + extra,) + shape[d + 1:]
            return Term("slice", (self.leaf(big, kind, bound),), (d, s, s + shape[d]))
        if form == "transpose":
            if nd < 2:
                return None
            i, j = r.sample(range(nd), 2)
            src = list(shape)
            src[i], src[j] = src[j], src[i]
            return Term("transpose", (self.leaf(src, kind, bound),), (i, j))
        if form == "view":
            if nd == 0:
                return None
            return Term("view", (self.leaf(self.refactor(shape), kind, bound),), (shape,))
        if form == "expand":
            if nd == 0:
                return None
            keep = r.randint(0, nd)  # dims of x: the last `keep` dims
            src = tuple(1 if r.random() < 0.5 else s for s in shape[nd - keep:])
            inner = None
            if self.aux.random() < 0.3:  # sometimes a concat broadcast along its other dims
                main, self.rng = self.rng, self.aux  # own stream: the other seeds stay as they were
                try:
                    inner = self.like(src, kind, "cat", bound)
                finally:
                    self.rng = main
            return Term("expand", (inner or self.leaf(src, kind, bound),), (shape,))
        if structural:
            return None
        if form == "full":
            return Term("full", (), (r.choice([0.5, 1.0, 2.0]) if kind == "p" else r.choice([0.0, -1.5, 2.0]), shape))
        if form in ("sum", "sum1", "sum3"):
            n = {"sum": 2, "sum1": 1, "sum3": 3}[form]
            return Term("Sum", tuple(self.leaf(shape, kind) for _ in range(n)))
        if form in ("max", "max1"):
            return Term("Max", tuple(self.leaf(shape, kind) for _ in range(2 if form == "max" else 1)))
        if form == "scale":
            f = r.choice([Fraction(1), Fraction(2), Fraction(1, 3), Fraction(3, 2)] +
                         ([] if kind == "p" else [Fraction(-1, 2)]))
            return Term("Scale", (self.leaf(shape, kind),), (f,))
        raise ValueError(form)

    def refactor(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Another shape with the same number of elements: merge, split or flatten."""
        r = self.rng
        n = math.prod(shape)
        choice = r.choice(["merge", "split", "flat", "same"])
        if choice == "merge" and len(shape) >= 2:
            i = r.randrange(len(shape) - 1)
            return shape[:i] + (shape[i] * shape[i + 1],) + shape[i + 2:]
        if choice == "split":
            i = r.randrange(len(shape))
            fs = [f for f in range(1, shape[i] + 1) if shape[i] % f == 0]
            f = r.choice(fs)
            return shape[:i] + (f, shape[i] // f) + shape[i + 1:]
        if choice == "flat":
            return (n,)
        return shape

    # -- op instances

    def instance(self, name: str) -> tuple[list[ArgSpec], tuple[Any, ...]] | None:
        """Argument specs (shape, kind, bound) and attributes of a random application: the
        op's family's sampler (`refine.ops.registry.Sample`, a family's SAMPLES) if it has
        one, else same-shape float arguments."""
        r = self.rng
        op = self.core[name]
        x = self.dims()
        sample = self.registry.samples.get(name)
        if sample is not None:
            return sample.args(self, x)
        if op.kind == "unary":
            return [(x, "f", 0)], ()
        if op.kind == "elementwise":
            return [(x, "f", 0), (x, "f", 0)], ()
        if op.inputs > 0 and all(k.rstrip("?") == "dim" for _, k in op.attrs):
            # an op from a rule file refine has no sampler for: same-shape float arguments
            # and a random dim for each dim attribute (none if its shape rule refuses them)
            specs, attrs = [(x, "f", 0)] * op.inputs, tuple(r.randrange(len(x)) for _ in op.attrs)
            try:
                op.shape([TensorType(x)] * op.inputs, {k: v for (k, _), v in zip(op.attrs, attrs, strict=True)})
            except ShapeError:
                return None
            return specs, attrs
        return None

    def build(self, name: str, args: list[Term], attrs: tuple[Any, ...]) -> Term:
        return Term(name, tuple(args), attrs)

    # -- the seed set

    FORMS = ("cat", "cat3", "slice", "transpose", "view", "expand", "full", "sum", "sum1", "sum3", "scale", "max", "max1")

    def seeds(self) -> list[Term]:
        """The generic seeds; the families' go to `family_seeds` and `shared_seeds`."""
        out: list[Term] = []
        for name in sorted(self.core):
            # one random stream per op: a new op leaves every other op's seeds as they were
            self.rng = random.Random(f"{self.seed}:{name}")
            sample = self.registry.samples.get(name)
            for _ in range(self.instances * (sample.count if sample else 1)):
                inst = self.instance(name)
                if inst is None:
                    continue
                specs, attrs = inst
                base = [self.leaf(s, k, b) for s, k, b in specs]
                t0 = self.build(name, base, attrs)
                out.append(t0)
                out.extend(self.sliced(t0))
                for i, (shape, kind, bound) in enumerate(specs):
                    for form in self.FORMS:
                        dim = None
                        if form.startswith("cat") and sample is not None and sample.concat_dim is not None:
                            dim = sample.concat_dim(self, i, attrs)
                        arg = self.like(shape, kind, form, bound, dim)
                        if arg is None:
                            continue
                        args = list(base)
                        args[i] = arg
                        t = self.build(name, args, attrs)
                        out.append(t)
                        if self.rng.random() < 0.3:
                            out.extend(self.sliced(t))
        # the families' seeds (SEEDS, SHARED_SEEDS), each list from a random stream of its
        # own; made last, so the leaves above keep their values
        self.family_seeds: dict[str, list[Term]] = {}
        for family, make in self.registry.seeders:
            self.rng = random.Random(f"{self.seed}:{family}")
            self.family_seeds[family] = [canonical(t) for t in make(self)]
        self.shared_seeds: dict[str, list[Term]] = {}
        for family, make in self.registry.shared_seeders:
            self.rng = random.Random(f"{self.seed}:{family}:shared")
            self.shared_seeds[family] = [canonical(t) for t in make(self)]
        return [canonical(t) for t in out]

    def sliced(self, t: Term) -> list[Term]:
        shape = self.shape(t)
        if not shape:
            return []
        d = self.rng.randrange(len(shape))
        n = shape[d]
        s = self.rng.randint(0, n - 1)
        e = self.rng.randint(s + 1, n)
        return [Term("slice", (t,), (d, s, e))]


def canonical(t: Term) -> Term:
    """Sum and Max are multisets: a fixed order of their terms."""
    args = tuple(canonical(a) for a in t.args)
    if t.op in ("Sum", "Max"):
        args = tuple(sorted(args, key=str))
    return replace(t, args=args)


def leaf_values(leaves: dict[str, LeafSpec], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, spec in leaves.items():
        if spec.kind == "b":
            out[name] = torch.rand(spec.shape, generator=g, dtype=torch.float64) < 0.5
        elif spec.kind == "i":
            out[name] = torch.randint(0, spec.bound, spec.shape, generator=g)
        elif spec.kind == "p":
            out[name] = torch.rand(spec.shape, generator=g, dtype=torch.float64) + 0.5
        else:
            out[name] = torch.randn(spec.shape, generator=g, dtype=torch.float64)
    return out


# ---------------------------------------------------------------------------------------
# The e-graph: every declaration, each rule in its own ruleset


def ruleset_name(i: int) -> str:
    return f"rule_{i}"


def query_heads(rule: Rule, names: set[str]) -> set[str]:
    """The constructors a rule's query (or rewrite's left side) mentions."""
    return heads(rule.command[1], names)


def analysis_writes(rule: Rule, names: set[str]) -> set[str]:
    """The tables an analysis rule fills: constructors its actions (or right side) apply,
    directly or through `unstable-fn`."""
    return heads(rule.command[2], names, strings=True)


@dataclass
class RuleResult:
    rule: str
    fired: bool
    seeds: int
    nodes: int
    checked: int
    failures: list[str]
    seconds: float


@dataclass
class Harness:
    registry: Registry
    seed: int = 0
    instances: int = 3
    iterations: int = ITERATIONS
    max_seeds: int = 150
    symbolic: bool = False  # compile the rules for PyObject sizes, as symbolic checks run them

    def __post_init__(self) -> None:
        reg = self.registry
        bare = replace(reg, rules=[], ops=dict(reg.ops), decls=list(reg.decls), families=list(reg.families))
        engine = Engine(bare, symbolic=self.symbolic)
        self.engine_sorts = engine.sorts
        decls = engine.declarations()  # declarations and shape rules, no rewrite rules
        self.hsorts = helper_sorts(reg)
        self.sorts: dict[str, tuple[str, ...]] = dict(self.engine_sorts)
        for h, ss in self.hsorts.items():
            self.sorts[h] = tuple(s for s in ss if s != "T")
        program: list[Sexp] = list(decls)
        self.checked_rules: list[tuple[int, Rule]] = []
        self.always: list[Rule] = []  # analyses: they run with the shape rules, as in the engine
        for i, r in enumerate(reg.rules):
            if self.symbolic and not r.symbolic:
                continue
            if r.analysis:
                program.append(in_ruleset(r.command, "shapes"))
                self.always.append(r)
            else:
                program.append((Sym("ruleset"), Sym(ruleset_name(i))))
                program.append(in_ruleset(r.command, ruleset_name(i)))
                self.checked_rules.append((i, r))
        self.eg = bindings.EGraph()
        self._run("\n".join(emit(x, self.symbolic) for x in program))
        gen = SeedGen(reg, self.seed, self.instances)
        self.seed_terms = gen.seeds()
        self.gen = gen
        # every seed with the constructors it holds: a rule is given the seeds holding its query's
        self.generic_pool = [(t, t.ops()) for t in self.seed_terms]
        self.family_pool = {f: [(t, t.ops()) for t in ts] for f, ts in gen.family_seeds.items()}
        self.shared_pool = [(t, t.ops()) for ts in gen.shared_seeds.values() for t in ts]
        self.values = leaf_values(gen.leaves, self.seed)
        for name, t in gen.defined.items():
            self.values[name] = eval_term(t, self.registry, self.values, {})
        self.cache: dict[Term, torch.Tensor] = {}
        names = set(self.sorts) | {"D"}
        tables = names | {"pp", "SumPair", "SumStop"} | set(reg.facts)
        self.writes = {r.name: analysis_writes(r, tables) for r in self.always}
        made = set().union(*self.writes.values())  # seeds need not hold what analyses make
        self.heads = {r.name: query_heads(r, names) - made for _, r in self.checked_rules}
        self.t_ops = names
        self.analysis_checked: Counter[str] = Counter()  # analysis table -> entries checked

    def _run(self, program: str) -> list:
        return self.eg.run_program(*self.eg.parse_program(program))

    # -- emitting seeds

    def _emit(self, seeds: list[Term]) -> str:
        """Each seed subterm once, inline (egglog's `let` globals scale badly), with its
        shape, as the engine types the sequential term."""
        lines: list[str] = []
        text: dict[Term, str] = {}

        def go(t: Term) -> str:
            if t in text:
                return text[t]
            if t.op == "D":
                s = f"(D {quote(t.attrs[0])})"
                text[t] = s  # first: a definition may name the leaf again (a sum holding a multiple of itself)
                if t.attrs[0] in self.gen.defined:
                    lines.append(f"(union {s} {go(self.gen.defined[t.attrs[0]])})")
            else:
                args = [go(a) for a in t.args]
                if t.op in ("Sum", "Max"):
                    s = f"({t.op} (multiset-of {' '.join(args)}))"
                elif t.op in self.hsorts:
                    ts, rest = iter(args), iter(t.attrs)
                    parts = [next(ts) if so == "T" else lit(next(rest), so, self.symbolic) for so in self.hsorts[t.op]]
                    s = f"({t.op} {' '.join(parts)})"
                else:
                    attrs = [lit(a, so, self.symbolic) for a, so in zip(t.attrs, self.sorts[t.op], strict=True)]
                    s = f"({t.op} {' '.join(args + attrs)})" if args or attrs else f"({t.op})"
            text[t] = s
            if t.op in self.hsorts:
                lines.append(f"(union {s} {s})")
            else:
                lines.append(f"(set (shape {s}) {lit(self.gen.shape(t), 'IV', self.symbolic)})")
            return s

        for seed in seeds:
            go(seed)
        return "\n".join(lines)

    # -- one rule

    def seeds_for(self, rule: Rule) -> list[Term]:
        """The seeds holding every constructor the rule's query names: its family's SEEDS and
        every family's SHARED_SEEDS that do, then generic ones, a fixed random choice of
        them filling up to `max_seeds`."""
        heads = self.heads[rule.name]
        given = [t for t, ops in self.family_pool.get(rule.family, []) if heads <= ops]
        given += [t for t, ops in self.shared_pool if heads <= ops]
        fit = [t for t, ops in self.generic_pool if heads <= ops]
        room = max(self.max_seeds - len(given), 0)
        if len(fit) > room:
            fit = random.Random(f"{self.seed}:{rule.name}").sample(fit, room)
        return given + fit

    def check_rule(self, index: int, rule: Rule) -> RuleResult:
        t0 = time.perf_counter()
        seeds = self.seeds_for(rule)
        self._run("(push)")
        try:
            self._run(self._emit(seeds))
            self._run("(run-schedule (saturate (run shapes)))")
            before = _counts(self._serialize())
            self._run(f"(run-schedule (repeat {self.iterations} (saturate (run shapes)) (run {ruleset_name(index)})) "
                      "(saturate (run shapes)))")
            graph = self._serialize()
        finally:
            self._run("(pop)")
        after = _counts(graph)
        fired = after != before
        checked, failures = self.check_graph(graph)
        return RuleResult(rule.name, fired, len(seeds), after[0], checked, failures, time.perf_counter() - t0)

    def _serialize(self) -> dict[str, Any]:
        s = self.eg.serialize([])
        if s.truncated_functions or s.discarded_functions:
            raise RuntimeError(f"serialization dropped functions: {s.truncated_functions} {s.discarded_functions}")
        return json.loads(s.to_json())

    # -- reading an e-graph back and evaluating it

    def check_graph(self, graph: dict[str, Any]) -> tuple[int, list[str]]:
        nodes = graph["nodes"]
        ctype = {c: d["type"] for c, d in graph["class_data"].items()}
        prim: dict[str, str] = {}  # class -> a primitive node in it
        for nid, n in nodes.items():
            if nid.startswith("primitive-"):
                prim.setdefault(n["eclass"], nid)

        def value(nid: str) -> Any:
            n = nodes[nid]
            sort = ctype[n["eclass"]]
            if not nid.startswith("primitive-"):
                nid = prim[n["eclass"]]
                n = nodes[nid]
            return _decode(n, sort, nodes, value)

        t_nodes = {nid: n for nid, n in nodes.items() if ctype[n["eclass"]] == "T" and n["op"] in self.t_ops}
        unknown = sorted({n["op"] for n in nodes.values() if ctype[n["eclass"]] == "T" and n["op"] not in self.t_ops
                          and n["op"] not in ("Out", "Mark")})
        failures = [f"no meaning known for constructor {u!r}" for u in unknown]
        cls_term: dict[str, Term] = {}
        node_term: dict[str, Term] = {}
        pending = dict(t_nodes)
        while pending:
            progress = False
            for nid, n in list(pending.items()):
                t = self._node_term(n, nodes, cls_term, value)
                if t is None:
                    continue
                node_term[nid] = t
                cls_term.setdefault(n["eclass"], t)
                del pending[nid]
                progress = True
            if not progress:
                break
        checked = 0
        for nid, t in node_term.items():
            ref = cls_term[nodes[nid]["eclass"]]
            a = self._eval(t)
            b = self._eval(ref)
            checked += 1
            if isinstance(a, str) or isinstance(b, str):
                bad = t if isinstance(a, str) else ref
                other = ref if bad is t else t
                how = "the rule created it" if other == bad else f"it was merged with {other}"
                failures.append(f"{bad} cannot be evaluated ({a if isinstance(a, str) else b}); {how}; "
                                f"{self.where(t, ref)}")
            elif not close(a, b):
                failures.append(f"{t}  !=  {ref}   (shapes {list(a.shape)} vs {list(b.shape)}, "
                                f"max error {max_err(a, b):.3g}); {self.where(t, ref)}")
        failures.sort(key=lambda f: "the rule created it" in f)  # merges first: they say what went wrong
        # the shape analysis and prefix products
        stops: tuple | None = None  # what SumStop entries are checked against, made at the first one
        for n in nodes.values():
            if n["op"] == "shape" and len(n["children"]) == 1:
                c = nodes[n["children"][0]]["eclass"]
                if c in cls_term:
                    v = self._eval(cls_term[c])
                    want = tuple(value(prim[n["eclass"]]))
                    if not isinstance(v, str) and tuple(v.shape) != want:
                        failures.append(f"shape analysis says {list(want)} for {cls_term[c]}, "
                                        f"which has shape {list(v.shape)}")
            if n["op"] == "SumHas":
                # a term of a sum of that class
                e, a = (nodes[k]["eclass"] for k in n["children"])
                self.analysis_checked["SumHas"] += 1
                if not any(m["op"] == "Sum" and m["eclass"] == e and a in {nodes[k]["eclass"] for k in nodes[m["children"][0]]["children"]}
                           for m in nodes.values()):
                    failures.append(f"SumHas: {cls_term.get(a)} is no term of a sum of the class of {cls_term.get(e)}")
            if n["op"] == "SumPair":
                # a class holding the sum of the two terms
                x1, x2, u = (cls_term.get(nodes[k]["eclass"]) for k in n["children"])
                self.analysis_checked["SumPair"] += 1
                if x1 is None or x2 is None or u is None:
                    failures.append(f"SumPair over terms that cannot be read back: {x1}, {x2}, {u}")
                else:
                    a, b = self._eval(Term("Sum", (x1, x2))), self._eval(u)
                    if isinstance(a, str) or isinstance(b, str) or not close(a, b):
                        failures.append(f"SumPair: {x1} + {x2} is not {u}; {self.where(x1, x2, u)}")
            if n["op"] == "SumStop" and len(n["children"]) == 1:
                self.analysis_checked["SumStop"] += 1
                if value(prim[n["eclass"]]) is True:
                    stops = stops or _stop_index(nodes, value)
                    failures += _check_sum_stop(n["children"][0], nodes, cls_term, stops)
            if n["op"] in self.registry.facts and len(n["children"]) == 1:
                failures += self._check_fact(n, nodes, cls_term)
            if n["op"] == "pp":
                self.analysis_checked["pp"] += 1
                sv, i = value(n["children"][0]), value(n["children"][1])
                got = value(prim[n["eclass"]])
                if i > len(sv) or got != math.prod(sv[:i]):
                    failures.append(f"(pp {list(sv)} {i}) = {got}, expected {math.prod(sv[:i]) if i <= len(sv) else 'none'}")
        return checked, failures

    def _check_fact(self, n: dict[str, Any], nodes: dict[str, Any], cls_term: dict[str, Term]) -> list[str]:
        fact = self.registry.facts[n["op"]]
        quant, holds = fact.quant, fact.holds
        self.analysis_checked[n["op"]] += 1
        kid = n["children"][0]
        classes = [nodes[kid]["eclass"]] if quant == "one" else [nodes[k]["eclass"] for k in nodes[kid]["children"]]
        terms = [cls_term.get(c) for c in classes]
        if any(t is None for t in terms):
            return [f"{n['op']} over terms that cannot be read back: {terms}"]
        values = [self._eval(t) for t in terms]  # type: ignore[arg-type]
        ok = [not isinstance(v, str) and holds(v) for v in values]
        if all(ok) if quant in ("one", "all") else any(ok):
            return []
        return [f"({n['op']} {', '.join(map(str, terms))}) does not hold; {self.where(*terms)}"]  # type: ignore[arg-type]

    def where(self, *terms: Term) -> str:
        leaves: set[str] = set()
        for t in terms:
            leaves |= t.leaves()
        return "where " + ", ".join(f"{x}: {list(self.gen.leaves[x].shape)}" for x in sorted(leaves, key=_natural))

    def _node_term(self, n: dict[str, Any], nodes: dict[str, Any], cls_term: dict[str, Term], value: Any) -> Term | None:
        op = n["op"]
        kids = n["children"]
        if op == "D":
            return Term("D", (), (value(kids[0]),))
        if op in ("Sum", "Max"):
            ms = nodes[kids[0]]
            if not kids[0].startswith("primitive-"):
                return None
            items = []
            for k in ms["children"]:
                c = nodes[k]["eclass"]
                if c not in cls_term:
                    return None
                items.append(cls_term[c])
            return Term(op, tuple(items))
        sorts = self.hsorts.get(op) or (("T",) * self.registry.ops[op].inputs + self.engine_sorts[op])
        args, attrs = [], []
        for k, s in zip(kids, sorts, strict=True):
            if s == "T":
                c = nodes[k]["eclass"]
                if c not in cls_term:
                    return None
                args.append(cls_term[c])
            else:
                attrs.append(_freeze(value(k)))
        return Term(op, tuple(args), tuple(attrs))

    def _eval(self, t: Term) -> torch.Tensor | str:
        try:
            return eval_term(t, self.registry, self.values, self.cache)
        except Exception as e:  # noqa: BLE001 - an ill-shaped term is a finding
            return f"{type(e).__name__}: {str(e)[:200]}"

    def run(self, only: Iterable[str] | None = None) -> list[RuleResult]:
        """Check each rule; the analysis rules that always run (prefix products, the sum
        index) are reported as exercised when their tables were checked in some e-graph."""
        keep = set(only) if only is not None else None
        out = [self.check_rule(i, r) for i, r in self.checked_rules if keep is None or r.name in keep]
        for r in self.always:
            if keep is None or r.name in keep:
                n = sum(self.analysis_checked[t] for t in self.writes[r.name])
                out.append(RuleResult(r.name, n > 0, 0, 0, n, [], 0.0))
        return out


def _stop_index(nodes: dict[str, Any], value: Any) -> tuple[dict[str, set[str]], set[str], dict[str, list[str]]]:
    """Per class, the classes it holds a Scale of; the classes that are zero (the zero
    constant, or a multiple of themselves other than 1 x); per multiset node, its sums' classes."""
    scales: dict[str, set[str]] = {}
    zeros: set[str] = set()
    sums: dict[str, list[str]] = {}
    for x in nodes.values():
        if x["op"] == "Scale":
            arg = nodes[x["children"][0]]["eclass"]
            scales.setdefault(x["eclass"], set()).add(arg)
            if arg == x["eclass"] and value(x["children"][1]) != 1:
                zeros.add(arg)
        elif x["op"] == "full" and value(x["children"][0]) == 0.0:
            zeros.add(x["eclass"])
        elif x["op"] == "Sum":
            sums.setdefault(x["children"][0], []).append(x["eclass"])
    return scales, zeros, sums


def _check_sum_stop(ms: str, nodes: dict[str, Any], cls_term: dict[str, Term],
                    stops: tuple[dict[str, set[str]], set[str], dict[str, list[str]]]) -> list[str]:
    """(SumStop ms) true: the sum of ms holds a term twice, two multiples of one tensor (or a
    tensor and a multiple of it), the sum itself or a multiple of it, or a zero, or is zero.
    False claims nothing (the expansion rules then apply, as without the index)."""
    scales, zeros, sums = stops
    kids = [nodes[k]["eclass"] for k in nodes[ms]["children"]]
    terms = set(kids)
    of = {t: scales.get(t, set()) for t in terms}
    for e in sums.get(ms, []):
        if len(kids) > len(terms) or e in terms or terms & zeros or e in zeros \
                or any(e in of[t] or of[t] & terms or any(of[t] & of[u] for u in terms if u != t) for t in terms):
            return []
    return [f"SumStop: the sum of {[cls_term.get(c) for c in sorted(terms)]} holds no like terms, multiple of itself "
            "or zero"]


def _natural(name: str) -> tuple[str, int]:
    head = name.rstrip("0123456789")
    return head, int(name[len(head):] or 0)


def _freeze(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _counts(graph: dict[str, Any]) -> tuple[int, int]:
    ctype = {c: d["type"] for c, d in graph["class_data"].items()}
    t = [n for n in graph["nodes"].values() if ctype[n["eclass"]] == "T"]
    return len(t), len({n["eclass"] for n in t})


_RATIO = re.compile(r"Ratio \{ numer: (-?\d+), denom: (\d+) \}")


def _decode(n: dict[str, Any], sort: str, nodes: dict[str, Any], value: Any) -> Any:
    op = n["op"]
    if sort == "i64":
        return int(op)
    if sort == "f64":
        return float(op)
    if sort == "String":
        return json.loads(op) if op.startswith('"') else op
    if sort == "bool":
        return op == "true"
    if sort == "BigRat":
        m = _RATIO.fullmatch(op)
        if m:
            return Fraction(int(m.group(1)), int(m.group(2)))
        return Fraction(op)
    if sort == "IV":
        return [value(k) for k in n["children"]]
    if sort == "PyObject":  # a size, when the rules run in symbolic mode on concrete seeds
        if re.fullmatch(r"-?\d+", op):
            return int(op)
        raise ValueError(f"cannot decode a PyObject value {op!r}")
    raise ValueError(f"cannot decode a {sort} value {op!r}")
