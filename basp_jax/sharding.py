"""Parameter shardings on a ('group', 'seq') mesh.

    fsdp:       every parameter sharded over the whole mesh (ZeRO-3 style, the paper's setting)
    hsdp:       sharded over 'seq' only, replicated across groups: gathers stay inside a seq group
                (inside a host) and the cross-group gradient reduction runs on 1/sp shards
    host:       sharded over the devices of one host, replicated across hosts, whatever the seq
                group size: gathers never leave a host and each gradient element crosses hosts
                once, as a 1/(devices per host) shard (reduce-scatter inside the host, all-reduce
                of the shard across hosts). Needs devices_per_host.
    replicated: every device holds everything (small models, debugging); never the default

One dimension per parameter is sharded: the largest one divisible by the axis size (ties go to
the earlier dimension), or none when no dimension divides (a small bias stays replicated).

The host strategy places parameters on a second mesh over the same devices in the same order,
('host', 'local') of shape (hosts, devices per host): a host is a run of consecutive devices of
the ('group', 'seq') mesh (basp_jax.mesh orders them host-major), which no PartitionSpec of that
mesh can name when a host holds part of the 'group' axis. XLA sees only device assignments, so
the two meshes mix freely in one program.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .mesh import GROUP, SEQ

STRATEGIES = ("fsdp", "hsdp", "host", "replicated")
# A dimension at least 1/MAJOR_RATIO of the largest is "large": hidden vs MLP width is 2.7-5.4x
# in Llama/Qwen (4096 vs 14336, 2048 vs 11008); vocabularies are 7.8x the hidden size and more
# (32000 vs 4096 to 151936 vs 896), and stacked layer counts far smaller, so they stay apart.
MAJOR_RATIO = 6
HOST, LOCAL = "host", "local"


def host_mesh(mesh: Mesh, devices_per_host: int) -> Mesh:
    """The mesh's devices as ('host', 'local'): one row per host (consecutive devices)."""
    n = mesh.devices.size
    if devices_per_host <= 0 or n % devices_per_host:
        raise ValueError(f"devices_per_host={devices_per_host} does not divide the mesh's {n} "
                         f"devices; use one of {[d for d in range(1, n + 1) if n % d == 0]}")
    grid = np.asarray(mesh.devices).reshape(n // devices_per_host, devices_per_host)
    return Mesh(grid, (HOST, LOCAL), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _strategy_axes(strategy: str):
    if strategy == "fsdp":
        return (GROUP, SEQ)
    if strategy == "hsdp":
        return SEQ
    if strategy == "host":
        return LOCAL
    if strategy == "replicated":
        return None
    raise ValueError(f"unknown parameter sharding {strategy!r}; use one of {', '.join(STRATEGIES)}")


def _placement_mesh(mesh: Mesh, strategy: str, devices_per_host: int | None) -> Mesh:
    if strategy != "host":
        return mesh
    if devices_per_host is None:
        raise ValueError("param_sharding='host' needs devices_per_host (the devices of one host)")
    return host_mesh(mesh, devices_per_host)


def param_spec(shape: tuple[int, ...], mesh: Mesh, strategy: str,
               devices_per_host: int | None = None) -> P:
    """The PartitionSpec of one parameter of `shape` under `strategy` (on the ('host', 'local')
    mesh for strategy='host', basp_jax.sharding.host_mesh)."""
    axes = _strategy_axes(strategy)
    if axes is None:
        return P()
    mesh = _placement_mesh(mesh, strategy, devices_per_host)
    names = axes if isinstance(axes, tuple) else (axes,)
    size = 1
    for name in names:
        size *= mesh.shape[name]
    if size == 1:
        return P()
    candidates = [i for i, n in enumerate(shape) if n % size == 0]
    if not candidates:
        return P()
    # The major-most of the large dimensions: a gather or scatter along a minor one makes XLA
    # transpose the whole stacked parameter first (0.9 GiB per MLP matrix of an 8B model).
    largest = max(shape[i] for i in candidates)
    dim = min(i for i in candidates if shape[i] * MAJOR_RATIO >= largest)
    spec = [None] * len(shape)
    spec[dim] = axes
    return P(*spec)


def param_sharding(shape: tuple[int, ...], mesh: Mesh, strategy: str,
                   devices_per_host: int | None = None) -> NamedSharding:
    spec = param_spec(tuple(shape), mesh, strategy, devices_per_host)
    return NamedSharding(_placement_mesh(mesh, strategy, devices_per_host), spec)


def tree_shardings(tree, mesh: Mesh, strategy: str, devices_per_host: int | None = None):
    """NamedShardings for every array (or ShapeDtypeStruct) leaf of a pytree of parameters."""
    placement = _placement_mesh(mesh, strategy, devices_per_host)  # one Mesh for every leaf
    return jax.tree.map(
        lambda x: NamedSharding(placement, param_spec(tuple(x.shape), mesh, strategy,
                                                      devices_per_host)), tree)


def abstract_arrays(tree, shardings=None):
    """ShapeDtypeStructs of the array leaves of `tree` carrying `shardings`: a pytree of
    shardings like `tree`, one Sharding for every leaf, or None (no sharding). A restore or
    compile target that lands directly on the mesh."""
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings),
                            tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)
