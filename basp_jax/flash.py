"""Flash attention in Pallas: Triton on a GPU (sm80+), interpret mode on CPU (tests).

    out, lse = flash_attention_with_lse(q, k, v, causal=True, q_segment_ids=seg, k_segment_ids=seg)
    dq, dk, dv = flash_attention_vjp(q, k, v, out, lse, d_out, causal=True, k_shift=shift)

q [b, sq, hq, d], k/v [b, sk, hkv, d] with hq a multiple of hkv; query head h reads kv head
h // (hq // hkv) where it lies (the kernels' BlockSpecs map it: no copy of k or v per query
head). lse [b, sq, hq] float32, natural log; a query that sees no key gets output 0 and lse -inf.
Key j sits at position k_shift + j relative to query 0 (k_shift may be traced: a ring hop's
offset depends on the device's rank), so chunks of one sequence merge by their log-sum-exp.

Three kernels: the forward (grid: query blocks x batch x query heads) keeps the running max,
sum and output of a query block in registers over the key blocks it can see; the backward is
flash attention 2's: a dq kernel with the same grid, and a dk/dv kernel over key blocks x batch
x kv heads that loops over the group's query heads and the query blocks that see its key block,
so dk and dv sum over the group inside the kernel. Which key blocks a query block can see
(causal order, the shift, and packed documents by each block's smallest and largest segment
id) is worked out before the kernels, as [lo, hi) per block: blocks outside cost nothing.
Inputs of any length are padded to whole blocks (no copy when the lengths are multiples);
half-precision inputs are multiplied in their dtype with float32 accumulation.

Our own kernel, from the structure of jax.experimental.pallas.ops.gpu.attention (JAX's Pallas
example: its loops, fused backward and segment masks), adding grouped-query heads in place,
the log-sum-exp as an output and an input of the backward, a traced key offset, block skipping
for documents, and inputs of any length. tokamax (the kernel library MaxText uses) was read and
not taken: its Triton attention maps grouped heads in place and can return the softmax
residuals, but takes packed documents only as a dense mask, has no key offset of the kind a
ring needs, runs on a GPU only (no interpret mode for CPU tests), and brings pydantic, qwix,
jaxtyping and a pinned typeguard into the install.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# Masked scores: finite, so a row that has seen no key yet keeps exp(m - m_new) = 1 with l = 0
# (no inf - inf); its probabilities are zeroed by the mask itself.
_NEG = -1e30
_MIN_BLOCK = 16  # Triton's dot needs every side >= 16


@dataclasses.dataclass(frozen=True)
class FlashBlocks:
    """Tile sizes: forward query/key blocks, the backward's (both kernels), Triton stages."""

    q: int = 128
    k: int = 128
    q_bwd: int = 64
    k_bwd: int = 64
    num_stages: int = 2

    @classmethod
    def square(cls, size: int) -> "FlashBlocks":
        """Every block `size` (rounded down to a power of two, at least 16): CPU tests."""
        size = max(_MIN_BLOCK, 1 << (max(size, 1).bit_length() - 1))
        return cls(size, size, size, size)


def flash_blocks(shared_memory_per_block: int | None) -> FlashBlocks:
    """Tiles for a GPU by the shared memory one block may take (basp_jax.gpus). Each forward
    pipeline stage holds a k and a v tile (block_k x head_dim, 2 bytes each at bf16; 64 KiB at
    128 x 128), the backward kernels a q and a dO tile besides the resident k/v or q/dO ones.
    H100/H200 (227 KiB): 128 x 128 forward, 64 x 64 backward. A100 (163 KiB): 128 x 64 forward.
    sm86/sm89 cards (99 KiB): 64 x 64 forward, 32 x 32 backward. Unknown: A100's."""
    if shared_memory_per_block is None:
        shared_memory_per_block = 166_912
    if shared_memory_per_block >= 200 * 1024:
        return FlashBlocks(128, 128, 64, 64, num_stages=2)
    if shared_memory_per_block >= 150 * 1024:
        return FlashBlocks(128, 64, 64, 64, num_stages=2)
    return FlashBlocks(64, 64, 32, 32, num_stages=2)


