"""Next-token cross-entropy that ignores padding and masked labels, whole or over chunks of tokens."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from basp_jax.sharding import ACTIVATION_SPEC, HOST, LOCAL

from .tiling import chunk_len, token_chunks


def causal_lm_loss(logits: jax.Array, targets: jax.Array, loss_mask: jax.Array | None = None):
    """(sum of token losses, number of counted tokens), both float32 scalars.

    logits [B, S, V]; targets [B, S] are the labels *for each position*, i.e. already shifted
    (targets[:, t] is the token that follows tokens[:, t]). A position counts when its target is
    >= 0 (use -100 or any negative id for padding, as Hugging Face does) and loss_mask, when given,
    is nonzero there. The mean is sum / max(count, 1); returning the pair lets gradient
    accumulation weight every token equally across microbatches.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {logits.shape} and targets {targets.shape} disagree on [batch, seq]")
    logits = logits.astype(jnp.float32)
    valid = targets >= 0
    if loss_mask is not None:
        if loss_mask.shape != targets.shape:
            raise ValueError(f"loss_mask must have shape {targets.shape}, got {loss_mask.shape}")
        valid = valid & (loss_mask != 0)
    safe = jnp.where(valid, targets, 0)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
    losses = jnp.where(valid, log_z - target_logit, 0.0)
    return losses.sum(dtype=jnp.float32), valid.sum(dtype=jnp.float32)


# Tokens per device whose logits exist at once in chunked_lm_loss (and models.vocab_parallel):
# 128 x a 128K vocabulary in float32 is 64 MiB per buffer, against 2.1 GB for 4,096 tokens. At
# 1,024 the 8B step at 16K held 1.5 GiB of chunk buffers, at 256 0.06 GiB more than at 128
# (compiled GPU program); more, smaller chunks cost no FLOPs, only more (small) collectives.
LOSS_CHUNK_TOKENS = 128


