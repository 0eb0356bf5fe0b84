"""Measurements, never assertions: each module runs a sweep and writes its table.

`python -m refine.bench`: every bundled example checked (bench.md); `refine.bench.load`:
loading and checking graphs of 1e4 to 1e6 nodes (bench_load.md); `refine.bench.corpus`: the
external Entangle corpus matrix (bench_corpus.md); `refine.bench.mutate`: the mutation sweep
(bench_mutate.md). In: the checkout's models and, when present, ../shared/corpus. Out:
Markdown tables of verdicts, times and memory.
"""
