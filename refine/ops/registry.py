"""Ops and rules as declarative values, and the registry that loads them from `rules/`.

An `Op` says what an op means: its signature, its shape rule, its torch reference (used by
the evaluator and the rule checker) and either how it appears in the e-graph (a `core` op,
an egglog constructor) or how it decomposes into core ops. A `Rule` is one egglog command
(a rewrite or a rule) with a name and a family. Rule files in `rules/` export `OPS` and
`RULES`; `RULES` may also be a function of the registry, for rule templates that apply to
every op of a kind (say, every unary elementwise op distributes over concat).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from types import ModuleType
from typing import Any

from refine.ir.graph import TensorType
from refine.ir.sexp import Sexp, SexpError, Sym, head, parse, parse_cached, parse_one, show

# Attribute kinds and the egglog sort each one becomes. A `size` (a tensor extent or an
# offset along a dim) is a `Dim`: i64 when every shape is concrete, a PyObject holding an
# int or a `refine.ir.sizes.Sym` when some are symbolic (see `refine.ir.sexp.emit`).
ATTR_SORTS = {
    "int": "i64",
    "size": "Dim",
    "dim": "i64",  # a dim of the first tensor argument; negative values are normalised
    "ints": "IV",
    "dims": "IV",
    "shape": "IV",
    "float": "f64",
    "rational": "BigRat",
    "bool": "bool",
    "str": "String",
}

# Extraction costs. A relation is clean when extraction finds no compute op in it.
LEAF_OUT = 1  # a rank output
LEAF = 3  # any other rank tensor
CLEAN = 2
COMPUTE = 100_000
# Rule-internal helper constructors (a partial application mapped over a Sum, rewritten to
# the real op one iteration later) must never be extracted: they cost more than anything.
HELPER = 1_000_000_000


class ShapeError(ValueError):
    """An op applied to arguments its shape rule rejects."""


ShapeFn = Callable[[list[TensorType], dict[str, Any]], TensorType]


@dataclass(frozen=True)
class Op:
    name: str
    inputs: int  # number of tensor arguments; -1 for a list of any length
    shape: ShapeFn
    attrs: tuple[tuple[str, str], ...] = ()  # (name, kind); a kind ending in "?" is optional
    ref: Callable[..., Any] | None = None  # torch semantics: ref(*tensors, **attrs)
    core: bool = False  # an egglog constructor; otherwise it must decompose
    clean: bool = False  # allowed in a clean relation
    kind: str = "compute"  # unary | binary | clean | compute | collective | identity
    decompose: Callable[..., str] | None = None  # (builder, args, attrs, out_type) -> ref
    egglog_shape: str | None = None  # egglog rule deriving (shape e) for new terms
    lower: Callable[..., Any] | None = None  # collectives: (inputs by group member, index, attrs) -> Term
    family: str = ""
    doc: str = ""
    # How the op treats a partial sum (localization reads it): "each", linear in every
    # tensor argument with the others fixed (matmul); "first", in the first one only
    # (x / y, a slice); "joint", in all of them together (Sum, cat); "" not linear.
    linear: str = ""
    # A node of this op with no clean relation is seen by its users as the op over its
    # inputs' clean relations (not an opaque leaf), and their steps search the rank program
    # deeper (`refine.prove.policy.Policy.deep_hops`): blockwise (online-softmax) attention
    # never holds softmax's value, only what its users compute from it.
    fuse: bool = False

    @property
    def cost(self) -> int:
        return CLEAN if self.clean else COMPUTE

    def attr_kinds(self) -> dict[str, str]:
        return dict(self.attrs)


@dataclass(frozen=True)
class Rule:
    name: str
    text: str  # one egglog command, with the size macros of `refine.ir.sexp.emit` unexpanded
    family: str = ""
    doc: str = ""
    symbolic: bool = True  # also sound and expressible when sizes are symbolic
    # an analysis or index that other rules read (prefix products, the terms of each sum):
    # it runs with the shape rules, to saturation before each iteration, so every rule
    # sees it complete
    analysis: bool = False
    # a feature of the case the rule only matters for ("defines": layouts stated by
    # defines, a padded rank's heads, copied KV heads): an engine for a case without it
    # leaves the rule out. That costs completeness only (a rule left out proves nothing),
    # and the cases that need it pay for it alone
    needs: str = ""

    @classmethod
    def of(cls, name: str, command: Sexp, **kw: Any) -> Rule:
        """A rule from its parsed command (its text is printed from it)."""
        r = cls(name, show(command), **kw)
        r.__dict__["command"] = command  # parsed already: `command` need not read the text back
        return r

    def in_family(self, family: str) -> Rule:
        out = replace(self, family=family)
        if "command" in self.__dict__:  # the same text: its parse holds
            out.__dict__["command"] = self.command
        return out

    @cached_property
    def command(self) -> Sexp:
        """The command as an expression: `(rewrite lhs rhs [:when (conds)])` or
        `(rule (query) (actions))`, read from `text` once."""
        return parse_one(self.text)


@dataclass(frozen=True)
class Helper:
    """A rule-internal constructor (cost HELPER: never extracted): an op partially applied,
    mapped over the terms of a sum and rewritten to the op one iteration later, or an index
    entry. `sorts` are its egglog argument sorts in order ("T" a tensor); `meaning(op,
    *args)` is its value, for terms that hold it and for the rule checker: `op(name)` applies
    a registry op's torch reference, the arguments come in declaration order."""

    name: str
    sorts: tuple[str, ...]
    meaning: Callable[..., Any]
    doc: str = ""

    @property
    def decl(self) -> str:
        return f"(constructor {self.name} ({' '.join(self.sorts)}) T :cost {HELPER})"


