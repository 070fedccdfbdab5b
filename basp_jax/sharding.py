"""Parameter shardings on a ('group', 'seq') mesh.

    fsdp:       every parameter sharded over the whole mesh (ZeRO-3 style, the paper's setting)
    hsdp:       sharded over 'seq' only, replicated across groups: gathers stay inside a seq group
                (inside a host) and the cross-group gradient reduction runs on 1/sp shards
    replicated: every device holds everything (small models, debugging); never the default

One dimension per parameter is sharded: the largest one divisible by the axis size (ties go to
the earlier dimension), or none when no dimension divides (a small bias stays replicated).
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .mesh import GROUP, SEQ

STRATEGIES = ("fsdp", "hsdp", "replicated")


def _strategy_axes(strategy: str):
    if strategy == "fsdp":
        return (GROUP, SEQ)
    if strategy == "hsdp":
        return SEQ
    if strategy == "replicated":
        return None
    raise ValueError(f"unknown parameter sharding {strategy!r}; use one of {', '.join(STRATEGIES)}")


def param_spec(shape: tuple[int, ...], mesh: Mesh, strategy: str) -> P:
    """The PartitionSpec of one parameter of `shape` under `strategy`."""
    axes = _strategy_axes(strategy)
    if axes is None:
        return P()
    names = axes if isinstance(axes, tuple) else (axes,)
    size = 1
    for name in names:
        size *= mesh.shape[name]
    if size == 1:
        return P()
    candidates = [i for i, n in enumerate(shape) if n % size == 0]
    if not candidates:
        return P()
    dim = max(candidates, key=lambda i: (shape[i], -i))
    spec = [None] * len(shape)
    spec[dim] = axes
    return P(*spec)


def param_sharding(shape: tuple[int, ...], mesh: Mesh, strategy: str) -> NamedSharding:
    return NamedSharding(mesh, param_spec(tuple(shape), mesh, strategy))


def tree_shardings(tree, mesh: Mesh, strategy: str):
    """NamedShardings for every array (or ShapeDtypeStruct) leaf of a pytree of parameters."""
    return jax.tree.map(lambda x: param_sharding(x.shape, mesh, strategy), tree)
