"""Where arrays live on a ('group', 'seq') mesh: one table from logical axis names to mesh axes.

Every parameter names its axes (models/layers.py); activations are named here. The table, RULES,
says for each logical axis whether it is split, and a parameter strategy says over which mesh
axes parameters are split:

    fsdp:       over the whole mesh, ('group', 'seq') (ZeRO-3 style, the paper's setting)
    hsdp:       over 'seq' only, replicated across groups: gathers stay inside a seq group
                (inside a host) and the cross-group gradient reduction runs on 1/sp shards
    host:       over the devices of one host, replicated across hosts, whatever the seq group
                size: gathers never leave a host and each gradient element crosses hosts once,
                as a 1/(devices per host) shard (reduce-scatter inside the host, all-reduce of
                the shard across hosts). Needs devices_per_host.
    staged:     over the whole mesh like fsdp (FSDP's memory), gathered in two stages where a
                layer is used: across hosts only the 1/N pieces a host lacks (stage), then
                inside the host; gradients reduce-scattered inside the host, then across hosts
                on 1/N shards. The cross-host gather runs again for the recomputed backward.
                The vocabulary tables stay where fsdp stores them (Strategy.tables).
    staged_keep: staged, keeping each layer's host-local copy from the forward for the
                recomputed backward (ZeRO++'s hpZ): the backward gathers inside the host
                only, for 1/(devices per host) of the layers' parameters more memory. With
                several microbatches the step gathers the copies once for all of them
                (train.program.step); their gradients cross hosts once a step where each
                BASP group is one host (sums_per_host), else once per microbatch.
                The vocabulary tables are staged too, to a host-local copy split on the
                vocabulary inside the host, and used there (basp_jax.vocab): the tokens' rows
                move inside the host (for many tokens per device the copy is used whole), and
                each table crosses hosts as 1/N pieces.
    replicated: nowhere: every device holds everything (small models, debugging); never the default

ShardingRules(strategy, mesh) turns names into PartitionSpecs and NamedShardings; it refuses a
parameter whose names put one mesh axis on two of its dimensions. A split dimension the axis
size does not divide (a tiny test vocabulary) falls back to the parameter's first other
dimension it divides, never the layer stack; a parameter none divides stays whole.

The host and staged strategies place parameters on a second mesh over the same devices in the
same order, ('host', 'local') of shape (hosts, devices per host): a host is a run of consecutive
devices of the ('group', 'seq') mesh (basp_jax.mesh orders them host-major), which no
PartitionSpec of that mesh can name when a host holds part of the 'group' axis. XLA sees only
device assignments, so the two meshes mix freely in one program.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .layout import divisors
from .mesh import GROUP, SEQ, groups_are_mapped
from .param_use import ParamUse
from .registry import Registry

HOST, LOCAL = "host", "local"


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A parameter sharding strategy: where parameters are stored, and where layers use them.
    `layout` below is a basp_jax.Layout (its sizes only). How the planner weighs a strategy
    (whether it tries it, in which order, how it prices its gradient reduction) is the
    planner's (basp_jax.planner.strategies).

    split_axes: the axes of its placement mesh a split parameter axis goes to.
    shard_devices(layout): how many devices share (shard) each parameter.
    per_host: placed on the ('host', 'local') mesh (host_mesh), so it needs devices_per_host;
        its gathers never leave a host.
    vocab_parallel: the embedding and LM head can be used where they are stored (split on the
        vocabulary over the compute mesh's axes: basp_jax.vocab).
    use: where and when a layer's parameters are gathered before use (basp_jax.param_use).
    tables: the strategy the vocabulary tables (parameters with a 'vocab' axis) follow
        instead, or None (this one). `staged` leaves them where fsdp stores them
        (vocabulary-parallel over every device): its streamed step (train.program.streamed)
        does not compile with staged tables on jaxlib 0.12, whose partitioner aborts.
    """

    split_axes: tuple[str, ...]
    shard_devices: Callable[..., int]
    per_host: bool = False
    vocab_parallel: bool = False
    use: ParamUse = ParamUse()
    tables: str | None = None

    @property
    def staged(self) -> bool:
        """Whether layers gather their parameters before use (a ParamUse with axes)."""
        return self.use.gathers

    @property
    def holds_host_copy(self) -> bool:
        """Whether each host holds a device copy of the layers' weights for the step: stored
        per host, or gathered to a host-local copy kept on the device."""
        return self.per_host and (not self.staged or self.use.copy == "device")

    @property
    def streams(self) -> bool:
        """Whether the streamed step (train.program.streamed: weights in host memory, copied in
        a layer at a time, again for the backward) can use it: not with per-host device copies
        of the weights (what streaming avoids), nor with a copy kept for the backward."""
        return self.use.copy is None and not (self.per_host and not self.staged)


