"""cuDNN's fused attention kernels, bound below JAX's wrapper: a forward that returns its softmax
statistics, a backward that takes any output and statistics, and vmap by folding.

    out = attention(q, k, v, mask="padding_causal", lengths=(n, n), offsets=(o, o))
    out, stats = forward(q, k, v, mask="causal")           # stats [b, hq, sq] float32
    dq, dk, dv = backward(q, k, v, out, stats, d_out, mask="causal")

q [b, sq, hq, d], k/v [b, sk, hkv, d] (grouped-query heads read in place). mask: "none",
"causal" (query i sees keys j <= i), "padding" / "padding_causal" (row r's first lengths[0][r]
queries and lengths[1][r] keys only; the other queries' outputs are 0, their statistics
undefined) or, with offsets, the packed layout (basp_jax.cudnn.packed_layout's per-row
[b, M] lengths and [b, M + 1] starts; each document attends alone). The statistics are each
query's log-sum-exp of its scaled scores, natural log (STATS), as basp_jax.flash's lse but
[b, hq, sq] where that is [b, sq, hq].

Why not JAX's public `dot_product_attention` (jax._src.cudnn.fused_attention_stablehlo), whose
primitives these are:
- its batching rule reshapes the packed layout's [b, M] lengths as if they were [b] (a step
  vmapped over groups, train.program.per_group, fails); here a custom_vmap folds the mapped
  axis into the batch;
- its custom partitioning requires one mesh per program ("mesh should be the same across the
  entire program"), which the per-host parameter mesh breaks. These kernels run inside
  basp_jax.attention's shard_map, where every axis is manual: they need no partitioning;
- its backward for return_residual drops the statistics' cotangent, so a ring could not run the
  backward of a hop from the merged output and statistics;
- jax 0.10's conversion of the packed offsets strides the key offsets by the query heads (wrong
  for grouped-query attention; 0.11 strides by the kv heads, as `ragged` does here).
The primitives and their parameters are private and differ by version (0.12 adds score_mod
operands and parameters): `FUSED` is None where a jax lacks them, and
tests/basp_jax/test_cudnn_call.py fails when a jax moves them.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp

MASKS = {"none": "NO_MASK", "causal": "CAUSAL", "padding": "PADDING",
         "padding_causal": "PADDING_CAUSAL"}
STATS = "natural log of sum(exp(scale * q.k)) over the keys a query sees"
_INT32_ELEMENTS = 2**31  # the packed layout's offsets count elements of q or k, in int32
_PRIVATE = ("_dot_product_attention_fwd_abstract", "_dot_product_attention_bwd_abstract",
            "_dot_product_attention_fwd_cuda_lowering", "_dot_product_attention_bwd_cuda_lowering",
            "MaskType", "AttentionLayout", "check_is_flash_attention", "check_cudnn_version",
            "_dot_product_attention_fwd_impl")


def jax_cudnn_module(names):
    """JAX's private cuDNN attention module where it has every one of `names`, else None."""
    try:
        module = importlib.import_module("jax._src.cudnn.fused_attention_stablehlo")
    except ImportError:
        return None
    return module if all(hasattr(module, name) for name in names) else None


def _fused_module():
    return jax_cudnn_module(_PRIVATE)


FUSED = _fused_module()
# jax 0.12's primitives take score_mod operands (none here) and two more parameters
_SCORE_MOD = FUSED is not None and "score_mod" in inspect.signature(
    FUSED._dot_product_attention_fwd_impl).parameters


class Call(NamedTuple):
    """What a call is that is not an array."""

    mask: str
    scale: float


def check(q, k, v, *, mask: str, packed: bool, training: bool = True):
    """NotImplementedError or RuntimeError where cuDNN would refuse the call: XLA refused to
    compile cuDNN attention earlier in this process (RefusedAtCompile), or JAX's checks do."""
    raise_if_refused()
    jax_checks(q, k, v, mask=mask, packed=packed, training=training)


def jax_checks(q, k, v, *, mask: str, packed: bool, training: bool = True):
    """JAX's own trace-time checks of the cuDNN kernel (head_dim, GPU generation, cuDNN
    version), and the packed layout's int32 offsets."""
    if FUSED is None:
        raise NotImplementedError(f"jax {jax.__version__} has none of cuDNN's fused attention "
                                  "primitives this kernel binds")
    if mask not in MASKS:
        raise ValueError(f"mask must be one of {', '.join(MASKS)}, not {mask!r}")
    if q.dtype not in (jnp.bfloat16, jnp.float16) or not q.dtype == k.dtype == v.dtype:
        raise NotImplementedError(f"cuDNN's fused attention takes bfloat16 or float16 q, k and "
                                  f"v, not {q.dtype}, {k.dtype}, {v.dtype}")
    if packed and max(q.size, k.size) >= _INT32_ELEMENTS:
        raise NotImplementedError(
            f"cuDNN's packed layout addresses q and k by int32 element offsets, and q {q.shape} "
            f"or k {k.shape} holds 2^31 elements or more")
    version = FUSED.check_cudnn_version()
    FUSED.check_is_flash_attention(q, k, v, FUSED.AttentionLayout.BTNH.value, version, False,
                                   training, packed)


