"""Run a capture Spec's rank steps for real: one process per rank on a gloo process group
(CPU, localhost), each step run eagerly, against its sequential step run in this process.

The ground truth for programs capture refuses (data-dependent sizes): what the ranks compute,
with real collectives, compared with the sequential step. `factory` is "module:function" (the
function called with `args` builds the Spec in each process: a Spec holds closures, which do not
pickle)."""

from __future__ import annotations

import importlib
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from refine import capture


def _spec(factory: str, args: tuple[Any, ...]) -> capture.Spec:
    module, _, name = factory.partition(":")
    return getattr(importlib.import_module(module), name)(*args)


def _outputs(step: capture.Step) -> dict[str, torch.Tensor]:
    """The step's loss and its parameters' gradients, run eagerly."""
    loss = step.step(step.model, **step.inputs)
    out = {"loss": loss.detach().clone()}
    for name, p in step.model.named_parameters():
        if p.grad is not None:
            out[f"{name}.grad"] = p.grad.detach().clone()
    return out


def _worker(rank: int, world: int, port: int, factory: str, args: tuple[Any, ...], into: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(_outputs(_spec(factory, args).rank(rank)), Path(into) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(factory: str, *args: Any) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """(the sequential step's loss and gradients, each rank's)."""
    spec = _spec(factory, args)
    seq = spec.sequential if isinstance(spec.sequential, capture.Step) else spec.sequential()
    expected = _outputs(seq)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(spec.world_size, _free_port(), factory, args, tmp), nprocs=spec.world_size)
        ranks = {r: torch.load(Path(tmp) / f"rank{r}.pt") for r in range(spec.world_size)}
    return expected, ranks
