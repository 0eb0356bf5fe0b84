"""The IR: a graph of tensor ops, small enough to hold in your head.

A `Graph` has typed inputs, nodes in topological order and named outputs. A `Node` applies
an op to tensor arguments (references to inputs or other nodes, or number literals) and
attributes (plain data). Every node has exactly one tensor output; multi-output ops are
split into one node per output when a graph is loaded.

A `Dist` is a device mesh plus one Graph per rank, the input relations (how each
sequential input lives on the ranks) and the expectations on outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Shape = tuple[Any, ...]  # each dim an int, or a refine.ir.sizes.Sym when the graph declares symbols
Arg = str | float | int | bool  # a str is a reference to an input or node of the same graph

# the float8 formats: casts to them are identities over the reals; `refine check --numeric` rounds to them
DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "bool", "uint8", "int8",
          "float8_e4m3fn", "float8_e5m2")
VALUE_CLASSES = ("bool", "int", "float")  # narrowest first: each holds the values of the ones before it


def value_class(dtype: str) -> str:
    """What values a dtype holds: "bool", "int" or "float". refine reasons about real values, so
    dtypes of one class are one type (bfloat16 is float32); a change of class is a cast."""
    if dtype == "bool":
        return "bool"
    return "int" if dtype.startswith(("int", "uint")) else "float"


def narrowing(src: str, dst: str) -> str | None:
    """Why a cast from dtype `src` to `dst` changes values (it narrows the value class), or None."""
    if VALUE_CLASSES.index(value_class(dst)) >= VALUE_CLASSES.index(value_class(src)):
        return None
    how = "binarizes (x != 0)" if value_class(dst) == "bool" else "truncates toward zero"
    return (f"a cast from {src} to {dst} changes values (it {how}): refine supports casts within one dtype class "
            "and from bool or integer to a wider class (bool to integer, either to floating point)")


@dataclass(frozen=True)
class TensorType:
    shape: Shape
    dtype: str = "float32"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class Input:
    name: str
    type: TensorType
    role: str = "data"  # parameter | data | buffer
    source: str | None = None


@dataclass
class Node:
    name: str
    op: str
    args: list[Arg]
    attrs: dict[str, Any]
    type: TensorType
    source: str | None = None  # "file.py:line" where the op was written
    origin: str | None = None  # the user's node this one was decomposed from, if any

    def tensor_args(self) -> list[str]:
        return [a for a in self.args if isinstance(a, str)]

    def __str__(self) -> str:
        args = ", ".join(str(a) for a in self.args)
        attrs = "".join(f", {k}={v}" for k, v in self.attrs.items())
        return f"{self.name} = {self.op}({args}{attrs}) : {self.type}"


@dataclass(frozen=True)
class Output:
    name: str
    ref: str
    role: str = "other"  # loss | gradient | activation | other
    of: str | None = None  # for a gradient: the parameter it is the gradient of


@dataclass
class Graph:
    inputs: list[Input] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    outputs: list[Output] = field(default_factory=list)
    name: str = "graph"
    symbols: dict[str, Any] = field(default_factory=dict)  # name -> refine.ir.sizes.Sym

    def __post_init__(self) -> None:
        self._index: dict[str, Input | Node] = {}
        self._of: tuple[list[Input], list[Node]] | None = None  # the lists _index was built from
        self._sizes = (0, 0)  # and their lengths then

    def index(self) -> dict[str, Input | Node]:
        """Every input and node by name. Kept up to date by `add`/`add_input`; a list
        appended to or cut elsewhere, or replaced, is seen by its length and identity and
        the index rebuilt. (Graphs are only appended to: a node replaced in place,
        `nodes[i] = m`, would not be seen; build a new Graph instead.)"""
        of = self._of
        if of is None or of[0] is not self.inputs or of[1] is not self.nodes or \
                self._sizes != (len(self.inputs), len(self.nodes)):
            self._reindex()
        return self._index

    def _reindex(self) -> None:
        self._index = {i.name: i for i in self.inputs} | {n.name: n for n in self.nodes}
        self._of = (self.inputs, self.nodes)
        self._sizes = (len(self.inputs), len(self.nodes))

    def add(self, node: Node) -> None:
        """Append a node, indexed (a rebuild of the index per node made loading quadratic)."""
        self.index()[node.name] = node
        self.nodes.append(node)
        self._sizes = (len(self.inputs), len(self.nodes))

    def add_input(self, inp: Input) -> None:
        self.index()[inp.name] = inp
        self.inputs.append(inp)
        self._sizes = (len(self.inputs), len(self.nodes))

    def type_of(self, ref: str) -> TensorType:
        return self.index()[ref].type

    def ancestors(self, *refs: str) -> set[str]:
        """`refs` and every input and node they are computed from."""
        idx = self.index()
        out: set[str] = set()
        stack = list(refs)
        while stack:
            x = stack.pop()
            if x in out:
                continue
            out.add(x)
            n = idx.get(x)
            if isinstance(n, Node):
                stack.extend(n.tensor_args())
        return out

    def users(self) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {name: [] for name in self.index()}
        for n in self.nodes:
            for a in n.tensor_args():
                out[a].append(n)
        return out

    def output(self, name: str) -> Output:
        for o in self.outputs:
            if o.name == name:
                return o
        raise KeyError(name)


@dataclass(frozen=True)
class Placement:
    """How a sequential tensor lies along one mesh axis."""

    kind: str  # replicate | shard | partial
    dim: int | None = None  # for shard
    reduce: str = "sum"  # for partial

    def __str__(self) -> str:
        if self.kind == "shard":
            return f"Shard({self.dim})"
        if self.kind == "partial":
            return f"Partial({self.reduce})"
        return "Replicate"


@dataclass(frozen=True)
class Relation:
    """A sequential input (`source`) and how the ranks hold it.

    Either `placements` (one per mesh axis) applied to the rank input named `local`, or a
    `layout`: an explicit relation expression over rank inputs (`name@rank`) that equals the
    sequential input, for fused weights; `replicas` are more copies of it (a tensor held whole
    by some ranks only, e.g. a pipeline's tied embedding on its first and last stage).
    """

    source: str
    local: str | None = None
    placements: tuple[Placement, ...] | None = None
    layout: Any = None  # a refine.ir.term.Term over rank tensors
    replicas: tuple[Any, ...] = ()  # more layouts, each the first's structure over other ranks' inputs
    guessed: bool = False
    where: str = ""  # json path, for messages


@dataclass(frozen=True)
class Expectation:
    """A sequential output must equal rank outputs `local` placed by `placements`, or each
    of the `layout` terms over rank outputs (`name@rank`): an output only some ranks make,
    e.g. the loss of a pipeline's last stage."""

    output: str  # sequential output name
    local: str | None = None  # rank output name; None: the same name (see refine.check._default)
    placements: tuple[Placement, ...] | None = None
    layout: tuple[Any, ...] | None = None  # refine.ir.term terms over rank outputs, each equal to the output
    where: str = ""
    guessed: bool = False  # placements guessed from shapes (reports flag them)


@dataclass(frozen=True)
class Mesh:
    axes: tuple[tuple[str, int], ...]

    @property
    def size(self) -> int:
        n = 1
        for _, s in self.axes:
            n *= s
        return n

    def coords(self, rank: int) -> tuple[int, ...]:
        out = []
        for _, s in reversed(self.axes):
            out.append(rank % s)
            rank //= s
        return tuple(reversed(out))

    def rank(self, coords: tuple[int, ...]) -> int:
        r = 0
        for (_, s), c in zip(self.axes, coords, strict=True):
            r = r * s + c
        return r


@dataclass(frozen=True)
class Define:
    """A rank input given in full by an expression over sequential inputs (`define`): a
    zero-padded shard `cat(slice(w, 1, 1920, 2048), zeros([2048, 256]), dim=1)`, or copies
    of a KV head. It says what relations cannot: relations give sequential inputs over
    rank tensors, and a part of a rank input no relation reads is otherwise free."""

    rank: int
    input: str  # the rank-local input name
    term: Any  # a refine.ir.term.Term whose leaves (D) are sequential input names
    where: str = ""  # json path, for messages


@dataclass
class Dist:
    mesh: Mesh
    ranks: dict[int, Graph]
    relations: list[Relation]
    expectations: list[Expectation]
    defines: list[Define] = field(default_factory=list)


def case_symbols(seq: Graph, dist: Dist) -> dict[str, Any]:
    """Every symbol either side declares (the ranks inherit the sequential file's)."""
    out = dict(seq.symbols)
    for g in dist.ranks.values():
        out.update(g.symbols)
    return out


def tensor_name(rank: int, name: str) -> str:
    """The global name of a rank's tensor, as relations print it."""
    return f"{name}@{rank}"
