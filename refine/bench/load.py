"""`make bench`: loading at scale. Chain and tree graphs of 10^4, 10^5 and 10^6 nodes (per
graph: the sequential one and each of two ranks') are written as JSON and loaded
(`refine.frontends.graphfile.load_seq` / `load_dist`, every check the loader makes), each size
in a subprocess of its own for its time and peak memory; the time per node shows whether
loading is linear. A correct 10^4-node chain pair is then checked whole (`refine check`).
Measured here, never asserted in tests; writes bench_load.md.

    python -m refine.bench.load            # every size
    python -m refine.bench.load 10000      # some sizes
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[2]  # the checkout: refine/bench/<this file>
SIZES = (10_000, 100_000, 1_000_000)
CHECK_SIZE = 10_000
HEAD = {"format": "refine-graph", "version": 1}


def _chain(n: int, rows: int) -> tuple[list[dict[str, Any]], Iterator[dict[str, Any]], str]:
    """x[rows, 4] through n elementwise ops (exp, neg, ...): inputs, nodes, output."""
    def nodes() -> Iterator[dict[str, Any]]:
        for i in range(n):
            yield {"name": f"n{i}", "op": "neg" if i % 2 else "exp", "args": [f"n{i - 1}" if i else "x"],
                   "shape": [rows, 4]}
    return [{"name": "x", "shape": [rows, 4]}], nodes(), f"n{n - 1}"


def _tree(n: int, rows: int) -> tuple[list[dict[str, Any]], Iterator[dict[str, Any]], str]:
    """A sum of n + 1 inputs x0..xn by a balanced tree of n adds: inputs, nodes, output."""
    def nodes() -> Iterator[dict[str, Any]]:
        level = [f"x{i}" for i in range(n + 1)]
        k = 0
        while len(level) > 1:
            nxt = []
            for a, b in zip(level[::2], level[1::2], strict=False):
                yield {"name": f"t{k}", "op": "add", "args": [a, b], "shape": [rows, 4]}
                nxt.append(f"t{k}")
                k += 1
            level = nxt + level[len(level) - len(level) % 2:]
    return [{"name": f"x{i}", "shape": [rows, 4]} for i in range(n + 1)], nodes(), f"t{n - 1}"


SHAPES = {"chain": _chain, "tree": _tree}


def _graph(f: TextIO, inputs: list[dict[str, Any]], nodes: Iterator[dict[str, Any]], outputs: list[dict[str, Any]]
           ) -> None:
    """A graph object, its nodes written as they come (a million of them are not held)."""
    f.write('{"inputs": ' + json.dumps(inputs) + ', "nodes": [')
    for i, node in enumerate(nodes):
        f.write(("," if i else "") + json.dumps(node))
    f.write('], "outputs": ' + json.dumps(outputs) + "}")


def write_pair(shape: str, n: int, directory: Path) -> tuple[Path, Path]:
    """A TP2 pair: the sequential graph over rows 8, each rank's over its 4 rows, an
    all_gather of the result; every input sharded by rows."""
    build = SHAPES[shape]
    seq, dist = directory / f"{shape}{n}.seq.json", directory / f"{shape}{n}.dist.json"
    inputs, nodes, out = build(n, 8)
    with seq.open("w") as f:
        f.write(json.dumps(HEAD | {"kind": "sequential"})[:-1] + ', "graph": ')
        _graph(f, inputs, nodes, [{"name": "y", "ref": out}])
        f.write("}")
    with dist.open("w") as f:
        f.write(json.dumps(HEAD | {"kind": "distributed", "mesh": {"axes": [{"name": "tp", "size": 2}]}})[:-1])
        f.write(', "ranks": [')
        for r in range(2):
            inputs, nodes, out = build(n, 4)
            gather = {"name": "y", "op": "all_gather", "args": [out], "shape": [8, 4], "attrs": {"dim": 0, "group": [0, 1]}}
            f.write((", " if r else "") + f'{{"rank": {r}, "graph": ')
            _graph(f, inputs, _then(nodes, gather), [{"name": "y", "ref": "y"}])
            f.write("}")
        relations = [{"from": x["name"], "placements": ["Shard(0)"]} for x in inputs]
        f.write('], "relations": ' + json.dumps(relations))
        f.write(', "expectations": [{"output": "y", "placements": ["Replicate"]}]}')
    return seq, dist


def _then(nodes: Iterator[dict[str, Any]], last: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from nodes
    yield last


def _peak_mib() -> float:
    """This process's peak resident memory (VmHWM: getrusage's maxrss keeps the parent's
    across the exec of a subprocess)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _load(seq: str, dist: str) -> dict[str, Any]:
    """In the subprocess: load both files, with times and peak memory."""
    from refine.frontends.graphfile import load_dist, load_seq
    from refine.ops.registry import load_registry

    registry = load_registry()
    base = _peak_mib()
    t0, c0 = time.perf_counter(), time.process_time()
    g = load_seq(seq, registry)
    t1 = time.perf_counter()
    d = load_dist(dist, registry, g)
    t2, c2 = time.perf_counter(), time.process_time()
    nodes = len(g.nodes) + sum(len(r.nodes) for r in d.ranks.values())
    return {"seq_s": t1 - t0, "dist_s": t2 - t1, "cpu_s": c2 - c0, "nodes": nodes, "base_mib": base,
            "peak_mib": _peak_mib()}