def chunked_lm_loss(hidden: jax.Array, targets: jax.Array, project: Callable, weight: jax.Array,
                    loss_fn: Callable = causal_lm_loss, *, mesh: Mesh | None = None,
                    chunk_tokens: int = LOSS_CHUNK_TOKENS, host_mesh: Mesh | None = None):
    """loss_fn(project(hidden, weight), targets) computed over chunks of tokens: the same
    (sum, count), but no [tokens, vocab] logits of the whole batch ever exist.

    hidden [B, S, D] (sharded P('group', 'seq', None) with `mesh`); project(h [..., D], weight) ->
    logits [..., V] float32; loss_fn(logits, targets) -> (sum, count) must add up over tokens (as
    causal_lm_loss does). The chunks are slices of every device's own tokens (chunk_tokens per
    device at most), so nothing moves between devices; a scan visits them with each chunk's
    projection and loss rematerialised, so the backward pass too holds one chunk's logits at a time.

    With a mesh, every device runs the loop over its own chunks with a whole copy of `weight`
    (_per_device_chunks): the weight's gradient is summed over the mesh once, after the loop.
    With `host_mesh` (host parameter sharding), `weight` is models.layers.host_copies of the
    projection: each host's devices run the loop with their host's copy (_per_host_chunks), so
    the copy is gathered inside the host once and its gradient crosses hosts once.
    """
    b, s, d = hidden.shape
    if targets.shape != (b, s):
        raise ValueError(f"hidden {hidden.shape} and targets {targets.shape} disagree on [batch, seq]")
    groups, sp = (1, 1) if mesh is None else (mesh.shape["group"], mesh.shape["seq"])
    local = s // sp
    c = chunk_len(local, b // groups, chunk_tokens)
    if host_mesh is not None:
        return _per_host_chunks(hidden, targets, project, weight, loss_fn, mesh, host_mesh,
                                (b // groups) * c)
    if mesh is not None:
        return _per_device_chunks(hidden, targets, project, weight, loss_fn, mesh, c)
    hs, ts = token_chunks(hidden, targets, sp, c)  # one device

    def per_chunk(h, t, w):
        return loss_fn(project(h, w), t)

    zero = jnp.zeros((), jnp.float32)
    return _sum_chunks(jax.checkpoint(per_chunk), weight, hs, ts, zero)


def _sum_chunks(chunk_loss, weight, hs, ts, zero):
    """(sum, count) of chunk_loss(h, t, weight) over the chunks [n, ...] of hs and ts, by a scan."""
    def body(carry, xs):
        total, count = chunk_loss(*xs, weight)
        return (carry[0] + total, carry[1] + count), None

    (total, count), _ = jax.lax.scan(body, (zero, zero), (hs, ts))
    return total, count


def _per_device_chunks(hidden, targets, project, weight, loss_fn, mesh: Mesh, c: int):
    """chunked_lm_loss on a mesh: one shard_map in which each device scans its own tokens' chunks
    with a whole copy of `weight` (gathered once if it is stored sharded). Made device-varying
    before the loop, the copy's cotangent accumulates on the device and its transpose sums it
    over the mesh once; differentiated through a scan over a replicated weight, XLA would
    all-reduce the whole [vocab, hidden] gradient once per chunk (the emulated cluster's B=8 step
    under hsdp: 16.5 instead of 9.0 MiB across hosts per device; a 128K x 2048 fp32 head at 4K
    tokens per device: 32 chunks of 1 GB per step)."""
    axes = tuple(mesh.axis_names)
    loop = _device_loop(project, loss_fn, c, axes)

    def local(h, t, w):
        return loop(h, t, jax.lax.pcast(w, axes, to="varying"))

    tokens = ACTIVATION_SPEC
    return jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, P()),
                         out_specs=(P(), P()))(hidden, targets, weight)


def _device_loop(project, loss_fn, c: int, axes: tuple[str, ...]):
    """The body both shard_maps run: (sum, count) of this device's tokens h, t in chunks of c,
    with its device-varying copy w of the weight, summed over `axes` once after the scan."""
    @jax.checkpoint
    def chunk_loss(h, t, w):
        return loss_fn(project(h, w), t)

    def loop(h, t, w):
        hs, ts = token_chunks(h, t, 1, c)
        zero = jax.lax.pcast(jnp.zeros((), jnp.float32), axes, to="varying")
        total, count = _sum_chunks(chunk_loss, w, hs, ts, zero)
        return jax.lax.psum(total, axes), jax.lax.psum(count, axes)

    return loop


def _per_host_chunks(hidden, targets, project, copies, loss_fn, mesh: Mesh, host_mesh: Mesh,
                     c: int):
    """chunked_lm_loss under host parameter sharding: the tokens relabelled host-major (nothing
    moves) and one shard_map on the host mesh in which each device scans its own tokens' chunks
    of c tokens with its host's whole copy of the weight (models.layers.host_copies), gathered
    inside the host once. The copy's cotangent is summed inside the host once, after the loop,
    and the copies' across hosts once (host_copies' transpose). Scanned in the global view
    instead, XLA gathered the copy inside the host for every chunk and reduce-scattered its f32
    gradient per chunk (a 128K x 4096 head at 256K tokens: 188 GiB per device per step)."""
    from .layers import host_major  # models.layers imports this module

    hidden = host_major(hidden, mesh, host_mesh)  # [hosts, tokens per host, D]
    targets = host_major(targets, mesh, host_mesh)
    loop = _device_loop(project, loss_fn, c, tuple(host_mesh.axis_names))

    def local(h, t, w):  # h [1, tokens per device, D], w [1, ...] its host's copy
        return loop(h, t, jax.lax.pcast(w[0], (LOCAL,), to="varying"))  # varying over hosts

    tokens = P(HOST, LOCAL)
    # the step traces under the layout's mesh: the host mesh (same devices) for this part
    with jax.sharding.use_abstract_mesh(host_mesh.abstract_mesh):
        return jax.shard_map(local, mesh=host_mesh, in_specs=(tokens, tokens, P(HOST)),
                             out_specs=(P(), P()))(hidden, targets, copies)
