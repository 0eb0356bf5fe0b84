"""What each op means: the registry, lowering and the interpreter.

`registry`: the ops and rewrite rules the rule families (`rules/`) declare, loaded into one
`Registry`; `lower`: a loaded graph rewritten to core ops (`lower`), the form every later
stage reasons about; `interp`: the ops' torch semantics run on graphs, rank programs
(collectives simulated in an order `schedule` allows) and relation terms, and random inputs
consistent with a program's relations; `special`: the integer values a program singles out
(the literals it compares an input with), which random draws mix in; `schedule`: the ranks' program order, matched
communication op by op, and whether it deadlocks. In: graphs and terms (`refine.ir`). Out:
their meaning, as shapes, core graphs and values.
"""