class _Static(NamedTuple):
    causal: bool
    blocks: FlashBlocks
    interpret: bool


def _pow2_at_least(n: int) -> int:
    return max(_MIN_BLOCK, 1 << (n - 1).bit_length())


def _block(size: int, length: int) -> int:
    """The block along a sequence of `length`: `size`, or the smallest power of two >= 16 that
    covers a shorter sequence."""
    return min(size, _pow2_at_least(length))


def _cdiv(a, b):
    return -(-a // b)


class _Plan(NamedTuple):
    """Static sizes of one call: blocks and the padded lengths."""

    bq: int
    bk: int
    bq_bwd: int
    bk_bwd: int
    sq_pad: int
    sk_pad: int
    d_pad: int


def _plan(q_shape, k_shape, blocks: FlashBlocks) -> _Plan:
    sq, d = q_shape[1], q_shape[3]
    sk = k_shape[1]
    if _pow2_at_least(d) > 128:  # tiles of a 256-wide head: half the keys, a quarter backward
        blocks = dataclasses.replace(blocks, k=min(blocks.k, 64), q_bwd=min(blocks.q_bwd, 32),
                                     k_bwd=min(blocks.k_bwd, 32))
    bq, bq_bwd = _block(blocks.q, sq), _block(blocks.q_bwd, sq)
    bk, bk_bwd = _block(blocks.k, sk), _block(blocks.k_bwd, sk)
    sq_pad = _cdiv(sq, max(bq, bq_bwd)) * max(bq, bq_bwd)
    sk_pad = _cdiv(sk, max(bk, bk_bwd)) * max(bk, bk_bwd)
    return _Plan(bq, bk, bq_bwd, bk_bwd, sq_pad, sk_pad, _pow2_at_least(d))


def _pad(x, axis, length, mode="constant"):
    if x.shape[axis] == length:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, pad, mode=mode)


def _pad_heads_dim(x, d_pad):
    return _pad(x, 3, d_pad)


# ----------------------------------------------------------------------------------------------
# Which blocks see which: [lo, hi) per block, computed once per call outside the kernels.


def _block_stats(seg, block):
    b = seg.shape[0]
    s = seg.reshape(b, -1, block)
    return s.min(-1), s.max(-1)


def _segment_range(own_min, own_max, other_min, other_max):
    """[lo, hi) per own block (each [b, n_own]) over the other side's blocks: a superset of the
    blocks that can share a segment with it (exact when segment ids never decrease along the
    sequence, as packing makes them). A block j can only share one if other_max[j] >= own_min
    and other_min[j] <= own_max; prefix and suffix extremes turn both into sorted searches."""
    def one(own_min, own_max, other_min, other_max):
        pre_max = lax.cummax(other_max)  # non-decreasing
        pre_min = lax.cummin(other_min)  # non-increasing
        suf_max = lax.cummax(other_max, reverse=True)  # non-increasing
        suf_min = lax.cummin(other_min, reverse=True)  # non-decreasing
        lo = jnp.maximum(jnp.searchsorted(pre_max, own_min, side="left", method="sort"),
                         jnp.searchsorted(-pre_min, -own_max, side="left", method="sort"))
        hi = jnp.minimum(jnp.searchsorted(-suf_max, -own_min, side="right", method="sort"),
                         jnp.searchsorted(suf_min, own_max, side="right", method="sort"))
        return lo, hi

    lo, hi = jax.vmap(one)(own_min, own_max, other_min, other_max)
    return lo.astype(jnp.int32), hi.astype(jnp.int32)


def _kv_ranges(batch, q_seg, k_seg, shift, *, causal, bq, bk, sq_pad, sk_pad, sk):
    """Key blocks [lo, hi) each query block (of bq) sees: [b, sq_pad / bq] each."""
    nq, nk = sq_pad // bq, sk_pad // bk
    hi = jnp.full((nq,), _cdiv(sk, bk), jnp.int32)
    if causal:
        last = (jnp.arange(nq, dtype=jnp.int32) + 1) * bq - 1 - shift  # last key it may see
        hi = jnp.minimum(hi, jnp.clip(jnp.floor_divide(last, bk) + 1, 0, nk))
    lo = jnp.zeros((batch, nq), jnp.int32)
    hi = jnp.broadcast_to(hi, (batch, nq))
    if q_seg is not None:
        s_lo, s_hi = _segment_range(*_block_stats(q_seg, bq), *_block_stats(k_seg, bk))
        lo, hi = jnp.maximum(lo, s_lo), jnp.minimum(hi, s_hi)
    return lo, jnp.maximum(lo, hi)


