"""Every .gpickle file of the corpus loads (refine/frontends/importer/gpickle.py), and every
call target in them is covered by refine: a framework op, an importer entry or capture's ATen
table (the tables are in tests/unit/test_ops_framework.py)."""

from __future__ import annotations

import collections

import pytest

from refine.frontends.importer.gpickle import NodeRef, load_gpickle
from tests.helpers import CORPUS
from tests.unit.test_ops_framework import IMPORTED, WRAPPERS, _coverage

pytestmark = pytest.mark.corpus


@pytest.mark.slow
def test_every_corpus_file_loads() -> None:
    files = sorted(CORPUS.glob("**/*.gpickle"))
    assert len(files) > 100
    for f in files:
        g = load_gpickle(f)
        assert g.nodes and all(isinstance(n.name, str) for n in g.nodes), f
        refs = {a.name for n in g.nodes for a in n.args if isinstance(a, NodeRef)}
        assert refs <= set(g.index), f


@pytest.mark.slow
def test_every_corpus_call_target_is_covered() -> None:
    import torch.distributed._functional_collectives  # noqa: F401 - registers _c10d_functional ops

    calls: collections.Counter[str] = collections.Counter()
    getitems: dict[str, set[int]] = collections.defaultdict(set)
    for f in sorted(CORPUS.glob("**/*.gpickle")):
        g = load_gpickle(f)
        for n in g.nodes:
            if n.op != "call_function":
                continue
            if "getitem" in n.target:
                src = g.index[n.args[0].name]
                getitems[src.target if src.target not in WRAPPERS else str(src.args[0])].add(n.args[1])
                calls["getitem"] += 1
            elif n.target in WRAPPERS:
                calls[str(n.args[0])] += 1
            elif n.target == "aten.index.Tensor":
                k = sum(isinstance(i, NodeRef) for i in n.args[1])
                calls[n.target if k == 1 else f"{n.target}[{k} indices]"] += 1
            elif n.target == "aten.index_put.default":
                idx = [i for i in n.args[1] if isinstance(i, NodeRef)]
                form = "bool mask" if len(idx) == 1 and g.index[idx[0].name].dtype == "bool" else f"{len(idx)} indices"
                calls[f"{n.target}[{form}]"] += 1
            else:
                calls[n.target] += 1
    assert len(calls) > 70
    covered, missing = {}, []
    for t in sorted(calls):
        how = _coverage(t, getitems[t])
        if how is None:
            missing.append(t)
        else:
            covered[t] = how
    print(f"\n{len(covered)} of {len(calls)} corpus call targets covered:")
    for t, how in covered.items():
        print(f"  {t} ({calls[t]} calls): {how}")
    assert not missing, f"corpus call targets refine does not cover: {missing}"
    assert not set(IMPORTED) - set(calls), "an importer entry the corpus no longer uses"
