"""Blockwise (flash) attention in pure JAX: O(S x block) memory forward and backward, on every
platform, with packed documents (segment ids), a key offset (a ring's hop) and the log-sum-exp
the ring merges by. The kernel registry (basp_jax.kernels) offers it as "blockwise"; the ring
(basp_jax.ring) calls its forward-with-lse and backward directly.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

DEFAULT_BLOCK = 512  # tokens per query and key block


# ----------------------------------------------------------------------------------------------
# Blockwise (flash) attention.
#
# Layout inside: q as [b, hkv, g, sq, d] (g = hq // hkv query heads per kv head), k/v [b, hkv, sk, d].
# Sequences are padded to a multiple of the block size; padded keys are masked out and padded
# query rows are sliced off. Key positions are shifted by `k_shift` relative to query positions
# (0 for self-attention; a ring step attends to another chunk of the sequence). Masked scores
# are excluded with `where`; a row that sees no key gets output 0 and lse = -inf, and loops only
# visit the key blocks a query block can see, so fully masked (causal-future) chunks cost nothing.


def _block_mask(qi, kj, block_q, block_k, k_len, k_shift, causal, q_seg, k_seg):
    """[b or 1, 1, 1, block_q, block_k] boolean: key valid, causal, same segment."""
    k_local = kj * block_k + jnp.arange(block_k)
    mask = jnp.broadcast_to(k_local[None, :] < k_len, (block_q, block_k))
    if causal:
        q_pos = qi * block_q + jnp.arange(block_q)
        mask = mask & (q_pos[:, None] >= k_shift + k_local[None, :])
    mask = mask[None]
    if q_seg is not None:
        mask = mask & (q_seg[:, :, None] == k_seg[:, None, :])
    return mask[:, None, None]


def _kv_block_end(qi, num_k, block_q, block_k, k_shift, causal):
    """Key blocks [0, end) that query block qi can see."""
    if not causal:
        return num_k
    last_visible = (qi + 1) * block_q - 1 - k_shift  # local index of the last key it may see
    return jnp.clip(last_visible // block_k + 1, 0, num_k)


def _q_block_start(kj, num_q, block_q, block_k, k_shift, causal):
    """First query block that can see key block kj."""
    if not causal:
        return 0
    return jnp.clip((k_shift + kj * block_k) // block_q, 0, num_q)


def segment_overlap(q_seg, k_seg, block_q, block_k):
    """[num_q, num_k] boolean: whether any query of block qi may share a segment with any key of
    block kj in some row, from each block's min and max segment id (disjoint ranges share none).

    Exact for any segment ids; it prunes well when they are non-decreasing along the sequence,
    as packing makes them (documents are contiguous: the data pipeline's cumulative count of
    eos tokens, and each contiguous piece of a zig-zag or ring chunk).
    """
    b = q_seg.shape[0]
    q = q_seg.reshape(b, -1, block_q)
    k = k_seg.reshape(b, -1, block_k)
    q_min, q_max = q.min(-1)[:, :, None], q.max(-1)[:, :, None]
    k_min, k_max = k.min(-1)[:, None, :], k.max(-1)[:, None, :]
    return jnp.any((k_max >= q_min) & (k_min <= q_max), axis=0)


def _first_last(row):
    """[first, last + 1) of the True entries of a boolean vector; [0, 0) when there are none."""
    n = row.shape[0]
    any_ = row.any()
    first = jnp.where(any_, jnp.argmax(row), 0)
    end = jnp.where(any_, n - jnp.argmax(row[::-1]), 0)
    return first, end


def _kv_block_range(qi, num_k, block_q, block_k, k_shift, causal, overlap):
    """Key blocks [start, end) that query block qi can see: causally and, with segment ids, the
    blocks whose segments its own can meet (packed documents: the blocks of its documents)."""
    end = _kv_block_end(qi, num_k, block_q, block_k, k_shift, causal)
    if overlap is None:
        return 0, end
    first, last = _first_last(overlap[qi])
    return first, jnp.minimum(end, last)


def _q_block_range(kj, num_q, block_q, block_k, k_shift, causal, overlap):
    """Query blocks [start, end) that can see key block kj."""
    start = _q_block_start(kj, num_q, block_q, block_k, k_shift, causal)
    if overlap is None:
        return start, num_q
    first, last = _first_last(overlap[:, kj])
    return jnp.maximum(start, first), last


def _slice(x, start, size, axis):
    return lax.dynamic_slice_in_dim(x, start * size, size, axis=axis)


def _scores(q_blk, k_blk, scale):
    return jnp.einsum("bhgqd,bhkd->bhgqk", q_blk, k_blk, preferred_element_type=jnp.float32) * scale


def _flash_forward(q, k, v, q_seg, k_seg, k_shift, *, causal, k_len, block_q, block_k, scale):
    b, hkv, g, sq, d = q.shape
    num_q, num_k = sq // block_q, k.shape[2] // block_k
    overlap = None if q_seg is None else segment_overlap(q_seg, k_seg, block_q, block_k)

    def row(qi):
        q_blk = _slice(q, qi, block_q, 3)
        q_seg_blk = None if q_seg is None else _slice(q_seg, qi, block_q, 1)

        def step(kj, carry):
            acc, m, l = carry
            k_blk, v_blk = _slice(k, kj, block_k, 2), _slice(v, kj, block_k, 2)
            k_seg_blk = None if k_seg is None else _slice(k_seg, kj, block_k, 1)
            mask = _block_mask(qi, kj, block_q, block_k, k_len, k_shift, causal, q_seg_blk, k_seg_blk)
            s = jnp.where(mask, _scores(q_blk, k_blk, scale), -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            # Rows that have seen no key yet keep m = -inf; shift by 0 there to avoid inf - inf.
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.where(mask, jnp.exp(s - shift[..., None]), 0.0)
            alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - shift, -jnp.inf))
            l = alpha * l + p.sum(-1)
            pv = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(v.dtype), v_blk,
                            preferred_element_type=jnp.float32)
            return alpha[..., None] * acc + pv, m_new, l

        init = (
            jnp.zeros((b, hkv, g, block_q, d), jnp.float32),
            jnp.full((b, hkv, g, block_q), -jnp.inf, jnp.float32),
            jnp.zeros((b, hkv, g, block_q), jnp.float32),
        )
        start, end = _kv_block_range(qi, num_k, block_q, block_k, k_shift, causal, overlap)
        acc, m, l = lax.fori_loop(start, jnp.maximum(start, end), step, init)
        seen = l > 0
        out = acc / jnp.where(seen, l, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
        return out.astype(q.dtype), lse

    out, lse = lax.map(row, jnp.arange(num_q))  # [num_q, b, hkv, g, block_q, (d)]
    out = jnp.moveaxis(out, 0, 3).reshape(b, hkv, g, sq, d)
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, hkv, g, sq)
    return out, lse


def _flash_backward(q, k, v, q_seg, k_seg, k_shift, out, lse, d_out, d_lse, *, causal, k_len,
                    block_q, block_k, scale):
    b, hkv, g, sq, d = q.shape
    num_q, num_k = sq // block_q, k.shape[2] // block_k
    overlap = None if q_seg is None else segment_overlap(q_seg, k_seg, block_q, block_k)
    # d lse / d score = p, so a cotangent on lse enters exactly like -delta.
    delta = jnp.einsum("bhgqd,bhgqd->bhgq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    delta = delta - d_lse

    def probs_and_dscores(qi, kj):
        q_blk, do_blk = _slice(q, qi, block_q, 3), _slice(d_out, qi, block_q, 3)
        k_blk, v_blk = _slice(k, kj, block_k, 2), _slice(v, kj, block_k, 2)
        q_seg_blk = None if q_seg is None else _slice(q_seg, qi, block_q, 1)
        k_seg_blk = None if k_seg is None else _slice(k_seg, kj, block_k, 1)
        mask = _block_mask(qi, kj, block_q, block_k, k_len, k_shift, causal, q_seg_blk, k_seg_blk)
        s = _scores(q_blk, k_blk, scale)
        p = jnp.where(mask, jnp.exp(s - _slice(lse, qi, block_q, 3)[..., None]), 0.0)
        dp = jnp.einsum("bhgqd,bhkd->bhgqk", do_blk, v_blk, preferred_element_type=jnp.float32)
        ds = p * (dp - _slice(delta, qi, block_q, 3)[..., None])
        return q_blk, do_blk, k_blk, p, ds

    # Pass A: dq, one query block at a time over the key blocks it sees.
    def dq_row(qi):
        def step(kj, dq):
            _, _, k_blk, _, ds = probs_and_dscores(qi, kj)
            return dq + jnp.einsum("bhgqk,bhkd->bhgqd", ds.astype(k.dtype), k_blk,
                                   preferred_element_type=jnp.float32)

        init = jnp.zeros((b, hkv, g, block_q, d), jnp.float32)
        start, end = _kv_block_range(qi, num_k, block_q, block_k, k_shift, causal, overlap)
        return lax.fori_loop(start, jnp.maximum(start, end), step, init)

    # Pass B: dk and dv, one key block at a time over the query blocks that see it.
    def dkv_col(kj):
        def step(qi, carry):
            dk, dv = carry
            q_blk, do_blk, _, p, ds = probs_and_dscores(qi, kj)
            dv = dv + jnp.einsum("bhgqk,bhgqd->bhkd", p.astype(d_out.dtype), do_blk,
                                 preferred_element_type=jnp.float32)
            dk = dk + jnp.einsum("bhgqk,bhgqd->bhkd", ds.astype(q.dtype), q_blk,
                                 preferred_element_type=jnp.float32)
            return dk, dv

        zeros = jnp.zeros((b, hkv, block_k, d), jnp.float32)
        start, end = _q_block_range(kj, num_q, block_q, block_k, k_shift, causal, overlap)
        return lax.fori_loop(start, jnp.maximum(start, end), step, (zeros, zeros))

    dq = jnp.moveaxis(lax.map(dq_row, jnp.arange(num_q)), 0, 3).reshape(q.shape) * scale
    dk, dv = lax.map(dkv_col, jnp.arange(num_k))
    dk = jnp.moveaxis(dk, 0, 2).reshape(k.shape) * scale
    dv = jnp.moveaxis(dv, 0, 2).reshape(v.shape)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _flash(q, k, v, q_seg, k_seg, k_shift, causal, k_len, block_q, block_k, scale):
    return _flash_forward(q, k, v, q_seg, k_seg, k_shift, causal=causal, k_len=k_len,
                          block_q=block_q, block_k=block_k, scale=scale)


def _flash_fwd(q, k, v, q_seg, k_seg, k_shift, causal, k_len, block_q, block_k, scale):
    out, lse = _flash_forward(q, k, v, q_seg, k_seg, k_shift, causal=causal, k_len=k_len,
                              block_q=block_q, block_k=block_k, scale=scale)
    return (out, lse), (q, k, v, q_seg, k_seg, k_shift, out, lse)


def _flash_bwd(causal, k_len, block_q, block_k, scale, residuals, cotangents):
    q, k, v, q_seg, k_seg, k_shift, out, lse = residuals
    d_out, d_lse = cotangents
    dq, dk, dv = _flash_backward(q, k, v, q_seg, k_seg, k_shift, out, lse, d_out, d_lse,
                                 causal=causal, k_len=k_len, block_q=block_q, block_k=block_k,
                                 scale=scale)
    return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_seq(x, length, axis, value=0):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _grouped(q, k, v, q_segment_ids, k_segment_ids, block_size):
    """q, k, v [b, s, h, d] padded to whole blocks in the kernels' layout (q [b, hkv, g, sq, d],
    k/v [b, hkv, sk, d]), the padded segment ids, and the block sizes."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    block_q, block_k = min(block_size, sq), min(block_size, sk)
    sq_pad, sk_pad = -(-sq // block_q) * block_q, -(-sk // block_k) * block_k
    q = _pad_seq(q, sq_pad, 1)
    k, v = _pad_seq(k, sk_pad, 1), _pad_seq(v, sk_pad, 1)
    q_seg = k_seg = None
    if q_segment_ids is not None:
        q_seg = _pad_seq(q_segment_ids.astype(jnp.int32), sq_pad, 1, value=-1)
        k_seg = _pad_seq(k_segment_ids.astype(jnp.int32), sk_pad, 1, value=-1)
    qg = _group_queries(q, hkv)
    kg, vg = (x.transpose(0, 2, 1, 3) for x in (k, v))
    return qg, kg, vg, q_seg, k_seg, block_q, block_k


def _group_queries(x, hkv):
    """[b, s, hq, d] -> [b, hkv, g, s, d] (or [b, s, hq] -> [b, hkv, g, s])."""
    b, s, hq = x.shape[:3]
    x = x.reshape(b, s, hkv, hq // hkv, *x.shape[3:])
    return jnp.moveaxis(x, 1, 3)


def _ungroup_queries(x, sq):
    """The inverse of _group_queries, with the padded rows beyond sq sliced off."""
    b, hkv, g, s = x.shape[:4]
    return jnp.moveaxis(x, 3, 1).reshape(b, s, hkv * g, *x.shape[4:])[:, :sq]


def blockwise_attention_with_lse(q, k, v, *, causal: bool, q_segment_ids=None, k_segment_ids=None,
                                 k_shift=0, block_size: int = DEFAULT_BLOCK):
    """Flash attention in pure JAX, returning (out [b, sq, hq, d], lse [b, sq, hq] float32).

    Key j sits at position k_shift + j relative to query 0 (causal masking uses it). Both outputs
    are differentiable, so chunks of a sequence can be merged by their log-sum-exp (ring attention).
    Memory is O(S x block) in forward and backward.
    """
    sq, d = q.shape[1], q.shape[3]
    qg, kg, vg, q_seg, k_seg, block_q, block_k = _grouped(q, k, v, q_segment_ids,
                                                          k_segment_ids, block_size)
    shift = jnp.asarray(k_shift, jnp.int32)
    out, lse = _flash(qg, kg, vg, q_seg, k_seg, shift, causal, k.shape[1], block_q, block_k,
                      1.0 / math.sqrt(d))
    return _ungroup_queries(out, sq), _ungroup_queries(lse, sq)


def blockwise_attention_vjp(q, k, v, out, lse, d_out, *, causal: bool, q_segment_ids=None,
                            k_segment_ids=None, k_shift=0, block_size: int = DEFAULT_BLOCK):
    """(dq, dk, dv): the gradients through the keys k, v's share of a larger attention of the
    queries q, whose final output, log-sum-exp and output cotangent are out, lse and d_out
    ([b, sq, hq, d], [b, sq, hq] float32, [b, sq, hq, d]). Flash attention's backward with the
    whole attention's lse gives each share's probabilities exactly, so a ring attention sums
    these over its chunks without keeping any chunk's partial output (basp_jax.ring)."""
    sq, sk, d = q.shape[1], k.shape[1], q.shape[3]
    hkv = k.shape[2]
    qg, kg, vg, q_seg, k_seg, block_q, block_k = _grouped(q, k, v, q_segment_ids,
                                                          k_segment_ids, block_size)
    sq_pad = qg.shape[3]
    # padded query rows: zero cotangent, lse 0 (finite), so they contribute nothing
    og, dog = (_group_queries(_pad_seq(x, sq_pad, 1), hkv) for x in (out, d_out))
    lseg = _group_queries(_pad_seq(lse.astype(jnp.float32), sq_pad, 1), hkv)
    dq, dk, dv = _flash_backward(qg, kg, vg, q_seg, k_seg, jnp.asarray(k_shift, jnp.int32), og,
                                 lseg, dog, jnp.zeros_like(lseg), causal=causal, k_len=sk,
                                 block_q=block_q, block_k=block_k, scale=1.0 / math.sqrt(d))
    dk, dv = (x.transpose(0, 2, 1, 3)[:, :sk] for x in (dk, dv))
    return _ungroup_queries(dq, sq), dk, dv


def blockwise_attention(q, k, v, *, causal: bool, segment_ids=None, block_size: int = DEFAULT_BLOCK):
    """Flash self-attention in pure JAX: O(S * block) memory in forward and backward."""
    out, _ = blockwise_attention_with_lse(q, k, v, causal=causal, q_segment_ids=segment_ids,
                                          k_segment_ids=segment_ids, block_size=block_size)
    return out
