"""An experiment, not part of the checker: aws_llama TP6 one layer with each rank's copied
KV heads told to the walk as whole-tensor equalities (README, aws_llama TP6).

Each copy (a rank's key head after the rotary, or value head, equal to the head of the
KV head's first holder) is proven first by a small e-graph over both tensors' ancestry back
to the define facts; then each rank's k (v) joins `prog.same` with a synthetic tensor, the
cat of its heads' holders' slices. TP6's layout (32 query heads padded to 36, 8 KV heads,
KV head g held first by query head 4g) is written in here: this is a probe of what the
prover does with the copies, not a mechanism. `--force5` also walks rank 5's k and v (no
sequential relation names them, so no frontier reaches rank 5's scores otherwise).

    .venv/bin/python models/entangle/tp6_copies_experiment.py /tmp/tp6/l1 [--force5]
"""

from __future__ import annotations

import importlib
import resource
import sys
import time
from typing import Any

from refine.ir.graph import TensorType
from refine.ir.term import Term, cat, leaf
from refine.prove.engine import _ancestry
from refine.verdict.report import print_report

C = importlib.import_module("refine.check")  # the module (refine.check is also a function)
P = importlib.import_module("refine.prove.engine")
RANKS, HEADS, QUERY_HEADS, GROUP = 6, 6, 32, 4
KV = ("concatenate_84.cat", "reshape_58.view")  # one layer's rotated k, and v (dumps' names)


def holder(g: int) -> tuple[int, int]:
    """Rank and local head of KV head g's first copy."""
    return divmod(GROUP * g, HEADS)


def tell_copies(prog: Any, registry: Any) -> None:
    engine = C.engine_for(registry)
    t0 = time.process_time()
    probes: list[str] = []
    for t in KV:
        for r in range(RANKS):
            parts = []
            for h in range(HEADS):
                q = HEADS * r + h
                s, j = holder(q // GROUP) if q < QUERY_HEADS else (r, h)  # padding: itself
                b = Term("slice", (leaf(f"{t}@{s}"),), (2, j, j + 1))
                parts.append(b)
                if (s, j) == (r, h):
                    continue
                # the check must name a term the e-graph holds: a synthetic tensor defined as it
                typ = prog.types[f"{t}@{r}"]
                probe = f"probe#{t}.{r}.{h}"
                prog.add(probe, TensorType(typ.shape[:2] + (1,) + typ.shape[3:], typ.dtype), b, None)
                probes.append(probe)
                tensors = _ancestry(prog, [f"{t}@{r}", f"{t}@{s}", probe], 16)
                res = engine.step(Term("slice", (leaf(f"{t}@{r}"),), (2, h, h + 1)), prog, registry, tensors,
                                  checks=[leaf(probe)], iterations=16, early=False)
                if not res.checks[0]:
                    raise SystemExit(f"copy not proven: {t}@{r} head {h} = {t}@{s} head {j}")
            name = f"{t}#copies@{r}"
            prog.add(name, prog.types[f"{t}@{r}"], cat(parts, 2), None)
            prog.same.union(f"{t}@{r}", name)
    for p in probes:
        for dep in prog.defs[p].leaves():
            prog.users[dep].remove(p)
        del prog.defs[p], prog.types[p], prog.users[p]
    print(f"{len(probes)} copies proven, {time.process_time() - t0:.1f} s CPU", file=sys.stderr)


def main() -> None:
    case, force5 = sys.argv[1], "--force5" in sys.argv
    relations = C.seq_input_relations

    def told(dist: Any, seq: Any, prog: Any, registry: Any, dist_file: str) -> Any:
        out = relations(dist, seq, prog, registry, dist_file)
        tell_copies(prog, registry)
        return out

    frontier = P.frontier

    def walked(prog: Any, leaves: set[str], known: set[str], *a: Any, **k: Any) -> list[str]:
        return frontier(prog, set(leaves) | {f"{t}@{RANKS - 1}" for t in KV}, known, *a, **k)

    C.seq_input_relations = told
    if force5:
        P.frontier = walked
    t0 = time.process_time()
    report = C.check_files(f"{case}/seq.json", f"{case}/dist.json")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"{time.process_time() - t0:.1f} s CPU, {rss} MiB", file=sys.stderr)
    print_report(report)


if __name__ == "__main__":
    main()
