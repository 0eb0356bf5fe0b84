# Every target sets up .venv when it is missing; the pinned CPU torch wheel keeps it small.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint bench clean

$(BIN)/refine: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(BIN)/refine

setup: $(BIN)/refine

demo: setup
	$(BIN)/refine check models/tp_mlp/seq.json models/tp_mlp/dist.json

test: setup
	$(BIN)/ruff check refine rules models tests notebooks
	$(BIN)/python -m pytest -q -n 2  # both cores: the suite is mostly independent capture and e-graph runs

lint: setup
	$(BIN)/ruff check refine rules models tests notebooks

bench: setup
	$(BIN)/python -m refine.bench
	$(BIN)/python -m refine.bench.load  # loading 1e4..1e6-node graphs (time, memory, per node) and a 1e4-node check (bench_load.md)
	$(BIN)/python -m refine.bench.corpus  # the external corpus matrix, when ../shared/corpus is there
	$(BIN)/python -m refine.bench.search  # the counterexample search on every buggy twin (bench_search.md)
	$(BIN)/python -m refine.bench.mutate  # mutation sweep: examples, captured and corpus cases (bench_mutate.md); exit 1 if one is unsound or crashed

clean:
	rm -rf $(VENV) build *.egg-info
