"""The token embedding and the cross-entropy with the vocabulary sharded, as the parameters are.

Under FSDP/HSDP the embedding table [vocab, embed] and the LM head [embed, vocab] are stored
sharded on their vocabulary dimension (basp_jax.sharding picks the largest divisible one). Used
as plain arrays, XLA gathers the whole table on every device (1 GB in bf16 for a 128K vocabulary
at 4,096 wide) and builds its whole float32 gradient before reduce-scattering it (2 GB, more for
every live copy). Here the tokens move instead of the table, as in Megatron-LM's vocab-parallel
embedding and cross-entropy:

- lookup: gather the token ids (int32, tiny) over the sharded axes, look each one up in the
  local slice of the table (zero where another device holds it) and reduce-scatter the rows
  back to the devices that own the tokens. Backward: an all-gather of the rows' cotangent and a
  scatter-add into the local slice. The table's gradient never exists whole.
- loss: per chunk of tokens, gather the hidden states over the sharded axes and compute every
  gathered token's logits for this device's slice of the vocabulary; the log-sum-exp and the
  target's logit are summed over the slices (all-reduces of one float per token). Each device
  then adds up the losses of its own tokens. The head's gradient stays local, the hidden
  states' cotangent is reduce-scattered back to their owners.

Works inside any jit over the ('group', 'seq') mesh; `vocab_axes` names the mesh axes the
vocabulary dimension is sharded over (the parameter strategy's axes, see `vocab_axes`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from basp_jax import cost
from basp_jax.mesh import GROUP, SEQ
from basp_jax.sharding import TOKENS, ShardingRules, activation_spec

from .tiling import chunk_len, token_chunks

FLAT = activation_spec(TOKENS)  # a flat token axis over the whole mesh, group-major


def vocab_axes(names: tuple[str, ...], shape: tuple[int, ...],
               rules: ShardingRules | None) -> tuple[str, ...] | None:
    """The mesh axes the 'vocab' axis of a parameter (axis `names`, `shape`) is stored split
    over, or None when the vocabulary is not what is split (then the plain, gathering
    computation applies): no mesh, replicated, host sharding (its own per-host path), or a
    vocabulary no axis size divides."""
    if rules is None or not rules.entry.vocab_parallel:
        return None
    spec = tuple(rules.spec(names, shape))
    spec = spec + (None,) * (len(shape) - len(spec))
    vocab_dim = names.index("vocab")
    axes = spec[vocab_dim]
    if axes is None or any(s is not None for i, s in enumerate(spec) if i != vocab_dim):
        return None
    return axes if isinstance(axes, tuple) else (axes,)


# vocab_parallel.lookup gathers its rows (shards x tokens x embed, float32 per device) in one
# piece up to LOOKUP_WHOLE_BYTES, where XLA fuses the lookup into the reduce-scatter (the 8B step
# at 8 shards x 512K tokens: 64 GiB of rows, 66.8 GiB peak; in 1 GiB chunks: 71.7), and in
# chunks of LOOKUP_CHUNK_BYTES beyond (32 shards x 512K: 135.4 GiB whole, 62.2 in 1 GiB chunks).
LOOKUP_WHOLE_BYTES = 2**36
LOOKUP_CHUNK_BYTES = 2**30

# RunOptions.vocab_parallel: when the tables are used where they are stored (if split on vocab)
MODES = ("auto", "always", "never")


def active_axes(axes: tuple[str, ...] | None, mesh: Mesh, num_tokens: int, vocab_size: int, *,
                tied: bool, mode: str) -> tuple[str, ...] | None:
    """`axes` when the vocabulary-parallel path should run for `num_tokens` tokens of the whole
    mesh, else None (gather the table instead). "auto": basp_jax.cost.prefer_vocab_parallel
    (where it moves fewer bytes, up to ~2/3 x vocab tokens per shard group tied, and at long
    sequences, where the gathering path's float32 rows and tables would cost the most memory)."""
    if axes is None or mode == "never":
        return None
    if mode == "always":
        return axes
    shard_group = _shard_count(mesh, axes)
    per_device = num_tokens / mesh.size
    return axes if cost.prefer_vocab_parallel(per_device, shard_group, vocab_size, tied) else None


def _shard_count(mesh: Mesh, axes: tuple[str, ...]) -> int:
    """How many devices the vocabulary is split over."""
    return math.prod(mesh.shape[name] for name in axes)


def _shard_index(axes: tuple[str, ...]) -> jax.Array:
    """This device's position along `axes` (row-major, as all_gather over `axes` orders it)."""
    index = 0
    for name in axes:
        index = index * lax.axis_size(name) + lax.axis_index(name)
    return index


def lookup(table: jax.Array, flat_tokens: jax.Array, *, mesh: Mesh, axes: tuple[str, ...],
           dtype) -> jax.Array:
    """table [vocab, embed] (sharded over `axes` on vocab), flat_tokens [T] sharded over the whole
    mesh (group-major) -> rows [T, embed] in `dtype`, sharded like the tokens."""

    shards = _shard_count(mesh, axes)
    local_tokens = flat_tokens.shape[0] // mesh.size
    row_bytes = shards * table.shape[1] * 4
    c = local_tokens
    if local_tokens * row_bytes > LOOKUP_WHOLE_BYTES:  # chunks of the device's tokens
        c = chunk_len(local_tokens, 1, max(1, LOOKUP_CHUNK_BYTES // row_bytes))

    def chunk(table, tokens):
        rows = table.shape[0]
        first = _shard_index(axes) * rows
        every = lax.all_gather(tokens, axes, tiled=True)
        here = (every >= first) & (every < first + rows)
        # Looked up in the stored dtype and cast after, so the gradient adds up in float32.
        found = jnp.take(table, jnp.clip(every - first, 0, rows - 1), axis=0)
        found = jnp.where(here[:, None], found, 0).astype(dtype)
        return lax.psum_scatter(found, axes, scatter_dimension=0, tiled=True)  # one row is not 0

    def local(table, tokens):
        if c == local_tokens:
            return chunk(table, tokens)
        # rematerialised: kept for the backward pass, each chunk's [rows, embed] mask of which
        # rows this shard holds would be stacked over the chunks (64 GiB at 32 shards, 512K)
        remat_chunk = jax.checkpoint(chunk)
        out = lax.map(lambda t: remat_chunk(table, t), tokens.reshape(-1, c))
        return out.reshape(local_tokens, -1)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(axes, None), FLAT),
                         out_specs=activation_spec(TOKENS, None))(table, flat_tokens)


def lm_loss(hidden: jax.Array, targets: jax.Array, weight: jax.Array, *, mesh: Mesh,
            axes: tuple[str, ...], vocab_dim: int, dtype, chunk_tokens: int):
    """models.causal_lm_loss of hidden @ weight, as (sum, count) float32, with weight's vocabulary
    sharded over `axes`: weight [embed, vocab] (vocab_dim=1, an LM head) or [vocab, embed]
    (vocab_dim=0, tied to the embedding). hidden [B, S, D] and targets [B, S] are sharded
    P('group', 'seq'). A chunk takes at most chunk_tokens of each device's tokens, as
    models.loss.chunked_lm_loss: gathered over the shards, its float32 logits are as large
    (chunk_tokens x shards tokens x vocab / shards); the scan rematerialises them backward."""
    b, s, d = hidden.shape
    groups, sp = mesh.shape[GROUP], mesh.shape[SEQ]
    local_len, rows = s // sp, b // groups
    c = chunk_len(local_len, rows, chunk_tokens)
    hs, ts = token_chunks(hidden, targets, sp, c)
    spec = activation_spec(None, "batch", "sequence")  # [chunk, B, S]
    w_spec = P(axes, None) if vocab_dim == 0 else P(None, axes)
    contract = "td,vd->tv" if vocab_dim == 0 else "td,dv->tv"

    def chunk_loss(h, t, w):
        mine = t.size
        h = lax.all_gather(h.reshape(mine, d), axes, tiled=True)
        t_all = lax.all_gather(t.reshape(mine), axes, tiled=True)
        logits = jnp.einsum(contract, h.astype(dtype), w.astype(dtype),
                            preferred_element_type=jnp.float32)
        width = logits.shape[1]
        first = _shard_index(axes) * width
        top = lax.pmax(lax.stop_gradient(logits.max(axis=1)), axes)  # cancels in the gradient
        log_z = top + jnp.log(lax.psum(jnp.exp(logits - top[:, None]).sum(axis=1), axes))
        here = (t_all >= first) & (t_all < first + width)
        picked = jnp.take_along_axis(logits, jnp.clip(t_all - first, 0, width - 1)[:, None], 1)
        target_logit = lax.psum(jnp.where(here, picked[:, 0], 0.0), axes)
        losses = jnp.where(t_all >= 0, log_z - target_logit, 0.0)
        own = lax.dynamic_slice_in_dim(losses, _shard_index(axes) * mine, mine)
        return own.sum(), (t >= 0).sum(dtype=jnp.float32)

    chunk_loss = jax.checkpoint(chunk_loss)

    def local(hs, ts, w):
        _, (totals, counts) = lax.scan(lambda _, xs: (None, chunk_loss(*xs, w)), None, (hs, ts))
        return totals.sum()[None], counts.sum()[None]

    total, count = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, w_spec),
                                 out_specs=(FLAT, FLAT))(hs, ts, weight)
    return total.sum(), count.sum()
