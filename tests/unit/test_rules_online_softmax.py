"""rules/online_softmax.py: the harness catches the tempting wrong forms of its rules (a
merge of blocks at two shifts, a shift's factor dropped), on the family's seeds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from refine.ops.registry import Rule, load_registry, rule
from refine.prove.harness import Harness

REG = load_registry()

BAD = [
    # the two blocks' sums at different shifts merged as if at one (ring_no_rescale's merge)
    rule("bad-expmv-merge-any-shift",
         ["(= ta (expmv_c a m va))", "(SumHas e ta)", "(= e (Sum ms))", "(= (multiset-length ms) 2)",
          "(multiset-contains ms ta)", "(= tb (multiset-pick (multiset-remove ms ta)))", "(= tb (expmv_c b m2 vb))",
          "(!= m m2)", "(= d (- (ndim a) 1))"],
         ["(union e (expmv_c (cat a b d) m (cat va vb (- d 1))))"]),
    # a product taken for its numerator whatever the factor (a block's shift never moved)
    rule("bad-expmv-shift-dropped", ["(= e (mul_t o f))", "(= o (expmv_c s m v))"], ["(union e o)"]),
]


@pytest.mark.parametrize("bad", BAD, ids=lambda r: r.name)
def test_the_harness_catches_a_wrong_online_softmax_rule(bad: Rule) -> None:
    reg = replace(REG, rules=list(REG.rules) + [Rule(bad.name, bad.text, "online_softmax")], ops=dict(REG.ops),
                  decls=list(REG.decls), families=list(REG.families))
    (r,) = Harness(reg, seed=0, instances=2).run([bad.name])
    assert r.fired and r.failures, r
