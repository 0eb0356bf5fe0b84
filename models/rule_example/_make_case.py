"""Write the rule example's case: tokens sharded over 2 ranks, a running product over the hidden
dim on each rank, then an all_gather. `--bug` sums over the sharded token dim instead."""

from __future__ import annotations

import sys
from pathlib import Path

from refine.frontends.build import GraphBuilder, dist_doc, seq_doc, write_case
from refine.ops.registry import load_registry

HERE = Path(__file__).resolve().parent


def make(bug: bool = False) -> tuple[dict, dict]:
    reg = load_registry([HERE])
    T, H, world = 8, 6, 2
    s = GraphBuilder(reg)
    x = s.input("x", [T, H])
    s.output("y", s.op("cumprod", x, name="running", dim=0 if bug else 1))
    ranks = {}
    for r in range(world):
        d = GraphBuilder(reg)
        xr = d.input("x", [T // world, H])
        y = d.op("cumprod", xr, name="running", dim=0 if bug else 1)
        d.output("y", d.op("all_gather", y, name="gather", dim=0, group=list(range(world))))
        ranks[r] = d
    rel = [{"from": "x", "placements": ["Shard(0)"]}]
    return seq_doc(s), dist_doc({"tp": world}, ranks, rel, [{"output": "y", "placements": ["Replicate"]}])


if __name__ == "__main__":
    bug = "--bug" in sys.argv
    write_case(HERE / ("case_bug" if bug else "case"), *make(bug))
