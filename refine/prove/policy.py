"""The prover's search policy: every knob that decides what a step looks at and how long it
searches, in one frozen object.

A search knob changes which proofs are found, never whether a proof is sound: every
equality an e-graph holds is proven, so a smaller knob can only lose proofs (a node left
unclean, a culprit, never a REFINES it did not prove) and a larger one only costs time.
The resource bounds that stop a runaway step (refine.prove.engine's NODE_BUDGET,
MATCH_BUDGET, MEMORY_BUDGET) and the caches' sizes are not here: they bound what the
process may spend whatever the search, and say nothing about where a proof is.

The walk (refine.prove.walk) relates each sequential node with a list of named strategies,
tried in order until one gives a clean relation; `strategies` says which may run (all by
default). `refine check --stats` reports how often each ran and how often its result was
the relation kept.
"""

from __future__ import annotations

from dataclasses import dataclass

# In the order the walk tries them on a node (see refine.prove.walk.infer for which apply where).
STRATEGIES: tuple[str, ...] = ("replay", "near", "wide", "deep", "carried", "write_back", "relayout", "side")


@dataclass(frozen=True)
class Policy:
    # -- one step (refine.prove.engine.Engine.step) --
    # Rule iterations of a step. Each iteration rewrites every term once more; a relation
    # that needs k rewrites in a row (a view of a slice of a concat...) needs k iterations,
    # and every iteration grows the e-graph. Enough for the op chains one sequential node
    # meets over rank tensors; too few and such a chain stays unproven.
    iterations: int = 14
    # A step stops before `iterations` once its target's best term is plain (rank tensors in
    # concats and sums) and has not got cheaper for this many iterations: most steps are
    # proven in a few iterations and the rest of the bound only grows the e-graph (most of
    # a step's time). A step with checks runs the whole bound: what it must prove is not
    # its cheapest term. No verdict measured needs the wait, but a culprit can: a node
    # proven a few iterations later (a count of kept targets related through not(==) = !=)
    # is clean, so the culprit is the op after it, the line at fault.
    patience: int = 3
    # An iteration with more rule matches than this that made the clean best term no
    # cheaper ends the step too, plain or not: associative-commutative regrouping (sums of
    # many like terms) keeps matching without producing anything cheaper, and each further
    # iteration costs more than the last.
    flood: int = 200_000

    # -- the frontier: which rank tensors a step's e-graph holds (refine.prove.frontier) --
    # Uses after a node's inputs' rank tensors that the first try searches: the ranks
    # usually compute a node's counterpart from its inputs' tensors within a few ops
    # (a local op, then maybe a collective and a view). Also the reach of the write-back
    # retry (refine.prove.walk._write_back), whose structural ops cost no hop.
    near_hops: int = 3
    # The second try's reach, when the near one finds no clean relation: a rank may put
    # more ops between the inputs and the counterpart (a communication that reshapes and
    # transposes around itself, a layout change before and after).
    wide_hops: int = 8
    # Over a fused op's term (Op.fuse: an op the ranks never materialise, as blockwise
    # attention never holds softmax), the counterpart of the users lies far downstream in
    # the rank program; searched this many uses deep ...
    deep_hops: int = 24
    # ... with this many rule iterations (the e-graph holds most of a rank program). Not 0:
    # Engine.step reads 0 iterations as `iterations` (so 0 searches longer, not less).
    deep_iterations: int = 6
    # What a node passes to its users is a term no deeper than this, else an opaque leaf:
    # every walk over a term recurses, and a chain of views of a value no rank tensor
    # stands for would pass a term one op deeper at every node. Relations over rank tensors
    # are a few ops deep.
    term_depth: int = 64
    # An unclean node over at most this many distinct ops is passed to its users as its
    # term instead of an opaque leaf: ranks often hold only what a mask selects (a sharded
    # lookup's range test), never the mask itself, and only what a fused computation makes
    # of an intermediate (Megatron's log(sum_exp) - logit for the log-probs' lookup), so the
    # relation exists only at its users. Larger terms would grow every later e-graph.
    carry_ops: int = 16
    # ... and the reach of its users' retry: the ranks' counterpart of a carried term is as
    # far as the chain it stands for.
    carry_hops: int = 12
    # A rank tensor that applies a node's own op to the tensors its inputs relate to stays
    # offered to later steps this many uses downstream: the relation kept may name another
    # equal tensor, and later steps must still reach the ranks' uses of their own
    # counterpart. Offered for ever, every later frontier would grow with each layer.
    counterpart_depth: int = 8
    # Tensors a structural frontier (the write-back retry) takes without counting a hop,
    # through ops that only move elements (views, slices, concats, transposes, expands):
    # a rank that writes a result back into a buffer and reads it out again puts several
    # such ops between a value and its use.
    struct_free: int = 96
    # How far back the other operand of such an op may be derived from available tensors
    # (a buffer's untouched part, beside the written slice).
    struct_depth: int = 4
    # The `side` strategy: a use of a frontier tensor whose other operand is not available yet is taken when
    # that operand is computed from available tensors (rank inputs among them) and
    # constants by at most this many ops, which come along: a mask a rank builds from its
    # labels for each micro-batch, beside the losses it masks.
    side_depth: int = 3
    # How many such ops after a step's leaves a write-back (a concat holding a slice of a
    # tensor of its own shape) is looked for before the structural retry is tried.
    write_back_hops: int = 3

    # -- facts about parts of rank inputs (refine.ir.layout: a replicated slice of fused weights) --
    # Uses after a fact's leaves where a slice may cut out what the facts cover, and so be
    # equal as a whole tensor on two ranks (refine.prove.walk.join_fact_consequences).
    fact_depth: int = 10

    # -- copies (refine.prove.copies: defines that copy a weight's heads) --
    # Uses after a copied weight that the search for its forms follows: the copy matters
    # where the ranks read it, within an attention block.
    copy_region_depth: int = 16
    # Definitions back, outside that region, that a proof of a copy's form takes (the
    # broadcasts of a positional table the region reads).
    copy_outside: int = 3
    # Rule iterations of a copy's proof (not 0, which Engine.step reads as `iterations`).
    copy_iterations: int = 12
    # Dims with more unit slices than this over all ranks are not searched for copies:
    # the search is per unit.
    copy_max_units: int = 4096
    # A tensor with more copied units than this along its best dim is left alone: a copy
    # is said in blocks (a head), and proving hundreds of columns one by one costs minutes.
    max_copies: int = 32

    # -- expectations (refine.check) --
    # Uses after an output's relation, and definitions back from the expected rank
    # outputs, that the expectation's step holds: the ranks assemble an output from what
    # they computed through communication and layout ops (flatten, reduce, slice).
    expect_hops: int = 8

    # The strategies the walk may run (STRATEGIES): one left out is never tried, so a node
    # that needs it stays unclean.
    strategies: tuple[str, ...] = STRATEGIES

    def uses(self, strategy: str) -> bool:
        return strategy in self.strategies


DEFAULT = Policy()
