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
from pathlib import Path
from types import ModuleType
from typing import Any

from refine.ir.graph import TensorType
from refine.ir.term import parse_sexps

# Attribute kinds and the egglog sort each one becomes. A `size` (a tensor extent or an
# offset along a dim) is a `Dim`: i64 when every shape is concrete, a PyObject holding an
# int or a `refine.ir.sizes.Sym` when some are symbolic (see `compile_text`).
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
    # deeper (`refine.prove.engine.DEEP_HOPS`): blockwise (online-softmax) attention never holds
    # softmax's value, only what its users compute from it.
    fuse: bool = False

    @property
    def cost(self) -> int:
        return CLEAN if self.clean else COMPUTE

    def attr_kinds(self) -> dict[str, str]:
        return dict(self.attrs)


@dataclass(frozen=True)
class Rule:
    name: str
    text: str  # one egglog command, with the size macros of `compile_text` unexpanded
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


@dataclass
class Registry:
    ops: dict[str, Op] = field(default_factory=dict)
    rules: list[Rule] = field(default_factory=list)
    families: list[str] = field(default_factory=list)
    decls: list[str] = field(default_factory=list)  # egglog declarations rules rely on
    # (family, SEEDS): a family's SEEDS(gen) -> terms, seed terms the soundness harness gives
    # that family's rules (left sides that are whole formulas the random seeds never build)
    seeders: list[tuple[str, Callable[..., Any]]] = field(default_factory=list)
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
            self.ops[op.name] = _with_family(op, name)
            self.origins.setdefault(f"op {op.name}", file)
        for d in getattr(module, "DECLS", []):
            self.decls.append(d)
            self.origins.setdefault(f"decl {d}", file)
        if callable(getattr(module, "SEEDS", None)):
            self.seeders.append((name, module.SEEDS))
        self._pending.append((name, getattr(module, "RULES", []), file))

    def finish(self) -> Registry:
        # templates see every op of every family, so they run after all files are read
        for name, rules, file in self._pending:
            made: Iterable[Rule] = rules(self) if callable(rules) else rules
            for r in made:
                self.rules.append(replace(r, family=r.family or name))
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
    computed with the macros of `compile_text`."""
    lhs, rhs = _macros(lhs), _macros(rhs)
    conds = [_macros(c) for c in when]
    rhs, binds = _hoist(rhs)
    if not binds:
        text = f"(rewrite {lhs} {rhs}" + (f" :when ({' '.join(conds)})" if conds else "") + ")"
        return Rule(name, text, doc=doc, symbolic=symbolic, analysis=analysis)
    # egglog reads functions such as (shape x) in queries only: bind them there
    query = " ".join([f"(= __e {lhs})", *conds, *binds])
    return Rule(name, f"(rule ({query}) ((union __e {rhs})))", doc=doc, symbolic=symbolic, analysis=analysis)


def rule(name: str, query: list[str], actions: list[str], doc: str = "", symbolic: bool = True,
         analysis: bool = False) -> Rule:
    q = [_macros(x) for x in query]
    acts = []
    for a in actions:
        a, binds = _hoist(_macros(a), start=len(acts) * 100)
        q += binds
        acts.append(a)
    return Rule(name, f"(rule ({' '.join(q)}) ({' '.join(acts)}))", doc=doc, symbolic=symbolic, analysis=analysis)


# ---------------------------------------------------------------------------------------
# Sizes. Rules compute on sizes with (d+ a b) (d- a b) (d* a b) (d/ a b) (exact
# division), test them with (d< a b) (d<= a b) (d> a b) (d>= a b) (d!= a b) and
# (d-divides k n), and write size literals as (dim 3). Equal sizes are equal values, so
# `=` and repeated pattern variables need no macro. With concrete shapes these are i64
# primitives; with symbolic ones, calls into `refine.ir.sizes`, whose tests hold only when
# proven for every value of the symbols (Z3 decides what the fast check cannot).

_I64 = {"d+": "+", "d-": "-", "d*": "*", "d/": "/", "d<": "<", "d<=": "<=", "d>": ">", "d>=": ">=", "d!=": "!="}
_PY_VALUE = {"d+": "add", "d-": "sub", "d*": "mul", "d/": "div"}
_PY_TEST = {"d<": "lt", "d<=": "le", "d>": "gt", "d>=": "ge", "d!=": "ne", "d-divides": "divides"}


def dims_prelude() -> str:
    """The egglog globals the symbolic macros call."""
    names = sorted(set(_PY_VALUE.values()) | set(_PY_TEST.values()))
    return "\n".join(f"(let $dims_{n} (py-eval \"__import__('refine.ir.sizes', fromlist=['{n}']).{n}\" "
                     "(py-dict) (py-dict)))" for n in names)


def compile_text(text: str, symbolic: bool) -> str:
    """Expand the size macros (and the sort name `Dim`) of egglog text for one mode."""
    if not any(m in text for m in ("(d", "Dim")):
        return text
    return " ".join(_emit(x, symbolic) for x in parse_sexps(text))


def _emit(x: Any, py: bool) -> str:
    if isinstance(x, str):
        return ("PyObject" if py else "i64") if x == "Dim" else x
    if not x:
        return "()"
    head, args = x[0], [_emit(a, py) for a in x[1:]]
    if not isinstance(head, str):
        return "(" + " ".join([_emit(head, py), *args]) + ")"
    if head == "dim":
        (n,) = args
        return f"(py-from-int {n})" if py else n
    if head == "d-divides":
        k, n = args
        return f"(= true (py-to-bool (py-call $dims_divides {k} {n})))" if py else f"(= 0 (% {n} {k}))"
    if head in _PY_VALUE:
        return f"(py-call $dims_{_PY_VALUE[head]} {' '.join(args)})" if py else f"({_I64[head]} {' '.join(args)})"
    if head in _PY_TEST:
        return f"(= true (py-to-bool (py-call $dims_{_PY_TEST[head]} {' '.join(args)})))" if py \
            else f"({_I64[head]} {' '.join(args)})"
    return "(" + " ".join([_emit(head, py), *args]) + ")"


def _hoist(text: str, start: int = 0) -> tuple[str, list[str]]:
    """Replace each `(shape X)` with a variable bound by a query fact."""
    binds: list[str] = []
    seen: dict[str, str] = {}
    out = []
    i = 0
    while i < len(text):
        if text.startswith("(shape ", i):
            j = end_of_atom(text, i)
            expr = text[i:j]
            if expr not in seen:
                seen[expr] = f"__s{start + len(seen)}"
                binds.append(f"(= {seen[expr]} {expr})")
            out.append(seen[expr])
            i = j
        else:
            out.append(text[i])
            i += 1
    return "".join(out), binds


def _macros(text: str) -> str:
    # (size x d) -> (vec-get (shape x) d); (ndim x) -> (vec-length (shape x))
    out = []
    i = 0
    while i < len(text):
        if text.startswith("(size ", i):
            out.append("(vec-get (shape ")
            i += len("(size ")
            j = end_of_atom(text, i)
            out.append(text[i:j] + ")")
            i = j
        elif text.startswith("(ndim ", i):
            out.append("(vec-length (shape ")
            i += len("(ndim ")
            j = end_of_atom(text, i)
            out.append(text[i:j] + "))")
            i = j
            # skip the closing paren of (ndim x)
            assert text[i] == ")", text
            i += 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def end_of_atom(text: str, i: int) -> int:
    if text[i] == "(":
        depth = 0
        for j in range(i, len(text)):
            depth += text[j] == "("
            depth -= text[j] == ")"
            if depth == 0:
                return j + 1
        raise ValueError(f"unbalanced rule text: {text}")
    j = i
    while j < len(text) and text[j] not in " )":
        j += 1
    return j
