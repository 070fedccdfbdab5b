"""Ring-hybrid sequence parallelism: when sp exceeds what the heads allow, split the `seq` axis
into `ring` runs of `inner` devices (sp = ring * inner).

Inside a run, an all-to-all (over `inner` consecutive devices) turns sequence shards into head
shards, exactly as in Ulysses; the run then holds one contiguous chunk of S / ring tokens. Across
runs, k/v chunks travel around a ring with `ppermute` (ring - 1 hops) and each device merges the
partial attention of its query chunk by log-sum-exp. Causal chunks entirely in the future are
skipped by the kernel's loop bounds (no compute). The chunks are contiguous, so under causal
masking later ranks do more work than earlier ones (no zig-zag load balancing yet).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .kernels import blockwise_attention_with_lse
from .mesh import SEQ


def inner_groups(sp: int, ring: int) -> list[list[int]]:
    """`seq` axis indices of each all-to-all run: consecutive devices (inside a host first)."""
    inner = sp // ring
    return [[r * inner + i for i in range(inner)] for r in range(ring)]


def ring_permutation(sp: int, ring: int) -> list[tuple[int, int]]:
    """Each device passes its k/v chunk to the same inner position of the next run."""
    inner = sp // ring
    return [(r * inner + i, ((r + 1) % ring) * inner + i) for r in range(ring) for i in range(inner)]


def _merge(out, lse, out_t, lse_t):
    """Combine two partial softmax attentions of the same queries by their log-sum-exp."""
    m = jnp.maximum(lse, lse_t)
    w, w_t = jnp.exp(lse - m), jnp.exp(lse_t - m)
    total = w + w_t
    merged = (out * w[..., None] + out_t * w_t[..., None]) / total[..., None]
    return merged, m + jnp.log(total)


def ring_local_attention(q, k, v, seg, *, sp: int, ring: int, causal: bool, block_size: int):
    """The per-device body inside shard_map: q [b, s/sp, h, d] -> [b, s/sp, h, d].

    `seg` is this device's [b, s/sp] segment ids or None.
    """
    groups = inner_groups(sp, ring)
    inner = sp // ring
    chunk = q.shape[1] * inner  # tokens per ring chunk: S / ring
    rank = lax.axis_index(SEQ) // inner

    def seq_to_heads(x):
        if inner == 1:
            return x
        return lax.all_to_all(x, SEQ, 2, 1, tiled=True, axis_index_groups=groups)

    def heads_to_seq(x):
        if inner == 1:
            return x
        return lax.all_to_all(x, SEQ, 1, 2, tiled=True, axis_index_groups=groups)

    q, k, v = (seq_to_heads(x) for x in (q, k, v))
    full_seg = None if seg is None else lax.all_gather(seg, SEQ, axis=1, tiled=True)  # small ints

    def chunk_seg(index):
        return None if full_seg is None else lax.dynamic_slice_in_dim(full_seg, index * chunk, chunk, axis=1)

    q_seg = chunk_seg(rank)
    perm = ring_permutation(sp, ring)
    out = lse = None
    for step in range(ring):
        source = (rank - step) % ring  # whose k/v chunk this device holds now
        out_t, lse_t = blockwise_attention_with_lse(
            q, k, v, causal=causal, q_segment_ids=q_seg, k_segment_ids=chunk_seg(source),
            k_shift=(source - rank) * chunk, block_size=block_size,
        )
        # Step 0 is the diagonal chunk, where every query sees at least itself: lse is finite.
        out, lse = (out_t.astype(jnp.float32), lse_t) if step == 0 else _merge(out, lse, out_t, lse_t)
        if step < ring - 1:
            k, v = lax.ppermute(k, SEQ, perm), lax.ppermute(v, SEQ, perm)
    return heads_to_seq(out.astype(q.dtype))
