"""Graph format v1: load and validate `seq.json` / `dist.json` (see schema/graph-v1.json).

    registry = refine.ops.registry.load_registry()
    seq = load_seq("seq.json", registry)
    dist = load_dist("dist.json", registry, seq)

Every problem is an `InputError` that names the file, the JSON path in it and the reason;
the CLI turns it into exit code 2. The loader checks everything a later stage relies on
(names, references, shapes against the ops' shape rules, collectives matched across ranks,
relations and expectations against the shapes they place), so that no later stage meets
bad input; the JSON Schema is documentation and a tool for editors, not what runs here.
Refused among others: unknown fields, duplicate JSON keys, unknown ops or attributes,
dangling references, nodes out of topological order, mismatched collectives across ranks,
relations whose pieces do not make the sequential shape.

Documents. `{"format": "refine-graph", "version": 1, "kind": "sequential", "graph": {...}}`
and `{"format": ..., "kind": "distributed", "mesh": {"axes": [{"name", "size"}]}, "ranks":
[{"rank": r, "graph": {...}}], "relations": [...], "expectations": [...]}`; optional
`"symbols"` in either (refine.ir.sizes; the distributed file inherits the sequential file's,
and redeclaring one differently is an error). A graph has `inputs` (name, shape, dtype,
role: parameter / data / buffer), `nodes` in topological order (name, op, args, attrs,
shape, dtype, source) and `outputs` (name, ref, role: loss / gradient with "of" /
activation / other). `args` are names of inputs or earlier nodes, or number literals. Every
node states its shape and dtype, which must agree with the op's shape rule.

Names may hold any text but `@` (it separates a name from its rank) and half a UTF-16
surrogate pair. They reach the e-graph only through one encoding (`refine.ir.term.quote`),
so a name is data, never egglog syntax, and reports show it as written. In the relation
language a name the plain form cannot spell is quoted JSON-style: `"attn out"@0`.

Bounds: fewer than 2^62 elements per tensor (the e-graph multiplies sizes in 64 bits), at
most 16 mesh axes and a graph for every rank, symbolic sizes that compare within 2^14
expansion steps, layouts nested at most 32 calls, no NaN literal (it equals nothing),
integers within 64 bits. Infinities are values (`-inf` masks). Loading is linear in the file.

Value classes. Floating dtypes are one class (refine's values are reals); a cast that narrows
the class (float to int truncates, anything to bool binarizes) is refused: in `cast`, in
every op taking a `dtype` (`to_copy`, `clone`, ...) and in a node whose declared dtype
narrows what torch would give. A bool made a number is `cast_float_t`; two bools add to
their logical or. A fill holds what its dtype holds (2.5 in int64 is 2).

Relations. `{"from": seq_input, "input": rank_input (default the same name), "placements":
[...] or {axis: placement}}` with Replicate, Shard(d), Partial(sum), Partial(max); or
`{"from": ..., "layout": expr}` in the relation language over rank inputs `name@rank`
(`cat(..., dim=d)`, `slice(x, dim, start, end)`, `sum(...)`, `scale(x, 1/2)`,
`view(x, [..])`, `transpose(x, i, j)`); or a list of such layouts, the same expression over
other ranks' tensors of the same names (replicas: copies held whole by some ranks only, such
as a pipeline's tied weight). A placed relation may say `"guessed": true` (capture writes it
for placements inferred from names and shapes); the report lists it. Every piece of a
relation must hold the sequential tensor's value class (float / int / bool; float precisions
may differ). A rank element stands for one sequential element only: a layout reading a
region twice (`cat(w@0, w@0)`, overlapping slices), two relations reading one rank tensor,
replicas placing a piece elsewhere and a scale by 0 are refused (symbolic bounds by proof,
`refine.relate.overlap`). Replicas at the same place and defines state such equalities and
are allowed. A sequential input with no relation but a rank input of the same name and shape
on every rank is taken as replicated, and the report flags the guess.

Defines. A define gives a rank input in full over sequential inputs (bare names, the
relation language plus `zeros([..])`): a zero-padded shard, or copies of a head,

    {"define": "w@5", "as": "cat(slice(w, 1, 1920, 2048), zeros([2048, 256]), dim=1)"}

Relations say what the sequential inputs are; a part of a rank input no relation reads is
otherwise free, so padding needs a define. Each is checked numerically against the relations:
random inputs are drawn to satisfy the relations, one group of defines and relations sharing an
input at a time, the defined inputs set from them, and every relation must keep its value, else
exit 2 naming the define's path. The prover is told each define as a fact over the inputs'
relations (rules/pad.py drops a zero-padded part of a product's contraction dim). Concrete
shapes only.

Program order. A rank graph's node order is its program order for communication: the order
in which the rank issues its collectives and sends/recvs. The k-th collective of a group on
each member is one collective, the j-th send from a to b meets the j-th recv on b from a,
and refine.ops.schedule checks that the ranks can run them in that order without deadlock
(else DOES NOT REFINE); sends/recvs with the same `batch` attribute are posted together.
Other nodes need only follow their inputs. The frontends keep that order: capture emits a
rank's collectives in the order make_fx traced them (each after the nodes it reads), the
Entangle importer translates a dump in its FX graph order (the order it was recorded in).
"""

from __future__ import annotations

import functools
import gc
import json
import math
import re
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any, TypeVar

from refine.ir import sizes
from refine.ir.errors import InputError
from refine.ir.graph import (
    DTYPES,
    VALUE_CLASSES,
    Define,
    Dist,
    Expectation,
    Graph,
    Input,
    Mesh,
    Node,
    Output,
    Placement,
    Relation,
    TensorType,
    narrowing,
    value_class,
)
from refine.ir.term import LayoutSyntaxError, parse_layout
from refine.ops.lower import normalize_attrs
from refine.ops.registry import Op, Registry, ShapeError

T = TypeVar("T")
FORMAT = "refine-graph"
VERSION = 1
ROLES_IN = ("parameter", "data", "buffer")
ROLES_OUT = ("loss", "gradient", "activation", "other")
MESH_AXES = 16  # every placement names each axis; real meshes have a few (dp, pp, tp, cp, ep)
# Sizes are 64-bit integers in the e-graph, and its rules multiply a tensor's dims (a view's
# prefix products, two merged dims) and add two of them (a concat): a product of any of a
# tensor's dims must stay below 2^62, so that such a sum stays within i64 (an 8B-parameter
# flat buffer is 2^33 elements). Integers the e-graph holds as they are must fit in i64.
MAX_ELEMENTS = 2**62
I64 = 2**63

