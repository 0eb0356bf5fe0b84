"""What the counterexample search costs where it runs: on every bundled buggy twin
(models/*_bug_*), every captured twin (models/capture/*.py, each `BUGS` entry, built with the
`make_case` arguments it states) and the corpus bug cases, write bench_search.md with the
verdict, whether a counterexample was found (and after how many draws), the rank node the
numbers show going wrong first and its line, and the time of the proof, of the search and of
the divergence search (the search runs only when the proof stops).

    python -m refine.bench.search [--only NAME ...]    # a NAME ending in / or : is a prefix: capture/
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from refine.bench.corpus import CORPUS, RELATIONS, matrix
from refine.check import check, check_files
from refine.verdict.report import Report

ROOT = Path(__file__).resolve().parents[2]  # the checkout: refine/bench/<this file>


def _captured(path: Path) -> Iterator[tuple[str, Callable[[], Report]]]:
    spec = importlib.util.spec_from_file_location(f"bench_capture_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # each twin is built with the make_case arguments BUGS states for it (a layout, a mesh)
    for bug, kwargs in getattr(module, "BUGS", {}).items():
        def run(module: object = module, bug: str = bug, kwargs: dict[str, object] = kwargs) -> Report:
            from refine.frontends.capture import capture

            return capture(module.make_case(bug=bug, **kwargs)).check()  # type: ignore[attr-defined]
        yield f"capture/{path.stem}:{bug}", run


def _corpus(name: str, seq_dir: str, dist_dir: str, rel: str | None) -> Callable[[], Report]:
    def run() -> Report:
        from refine.frontends.graphfile import load_dist, load_seq
        from refine.frontends.importer.entangle import import_case
        from refine.ops.registry import load_registry

        out = Path(tempfile.mkdtemp())
        import_case(CORPUS / seq_dir, CORPUS / dist_dir, RELATIONS / rel if rel else None).write(out)
        registry = load_registry()
        seq = load_seq(out / "seq.json", registry)
        return check(seq, load_dist(out / "dist.json", registry, seq), registry)
    return run


def cases() -> Iterator[tuple[str, Callable[[], Report]]]:
    for p in sorted((ROOT / "models").glob("*_bug_*/dist.json")):
        yield p.parent.name, lambda p=p: check_files(p.parent / "seq.json", p)
    for path in sorted((ROOT / "models" / "capture").glob("*.py")):
        yield from _captured(path)
    if CORPUS.is_dir():
        for name, seq_dir, dist_dir, rel in matrix():
            if name.startswith("bug_"):
                yield f"corpus/{name}", _corpus(name, seq_dir, dist_dir, rel)


def row(name: str, run: Callable[[], Report]) -> str:
    t0 = time.perf_counter()
    try:
        r = run()
    except Exception as e:  # noqa: BLE001 - a case that cannot be built or checked is a row, not the end
        return f"| {name} | error: {type(e).__name__}: {str(e)[:80]} | | | | | | |"
    total = time.perf_counter() - t0
    s, search, c = r.stats, r.search, r.culprit
    if search is None:
        found = "no search (proof)"
    elif search.found is not None:
        found = f"yes, draw {search.found.seed + 1}"
    elif search.skipped:
        found = f"skipped: {search.skipped[:60]}"
    else:
        found = f"no ({search.agreed} draws agreed)"
    where = ""
    if c is not None and c.divergence is not None:
        d = c.divergence
        where = f"{d.rank_node} ({d.op}) at {d.source} [{d.repairs} runs]"
    elif c is not None and c.rank_node:
        where = f"prover: {c.rank_node} at {c.rank_source}"
    search_s = s.get("search_seconds", 0.0)
    return (f"| {name} | {r.verdict} | {found} | {where} | {total:.1f} | {total - search_s:.1f} "
            f"| {search_s:.2f} |")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m refine.bench.search")
    ap.add_argument("--only", nargs="*", default=None,
                    help="case names, or prefixes ending in / or : (capture/, capture/tp_mlp:); default: all")
    ap.add_argument("--out", default=str(ROOT / "bench_search.md"))
    args = ap.parse_args(argv)
    rows = ["| case | verdict | counterexample | rank node the numbers show wrong first | total s | capture, load, proof s "
            "| search + divergence s |", "|---|---|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    for name, run in cases():
        if args.only and not any(name == o or (o.endswith(("/", ":")) and name.startswith(o)) for o in args.only):
            continue
        rows.append(row(name, run))
        print(rows[-1], flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    text = "\n".join(rows) + f"\n\npeak RSS {peak:.0f} MiB\n"
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