# An argument of a seed term the soundness harness builds: its shape, its kind ("f" any
# float, "p" positive, "b" bool, "i" integer ids below the bound) and that bound.
ArgSpec = tuple[tuple[int, ...], str, int]


@dataclass(frozen=True)
class Sample:
    """How the soundness harness applies one core op to random arguments (a family's
    SAMPLES, by op name): `args(gen, x)` gives the argument specs and attributes of one
    application, or None, drawing from `gen.rng` (`gen` a `refine.prove.harness.SeedGen`;
    `x` random dims it drew first); `count` applications per harness instance (ops with
    many forms get more). An op without one gets same-shape float arguments. The harness
    also puts each argument in other forms, a concat among them: `concat_dim(gen, i,
    attrs)` may choose the dim argument i is cut along (None: any)."""

    args: Callable[[Any, tuple[int, ...]], tuple[list[ArgSpec], tuple[Any, ...]] | None]
    count: int = 1
    concat_dim: Callable[[Any, int, tuple[Any, ...]], int | None] | None = None


def index_within(gen: Any) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    """Random dims x, a dim d and the shape of an index along d that stays within x (what
    gather- and scatter-like ops take): 1 to 3 entries along d, sometimes fewer than x has
    on another dim. Drawn from `gen.rng` in a fixed order (the harness's seeds repeat)."""
    r = gen.rng
    x = gen.dims(r.choice([1, 2, 2, 3]))
    d = r.randrange(len(x))
    idx = list(x)
    idx[d] = r.choice([1, 2, 3])
    if len(x) > 1 and r.random() < 0.25:
        j = r.choice([i for i in range(len(x)) if i != d])
        idx[j] = r.randint(1, x[j])
    return x, d, tuple(idx)


@dataclass(frozen=True)
class Fact:
    """What a fact relation an analysis derives says (a family's FACTS, by relation name; the
    relation is declared in its DECLS), for the soundness harness, which checks every fact
    of every e-graph it reads back: `holds(value)` of its one tensor (`quant` "one"), or of
    all / some of the terms of its multiset ("all", "any")."""

    quant: str
    holds: Callable[[Any], bool]


# A demand relation (every_term's `want`) says only that a rule asks about the tensor: it
# holds of every value. Listed in FACTS so the harness counts the rules making it as exercised.
DEMAND = Fact("one", lambda _value: True)


