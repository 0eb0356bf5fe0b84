"""Independent evidence that the checker is right, used by the tests and the benches.

`differential`: both programs run on random consistent inputs and compared output by output
(`differential`), and every relation the prover infers checked numerically (`audit`);
`mutate`: realistic distributed bugs injected into correct cases, each mutant judged by the
checker against what evaluating it says; `precision`: both programs run in bf16, fp16 or fp8
against float64, each output's error held to a tolerance from what the sequential program
loses (`refine check --numeric`). In: a case (`Graph`, `Dist`). Out: mismatches, mutation
outcomes and numeric warnings; never a verdict of the checker's own.
"""
