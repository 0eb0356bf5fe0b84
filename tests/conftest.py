"""Shared test setup: a cache directory of the session's own, every REFINES run on random
inputs too (a difference fails the test: a soundness failure), the registry as a fixture, and
what the markers registered in pyproject.toml mean at run time (`corpus` tests skip without
the corpus; `heavy` ones run only with --heavy)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from refine.ops.registry import Registry, load_registry
from tests.helpers import CORPUS, NO_CORPUS

# One intra-op thread per test process: the suite runs one process per core (pytest -n), and
# torch's own thread pool on top of that makes every small op wait for a core (a 4x4 float64
# matmul took 32 ms instead of 5 us on a loaded 2-core machine).
torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--heavy", action="store_true",
                     help="also run the tests marked heavy (more memory than a 2-core CI machine has)")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("corpus") is not None and not CORPUS.is_dir():
        pytest.skip(NO_CORPUS)
    if item.get_closest_marker("heavy") is not None and not item.config.getoption("--heavy"):
        pytest.skip("more memory than a 2-core CI machine has (see the test's docstring): run with --heavy")


@pytest.fixture(autouse=True, scope="session")
def _refine_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Verifications of extra rule directories (refine.prove.extra_rules) go to a cache of the test
    session's own, never the user's; subprocesses inherit it."""
    old = os.environ.get("REFINE_CACHE_DIR")
    os.environ["REFINE_CACHE_DIR"] = str(tmp_path_factory.mktemp("refine-cache"))
    yield
    if old is None:
        os.environ.pop("REFINE_CACHE_DIR", None)
    else:
        os.environ["REFINE_CACHE_DIR"] = old


@pytest.fixture(autouse=True, scope="session")
def _self_check() -> Iterator[None]:
    """Every REFINES in the suite is also run on random inputs (refine.check, REFINE_SELF_CHECK):
    outputs that differ raise SoundnessFailure, failing whichever test got the verdict."""
    old = os.environ.get("REFINE_SELF_CHECK")
    os.environ["REFINE_SELF_CHECK"] = "1"
    yield
    if old is None:
        os.environ.pop("REFINE_SELF_CHECK", None)
    else:
        os.environ["REFINE_SELF_CHECK"] = old


@pytest.fixture(scope="session")
def registry() -> Registry:
    """The built-in rule families (load_registry caches them: one load per test process)."""
    return load_registry()
