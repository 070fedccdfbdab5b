"""FP8 all-to-alls for attention's q, k and v (model.fp8_exchange): half the bytes of bf16.

    q, k, v = fp8_all_to_all((q, k, v), 2, 1, sp)  # inside shard_map: seq -> heads

Forward: the sender scales every (destination block, head) of its [b, s, h, d] shards by that
head's amax over its local tokens (current scaling, no state), sends each float8_e4m3fn array
through its all-to-all and the float32 scales of all of them ([blocks, heads per block] each)
through one more, tiny one; the receiver multiplies each (source, head) block by its scale back
into the compute dtype, before the attention kernel. Per head, not per tensor: heads differ in magnitude (q and k
after their norms and RoPE, v not normed at all), and one outlier head would flatten the others'
resolution.

Backward (custom_vjp, the quantization straight-through): the incoming gradient takes the
inverse all-to-all the same way, in float8_e5m2 (gradients need range more than mantissa) with
per (destination block, head) scales of its own. So both the forward and the backward exchange
of q, k and v move one byte per value. The attention output's exchange and its gradient stay in
the compute dtype: a quarter of the bytes (40% with Llama's grouped-query heads), and the o
projection reads it as it is (quantized there only under model.fp8).

The arithmetic is that of models.fp8 (flax's fp8_ops: scale = amax / the format's largest
value, 1 where amax is zero or not finite; divide, clip, cast), done in float32 so that any
compute dtype (float16 too) dequantizes without underflowing its scale.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .mesh import SEQ

E4M3 = jnp.float8_e4m3fn  # forward: q, k, v (more mantissa)
E5M2 = jnp.float8_e5m2  # backward: their gradients (more range)
# The bytes cross as uint8: a backend without float8 collectives would otherwise widen them
# (XLA's CPU compiler runs an f8 all-to-all as f16, as it runs bf16 ones as f32).
WIRE = jnp.uint8
HEAD_AXIS = 3  # of the blocked [b, s, blocks, h/blocks, d] or [b, blocks, s/blocks, h, d] view


def _blocked(x: jax.Array, axis: int, blocks: int) -> jax.Array:
    """x [b, s, h, d] with `axis` (1 or 2) split into [blocks, size / blocks]: the heads are
    then axis 3 of the view either way."""
    shape = list(x.shape)
    shape[axis:axis + 1] = [blocks, shape[axis] // blocks]
    return x.reshape(shape)


def _broadcast(scale: jax.Array, block_axis: int) -> jax.Array:
    """[blocks, heads] scales shaped to multiply a blocked view (blocks at block_axis)."""
    shape = [1] * 5
    shape[block_axis], shape[HEAD_AXIS] = scale.shape
    return scale.reshape(shape)


def head_scales(xb: jax.Array, block_axis: int, q_dtype) -> jax.Array:
    """[blocks, heads] float32 scales of a blocked view: each (block, head)'s amax over its
    tokens and head_dim, divided by q_dtype's largest value (1 where the amax is 0 or not
    finite)."""
    others = tuple(a for a in range(xb.ndim) if a not in (block_axis, HEAD_AXIS))
    amax = jnp.max(jnp.abs(xb), axis=others).astype(jnp.float32)
    scale = amax / float(jnp.finfo(q_dtype).max)
    return lax.stop_gradient(jnp.where(jnp.isfinite(amax) & (amax > 0), scale, 1.0))


def _exchange(xs, split_axis, concat_axis, axis_size, groups, q_dtype):
    """Quantize each x per (block of split_axis, head) to q_dtype, all-to-all it, its scales
    all in one; dequantize into each x's dtype."""
    a2a = functools.partial(lax.all_to_all, axis_name=SEQ, tiled=True,
                            axis_index_groups=None if groups is None else [list(g) for g in groups])
    limit = float(jnp.finfo(q_dtype).max)
    sent, scales = [], []
    for x in xs:
        xb = _blocked(x, split_axis, axis_size)
        scale = head_scales(xb, split_axis, q_dtype)
        x8 = jnp.clip(xb.astype(jnp.float32) / _broadcast(scale, split_axis), -limit, limit)
        x8 = lax.bitcast_convert_type(x8.astype(q_dtype).reshape(x.shape), WIRE)
        sent.append(a2a(x8, split_axis=split_axis, concat_axis=concat_axis))
        scales.append(scale)
    # row i of the received scales: source i's, for the heads of the blocks it sent here
    received = a2a(jnp.concatenate(scales, axis=1), split_axis=0, concat_axis=0)
    bounds = np.cumsum([s.shape[1] for s in scales])[:-1]
    out = []
    for x, y8, scale in zip(xs, sent, jnp.split(received, bounds, axis=1)):
        yb = _blocked(lax.bitcast_convert_type(y8, q_dtype), concat_axis, axis_size)
        y = yb.astype(jnp.float32) * _broadcast(scale, concat_axis)
        out.append(y.astype(x.dtype).reshape(y8.shape))
    return tuple(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def fp8_all_to_all(xs: tuple[jax.Array, ...], split_axis: int, concat_axis: int,
                   axis_size: int, groups: tuple[tuple[int, ...], ...] | None = None
                   ) -> tuple[jax.Array, ...]:
    """lax.all_to_all(x, 'seq', split_axis, concat_axis, tiled=True) of each [b, s, h, d]
    array of xs (split/concat axes 1 and 2, either way) carried in e4m3 with per-head scales,
    e5m2 for the gradients backward (module docstring). axis_size: the devices of one exchange
    (the seq degree, or the ring's a2a run with `groups`, lax.all_to_all's axis_index_groups)."""
    return _exchange(xs, split_axis, concat_axis, axis_size, groups, E4M3)


def _fwd(xs, split_axis, concat_axis, axis_size, groups):
    return _exchange(xs, split_axis, concat_axis, axis_size, groups, E4M3), None


def _bwd(split_axis, concat_axis, axis_size, groups, _, gs):
    # straight-through: the gradient of dequantize(quantize(x)) taken as the identity's
    return (_exchange(gs, concat_axis, split_axis, axis_size, groups, E5M2),)


fp8_all_to_all.defvjp(_fwd, _bwd)
