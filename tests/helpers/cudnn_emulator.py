"""What cuDNN's fused attention kernels compute, in plain JAX on CPU: stand-ins for JAX's two
primitives (basp_jax.cudnn_call.primitives) that read their operands as the cuDNN custom call
does, so the CPU tests run everything basp_jax builds around the kernels (the packed layout's
conversion, the vmap fold, the custom_vjp, a ring's merges) against independent references.

How the operands are read (the kernels' contract, as JAX's wrapper and its tests state it):
- q/k/v [B, T, N, H] (BTNH); mask_type NO_MASK, CAUSAL, PADDING or PADDING_CAUSAL;
- padding, one document per row: the first q_seqlen[b] queries and kv_seqlen[b] keys of row b;
  the other queries' outputs are 0 (JAX's test: "cuDNN padding mask generation will mask out
  output accordingly"), their statistics and the gradients of rows outside the lengths
  unspecified (here: garbage, so callers must mask them);
- packed (offsets [B, M + 1], M > 1): one list of documents over the flattened batch, document
  j's queries from q_offsets[j] / (N * H) (an element offset), q_seqlen[j] of them; its keys
  likewise with k's heads; each document attends alone, causal from its own first token;
- the forward's statistics: each query's log-sum-exp of scale * q.k, natural log, [B * M, N, T]
  (here a packed row's statistics sit in row b * M; how cuDNN lays them out does not matter to
  its callers, which hand them back to its backward unchanged);
- the backward: flash attention's, from the given output and statistics (not recomputed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

GARBAGE = 7.25  # statistics of queries the kernel does not compute


def _documents(seqlen, offsets, batch, length, per_token):
    """[batch, length] (document, position in it) of every token; document -1: none."""
    flat = jnp.arange(batch * length)
    starts = offsets.reshape(-1)[:seqlen.size] // per_token
    lens = seqlen.reshape(-1)
    inside = (flat[:, None] >= starts[None]) & (flat[:, None] < starts[None] + lens[None]) & \
        (lens[None] > 0)
    doc = jnp.where(inside.any(-1), jnp.argmax(inside, -1), -1)
    pos = flat - jnp.take(starts, jnp.maximum(doc, 0))
    return doc.reshape(batch, length), pos.reshape(batch, length)


def _mask(q, k, q_seqlen, kv_seqlen, q_offsets, kv_offsets, mask_type):
    """[B, 1, T, S] which key each query sees, and [B, T] which queries are computed."""
    name = mask_type.name
    b, t, n, h = q.shape
    s, nkv = k.shape[1], k.shape[2]
    causal = "CAUSAL" in name
    packed = q_offsets.ndim == 2 and q_offsets.shape[1] - 1 > 1
    if packed:
        q_doc, q_pos = _documents(q_seqlen, q_offsets, b, t, n * h)
        k_doc, k_pos = _documents(kv_seqlen, kv_offsets, b, s, nkv * h)
        sees = (q_doc[:, :, None] == k_doc[:, None, :]) & (q_doc[:, :, None] >= 0)
        if causal:
            sees &= q_pos[:, :, None] >= k_pos[:, None, :]
        return sees[:, None], q_doc >= 0
    q_idx, k_idx = jnp.arange(t), jnp.arange(s)
    sees = jnp.ones((b, t, s), bool)
    computed = jnp.ones((b, t), bool)
    if "PADDING" in name:
        q_n, k_n = q_seqlen.reshape(b), kv_seqlen.reshape(b)
        computed = q_idx[None] < q_n[:, None]
        sees = computed[:, :, None] & (k_idx[None, None] < k_n[:, None, None])
    if causal:
        sees &= q_idx[None, :, None] >= k_idx[None, None, :]
    return sees[:, None], computed


def _scores(q, k, scale):
    group = q.shape[2] // k.shape[2]
    k = jnp.repeat(k.astype(jnp.float32), group, axis=2)
    return jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k) * scale


def _segments(q_offsets):
    return q_offsets.shape[1] - 1 if q_offsets.ndim == 2 else 1


class _Forward:
    def __init__(self, calls):
        self.calls = calls

    def bind(self, q, k, v, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, *_pages,
             scale, mask_type, is_training, **_):
        assert is_training and bias.size == 0
        self.calls.append(mask_type.name)
        sees, computed = _mask(q, k, q_seqlen, kv_seqlen, q_offsets, kv_offsets, mask_type)
        scores = jnp.where(sees, _scores(q, k, scale), -jnp.inf)
        lse = jax.nn.logsumexp(scores, axis=-1)  # [B, N, T]
        probs = jnp.where(sees, jnp.exp(scores - lse[..., None]), 0.0)
        group = q.shape[2] // k.shape[2]
        v = jnp.repeat(v.astype(jnp.float32), group, axis=2)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        out = jnp.where(computed[:, :, None, None], out, 0.0).astype(q.dtype)
        lse = jnp.where(computed[:, None, :], lse, GARBAGE)
        m = _segments(q_offsets)
        stats = jnp.full((q.shape[0] * m, *lse.shape[1:]), GARBAGE, jnp.float32)
        return [out, stats.at[::m].set(lse)]


class _Backward:
    def bind(self, q, k, v, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, _pk, _pv,
             stats, out, d_out, *, scale, mask_type, **_):
        sees, _ = _mask(q, k, q_seqlen, kv_seqlen, q_offsets, kv_offsets, mask_type)
        lse = stats[::_segments(q_offsets)]
        group = q.shape[2] // k.shape[2]
        kf = jnp.repeat(k.astype(jnp.float32), group, axis=2)
        vf = jnp.repeat(v.astype(jnp.float32), group, axis=2)
        probs = jnp.where(sees, jnp.exp(_scores(q, k, scale) - lse[..., None]), 0.0)
        do = d_out.astype(jnp.float32)
        delta = jnp.einsum("bqhd,bqhd->bhq", do, out.astype(jnp.float32))
        dp = jnp.einsum("bqhd,bkhd->bhqk", do, vf)
        ds = probs * (dp - delta[..., None])
        dq = jnp.einsum("bhqk,bkhd->bqhd", ds, kf) * scale
        dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(jnp.float32)) * scale
        dv = jnp.einsum("bhqk,bqhd->bkhd", probs, do)

        def per_kv_head(x):
            b, s, _, d = x.shape
            return x.reshape(b, s, k.shape[2], group, d).sum(3)

        dk, dv = per_kv_head(dk), per_kv_head(dv)
        if "PADDING" in mask_type.name and _segments(q_offsets) == 1:
            # rows outside the lengths: unspecified (here garbage, so callers must mask them)
            b = q.shape[0]
            q_rows = jnp.arange(q.shape[1])[None] < q_seqlen.reshape(b)[:, None]
            k_rows = jnp.arange(k.shape[1])[None] < kv_seqlen.reshape(b)[:, None]
            dq = jnp.where(q_rows[:, :, None, None], dq, GARBAGE)
            dk, dv = (jnp.where(k_rows[:, :, None, None], x, GARBAGE) for x in (dk, dv))
        return [dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)]


def install(monkeypatch, cudnn_call):
    """Run basp_jax.cudnn_call's kernels as this module's stand-ins, and JAX's checks in its
    check as JAX's head_dim check for a Hopper GPU (no cuDNN library here). Returns the list
    the forward appends each call's mask type name to."""
    assert cudnn_call.FUSED is not None, f"jax {jax.__version__} lacks the cuDNN primitives"
    calls = []
    monkeypatch.setattr(cudnn_call, "primitives", lambda: (_Forward(calls), _Backward()))

    def jax_checks(q, k, v, *, mask, packed, training=True):
        if mask not in cudnn_call.MASKS:
            raise ValueError(mask)
        if q.shape[-1] > 256 or q.shape[-1] % 8:
            raise NotImplementedError(f"The head dim must be <= 256 and a multiple of 8, "
                                      f"but got {q.shape[-1]}.")

    monkeypatch.setattr(cudnn_call, "jax_checks", jax_checks)
    return calls


def lse_reference(q, k, *, causal, scale=None):
    """[b, hq, sq] natural-log log-sum-exp of the scaled scores (float32)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = _scores(q, k, scale)
    if causal:
        t, s = q.shape[1], k.shape[1]
        scores = jnp.where(np.tril(np.ones((t, s), bool)), scores, -jnp.inf)
    return jax.nn.logsumexp(scores, axis=-1)
