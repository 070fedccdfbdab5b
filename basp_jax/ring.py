"""Ring-hybrid sequence parallelism: when sp exceeds what the heads allow, split the `seq` axis
into `ring` runs of `inner` devices (sp = ring * inner).

Inside a run, an all-to-all (over `inner` consecutive devices) turns sequence shards into head
shards, exactly as in Ulysses; the run then holds one contiguous chunk of S / ring tokens. Across
runs, k/v chunks travel around a ring with `ppermute` (ring - 1 hops) and each device merges the
partial attention of its query chunk by log-sum-exp. Causal chunks entirely in the future are
skipped by the kernel's loop bounds (no compute).

Load balance under causal masking: with contiguous chunks, the last rank of the ring attends to
every earlier chunk while the first attends only to its own, and each ring step waits for the
busiest. With a zig-zag layout (Layout.zigzag) the sequence is cut into 2 x ring halves and rank
r holds halves r and 2 ring - 1 - r, so every rank does the same work at every step. The caller
then feeds the tokens in `Layout.token_order` (basp_jax.layout.zigzag_order: a permutation of the
sequence axis, done once at data loading, not per layer).

The runs, the ring's hops and the token order are the layout's (basp_jax.layout.Layout).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .kernels import blockwise_attention_with_lse
from .layout import Layout
from .mesh import SEQ
from .remat import name_exchange


def _merge(out, lse, out_t, lse_t):
    """Combine two partial softmax attentions of the same queries by their log-sum-exp."""
    m = jnp.maximum(lse, lse_t)
    w, w_t = jnp.exp(lse - m), jnp.exp(lse_t - m)
    total = w + w_t
    merged = (out * w[..., None] + out_t * w_t[..., None]) / total[..., None]
    return merged, m + jnp.log(total)


def ring_local_attention(q, k, v, seg, *, layout: Layout, causal: bool, block_size: int):
    """The per-device body inside shard_map: q [b, s/sp, h, d] -> [b, s/sp, h, d].

    `seg` is this device's [b, s/sp] segment ids or None. With layout.zigzag, the sequence axis
    is in layout.token_order.
    """
    ring, zigzag = layout.ring, layout.zigzag
    groups = layout.a2a_runs
    inner = layout.a2a
    chunk = q.shape[1] * inner  # tokens per ring chunk: S / ring
    rank = lax.axis_index(SEQ) // inner

    def seq_to_heads(x):
        if inner == 1:
            return x
        return name_exchange(lax.all_to_all(x, SEQ, 2, 1, tiled=True, axis_index_groups=groups))

    def heads_to_seq(x):
        if inner == 1:
            return x
        return name_exchange(lax.all_to_all(x, SEQ, 1, 2, tiled=True, axis_index_groups=groups))

    q, k, v = (seq_to_heads(x) for x in (q, k, v))
    full_seg = None if seg is None else name_exchange(lax.all_gather(seg, SEQ, axis=1, tiled=True))

    def chunk_seg(index):
        return None if full_seg is None else lax.dynamic_slice_in_dim(full_seg, index * chunk, chunk, axis=1)

    # Pieces of a chunk with their position (in units of `piece` tokens) in the true sequence.
    if zigzag:
        piece = chunk // 2

        def pieces(x, owner):
            halves = (owner, 2 * ring - 1 - owner)
            if x is None:
                return [(None, h) for h in halves]
            return [(x[:, :piece], halves[0]), (x[:, piece:], halves[1])]
    else:
        piece = chunk

        def pieces(x, owner):
            return [(x, owner)]

    q_pieces = pieces(q, rank)
    q_seg_pieces = pieces(chunk_seg(rank), rank)
    perm = layout.ring_hops
    acc = [None] * len(q_pieces)  # (out, lse) per query piece
    for step in range(ring):
        source = (rank - step) % ring  # whose k/v chunk this device holds now
        kv_pieces = list(zip(pieces(k, source), pieces(v, source), pieces(chunk_seg(source), source)))
        for n, ((q_piece, q_pos), (q_seg, _)) in enumerate(zip(q_pieces, q_seg_pieces)):
            # At step 0, piece n of the own chunk is the diagonal of query piece n, where every
            # query sees at least itself: take it first so the running log-sum-exp is finite
            # before anything is merged into it.
            order = kv_pieces if step else [kv_pieces[n]] + kv_pieces[:n] + kv_pieces[n + 1:]
            for (k_piece, k_pos), (v_piece, _), (k_seg, _) in order:
                out_t, lse_t = blockwise_attention_with_lse(
                    q_piece, k_piece, v_piece, causal=causal, q_segment_ids=q_seg,
                    k_segment_ids=k_seg, k_shift=(k_pos - q_pos) * piece, block_size=block_size,
                )
                if acc[n] is None:
                    acc[n] = (out_t.astype(jnp.float32), lse_t)
                else:
                    acc[n] = _merge(*acc[n], out_t, lse_t)
        if step < ring - 1:
            k, v = (name_exchange(lax.ppermute(x, SEQ, perm)) for x in (k, v))
    out = jnp.concatenate([o for o, _ in acc], axis=1)
    return heads_to_seq(out.astype(q.dtype))