def _check(seq: str, dist: str) -> dict[str, Any]:
    """In the subprocess: the whole check."""
    from refine.check import check_files

    t0 = time.perf_counter()
    report = check_files(seq, dist)
    return {"s": time.perf_counter() - t0, "verdict": report.verdict,
            "steps": report.stats["steps"], "replayed": report.stats["replayed"], "peak_mib": _peak_mib()}


def _child(what: str, seq: Path, dist: Path) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-m", "refine.bench.load", f"--{what}", str(seq), str(dist)],
                       capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(p.stdout)


def main(argv: list[str]) -> int:
    if argv[:1] in (["--load"], ["--check"]):
        print(json.dumps((_load if argv[0] == "--load" else _check)(argv[1], argv[2])))
        return 0
    sizes = [int(float(a)) for a in argv] or list(SIZES)
    # CPU time per node is the linearity column (wall time counts the machine's other work too)
    rows = ["| graph | nodes per graph | all nodes | file MB | load seq s | load dist s | CPU us/node | peak MiB |",
            "|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for shape in SHAPES:
            for n in sizes:
                seq, dist = write_pair(shape, n, Path(tmp))
                mb = (seq.stat().st_size + dist.stat().st_size) / 1e6
                r = _child("load", seq, dist)
                if "error" in r:
                    rows.append(f"| {shape} | {n} | | {mb:.0f} | {r['error']} | | | |")
                else:
                    per = 1e6 * r["cpu_s"] / r["nodes"]
                    rows.append(f"| {shape} | {n} | {r['nodes']} | {mb:.0f} | {r['seq_s']:.2f} | {r['dist_s']:.2f} "
                                f"| {per:.1f} | {r['peak_mib'] - r['base_mib']:.0f} over {r['base_mib']:.0f} |")
                print(rows[-1], flush=True)
                seq.unlink()
                dist.unlink()
        seq, dist = write_pair("chain", CHECK_SIZE, Path(tmp))
        c = _child("check", seq, dist)
    out = "\n".join(rows) + "\n\n"
    if "error" in c:
        out += f"refine check, correct {CHECK_SIZE}-node chain pair: {c['error']}\n"
    else:
        out += (f"refine check, correct {CHECK_SIZE}-node chain pair: {c['verdict']} in {c['s']:.1f} s "
                f"({c['steps']} e-graph steps, {c['replayed']} replayed), peak {c['peak_mib']:.0f} MiB\n")
    (ROOT / "bench_load.md").write_text(out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
