"""The model zoo: training steps written the way each framework's users write them, built from
the upstream modules as they are (no copies of their code, no edits to them), each captured
and checked at 2 layers in at least two parallel configurations, with realistic silent bugs.

One program per file. A program's module holds `REQUIRES` (the packages it imports beyond
refine's own), `PROGRAM` (a `Program`: its configurations and bugs) and `make_case(config, bug=None) -> refine.capture.Spec`.
The correct program must REFINE in every configuration; each bug must give DOES NOT REFINE
with the report's rank line (`Culprit.rank_source`) at the bug's line: by default the line of
the program's file marked `# BUG: <name>` (the line the bug changes, or for a statement the
bug leaves out, the line making the value that statement should have taken); a bug that is a
setting of an upstream module (a parallel plan entry) names the upstream line it changes
(`Bug.upstream`), since every rank node it affects is made there.

    from models.zoo import programs
    for p in programs():                       # every program whose packages are installed
        spec = p.make_case(p.smoke)            # a refine.capture.Spec
        ...

`make bench` runs every program × configuration and every bug (refine/bench/zoo.py, table in
bench_zoo.md); the suite runs each program's `smoke` configuration and smoke bugs in CI and
the rest in the slow tier (tests/cases/test_zoo.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

ZOO = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Bug:
    """A planted silent bug: the configuration it is built in and what it is."""

    config: str
    what: str  # the bug and where the public record of its kind is (tracker issue, paper)
    upstream: tuple[str, str] | None = None  # (file name, a snippet of the line): an upstream line the report names
    smoke: bool = False  # checked in CI (the quick tier), not only in the slow tier and `make bench`
    # why the report names another line than the bug's, while that is so: the suite then
    # expects the miss (and fails once the right line is named, so the note goes), the bench
    # table counts the row as not right
    known_miss: str = ""


@dataclass(frozen=True)
class Program:
    """A zoo program: its parallel configurations (name -> what it is), the one CI runs and
    its bugs. The packages it needs are the module's `REQUIRES = ("pkg", ...)`, read from its
    text before it is imported (the zoo skips it, saying which, without them)."""

    configs: dict[str, str]
    smoke: str
    bugs: dict[str, Bug] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.smoke not in self.configs:
            raise ValueError(f"smoke configuration {self.smoke!r} is not one of {sorted(self.configs)}")
        for name, bug in self.bugs.items():
            if bug.config not in self.configs:
                raise ValueError(f"bug {name!r}: configuration {bug.config!r} is not one of {sorted(self.configs)}")

    def validate(self, config: str, bug: str | None) -> None:
        """A program's make_case refuses an unknown configuration or bug, saying which exist (a
        bug may be built in any configuration; `Bug.config` is the one the zoo checks)."""
        if config not in self.configs:
            raise ValueError(f"unknown configuration {config!r} (configurations: {', '.join(self.configs)})")
        if bug is not None and bug not in self.bugs:
            raise ValueError(f"unknown bug {bug!r} (bugs: {', '.join(self.bugs)})")


@dataclass(frozen=True)
class Entry:
    """A program's module, loaded: its name, `PROGRAM` and `make_case`."""

    name: str
    module: ModuleType

    @property
    def program(self) -> Program:
        return self.module.PROGRAM

    @property
    def make_case(self) -> Callable[..., Any]:
        return self.module.make_case

    @property
    def path(self) -> Path:
        return ZOO / f"{self.name}.py"

    def marked(self) -> dict[str, set[str]]:
        """bug -> the "file.py:N" lines of the program's file marked `# BUG: <bug>`."""
        return marked_lines(self.path)

    def culprit_lines(self, bug: str) -> set[str]:
        """The "file.py:N" lines a report of `bug` may name (see the module docstring)."""
        up = self.program.bugs[bug].upstream
        if up is None:
            return self.marked().get(bug, set())
        return upstream_lines(*up)


def marked_lines(path: Path) -> dict[str, set[str]]:
    """bug -> the "file.py:N" lines of a program file whose comment marks `BUG: <bug>`
    (the zoo's programs and models/capture's twins)."""
    out: dict[str, set[str]] = {}
    for i, line in enumerate(path.read_text().splitlines(), 1):
        _, hash_, comment = line.partition("#")
        for bug in re.findall(r"\bBUG: (\w+)", comment) if hash_ else ():
            out.setdefault(bug, set()).add(f"{path.name}:{i}")
    return out


def upstream_lines(file: str, snippet: str) -> set[str]:
    """"file:N" of the lines of an installed upstream file (found by name under the installed
    packages' sources) containing `snippet`."""
    import sys

    found: set[str] = set()
    for base in {Path(p) for p in sys.path if p and Path(p).is_dir() and "site-packages" in p}:
        for path in base.rglob(file):
            for i, text in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if snippet in text:
                    found.add(f"{path.name}:{i}")
    return found


def names() -> list[str]:
    """Every program file of the zoo, installed packages or not."""
    return sorted(p.stem for p in ZOO.glob("*.py") if not p.stem.startswith("_"))


def missing(name: str) -> list[str]:
    """The packages program `name` needs that are not installed (read before importing it)."""
    text = (ZOO / f"{name}.py").read_text()
    m = re.search(r"^REQUIRES\s*=\s*\(([^)]*)\)", text, re.M)
    wanted = re.findall(r"['\"]([\w.]+)['\"]", m.group(1)) if m else []
    return [w for w in wanted if importlib.util.find_spec(w) is None]


def load(name: str) -> Entry:
    return Entry(name, importlib.import_module(f"models.zoo.{name}"))


def programs() -> list[Entry]:
    """Every program whose packages are installed."""
    return [load(n) for n in names() if not missing(n)]
