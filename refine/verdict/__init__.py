"""From what was proven to a verdict a user can act on.

`expect`: what the rank outputs must make for each sequential output (its expectation as
terms); `localize`: the first sequential node whose relation fails, and why; `factor`,
`missing_reduce`, `terms`: evaluating the rank programs to name a wrong constant, a missing
reduction or a term one rank should not sum into a reduction; `counterexample`: when the
proof stops, inputs on which the outputs differ and the rank node they show going wrong
first; `reduce`: the same programs at small sizes, for a
search on a case too large to evaluate; `report`: the verdict, printed or as JSON;
`draw`: the culprit's neighbourhood as a picture. In: the `Inference` (`refine.prove`) and
the programs. Out: a `Report`: REFINES (a proof), DOES NOT REFINE (a counterexample) or
UNPROVEN (neither), with the culprit node.
"""
