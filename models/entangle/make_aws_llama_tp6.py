"""Write relations/aws_llama_tp6.json: the zero-padded shards of AWS transformers-neuronx
Llama-3 at TP6, as layouts (the sequential weight over the ranks' real parts) and defines
(each rank's weight in full over the sequential one: real parts, copies, zero padding).

The facts, checked against the dumps' placeholder shapes (tp1 against tp6, every layer):
the fused QKV weight [hidden, q | k | v] holds on each rank `ceil(heads / n)` query heads
(the query heads padded to that many per rank, the last rank's extra heads zero) and, for
each local query head, a copy of its KV head (`h // (heads / kv_heads)`; zero for a padded
head), so every rank's k and v have as many heads as its q; the output projection
[hidden, heads * head_dim] is split along dim 1 the same way as q (padding zero); the MLP
weights [hidden, inter] along dim 1 in `ceil(inter / n)` columns per rank, padding zero.
The sizes are data here and in the file, never in a rule.

    python models/entangle/make_aws_llama_tp6.py   # rewrites relations/aws_llama_tp6.json
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Llama-3 as the corpus dumps it (README of the corpus: q 2048, k 512, v 512 columns)
HIDDEN, HEAD_DIM, HEADS, KV_HEADS, INTER, VOCAB, N = 2048, 64, 32, 8, 8192, 128256, 6

SEQ, LOCAL = "{seq}", "{local}"  # placeholder names, filled in by the importer per layer


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _slice(x: str, dim: int, start: int, end: int, whole: int | None = None) -> str:
    """x's [start, end) along dim; x itself when that is all of it (`whole` columns)."""
    return x if start == 0 and end == whole else f"slice({x}, {dim}, {start}, {end})"


def _cat(parts: list[str], dim: int) -> str:
    return parts[0] if len(parts) == 1 else f"cat({', '.join(parts)}, dim={dim})"


def _runs(cols: list[int | None], rows: int, dim: int) -> list[str]:
    """Pieces of a rank weight, column block by block (`None`: a zero block), adjacent
    sequential blocks and zero blocks merged: slices of the sequential weight and zeros."""
    out: list[str] = []
    k = 0
    while k < len(cols):
        s = cols[k]
        m = k + 1
        while m < len(cols) and ((s is None and cols[m] is None) or
                                 (s is not None and cols[m] is not None and cols[m] == s + (m - k) * HEAD_DIM)):
            m += 1
        width = (m - k) * HEAD_DIM
        out.append(f"zeros([{rows}, {width}])" if s is None else _slice(SEQ, dim, s, s + width))
        k = m
    return out


def qkv(n: int) -> tuple[str, list[str]]:
    """The fused QKV weight's layout (each sequential head read from its first holder) and
    every rank's define."""
    per = _ceil(HEADS, n)  # query heads per rank, padded
    group = HEADS // KV_HEADS  # query heads per KV head
    q_cols, kv_cols = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    local = per * HEAD_DIM  # columns of each of q, k, v on a rank
    # the layout: q from every rank (its real heads), each KV head from its first holder
    q = [_slice(f"{LOCAL}@{r}", 1, 0, min(per, HEADS - r * per) * HEAD_DIM) for r in range(n) if r * per < HEADS]
    parts = [_cat(q, 1)]
    for off in (local, 2 * local):  # k, then v
        heads = []
        for h in range(KV_HEADS):
            g = h * group  # its first query head
            r, j = divmod(g, per)
            heads.append(_slice(f"{LOCAL}@{r}", 1, off + j * HEAD_DIM, off + (j + 1) * HEAD_DIM))
        parts.append(_cat(heads, 1))
    layout = _cat(parts, 1)
    defines = []
    for r in range(n):
        gs = [r * per + j for j in range(per)]
        qc = [g * HEAD_DIM if g < HEADS else None for g in gs]
        kc = [q_cols + (g // group) * HEAD_DIM if g < HEADS else None for g in gs]
        vc = [q_cols + kv_cols + (g // group) * HEAD_DIM if g < HEADS else None for g in gs]
        defines.append(_cat(_runs(qc, HIDDEN, 1) + _runs(kc, HIDDEN, 1) + _runs(vc, HIDDEN, 1), 1))
    return layout, defines


def padded_cols(total: int, n: int, rows: int, per: int) -> tuple[str, dict[str, str]]:
    """A weight split along dim 1 in `per` columns per rank (n * per >= total), the extra
    columns zero: its layout and the defines of the padded ranks."""
    layout = _cat([_slice(f"{LOCAL}@{r}", 1, 0, min(per, total - r * per), per) for r in range(n) if r * per < total], 1)
    defines = {}
    for r in range(n):
        real = max(0, min(per, total - r * per))
        if real < per:
            pieces = ([_slice(SEQ, 1, r * per, r * per + real)] if real else []) + [f"zeros([{rows}, {per - real}])"]
            defines[str(r)] = _cat(pieces, 1)
    return layout, defines


def relations(n: int = N) -> dict:
    qkv_layout, qkv_defines = qkv(n)
    # the output projection's input columns are the attention's heads: split like q
    o_layout, o_defines = padded_cols(HEADS * HEAD_DIM, n, HIDDEN, _ceil(HEADS, n) * HEAD_DIM)
    mlp_layout, mlp_defines = padded_cols(INTER, n, HIDDEN, _ceil(INTER, n))
    return {
        "format": "refine-entangle-relations", "version": 1,
        "comment": (f"AWS transformers-neuronx Llama-3 at TP{n}, written by models/entangle/make_aws_llama_tp6.py: "
                    f"{HEADS} query heads padded to {n} x {_ceil(HEADS, n)}, each rank's k and v one copy of the KV "
                    f"head per local query head (zero for padding), the output projection split like q and the MLP "
                    f"weights {INTER} columns padded to {n} x {_ceil(INTER, n)}, padding zero (defines); norms "
                    f"replicated and the logits weight sharded along dim 1 (placed by shape). Output 0 is the logits, "
                    f"sharded over the vocabulary."),
        "inputs": [
            {"shape": [HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM], "layout": qkv_layout,
             "defines": {str(r): d for r, d in enumerate(qkv_defines)}},
            {"shape": [HIDDEN, HEADS * HEAD_DIM], "layout": o_layout, "defines": o_defines},
            {"shape": [HIDDEN, INTER], "layout": mlp_layout, "defines": mlp_defines},
        ],
        "outputs": [{"index": 0, "name": "logits", "role": "activation", "placements": ["Shard(0)"]}],
    }


def main() -> None:
    out = HERE / "relations" / "aws_llama_tp6.json"
    out.write_text(json.dumps(relations(), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
