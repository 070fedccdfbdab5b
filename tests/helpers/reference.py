"""Independent single-device references for the tests: plain softmax attention with explicit masks."""

import jax
import jax.numpy as jnp
import numpy as np


def reference_attention(q, k, v, *, causal, segment_ids=None):
    """q [B,S,Hq,D], k/v [B,S,Hkv,D] -> [B,S,Hq,D]; float32 softmax over an explicit boolean mask."""
    b, s, hq, d = q.shape
    group = hq // k.shape[2]
    k = jnp.repeat(k, group, axis=2)
    v = jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) / np.sqrt(d)
    mask = np.ones((1, 1, s, s), bool)
    if causal:
        mask = mask & np.tril(np.ones((s, s), bool))[None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v.astype(jnp.float32))


def packed_segment_ids(key, batch, seq_len, max_docs=4):
    """Sorted random segment ids per row: documents packed back to back."""
    ids = jax.random.randint(key, (batch, seq_len), 0, max_docs)
    return jnp.sort(ids, axis=1).astype(jnp.int32)


def random_documents(rng, rows: int, length: int, most: int) -> np.ndarray:
    """Segment ids [rows, length] of rows packed with 1..most documents of random lengths,
    numbered in order from 1 (as the packer numbers them), some of one token."""
    out = np.zeros((rows, length), np.int32)
    for r in range(rows):
        count = rng.integers(1, most + 1)
        cuts = np.sort(rng.choice(np.arange(1, length), count - 1, replace=False))
        for doc, (a, b) in enumerate(zip([0, *cuts], [*cuts, length])):
            out[r, a:b] = doc + 1
    return out