def _q_ranges(batch, q_seg, k_seg, shift, *, causal, bq, bk, sq_pad, sk_pad, sq):
    """Query blocks [lo, hi) that see each key block (of bk): [b, sk_pad / bk] each."""
    nq, nk = sq_pad // bq, sk_pad // bk
    lo = jnp.zeros((nk,), jnp.int32)
    if causal:
        first = shift + jnp.arange(nk, dtype=jnp.int32) * bk  # first query that may see it
        lo = jnp.clip(jnp.floor_divide(first, bq), 0, nq)
    lo = jnp.broadcast_to(lo, (batch, nk))
    hi = jnp.full((batch, nk), _cdiv(sq, bq), jnp.int32)
    if q_seg is not None:
        s_lo, s_hi = _segment_range(*_block_stats(k_seg, bk), *_block_stats(q_seg, bq))
        lo, hi = jnp.maximum(lo, s_lo), jnp.minimum(hi, s_hi)
    return lo, jnp.maximum(lo, hi)


# ----------------------------------------------------------------------------------------------
# The kernels. Refs arrive in the order of the pallas_call's inputs, then its outputs.


def triton_dot(a, b, trans_a=False, trans_b=False):
    """a @ b (either transposed) in float32: Triton's tensor-core dot on a GPU."""
    from jax.experimental.pallas import triton as plgpu  # Triton bits: imported when traced

    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b)


def block_scalar(ref):
    return jnp.min(ref[...])  # a (1,) block: reduce to the scalar (Triton loads tensors)


def _mask(q_pos, k_pos, shift, q_len, k_len, causal, q_seg, k_seg):
    mask = (q_pos[:, None] < q_len) & (k_pos[None, :] < k_len)
    if causal:
        mask = mask & (q_pos[:, None] >= shift + k_pos[None, :])
    if q_seg is not None:
        mask = mask & (q_seg[:, None] == k_seg[None, :])
    return mask


def _unpack(refs, has_seg, n_in):
    ins, outs = list(refs[:n_in]), refs[n_in:]
    if has_seg:
        segs = ins[-2:]
        ins = ins[:-2]
    else:
        segs = [None, None]
    return ins, segs, outs


def _forward_kernel(*refs, causal, has_seg, scale, bq, bk, q_len, k_len):
    (q_ref, k_ref, v_ref, shift_ref, lo_ref, hi_ref), (qs_ref, ks_ref), (o_ref, lse_ref) = \
        _unpack(refs, has_seg, 8 if has_seg else 6)
    qi = pl.program_id(0)
    shift = block_scalar(shift_ref)
    q = q_ref[...]
    q_pos = qi * bq + jnp.arange(bq)
    q_seg = None if qs_ref is None else qs_ref[...]
    d = q.shape[-1]

    def body(kj, carry):
        acc, m, l = carry
        ks = pl.ds(kj * bk, bk)
        k = k_ref[ks, :]
        s = triton_dot(q, k, trans_b=True) * scale
        k_seg = None if ks_ref is None else ks_ref[ks]
        mask = _mask(q_pos, kj * bk + jnp.arange(bk), shift, q_len, k_len, causal, q_seg, k_seg)
        s = jnp.where(mask, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=1)
        v = v_ref[ks, :]
        acc = alpha[:, None] * acc + triton_dot(p.astype(v.dtype), v)
        return acc, m_new, l

    init = (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), _NEG, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    lo, hi = block_scalar(lo_ref), block_scalar(hi_ref)
    acc, m, l = lax.fori_loop(lo, hi, body, init)
    seen = l > 0.0
    l_safe = jnp.where(seen, l, 1.0)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)


