"""Mutation sweep over corpus cases (refine/mutate.py): import each case, inject seeded bugs,
check and (where the case is small enough to run in torch) evaluate each mutant, and write
bench_mutate.md with the outcome of every mutant and the counts per operator (caught /
neutral / incomplete / UNSOUND; unjudged where the case is too large to evaluate).

Each case runs in a child process (its peak RSS and CPU time are its own). Exit 1 if any
mutant is UNSOUND. Run by `make bench`, or alone:

    python -m refine.bench_mutate [--only aws_llama/tp2_layer1 ...] [--count 40] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from refine.bench_corpus import CORPUS, RELATIONS, ROOT

KINDS = ("caught", "neutral", "incomplete", "UNSOUND", "unjudged")

# (name, sequential dir, distributed dir, relation file, evaluate): evaluation runs both
# programs in float64; gpt's 98304-entry vocabulary over 12288 tokens (tensors of 1.2e9
# elements) and qwen2's 32768 tokens are beyond this machine, so those report verdicts only
CASES = [
    ("aws_llama/tp2_layer1", "aws_llama/tp1_layer1", "aws_llama/tp2_layer1", "aws_llama.json", True),
    # two layers: a mutant in either must be caught while the other layer's steps are replayed
    ("aws_llama/tp2_layer2", "aws_llama/tp1_layer2", "aws_llama/tp2_layer2", "aws_llama.json", True),
    ("gpt/paral2_layer1", "gpt/paral1_layer1", "gpt/paral2_layer1", "gpt.json", False),
    ("qwen2/paral2_layer1", "qwen2/paral1_layer1", "qwen2/paral2_layer1", "qwen2.json", False),
]


def one(name: str, count: int, seed: int) -> dict[str, object]:
    from refine.importer.entangle import import_case
    from refine.mutate import load_case, run
    from refine.opset import load_registry

    _, seq_dir, dist_dir, rel, evaluate = next(c for c in CASES if c[0] == name)
    with tempfile.TemporaryDirectory() as d:
        import_case(CORPUS / seq_dir, CORPUS / dist_dir, RELATIONS / rel).write(d)
        registry = load_registry()
        seq, dist, doc = load_case(Path(d) / "seq.json", Path(d) / "dist.json", registry)
        rows = []

        def log(o: object) -> None:
            print(f"{name}: {o.kind:10} {o.verdict:16} {o.mutant.name}", file=sys.stderr, flush=True)  # type: ignore[attr-defined]

        for o in run(seq, dist, doc, registry, count, seed, on_outcome=log, evaluate=evaluate):
            rows.append({"operator": o.mutant.operator, "mutant": o.mutant.name, "verdict": o.verdict,
                         "wrong": o.wrong, "kind": o.kind, "culprit": o.culprit,
                         "error": None if o.error != o.error else o.error})
    use = resource.getrusage(resource.RUSAGE_SELF)
    return {"case": name, "rows": rows, "cpu_s": use.ru_utime + use.ru_stime, "rss_mib": use.ru_maxrss / 1024}


def table(results: list[dict[str, object]]) -> str:
    lines = ["# Mutation sweep", "", "| case | operator | " + " | ".join(KINDS) + " |",
             "|---|---|" + "---|" * len(KINDS)]
    for res in results:
        rows = [r for r in res["rows"] if r["operator"] != "none"]  # type: ignore[union-attr]
        per: dict[str, Counter[str]] = {}
        for r in rows:
            per.setdefault(r["operator"], Counter())[r["kind"]] += 1
        for op, c in sorted(per.items()):
            lines.append(f"| {res['case']} | {op} | " + " | ".join(str(c[k]) for k in KINDS) + " |")
        total = Counter(r["kind"] for r in rows)
        lines.append(f"| {res['case']} | **all** ({res['cpu_s']:.0f} s CPU, {res['rss_mib']:.0f} MiB) | "
                     + " | ".join(str(total[k]) for k in KINDS) + " |")
    lines += ["", "## Every mutant", "", "| case | mutant | verdict | wrong | outcome | culprit |", "|---|---|---|---|---|---|"]
    for res in results:
        for r in res["rows"]:  # type: ignore[union-attr]
            wrong = "?" if r["wrong"] is None else ("yes" if r["wrong"] else "no")
            lines.append(f"| {res['case']} | {r['mutant']} | {r['verdict']} | {wrong} | {r['kind']} | {r['culprit']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m refine.bench_mutate")
    ap.add_argument("--only", nargs="*", default=None, help="case names (default: all)")
    ap.add_argument("--count", type=int, default=40, help="mutants per case")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench_mutate.md"))
    ap.add_argument("--one", metavar="NAME", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.count, args.seed)))
        return 0
    if not CORPUS.is_dir():
        print(f"no corpus at {CORPUS}: nothing to do")
        return 0
    results = []
    for name, *_ in CASES:
        if args.only is not None and name not in args.only:
            continue
        p = subprocess.run([sys.executable, "-m", "refine.bench_mutate", "--one", name, "--count", str(args.count),
                            "--seed", str(args.seed)], stdout=subprocess.PIPE, text=True)
        if p.returncode != 0:
            print(f"{name}: failed (exit {p.returncode})")
            continue
        results.append(json.loads(p.stdout.strip().splitlines()[-1]))
    text = table(results)
    Path(args.out).write_text(text)
    print(text)
    return 1 if any(r["kind"] == "UNSOUND" for res in results for r in res["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