# The custom calls these kernels compile to (XLA's names): a program runs cuDNN attention where
# its text holds one
CUSTOM_CALL_PREFIX = "__cudnn$fmha"


class RefusedAtCompile(NotImplementedError):
    """XLA refused cuDNN attention while compiling an earlier program of this process."""


_COMPILE_REFUSAL: list[str] = []  # XLA's reason, once it refused to compile cuDNN attention


def refuse_for_process(reason: str) -> None:
    """XLA refused to compile cuDNN attention (a kernel its cuDNN cannot build for this GPU, a
    compiler that cannot build it without one): from now on, every program this process traces
    runs the fallback kernel in its place (check raises RefusedAtCompile). The one note is the
    caller's, who caught the refusal."""
    _COMPILE_REFUSAL[:] = [reason]


def compile_refusal() -> str | None:
    """XLA's reason where it refused to compile cuDNN attention in this process, else None."""
    return _COMPILE_REFUSAL[0] if _COMPILE_REFUSAL else None


def allow_again() -> None:
    """Forget a compile-time refusal (refuse_for_process): programs traced next try cuDNN again."""
    _COMPILE_REFUSAL.clear()


def raise_if_refused() -> None:
    """RefusedAtCompile where XLA has refused to compile cuDNN attention in this process."""
    if _COMPILE_REFUSAL:
        raise RefusedAtCompile(f"XLA refused to compile cuDNN attention earlier in this process "
                               f"({_COMPILE_REFUSAL[0]})")


_NOTED: set[str] = set()  # the refusals noted (once each)


def note_refusal(error: Exception, q, then: str, logger: str = __name__) -> None:
    """One logged warning per distinct reason cuDNN refused q while it was traced, saying what
    runs instead (`then`). None for a refusal at compile time: its one note is the compiler's
    caller's."""
    if isinstance(error, RefusedAtCompile):
        return
    reason = " ".join(str(error).split())[:200]
    if reason not in _NOTED:
        _NOTED.add(reason)
        logging.getLogger(logger).warning("cuDNN attention refused q %s %s (%s); %s", q.shape,
                                          q.dtype, reason, then)


def attention(q, k, v, *, mask: str, lengths=None, offsets=None, scale: float | None = None):
    """Attention through cuDNN's kernels, differentiable in q, k and v (module docstring)."""
    call = Call(mask, q.shape[-1] ** -0.5 if scale is None else float(scale))
    return _attention(q, k, v, lengths, offsets, call)


def forward(q, k, v, *, mask: str, lengths=None, offsets=None, scale: float | None = None):
    """(out, stats [b, hq, sq] float32) of one cuDNN forward (not differentiable)."""
    call = Call(mask, q.shape[-1] ** -0.5 if scale is None else float(scale))
    return _mapped(_bind_forward, call, (q, k, v, lengths, offsets))


def backward(q, k, v, out, stats, d_out, *, mask: str, lengths=None, offsets=None,
             scale: float | None = None):
    """(dq, dk, dv) of one cuDNN backward from `out` and `stats` (a larger attention's: a ring
    passes the merged ones) and the output's cotangent."""
    call = Call(mask, q.shape[-1] ** -0.5 if scale is None else float(scale))
    return _mapped(_bind_backward, call, (q, k, v, lengths, offsets, out, stats, d_out))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, lengths, offsets, call: Call):
    return _mapped(_bind_forward, call, (q, k, v, lengths, offsets))[0]


def _attention_fwd(q, k, v, lengths, offsets, call: Call):
    out, stats = _mapped(_bind_forward, call, (q, k, v, lengths, offsets))
    return out, (q, k, v, lengths, offsets, out, stats)


