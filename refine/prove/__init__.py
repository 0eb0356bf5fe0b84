"""Relate every sequential tensor to rank tensors by equality saturation.

`walk`: the walk over the sequential graph (`infer`), one node at a time, trying the search
strategies in order; `policy`: every search knob in one `Policy`, each with the general
reason it exists; `frontier`: the neighbourhood of rank tensors a step is told about;
`engine`: the e-graph engine (`Engine.step`, one egglog e-graph per step, bounded in
e-nodes, matches and memory); `declarations`: the rules' dependency closure over their
parsed trees; `egg`: egglog's bindings, loaded without the rest of the egglog package; `reuse`: a repeated layer's steps replayed from an earlier one's premises;
`copies`: rank tensors that copy another rank's heads, proven once before the walk;
`harness`: the numerical soundness check of every rewrite rule; `extra_rules`: a user's
extra rule directory verified with the harness before a check uses it. In: the lowered
sequential graph, the `DistProgram` and the input relations (`refine.relate`). Out: an
`Inference`, each sequential tensor's cheapest term over rank tensors and whether it is
clean (a proof).
"""