def _dq_kernel(*refs, causal, has_seg, scale, bq, bk, q_len, k_len):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, shift_ref, lo_ref, hi_ref), \
        (qs_ref, ks_ref), (dq_ref,) = _unpack(refs, has_seg, 11 if has_seg else 9)
    qi = pl.program_id(0)
    shift = block_scalar(shift_ref)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_pos = qi * bq + jnp.arange(bq)
    q_seg = None if qs_ref is None else qs_ref[...]

    def body(kj, dq):
        ks = pl.ds(kj * bk, bk)
        k, v = k_ref[ks, :], v_ref[ks, :]
        s = triton_dot(q, k, trans_b=True) * scale
        k_seg = None if ks_ref is None else ks_ref[ks]
        mask = _mask(q_pos, kj * bk + jnp.arange(bk), shift, q_len, k_len, causal, q_seg, k_seg)
        p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
        dp = triton_dot(do, v, trans_b=True)
        ds = p * (dp - delta[:, None])
        return dq + triton_dot(ds.astype(k.dtype), k)

    lo, hi = block_scalar(lo_ref), block_scalar(hi_ref)
    dq = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, causal, has_seg, scale, bq, bk, q_len, k_len, group, head_dim, sq_pad):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, shift_ref, lo_ref, hi_ref), \
        (qs_ref, ks_ref), (dk_ref, dv_ref) = _unpack(refs, has_seg, 11 if has_seg else 9)
    kj = pl.program_id(0)
    shift = block_scalar(shift_ref)
    k, v = k_ref[...], v_ref[...]
    k_pos = kj * bk + jnp.arange(bk)
    k_seg = None if ks_ref is None else ks_ref[...]
    lo, hi = block_scalar(lo_ref), block_scalar(hi_ref)

    def head(gi, carry):  # the group's query heads: columns gi * head_dim of q and dO
        cols = pl.ds(gi * head_dim, head_dim)

        def body(qi, carry):
            dk, dv = carry
            rows = pl.ds(qi * bq, bq)
            q, do = q_ref[rows, cols], do_ref[rows, cols]
            at = pl.ds(gi * sq_pad + qi * bq, bq)
            lse, delta = lse_ref[at], delta_ref[at]
            s = triton_dot(q, k, trans_b=True) * scale
            q_seg = None if qs_ref is None else qs_ref[rows]
            mask = _mask(qi * bq + jnp.arange(bq), k_pos, shift, q_len, k_len, causal, q_seg,
                         k_seg)
            p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
            dv = dv + triton_dot(p.astype(do.dtype), do, trans_a=True)
            dp = triton_dot(do, v, trans_b=True)
            ds = p * (dp - delta[:, None])
            dk = dk + triton_dot(ds.astype(q.dtype), q, trans_a=True)
            return dk, dv

        return lax.fori_loop(lo, hi, body, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _params(blocks: FlashBlocks, num_warps: int):
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=blocks.num_stages)


# ----------------------------------------------------------------------------------------------
# The calls, on padded inputs: q [b, sq_pad, hq, d_pad], k/v [b, sk_pad, hkv, d_pad], segment
# ids [b, s_pad] int32 or None, shift int32 scalar; lse and delta [b, hq, sq_pad] float32.


