"""The external corpus matrix (GraphGuard/Entangle dumps, `../shared/corpus/entangle`):
import each configuration, check it, and write bench_corpus.md with the verdict, node
count, the whole configuration's wall and CPU time (Python's start, imports, the corpus
import, loading the graphs, the check), the inference time alone (loaded graphs to verdict,
the analogue of the time the corpus README publishes for the original tool: "inference
time, graph loading excluded"), peak RSS, time per node and, where the corpus README
publishes one, the original tool's time and the ratio of our inference CPU time to it.

Each configuration runs in a child process (`python -m refine.bench.corpus --one ...`) so its
peak RSS and CPU time are its own; a configuration that takes longer than --timeout seconds is
recorded as such. Run by `make bench` (after the bundled examples), or alone:

    python -m refine.bench.corpus [--only gpt/paral2_layer1 ...] [--timeout 600]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: refine/bench/<this file>
CORPUS = ROOT.parent / "shared" / "corpus" / "entangle"
RELATIONS = ROOT / "models" / "entangle" / "relations"

# inference time the corpus README reports for the original tool (16-core EPYC 7302P,
# graph loading excluded): only the ends of each range are published
PUBLISHED = {"gpt/paral2_layer1": 13.6, "gpt/paral8_layer8": 174.4,
             "aws_llama/tp2_layer1": 10.0, "aws_llama/tp8_layer8": 237.0}


def matrix() -> list[tuple[str, str, str, str | None]]:
    """(name, sequential dir, distributed dir, relation file) of every configuration."""
    rows: list[tuple[str, str, str, str | None]] = []
    for layers in (1, 2, 4, 8):
        for tp in (2, 4, 6, 8):
            rows.append((f"gpt/paral{tp}_layer{layers}", f"gpt/paral1_layer{layers}", f"gpt/paral{tp}_layer{layers}",
                         "gpt.json"))
    for tp in (2, 4):
        rows.append((f"qwen2/paral{tp}_layer1", "qwen2/paral1_layer1", f"qwen2/paral{tp}_layer1", "qwen2.json"))
    for layers in (1, 2, 4, 8):
        for tp in (2, 4, 6, 8):
            # TP6 pads its shards (models/entangle/make_aws_llama_tp6.py writes its file)
            rows.append((f"aws_llama/tp{tp}_layer{layers}", f"aws_llama/tp1_layer{layers}",
                         f"aws_llama/tp{tp}_layer{layers}", "aws_llama_tp6.json" if tp == 6 else "aws_llama.json"))
    rows.append(("bug_grad_accumulation", "bug_grad_accumulation/1step", "bug_grad_accumulation/2step.bug",
                 "bug_grad_accumulation.json"))
    rows.append(("bug_missing_layernorm_allreduce", "bug_missing_layernorm_allreduce/tp1",
                 "bug_missing_layernorm_allreduce/tp2.bug", "bug_missing_layernorm_allreduce.json"))
    return rows


def one(name: str, seq_dir: str, dist_dir: str, rel: str | None, out: Path) -> dict[str, object]:
    """Import and check one configuration in this process. `check_s` is the check of the
    imported files (rule families, loading, inference); `infer_s` and `infer_cpu_s` the
    inference alone: from the loaded graphs and registry to the verdict (lowering, the
    e-graph steps, expectations, localization when it does not refine)."""
    from refine.check import check
    from refine.frontends.graphfile import load_dist, load_seq
    from refine.frontends.importer.entangle import import_case
    from refine.ir.errors import InputError
    from refine.ops.registry import load_registry

    t0 = time.perf_counter()
    row: dict[str, object] = {"config": name}
    try:
        case = import_case(CORPUS / seq_dir, CORPUS / dist_dir, RELATIONS / rel if rel else None)
        row["nodes"] = case.nodes
        case.write(out)
        t1 = time.perf_counter()
        registry = load_registry()
        seq = load_seq(out / "seq.json", registry)
        dist = load_dist(out / "dist.json", registry, seq)
        t2, c2 = time.perf_counter(), time.process_time()
        report = check(seq, dist, registry, str(out / "seq.json"), str(out / "dist.json"))
        row["infer_s"] = time.perf_counter() - t2
        row["infer_cpu_s"] = time.process_time() - c2
        row["verdict"] = report.verdict
        row["check_s"] = time.perf_counter() - t1
        if report.culprit is not None:
            row["culprit"] = f"{report.culprit.node} ({report.culprit.op}) at {report.culprit.source}"
    except InputError as e:
        row["verdict"] = "exit 2"
        row["culprit"] = e.reason[:160]
    row["wall_s"] = time.perf_counter() - t0  # corpus import, load and inference (after Python's imports)
    use = resource.getrusage(resource.RUSAGE_SELF)
    row["rss_mib"] = use.ru_maxrss / 1024
    row["cpu_s"] = use.ru_utime + use.ru_stime  # on a shared machine, wall time includes waiting for a core
    return row


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m refine.bench.corpus")
    ap.add_argument("--only", nargs="*", default=None, help="configuration names (default: the whole matrix)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default=str(ROOT / "bench_corpus.md"))
    ap.add_argument("--one", nargs=4, metavar=("NAME", "SEQ", "DIST", "REL"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        name, seq, dist, rel = args.one
        out = Path(os.environ.get("TMPDIR", "/tmp")) / f"refine_bench_{os.getpid()}"
        print(json.dumps(one(name, seq, dist, None if rel == "-" else rel, out)))
        return 0
    if not CORPUS.is_dir():
        print(f"no corpus at {CORPUS}: skipping the corpus matrix")
        return 0
    # the published times are the original tool's inference, graph loading excluded: our
    # analogue is the inference columns; the whole process (start, imports, corpus import,
    # load) is shown next to them, not hidden. On a shared machine wall time includes
    # waiting for a core, so the ratio uses CPU time (user + system, every thread)
    rows = ["| config | verdict | FX nodes | whole process: wall s (start, imports, corpus import, load, inference) | "
            "whole process: CPU s | inference (loaded graphs to verdict): wall s | inference: CPU s | "
            "peak RSS MiB | ms/node (whole wall) | published s (original tool: inference, loading excluded, 16 cores) | "
            "ratio (inference CPU / published) | where it stops |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, seq, dist, rel in matrix():
        if args.only and name not in args.only:
            continue
        cmd = [sys.executable, "-m", "refine.bench.corpus", "--one", name, seq, dist, rel or "-"]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
            r = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else \
                {"verdict": "crashed", "culprit": (p.stderr.strip().splitlines() or [""])[-1][:160]}
            r["process_s"] = time.perf_counter() - t0  # the child's whole life: start and imports too
        except subprocess.TimeoutExpired:
            r = {"verdict": f"timeout > {args.timeout:.0f} s", "wall_s": time.perf_counter() - t0}
        wall, nodes, infer = r.get("process_s", r.get("wall_s")), r.get("nodes"), r.get("infer_cpu_s")
        pub = PUBLISHED.get(name)
        cells = [name, str(r.get("verdict")), str(nodes or ""), f"{wall:.1f}" if wall else "",
                 f"{r['cpu_s']:.1f}" if "cpu_s" in r else "", f"{r['infer_s']:.2f}" if "infer_s" in r else "",
                 f"{infer:.2f}" if infer is not None else "", f"{r['rss_mib']:.0f}" if "rss_mib" in r else "",
                 f"{1000 * wall / nodes:.1f}" if wall and nodes else "", f"{pub}" if pub else "",
                 f"{infer / pub:.3f}" if pub and infer is not None and r.get("verdict") == "REFINES" else "",
                 str(r.get("culprit", "")).replace("|", "/")]
        rows.append("| " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    text = "\n".join(rows) + (
        f"\n\nmachine: {os.cpu_count()} cores; one configuration at a time, each in its own process. "
        "Whole process: Python's start, imports (torch, egglog, the rule families), importing the corpus "
        "dumps, loading the graphs and the inference. Inference: the loaded graphs and rule registry to "
        "the verdict (lowering, relating the inputs, the e-graph steps, expectations, localization), the "
        "analogue of the published \"inference time, graph loading excluded\" (of the original tool, on a "
        "16-core EPYC 7302P).\n")
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
