"""A model's layer parameters as a list, ('layers', i, ...), or stacked as models.Transformer
scans them: alike layers as one Block's [num_layers, ...] leaves ('layers', <name>, ...), layers
repeating a pattern of `period` kinds as a Period's ('layers', 'blocks', j, ...) [num_layers /
period, ...] leaves (slice r of block j is layer r * period + j). The conversions between the
two, on pure dicts of arrays (the parameters, or an optimizer state's trees shaped like them), so
a checkpoint written with one layout reads into the other."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .transformer import PERIOD_BLOCKS


def is_list(layers: dict) -> bool:
    """Whether a 'layers' subtree holds one entry per layer (integer keys)."""
    return bool(layers) and all(isinstance(k, int) for k in layers)


def _stack_leaves(*xs):
    return jnp.stack(xs)


def _take(x, r):
    return x[r]


def stack(layers: dict, period: int, combine=_stack_leaves) -> dict:
    """{i: layer i's tree} -> the stack by `period` (1: a Block's stack). combine: makes one
    leaf of the layers' leaves (default: jnp.stack)."""
    count = len(layers)
    if period < 1 or count % period:
        raise ValueError(f"a stack by period {period} needs a multiple of {period} layers, got "
                         f"{count}")

    def stacked(indices):
        return jax.tree.map(combine, *[layers[i] for i in indices])

    if period == 1:
        return stacked(range(count))
    return {PERIOD_BLOCKS: {j: stacked(range(j, count, period)) for j in range(period)}}


def unstack(stacked: dict, take=_take) -> dict:
    """The stack (by period, or a Block's) -> {i: layer i's tree}. take(leaf, r): a leaf's
    slice r (default: leaf[r])."""
    blocks = stacked[PERIOD_BLOCKS] if PERIOD_BLOCKS in stacked else {0: stacked}
    period = len(blocks)
    repeats = jax.tree.leaves(blocks[0])[0].shape[0]
    return {r * period + j: jax.tree.map(lambda x, r=r: take(x, r), blocks[j])
            for r in range(repeats) for j in range(period)}


def restack(tree, period: int | None, combine=_stack_leaves, take=_take):
    """Every 'layers' dict in `tree` (nested anywhere, through dicts, lists and tuples: an
    optimizer state's moments) in the layout of `period`: stacked by it, or a list where
    period is None. combine, take: as stack's and unstack's."""
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            if key == "layers" and isinstance(value, dict) and value:
                listed = value if is_list(value) else unstack(value, take)
                out[key] = listed if period is None else stack(listed, period, combine)
            else:
                out[key] = restack(value, period, combine, take)
        return out
    if isinstance(tree, (list, tuple)):
        items = [restack(v, period, combine, take) for v in tree]
        if hasattr(tree, "_fields"):  # a NamedTuple (optax's states)
            return type(tree)(*items)
        return type(tree)(items)
    return tree
