"""The data every stage shares, and nothing that runs a stage.

`graph`: graphs of tensor ops and distributed programs (a mesh, one graph per rank,
relations, expectations); `term`: the term language relations and rules are written in; `sexp`: s-expressions,
the syntax of egglog and of rule patterns (one reader, one printer);
`sizes`: symbolic sizes and their proven comparisons; `layout`: the terms a placement or a
replicated layout denote; `errors`: the errors any stage reports about its input; `lazy`:
torch, imported when first used. In: nothing but Python values. Out: the types and term
algebra the other stages are written in. Nothing here imports another stage.
"""
