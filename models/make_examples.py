"""Generate the example cases in models/: correct distributed programs and buggy twins.

Run `python models/make_examples.py` to rewrite every models/<case>/{seq,dist}.json.
Each bug twin reproduces a real bug pattern; tests/test_examples.py says which node each
one must be localized to.
"""

from __future__ import annotations

from pathlib import Path

from refine.build import GraphBuilder, dist_doc, seq_doc, write_case

HERE = Path(__file__).resolve().parent


def tp_mlp(world: int = 2, bug: str | None = None) -> tuple[dict, dict]:
    """Megatron MLP: column-parallel fc1 (+bias, gelu), row-parallel fc2, all_reduce, bias."""
    T, H, F = 8, 16, 32
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
    return seq_doc(s), dist_doc({"tp": world}, ranks, rel, exp)


CASES = {
    "tp_mlp": lambda: tp_mlp(),
    "tp_mlp_bug_bias_before_sum": lambda: tp_mlp(bug="bias_before_sum"),
    "tp_mlp_bug_missing_all_reduce": lambda: tp_mlp(bug="missing_all_reduce"),
}


def main() -> None:
    for name, make in CASES.items():
        seq, dist = make()
        write_case(HERE / name, seq, dist)


if __name__ == "__main__":
    main()
