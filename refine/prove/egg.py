"""egglog's Rust bindings without its Python front end.

`from egglog import bindings` runs `egglog/__init__.py` first, which builds egglog's
high-level Python API (~0.2 s of CPU); refine uses only the bindings. The extension module
is loaded on its own under its own name, so a later `import egglog` finds it; if that
fails (another layout), the usual import."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def _load() -> ModuleType:
    if "egglog.bindings" in sys.modules:
        return sys.modules["egglog.bindings"]
    try:
        spec = importlib.util.find_spec("egglog")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("no egglog package")
        here = Path(next(iter(spec.submodule_search_locations)))
        path = next(p for suffix in importlib.machinery.EXTENSION_SUFFIXES
                    if (p := here / f"bindings{suffix}").is_file())
        ext = importlib.util.spec_from_file_location("egglog.bindings", path)
        if ext is None or ext.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(ext)
        sys.modules["egglog.bindings"] = module
        ext.loader.exec_module(module)
        return module
    except (ImportError, StopIteration):
        sys.modules.pop("egglog.bindings", None)
        from egglog import bindings as module

        return module


bindings = _load()