@dataclass
class Registry:
    ops: dict[str, Op] = field(default_factory=dict)
    rules: list[Rule] = field(default_factory=list)
    families: list[str] = field(default_factory=list)
    decls: list[str] = field(default_factory=list)  # egglog declarations rules rely on
    helpers: dict[str, Helper] = field(default_factory=dict)  # families' HELPERS (declared in `decls` too)
    samples: dict[str, Sample] = field(default_factory=dict)  # families' SAMPLES: op name -> harness sampler
    facts: dict[str, Fact] = field(default_factory=dict)  # families' FACTS: relation name -> what it says
    # (family, SEEDS): a family's SEEDS(gen) -> terms, seed terms the soundness harness gives
    # that family's rules (left sides that are whole formulas the random seeds never build)
    seeders: list[tuple[str, Callable[..., Any]]] = field(default_factory=list)
    # (family, SHARED_SEEDS): small seed terms the harness gives every rule, of any family,
    # whose query's constructors they hold (shapes the generic seeds rarely make)
    shared_seeders: list[tuple[str, Callable[..., Any]]] = field(default_factory=list)
    # the file each op, rule and declaration came from ("op NAME", "rule NAME", "decl TEXT"),
    # so a refusal can name it (refine.prove.extra_rules)
    origins: dict[str, str] = field(default_factory=dict)
    # the content digest (`dir_digest`) of each extra rule directory, taken when it was read
    digests: tuple[str, ...] = ()

    def add_family(self, name: str, module: ModuleType) -> None:
        file = str(getattr(module, "__file__", None) or name)
        self.families.append(name)
        for op in getattr(module, "OPS", []):
            if op.name in self.ops:
                raise ValueError(f"rule family {name}: op {op.name!r} is already defined")
            if op.egglog_shape:
                _read(op.egglog_shape, f"rule family {name}: op {op.name}'s egglog_shape")
            self.ops[op.name] = _with_family(op, name)
            self.origins.setdefault(f"op {op.name}", file)
        for h in getattr(module, "HELPERS", []):
            if h.name in self.helpers:
                raise ValueError(f"rule family {name}: helper {h.name!r} is already defined")
            self.helpers[h.name] = h
            self.decls.append(h.decl)
            self.origins.setdefault(f"decl {h.decl}", file)
        for d in getattr(module, "DECLS", []):
            _read(d, f"rule family {name}: a declaration")
            self.decls.append(d)
            self.origins.setdefault(f"decl {d}", file)
        for op_name, sample in getattr(module, "SAMPLES", {}).items():
            if op_name in self.samples:
                raise ValueError(f"rule family {name}: op {op_name!r} already has a sampler")
            self.samples[op_name] = sample
        for rel, fact in getattr(module, "FACTS", {}).items():
            if rel in self.facts:
                raise ValueError(f"rule family {name}: fact {rel!r} is already defined")
            self.facts[rel] = fact
        if callable(getattr(module, "SEEDS", None)):
            self.seeders.append((name, module.SEEDS))
        if callable(getattr(module, "SHARED_SEEDS", None)):
            self.shared_seeders.append((name, module.SHARED_SEEDS))
        self._pending.append((name, getattr(module, "RULES", []), file))

    def finish(self) -> Registry:
        # templates see every op of every family, so they run after all files are read
        for name, rules, file in self._pending:
            made: Iterable[Rule] = rules(self) if callable(rules) else rules
            for r in made:
                _read(r, f"rule family {name}: rule {r.name}")
                self.rules.append(r if r.family else r.in_family(name))
                self.origins.setdefault(f"rule {r.name}", file)
        self._pending.clear()
        names = [r.name for r in self.rules]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate rule names: {sorted(dup)}")
        return self

    def __post_init__(self) -> None:
        self._pending: list[tuple[str, Any]] = []

    def of_kind(self, kind: str) -> list[Op]:
        return [op for op in self.ops.values() if op.kind == kind]


def _read(x: str | Rule, what: str) -> None:
    """Parse a declaration or rule once, at load: text that is no s-expression is refused
    naming where it came from."""
    try:
        parse_cached(x) if isinstance(x, str) else x.command
    except SexpError as e:
        raise ValueError(f"{what}: {e}") from None


def _with_family(op: Op, family: str) -> Op:
    from dataclasses import replace

    return op if op.family else replace(op, family=family)


def builtin_rules_dir() -> Path:
    """`rules/` of a checkout, or the copy installed as `refine.rules_builtin`."""
    checkout = Path(__file__).resolve().parents[2] / "rules"  # refine/ops/registry.py -> the checkout
    if checkout.is_dir():
        return checkout
    spec = importlib.util.find_spec("refine.rules_builtin")
    if spec and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    raise FileNotFoundError("cannot find the rules/ directory")


