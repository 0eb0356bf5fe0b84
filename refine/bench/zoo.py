"""`make bench`: the model zoo (models/zoo) as a table: each program × configuration and each
bug → verdict, whether the verdict is the expected one and the culprit line the bug's line
(a known miss, `Bug.known_miss`, is counted apart: exit 1 only for a row not as expected),
capture and check seconds, peak RSS. Each row runs in its own process (peak RSS is that
row's; one program's process-group state cannot leak into the next). Writes bench_zoo.md.

    python -m refine.bench.zoo [PROGRAM ...]
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: refine/bench/<this file>
TIMEOUT = 1800  # a row's wall-clock bound: a run past it is reported as a timeout, not waited for


def one(name: str, config: str, bug: str | None) -> dict[str, object]:
    """Capture and check one zoo case in this process; what the table shows of it."""
    sys.path.insert(0, str(ROOT))
    from models.zoo import load
    from refine.frontends import capture

    e = load(name)
    t0 = time.perf_counter()
    case = capture.capture(e.make_case(config, bug=bug))
    t1 = time.perf_counter()
    report = case.check()
    t2 = time.perf_counter()
    want = "REFINES" if bug is None else "DOES NOT REFINE"
    line = report.culprit.rank_source if report.culprit is not None else None
    right = report.verdict == want and (bug is None or line in e.culprit_lines(bug))
    known = bool(bug is not None and report.verdict == want and not right and e.program.bugs[bug].known_miss)
    return {"verdict": report.verdict, "right": right, "known": known, "line": line, "capture": t1 - t0,
            "check": t2 - t1,
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def rows(selected: list[str]) -> list[tuple[str, str, str | None]]:
    sys.path.insert(0, str(ROOT))
    from models.zoo import load, missing, names

    out: list[tuple[str, str, str | None]] = []
    for name in names():
        if selected and name not in selected:
            continue
        if missing(name):
            print(f"{name}: skipped, needs {', '.join(missing(name))}", flush=True)
            continue
        p = load(name).program
        out += [(name, c, None) for c in p.configs] + [(name, b.config, bug) for bug, b in p.bugs.items()]
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        print(json.dumps(one(argv[1], argv[2], argv[3] if argv[3] != "-" else None)))
        return 0
    table = ["| program | config | bug | verdict | right | culprit line | capture s | check s | peak RSS MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    wrong = known = 0
    for name, config, bug in rows(argv):
        cmd = [sys.executable, "-m", "refine.bench.zoo", "--one", name, config, bug or "-"]
        t0 = time.perf_counter()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
            r = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
            err = done.stderr.strip().splitlines()[-1:] if r is None else []
        except subprocess.TimeoutExpired:
            r, err = None, [f"timeout after {TIMEOUT} s"]
        if r is None:
            wrong += 1
            table.append(f"| {name} | {config} | {bug or ''} | error: {' '.join(err)[:120]} | no | | | "
                         f"{time.perf_counter() - t0:.1f} | |")
        else:
            wrong += not r["right"] and not r["known"]
            known += r["known"]
            ok = "yes" if r["right"] else "no (known miss)" if r["known"] else "NO"
            table.append(f"| {name} | {config} | {bug or ''} | {r['verdict']} | {ok} "
                         f"| {r['line'] or ''} | {r['capture']:.1f} | {r['check']:.1f} | {r['rss']:.0f} |")
        print(table[-1], flush=True)
    out = "\n".join(table) + (f"\n\nrows not as expected: {wrong}; bugs whose report names another line, "
                               f"known (Bug.known_miss): {known}\n")
    (ROOT / "bench_zoo.md").write_text(out)
    print(out)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
