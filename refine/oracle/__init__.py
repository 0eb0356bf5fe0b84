"""Independent evidence that the checker is right, used by the tests and the benches.

`differential`: both programs run on random consistent inputs and compared output by output
(`differential`), and every relation the prover infers checked numerically (`audit`);
`mutate`: realistic distributed bugs injected into correct cases, each mutant judged by the
checker against what evaluating it says. In: a case (`Graph`, `Dist`). Out: mismatches and
mutation outcomes; never a verdict of the checker's own.
"""