def _load_module(path: Path) -> ModuleType:
    mod_name = f"refine_rules_{path.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load rule file {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    return module


_CACHE: dict[tuple[str, ...], Registry] = {}


def dir_digest(d: Path) -> str:
    """SHA-256 over the relative paths and contents of every file under `d` (byte code
    caches and hidden entries left out): what an extra rule directory holds."""
    h = hashlib.sha256()
    for path in sorted(p for p in d.rglob("*") if p.is_file()):
        rel = path.relative_to(d)
        if any(part == "__pycache__" or part.startswith(".") for part in rel.parts):
            continue
        data = path.read_bytes()
        h.update(f"{rel.as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def load_registry(extra_dirs: Iterable[Path | str] = ()) -> Registry:
    """All rule families: the built-in ones, then each extra directory's, in file order. An
    extra directory is read again when its files change (its digest is part of the key)."""
    dirs = [builtin_rules_dir(), *(Path(d) for d in extra_dirs)]
    for d in dirs:
        if not d.is_dir():
            raise FileNotFoundError(f"rule directory {d} does not exist")
    digests = tuple(dir_digest(d) for d in dirs[1:])
    key = tuple(str(d.resolve()) for d in dirs) + digests
    if key in _CACHE:
        return _CACHE[key]
    reg = Registry(digests=digests)
    for d in dirs:
        for path in sorted(d.glob("*.py")):
            if path.name.startswith("_"):
                continue
            reg.add_family(path.stem, _load_module(path))
    # the digests must describe the code that ran (refine.prove.extra_rules keys verification on them)
    if tuple(dir_digest(d) for d in dirs[1:]) != digests:
        raise ValueError(f"a rule directory changed while it was read: {', '.join(map(str, dirs[1:]))}")
    _CACHE[key] = reg.finish()
    return _CACHE[key]


# ---------------------------------------------------------------------------------------
# Helpers for rule files: shape rules and rule constructors.


def broadcast_shapes(*shapes: tuple[Any, ...]) -> tuple[Any, ...]:
    """torch's broadcasting, for concrete and symbolic sizes: at each right-aligned dim the
    sizes other than 1 must be one size. A symbol is never assumed to be 1 (if it is, the
    result is still right: broadcasting 1 against 1)."""
    n = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(n):
        sizes = {s[len(s) - n + i] for s in shapes if len(s) - n + i >= 0}
        big = sizes - {1}
        if len(big) > 1:
            raise ShapeError(f"shapes {[list(s) for s in shapes]} do not broadcast")
        out.append(next(iter(big)) if big else 1)
    return tuple(out)


def matmul_shape(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[Any, ...]:
    """The shape of torch.matmul(a, b): 1-d operands gain and lose a dim, batches broadcast."""
    if not a or not b:
        raise ShapeError(f"matmul of {list(a)} and {list(b)}: both need at least one dim")
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise ShapeError(f"matmul of {list(a)} and {list(b)}: contraction sizes differ")
    out = broadcast_shapes(a2[:-2], b2[:-2]) + (a2[-2], b2[-1])
    if len(a) == 1:
        out = out[:-2] + out[-1:]
    if len(b) == 1:
        out = out[:-1]
    return out


def rewrite(name: str, lhs: str, rhs: str, *when: str, doc: str = "", symbolic: bool = True,
            analysis: bool = False) -> Rule:
    """`lhs` rewrites to `rhs` when every condition holds. `(size x d)` is the size of dim
    d of x and `(ndim x)` its rank; both read the shape analysis. Sizes are compared and
    computed with the macros of `refine.ir.sexp.emit`."""
    left, right = _macros(parse_one(lhs)), _macros(parse_one(rhs))
    conds = [_macros(c) for text in when for c in parse(text)]
    right, binds = _hoist(right)
    if not binds:
        cmd: Sexp = (Sym("rewrite"), left, right, *((Sym(":when"), tuple(conds)) if conds else ()))
    else:
        # egglog reads functions such as (shape x) in queries only: bind them there
        e = Sym("__e")
        cmd = (Sym("rule"), ((Sym("="), e, left), *conds, *binds), ((Sym("union"), e, right),))
    return Rule.of(name, cmd, doc=doc, symbolic=symbolic, analysis=analysis)


def rule(name: str, query: list[str], actions: list[str], doc: str = "", symbolic: bool = True,
         analysis: bool = False) -> Rule:
    q = [_macros(x) for text in query for x in parse(text)]
    acts: list[Sexp] = []
    for text in actions:
        for a in parse(text):
            a, binds = _hoist(_macros(a), start=len(acts) * 100)
            q += binds
            acts.append(a)
    return Rule.of(name, (Sym("rule"), tuple(q), tuple(acts)), doc=doc, symbolic=symbolic, analysis=analysis)


def every_term(prefix: str, fact: str, todo: str, every: str, want: str | None = None) -> list[Rule]:
    """Analysis rules deriving `(fact e)` for a Sum e whose every term has it: `(todo ms)`
    walks a sum's multiset one picked term at a time while the terms have it, `(every ms)`
    says all of ms do (egglog has no quantifier over a multiset's elements).

    The walk costs a sum of n terms n multisets and n analysis iterations, and the sum rules
    make many long sums: walked for every sum, one step's analysis took minutes. With `want`
    only sums something asks about are walked: the family seeds `(want x)` where a rule
    reads the fact and passes it down the ops its facts come up through; a wanted sum's
    terms are wanted too (through the sum index, SumHas)."""
    def r(name: str, query: list[str], actions: list[str]) -> Rule:
        return rule(f"{prefix}-{name}", query, actions, analysis=True)

    asked = [f"({want} e)"] if want else []
    return [
        r("sum-start", ["(= e (Sum ms))", *asked, f"({fact} (multiset-pick ms))"], [f"({todo} ms)"]),
        r("sum-last", [f"({todo} ms)", "(= (multiset-length ms) 1)", f"({fact} (multiset-pick ms))"],
          [f"({every} ms)"]),
        r("sum-next", [f"({todo} ms)", "(> (multiset-length ms) 1)", "(= p (multiset-pick ms))", f"({fact} p)",
                       "(= rest (multiset-remove ms p))", f"({fact} (multiset-pick rest))"], [f"({todo} rest)"]),
        r("sum-all", [f"({todo} ms)", "(> (multiset-length ms) 1)", "(= p (multiset-pick ms))", f"({fact} p)",
                      f"({every} (multiset-remove ms p))"], [f"({every} ms)"]),
        r("sum", ["(= e (Sum ms))", f"({every} ms)"], [f"({fact} e)"]),
        *([r("want-terms", [f"({want} e)", "(= e (Sum ms))", "(SumHas e a)"], [f"({want} a)"])] if want else []),
    ]


def wanted_through(prefix: str, want: str, ops: Iterable[tuple[str, str]]) -> list[Rule]:
    """Analysis rules passing a demand `(want e)` (see every_term) from each op's result to
    its operands: ops as (name, the arguments after the first operand); `cat` passes it to both."""
    out = [rule(f"{prefix}-want-{op}", [f"({want} e)", f"(= e ({op} x{' ' + args if args else ''}))"],
                [f"({want} x)"], analysis=True) for op, args in ops]
    return out + [rule(f"{prefix}-want-cat", [f"({want} e)", "(= e (cat a b d))"], [f"({want} a)", f"({want} b)"],
                       analysis=True)]


def _hoist(x: Sexp, start: int = 0) -> tuple[Sexp, list[Sexp]]:
    """Replace each `(shape X)` with a variable bound by a query fact."""
    binds: list[Sexp] = []
    seen: dict[Sexp, Sym] = {}

    def walk(y: Sexp) -> Sexp:
        if not isinstance(y, tuple):
            return y
        if head(y) == "shape":
            if y not in seen:
                seen[y] = Sym(f"__s{start + len(seen)}")
                binds.append((Sym("="), seen[y], y))
            return seen[y]
        return tuple(walk(z) for z in y)

    return walk(x), binds


def _macros(x: Sexp) -> Sexp:
    """(size x d) -> (vec-get (shape x) d); (ndim x) -> (vec-length (shape x))."""
    if not isinstance(x, tuple):
        return x
    h = head(x)
    if h == "size":
        _, t, *rest = x
        return (Sym("vec-get"), (Sym("shape"), _macros(t)), *map(_macros, rest))
    if h == "ndim":
        _, t = x
        return (Sym("vec-length"), (Sym("shape"), _macros(t)))
    return tuple(_macros(y) for y in x)
