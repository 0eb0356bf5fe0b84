"""`make bench`: time every case under models/ (wall time including load, e-graph steps,
peak RSS) and write bench.md. Performance is measured here, never asserted in tests."""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

from refine.check import check_files

ROOT = Path(__file__).resolve().parents[2]  # the checkout: refine/bench/<this file>


def main(argv: list[str]) -> int:
    cases = sorted(p.parent for p in (ROOT / "models").glob("*/dist.json"))
    rows = ["| case | verdict | seq nodes | rank nodes | ranks | steps | wall s | ms/seq node |",
            "|---|---|---|---|---|---|---|---|"]
    for case in cases:
        t0 = time.perf_counter()
        r = check_files(case / "seq.json", case / "dist.json")
        dt = time.perf_counter() - t0
        s = r.stats
        rows.append(f"| {case.name} | {'REFINES' if r.refines else 'bug'} | {s['seq_nodes']} | {s['rank_nodes']} "
                    f"| {s['ranks']} | {s['steps']} | {dt:.2f} | {1000 * dt / max(s['seq_nodes'], 1):.0f} |")
        print(rows[-1], flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = "\n".join(rows) + f"\n\npeak RSS {peak:.0f} MiB\n"
    (ROOT / "bench.md").write_text(out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
