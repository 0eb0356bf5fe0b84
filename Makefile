# Every target sets up .venv when it is missing; the pinned CPU torch wheel keeps it small.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-all lint bench clean

$(BIN)/refine: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# the zoo's torchtitan program (models/zoo/torchtitan_llama.py): --no-deps, since torchtitan
	# pins a CUDA torch nightly; its model and parallelize code need only these (triton: imported
	# at module level on torchtitan.models.llama3's import path)
	$(BIN)/python -m pip install -q --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 \
		docstring_parser==0.18.0 triton==3.9.0
	touch $(BIN)/refine

setup: $(BIN)/refine

demo: setup
	$(BIN)/refine check models/tp_mlp/seq.json models/tp_mlp/dist.json

# both cores: the suite is mostly independent capture and e-graph runs. `test` (CI) leaves out
# the tests marked slow (a minute or more each: whole-model twins, knob sweeps, 8-rank
# reductions); `test-all` runs them too, before a merge.
test: setup
	$(BIN)/ruff check refine rules models tests notebooks
	$(BIN)/python -m pytest -q -n 2 -m "not slow"

test-all: setup
	$(BIN)/ruff check refine rules models tests notebooks
	$(BIN)/python -m pytest -q -n 2

lint: setup
	$(BIN)/ruff check refine rules models tests notebooks

bench: setup
	$(BIN)/python -m refine.bench
	$(BIN)/python -m refine.bench.load  # loading 1e4..1e6-node graphs (time, memory, per node) and a 1e4-node check (bench_load.md)
	$(BIN)/python -m refine.bench.corpus  # the external corpus matrix, when ../shared/corpus is there
	$(BIN)/python -m refine.bench.search  # the counterexample search on every buggy twin (bench_search.md)
	$(BIN)/python -m refine.bench.mutate  # mutation sweep: examples, captured and corpus cases (bench_mutate.md); exit 1 if one is unsound or crashed
	$(BIN)/python -m refine.bench.zoo  # the model zoo: program x config and each bug -> verdict, culprit right, seconds, RSS (bench_zoo.md); exit 1 if a row is not as expected

clean:
	rm -rf $(VENV) build *.egg-info
