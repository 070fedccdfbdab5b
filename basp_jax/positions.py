"""Position ids for RoPE: global positions in the sequence, or positions within packed documents.

Both are computed on the global [B, S] array, so under jit with a P('group', 'seq') sharding each
shard gets its own global positions (iota is partitioned; the packed case needs only a cumulative
max over small integers). Apply RoPE with these *before* the all-to-all.

A sequence held in another token order (a zig-zag ring's, basp_jax.Layout.token_order) gets its
positions in that order: `position_ids(B, S, segment_ids, order=layout.token_order)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def position_ids(batch: int, seq_len: int, segment_ids: jax.Array | None = None,
                 order: np.ndarray | None = None) -> jax.Array:
    """[batch, seq_len] int32 positions: 0..S-1, or restarting at 0 at each new segment.

    `order`: the permutation of the sequence axis the arrays (segment_ids included) are in
    (None: natural order); the positions come back in the same order.
    """
    if segment_ids is not None and segment_ids.shape != (batch, seq_len):
        raise ValueError(f"segment_ids must have shape {(batch, seq_len)}, got {segment_ids.shape}")
    if order is not None:
        if segment_ids is None:
            return jnp.broadcast_to(jnp.asarray(order, jnp.int32), (batch, seq_len))
        # document positions in the natural order, then permuted like the tokens
        natural = segment_ids[:, np.argsort(order)]
        return position_ids(batch, seq_len, natural)[:, order]
    index = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
    if segment_ids is None:
        return index
    starts = jnp.concatenate(
        [jnp.ones((batch, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    segment_start = lax.cummax(jnp.where(starts, index, 0), axis=1)
    return index - segment_start


def shard_positions(local_seq_len: int, axis_name: str = "seq") -> jax.Array:
    """Inside a shard_map over `axis_name`: the global positions [local_seq_len] of this shard."""
    return lax.axis_index(axis_name) * local_seq_len + jnp.arange(local_seq_len, dtype=jnp.int32)
