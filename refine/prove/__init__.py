"""Relate every sequential tensor to rank tensors by equality saturation.

`engine`: the e-graph engine (`Engine.step`, one egglog e-graph per step) and the walk over
the sequential graph (`infer`); `egg`: egglog's bindings, loaded without the rest of the
egglog package; `reuse`: a repeated layer's steps replayed from an earlier one's premises;
`copies`: rank tensors that copy another rank's heads, proven once before the walk;
`harness`: the numerical soundness check of every rewrite rule; `extra_rules`: a user's
extra rule directory verified with the harness before a check uses it. In: the lowered
sequential graph, the `DistProgram` and the input relations (`refine.relate`). Out: an
`Inference`, each sequential tensor's cheapest term over rank tensors and whether it is
clean (a proof).
"""