# the fields each object of the format may have (anything else is a typo, and an error)
FIELDS = {
    "sequential": ("format", "version", "kind", "symbols", "graph"),
    "distributed": ("format", "version", "kind", "symbols", "mesh", "ranks", "relations", "expectations"),
    "symbol": ("min", "multiple_of"),
    "graph": ("inputs", "nodes", "outputs"),
    "input": ("name", "shape", "dtype", "role", "source"),
    "node": ("name", "op", "args", "attrs", "shape", "dtype", "source"),
    "output": ("name", "ref", "role", "of"),
    "mesh": ("axes",),
    "axis": ("name", "size"),
    "rank": ("rank", "graph"),
    "relation": ("from", "input", "placements", "layout", "guessed"),
    "define": ("define", "as"),
    "expectation": ("output", "local", "placements", "layout", "guessed"),
}


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    for t in (bool, int, float, str, list, dict):
        if isinstance(v, t):
            return _kind_name(t)
    return type(v).__name__


class _Ctx:
    def __init__(self, file: str) -> None:
        self.file = file
        self.symbols: dict[str, sizes.Sym] = {}
        # types read so far, by their shape of plain ints and dtype: most tensors share a few
        # (read once, and one object: a million-node graph holds a few thousand types)
        self.types: dict[tuple[tuple[int, ...], str], TensorType] = {}

    def fail(self, where: str, reason: str) -> InputError:
        return InputError(self.file, where or "$", reason)

    def get(self, obj: Any, key: str, where: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        if not isinstance(obj, dict):
            raise self.fail(where, f"expected an object, got {_json_type(obj)}")
        if key not in obj:
            if default is not ...:
                return default
            raise self.fail(where, f"missing field {key!r}")
        v = obj[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
            raise self.fail(f"{where}.{key}", f"expected {_kind_name(kind)}, got {_json_type(v)}")
        return v

    def fields(self, obj: Any, where: str, what: str) -> None:
        """`obj` is an object with only the fields the format gives a `what`."""
        if not isinstance(obj, dict):
            raise self.fail(where, f"expected an object, got {_json_type(obj)}")
        allowed = FIELDS[what]
        for k in obj:
            if k not in allowed:
                raise self.fail(f"{where}.{k}", f"unknown field {k!r} in {_a(what)} (allowed: {', '.join(allowed)})")

    def name(self, obj: dict[str, Any], key: str, where: str, default: Any = ...) -> str:
        v = self.get(obj, key, where, str, default)
        if not v:
            raise self.fail(f"{where}.{key}", "a name must not be empty")
        if "@" in v:
            raise self.fail(f"{where}.{key}", f"a name must not contain '@' (it separates a name from a rank): {v!r}")
        return v


def _a(what: str) -> str:
    what = f"{what} document" if what in ("sequential", "distributed") else what
    return ("an " if what[0] in "aeiou" else "a ") + what


def read_json(path: str | Path) -> Any:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(str(path), "$", f"not UTF-8 text (byte {e.start}): not a JSON file") from None
    except OSError as e:
        raise InputError(str(path), "$", f"cannot read: {e.strerror or e}") from None
    repeated: list[_Object] = []  # objects with a key given twice: only then is the document walked

    def read_object(pairs: list[tuple[str, Any]]) -> _Object:
        obj = _Object(pairs)
        if obj.dups:
            repeated.append(obj)
        return obj

    try:
        doc = json.loads(text, object_pairs_hook=read_object)
    except json.JSONDecodeError as e:
        raise InputError(str(path), f"line {e.lineno} column {e.colno}", f"malformed JSON: {e.msg}") from None
    except RecursionError:
        raise InputError(str(path), "$", "malformed JSON: nested too deeply") from None
    except ValueError as e:  # a number of more digits than Python converts
        raise InputError(str(path), "$", f"unreadable JSON: {e}") from None
    dup = _duplicate_key(doc, "$") if repeated else None
    if dup is not None:
        where, key = dup
        raise InputError(str(path), where, f"key {key!r} appears twice in one object (JSON keeps only the last)")
    bad = _not_text(doc, "$") if _SURROGATE_ESCAPE.search(text) else None
    if bad is not None:
        raise InputError(str(path), bad, "a string holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape "
                                         "that is not half of a pair): not Unicode text")
    return doc


class _Object(dict):
    """A JSON object that remembers keys given more than once."""

    dups: tuple[str, ...] = ()

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        if len(self) != len(pairs):
            seen: set[str] = set()
            self.dups = tuple(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]


def _duplicate_key(v: Any, where: str) -> tuple[str, str] | None:
    """The first object, in document order, with a key given twice, and that key. A walk, not
    a recursion: documents nest as deep as the JSON parser allows."""
    stack = [(v, where)]
    while stack:
        x, at = stack.pop()
        if isinstance(x, _Object) and x.dups:
            return at, x.dups[0]
        if isinstance(x, dict):
            inner = [(y, f"{at}.{k}") for k, y in x.items() if isinstance(y, (dict, list))]
        elif isinstance(x, list):
            inner = [(y, f"{at}[{i}]") for i, y in enumerate(x) if isinstance(y, (dict, list))]
        else:
            continue  # the document itself may be a scalar
        stack.extend(reversed(inner))
    return None


def _not_text(v: Any, where: str) -> str | None:
    """Where a string (or key) of the document is not Unicode text: JSON's \\u escapes can
    spell half a surrogate pair, which no text output can print."""
    if isinstance(v, str):
        return None if v.isascii() or not _SURROGATE.search(v) else where
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, x in items:
        at = f"{where}.{k}" if isinstance(k, str) else f"{where}[{k}]"
        if isinstance(k, str) and _SURROGATE.search(k):
            return at
        found = _not_text(x, at)
        if found:
            return found
    return None


_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # how one gets into a document read as UTF-8


def _header(c: _Ctx, doc: Any, kind: str) -> None:
    if not isinstance(doc, dict):
        raise c.fail("$", f"the document must be a JSON object, got {_json_type(doc)}")
    for key, want in (("format", FORMAT), ("version", VERSION), ("kind", kind)):
        if key not in doc:
            raise c.fail("$", f"missing field {key!r} (expected {want!r})")
    fmt, version, got = doc["format"], doc["version"], doc["kind"]
    if fmt != FORMAT:
        raise c.fail("$.format", f"expected {FORMAT!r}, got {fmt!r}")
    if not isinstance(version, int) or isinstance(version, bool) or version != VERSION:
        raise c.fail("$.version", f"unsupported version {version!r} (this refine reads {VERSION})")
    if got != kind:
        if got in ("sequential", "distributed"):
            raise c.fail("$.kind", f"expected {kind!r}, got {got!r}: are the two files swapped?")
        raise c.fail("$.kind", f"expected {kind!r}, got {got!r}")
    c.fields(doc, "$", kind)


def _symbols(c: _Ctx, doc: dict[str, Any], inherited: dict[str, sizes.Sym]) -> dict[str, sizes.Sym]:
    """`symbols`: name -> {min, multiple_of}. A name the sequential file declares must mean
    the same in the distributed one."""
    out = dict(inherited)
    for name, spec in c.get(doc, "symbols", "$", dict, {}).items():
        at = f"$.symbols.{name}"
        if not name.isidentifier() or name.startswith("_"):
            raise c.fail(at, f"a symbol name must be an identifier not starting with '_', got {name!r}")
        c.fields(spec, at, "symbol")
        lo = c.get(spec, "min", at, int, 1)
        step = c.get(spec, "multiple_of", at, int, 1)
        if lo < 0:
            raise c.fail(f"{at}.min", f"a size is never negative; min must be at least 0, got {lo}")
        if step < 1:
            raise c.fail(f"{at}.multiple_of", f"multiple_of must be at least 1, got {step}")
        s = sizes.sym(name, lo, step)
        if name in inherited and inherited[name] != s:
            old = sizes.atoms_of(inherited[name])[name]
            raise c.fail(at, f"symbol {name!r} is declared with min {lo}, multiple_of {step} here but with "
                             f"min {old.min}, multiple_of {old.multiple} in the sequential file")
        out[name] = s
    return out


def _dim(c: _Ctx, v: Any, where: str, allow_minus_one: bool = False) -> Any:
    """A size: a non-negative integer, or an expression over the declared symbols."""
    if isinstance(v, str):
        try:
            d = sizes.parse(v, c.symbols)
        except ValueError as e:
            known = ", ".join(sorted(c.symbols)) or "none declared"
            raise c.fail(where, f"cannot read size {v!r}: {e} (symbols: {known})") from None
        if not sizes.ge(d, 0):
            raise c.fail(where, f"size {v!r} is not provably non-negative for every value of its symbols")
        return d
    if not _is_int(v) or (v < 0 and not (allow_minus_one and v == -1)):
        raise c.fail(where, f"a dim must be a non-negative integer, got {v!r} (or a size over declared "
                            "symbols, like \"S/2\")")
    return v


def _type(c: _Ctx, obj: dict[str, Any], where: str) -> TensorType:
    shape = c.get(obj, "shape", where, list)
    dtype = c.get(obj, "dtype", where, str, "float32")
    key = (tuple(shape), dtype) if all(type(s) is int for s in shape) else None  # True is no 1 here
    if key in c.types:
        return c.types[key]  # type: ignore[index]
    dims_ = tuple(_dim(c, s, f"{where}.shape[{i}]") for i, s in enumerate(shape))
    if dtype not in DTYPES:
        raise c.fail(f"{where}.dtype", f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    count = math.prod(max(d, 1) for d in dims_ if isinstance(d, int))  # symbolic sizes are Python ints there
    if count >= MAX_ELEMENTS:
        raise c.fail(f"{where}.shape", f"shape {list(dims_)} has 2^{math.log2(count):.1f} elements (a zero-sized "
                                       "dim counted as 1): refine reads tensors of fewer than 2^62 elements, "
                                       "as its e-graph multiplies sizes in 64 bits")
    typ = TensorType(dims_, dtype)
    if key is not None:
        c.types[key] = typ
    return typ


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _number_problem(v: Any) -> str | None:
    """Why a number literal cannot be read: NaN, or an integer beyond 64 bits. Infinities are
    values (a mask's -inf); NaN equals nothing, itself included, so no equality refine could
    prove or refute over a tensor holding it means what torch computes."""
    if isinstance(v, float) and v != v:
        return "is NaN, which refine does not reason about (NaN equals nothing, not even itself)"
    if _is_int(v) and not -I64 <= v < I64:
        return f"is an integer of {v.bit_length()} bits, which does not fit in 64 bits"
    return None


def _attr_problem(name: str, kind: str, v: Any) -> str | None:
    """Why attribute value `v` does not fit `kind`, or None if it does."""
    optional = kind.endswith("?")
    kind = kind.rstrip("?")
    if v is None:
        return None if optional else "is required; null is not a value for it"
    problem = next((p for x in (v if isinstance(v, list) else [v]) if (p := _number_problem(x))), None)
    if problem and kind != "rational":
        return problem
    ok = {
        "int": _is_int(v),
        "dim": _is_int(v),
        "ints": isinstance(v, list) and all(_is_int(x) or isinstance(x, str) for x in v),
        "shape": isinstance(v, list) and all(_is_int(x) or isinstance(x, str) for x in v),
        "size": _is_int(v) or isinstance(v, str),
        "dims": _is_int(v) or (isinstance(v, list) and all(_is_int(x) for x in v)),
        "float": _is_num(v),
        "bool": isinstance(v, bool),
        "str": isinstance(v, str),
    }
    if kind == "rational":
        try:
            if isinstance(v, bool) or not isinstance(v, (int, float, str)):
                raise ValueError
            Fraction(v)
            return None
        except (ValueError, ZeroDivisionError, OverflowError):
            return f"must be a number or a fraction like '1/2', got {v!r}"
    if kind not in ok or ok[kind]:
        if name == "dtype" and isinstance(v, str) and v not in DTYPES:
            return f"unknown dtype {v!r} (known: {', '.join(DTYPES)})"
        if kind == "shape" and any(_is_int(x) and x < 0 for x in v):
            return f"a shape's dims must be non-negative, got {v!r}"
        return None
    want = {"int": "an integer", "dim": "an integer (a dim)", "ints": "a list of integers or sizes",
            "shape": "a list of sizes (a shape)", "size": "a size (an integer or an expression like \"S/2\")", "dims": "an integer or a list of integers",
            "float": "a number", "bool": "true or false", "str": "a string"}[kind]
    return f"must be {want}, got {_json_type(v)} {json.dumps(v)}"


def _check_attrs(c: _Ctx, op: Op, op_name: str, name: str, attrs: dict[str, Any], at: str) -> None:
    known = op.attr_kinds()
    for k, v in attrs.items():
        if k not in known:
            raise c.fail(f"{at}.attrs.{k}",
                         f"op {op_name!r} has no attribute {k!r} (it has: {', '.join(known) or 'none'})")
        problem = _attr_problem(k, known[k], v)
        if problem:
            raise c.fail(f"{at}.attrs.{k}", f"attribute {k!r} of op {op_name!r} {problem}")
    for k, kind in op.attrs:
        if not kind.endswith("?") and k not in attrs:
            raise c.fail(f"{at}.attrs", f"node {name!r}: op {op_name!r} needs attribute {k!r} ({kind})")


def _read_sizes(c: _Ctx, op: Op, attrs: dict[str, Any], at: str) -> dict[str, Any]:
    """Attributes holding sizes, with symbolic expressions read."""
    out = dict(attrs)
    for k, kind in op.attrs:
        kind, v = kind.rstrip("?"), attrs.get(k)
        if v is None:
            continue
        if kind in ("shape", "ints"):
            out[k] = [_dim(c, x, f"{at}.attrs.{k}[{i}]", allow_minus_one=True) for i, x in enumerate(v)]
        elif kind == "size":
            out[k] = _dim(c, v, f"{at}.attrs.{k}")
    return out


def _dtype_problem(op: Op, attrs: dict[str, Any], ins: list[TensorType], inferred: TensorType,
                   typ: TensorType, args: list[Any]) -> str | None:
    """Why a node's dtype misstates its value class, or None. The prover reasons about the
    values the op computes, so a dtype that narrows them (float to int truncates, to bool
    binarizes) would change them unseen; a `dtype` attribute (a cast, rules/cast.py) must
    be the node's. A number literal takes part as torch promotes it (an int tensor times
    0.5 is a float one). A node without tensor inputs that stores a number (`full`) holds it
    as its dtype does (refine.ops.lower.held); a recv holds what its send sent (same dtype)."""
    declared = value_class(typ.dtype)
    given = attrs.get("dtype")
    if given is not None:
        if value_class(given) != declared:
            return f"its dtype attribute is {given}, of another value class"
        return None
    if not ins and (op.kind == "collective" or any(k.rstrip("?") == "float" for _, k in op.attrs)):
        return None
    if len(ins) != len(args):
        # as torch types the op: each number literal a rank-0 tensor of its class (0.5 a
        # float; 2 and 2.0 an int, which an integer tensor holds exactly)
        tensors = iter(ins)
        typed = [next(tensors) if isinstance(x, str) else TensorType((), _literal_dtype(x)) for x in args]
        try:
            inferred = op.shape(typed, attrs)
        except Exception:  # noqa: BLE001 - a rule that takes no tensor there: the tensors' type stands
            pass
    got = value_class(inferred.dtype)
    if VALUE_CLASSES.index(declared) < VALUE_CLASSES.index(got):
        return f"{op.name} of {', '.join(map(str, ins)) or 'no tensors'} gives {inferred.dtype}, and " + \
            str(narrowing(inferred.dtype, typ.dtype))
    return None


def _literal_dtype(x: Any) -> str:
    return "bool" if isinstance(x, bool) else "int64" if float(x).is_integer() else "float32"


def _lowerable(op: Op) -> bool:
    return op.core or op.decompose is not None or op.kind in ("identity", "collective")


def load_graph(c: _Ctx, obj: Any, where: str, registry: Registry) -> Graph:
    c.fields(obj, where, "graph")
    g = Graph(name=where)
    seen: dict[str, str] = {}

    def define(name: str, at: str) -> None:
        if name in seen:
            raise c.fail(f"{at}.name", f"name {name!r} is already defined at {seen[name]}")
        seen[name] = at

    for i, inp in enumerate(c.get(obj, "inputs", where, list)):
        at = f"{where}.inputs[{i}]"
        c.fields(inp, at, "input")
        name = c.name(inp, "name", at)
        define(name, at)
        role = c.get(inp, "role", at, str, "data")
        if role not in ROLES_IN:
            raise c.fail(f"{at}.role", f"role must be one of {list(ROLES_IN)}, got {role!r}")
        src = c.get(inp, "source", at, str, None)
        g.add_input(Input(name, _type(c, inp, at), role, src))

    raw_nodes = c.get(obj, "nodes", where, list)
    # every name first, so that a reference to a later node is reported as a cycle/order error
    later: dict[str, int] = {}
    for i, n in enumerate(raw_nodes):
        name = n.get("name") if isinstance(n, dict) else None
        if isinstance(name, str):
            later.setdefault(name, i)
    for i, n in enumerate(raw_nodes):
        at = f"{where}.nodes[{i}]"
        c.fields(n, at, "node")
        name = c.name(n, "name", at)
        define(name, at)
        op_name = c.get(n, "op", at, str)
        op = registry.ops.get(op_name)
        if op is None:
            raise c.fail(f"{at}.op", f"unknown op {op_name!r} in node {name!r}: no rule family defines it")
        if not _lowerable(op):
            raise c.fail(f"{at}.op", f"op {op_name!r} in node {name!r} (rule family {op.family!r}) is not a core op "
                                     "and has no decomposition: refine cannot reason about it")
        args = c.get(n, "args", at, list, [])
        for j, a in enumerate(args):
            if isinstance(a, str):
                if a not in seen or a == name:
                    if a in later:
                        kind = "a cycle" if later[a] >= i else "an ordering error"
                        raise c.fail(f"{at}.args[{j}]", f"{name!r} uses {a!r}, defined later: {kind} (nodes must be in topological order)")
                    raise c.fail(f"{at}.args[{j}]", f"{name!r} refers to {a!r}, which is not defined")
            elif not _is_num(a):
                raise c.fail(f"{at}.args[{j}]", f"an argument is a name or a number, got {_json_type(a)}")
            elif problem := _number_problem(a):
                raise c.fail(f"{at}.args[{j}]", f"node {name!r}: the literal {problem}")
        attrs = c.get(n, "attrs", at, dict, {})
        _check_attrs(c, op, op_name, name, attrs, at)
        attrs = _read_sizes(c, op, attrs, at)
        tensors = [a for a in args if isinstance(a, str)]
        if op.inputs >= 0 and len(args) != op.inputs:
            raise c.fail(f"{at}.args", f"op {op_name!r} takes {op.inputs} argument(s), got {len(args)}")
        if op.decompose is None and len(tensors) != len(args):
            raise c.fail(f"{at}.args", f"op {op_name!r} takes tensors only, not number literals")
        typ = _type(c, n, at)
        ins = [g.type_of(a) for a in tensors]
        try:
            norm = normalize_attrs(op, attrs, ins)
            inferred = op.shape(ins, norm)
        except ShapeError as e:
            raise c.fail(at, f"node {name!r} ({op_name}): {e}") from None
        except Exception as e:  # a shape rule meeting arguments it cannot take
            lit = next((j for j, a in enumerate(args) if not isinstance(a, str)), None)
            if lit is not None:
                raise c.fail(f"{at}.args[{lit}]", f"node {name!r}: op {op_name!r} does not take the number literal "
                                                  f"{args[lit]!r} here ({type(e).__name__}: {e})") from None
            raise c.fail(at, f"node {name!r} ({op_name}): bad arguments or attributes for its shape rule "
                             f"({type(e).__name__}: {e})") from None
        if tuple(inferred.shape) != typ.shape:
            raise c.fail(f"{at}.shape", f"node {name!r} ({op_name}) has shape {list(typ.shape)} but its inputs give {list(inferred.shape)}")
        problem = _dtype_problem(op, norm, ins, inferred, typ, args)
        if problem:
            raise c.fail(f"{at}.dtype", f"node {name!r} ({op_name}) says dtype {typ.dtype}, but {problem}")
        src = c.get(n, "source", at, str, None)
        g.add(Node(name, op_name, list(args), attrs, typ, src))

    outs = c.get(obj, "outputs", where, list)
    if not outs:
        raise c.fail(f"{where}.outputs", "a graph needs at least one output")
    names: set[str] = set()
    inputs = {i.name for i in g.inputs}
    for i, o in enumerate(outs):
        at = f"{where}.outputs[{i}]"
        c.fields(o, at, "output")
        name = c.name(o, "name", at)
        ref = c.get(o, "ref", at, str, name)
        if ref not in seen:
            raise c.fail(f"{at}.ref", f"output {name!r} refers to {ref!r}, which is not defined")
        if name in names:
            raise c.fail(f"{at}.name", f"output name {name!r} is used twice")
        names.add(name)
        role = c.get(o, "role", at, str, "other")
        if role not in ROLES_OUT:
            raise c.fail(f"{at}.role", f"role must be one of {list(ROLES_OUT)}, got {role!r}")
        of = c.get(o, "of", at, str, None)
        if of is not None and of not in inputs:
            raise c.fail(f"{at}.of", f"output {name!r} is the gradient of {of!r}, which is not an input")
        g.outputs.append(Output(name, ref, role, of))
    return g


def _uncollected(load: Callable[..., T]) -> Callable[..., T]:
    """`load` with the cyclic collector paused: a load makes millions of objects and no
    reference cycles, and the collector's passes over them (a full one walks everything
    made so far) took 40% of loading a 10^6-node graph."""

    @functools.wraps(load)
    def run(*args: Any, **kwargs: Any) -> T:
        was = gc.isenabled()
        gc.disable()
        try:
            return load(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return run


@_uncollected
def load_seq(path: str | Path, registry: Registry) -> Graph:
    c = _Ctx(str(path))
    doc = read_json(path)
    _header(c, doc, "sequential")
    c.symbols = _symbols(c, doc, {})
    g = load_graph(c, c.get(doc, "graph", "$", dict), "$.graph", registry)
    g.symbols = dict(c.symbols)
    for i, n in enumerate(g.nodes):
        if registry.ops[n.op].kind == "collective":
            raise c.fail(f"$.graph.nodes[{i}].op", f"the sequential graph has a collective ({n.op}) in node {n.name!r}")
    g.name = "seq"
    return g


def parse_placement(c: _Ctx, text: Any, where: str) -> Placement:
    if not isinstance(text, str):
        raise c.fail(where, f"a placement is a string like 'Shard(0)', got {_json_type(text)} {json.dumps(text)}")
    t = text.strip()
    if t in ("Replicate", "Replicate()", "R"):
        return Placement("replicate")
    if t in ("Partial", "Partial()", "Partial(sum)", "P"):
        return Placement("partial", reduce="sum")
    if t in ("Partial(max)",):
        return Placement("partial", reduce="max")
    if t.startswith("Shard(") and t.endswith(")"):
        try:
            return Placement("shard", dim=int(t[6:-1]))
        except ValueError:
            pass
    raise c.fail(where, f"unknown placement {text!r} (Replicate, Shard(d), Partial(sum), Partial(max))")


def _placements(c: _Ctx, obj: dict[str, Any], where: str, mesh: Mesh, ndim: int, what: str
                ) -> tuple[Placement, ...]:
    """One placement per mesh axis; Shard dims normalized against a tensor of `ndim` dims."""
    raw = obj["placements"]
    at = f"{where}.placements"
    names = [a for a, _ in mesh.axes]
    if isinstance(raw, dict):
        for k in raw:
            if k not in names:
                raise c.fail(f"{at}.{k}", f"unknown mesh axis {k!r} (axes: {', '.join(names)})")
        items = [(f"{at}.{a}", raw.get(a, "Replicate")) for a in names]
    elif isinstance(raw, list):
        if len(raw) != len(mesh.axes):
            raise c.fail(at, f"expected one placement per mesh axis ({len(mesh.axes)}: {', '.join(names)}), got {len(raw)}")
        items = [(f"{at}[{i}]", p) for i, p in enumerate(raw)]
    else:
        raise c.fail(at, f"expected a list (one placement per mesh axis) or an object by axis name, got {_json_type(raw)}")
    out = []
    for path, p in items:
        pl = parse_placement(c, p, path)
        if pl.kind == "shard":
            assert pl.dim is not None
            if not -ndim <= pl.dim < ndim:
                raise c.fail(path, f"{pl} is out of range for {what}, which has {ndim} dim(s)")
            pl = Placement("shard", dim=pl.dim % ndim)
        out.append(pl)
    return tuple(out)


def _placed_shape(c: _Ctx, mesh: Mesh, placements: tuple[Placement, ...], shape_of: Callable[[int], tuple[int, ...]],
                  where: str, what: str) -> tuple[int, ...]:
    """The shape of the tensor the ranks' pieces `shape_of(rank)` make when placed this way:
    replicas (and partial terms) must agree, shards must concatenate."""

    def go(axis: int, coords: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
        if axis == len(mesh.axes):
            r = mesh.rank(coords)
            return tuple(shape_of(r)), r
        parts = [go(axis + 1, coords + (i,)) for i in range(mesh.axes[axis][1])]
        p, (first, r0) = placements[axis], parts[0]
        ax = mesh.axes[axis][0]
        for s, r in parts[1:]:
            if p.kind == "shard":
                d = p.dim
                assert d is not None
                if len(s) != len(first) or d >= len(s) or any(x != y for k, (x, y) in enumerate(zip(s, first, strict=True)) if k != d):
                    raise c.fail(where, f"{what}: the pieces on rank {r0} {list(first)} and rank {r} {list(s)} "
                                        f"cannot be concatenated along dim {d} ({p} on mesh axis {ax!r})")
            elif s != first:
                role = "replicas" if p.kind == "replicate" else "terms of one partial sum"
                raise c.fail(where, f"{what}: rank {r0} holds shape {list(first)} but rank {r} holds {list(s)}; "
                                    f"they cannot be {role} ({p} on mesh axis {ax!r})")
        if p.kind != "shard":
            return first, r0
        assert p.dim is not None
        return first[:p.dim] + (sum(s[p.dim] for s, _ in parts),) + first[p.dim + 1:], r0

    return go(0, ())[0]


def _check_collectives(c: _Ctx, ranks: dict[int, Graph], at_rank: dict[int, str], registry: Registry) -> None:
    """The k-th collective of a group on each member is one collective: every member must run
    it, with the same op and attributes, on inputs of one shape; each send meets its recv."""
    by_group: dict[tuple[tuple[int, ...], int], dict[int, tuple[Node, str]]] = {}
    p2p: dict[tuple[int, int], tuple[list[tuple[Node, str]], list[tuple[Node, str]]]] = {}
    for r, g in sorted(ranks.items()):
        count: dict[tuple[int, ...], int] = {}
        for j, n in enumerate(g.nodes):
            if registry.ops[n.op].kind != "collective":
                continue
            at = f"{at_rank[r]}.graph.nodes[{j}]"
            if n.op in ("send", "recv"):
                peer = n.attrs["peer"]
                pair = (r, peer) if n.op == "send" else (peer, r)
                p2p.setdefault(pair, ([], []))[n.op == "recv"].append((n, at))
                continue
            if not isinstance(n.attrs.get("group"), list):
                raise c.fail(f"{at}.op", f"collective {n.op!r} in node {n.name!r} has no 'group' (a list of ranks): "
                                         "refine cannot match it across ranks")
            group = tuple(n.attrs["group"])
            k = count.get(group, 0)
            count[group] = k + 1
            by_group.setdefault((group, k), {})[r] = (n, at)

    def signature(g: Graph, n: Node) -> tuple[str, dict[str, Any], TensorType | None]:
        op = registry.ops[n.op]
        ins = [g.type_of(a) for a in n.tensor_args()]
        return n.op, normalize_attrs(op, n.attrs, ins), ins[0] if ins else None

    for (group, k), members in sorted(by_group.items()):
        r0 = min(members)
        n0, at0 = members[r0]
        for r in group:
            if r not in members:
                raise c.fail(at0, f"collective #{k} of group {list(group)} on rank {r0} ({n0.op} {n0.name!r}) "
                                  f"has no partner on rank {r}: rank {r} runs only {_count(ranks[r], group, registry)} "
                                  f"collective(s) of that group")
        op0, attrs0, in0 = signature(ranks[r0], n0)
        for r, (n, at) in sorted(members.items()):
            op, attrs, inp = signature(ranks[r], n)
            if op != op0 or attrs != attrs0:
                raise c.fail(at, f"collective #{k} of group {list(group)} is {op} {_show(n.attrs)} on rank {r} "
                                 f"(node {n.name!r}) but {op0} {_show(n0.attrs)} on rank {r0} (node {n0.name!r})")
            if inp is not None and in0 is not None and inp != in0:
                raise c.fail(f"{at}.args[0]", f"collective #{k} of group {list(group)} ({op}) gets {inp} on rank {r} "
                                              f"(node {n.name!r}) but {in0} on rank {r0} (node {n0.name!r})")
    for (src, dst), (sends, recvs) in sorted(p2p.items()):
        for i in range(max(len(sends), len(recvs))):
            if i >= len(recvs):
                n, at = sends[i]
                raise c.fail(at, f"rank {src} sends {n.tensor_args()[0]!r} (node {n.name!r}, send #{i} to rank {dst}) "
                                 f"but rank {dst} has {len(recvs)} matching recv(s) from rank {src}")
            if i >= len(sends):
                n, at = recvs[i]
                raise c.fail(at, f"rank {dst} receives {n.name!r} (recv #{i} from rank {src}) "
                                 f"but rank {src} has {len(sends)} matching send(s) to rank {dst}")
            (s, s_at), (v, v_at) = sends[i], recvs[i]
            sent = ranks[src].type_of(s.tensor_args()[0])
            if sent.shape != v.type.shape or sent.dtype != v.type.dtype:
                raise c.fail(v_at, f"recv {v.name!r} on rank {dst} expects {v.type} but the matching send "
                                   f"{s.name!r} on rank {src} ({s_at}) sends {sent}")


def _count(g: Graph, group: tuple[int, ...], registry: Registry) -> int:
    return sum(1 for n in g.nodes if registry.ops[n.op].kind == "collective"
               and tuple(n.attrs.get("group") or ()) == group)


def _show(attrs: dict[str, Any]) -> str:
    return json.dumps(attrs, sort_keys=True, default=str)


@_uncollected
def load_dist(path: str | Path, registry: Registry, seq: Graph) -> Dist:
    c = _Ctx(str(path))
    doc = read_json(path)
    _header(c, doc, "distributed")
    c.symbols = _symbols(c, doc, seq.symbols)
    mesh_obj = c.get(doc, "mesh", "$", dict)
    c.fields(mesh_obj, "$.mesh", "mesh")
    axes = []
    raw_axes = c.get(mesh_obj, "axes", "$.mesh", list)
    if len(raw_axes) > MESH_AXES:
        raise c.fail("$.mesh.axes", f"{len(raw_axes)} mesh axes; refine reads up to {MESH_AXES}")
    for i, ax in enumerate(raw_axes):
        at = f"$.mesh.axes[{i}]"
        c.fields(ax, at, "axis")
        name = c.name(ax, "name", at)
        if name in {a for a, _ in axes}:
            raise c.fail(f"{at}.name", f"mesh axis {name!r} is named twice")
        size = c.get(ax, "size", at, int)
        if size < 1:
            raise c.fail(f"{at}.size", f"an axis size must be at least 1, got {size}")
        axes.append((name, size))
    if not axes:
        raise c.fail("$.mesh.axes", "the mesh needs at least one axis")
    mesh = Mesh(tuple(axes))

    ranks: dict[int, Graph] = {}
    at_rank: dict[int, str] = {}
    raw_ranks = c.get(doc, "ranks", "$", list)
    if mesh.size > len(raw_ranks):
        # every rank needs its graph: checked before anything walks the ranks of a mesh
        # that can be any size (an axis of 10^12 ranks)
        given = {r.get("rank") for r in raw_ranks if isinstance(r, dict)}
        missing = next(k for k in range(len(raw_ranks) + 1) if k not in given)
        raise c.fail("$.ranks", f"no graph for rank {missing} (the mesh has {mesh.size} ranks)")
    for i, r in enumerate(raw_ranks):
        at = f"$.ranks[{i}]"
        c.fields(r, at, "rank")
        rank = c.get(r, "rank", at, int)
        if not 0 <= rank < mesh.size:
            raise c.fail(f"{at}.rank", f"rank {rank} is outside the mesh of {mesh.size} ranks")
        if rank in ranks:
            raise c.fail(f"{at}.rank", f"rank {rank} appears twice (also at {at_rank[rank]})")
        g = load_graph(c, c.get(r, "graph", at, dict), f"{at}.graph", registry)
        g.name = f"rank{rank}"
        g.symbols = dict(c.symbols)
        for j, n in enumerate(g.nodes):
            if registry.ops[n.op].kind != "collective":
                continue
            nat = f"{at}.graph.nodes[{j}].attrs"
            group = n.attrs.get("group")
            if isinstance(group, list):
                bad = [x for x in group if not _is_int(x) or not 0 <= x < mesh.size]
                if bad:
                    raise c.fail(f"{nat}.group", f"rank {bad[0]!r} is not in the mesh of {mesh.size} ranks")
                if rank not in group:
                    raise c.fail(f"{nat}.group", f"rank {rank} runs a collective of group {list(group)} it is not in")
            peer = n.attrs.get("peer")
            if peer is not None:
                if not _is_int(peer) or not 0 <= peer < mesh.size:
                    raise c.fail(f"{nat}.peer", f"peer rank {peer} is not in the mesh of {mesh.size} ranks")
                if peer == rank:
                    raise c.fail(f"{nat}.peer", f"rank {rank} cannot {n.op} to itself")
        ranks[rank] = g
        at_rank[rank] = at
    # as many graphs as ranks, each a distinct rank of the mesh: every rank has its graph
    _check_collectives(c, ranks, at_rank, registry)

    seq_inputs = {i.name: i for i in seq.inputs}
    rank_inputs = {r: {x.name for x in g.inputs} for r, g in ranks.items()}
    relations: list[Relation] = []
    related: dict[str, str] = {}
    defines: list[Define] = []
    defined: dict[tuple[int, str], str] = {}
    for i, rel in enumerate(c.get(doc, "relations", "$", list, [])):
        at = f"$.relations[{i}]"
        if isinstance(rel, dict) and "define" in rel:
            defines.append(_define(c, rel, at, ranks, seq, registry, defined))
            continue
        c.fields(rel, at, "relation")
        src = _once(c, rel, "from", at, seq_inputs, related, "relation", "an input")
        want = seq_inputs[src].type.shape
        if "layout" in rel:
            for k in ("placements", "input"):
                if k in rel:
                    raise c.fail(f"{at}.{k}", "a relation has either 'layout' or 'input'/'placements', not both")
            terms = _layouts(c, rel, at, lambda r: rank_inputs[r], ranks, mesh, "an input")
            for j, term in enumerate(terms):
                where = f"{at}.layout" + (f"[{j}]" if isinstance(rel["layout"], list) else "")
                _layout_shape(c, term, lambda r, n: ranks[r].type_of(n), registry, want, where, src)
                _leaf_classes(c, term, lambda r, n: ranks[r].type_of(n), where, f"sequential input {src!r}",
                              seq_inputs[src].type.dtype)
            guessed = c.get(rel, "guessed", at, bool, False)
            relations.append(Relation(src, layout=terms[0], replicas=tuple(terms[1:]), guessed=guessed, where=at))
            continue
        local = c.name(rel, "input", at, src)
        if "placements" not in rel:
            raise c.fail(at, "a relation needs 'placements' or 'layout'")
        pl = _placements(c, rel, at, mesh, len(want), f"sequential input {src!r}")
        guessed = c.get(rel, "guessed", at, bool, False)
        for r in sorted(ranks):
            if local not in rank_inputs[r]:
                raise c.fail(f"{at}.input" if "input" in rel else f"{at}.from",
                             f"{local!r} is not an input of rank {r}")
        got = _placed_shape(c, mesh, pl, lambda r, local=local: ranks[r].type_of(local).shape, f"{at}.placements",
                            f"rank input {local!r} placed [{', '.join(map(str, pl))}]")
        if got != want:
            raise c.fail(f"{at}.placements", f"the ranks' pieces of {src!r} ({local!r} placed [{', '.join(map(str, pl))}]) "
                                             f"make shape {list(got)}, but the sequential input has {list(want)}")
        for r, g in sorted(ranks.items()):
            _same_class(c, at, f"sequential input {src!r}", seq_inputs[src].type.dtype, f"{local}@{r}",
                        g.type_of(local).dtype)
        relations.append(Relation(src, local, pl, guessed=guessed, where=at))

    expectations: list[Expectation] = []
    seq_outs = {o.name: o for o in seq.outputs}
    outs = {r: {o.name: o.ref for o in g.outputs} for r, g in ranks.items()}
    expected: dict[str, str] = {}
    for i, ex in enumerate(c.get(doc, "expectations", "$", list, [])):
        at = f"$.expectations[{i}]"
        c.fields(ex, at, "expectation")
        out = _once(c, ex, "output", at, seq_outs, expected, "expectation", "an output")
        want = seq.type_of(seq_outs[out].ref).shape
        if "layout" in ex:
            for k in ("placements", "local"):
                if k in ex:
                    raise c.fail(f"{at}.{k}", "an expectation has either 'layout' or 'local'/'placements', not both")
            terms = _layouts(c, ex, at, lambda r: set(outs[r]), ranks, mesh, "an output")
            for j, term in enumerate(terms):
                where = f"{at}.layout" + (f"[{j}]" if isinstance(ex["layout"], list) else "")
                _layout_shape(c, term, lambda r, n: ranks[r].type_of(outs[r][n]), registry, want, where, out,
                              "sequential output")
                _leaf_classes(c, term, lambda r, n: ranks[r].type_of(outs[r][n]), where, f"sequential output {out!r}",
                              seq.type_of(seq_outs[out].ref).dtype)
            expectations.append(Expectation(out, layout=tuple(terms), where=at))
            continue
        local = c.name(ex, "local", at, out)
        refs: dict[int, str] = {}
        for r in sorted(ranks):
            if local not in outs[r]:
                raise c.fail(f"{at}.local" if "local" in ex else f"{at}.output", f"{local!r} is not an output of rank {r}")
            refs[r] = outs[r][local]
        if "placements" in ex:
            pl = _placements(c, ex, at, mesh, len(want), f"sequential output {out!r}")
        else:
            pl = tuple(Placement("replicate") for _ in mesh.axes)
        got = _placed_shape(c, mesh, pl, lambda r, refs=refs: ranks[r].type_of(refs[r]).shape, f"{at}.placements",
                            f"rank output {local!r} placed [{', '.join(map(str, pl))}]")
        if got != want:
            raise c.fail(f"{at}.placements", f"rank output {local!r} placed [{', '.join(map(str, pl))}] makes shape "
                                             f"{list(got)}, but the sequential output {out!r} has {list(want)}")
        for r, ref in sorted(refs.items()):
            _same_class(c, at, f"sequential output {out!r}", seq.type_of(seq_outs[out].ref).dtype, f"{local}@{r}",
                        ranks[r].type_of(ref).dtype)
        expectations.append(Expectation(out, local, pl, where=at, guessed=c.get(ex, "guessed", at, bool, False)))
    for name, o in seq_outs.items():
        if name in expected:
            continue
        # no expectation: the ranks' outputs of the same name are compared with it (refine.check)
        for r, g in sorted(ranks.items()):
            if name in outs[r]:
                _same_class(c, "$.expectations", f"sequential output {name!r} (no expectation given)",
                            seq.type_of(o.ref).dtype, f"{name}@{r}", g.type_of(outs[r][name]).dtype)
    dist = Dist(mesh, ranks, relations, expectations, defines)
    if defines:
        _check_defines(c, seq, dist, registry)
    return dist


def _define(c: _Ctx, rel: dict[str, Any], at: str, ranks: dict[int, Graph], seq: Graph, registry: Registry,
            defined: dict[tuple[int, str], str]) -> Define:
    """`{"define": "name@rank", "as": "<expression over sequential inputs>"}`: the rank input
    in full, from sequential inputs (zero padding, copies of a head)."""
    c.fields(rel, at, "define")
    target = c.get(rel, "define", at, str)
    name, _, r = target.rpartition("@")
    if not name or not r.isdigit():
        raise c.fail(f"{at}.define", f"expected a rank input name@rank, got {target!r}")
    rank = int(r)
    if rank not in ranks:
        raise c.fail(f"{at}.define", f"{target!r}: there is no rank {rank} (the mesh has {len(ranks)} ranks)")
    if not isinstance(ranks[rank].index().get(name), Input):
        raise c.fail(f"{at}.define", f"{target!r} is not an input of rank {rank}")
    if (rank, name) in defined:
        raise c.fail(f"{at}.define", f"{target!r} is defined twice (also at {defined[rank, name]})")
    defined[rank, name] = at
    text = c.get(rel, "as", at, str)
    try:
        term = parse_layout(text, sequential=True)
    except LayoutSyntaxError as e:
        raise c.fail(f"{at}.as", f"syntax error in define {text!r}: {e}") from None
    except Exception as e:  # the parser should say LayoutSyntaxError; never let it escape
        raise c.fail(f"{at}.as", f"syntax error in define {text!r} ({type(e).__name__}: {e})") from None
    seq_types = {x: i.type for x in term.leaves() if isinstance(i := seq.index().get(x), Input)}
    for leaf in sorted(term.leaves()):
        if leaf not in seq_types:
            raise c.fail(f"{at}.as", f"{leaf!r} is not an input of the sequential graph")
    want = ranks[rank].type_of(name)
    for leaf in sorted(term.leaves()):
        _same_class(c, f"{at}.as", f"sequential input {leaf!r}", seq_types[leaf].dtype, target, want.dtype)
    if any(not isinstance(d, int) for d in want.shape) or \
            any(not isinstance(d, int) for x in term.leaves() for d in seq_types[x].shape):
        raise c.fail(f"{at}.as", "a define takes concrete shapes only (no symbolic sizes)")

    def shape(t: Any) -> TensorType:
        if t.op == "D":
            return seq_types[t.attrs[0]]
        op = registry.ops[t.op]
        attrs = {k: v for (k, _), v in zip(op.attrs, t.attrs, strict=False)}
        return op.shape([shape(a) for a in t.args], attrs)

    try:
        got = shape(term)
    except Exception as e:  # ShapeError, or a shape rule meeting a term it cannot take
        raise c.fail(f"{at}.as", f"the define of {target!r} is ill-shaped: {e}") from None
    if tuple(got.shape) != tuple(want.shape):
        raise c.fail(f"{at}.as", f"the define of {target!r} makes shape {list(got.shape)}, "
                                 f"but the rank input has {list(want.shape)}")
    return Define(rank, name, term, at)


def _check_defines(c: _Ctx, seq: Graph, dist: Dist, registry: Registry) -> None:
    """Defines must agree with the relations: with random sequential inputs and rank inputs
    that satisfy the relations, each defined rank input set from its define must leave
    every relation's value unchanged (a define that says a region is zero, or a copy of
    another head, where a relation reads real data from it, is refused)."""
    from refine.ops.interp import define_conflict  # imports torch: only a case with defines does

    bad = define_conflict(seq, dist, registry)
    if bad is not None:
        d, why = bad
        raise c.fail(f"{d.where}.as", f"the define of {d.input}@{d.rank} contradicts the relations: {why}")


def _same_class(c: _Ctx, where: str, what: str, want: str, tensor: str, got: str) -> None:
    """A relation (an expectation, a define) equates values, so both sides hold values of one
    class; float precisions may differ (bfloat16 ranks of a float32 model)."""
    if value_class(want) != value_class(got):
        raise c.fail(where, f"{what} is {want} but rank tensor {tensor} is {got}: a relation equates values of one "
                            "class (float, int or bool; float precisions may differ)")


def _leaf_classes(c: _Ctx, term: Any, type_of: Callable[[int, str], TensorType], where: str, what: str,
                  want: str) -> None:
    """Every rank tensor a layout reads holds values of the sequential tensor's class."""
    for leaf in sorted(term.leaves()):
        name, _, r = leaf.rpartition("@")
        _same_class(c, where, what, want, leaf, type_of(int(r), name).dtype)


def _once(c: _Ctx, obj: dict[str, Any], key: str, at: str, known: dict[str, Any], seen: dict[str, str],
          what: str, kind: str) -> str:
    """`obj[key]` names a sequential input/output that no earlier relation/expectation names."""
    name = c.get(obj, key, at, str)
    noun = kind.split()[-1]
    if name not in known:
        raise c.fail(f"{at}.{key}", f"{name!r} is not {kind} of the sequential graph "
                                    f"({noun}s: {', '.join(known) or 'none'})")
    if name in seen:
        label = "sequential input" if noun == "input" else noun
        raise c.fail(f"{at}.{key}", f"a second {what} for {label} {name!r} (the first is {seen[name]})")
    seen[name] = at
    return name


def _layouts(c: _Ctx, obj: dict[str, Any], at: str, names: Callable[[int], set[str]], ranks: dict[int, Graph],
             mesh: Mesh, kind: str) -> list[Any]:
    """`obj["layout"]`: one expression over `name@rank`, or a list of replicas: the same
    expression over other ranks' tensors (leaf by leaf, same names)."""
    raw = obj.get("layout")
    texts = raw if isinstance(raw, list) else [c.get(obj, "layout", at, str)]
    if not texts:
        raise c.fail(f"{at}.layout", "an empty list of layouts")
    terms = []
    for j, text in enumerate(texts):
        where = f"{at}.layout" + (f"[{j}]" if isinstance(raw, list) else "")
        if not isinstance(text, str) or not text.strip():
            raise c.fail(where, f"expected a layout expression (a string), got {_json_type(text)}")
        try:
            term = parse_layout(text)
        except LayoutSyntaxError as e:
            raise c.fail(where, f"syntax error in layout {text!r}: {e}") from None
        except Exception as e:  # the parser should say LayoutSyntaxError; never let it escape
            raise c.fail(where, f"syntax error in layout {text!r} ({type(e).__name__}: {e})") from None
        for leaf in sorted(term.leaves()):
            name, _, r = leaf.rpartition("@")
            if int(r) not in ranks:
                raise c.fail(where, f"{leaf!r}: there is no rank {r} (the mesh has {mesh.size} ranks)")
            if name not in names(int(r)):
                raise c.fail(where, f"{leaf!r} is not {kind} of rank {r}")
        if terms and not _replica_of(terms[0], term):
            raise c.fail(where, f"layout {text!r} is no replica of {texts[0]!r}: a list of layouts holds the same "
                                "expression over other ranks' tensors of the same names")
        terms.append(term)
    return terms


def _replica_of(a: Any, b: Any) -> bool:
    if a.op in ("D", "Out") or b.op in ("D", "Out"):
        return a.op == b.op and a.attrs[0].rpartition("@")[0] == b.attrs[0].rpartition("@")[0]
    return a.op == b.op and a.attrs == b.attrs and len(a.args) == len(b.args) and \
        all(_replica_of(x, y) for x, y in zip(a.args, b.args, strict=True))


def _layout_shape(c: _Ctx, term: Any, type_of: Callable[[int, str], TensorType], registry: Registry,
                  want: tuple[int, ...], where: str, src: str, what: str = "sequential input") -> None:
    """A layout must be well-shaped and make the sequential tensor's shape."""

    def shape(t: Any) -> TensorType:
        if t.op in ("D", "Out"):
            name, _, r = t.attrs[0].rpartition("@")
            return type_of(int(r), name)
        ins = [shape(a) for a in t.args]
        op = registry.ops[t.op]
        attrs = {k: v for (k, _), v in zip(op.attrs, t.attrs, strict=False)}
        return op.shape(ins, attrs)

    try:
        got = shape(term)
    except ShapeError as e:
        raise c.fail(where, f"the layout for {src!r} is ill-shaped: {e}") from None
    except Exception as e:
        raise c.fail(where, f"the layout for {src!r} is ill-shaped ({type(e).__name__}: {e})") from None
    if tuple(got.shape) != want:
        raise c.fail(where, f"the layout for {src!r} makes shape {list(got.shape)}, "
                            f"but the {what} has {list(want)}")
