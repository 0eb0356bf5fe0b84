"""Helpers the capture tests share: load a model file from models/capture, capture a step
saying how long it took, find a source line in it, read which outputs a report or a
numeric run finds wrong, and Megatron's two tensor-parallel regions written by hand."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from refine import capture
from refine.oracle.differential import differential
from tests.helpers import MODELS as ALL_MODELS

MODELS = ALL_MODELS / "capture"


def load_model(name: str) -> ModuleType:
    """models/capture/<name>.py as a fresh module (not registered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(f"capture_model_{name}", MODELS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed_capture(spec: capture.Spec) -> capture.Case:
    """capture(spec), printing how long it took (shown with pytest -s)."""
    t0 = time.perf_counter()
    case = capture(spec)
    print(f"capture {spec.name}: {time.perf_counter() - t0:.1f} s")
    return case


def line_of(path: Path, snippet: str) -> str:
    """"file.py:N" of the first line of `path` containing `snippet`, as reports write sources."""
    n = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if snippet in text)
    return f"{path.name}:{n}"


def failing(report: Any) -> set[str]:
    return {o.name for o in report.outputs if not o.ok}


def wrong_numerically(case: capture.Case) -> set[str]:
    """Outputs that `refine.oracle.differential.differential` finds wrong on random inputs."""
    return {d.output for d in differential(case.seq, case.dist, case.registry, seed=3) if d.ok is False}


class ReduceFromTP(torch.autograd.Function):
    """The all-reduce forward, the identity backward (Megatron's "g")."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x, "sum", dist.group.WORLD)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class CopyToTP(torch.autograd.Function):
    """The identity forward, the input gradient all-reduced backward (Megatron's "f")."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(grad)
        return grad
