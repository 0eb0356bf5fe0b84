"""Extra rule directories (`refine check --rules DIR`) are verified before a check uses them.

A rules directory is Python that refine imports and runs as the user, like a plugin: it is
trusted *code*. What this module checks is that its *content* is right, since a wrong rule
makes a buggy program REFINE. What the directory adds to the built-in families is checked:

- every rule the built-in registry does not hold with the same name and text (a built-in
  template applied to a new op is new): the soundness harness (`refine.prove.harness`) runs it
  alone on random seed terms, with concrete sizes and, for a rule marked `symbolic`, with
  symbolic ones. Only these rules are compiled (with the built-in analyses they may read):
  the built-in rules are the test suite's job;
- every new op: on sampled arguments (same-shape float tensors, every value of its `dim`
  attributes), its shape rule against its torch reference's result, and what refine lowers
  it to (its decomposition, or the input itself for `kind="identity"`) against the
  reference. The reference is the op's meaning: refine cannot check it against anything;
- `DECLS` may only declare (sorts, constructors, relations, functions) and an op's
  `egglog_shape` may only set `(shape e)`: a rewrite there would never be verified;
- a new collective cannot be checked (refine has no reference for how it lowers).

Policy: a counterexample (`unsound`) always refuses the check (exit 2, naming the file, the
rule or op and why). Something the harness could not exercise (`untested`: no seed term
matched a rule, arguments cannot be sampled for an op) refuses too, unless the user trusts
it (`--trust-rules`); the report then lists it under "unverified rules used", so that
verdict is visibly conditional.

Cache: a verification is stored as one JSON file named by a SHA-256 key over the format,
refine's own sources (the `refine` package and the built-in rules) and the versions of torch
and egglog, the harness parameters, each extra directory's path and content digest
(`refine.ops.registry.dir_digest`: every file under it) and the text of what it adds. A change
to any of them verifies again. The directory is `$REFINE_CACHE_DIR`, else
`$XDG_CACHE_HOME/refine`, else `~/.cache/refine` (entries in `verified-rules/`); writes are
atomic (a temporary file renamed over). What the cache is trusted for: an entry is the outcome
of a verification of exactly that content on this machine. Whoever can write the user's cache
can also edit the rule files the user runs, so an entry is believed, but one that does not
parse, names another key or fails its own checksum is ignored and the rules are verified again.
Code the rule files import from outside their directory (other than refine) is not part of the
key.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import itertools
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any

from refine.ir.errors import InputError
from refine.ir.sexp import SexpError, head, parse, show
from refine.ops.registry import Op, Registry, Rule, builtin_rules_dir, load_registry

FORMAT = 1
CACHE_ENV = "REFINE_CACHE_DIR"
# the harness as `refine rules verify` runs it: seed 0 for concrete sizes, 1 for symbolic
SEED, INSTANCES, MAX_SEEDS = 0, 3, 150
DECLARATIONS = {"sort", "datatype", "datatype*", "constructor", "relation", "function"}
SHAPES = ((4,), (2, 3), (3, 1, 2))  # argument shapes an op is tried on
TRUST_HINT = ("(`refine rules verify --rules DIR` shows the details; --trust-rules uses an untested rule or op "
              "anyway and says so in the report, a wrong one is refused regardless)")


@dataclass(frozen=True)
class Finding:
    file: str
    item: str  # "rule NAME", "op NAME" or "DECLS"
    status: str  # "unsound" (a counterexample) or "untested" (not exercised)
    reason: str
    mode: str = ""  # "concrete" or "symbolic" when it holds for one size mode only

    def __str__(self) -> str:
        return f"{self.file}: {self.item}: {self.status}: {self.reason}"


@dataclass
class Verification:
    key: str
    rules: list[str] = field(default_factory=list)  # the extra rules checked
    ops: list[str] = field(default_factory=list)  # the new ops checked
    findings: list[Finding] = field(default_factory=list)
    cached: bool = False


class RulesRefused(InputError):
    """Extra rules or ops that failed verification, or were not exercised and not trusted."""

    def __init__(self, findings: list[Finding]) -> None:
        first = findings[0]
        super().__init__(first.file, first.item, f"{first.status}: {first.reason}")
        self.findings = findings
        self.args = ("\n".join([*map(str, findings), TRUST_HINT]),)


# ---------------------------------------------------------------------------------------
# What the extra directories add


def extra_items(registry: Registry) -> tuple[list[Rule], list[Op], list[str]]:
    """The rules, ops and declarations of `registry` the built-in registry lacks."""
    base = load_registry()
    if registry is base:
        return [], [], []
    known = {(r.name, r.text, r.symbolic, r.analysis) for r in base.rules}
    rules = [r for r in registry.rules if (r.name, r.text, r.symbolic, r.analysis) not in known]
    ops = [op for name, op in registry.ops.items() if name not in base.ops]
    known_decls = set(base.decls)
    decls = [d for d in registry.decls if d not in known_decls]
    return rules, ops, decls


def _file(registry: Registry, item: str) -> str:
    return registry.origins.get(item, "?")


def _made_by_template(registry: Registry, rule: Rule) -> str:
    """A note for a new rule from a built-in file: a template made it for a new op."""
    file = Path(_file(registry, f"rule {rule.name}"))
    return " (a built-in template made it for a new op)" if file.parent == builtin_rules_dir() else ""


# ---------------------------------------------------------------------------------------
# The cache key and the cache


@cache
def refine_identity() -> str:
    """refine's own sources and the versions of what the harness evaluates with."""
    h = hashlib.sha256()
    for root in (Path(__file__).resolve().parents[1], builtin_rules_dir()):  # refine/, rules/
        for p in sorted(root.rglob("*.py")):
            if "__pycache__" in p.parts:
                continue
            h.update(f"{p.relative_to(root).as_posix()}\0".encode())
            h.update(p.read_bytes())
    for dist in ("refine", "torch", "egglog"):
        try:
            h.update(f"{dist}={importlib.metadata.version(dist)}\0".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{dist}=?\0".encode())
    return h.hexdigest()


def verification_key(registry: Registry, dirs: list[str]) -> str:
    rules, ops, decls = extra_items(registry)
    body = {
        "format": FORMAT, "refine": refine_identity(),
        "harness": [SEED, INSTANCES, MAX_SEEDS],  # and the rest of it: refine's sources
        "dirs": dirs, "digests": list(registry.digests),
        "rules": [[r.name, r.text, r.symbolic, r.analysis] for r in rules],
        "ops": [[op.name, op.inputs, op.attrs, op.core, op.kind, op.egglog_shape or "", op.decompose is not None]
                for op in ops],
        "decls": decls,
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def cache_dir() -> Path:
    """Where verifications are kept: $REFINE_CACHE_DIR, $XDG_CACHE_HOME/refine, ~/.cache/refine."""
    if os.environ.get(CACHE_ENV):
        root = Path(os.environ[CACHE_ENV])
    elif os.environ.get("XDG_CACHE_HOME"):
        root = Path(os.environ["XDG_CACHE_HOME"]) / "refine"
    else:
        root = Path.home() / ".cache" / "refine"
    return root / "verified-rules"


def cache_path(key: str) -> Path:
    return cache_dir() / f"{key}.json"


def _checksum(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_cached(key: str) -> Verification | None:
    """The stored verification under `key`, or None when there is none or it is not intact."""
    try:
        doc = json.loads(cache_path(key).read_text())
        body, check = doc["body"], doc["checksum"]
        if check != _checksum(body) or body["format"] != FORMAT or body["key"] != key:
            return None
        findings = [Finding(**f) for f in body["findings"]]
        if not all(f.status in ("unsound", "untested") and all(isinstance(v, str) for v in asdict(f).values())
                   for f in findings):
            return None
        rules, ops = body["rules"], body["ops"]
        if not all(isinstance(x, str) for x in [*rules, *ops]):
            return None
        return Verification(key, rules, ops, findings, cached=True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # missing, unreadable or corrupted: verify again


def write_cached(v: Verification) -> None:
    """Store atomically; a cache that cannot be written only costs a verification next time."""
    body = {"format": FORMAT, "key": v.key, "rules": v.rules, "ops": v.ops, "findings": [asdict(f) for f in v.findings]}
    path = cache_path(v.key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"body": body, "checksum": _checksum(body)}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass


# ---------------------------------------------------------------------------------------
# Verification


def verify(registry: Registry, dirs: list[str] | None = None, use_cache: bool = True) -> Verification:
    """Verify what the extra directories add to `registry` (from the cache when it holds
    this exact content). `dirs`: the extra directories, for the key."""
    dirs = [str(Path(d).resolve()) for d in dirs or []]
    key = verification_key(registry, dirs)
    if use_cache:
        hit = read_cached(key)
        if hit is not None:
            return hit
    rules, ops, decls = extra_items(registry)
    findings = _check_decls(registry, decls) + _check_ops(registry, ops) + _check_rules(registry, rules)
    v = Verification(key, [r.name for r in rules], [op.name for op in ops], findings)
    if use_cache:
        write_cached(v)
    return v


def require_verified(registry: Registry, dirs: list[str], symbolic: bool, trust: bool) -> list[str]:
    """Raise RulesRefused unless the extra rules may be used for a check in this size mode;
    return what is used unverified (trusted), for the report."""
    rules, ops, decls = extra_items(registry)
    if not (rules or ops or decls):
        return []
    v = verify(registry, dirs)
    mode = "symbolic" if symbolic else "concrete"
    relevant = [f for f in v.findings if f.status == "unsound" or f.mode in ("", mode)]
    unsound = [f for f in relevant if f.status == "unsound"]
    untested = [f for f in relevant if f.status == "untested"]
    if unsound or (untested and not trust):
        raise RulesRefused(unsound + untested)
    return [str(f) for f in untested]


def _check_rules(registry: Registry, rules: list[Rule]) -> list[Finding]:
    from refine.prove import harness

    if not rules:
        return []
    names = {r.name for r in rules}
    # the extra rules and the analyses they may read: every rule runs alone in its ruleset,
    # so the built-in rewrites left out change nothing but the time to declare them
    sub = replace(registry, rules=[r for r in registry.rules if r.analysis or r.name in names],
                  ops=dict(registry.ops), decls=list(registry.decls), families=list(registry.families))
    out: list[Finding] = []
    for symbolic in (False, True):
        mode = "symbolic" if symbolic else "concrete"
        mine = [r for r in rules if r.symbolic or not symbolic]
        if not mine:
            continue
        try:
            h = harness.Harness(sub, seed=SEED + symbolic, instances=INSTANCES, max_seeds=MAX_SEEDS,
                                symbolic=symbolic)
            results = {res.rule: res for res in h.run([r.name for r in mine])}
        except Exception as e:  # noqa: BLE001 - a harness that cannot run tested nothing
            why = f"the soundness harness could not run ({mode} sizes): {type(e).__name__}: {str(e)[:300]}"
            out += [Finding(_file(registry, f"rule {r.name}"), f"rule {r.name}", "untested", why, mode) for r in mine]
            continue
        for r in mine:
            res = results.get(r.name)
            where, note = _file(registry, f"rule {r.name}"), _made_by_template(registry, r)
            if res is not None and res.failures:
                more = f" (and {len(res.failures) - 1} more)" if len(res.failures) > 1 else ""
                out.append(Finding(where, f"rule {r.name}", "unsound",
                                   f"the soundness harness found a counterexample ({mode} sizes){note}: "
                                   f"{res.failures[0][:400]}{more}"))
            elif res is None or not res.fired or res.checked == 0:
                out.append(Finding(where, f"rule {r.name}", "untested",
                                   f"no seed term of the soundness harness made it fire ({mode} sizes){note}, so "
                                   "it was never checked (a family's SEEDS(gen) can give its rules seed terms)",
                                   mode))
    return out


def _check_decls(registry: Registry, decls: list[str]) -> list[Finding]:
    out = []
    for d in decls:
        try:
            heads = [head(x) or show(x) for x in parse(d)]
        except Exception as e:  # noqa: BLE001 - unreadable: egglog will not take it either
            heads = [f"unreadable ({e})"]
        bad = [h for h in heads if h not in DECLARATIONS]
        if bad:
            out.append(Finding(_file(registry, f"decl {d}"), "DECLS", "untested",
                               f"`{d[:120]}` is not only declarations ({', '.join(map(str, bad))}): a rule there "
                               "would run unverified; rules belong in RULES, where the harness checks them"))
    return out


def _sets_shapes_only(text: str) -> bool:
    """An egglog_shape: one `(rule (query) (actions))` whose actions only set `(shape ...)`."""
    try:
        cmds = parse(text)
    except SexpError:
        return False
    if len(cmds) != 1 or head(cmds[0]) != "rule" or len(cmds[0]) < 3:
        return False
    actions = cmds[0][2]
    return isinstance(actions, tuple) and all(
        head(a) == "set" and len(a) == 3 and head(a[1]) == "shape" for a in actions)


def _check_ops(registry: Registry, ops: list[Op]) -> list[Finding]:
    out = []
    for op in ops:
        where, item = _file(registry, f"op {op.name}"), f"op {op.name}"
        if op.kind == "collective":
            out.append(Finding(where, item, "untested", "a new collective: refine has no reference to check how "
                                                        "it lowers against"))
            continue
        if op.egglog_shape and not _sets_shapes_only(op.egglog_shape):
            out.append(Finding(where, item, "untested", "its egglog_shape does more than set (shape e) in one rule: "
                                                        "it would run unverified"))
        out += _try_op(registry, op, where, item)
    return out


def _samples(op: Op) -> list[tuple[list[Any], dict[str, Any]]]:
    """Arguments refine can make for any op: same-shape float tensors and each value of the
    `dim` attributes (optional attributes left out); none when another attribute is needed."""
    from refine.ir.graph import TensorType

    if any(k != "dim" and not k.endswith("?") for _, k in op.attrs):
        return []
    dims = [name for name, k in op.attrs if k == "dim"]
    counts = [op.inputs] if op.inputs >= 0 else [1, 2, 3]
    out = []
    for shape, n in itertools.product(SHAPES, counts):
        for values in itertools.product(range(len(shape)), repeat=len(dims)):
            ins, attrs = [TensorType(shape)] * n, dict(zip(dims, values, strict=True))
            try:
                op.shape(ins, attrs)
            except Exception:  # noqa: BLE001 - arguments this op does not take
                continue
            out.append((ins, attrs))
    return out


def _try_op(registry: Registry, op: Op, where: str, item: str) -> list[Finding]:
    """The shape rule and the lowering against the torch reference, on sampled arguments."""
    import torch

    from refine.ir.graph import Graph, Input, Node, Output
    from refine.ops.interp import canon, close, eval_graph, max_err
    from refine.ops.lower import lower

    how = "alias (kind identity)" if op.kind == "identity" else "decomposition" if op.decompose else ""
    tried, last = 0, "no arguments it can sample: same-shape float tensors and dim attributes only"
    gen = torch.Generator().manual_seed(SEED)
    for ins, attrs in _samples(op):
        names = [f"x{i}" for i in range(len(ins))]
        at = f"on inputs {[list(t.shape) for t in ins]}" + (f" with {attrs}" if attrs else "")
        try:
            out_type = op.shape(ins, attrs)
            g = Graph([Input(x, t) for x, t in zip(names, ins, strict=True)],
                      [Node("y", op.name, list(names), dict(attrs), out_type)], [Output("y", "y")])
            values = {x: torch.randn(t.shape, generator=gen, dtype=torch.float64) for x, t in zip(names, ins, strict=True)}
            if op.kind == "identity":  # the evaluator aliases it too: the reference alone says what it is
                if op.ref is None:
                    return []
                want = canon(op.ref(*values.values(), **attrs), out_type.dtype)
            else:
                want = eval_graph(g, registry, values)["y"]
            core, rename = lower(g, registry)
            got = eval_graph(core, registry, values)[rename["y"]]
        except Exception as e:  # noqa: BLE001 - not comparable on these arguments
            last = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        tried += 1
        if tuple(want.shape) != tuple(out_type.shape):
            return [Finding(where, item, "unsound", f"its shape rule gives {list(out_type.shape)} where its torch "
                                                    f"reference gives {list(want.shape)} {at}")]
        if how and not close(want, got):
            return [Finding(where, item, "unsound", f"its {how} differs from its torch reference {at} "
                                                    f"(max error {max_err(want, got):.3g})")]
    if how and not tried:
        return [Finding(where, item, "untested", f"refine could not try its {how} against its torch reference "
                                                 f"({last})")]
    return []
