"""Shared test setup."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


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
