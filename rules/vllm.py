"""vLLM's custom ops (the `_C` kernels and the attention op), as an inference graph traced
with torch.compile shows them: wrapped in `auto_functionalized(op, **kwargs)`.

`auto_functionalized` returns a tuple: the op's own results first (these ops return
nothing: one `None` slot at index 0), then the new value of every argument the op mutates,
in schema order. So getitem k >= 1 is the k-th mutated argument after the call. Importer
mapping (kwargs by name, as the corpus stores them; the output buffers (`result`, `out`,
`output`) are fully overwritten, so their old values never matter and are dropped):

  _C.rms_norm(result!, input, weight, epsilon)            getitem 1 -> vllm_rms_norm(input, weight, eps)
  _C.fused_add_rms_norm(input!, residual!, weight, epsilon)
        getitem 1 (new input)    -> vllm_fused_add_rms_norm(input, residual, weight, eps)
        getitem 2 (new residual) -> vllm_fused_add_rms_norm_residual(input, residual)
  _C.rotary_embedding(positions, query!, key!, head_size, cos_sin_cache, is_neox)
        getitem 1 -> vllm_rotary_embedding(positions, query, cos_sin_cache, head_size, is_neox)
        getitem 2 -> vllm_rotary_embedding(positions, key, cos_sin_cache, head_size, is_neox)
  _C.silu_and_mul(out!, input)                             getitem 1 -> vllm_silu_and_mul(input)
  vllm.unified_attention_with_output(query, key, value, output!, layer_name)
        getitem 1 -> vllm_attention(query, key, value, scale=head_size ** -0.5)
  vllm.all_reduce(x, group_name)  -> refine's collective `all_reduce` (reduce_op sum) over
        the ranks of the named tensor-parallel group ("tp:0": every rank in the corpus)

Semantics (vLLM's csrc kernels and their torch-native fallbacks, `forward_native`):
- rms_norm: x * rsqrt(mean(x^2, last dim) + eps) * weight.
- fused_add_rms_norm: residual' = input + residual, input' = rms_norm(residual').
- rotary_embedding: cos_sin_cache [max_pos, rot] holds cos | sin halves per position; each
  head's first rot elements are rotated: neox style pairs element i with i + rot/2, GPT-J
  style pairs 2i with 2i+1: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); the rest of the
  head passes through. Query/key are [tokens, heads * head_size] (or [tokens, heads, head_size]).
- silu_and_mul: silu(x[..., :d]) * x[..., d:], d = half the last dim.
- attention: the layer's scale and the batch's sequence boundaries live outside the graph
  (the Attention layer and the forward context). `vllm_attention` is causal attention of
  one sequence holding all the tokens (a prefill with no cached prefix), with grouped-query
  heads (query head h reads kv head h // (heads / kv_heads)); an importer must only map a
  call to it when that holds, and pass the layer's scale (Qwen2: head_size ** -0.5).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from refine.ir import sizes
from refine.ir.graph import Arg, TensorType
from refine.ir.lazy import F, torch
from refine.ops.lower import Builder
from refine.ops.registry import Op, ShapeError

# --- RMS norms


def _rms_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, *rest = ins
    *others, w = rest
    if x.ndim < 1 or w.shape != (x.shape[-1],) or any(o.shape != x.shape for o in others):
        raise ShapeError(f"vllm rms norm of {[list(t.shape) for t in ins]}")
    return x


def _rms_ref(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rms(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    return b.emit("rms_norm_c", list(args), {"normalized_ndim": 1, "eps": float(attrs["eps"])}, out)


def _fused(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    x, res, w = args
    return _rms(b, [b.emit("Sum", [x, res], {}), w], attrs, out)


def _residual_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, res = ins
    if x.shape != res.shape:
        raise ShapeError(f"residual {list(res.shape)} for input {list(x.shape)}")
    return x


# --- silu_and_mul


def _silu_mul_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    if x.ndim < 1 or not sizes.divides(2, x.shape[-1]):
        raise ShapeError(f"silu_and_mul of {list(x.shape)}: the last dim must be even")
    return TensorType(x.shape[:-1] + (sizes.exact_div(x.shape[-1], 2),), x.dtype)


def _silu_mul_ref(x):
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def _silu_mul(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    (x,) = args
    assert isinstance(x, str)
    last, d = len(out.shape) - 1, out.shape[-1]
    gate = b.emit("slice", [x], {"dim": last, "start": 0, "end": d})
    up = b.emit("slice", [x], {"dim": last, "start": d, "end": b.type(x).shape[-1]})
    return b.emit("mul_t", [b.emit("silu_t", [gate], {}), up], {}, out)


# --- rotary embedding


def _heads(x: TensorType, hs: Any) -> tuple[Any, Any]:
    """(tokens, heads) of a [tokens, heads * hs] or [tokens, heads, hs] tensor."""
    if x.ndim == 2 and sizes.divides(hs, x.shape[1]):
        return x.shape[0], sizes.exact_div(x.shape[1], hs)
    if x.ndim == 3 and x.shape[2] == hs:
        return x.shape[0], x.shape[1]
    raise ShapeError(f"rotary embedding of {list(x.shape)} with head_size {hs}")


def _rope_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    pos, x, cache = ins
    hs = attrs["head_size"]
    t, _ = _heads(x, hs)
    rot = cache.shape[1] if cache.ndim == 2 else None
    if pos.shape != (t,) or rot is None or not sizes.divides(2, rot) or not sizes.le(rot, hs):
        raise ShapeError(f"rotary embedding: positions {list(pos.shape)}, cache {list(cache.shape)}, "
                         f"x {list(x.shape)}, head_size {hs}")
    if not pos.dtype.startswith(("int", "uint")):
        raise ShapeError(f"rotary embedding positions of dtype {pos.dtype}")
    return x


def _rope_ref(pos, x, cache, head_size, is_neox):
    t = x.shape[0]
    xs = x.reshape(t, -1, head_size)
    rot = cache.shape[1]
    cos, sin = cache[pos.long()].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    r, rest = xs[..., :rot], xs[..., rot:]
    if is_neox:
        x1, x2 = r.chunk(2, dim=-1)
    else:
        x1, x2 = r[..., 0::2], r[..., 1::2]
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    out = torch.cat((o1, o2), -1) if is_neox else torch.stack((o1, o2), -1).flatten(-2)
    return torch.cat((out, rest), -1).reshape(x.shape)


def _rope(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    pos, x, cache = args
    assert isinstance(x, str) and isinstance(cache, str) and isinstance(pos, str)
    hs = attrs["head_size"]
    t, nh = _heads(b.type(x), hs)
    rot = b.type(cache).shape[1]
    half = sizes.exact_div(rot, 2)
    xs = b.view(x, (t, nh, hs))
    cs = b.emit("embedding", [cache, pos], {})  # [t, rot]: cache rows at the positions

    def along_heads(c: str) -> str:
        return b.broadcast(b.view(c, (t, 1, half)), (t, nh, half))

    cos = along_heads(b.emit("slice", [cs], {"dim": 1, "start": 0, "end": half}))
    sin = along_heads(b.emit("slice", [cs], {"dim": 1, "start": half, "end": rot}))
    r = xs if rot == hs else b.emit("slice", [xs], {"dim": 2, "start": 0, "end": rot})
    if attrs["is_neox"]:
        x1 = b.emit("slice", [r], {"dim": 2, "start": 0, "end": half})
        x2 = b.emit("slice", [r], {"dim": 2, "start": half, "end": rot})
    else:  # interleaved pairs: a view [t, nh, half, 2] and its two columns
        pairs = b.view(r, (t, nh, half, 2))
        x1 = b.view(b.emit("slice", [pairs], {"dim": 3, "start": 0, "end": 1}), (t, nh, half))
        x2 = b.view(b.emit("slice", [pairs], {"dim": 3, "start": 1, "end": 2}), (t, nh, half))
    o1 = b.emit("Sum", [b.emit("mul_t", [x1, cos], {}), b.scale(b.emit("mul_t", [x2, sin], {}), Fraction(-1))], {})
    o2 = b.emit("Sum", [b.emit("mul_t", [x2, cos], {}), b.emit("mul_t", [x1, sin], {})], {})
    if attrs["is_neox"]:
        y = b.emit("cat", [o1, o2], {"dim": 2})
    else:
        y = b.view(b.emit("cat", [b.view(o1, (t, nh, half, 1)), b.view(o2, (t, nh, half, 1))], {"dim": 3}),
                   (t, nh, rot))
    if rot != hs:
        y = b.emit("cat", [y, b.emit("slice", [xs], {"dim": 2, "start": rot, "end": hs})], {"dim": 2})
    return b.view(y, out.shape)


# --- attention


def _attn_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    q, k, v = ins
    if q.ndim != 3 or k.shape != v.shape or k.ndim != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2] \
            or not sizes.divides(k.shape[1], q.shape[1]):
        raise ShapeError(f"attention of q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    return q


def _attn_ref(q, k, v, scale):
    t, nh, _ = q.shape
    g = nh // k.shape[1]
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("thd,shd->hts", q, kk) * scale
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    p = torch.softmax(s.masked_fill(future, -math.inf), dim=-1)
    return torch.einsum("hts,shd->thd", p, vv)


def _attn(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    q, k, v = args
    assert isinstance(q, str) and isinstance(k, str) and isinstance(v, str)
    t, nh, hd = b.type(q).shape
    nkv = b.type(k).shape[1]
    g = sizes.exact_div(nh, nkv)

    def heads_first(x: str, n: Any) -> str:  # [t, n, hd] -> [nh, t, hd], kv heads repeated
        y = b.transpose(x, 0, 1)
        if n == nh:
            return y
        return b.view(b.broadcast(b.view(y, (n, 1, t, hd)), (n, g, t, hd)), (nh, t, hd))

    qh, kh, vh = heads_first(q, nh), heads_first(k, nkv), heads_first(v, nkv)
    s = b.emit("matmul", [qh, b.transpose(kh, 1, 2)], {})  # [nh, t, t]
    s = b.emit("mul_t", [s, b.const(float(attrs["scale"]), (nh, t, t))], {})
    future = b.broadcast(b.emit("causal_mask_c", [], {"n": t}), (nh, t, t), "bool")
    masked = b.emit("masked_fill_t", [s, future], {"value": -math.inf}, TensorType((nh, t, t), out.dtype))
    p = b.emit("softmax", [masked], {"dim": 2})
    return b.transpose(b.emit("matmul", [p, vh], {}), 0, 1)


def _mask_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    return TensorType((attrs["n"], attrs["n"]), "bool")


OPS = [
    # The future positions of causal attention: a clean constant, like `full` and `arange_c`
    # (the prover relates a constant by itself; a mask computed by comparing two ranges
    # would be a non-clean op over constants)
    Op("causal_mask_c", 0, _mask_shape, (("n", "size"),), core=True, clean=True, kind="clean",
       ref=lambda n: torch.ones(n, n, dtype=torch.bool).triu(1),
       egglog_shape="(rule ((= e (causal_mask_c n))) ((set (shape e) (vec-of n n))))",
       doc="[n, n] bool, True where the column (key) is after the row (query)"),
    # corpus: input [32768, 1536] bf16, weight [1536], eps 1e-6
    Op("vllm_rms_norm", 2, _rms_shape, (("eps", "float"),), ref=_rms_ref, decompose=_rms,
       doc="_C.rms_norm: args input, weight"),
    Op("vllm_fused_add_rms_norm", 3, _rms_shape, (("eps", "float"),),
       ref=lambda x, res, w, eps: _rms_ref(x + res, w, eps), decompose=_fused,
       doc="_C.fused_add_rms_norm's new input: rms_norm(input + residual); args input, residual, weight"),
    Op("vllm_fused_add_rms_norm_residual", 2, _residual_shape, ref=lambda x, res: x + res,
       decompose=lambda b, args, attrs, out: b.emit("Sum", list(args), {}, out),
       doc="_C.fused_add_rms_norm's new residual: input + residual"),
    # corpus: positions [32768] int64, query [32768, 384] (3 heads of 128), key [32768, 128],
    # cache [32768, 128], head_size 128, is_neox True
    Op("vllm_rotary_embedding", 3, _rope_shape, (("head_size", "size"), ("is_neox", "bool")), ref=_rope_ref,
       decompose=_rope, doc="_C.rotary_embedding applied to one of query/key; args positions, x, cos_sin_cache"),
    # corpus: input [32768, 4480] -> [32768, 2240]
    Op("vllm_silu_and_mul", 1, _silu_mul_shape, ref=_silu_mul_ref, decompose=_silu_mul,
       doc="_C.silu_and_mul: silu(first half) * second half of the last dim"),
    # corpus: q [32768, 3, 128], k, v [32768, 1, 128]
    Op("vllm_attention", 3, _attn_shape, (("scale", "float"),), ref=_attn_ref, decompose=_attn,
       doc="causal grouped-query attention of one sequence; args q [T, H, D], k, v [T, Hkv, D]"),
]
