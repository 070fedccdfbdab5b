"""A model's token-local work over chunks of each device's own tokens (basp_jax.tiling): no
buffer of a whole shard's [tokens, width] exists at once (the SwiGLU MLP's [tokens,
intermediate], the norms' float32 copies, RoPE's temporaries at long sequences), with the nnx
modules' parameters passed in.
"""

from __future__ import annotations

from typing import Callable

import jax
from flax import nnx
from jax.sharding import Mesh

from basp_jax.tiling import map_token_chunks


def map_module_chunks(fn: Callable, modules: tuple, xs: tuple, *, mesh: Mesh | None,
                      chunk_tokens: int, dtype):
    """fn(modules, *xs_chunk) over chunks of each device's tokens (map_token_chunks), with the
    nnx modules' parameters passed in (cast to the compute dtype first, as every layer casts at
    use, so stored-sharded weights are gathered in it). None entries of `modules` stay None."""
    split = [None if m is None else nnx.split(m) for m in modules]
    weights = [None if p is None else jax.tree.map(lambda a: a.astype(dtype), p[1])
               for p in split]
    graphdefs = [None if p is None else p[0] for p in split]

    def apply(chunk, weights):
        merged = tuple(None if g is None else nnx.merge(g, w) for g, w in zip(graphdefs, weights))
        return fn(merged, *chunk)

    return map_token_chunks(apply, tuple(xs), weights, mesh=mesh, chunk_tokens=chunk_tokens)