def _attention_bwd(call: Call, residuals, d_out):
    q, k, v, lengths, offsets, out, stats = residuals
    dq, dk, dv = _mapped(_bind_backward, call, (q, k, v, lengths, offsets, out, stats, d_out))
    zero = jax.tree.map(lambda _: None, (lengths, offsets))
    return (dq, dk, dv, *zero)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _mapped(bind, call: Call, args):
    """bind(call, *args) under a custom_vmap that folds a mapped axis into the batch: every
    array here leads with the batch, and cuDNN's kernels take one batch axis."""
    leaves, tree = jax.tree.flatten(args)

    @jax.custom_batching.custom_vmap
    def run(*leaves):
        return bind(call, *jax.tree.unflatten(tree, leaves))

    @run.def_vmap
    def _fold(axis_size, in_batched, *leaves):
        whole = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
                 for x, batched in zip(leaves, in_batched)]
        outs = run(*(x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in whole))
        return (tuple(x.reshape(axis_size, x.shape[0] // axis_size, *x.shape[1:])
                      for x in outs), (True,) * len(outs))

    return run(*leaves)


def ragged(lengths, offsets, q_shape, k_shape):
    """The packed layout's per-row (lengths, offsets) pairs as cuDNN reads them: one list of
    documents over the flattened batch, each start in elements of q or k (token * heads *
    head_dim of its own tensor), unused entries after the used ones (lengths 0, starts one past
    the end). Rows of one document each keep their per-row form, as JAX passes them."""
    (q_len, kv_len), (q_off, kv_off) = lengths, offsets
    if q_off.shape[1] - 1 <= 1:
        return lengths, offsets
    b, t, hq, d = q_shape
    _, s, hkv, _ = k_shape

    def left(x, fill):  # every used (>= 0) entry first, in order, over the flattened batch
        flat = x.reshape(-1)
        index = jnp.nonzero(flat >= 0, size=flat.size, fill_value=flat.size)[0]
        return jnp.take(flat, index, fill_value=fill).reshape(x.shape)

    def starts(off, length, per_token):
        rows = jnp.arange(off.shape[0], dtype=off.dtype)[:, None] * length
        return left(jnp.where(off >= 0, off + rows, off), off.shape[0] * length) * per_token

    return ((left(q_len, 0), left(kv_len, 0)),
            (starts(q_off, t, hq * d), starts(kv_off, s, hkv * d)))


def _operands(q, lengths, offsets, k_shape):
    unused = jnp.zeros(0, q.dtype)
    if offsets is not None:
        lengths, offsets = ragged(lengths, offsets, q.shape, k_shape)
    q_len, kv_len = lengths if lengths is not None else (unused, unused)
    q_off, kv_off = offsets if offsets is not None else (unused, unused)
    return [unused, q_len, kv_len, q_off, kv_off, unused, unused]  # bias .. page tables


def _params(call: Call, **extra) -> dict:
    params = dict(scale=call.scale, seed=0, dropout_rate=0.0, variadic_args=(False, False),
                  mask_type=FUSED.MaskType[MASKS[call.mask]],
                  layout=FUSED.AttentionLayout.BTNH.value, sliding_window_length=None, **extra)
    if _SCORE_MOD:
        params.update(score_mod_name=None, score_mod_jaxpr=None)
    return params


def _own_primitive(name: str, abstract_eval, cuda_lowering):
    """A primitive of our own with JAX's abstract evaluation and CUDA lowering (the cuDNN custom
    call). JAX's own are on its list of primitives whose lowering needs the devices, and a
    program holding one must place every array on one mesh ("mesh should be the same across
    the entire program"): a step whose parameters live on a per-host mesh does not. Their
    lowering reads the operands' types only."""
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    primitive = Primitive(name)
    primitive.multiple_results = True
    # called outside jit: compiled by itself (once per parameters), as JAX runs any primitive
    @functools.lru_cache(maxsize=None)
    def jitted(params):
        return jax.jit(lambda *a: primitive.bind(*a, **dict(params)))

    primitive.def_impl(lambda *args, **params: jitted(tuple(sorted(params.items())))(*args))
    primitive.def_abstract_eval(abstract_eval)
    mlir.register_lowering(primitive, cuda_lowering, platform="cuda")
    return primitive


_PRIMITIVES = None if FUSED is None else (
    _own_primitive("basp_cudnn_attention_fwd", FUSED._dot_product_attention_fwd_abstract,
                   FUSED._dot_product_attention_fwd_cuda_lowering),
    _own_primitive("basp_cudnn_attention_bwd", FUSED._dot_product_attention_bwd_abstract,
                   FUSED._dot_product_attention_bwd_cuda_lowering))


def primitives():
    """(forward, backward): primitives of the cuDNN custom calls (_own_primitive; a CPU test
    replaces them with its own implementation of what the kernels compute:
    tests/helpers/cudnn_emulator)."""
    return _PRIMITIVES


def _bind_forward(call: Call, q, k, v, lengths, offsets):
    """One forward kernel on arguments in the per-row form: (out, stats [b, hq, sq]). Packed,
    cuDNN's statistics are [b * M, hq, sq]: kept whole for the backward, returned as they are."""
    bias, *rest = _operands(q, lengths, offsets, k.shape)
    out, stats = primitives()[0].bind(q, k, v, bias, *rest, **_params(call, is_training=True))
    return out, stats


def _bind_backward(call: Call, q, k, v, lengths, offsets, out, stats, d_out):
    bias, *rest = _operands(q, lengths, offsets, k.shape)
    dq, dk, dv = primitives()[1].bind(q, k, v, bias, *rest, stats, out, d_out,
                                      **_params(call))[:3]
    return dq, dk, dv
