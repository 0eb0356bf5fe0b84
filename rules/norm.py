"""Softmax and normalisation: they act along some dims and commute with a concat on any
other dim. (Normalising over a sharded dim needs a statistics all-reduce; that decomposes.)"""

from __future__ import annotations

import math
from typing import Any

from refine.ir.graph import Arg, TensorType
from refine.ir.lazy import F, torch
from refine.ir.term import Term
from refine.ops.lower import Builder
from refine.ops.registry import ArgSpec, Op, Rule, Sample, ShapeError, rewrite, rule


def _along(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x = ins[0]
    if not 0 <= attrs["dim"] < x.ndim:
        raise ShapeError(f"dim {attrs['dim']} of {list(x.shape)}")
    return x


def _norm_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, *params = ins
    k = attrs["normalized_ndim"]
    if not 1 <= k <= x.ndim:
        raise ShapeError(f"normalising {k} trailing dims of {list(x.shape)}")
    for p in params:
        if p.shape != x.shape[x.ndim - k:]:
            raise ShapeError(f"norm parameter {list(p.shape)} for input {list(x.shape)}")
    return x


def _user_norm_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    ns = tuple(attrs["normalized_shape"])
    x = ins[0]
    if x.shape[x.ndim - len(ns):] != ns:
        raise ShapeError(f"normalized_shape {list(ns)} does not end {list(x.shape)}")
    return _norm_shape(ins, {"normalized_ndim": len(ns)})


def _layer_norm(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    x, *params = args
    ns = tuple(attrs["normalized_shape"])
    w = params[0] if len(params) > 0 and params[0] is not None else b.const(1.0, ns)
    bias = params[1] if len(params) > 1 and params[1] is not None else b.const(0.0, ns)
    return b.emit("layer_norm_c", [x, w, bias], {"normalized_ndim": len(ns), "eps": float(attrs.get("eps", 1e-5))}, out)


def _rms_norm(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
    x, *params = args
    ns = tuple(attrs["normalized_shape"])
    w = params[0] if params and params[0] is not None else b.const(1.0, ns)
    return b.emit("rms_norm_c", [x, w], {"normalized_ndim": len(ns), "eps": float(attrs.get("eps", 1e-6))}, out)


def _stats_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    ns = tuple(attrs["normalized_shape"])
    k = len(ns)
    if not 1 <= k <= x.ndim or x.shape[x.ndim - k:] != ns:
        raise ShapeError(f"normalized_shape {list(ns)} does not end {list(x.shape)}")
    return TensorType(x.shape[:x.ndim - k] + (1,) * k, x.dtype)


def _over_last_dim(core: str):
    """A statistic over the trailing normalized dims, kept: the core op over the last dim,
    with several normalized dims merged into one first (a view keeps a concat on a leading
    dim). The statistic is one core op, not its formula: traced backwards recompute the
    centred input themselves, and the prover follows one rank tensor per value."""

    def decompose(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
        x = args[0]
        assert isinstance(x, str)
        t = b.type(x)
        k = len(attrs["normalized_shape"])
        lead = t.shape[:t.ndim - k]
        flat = b.view(x, lead + (math.prod(t.shape[t.ndim - k:]),))
        at = {"dim": len(lead)} if core == "rmean" else {"eps": float(attrs.get("eps", 1e-5))}
        y = b.emit(core, [flat], at)
        return b.view(y, out.shape)

    return decompose


def _rstd_c_shape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    (x,) = ins
    if x.ndim < 1:
        raise ShapeError("layer_norm_rstd_c of a rank-0 tensor")
    return TensorType(x.shape[:-1] + (1,), x.dtype)


def _rstd_c_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + eps)


def _ln_stat_ref(i: int):
    def ref(x, normalized_shape, eps=1e-5):
        return torch.native_layer_norm(x, list(normalized_shape), None, None, eps)[i]

    return ref


def _softmax_user(core: str):
    def decompose(b: Builder, args: list[Arg], attrs: dict[str, Any], out: TensorType) -> str:
        return b.emit(core, list(args), {"dim": attrs["dim"]}, out)

    return decompose


def _ln_ref(x, w, b, normalized_ndim, eps):
    return F.layer_norm(x, x.shape[x.ndim - normalized_ndim:], w, b, eps)


def _rms_ref(x, w, normalized_ndim, eps):
    dims = tuple(range(x.ndim - normalized_ndim, x.ndim))
    return x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps) * w


NORM_ATTRS = (("normalized_ndim", "int"), ("eps", "float"))
SAME_EGG = "(rule ((= e (OP x ARGS)) (= s (shape x))) ((set (shape e) s)))"

OPS = [
    # fused: blockwise (online-softmax) attention never holds it, only what uses it (rules/lse.py)
    Op("softmax", 1, _along, (("dim", "dim"),), ref=lambda x, dim: torch.softmax(x, dim), core=True,
       egglog_shape=SAME_EGG.replace("OP", "softmax").replace("ARGS", "d"), fuse=True),
    Op("log_softmax", 1, _along, (("dim", "dim"),), ref=lambda x, dim: torch.log_softmax(x, dim),
       core=True, egglog_shape=SAME_EGG.replace("OP", "log_softmax").replace("ARGS", "d")),
    Op("layer_norm_c", 3, _norm_shape, NORM_ATTRS, ref=_ln_ref, core=True,
       egglog_shape=SAME_EGG.replace("OP", "layer_norm_c").replace("ARGS", "w b k eps"),
       doc="layer norm over the trailing normalized_ndim dims, with weight and bias"),
    Op("rms_norm_c", 2, _norm_shape, NORM_ATTRS, ref=_rms_ref, core=True,
       egglog_shape=SAME_EGG.replace("OP", "rms_norm_c").replace("ARGS", "w k eps")),
    Op("layer_norm", -1, _user_norm_shape, (("normalized_shape", "ints"), ("eps", "float?")),
       ref=lambda x, w=None, b=None, normalized_shape=(), eps=1e-5: F.layer_norm(x, normalized_shape, w, b, eps),
       decompose=_layer_norm, doc="args: x[, weight[, bias]]"),
    # native_layer_norm's statistics (outputs 1 and 2), which its decomposed backward reads
    Op("layer_norm_rstd_c", 1, _rstd_c_shape, (("eps", "float"),), ref=_rstd_c_ref, core=True,
       egglog_shape="(rule ((= e (layer_norm_rstd_c x eps)) (= s (shape x))) "
       "((set (shape e) (vec-set s (- (vec-length s) 1) (dim 1)))))",
       doc="1/sqrt(biased variance over the last dim + eps), kept as size 1"),
    Op("layer_norm_mean", 1, _stats_shape, (("normalized_shape", "ints"), ("eps", "float?")),
       ref=_ln_stat_ref(1), decompose=_over_last_dim("rmean"),
       doc="mean over the trailing normalized dims, kept as size 1"),
    Op("layer_norm_rstd", 1, _stats_shape, (("normalized_shape", "ints"), ("eps", "float?")),
       ref=_ln_stat_ref(2), decompose=_over_last_dim("layer_norm_rstd_c"),
       doc="1/sqrt(biased variance + eps) over the trailing normalized dims, kept as size 1"),
    # aten's _softmax / _log_softmax; half_to_float only changes the dtype
    Op("_softmax", 1, _along, (("dim", "dim"), ("half_to_float", "bool?")),
       ref=lambda x, dim, half_to_float=False: torch.softmax(x, dim), decompose=_softmax_user("softmax")),
    Op("_log_softmax", 1, _along, (("dim", "dim"), ("half_to_float", "bool?")),
       ref=lambda x, dim, half_to_float=False: torch.log_softmax(x, dim), decompose=_softmax_user("log_softmax")),
    Op("rms_norm", -1, _user_norm_shape, (("normalized_shape", "ints"), ("eps", "float?")),
       ref=lambda x, w=None, normalized_shape=(), eps=1e-6: _rms_ref(x, w if w is not None else torch.ones(normalized_shape, dtype=x.dtype), len(normalized_shape), eps),
       decompose=_rms_norm, doc="args: x[, weight]"),
]


def RULES(reg: Any) -> list[Rule]:  # noqa: N802 - a rule file's export
    out = []
    for op in ("softmax", "log_softmax"):
        out += [
            rewrite(f"{op}-over-cat", f"({op} (cat a b d) d2)", f"(cat ({op} a d2) ({op} b d2) d)",
                    "(!= d d2)"),
            rewrite(f"slice-into-{op}", f"(slice ({op} x d2) d s e)", f"({op} (slice x d s e) d2)",
                    "(!= d d2)"),
        ]
    # a concat on a dim the norm does not normalise (d < ndim - k) passes through it
    # (the normalized dim itself split: rmean becomes partial sums, rstd has no relation)
    out += [
        rewrite("layer_norm_rstd_c-over-cat", "(layer_norm_rstd_c (cat a b d) eps)",
                "(cat (layer_norm_rstd_c a eps) (layer_norm_rstd_c b eps) d)", "(< d (- (ndim a) 1))"),
        rewrite("slice-into-layer_norm_rstd_c", "(slice (layer_norm_rstd_c x eps) d s e)",
                "(layer_norm_rstd_c (slice x d s e) eps)", "(< d (- (ndim x) 1))"),
    ]
    out += [
        rewrite("layer_norm-over-cat", "(layer_norm_c (cat a b d) w c k eps)",
                "(cat (layer_norm_c a w c k eps) (layer_norm_c b w c k eps) d)",
                "(< d (- (ndim a) k))"),
        rewrite("slice-into-layer_norm", "(slice (layer_norm_c x w c k eps) d s e)",
                "(layer_norm_c (slice x d s e) w c k eps)", "(< d (- (ndim x) k))"),
        rewrite("rms_norm-over-cat", "(rms_norm_c (cat a b d) w k eps)",
                "(cat (rms_norm_c a w k eps) (rms_norm_c b w k eps) d)", "(< d (- (ndim a) k))"),
        rewrite("slice-into-rms_norm", "(slice (rms_norm_c x w k eps) d s e)",
                "(rms_norm_c (slice x d s e) w k eps)", "(< d (- (ndim x) k))"),
    ]
    # the converse, kept to norms that exist (no slice term is made): rows of a norm are the
    # norm of those rows. A sequence laid out in permuted chunks (head-tail context
    # parallelism) relates the sequential norm to a concat of slices of the ranks' inputs,
    # whose norms the ranks hold only whole.
    out += [
        rule("layer_norm-of-slice-existing", ["(= e (layer_norm_c (slice x d s f) w c k eps))",
                                              "(= u (layer_norm_c x w c k eps))", "(< d (- (ndim x) k))"],
             ["(union e (slice u d s f))"]),
        rule("rms_norm-of-slice-existing", ["(= e (rms_norm_c (slice x d s f) w k eps))",
                                            "(= u (rms_norm_c x w k eps))", "(< d (- (ndim x) k))"],
             ["(union e (slice u d s f))"]),
        rule("layer_norm_rstd_c-of-slice-existing", ["(= e (layer_norm_rstd_c (slice x d s f) eps))",
                                                     "(= u (layer_norm_rstd_c x eps))", "(< d (- (ndim x) 1))"],
             ["(union e (slice u d s f))"]),
    ]
    return out


# The soundness harness's seeds: a dim to normalise over; norms over 1 or all trailing dims
def _over_dim(gen: Any, x: tuple[int, ...]) -> tuple[list[ArgSpec], tuple[Any, ...]]:
    return [(x, "f", 0)], (gen.rng.randrange(len(x)),)


def _norm(name: str) -> Any:
    def args(gen: Any, x: tuple[int, ...]) -> tuple[list[ArgSpec], tuple[Any, ...]]:
        k = gen.rng.choice([1, 1, len(x)])
        w = x[len(x) - k:]
        specs = [(x, "f", 0), (w, "f", 0)] + ([(w, "f", 0)] if name == "layer_norm_c" else [])
        return specs, (k, 1e-5)

    return args


SAMPLES = {
    "softmax": Sample(_over_dim, count=2),
    "log_softmax": Sample(_over_dim, count=2),
    "layer_norm_c": Sample(_norm("layer_norm_c"), count=3),
    "rms_norm_c": Sample(_norm("rms_norm_c"), count=3),
    "layer_norm_rstd_c": Sample(lambda gen, x: ([(x, "f", 0)], (gen.rng.choice([1e-5, 0.5]),)), count=2),
}


def SHARED_SEEDS(gen: Any) -> list[Term]:  # noqa: N802 - a rule file's export
    """Layer and RMS norms over a concat of rows, and rows sliced from them."""
    out: list[Term] = []
    for _ in range(gen.instances):
        for op, n_params in (("layer_norm_c", 2), ("rms_norm_c", 1)):
            c = Term("cat", (gen.leaf((1, 3)), gen.leaf((2, 3))), (0,))
            params = tuple(gen.leaf((3,)) for _ in range(n_params))
            out.append(Term(op, (c, *params), (1, 1e-5)))
            out.append(Term("slice", (Term(op, (gen.leaf((3, 3)), *params), (1, 1e-5)),), (0, 1, 3)))
            x = gen.leaf((3, 3))  # a norm of some rows next to the norm of all (one term)
            out.append(Term("cat", (Term(op, (x, *params), (1, 1e-5)),
                                    Term(op, (Term("slice", (x,), (0, 1, 3)), *params), (1, 1e-5))), (0,)))
        x = gen.leaf((3, 3))
        out.append(Term("cat", (Term("layer_norm_rstd_c", (x,), (1e-5,)),
                                Term("layer_norm_rstd_c", (Term("slice", (x,), (0, 0, 2)),), (1e-5,))), (0,)))
    return out