def _forward(q, k, v, q_seg, k_seg, shift, plan: _Plan, static: _Static, q_len, k_len, scale):
    b, sq_pad, hq, d = q.shape
    sk_pad, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    bq, bk = plan.bq, plan.bk
    lo, hi = _kv_ranges(b, q_seg, k_seg, shift, causal=static.causal, bq=bq, bk=bk,
                        sq_pad=sq_pad, sk_pad=sk_pad, sk=k_len)
    has_seg = q_seg is not None
    in_specs = [
        pl.BlockSpec((None, bq, None, d), lambda i, j, h: (j, i, h, 0)),
        pl.BlockSpec((None, sk_pad, None, d), lambda i, j, h: (j, 0, h // group, 0)),
        pl.BlockSpec((None, sk_pad, None, d), lambda i, j, h: (j, 0, h // group, 0)),
        pl.BlockSpec((1,), lambda i, j, h: (0,)),
        pl.BlockSpec((None, 1), lambda i, j, h: (j, i)),
        pl.BlockSpec((None, 1), lambda i, j, h: (j, i)),
    ]
    args = [q, k, v, jnp.reshape(shift, (1,)), lo, hi]
    if has_seg:
        in_specs += [pl.BlockSpec((None, bq), lambda i, j, h: (j, i)),
                     pl.BlockSpec((None, sk_pad), lambda i, j, h: (j, 0))]
        args += [q_seg, k_seg]
    kernel = functools.partial(_forward_kernel, causal=static.causal, has_seg=has_seg,
                               scale=scale, bq=bq, bk=bk, q_len=q_len, k_len=k_len)
    return pl.pallas_call(
        kernel,
        grid=(sq_pad // bq, b, hq),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, bq, None, d), lambda i, j, h: (j, i, h, 0)),
                   pl.BlockSpec((None, None, bq), lambda i, j, h: (j, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, hq, sq_pad), jnp.float32)],
        compiler_params=_params(static.blocks, 4 if d <= 64 else 8),
        interpret=static.interpret,
        name="flash_attention_fwd",
    )(*args)


def _backward(q, k, v, q_seg, k_seg, shift, do, lse, delta, plan: _Plan, static: _Static,
              q_len, k_len, scale, wrt: str = "qkv"):
    """(dq, dk, dv); wrt "q": only the dq kernel runs (dk, dv None), "kv": only the dk/dv one
    (dq None)."""
    common = dict(causal=static.causal, has_seg=q_seg is not None, scale=scale,
                  bq=plan.bq_bwd, bk=plan.bk_bwd, q_len=q_len, k_len=k_len)
    args = (q, k, v, q_seg, k_seg, shift, do, lse, delta, plan, static, common)
    dq = _backward_dq(*args) if wrt != "kv" else None
    dk, dv = _backward_dkv(*args) if wrt != "q" else (None, None)
    return dq, dk, dv


def _backward_dims(q, k, plan: _Plan):
    """(batch, padded query length, query heads, head dim, padded key length, kv heads, query
    heads per kv head, query block, key block, warps) of the backward kernels."""
    b, sq_pad, hq, d = q.shape
    sk_pad, hkv = k.shape[1], k.shape[2]
    bq, bk = plan.bq_bwd, plan.bk_bwd
    return b, sq_pad, hq, d, sk_pad, hkv, hq // hkv, bq, bk, 4 if bq * bk < 128 * 128 else 8


def _backward_dq(q, k, v, q_seg, k_seg, shift, do, lse, delta, plan: _Plan, static: _Static,
                 common):
    """dq: grid over query blocks x batch x query heads, like the forward."""
    b, sq_pad, hq, d, sk_pad, hkv, group, bq, bk, warps = _backward_dims(q, k, plan)
    has_seg = q_seg is not None
    shift1 = jnp.reshape(shift, (1,))
    k_len = common["k_len"]
    lo, hi = _kv_ranges(b, q_seg, k_seg, shift, causal=static.causal, bq=bq, bk=bk,
                        sq_pad=sq_pad, sk_pad=sk_pad, sk=k_len)
    q_block = pl.BlockSpec((None, bq, None, d), lambda i, j, h: (j, i, h, 0))
    kv_full = pl.BlockSpec((None, sk_pad, None, d), lambda i, j, h: (j, 0, h // group, 0))
    row = pl.BlockSpec((None, None, bq), lambda i, j, h: (j, h, i))
    one = pl.BlockSpec((None, 1), lambda i, j, h: (j, i))
    in_specs = [q_block, kv_full, kv_full, q_block, row, row,
                pl.BlockSpec((1,), lambda i, j, h: (0,)), one, one]
    args = [q, k, v, do, lse, delta, shift1, lo, hi]
    if has_seg:
        in_specs += [pl.BlockSpec((None, bq), lambda i, j, h: (j, i)),
                     pl.BlockSpec((None, sk_pad), lambda i, j, h: (j, 0))]
        args += [q_seg, k_seg]
    return pl.pallas_call(
        functools.partial(_dq_kernel, **common),
        grid=(sq_pad // bq, b, hq),
        in_specs=in_specs,
        out_specs=q_block,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_params(static.blocks, warps),
        interpret=static.interpret,
        name="flash_attention_dq",
    )(*args)


def _backward_dkv(q, k, v, q_seg, k_seg, shift, do, lse, delta, plan: _Plan, static: _Static,
                  common):
    """dk, dv: grid over key blocks x batch x kv heads; the group's query heads side by side in
    the last axis of q and dO, and their lse/delta rows one after another (free reshapes)."""
    b, sq_pad, hq, d, sk_pad, hkv, group, bq, bk, warps = _backward_dims(q, k, plan)
    has_seg = q_seg is not None
    shift1 = jnp.reshape(shift, (1,))
    q_len = common["q_len"]
    lo, hi = _q_ranges(b, q_seg, k_seg, shift, causal=static.causal, bq=bq, bk=bk,
                       sq_pad=sq_pad, sk_pad=sk_pad, sq=q_len)
    qg, dog = (x.reshape(b, sq_pad, hkv, group * d) for x in (q, do))
    lseg, deltag = (x.reshape(b, hkv, group * sq_pad) for x in (lse, delta))
    q_full = pl.BlockSpec((None, sq_pad, None, group * d), lambda i, j, h: (j, 0, h, 0))
    kv_block = pl.BlockSpec((None, bk, None, d), lambda i, j, h: (j, i, h, 0))
    rows = pl.BlockSpec((None, None, group * sq_pad), lambda i, j, h: (j, h, 0))
    one = pl.BlockSpec((None, 1), lambda i, j, h: (j, i))
    in_specs = [q_full, kv_block, kv_block, q_full, rows, rows,
                pl.BlockSpec((1,), lambda i, j, h: (0,)), one, one]
    args = [qg, k, v, dog, lseg, deltag, shift1, lo, hi]
    if has_seg:
        in_specs += [pl.BlockSpec((None, sq_pad), lambda i, j, h: (j, 0)),
                     pl.BlockSpec((None, bk), lambda i, j, h: (j, i))]
        args += [q_seg, k_seg]
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, **common, group=group, head_dim=d, sq_pad=sq_pad),
        grid=(sk_pad // bk, b, hkv),
        in_specs=in_specs,
        out_specs=[kv_block, kv_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_params(static.blocks, warps),
        interpret=static.interpret,
        name="flash_attention_dkv",
    )(*args)
    return dk, dv


# ----------------------------------------------------------------------------------------------
# Padding to whole blocks, and the differentiable entry points.


def _padded(q, k, v, q_seg, k_seg, plan: _Plan):
    q = _pad_heads_dim(_pad(q, 1, plan.sq_pad), plan.d_pad)
    k, v = (_pad_heads_dim(_pad(x, 1, plan.sk_pad), plan.d_pad) for x in (k, v))
    if q_seg is not None:  # edge values: padded rows and keys are masked by position anyway
        q_seg = _pad(q_seg.astype(jnp.int32), 1, plan.sq_pad, mode="edge")
        k_seg = _pad(k_seg.astype(jnp.int32), 1, plan.sk_pad, mode="edge")
    return q, k, v, q_seg, k_seg


def _rows(x, plan: _Plan):
    """[b, sq, hq] -> the kernels' [b, hq, sq_pad] float32."""
    return _pad(jnp.swapaxes(x.astype(jnp.float32), 1, 2), 2, plan.sq_pad)


def _fwd_impl(q, k, v, q_seg, k_seg, shift, static: _Static):
    plan = _plan(q.shape, k.shape, static.blocks)
    sq, d = q.shape[1], q.shape[3]
    qp, kp, vp, qs, ks = _padded(q, k, v, q_seg, k_seg, plan)
    out, lse = _forward(qp, kp, vp, qs, ks, shift, plan, static, sq, k.shape[1],
                        1.0 / math.sqrt(d))
    return out[:, :sq, :, :d], jnp.swapaxes(lse, 1, 2)[:, :sq]


def _bwd_impl(q, k, v, q_seg, k_seg, shift, out, lse, d_out, d_lse, static: _Static,
              wrt: str = "qkv"):
    plan = _plan(q.shape, k.shape, static.blocks)
    sq, sk, d = q.shape[1], k.shape[1], q.shape[3]
    qp, kp, vp, qs, ks = _padded(q, k, v, q_seg, k_seg, plan)
    # d lse / d score = p, so a cotangent on lse enters like -delta
    delta = jnp.einsum("bshd,bshd->bsh", d_out.astype(jnp.float32), out.astype(jnp.float32))
    if d_lse is not None:
        delta = delta - d_lse
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows that see no key: their mask is empty
    dop = _pad_heads_dim(_pad(d_out.astype(q.dtype), 1, plan.sq_pad), plan.d_pad)
    dq, dk, dv = _backward(qp, kp, vp, qs, ks, shift, dop, _rows(lse, plan), _rows(delta, plan),
                           plan, static, sq, sk, 1.0 / math.sqrt(d), wrt)
    dq = None if dq is None else dq[:, :sq, :, :d]
    if dk is not None:
        dk, dv = dk[:, :sk, :, :d], dv[:, :sk, :, :d]
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, q_seg, k_seg, shift, static: _Static):
    return _fwd_impl(q, k, v, q_seg, k_seg, shift, static)


def _flash_fwd(q, k, v, q_seg, k_seg, shift, static: _Static):
    out, lse = _fwd_impl(q, k, v, q_seg, k_seg, shift, static)
    return (out, lse), (q, k, v, q_seg, k_seg, shift, out, lse)


def _flash_bwd(static: _Static, residuals, cotangents):
    q, k, v, q_seg, k_seg, shift, out, lse = residuals
    d_out, d_lse = cotangents
    dq, dk, dv = _bwd_impl(q, k, v, q_seg, k_seg, shift, out, lse, d_out, d_lse, static)
    return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _check(q, k, v, q_segment_ids, k_segment_ids):
    if q.ndim != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"flash attention takes q [b, sq, hq, d] and k, v [b, sk, hkv, d]; got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of kv heads "
                         f"({k.shape[2]})")
    if (q_segment_ids is None) != (k_segment_ids is None):
        raise ValueError("pass both q_segment_ids and k_segment_ids, or neither")


def flash_attention_with_lse(q, k, v, *, causal: bool, q_segment_ids=None, k_segment_ids=None,
                             k_shift=0, blocks: FlashBlocks | None = None,
                             interpret: bool = False):
    """(out [b, sq, hq, d], lse [b, sq, hq] float32), both differentiable."""
    _check(q, k, v, q_segment_ids, k_segment_ids)
    static = _Static(causal, blocks or FlashBlocks(), interpret)
    shift = jnp.asarray(k_shift, jnp.int32)
    return _flash(q, k, v, q_segment_ids, k_segment_ids, shift, static)


def flash_attention_vjp(q, k, v, out, lse, d_out, *, causal: bool, q_segment_ids=None,
                        k_segment_ids=None, k_shift=0, blocks: FlashBlocks | None = None,
                        interpret: bool = False, wrt: str = "qkv"):
    """(dq, dk, dv) through the keys k, v's share of a larger attention of q whose final output,
    log-sum-exp and output cotangent are out, lse, d_out (as basp_jax.kernels.
    blockwise_attention_vjp: a ring sums these over its chunks). wrt="q" runs only the dq
    kernel (dk, dv are None), wrt="kv" only the dk/dv one (dq is None): a ring that sums dq
    over all its hops before it sums any dk/dv holds one running sum at a time."""
    _check(q, k, v, q_segment_ids, k_segment_ids)
    if wrt not in ("qkv", "q", "kv"):
        raise ValueError(f"wrt must be 'qkv', 'q' or 'kv', not {wrt!r}")
    static = _Static(causal, blocks or FlashBlocks(), interpret)
    shift = jnp.asarray(k_shift, jnp.int32)
    return _bwd_impl(q, k, v, q_segment_ids, k_segment_ids, shift, out, lse, d_out, None, static,
                     wrt)


def flash_attention(q, k, v, *, causal: bool, segment_ids=None, blocks: FlashBlocks | None = None,
                    interpret: bool = False):
    """Self-attention: out [b, s, hq, d]."""
    out, _ = flash_attention_with_lse(q, k, v, causal=causal, q_segment_ids=segment_ids,
                                      k_segment_ids=segment_ids, blocks=blocks,
                                      interpret=interpret)
    return out
