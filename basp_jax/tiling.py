"""Token-local work over chunks of each device's own tokens, so that no buffer of a whole shard's
[tokens, width] exists at once (a model's MLP [tokens, intermediate], its norms' float32 copies,
RoPE's temporaries at long sequences; models.tiling runs a model's modules through it).

The chunks are slices of the tokens a device already holds: nothing moves between devices. Each
chunk's function is rematerialised (jax.checkpoint), so the backward pass too holds one chunk's
intermediates at a time. The loss's chunking (basp_jax.vocab) uses the same helpers.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from .mesh import SEQ, checks_varying_axes, device_varying, row_groups, unmapped_axes
from .sharding import activation_spec


def chunk_len(local_len: int, rows: int, chunk_tokens: int) -> int:
    """The largest divisor c of local_len with rows * c <= chunk_tokens (at least 1)."""
    best = 1
    for small in range(1, int(local_len ** 0.5) + 1):
        if local_len % small:
            continue
        for c in (small, local_len // small):
            if rows * c <= chunk_tokens and c > best:
                best = c
    return best


def token_chunks(hidden: jax.Array, targets: jax.Array, sp: int, c: int):
    """[B, S, D], [B, S] -> [n, B, sp, c, D], [n, B, sp, c]: chunk i holds positions
    i*c..(i+1)*c-1 of every device's slice of the sequence (S split over sp devices)."""
    b, s, d = hidden.shape
    n = s // sp // c
    return (jnp.moveaxis(hidden.reshape(b, sp, n, c, d), 2, 0),
            jnp.moveaxis(targets.reshape(b, sp, n, c), 2, 0))


def _scan_chunks(fn: Callable, xs: tuple, weights, c: int):
    """fn(chunks of xs, weights) over chunks of c positions of each x [rows, positions, ...],
    every row in each chunk; the outputs (a pytree of [rows, c, ...]) put back together."""
    rows, length = xs[0].shape[:2]
    n = length // c
    chunked = tuple(jnp.moveaxis(x.reshape(rows, n, c, *x.shape[2:]), 1, 0) for x in xs)
    step = jax.checkpoint(fn)

    def body(_, chunk):
        return None, step(chunk, weights)

    _, ys = jax.lax.scan(body, None, chunked)
    return jax.tree.map(lambda y: jnp.moveaxis(y, 0, 1).reshape(rows, length, *y.shape[3:]), ys)


def map_token_chunks(fn: Callable, xs: tuple, weights, *, mesh: Mesh | None,
                     chunk_tokens: int):
    """fn(xs_chunk, weights) -> a pytree of [rows, c, ...], applied to xs (arrays [B, S, ...],
    sharded P('group', 'seq') with a mesh) in chunks of at most chunk_tokens tokens per device;
    returns the pytree of [B, S, ...] arrays. `weights` is a pytree of arrays every chunk uses.

    With a mesh, one shard_map in which every device scans its own tokens with whole copies of
    `weights` (gathered once, before the loop, if they are stored sharded). Made device-varying
    before the loop, their cotangents accumulate on the device and are summed over the mesh
    once, after it; differentiated through a scan in the global view, XLA would reduce every
    weight's gradient once per chunk (as basp_jax.vocab explains for the LM head).
    """
    b, s = xs[0].shape[:2]
    groups, sp = (1, 1) if mesh is None else (row_groups(mesh), mesh.shape[SEQ])
    c = chunk_len(s // sp, b // groups, chunk_tokens)
    if mesh is None:
        return _scan_chunks(fn, tuple(xs), weights, c)
    axes = unmapped_axes(mesh)

    def local(xs, weights):
        weights = jax.tree.map(lambda w: device_varying(w, axes), weights)
        return _scan_chunks(fn, xs, weights, c)

    rows = activation_spec("batch", "sequence")  # a prefix: any trailing axes stay whole
    return jax.shard_map(local, mesh=mesh, in_specs=(rows, P()), out_specs=rows,
                         check_vma=checks_varying_axes())(tuple(xs), weights)
