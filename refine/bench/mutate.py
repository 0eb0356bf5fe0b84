"""Mutation sweep (refine/oracle/mutate.py) over the bundled examples (models/*, the correct
ones), cases built or captured here (collectives of several groups, a pipeline's sends and
recvs: what the order-swap operators need) and corpus cases: inject seeded bugs, check and
(where the case is small enough to run in torch) evaluate each mutant, and write
bench_mutate.md with the counts per operator and per case (caught / refused / neutral /
incomplete / missed / UNSOUND / crashed / timeout / unjudged) and the outcome of every mutant. Each
check gets CHECK_LIMIT seconds of CPU (a "timeout" past it: no verdict, reported, not failing).

Each case runs in a child process (its peak RSS and CPU time are its own), `--jobs` of them
at a time but never two heavy ones (a corpus case evaluated in float64 holds GBs). Exit 1
if any mutant is UNSOUND or crashed, or a case failed. Run by `make bench`, or alone:

    python -m refine.bench.mutate [--only tp_mlp capture/pp_tied_2 ...] [--count N] [--seed 0] [--jobs 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refine.bench.corpus import CORPUS, RELATIONS, ROOT

KINDS = ("caught", "refused", "neutral", "incomplete", "missed", "UNSOUND", "crashed", "timeout", "unjudged")
CHECK_LIMIT = 120.0  # CPU seconds for one mutant's check (aws_llama's take 10-20): past it, "timeout"
FAILING = ("UNSOUND", "crashed")  # a false proof, or a check that raised: exit 1


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # example (models/NAME) | built (here) | capture (models/capture) | corpus (Entangle)
    source: tuple[Any, ...] = ()
    evaluate: bool = True
    count: int = 40
    heavy: bool = False  # GBs of memory: never two at once


def _examples() -> list[Case]:
    """Every correct bundled example (a buggy twin's mutants say little: it does not refine)."""
    dirs = sorted(p.parent.name for p in (ROOT / "models").glob("*/dist.json"))
    return [Case(d, "example", (d,)) for d in dirs if "_bug_" not in d]


CASES: list[Case] = [
    *_examples(),
    # a world all_reduce next to a tensor-parallel one: a rank that swaps them deadlocks
    Case("built/dp_tp_stat", "built", ("dp_tp_stat",)),
    # fc1 kept in bfloat16 and read back as float32: casts whose dtype a bug makes an int
    Case("built/tp_mlp_bf16", "built", ("tp_mlp_bf16",)),
    # pipelines (sends and recvs, the tied embedding's all_reduce), 2D meshes (dp x tp, kv x rep)
    Case("capture/pp_tied_2", "capture", ("pp_tied", {"world_size": 2})),
    Case("capture/pp_tied_3", "capture", ("pp_tied", {"world_size": 3})),
    Case("capture/tp_mlp_dp2", "capture", ("tp_mlp", {"world_size": 4, "dp": 2})),
    Case("capture/gqa_tp_4", "capture", ("gqa_tp", {"world_size": 4, "heads": 4, "kv_heads": 2})),
    # the corpus (skipped when it is not next to this checkout). Evaluation runs both programs
    # in float64; gpt's 98304-entry vocabulary over 12288 tokens (tensors of 1.2e9 elements)
    # and qwen2's 32768 tokens are beyond this machine, so those report verdicts only
    Case("aws_llama/tp2_layer1", "corpus", ("aws_llama/tp1_layer1", "aws_llama/tp2_layer1", "aws_llama.json"),
         heavy=True),
    # two layers: a mutant in either must be caught while the other layer's steps are replayed
    Case("aws_llama/tp2_layer2", "corpus", ("aws_llama/tp1_layer2", "aws_llama/tp2_layer2", "aws_llama.json"),
         heavy=True),
    Case("gpt/paral2_layer1", "corpus", ("gpt/paral1_layer1", "gpt/paral2_layer1", "gpt.json"), False),
    Case("qwen2/paral2_layer1", "corpus", ("qwen2/paral1_layer1", "qwen2/paral2_layer1", "qwen2.json"), False),
]


def dp_tp_stat(out: str | Path, dp: int = 2, tp: int = 2) -> None:
    """An MLP over a dp x tp mesh (ranks dp-major): tokens split over dp, fc1 column- and fc2
    row-parallel over tp (a sum all_reduce over the tp group), and a statistic of fc1's
    output (its sum, a logging metric) all-reduced over every rank first. Nothing orders the
    two collectives but the program: a rank that runs the tp one first waits for a partner
    that waits for it in the world one."""
    from refine.frontends.build import GraphBuilder, dist_doc, seq_doc, write_case

    T, H, F = 8, 8, 16
    s = GraphBuilder()
    x = s.input("x", [T, H])
    w1, w2 = s.input("w1", [H, F], role="parameter"), s.input("w2", [F, H], role="parameter")
    f1 = s.op("matmul", x, w1, name="fc1")
    s.output("stat", s.op("sum", f1, name="fc1_sum", dim=[0, 1]))
    s.output("y", s.op("matmul", s.op("gelu", f1, name="act", approximate="none"), w2, name="fc2"))
    world = list(range(dp * tp))
    ranks = {}
    for r in world:
        d = GraphBuilder()
        f1_ = d.op("matmul", d.input("x", [T // dp, H]), d.input("w1", [H, F // tp], role="parameter"), name="fc1")
        total = d.op("all_reduce", d.op("sum", f1_, name="fc1_sum", dim=[0, 1]), name="stat_sum", reduce_op="sum",
                     group=world)
        d.output("stat", total)
        h = d.op("gelu", f1_, name="act", approximate="none")
        fc2 = d.op("matmul", h, d.input("w2", [F // tp, H], role="parameter"), name="fc2")
        d.output("y", d.op("all_reduce", fc2, name="fc2_sum", reduce_op="sum",
                           group=[r // tp * tp + k for k in range(tp)]))
        ranks[r] = d
    rel = [{"from": "x", "placements": ["Shard(0)", "Replicate"]}, {"from": "w1", "placements": ["Replicate", "Shard(1)"]},
           {"from": "w2", "placements": ["Replicate", "Shard(0)"]}]
    ex = [{"output": "y", "placements": ["Shard(0)", "Replicate"]},
          {"output": "stat", "placements": ["Replicate", "Replicate"]}]
    write_case(out, seq_doc(s), dist_doc({"dp": dp, "tp": tp}, ranks, rel, ex))


def tp_mlp_bf16(out: str | Path, world: int = 2) -> None:
    """A tensor-parallel MLP whose fc1 output is kept in bfloat16 (`to_copy`) and read back
    as float32 (`cast`), as activation memory savings do: dtype attributes to mutate."""
    from refine.frontends.build import GraphBuilder, dist_doc, seq_doc, write_case

    T, H, F = 8, 8, 16

    def mlp(g: GraphBuilder, f: int, reduce: list[int] | None) -> None:
        x, w1, w2 = g.input("x", [T, H]), g.input("w1", [H, f], role="parameter"), g.input("w2", [f, H], role="parameter")
        low = g.op("to_copy", g.op("matmul", x, w1, name="fc1"), name="fc1_bf16", dtype="bfloat16")
        h = g.op("gelu", g.op("cast", low, name="fc1_f32", dtype="float32"), name="act", approximate="none")
        y = g.op("matmul", h, w2, name="fc2")
        g.output("y", y if reduce is None else g.op("all_reduce", y, name="fc2_sum", reduce_op="sum", group=reduce))

    s = GraphBuilder()
    mlp(s, F, None)
    ranks = {}
    for r in range(world):
        ranks[r] = GraphBuilder()
        mlp(ranks[r], F // world, list(range(world)))
    rel = [{"from": "x", "placements": ["Replicate"]}, {"from": "w1", "placements": ["Shard(1)"]},
           {"from": "w2", "placements": ["Shard(0)"]}]
    write_case(out, seq_doc(s), dist_doc({"tp": world}, ranks, rel, [{"output": "y", "placements": ["Replicate"]}]))


def _write_case(case: Case, d: Path) -> None:
    """seq.json and dist.json of the case in directory d."""
    if case.kind == "example":
        for f in ("seq.json", "dist.json"):
            (d / f).write_text((ROOT / "models" / case.source[0] / f).read_text())
    elif case.kind == "built":
        {"dp_tp_stat": dp_tp_stat, "tp_mlp_bf16": tp_mlp_bf16}[case.source[0]](d)
    elif case.kind == "capture":
        from refine.frontends import capture

        module, kwargs = case.source
        spec = importlib.util.spec_from_file_location(f"capture_model_{module}", ROOT / "models" / "capture" / f"{module}.py")
        assert spec is not None and spec.loader is not None
        model = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(model)
        capture(model.make_case(**kwargs)).write(d)
    else:
        from refine.frontends.importer.entangle import import_case

        seq_dir, dist_dir, rel = case.source
        import_case(CORPUS / seq_dir, CORPUS / dist_dir, RELATIONS / rel).write(d)


def operator_order() -> list[str]:
    """The new operators first: a case's mutants take the operators in turn, so each gets
    its share whatever the count (the older ones are also what the bundled tests cover)."""
    from refine.oracle.mutate import ALL_OPERATORS, OPERATORS

    return [o for o in ALL_OPERATORS if o not in OPERATORS] + list(OPERATORS)


def one(name: str, count: int | None, seed: int) -> dict[str, object]:
    from refine.ops.registry import load_registry
    from refine.oracle.mutate import load_case, read_doc, run

    case = next(c for c in CASES if c.name == name)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        _write_case(case, d)
        registry = load_registry()
        seq, dist, doc = load_case(d / "seq.json", d / "dist.json", registry)
        rows = []

        def log(o: Any) -> None:
            print(f"{name}: {o.kind:10} {o.verdict:16} {_cell(o.mutant.name)[:160]}", file=sys.stderr, flush=True)

        for o in run(seq, dist, doc, registry, count or case.count, seed, operator_order(), on_outcome=log,
                     evaluate=case.evaluate, seq_doc=read_doc(d / "seq.json"), check_limit=CHECK_LIMIT):
            rows.append({"operator": o.mutant.operator, "mutant": o.mutant.name, "verdict": o.verdict,
                         "wrong": o.wrong, "kind": o.kind, "culprit": o.culprit,
                         "error": None if o.error != o.error else o.error})
    use = resource.getrusage(resource.RUSAGE_SELF)
    return {"case": name, "rows": rows, "cpu_s": use.ru_utime + use.ru_stime, "rss_mib": use.ru_maxrss / 1024,
            "wall_s": time.perf_counter() - t0}


def _cell(text: object) -> str:
    """A table cell: one line (a hostile name may hold newlines), no column separators."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _counts_table(title: str, key: str, per: dict[str, Counter[str]], extra: dict[str, str] | None = None) -> list[str]:
    lines = [f"## {title}", "", f"| {key} | " + " | ".join(KINDS) + " | total |" + (" |" if extra else ""),
             "|---|" + "---|" * (len(KINDS) + 1) + ("---|" if extra else "")]
    for k, c in per.items():
        row = f"| {k} | " + " | ".join(str(c[x]) for x in KINDS) + f" | {sum(c.values())} |"
        lines.append(row + (f" {extra.get(k, '')} |" if extra else ""))
    return lines + [""]


def summary(results: list[dict[str, Any]], wall: float | None = None) -> str:
    """The counts per operator and per case, and every UNSOUND or crashed mutant."""
    mutants = [(res["case"], r) for res in results for r in res["rows"] if r["operator"] != "none"]
    total = Counter(r["kind"] for _, r in mutants)
    head = f"{len(mutants)} mutants over {len(results)} cases: " + ", ".join(f"{k} {total[k]}" for k in KINDS)
    lines = ["# Mutation sweep", "", head + (f" ({wall / 60:.1f} min wall)" if wall is not None else ""), ""]
    per_op: dict[str, Counter[str]] = {}
    for _, r in mutants:
        per_op.setdefault(r["operator"], Counter())[r["kind"]] += 1
    lines += _counts_table("Per operator", "operator", dict(sorted(per_op.items())))
    per_case = {res["case"]: Counter(r["kind"] for r in res["rows"] if r["operator"] != "none") for res in results}
    cost = {res["case"]: f"{res['cpu_s']:.0f} s CPU, {res['rss_mib']:.0f} MiB" for res in results}
    lines += _counts_table("Per case", "case", per_case, cost)
    base = [(res["case"], r) for res in results for r in res["rows"] if r["operator"] == "none"
            and (r["verdict"] != "REFINES" or r["kind"] not in ("neutral", "unjudged"))]
    if base:
        lines += ["The unmutated case itself is not neutral (the rest of its rows mean little): "
                  + ", ".join(f"{c} ({r['kind']})" for c, r in base), ""]
    blind = Counter(r["operator"] for _, r in mutants if r["kind"] == "unjudged" and r["verdict"] == "REFINES")
    if blind:
        lines += ["Unjudged mutants that REFINE (too large to evaluate; a live bug there is likely unsound): "
                  + ", ".join(f"{op} {n}" for op, n in sorted(blind.items())), ""]
    bad = [(c, r) for c, r in mutants if r["kind"] in (*FAILING, "timeout")]
    lines += ["## UNSOUND, crashed and timed-out mutants", ""]
    lines += [f"- {c}: **{r['kind']}** {_cell(r['mutant'])}" + (f" ({_cell(r['culprit'])})" if r["culprit"] else "")
              for c, r in bad] or ["none"]
    return "\n".join(lines) + "\n"


def table(results: list[dict[str, Any]], wall: float | None = None) -> str:
    lines = [summary(results, wall), "## Per case and operator", "",
             "| case | operator | " + " | ".join(KINDS) + " |", "|---|---|" + "---|" * len(KINDS)]
    for res in results:
        per: dict[str, Counter[str]] = {}
        for r in res["rows"]:
            if r["operator"] != "none":
                per.setdefault(r["operator"], Counter())[r["kind"]] += 1
        for op, c in sorted(per.items()):
            lines.append(f"| {res['case']} | {op} | " + " | ".join(str(c[k]) for k in KINDS) + " |")
    lines += ["", "## Every mutant", "", "| case | mutant | verdict | wrong | outcome | culprit |",
              "|---|---|---|---|---|---|"]
    for res in results:
        for r in res["rows"]:
            wrong = "?" if r["wrong"] is None else ("yes" if r["wrong"] else "no")
            lines.append(f"| {res['case']} | {_cell(r['mutant'])} | {r['verdict']} | {wrong} | {r['kind']} "
                         f"| {_cell(r['culprit'])} |")
    return "\n".join(lines) + "\n"


def sweep(cases: list[Case], count: int | None, seed: int, jobs: int, timeout: float) -> tuple[list[dict[str, Any]], list[str]]:
    """Run each case in a child process, `jobs` at a time, one heavy case at a time (heavy
    ones first: they are the longest). Returns the results in the cases' order and the failures."""
    todo = sorted(cases, key=lambda c: not c.heavy)
    running: list[tuple[Case, subprocess.Popen[bytes], float, Any]] = []
    done: dict[str, dict[str, Any]] = {}
    failed: list[str] = []
    while todo or running:
        for case in list(todo):
            if len(running) >= jobs:
                break
            if case.heavy and any(c.heavy for c, *_ in running):
                continue
            cmd = [sys.executable, "-m", "refine.bench.mutate", "--one", case.name, "--seed", str(seed)]
            if count is not None:
                cmd += ["--count", str(count)]
            out_file = tempfile.TemporaryFile()  # not a pipe: nobody reads it while the child runs
            running.append((case, subprocess.Popen(cmd, stdout=out_file), time.monotonic(), out_file))
            todo.remove(case)
        time.sleep(0.5)
        for entry in list(running):
            case, p, t0, out_file = entry
            if p.poll() is None and time.monotonic() - t0 > timeout:
                p.kill()
            if p.poll() is None:
                continue
            out_file.seek(0)
            out = out_file.read().decode()
            out_file.close()
            running.remove(entry)
            if p.returncode != 0 or not out.strip():
                failed.append(f"{case.name}: failed (exit {p.returncode})")
                print(failed[-1], flush=True)
                continue
            done[case.name] = json.loads(out.strip().splitlines()[-1])
    return [done[c.name] for c in cases if c.name in done], failed


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m refine.bench.mutate")
    ap.add_argument("--only", nargs="*", default=None, help="case names (default: all)")
    ap.add_argument("--count", type=int, default=None, help="mutants per case (default: each case's own)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2, help="cases checked at once (child processes)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds a case may take")
    ap.add_argument("--out", default=str(ROOT / "bench_mutate.md"))
    ap.add_argument("--one", metavar="NAME", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.count, args.seed)))
        return 0
    unknown = sorted(set(args.only or ()) - {c.name for c in CASES})
    if unknown:
        print(f"no such case: {', '.join(unknown)} (cases: {', '.join(c.name for c in CASES)})")
        return 2
    cases = [c for c in CASES if args.only is None or c.name in args.only]
    if not CORPUS.is_dir():
        print(f"no corpus at {CORPUS}: its cases are skipped")
        cases = [c for c in cases if c.kind != "corpus"]
    t0 = time.monotonic()
    results, failed = sweep(cases, args.count, args.seed, max(1, args.jobs), args.timeout)
    wall = time.monotonic() - t0
    Path(args.out).write_text(table(results, wall))
    print(summary(results, wall) + "".join(f"{f}\n" for f in failed) + f"(every mutant: {args.out})")
    bad = any(r["kind"] in FAILING for res in results for r in res["rows"])
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