PARAM_SHARDINGS: Registry[Strategy] = Registry("parameter sharding")
PARAM_SHARDINGS.register("fsdp", Strategy((GROUP, SEQ), lambda layout: layout.num_devices,
                                          vocab_parallel=True))
PARAM_SHARDINGS.register("hsdp", Strategy((SEQ,), lambda layout: layout.sp, vocab_parallel=True))
PARAM_SHARDINGS.register("host", Strategy(
    (LOCAL,), lambda layout: min(layout.devices_per_host, layout.num_devices), per_host=True))
# Stored as fsdp, gathered across hosts to a host-local copy: staged_keep keeps that copy for
# the backward on the device, staged_offload in host memory, staged nowhere (gathered again).
for _name, _copy in (("staged_keep", "device"), ("staged_offload", "host"), ("staged", None)):
    PARAM_SHARDINGS.register(_name, Strategy(
        (LOCAL, HOST), lambda layout: layout.num_devices, per_host=True,
        use=ParamUse(axes=(LOCAL,), copy=_copy), tables="fsdp" if _copy is None else None))
PARAM_SHARDINGS.register("replicated", Strategy((), lambda layout: 1))


def needs_devices_per_host(param_sharding: str) -> bool:
    """Whether a strategy places parameters per host (Strategy.per_host), so its rules need the
    devices of one host. A ValueError names the choices for an unknown one."""
    return PARAM_SHARDINGS.get(param_sharding).per_host


DEFAULT_STRATEGY = "fsdp"  # parameters' placement unless told otherwise (models.RunOptions)
SPLIT = "split"  # in RULES: split over the strategy's parameter axes

# The one table. One axis of each parameter is split: the major axis of each matrix (a gather or
# scatter along a minor one makes XLA transpose the whole stacked parameter first: BENCHMARKS.md
# section 6, "Figures behind design choices") and the vocabulary wherever it is, so the embedding and the LM head
# are used where they are stored (basp_jax.vocab). Activations: rows over groups, the
# sequence over the devices of a group; an axis not named here (hidden, heads) is whole.
RULES: dict[str, str | None] = {
    # parameters
    "layers": None,          # the stacked layer axis (scan_layers): every device has every layer
    "vocab": SPLIT,          # embedding rows, LM-head columns
    "embed": None,           # the model width of the tables and of o_proj's, down_proj's outputs
    "qkv_embed": SPLIT,      # q/k/v_proj inputs [embed, heads * head_dim]
    "q_heads": None,         # q_proj outputs and bias
    "kv_heads": None,        # k/v_proj outputs and biases
    "o_heads": SPLIT,        # o_proj input [heads * head_dim, embed]
    "mlp_up_embed": SPLIT,   # gate/up_proj inputs [embed, mlp]
    "mlp_up": None,          # gate/up_proj outputs
    "mlp_down": SPLIT,       # down_proj input [mlp, embed]
    "norm": SPLIT,           # RMSNorm weights [embed]
    "head_dim": SPLIT,       # q/k norm weights [head_dim] (Qwen3)
    # a sparse MLP's expert weights [experts, in, out] (models.moe) split on the expert axis, as
    # the experts split over a seq group use them (a slice of the stored shards' axis, not a
    # transpose of every expert); the router's [embed, experts] output axis is whole
    "expert": SPLIT,
    "expert_in": None,
    "expert_out": None,
    "router": None,
    # activations [batch, sequence, ...]
    "batch": GROUP,
    "sequence": SEQ,
}
# A flat token axis over the whole mesh, group-major: each device's slice is the tokens it holds.
TOKENS = ("batch", "sequence")


