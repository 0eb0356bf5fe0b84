"""`torch` for rule families, imported when first used.

Every rule family names torch functions as its ops' numeric references (`Op.ref`), read
when an op is evaluated (audits, localization, the soundness harness), not when a case is
checked; importing torch is ~1 s of CPU, most of a `refine check` outside the proof. A
family writes `from refine.ir.lazy import torch`: `torch.exp`, `torch.nn.functional.silu` are
then paths that import torch when called. Once torch is imported, every attribute read is
torch's own (so `torch.float64` inside a reference is the real dtype).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any


class _Lazy:
    """A path of attributes under `torch`."""

    __slots__ = ("_path",)

    def __init__(self, path: tuple[str, ...]) -> None:
        self._path = path

    def _resolve(self) -> Any:
        obj: Any = importlib.import_module("torch")
        for part in self._path:
            obj = getattr(obj, part)
        return obj

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle, inspect probe these: answer as torch would
            return getattr(self._resolve(), name)
        if "torch" in sys.modules:
            return getattr(self._resolve(), name)
        return _Lazy((*self._path, name))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # arguments read before torch was imported (`dtype=torch.float64`) are paths too
        return self._resolve()(*(_real(a) for a in args), **{k: _real(v) for k, v in kwargs.items()})

    def __repr__(self) -> str:
        return "torch" + "".join(f".{p}" for p in self._path) + " (lazy)"


def _real(x: Any) -> Any:
    if isinstance(x, _Lazy):
        return x._resolve()
    if isinstance(x, tuple | list):
        return type(x)(_real(y) for y in x)
    return x


torch: Any = _Lazy(())
F: Any = torch.nn.functional
