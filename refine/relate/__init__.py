"""From two programs to equations over rank tensors.

`program`: the rank graphs lowered and their collectives matched across ranks, giving the
distributed program as definitions over rank tensors (`DistProgram`), and each sequential
input as a relation term over rank inputs (`seq_input_relations`); `overlap`: no rank
element stands for two sequential elements. In: a lowered sequential graph and a `Dist`.
Out: a `DistProgram` with no communication left, only equalities, and the input relations
the prover starts from.
"""