def sums_per_host(param_sharding: str, layout, grad_accum: int) -> bool:
    """Whether a step of grad_accum microbatches keeps each host's gradient sum apart until it
    ends, so gradients cross hosts once a step (train.program.per_group): each BASP group is
    one host (sp equals the devices per host, more than one group) and the strategy holds a
    host-local copy of the weights for the step anyway (host; staged_keep). Not with a ring,
    whose all-to-alls among parts of a group jax.vmap cannot map over the groups.

    With one microbatch there is no sum to keep, and the copies' gradients wait for the step's
    end, 1/(devices per host) of them in the compute dtype, where the plain step reduces each
    layer's as it comes onto float32 1/N shards: as much memory on 2 hosts, more on more
    (BENCHMARKS.md section 6, "Figures behind design choices"). staged_keep keeps them on 2
    hosts all the same, for the written-out reduce-scatter (the same bytes in the GPU program,
    half in the CPU one)."""
    entry = PARAM_SHARDINGS.get(param_sharding)
    if not (entry.holds_host_copy and layout.groups > 1 and layout.sp == layout.devices_per_host
            and layout.ring == 1):
        return False
    return grad_accum > 1 or (entry.use.copy == "device" and layout.groups == 2)


def host_mesh(mesh: Mesh, devices_per_host: int) -> Mesh:
    """The mesh's devices as ('host', 'local'): one row per host (consecutive devices)."""
    n = mesh.devices.size
    if devices_per_host <= 0 or n % devices_per_host:
        raise ValueError(f"devices_per_host={devices_per_host} does not divide the mesh's {n} "
                         f"devices; use one of {divisors(n)}")
    grid = np.asarray(mesh.devices).reshape(n // devices_per_host, devices_per_host)
    return Mesh(grid, (HOST, LOCAL), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _mesh_axes(name: str, split: tuple[str, ...]) -> tuple[str, ...]:
    """The mesh axes logical axis `name` goes to (() when it is whole)."""
    if name not in RULES:
        raise ValueError(f"logical axis {name!r} is not in basp_jax.sharding.RULES; name the "
                         f"axis with one of {', '.join(RULES)} (or None for a whole axis)")
    rule = RULES[name]
    return split if rule == SPLIT else (() if rule is None else (rule,))


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _resolve(names, split: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The mesh axes of each dimension; refuses one mesh axis on two dimensions."""
    out, seen = [], {}
    for dim, entry in enumerate(names):
        logical = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        axes = tuple(a for name in logical for a in _mesh_axes(name, split))
        for a in axes:
            if a in seen:
                raise ValueError(
                    f"logical axes {names[seen[a]]!r} and {entry!r} of {tuple(names)} both map to "
                    f"mesh axis {a!r}; change basp_jax.sharding.RULES so one of them is whole")
            seen[a] = dim
        out.append(axes)
    return out


def activation_spec(*names) -> P:
    """The PartitionSpec of an activation whose axes have these logical names (None: whole; a
    tuple: one flat axis over several), e.g. activation_spec('batch', 'sequence', None).
    Under groups_mapped, without 'group'."""
    axes = _resolve(names, ())
    if groups_are_mapped():
        axes = [tuple(a for a in dim if a != GROUP) for dim in axes]
    return P(*(_entry(dim) for dim in axes))


def rows_spec() -> P:
    """[B, S] activations' PartitionSpec as traced now (ACTIVATION_SPEC outside groups_mapped)."""
    return activation_spec("batch", "sequence")


# [B, S, ...] activations: rows over groups, sequence over the devices of a seq group.
ACTIVATION_SPEC = activation_spec("batch", "sequence")


def activation_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of [B, S, ...] activations and [B, S] token/segment arrays."""
    return NamedSharding(mesh, rows_spec())


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """RULES under one parameter strategy on one ('group', 'seq') mesh (devices_per_host: the
    devices of one host, needed by strategy='host')."""

    strategy: str
    mesh: Mesh
    devices_per_host: int | None = None

    def __post_init__(self):
        if self.entry.per_host and self.devices_per_host is None:
            raise ValueError(f"param_sharding={self.strategy!r} needs devices_per_host (the "
                             "devices of one host)")

    @property
    def entry(self) -> Strategy:
        return PARAM_SHARDINGS.get(self.strategy)  # (a ValueError naming the choices)

    @property
    def per_host(self) -> bool:
        """Whether parameters live on the ('host', 'local') mesh, one copy per host."""
        return self.entry.per_host

    @functools.cached_property
    def placement(self) -> Mesh:
        """The mesh parameters are placed on: ('host', 'local') for a per-host strategy, else
        the mesh."""
        if self.entry.per_host:
            return host_mesh(self.mesh, self.devices_per_host)
        return self.mesh

    @property
    def split_axes(self) -> tuple[str, ...]:
        """The mesh axes of `placement` that a split parameter axis goes to."""
        return self.entry.split_axes

    @functools.cached_property
    def _table_rules(self) -> "ShardingRules":
        return ShardingRules(self.entry.tables, self.mesh, self.devices_per_host)

    def for_names(self, names) -> "ShardingRules":
        """The rules that place a parameter whose axes are named `names`: the tables'
        strategy's for a vocabulary table (Strategy.tables), else these."""
        if self.entry.tables is None or "vocab" not in names:
            return self
        return self._table_rules

    def spec(self, names, shape) -> P:
        """The PartitionSpec of a parameter of `shape` whose axes are named `names`."""
        rules = self.for_names(names)
        if rules is not self:
            return rules.spec(names, shape)
        if len(names) != len(shape):
            raise ValueError(f"a parameter of shape {tuple(shape)} has {len(names)} axis names "
                             f"{tuple(names)}; name every axis")
        split = self.split_axes
        dims = _resolve(names, split)
        size = int(np.prod([self.placement.shape[a] for a in split], dtype=np.int64))
        chosen = [i for i, axes in enumerate(dims) if axes]
        if size == 1 or not chosen:
            return P()
        if all(shape[i] % size == 0 for i in chosen):
            return P(*(_entry(axes) for axes in dims))
        # The split dimension does not divide: the first other one that does, not the layers.
        for i, n in enumerate(shape):
            if names[i] != "layers" and n % size == 0:
                return P(*(_entry(split) if j == i else None for j in range(len(shape))))
        return P()

    def sharding(self, names, shape) -> NamedSharding:
        rules = self.for_names(names)
        return NamedSharding(rules.placement, rules.spec(names, shape))

    @property
    def staged(self) -> bool:
        """Whether parameters are gathered (across hosts, for the staged strategies) before use."""
        return self.entry.staged

    @property
    def use(self) -> ParamUse:
        """Where and when layers gather their parameters (basp_jax.param_use)."""
        return self.entry.use

    def use_spec(self, names, shape) -> P:
        """The PartitionSpec a parameter is used in: the stored one, less the axes a staged
        strategy gathers across hosts (the same dimension, so the gather moves only the pieces
        a host lacks)."""
        spec = self.spec(names, shape)
        if not self.staged or self.for_names(names) is not self:
            return spec
        keep = set(self.entry.use.axes)

        def kept(entry):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            return _entry(tuple(a for a in axes if a in keep))

        return P(*(kept(e) for e in spec))

    def stage(self, x: jax.Array, names, dtype=None) -> jax.Array:
        """A parameter as its layer uses it, in `dtype` (default: its own): under a staged
        strategy gathered across hosts to its host-local copy (use_spec), whose gradient is
        summed inside the host, then reduce-scattered across hosts onto the stored 1/N shards;
        else x itself."""
        if dtype is not None:
            x = x.astype(dtype)  # cast first: the gather (and a kept copy) moves fewer bytes
        if not self.staged or self.for_names(names) is not self:
            return x
        return self.entry.use.gather(self, x, names)

    def shardings(self, names, tree):
        """NamedShardings for the array (or ShapeDtypeStruct) leaves of `tree`, from `names`: a
        pytree like `tree` with each leaf's tuple of axis names (models.param_names)."""
        return jax.tree.map(lambda x, n: self.sharding(n, x.shape), tree, names)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())


def abstract_arrays(tree, shardings=None):
    """ShapeDtypeStructs of the array leaves of `tree` carrying `shardings`: a pytree of
    shardings like `tree`, one Sharding for every leaf, or None (no sharding). A restore or
    compile target that lands directly on the mesh."""
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings),
                            tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)
