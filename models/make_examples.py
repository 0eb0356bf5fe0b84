"""Generate the example cases in models/: correct distributed programs and buggy twins.

Run `python models/make_examples.py` to rewrite every models/<case>/{seq,dist}.json.
Each bug twin reproduces a real bug pattern; tests/cases/test_examples.py says which node each
one must be localized to.
"""

from __future__ import annotations

from pathlib import Path

from refine.frontends.build import GraphBuilder, dist_doc, seq_doc, write_case
from refine.ir import sizes

HERE = Path(__file__).resolve().parent


def tp_mlp(world: int = 2, bug: str | None = None, symbolic: bool = False) -> tuple[dict, dict]:
    """Megatron MLP: column-parallel fc1 (+bias, gelu), row-parallel fc2, all_reduce, bias.
    `symbolic`: any number of tokens T and any hidden sizes H, F (F divisible by the ranks)."""
    T, H, F = 8, 16, 32
    if symbolic:
        T, H, F = sizes.sym("T"), sizes.sym("H"), sizes.sym("F", multiple=world)
    s = GraphBuilder()
    x = s.input("x", [T, H])
    w1 = s.input("w1", [H, F], role="parameter")
    b1 = s.input("b1", [F], role="parameter")
    w2 = s.input("w2", [F, H], role="parameter")
    b2 = s.input("b2", [H], role="parameter")
    h = s.op("matmul", x, w1, name="fc1")
    h = s.op("add", h, b1, name="fc1_bias")
    g = s.op("gelu", h, name="act", approximate="none")
    y = s.op("matmul", g, w2, name="fc2")
    y = s.op("add", y, b2, name="fc2_bias")
    s.output("y", y)

    ranks = {}
    for r in range(world):
        d = GraphBuilder()
        x_ = d.input("x", [T, H])
        w1_ = d.input("w1", [H, F // world], role="parameter")
        b1_ = d.input("b1", [F // world], role="parameter")
        w2_ = d.input("w2", [F // world, H], role="parameter")
        b2_ = d.input("b2", [H], role="parameter")
        h = d.op("matmul", x_, w1_, name="fc1")
        h = d.op("add", h, b1_, name="fc1_bias")
        g = d.op("gelu", h, name="act", approximate="none")
        p = d.op("matmul", g, w2_, name="fc2")
        if bug == "bias_before_sum":
            p = d.op("add", p, b2_, name="fc2_bias")
            y = d.op("all_reduce", p, name="fc2_sum", reduce_op="sum", group=list(range(world)))
        elif bug == "missing_all_reduce":
            y = d.op("add", p, b2_, name="fc2_bias")
        elif bug == "double_all_reduce":
            # the row-parallel layer reduces, and so does its caller: the sum is summed again
            y = d.op("all_reduce", p, name="fc2_sum", reduce_op="sum", group=list(range(world)))
            y = d.op("all_reduce", y, name="fc2_sum_again", reduce_op="sum", group=list(range(world)))
            y = d.op("add", y, b2_, name="fc2_bias")
        else:
            y = d.op("all_reduce", p, name="fc2_sum", reduce_op="sum", group=list(range(world)))
            y = d.op("add", y, b2_, name="fc2_bias")
        d.output("y", y)
        ranks[r] = d
    rel = [
        {"from": "x", "placements": ["Replicate"]},
        {"from": "w1", "placements": ["Shard(1)"]},
        {"from": "b1", "placements": ["Shard(0)"]},
        {"from": "w2", "placements": ["Shard(0)"]},
        {"from": "b2", "placements": ["Replicate"]},
    ]
    exp = [{"output": "y", "placements": ["Replicate"]}]
    return seq_doc(s, [T, H, F]), dist_doc({"tp": world}, ranks, rel, exp)


def sp_mlp(world: int = 2, bug: str | None = None, symbolic: bool = False) -> tuple[dict, dict]:
    """Megatron sequence-parallel MLP: x sharded by tokens, layer_norm on the shards,
    all_gather(dim 0), column-parallel fc1 (+bias, gelu), row-parallel fc2,
    reduce_scatter(dim 0), then the replicated bias on the token shard.
    `symbolic`: any number of tokens divisible by the ranks, any hidden size."""
    T, H, F = 8, 16, 32
    if symbolic:
        T, H = sizes.sym("T", multiple=world), sizes.sym("H")
    s = GraphBuilder()
    x = s.input("x", [T, H])
    ln_w = s.input("ln_w", [H], role="parameter")
    ln_b = s.input("ln_b", [H], role="parameter")
    w1 = s.input("w1", [H, F], role="parameter")
    b1 = s.input("b1", [F], role="parameter")
    w2 = s.input("w2", [F, H], role="parameter")
    b2 = s.input("b2", [H], role="parameter")
    n = s.op("layer_norm", x, ln_w, ln_b, name="ln", normalized_shape=[H])
    h = s.op("matmul", n, w1, name="fc1")
    h = s.op("add", h, b1, name="fc1_bias")
    g = s.op("gelu", h, name="act", approximate="none")
    y = s.op("matmul", g, w2, name="fc2")
    y = s.op("add", y, b2, name="fc2_bias")
    s.output("y", y)

    group = list(range(world))
    ranks = {}
    for r in range(world):
        d = GraphBuilder()
        x_ = d.input("x", [T // world, H])
        ln_w_ = d.input("ln_w", [H], role="parameter")
        ln_b_ = d.input("ln_b", [H], role="parameter")
        w1_ = d.input("w1", [H, F // world], role="parameter")
        b1_ = d.input("b1", [F // world], role="parameter")
        w2_ = d.input("w2", [F // world, H], role="parameter")
        b2_ = d.input("b2", [H], role="parameter")
        n = d.op("layer_norm", x_, ln_w_, ln_b_, name="ln", normalized_shape=[H])
        if bug == "gather_wrong_order":
            # the gather's group lists the ranks in another order than the reduce_scatter's
            n = d.op("all_gather", n, name="sp_gather", dim=0, group=group[::-1])
        elif bug == "gather_wrong_dim":
            # gathered along the hidden dim, then viewed back as [T, H]: tokens interleave
            n = d.op("all_gather", n, name="sp_gather", dim=1, group=group)
            n = d.op("reshape", n, name="sp_gather_view", shape=[T, H])
        else:
            n = d.op("all_gather", n, name="sp_gather", dim=0, group=group)
        h = d.op("matmul", n, w1_, name="fc1")
        h = d.op("add", h, b1_, name="fc1_bias")
        g = d.op("gelu", h, name="act", approximate="none")
        p = d.op("matmul", g, w2_, name="fc2")
        if bug == "bias_before_reduce_scatter":
            p = d.op("add", p, b2_, name="fc2_bias")
            y = d.op("reduce_scatter", p, name="sp_scatter", dim=0, reduce_op="sum", group=group)
        else:
            y = d.op("reduce_scatter", p, name="sp_scatter", dim=0, reduce_op="sum", group=group)
            y = d.op("add", y, b2_, name="fc2_bias")
        d.output("y", y)
        ranks[r] = d
    rel = [
        {"from": "x", "placements": ["Shard(0)"]},
        {"from": "ln_w", "placements": ["Replicate"]},
        {"from": "ln_b", "placements": ["Replicate"]},
        {"from": "w1", "placements": ["Shard(1)"]},
        {"from": "b1", "placements": ["Shard(0)"]},
        {"from": "w2", "placements": ["Shard(0)"]},
        {"from": "b2", "placements": ["Replicate"]},
    ]
    exp = [{"output": "y", "placements": ["Shard(0)"]}]
    return seq_doc(s, [T, H, F]), dist_doc({"tp": world}, ranks, rel, exp)


def tp_attention(world: int = 2, bug: str | None = None, symbolic: bool = False) -> tuple[dict, dict]:
    """Self-attention with the heads split across ranks: column-parallel q/k/v projections,
    per-head softmax(q k^T * scale) v, row-parallel output projection, all_reduce, bias.
    `symbolic`: any number of tokens T (heads and head size stay concrete)."""
    T, NH, HD = 8, 4, 4
    if symbolic:
        T = sizes.sym("T")
    H = NH * HD
    nh = NH // world
    scale = HD ** -0.5  # 0.5: exact
    s = GraphBuilder()
    x = s.input("x", [T, H])
    wq = s.input("wq", [H, H], role="parameter")
    wk = s.input("wk", [H, H], role="parameter")
    wv = s.input("wv", [H, H], role="parameter")
    wo = s.input("wo", [H, H], role="parameter")
    bo = s.input("bo", [H], role="parameter")

    def attention(g: GraphBuilder, x: str, wq: str, wk: str, wv: str, heads: int) -> str:
        q = g.op("matmul", x, wq, name="q_proj")
        k = g.op("matmul", x, wk, name="k_proj")
        v = g.op("matmul", x, wv, name="v_proj")
        q = g.op("transpose", g.op("reshape", q, name="q_heads", shape=[T, heads, HD]), name="q_t", dim0=0, dim1=1)
        k = g.op("transpose", g.op("reshape", k, name="k_heads", shape=[T, heads, HD]), name="k_t", dim0=0, dim1=1)
        v = g.op("transpose", g.op("reshape", v, name="v_heads", shape=[T, heads, HD]), name="v_t", dim0=0, dim1=1)
        kt = g.op("transpose", k, name="k_tt", dim0=1, dim1=2)
        a = g.op("matmul", q, kt, name="scores")
        a = g.op("mul", a, scale, name="scaled")
        p = g.op("softmax", a, name="probs", dim=-1)
        o = g.op("matmul", p, v, name="attn")
        o = g.op("transpose", o, name="attn_t", dim0=0, dim1=1)
        return g.op("reshape", o, name="merge_heads", shape=[T, heads * HD])

    o = attention(s, x, wq, wk, wv, NH)
    y = s.op("matmul", o, wo, name="out_proj")
    y = s.op("add", y, bo, name="out_bias")
    s.output("y", y)

    group = list(range(world))
    ranks = {}
    for r in range(world):
        d = GraphBuilder()
        x_ = d.input("x", [T, H])
        wq_ = d.input("wq", [H, H // world], role="parameter")
        wk_ = d.input("wk", [H, H // world], role="parameter")
        wv_ = d.input("wv", [H, H // world], role="parameter")
        wo_ = d.input("wo", [H // world, H], role="parameter")
        bo_ = d.input("bo", [H], role="parameter")
        if bug == "reduce_replicated_input":
            # Megatron's f/g swapped: the input is all-reduced (forward of g) instead of
            # copied (forward of f), so every rank sees world * x
            x_ = d.op("all_reduce", x_, name="x_sum", reduce_op="sum", group=group)
        o = attention(d, x_, wq_, wk_, wv_, nh)
        p = d.op("matmul", o, wo_, name="out_proj")
        if bug == "missing_all_reduce":
            y = d.op("add", p, bo_, name="out_bias")
        elif bug == "bias_before_sum":
            p = d.op("add", p, bo_, name="out_bias")
            y = d.op("all_reduce", p, name="out_sum", reduce_op="sum", group=group)
        else:
            y = d.op("all_reduce", p, name="out_sum", reduce_op="sum", group=group)
            y = d.op("add", y, bo_, name="out_bias")
        d.output("y", y)
        ranks[r] = d
    rel = [
        {"from": "x", "placements": ["Replicate"]},
        {"from": "wq", "placements": ["Shard(1)"]},
        {"from": "wk", "placements": ["Shard(1)"]},
        {"from": "wv", "placements": ["Shard(1)"]},
        {"from": "wo", "placements": ["Shard(0)"]},
        {"from": "bo", "placements": ["Replicate"]},
    ]
    exp = [{"output": "y", "placements": ["Replicate"]}]
    return seq_doc(s, [T]), dist_doc({"tp": world}, ranks, rel, exp)


def vocab_embedding(world: int = 2, bug: str | None = None) -> tuple[dict, dict]:
    """Megatron VocabParallelEmbedding: the token table is sharded by rows; each rank looks
    up the ids in its range (shifted to local rows), zeroes the others, and the ranks' rows
    are summed. Then the replicated position embedding is added."""
    V, H, T = 32, 8, 6
    n = V // world
    s = GraphBuilder()
    ids = s.input("ids", [T], dtype="int64")
    pos = s.input("pos", [T], dtype="int64")
    wte = s.input("wte", [V, H], role="parameter")
    wpe = s.input("wpe", [T, H], role="parameter")
    e = s.op("embedding", wte, ids, name="tok_embed")
    p = s.op("embedding", wpe, pos, name="pos_embed")
    h = s.op("add", e, p, name="embed_sum")
    s.output("h", h)

    group = list(range(world))
    ranks = {}
    for r in range(world):
        d = GraphBuilder()
        ids_ = d.input("ids", [T], dtype="int64")
        pos_ = d.input("pos", [T], dtype="int64")
        wte_ = d.input("wte", [n, H], role="parameter")
        wpe_ = d.input("wpe", [T, H], role="parameter")
        start = (r + 1) % world * n if bug == "wrong_offset" else r * n
        end = start + n
        below = d.op("lt", ids_, start, name="below")
        above = d.op("ge", ids_, end, name="above")
        mask = d.op("logical_or", below, above, name="mask")
        local = d.op("sub", ids_, start, name="local_ids")
        local = d.op("masked_fill", local, mask, name="local_ids_masked", value=0)
        e = d.op("embedding", wte_, local, name="tok_embed")
        if bug != "missing_output_mask":
            m = d.op("unsqueeze", mask, name="mask_col", dim=-1)
            e = d.op("masked_fill", e, m, name="tok_embed_masked", value=0.0)
        if bug != "missing_all_reduce":
            e = d.op("all_reduce", e, name="tok_embed_sum", reduce_op="sum", group=group)
        p = d.op("embedding", wpe_, pos_, name="pos_embed")
        h = d.op("add", e, p, name="embed_sum")
        d.output("h", h)
        ranks[r] = d
    rel = [
        {"from": "ids", "placements": ["Replicate"]},
        {"from": "pos", "placements": ["Replicate"]},
        {"from": "wte", "placements": ["Shard(0)"]},
        {"from": "wpe", "placements": ["Replicate"]},
    ]
    exp = [{"output": "h", "placements": ["Replicate"]}]
    return seq_doc(s), dist_doc({"tp": world}, ranks, rel, exp)


CASES = {
    "tp_mlp": lambda: tp_mlp(),
    "tp_mlp_bug_bias_before_sum": lambda: tp_mlp(bug="bias_before_sum"),
    "tp_mlp_bug_missing_all_reduce": lambda: tp_mlp(bug="missing_all_reduce"),
    "tp_mlp_bug_double_all_reduce": lambda: tp_mlp(bug="double_all_reduce"),
    "tp_mlp_symbolic": lambda: tp_mlp(symbolic=True),
    "tp_mlp_symbolic_bug_bias_before_sum": lambda: tp_mlp(bug="bias_before_sum", symbolic=True),
    "sp_mlp": lambda: sp_mlp(),
    "sp_mlp_4ranks": lambda: sp_mlp(world=4),
    "sp_mlp_bug_gather_wrong_order": lambda: sp_mlp(bug="gather_wrong_order"),
    "sp_mlp_bug_gather_wrong_dim": lambda: sp_mlp(bug="gather_wrong_dim"),
    "sp_mlp_bug_bias_before_reduce_scatter": lambda: sp_mlp(bug="bias_before_reduce_scatter"),
    "sp_mlp_symbolic": lambda: sp_mlp(symbolic=True),
    "sp_mlp_symbolic_bug_gather_wrong_dim": lambda: sp_mlp(bug="gather_wrong_dim", symbolic=True),
    "sp_mlp_symbolic_bug_bias_before_reduce_scatter": lambda: sp_mlp(bug="bias_before_reduce_scatter", symbolic=True),
    "tp_attention": lambda: tp_attention(),
    "tp_attention_4ranks": lambda: tp_attention(world=4),
    "tp_attention_symbolic": lambda: tp_attention(symbolic=True),
    "tp_attention_bug_missing_all_reduce": lambda: tp_attention(bug="missing_all_reduce"),
    "tp_attention_bug_reduce_replicated_input": lambda: tp_attention(bug="reduce_replicated_input"),
    "tp_attention_bug_bias_before_sum": lambda: tp_attention(bug="bias_before_sum"),
    "vocab_embedding": lambda: vocab_embedding(),
    "vocab_embedding_4ranks": lambda: vocab_embedding(world=4),
    "vocab_embedding_bug_missing_output_mask": lambda: vocab_embedding(bug="missing_output_mask"),
    "vocab_embedding_bug_wrong_offset": lambda: vocab_embedding(bug="wrong_offset"),
    "vocab_embedding_bug_missing_all_reduce": lambda: vocab_embedding(bug="missing_all_reduce"),
}


def main() -> None:
    for name, make in CASES.items():
        seq, dist = make()
        write_case(HERE / name, seq, dist)


if __name__ == "__main__":
    main()
