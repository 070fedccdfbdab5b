"""Vocabulary tables on the mesh: the embedding lookup of a [vocab, embed] table and the chunked
LM loss of a head, placed as a parameter strategy (basp_jax.sharding.ShardingRules) says.

Model-agnostic: a model describes each table once (Table: its logical axis names, shape, the
run's ShardingRules) and calls Table.lookup and Table.loss; which path runs is the strategy's
answer, never the model's:

- the vocabulary split over mesh axes (fsdp, hsdp: Strategy.vocab_parallel): the table is used
  where it is stored (parallel_lookup, parallel_loss, below);
- one copy per host (a per-host strategy, Strategy.per_host: host_copies): the lookup's and the
  loss's gradients are summed inside each host, then cross hosts once as the shards the hosts
  store (1/(devices per host) under host sharding, 1/N under a staged strategy). A staged
  strategy's copy keeps the vocabulary split over the host's devices and is used there
  (parallel_lookup and parallel_loss on the host mesh, over 'local': the tokens' rows move
  inside the host only) where a device's tokens are few enough (prefer_vocab_parallel); the
  host strategy's, and a staged one's for more tokens, is gathered whole inside the host
  (_lookup_per_host, _per_host_chunks);
- otherwise the table is gathered and every device loops over its own tokens
  (chunked_lm_loss, _per_device_chunks).

The split vocabulary, in detail:
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

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .mesh import SEQ, checks_varying_axes, device_varying, row_groups, unmapped_axes
from .sharding import HOST, LOCAL, TOKENS, ShardingRules, activation_spec, rows_spec
from .tiling import chunk_len, token_chunks


def flat_spec() -> P:
    """A flat token axis over the whole mesh, group-major (over 'seq' only under
    basp_jax.mesh.groups_mapped)."""
    return activation_spec(TOKENS)


# Tokens per device whose logits exist at once in chunked_lm_loss (and parallel_loss): small,
# because a float32 chunk of logits over a whole vocabulary is large and larger chunks held more
# buffers at once; more, smaller chunks cost no FLOPs, only more (small) collectives (BENCHMARKS.md,
# "Figures behind design choices").
LOSS_CHUNK_TOKENS = 128

# Tokens per device above which the gathering embedding and loss cost too much memory whatever
# they save in bytes: their float32 [tokens, hidden] rows and whole float32 tables and gradients
# (BENCHMARKS.md, "Figures behind design choices").
GATHER_MAX_TOKENS_PER_DEVICE = 65536


def prefer_vocab_parallel(tokens_per_device: float, shard_group: int, vocab_size: int,
                          tied: bool) -> bool:
    """Whether the embedding and loss should move the tokens' rows (this module) rather than
    gather the vocabulary tables: where that sends fewer bytes, or where the gathering path's
    memory would grow too large (GATHER_MAX_TOKENS_PER_DEVICE). Rows: ~12 x
    tokens x hidden bytes over the shard group (the embedding's rows and cotangent, the loss's
    hidden states gathered forward and again rematerialised, their f32 cotangent); tables: ~8 x
    vocab x hidden bytes per table (bf16 gathers forward and backward, an f32 gradient). Rows
    send less below 2/3 x vocab tokens per shard group with a tied table, 4/3 x vocab untied."""
    tables = 1 if tied else 2
    return (12 * tokens_per_device * shard_group < 8 * vocab_size * tables
            or tokens_per_device > GATHER_MAX_TOKENS_PER_DEVICE)


def vocab_axes(names: tuple[str, ...], shape: tuple[int, ...],
               rules: ShardingRules | None) -> tuple[str, ...] | None:
    """The mesh axes the 'vocab' axis of a parameter (axis `names`, `shape`) is stored split
    over, or None when the vocabulary is not what is split (then the plain, gathering
    computation applies): no mesh, replicated, host sharding (its own per-host path), or a
    vocabulary no axis size divides."""
    if rules is not None:
        rules = rules.for_names(names)
    if rules is None or not rules.entry.vocab_parallel:
        return None
    spec = tuple(rules.spec(names, shape))
    spec = spec + (None,) * (len(shape) - len(spec))
    vocab_dim = names.index("vocab")
    axes = spec[vocab_dim]
    if axes is None or any(s is not None for i, s in enumerate(spec) if i != vocab_dim):
        return None
    return axes if isinstance(axes, tuple) else (axes,)


# parallel_lookup gathers its rows (shards x tokens x embed, float32 per device) in one
# piece up to LOOKUP_WHOLE_BYTES, where XLA fuses the lookup into the reduce-scatter (chunks
# would cost more there), and in chunks of LOOKUP_CHUNK_BYTES beyond, where the whole rows would
# not fit (BENCHMARKS.md, "Figures behind design choices").
LOOKUP_WHOLE_BYTES = 2**36
LOOKUP_CHUNK_BYTES = 2**30

# when a table split on its vocabulary is used where it is stored (Table.mode)
MODES = ("auto", "always", "never")


def active_axes(axes: tuple[str, ...] | None, mesh: Mesh, num_tokens: int, vocab_size: int, *,
                tied: bool, mode: str) -> tuple[str, ...] | None:
    """`axes` when the vocabulary-parallel path should run for `num_tokens` tokens of the whole
    mesh, else None (gather the table instead). "auto": prefer_vocab_parallel
    (where it moves fewer bytes, up to ~2/3 x vocab tokens per shard group tied, and at long
    sequences, where the gathering path's float32 rows and tables would cost the most memory)."""
    if axes is None or mode == "never":
        return None
    if mode == "always":
        return axes
    shard_group = _shard_count(mesh, axes)
    per_device = num_tokens / mesh.size
    return axes if prefer_vocab_parallel(per_device, shard_group, vocab_size, tied) else None


def _shard_count(mesh: Mesh, axes: tuple[str, ...]) -> int:
    """How many devices the vocabulary is split over."""
    return math.prod(mesh.shape[name] for name in axes)


def _shard_index(axes: tuple[str, ...]) -> jax.Array:
    """This device's position along `axes` (row-major, as all_gather over `axes` orders it)."""
    index = 0
    for name in axes:
        index = index * lax.axis_size(name) + lax.axis_index(name)
    return index


def parallel_lookup(table: jax.Array, flat_tokens: jax.Array, *, mesh: Mesh,
                    axes: tuple[str, ...], dtype, per_host: bool = False) -> jax.Array:
    """table [vocab, embed] (sharded over `axes` on vocab), flat_tokens [T] sharded over the whole
    mesh (group-major) -> rows [T, embed] in `dtype`, sharded like the tokens. per_host: `mesh`
    is the host mesh and table [hosts, vocab, embed] one copy per host (host_copies) split over
    `axes` inside it; the rows move inside each host only."""

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
        # rows this shard holds would be stacked over the chunks
        remat_chunk = jax.checkpoint(chunk)
        out = lax.map(lambda t: remat_chunk(table, t), tokens.reshape(-1, c))
        return out.reshape(local_tokens, -1)

    if not per_host:
        return jax.shard_map(local, mesh=mesh, in_specs=(P(axes, None), flat_spec()),
                             out_specs=activation_spec(TOKENS, None))(table, flat_tokens)
    tokens = P((HOST, LOCAL))  # the flat order is host-major (basp_jax.mesh): a relabelling
    flat_tokens = jax.lax.with_sharding_constraint(flat_tokens, NamedSharding(mesh, tokens))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        # this host's copy, looked up in float32 so that its gradient adds up in float32
        return jax.shard_map(lambda t, x: local(t[0].astype(jnp.float32), x), mesh=mesh,
                             in_specs=(P(HOST, axes, None), tokens),
                             out_specs=P((HOST, LOCAL), None))(table, flat_tokens)


def parallel_loss(hidden: jax.Array, targets: jax.Array, weight: jax.Array, *, mesh: Mesh,
                  axes: tuple[str, ...], vocab_dim: int, dtype, chunk_tokens: int,
                  host_mesh: Mesh | None = None):
    """The next-token cross-entropy of hidden @ weight (targets < 0 not counted), as (sum,
    count) float32, with weight's vocabulary sharded over `axes`: weight [embed, vocab]
    (vocab_dim=1, an LM head) or [vocab, embed] (vocab_dim=0, tied to the embedding). hidden [B, S, D] and targets [B, S] are sharded
    P('group', 'seq'). A chunk takes at most chunk_tokens of each device's tokens, as
    chunked_lm_loss: gathered over the shards, its float32 logits are as large
    (chunk_tokens x shards tokens x vocab / shards); the scan rematerialises them backward.
    host_mesh: weight is host_copies of a staged table, split over `axes` of the host mesh
    inside each host; the hidden states are gathered inside the host only."""
    b, s, d = hidden.shape
    groups, sp = row_groups(mesh), mesh.shape[SEQ]
    local_len, rows = s // sp, b // groups
    c = chunk_len(local_len, rows, chunk_tokens)
    w_spec = P(axes, None) if vocab_dim == 0 else P(None, axes)
    if host_mesh is None:
        hs, ts = token_chunks(hidden, targets, sp, c)
        spec = activation_spec(None, "batch", "sequence")  # [chunk, B, S]
    else:  # [chunk, hosts, local, tokens]: each device's own tokens, host-major (no moves)
        hs, ts = (_host_chunks(x, mesh, host_mesh, rows * c) for x in (hidden, targets))
        mesh, spec, w_spec = host_mesh, P(None, HOST, LOCAL), P(HOST, *w_spec)
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
        if host_mesh is not None:  # this host's copy (its gradient summed over the chunks in
            # float32); the device's tokens [chunk, tokens, D]
            w, hs, ts = w[0].astype(jnp.float32), hs.reshape(hs.shape[0], -1, d), ts.reshape(
                ts.shape[0], -1)
        _, (totals, counts) = lax.scan(lambda _, xs: (None, chunk_loss(*xs, w)), None, (hs, ts))
        return totals.sum()[None], counts.sum()[None]

    every = flat_spec() if host_mesh is None else P((HOST, LOCAL))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        total, count = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, w_spec),
                                     out_specs=(every, every))(hs, ts, weight)
    return total.sum(), count.sum()


def _host_chunks(x: jax.Array, mesh: Mesh, host_mesh: Mesh, c: int) -> jax.Array:
    """x [B, S, ...] sharded P('group', 'seq') -> [n, hosts, devices per host, c, ...] on the
    host mesh: chunk i holds tokens i*c..(i+1)*c-1 of every device's own tokens (a relabelling)."""
    x = host_major(x, mesh, host_mesh)  # [hosts, tokens per host, ...]
    hosts, local = host_mesh.shape[HOST], host_mesh.shape[LOCAL]
    rest = x.shape[2:]
    n = x.shape[1] // local // c
    x = jnp.moveaxis(x.reshape(hosts, local, n, c, *rest), 2, 0)
    spec = P(None, HOST, LOCAL, *([None] * (1 + len(rest))))
    return jax.lax.with_sharding_constraint(x, NamedSharding(host_mesh, spec))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def cotangent_sharding(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """The identity, whose cotangent is constrained to `sharding` (where a sum must happen)."""
    return x


def _cotangent_sharding_fwd(x, sharding):
    return x, None


def _cotangent_sharding_bwd(sharding, _, g):
    return (jax.lax.with_sharding_constraint(g, sharding),)


cotangent_sharding.defvjp(_cotangent_sharding_fwd, _cotangent_sharding_bwd)


def host_copies(w: jax.Array, names: tuple[str, ...], rules: ShardingRules) -> jax.Array:
    """[hosts, *w.shape]: one copy of a host-sharded parameter per host (no data moves). Host h's
    tokens use copy h; every use's cotangent is summed into the host's shards (the constraint),
    and the broadcast's transpose sums the hosts' shards once: 1/(devices per host) of the
    gradient crosses hosts, however many uses and loop iterations contributed."""
    spec = rules.use_spec(names, w.shape)  # as a layer uses it: staged, less the host axis
    hosts = rules.placement.shape[HOST]
    per_host = NamedSharding(rules.placement, P(HOST, *spec))
    # placed as the host's shards forward too: a use that gathers the copy whole then gathers
    # it inside the host (else XLA may gather a staged table over every device at once)
    copies = jax.lax.with_sharding_constraint(jnp.broadcast_to(w, (hosts, *w.shape)), per_host)
    return cotangent_sharding(copies, per_host)


def host_major(x: jax.Array, mesh: Mesh, host_mesh: Mesh) -> jax.Array:
    """[B, S, ...] sharded P('group', 'seq') -> [hosts, B*S/hosts, ...]: row h holds exactly the
    tokens of host h's devices, in device order (a relabelling: nothing moves)."""
    b, s, rest = x.shape[0], x.shape[1], x.shape[2:]
    g, sp = row_groups(mesh), mesh.shape[SEQ]
    x = x.reshape(g, b // g, sp, s // sp, *rest)
    x = jnp.moveaxis(x, 2, 1).reshape(host_mesh.shape[HOST], -1, *rest)
    spec = P(HOST, LOCAL, *([None] * len(rest)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(host_mesh, spec))


def chunked_lm_loss(hidden: jax.Array, targets: jax.Array, project: Callable, weight: jax.Array,
                    loss_fn: Callable, *, mesh: Mesh | None = None,
                    chunk_tokens: int = LOSS_CHUNK_TOKENS, host_mesh: Mesh | None = None):
    """loss_fn(project(hidden, weight), targets) computed over chunks of tokens: the same
    (sum, count), but no [tokens, vocab] logits of the whole batch ever exist.

    hidden [B, S, D] (sharded P('group', 'seq', None) with `mesh`); project(h [..., D], weight) ->
    logits [..., V] float32; loss_fn(logits, targets) -> (sum, count) must add up over tokens
    (as a next-token cross-entropy does). The chunks are slices of every device's own tokens
    (chunk_tokens per device at most), so nothing moves between devices; a scan visits them with each chunk's
    projection and loss rematerialised, so the backward pass too holds one chunk's logits at a time.

    With a mesh, every device runs the loop over its own chunks with a whole copy of `weight`
    (_per_device_chunks): the weight's gradient is summed over the mesh once, after the loop.
    With `host_mesh` (a per-host strategy's placement), `weight` is host_copies of the
    projection: each host's devices run the loop with their host's copy (_per_host_chunks), so
    the copy is gathered inside the host once and its gradient crosses hosts once.
    """
    b, s, d = hidden.shape
    if targets.shape != (b, s):
        raise ValueError(f"hidden {hidden.shape} and targets {targets.shape} disagree on [batch, seq]")
    groups, sp = (1, 1) if mesh is None else (row_groups(mesh), mesh.shape[SEQ])
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
    all-reduce the whole [vocab, hidden] gradient once per chunk (BENCHMARKS.md, "Figures
    behind design choices")."""
    axes = unmapped_axes(mesh)
    loop = _device_loop(project, loss_fn, c, axes)

    def local(h, t, w):
        return loop(h, t, device_varying(w, axes))

    tokens = rows_spec()
    return jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, P()), out_specs=(P(), P()),
                         check_vma=checks_varying_axes())(hidden, targets, weight)


def _device_loop(project, loss_fn, c: int, axes: tuple[str, ...]):
    """The body both shard_maps run: (sum, count) of this device's tokens h, t in chunks of c,
    with its device-varying copy w of the weight, summed over `axes` once after the scan."""
    @jax.checkpoint
    def chunk_loss(h, t, w):
        return loss_fn(project(h, w), t)

    def loop(h, t, w):
        hs, ts = token_chunks(h, t, 1, c)
        zero = jnp.zeros_like(t, jnp.float32, shape=())  # varying over what the tokens vary over
        total, count = _sum_chunks(chunk_loss, w, hs, ts, zero)
        return jax.lax.psum(total, axes), jax.lax.psum(count, axes)

    return loop


def _per_host_chunks(hidden, targets, project, copies, loss_fn, mesh: Mesh, host_mesh: Mesh,
                     c: int):
    """chunked_lm_loss under host parameter sharding: the tokens relabelled host-major (nothing
    moves) and one shard_map on the host mesh in which each device scans its own tokens' chunks
    of c tokens with its host's whole copy of the weight (host_copies), gathered
    inside the host once. The copy's cotangent is summed inside the host once, after the loop,
    and the copies' across hosts once (host_copies' transpose). Scanned in the global view
    instead, XLA gathered the copy inside the host for every chunk and reduce-scattered its f32
    gradient per chunk (BENCHMARKS.md, "Figures behind design choices")."""
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


def _flat_tokens(tokens: jax.Array, mesh: Mesh) -> jax.Array:
    """[B, S] sharded P('group', 'seq') -> [B*S] over the whole mesh, group-major (a relabelling).

    Gathered over the tokens flattened to one axis sharded over the whole mesh, the lookup's
    gradient (a scatter-add) is reduced over both mesh axes at once. Over [B, S] sharded
    P('group', 'seq') XLA reduces it one axis at a time, and the cross-group step carries the
    whole [vocab, embed] gradient. The flat order is (group, seq, row, position), so each
    device's slice of the flat axis is exactly the tokens it already holds: no moves."""
    b, s = tokens.shape
    g, sp = row_groups(mesh), mesh.shape[SEQ]
    flat = tokens.reshape(g, b // g, sp, s // sp).transpose(0, 2, 1, 3).reshape(-1)
    return jax.lax.with_sharding_constraint(flat, NamedSharding(mesh, flat_spec()))


def _unflatten(rows: jax.Array, mesh: Mesh, b: int, s: int) -> jax.Array:
    """_flat_tokens' inverse for rows [B*S, E] -> [B, S, E] sharded P('group', 'seq')."""
    g, sp = row_groups(mesh), mesh.shape[SEQ]
    out = rows.reshape(g, sp, b // g, s // sp, -1).transpose(0, 2, 1, 3, 4).reshape(b, s, -1)
    return jax.lax.with_sharding_constraint(
        out, NamedSharding(mesh, activation_spec("batch", "sequence", None)))


def _lookup_per_host(copies: jax.Array, flat: jax.Array, host_mesh: Mesh) -> jax.Array:
    """The lookup from one copy of the table per host. Over the whole mesh XLA sums the
    gradient (a scatter-add) with one all-reduce over every device, each device sending the
    full table's gradient across hosts; here the copies' cotangents are first summed inside
    each host into its parameter shards (host_copies' constraint), and the broadcast's transpose
    then adds the hosts' shards: 1/(devices per host) of the table crosses hosts."""
    hosts = host_mesh.shape[HOST]
    # The flat token order is host-major (basp_jax.mesh), so row h holds host h's tokens.
    tokens = jax.lax.with_sharding_constraint(
        flat.reshape(hosts, -1), NamedSharding(host_mesh, P(HOST, LOCAL)))
    out = jax.vmap(lambda table, t: jnp.take(table, t, axis=0))(copies, tokens)
    return out.reshape(flat.shape[0], -1)


@dataclasses.dataclass(frozen=True)
class Table:
    """One vocabulary table of a model as `rules` places it: a parameter whose logical axis
    `names` (basp_jax.sharding.RULES) hold 'vocab', of `shape`: [vocab, embed] for an
    embedding (also the head when tied), [embed, vocab] for an LM head. rules=None: one device.

    The model asks the table, the table asks the strategy (rules.entry): whether the vocabulary
    is what is split (vocab_axes: the table is then used where it is stored, parallel_lookup and
    parallel_loss), or the strategy is per host (use: one copy per host, host_copies), or
    neither (the table is gathered). mode: one of MODES, when a vocabulary-split table is used
    where it is stored; tied: the embedding is also the head (active_axes' byte count).
    """

    names: tuple[str, ...]
    shape: tuple[int, ...]
    rules: ShardingRules | None = None
    mode: str = "auto"
    tied: bool = False

    def __post_init__(self):
        if self.rules is not None:  # the rules of this table (ShardingRules.for_names)
            object.__setattr__(self, "rules", self.rules.for_names(self.names))

    @functools.cached_property
    def vocab_axes(self) -> tuple[str, ...] | None:
        """The mesh axes the vocabulary is stored split over (vocab_axes), else None."""
        return vocab_axes(self.names, self.shape, self.rules)

    @property
    def vocab_size(self) -> int:
        return self.shape[self.names.index("vocab")]

    @property
    def per_host(self) -> bool:
        """Whether the strategy uses one copy of the table per host (use, host_copies): host
        sharding's, or a staged strategy's host-local copy. Its gradient is summed inside each
        host, then crosses hosts once, as the shards the hosts store."""
        return self.rules is not None and self.rules.per_host

    def active_axes(self, num_tokens: int) -> tuple[str, ...] | None:
        """vocab_axes when the table's use by num_tokens tokens moves rows, not the table."""
        if self.rules is None:
            return None
        return active_axes(self.vocab_axes, self.rules.mesh, num_tokens, self.vocab_size,
                           tied=self.tied, mode=self.mode)

    @functools.cached_property
    def host_vocab_axes(self) -> tuple[str, ...] | None:
        """(LOCAL,) where a staged strategy's host-local copy is split on the vocabulary over
        the host's devices (the tokens' rows then move inside the host), else None."""
        if self.rules is None or not self.rules.staged:
            return None
        spec = tuple(self.rules.use_spec(self.names, self.shape))
        spec = spec + (None,) * (len(self.shape) - len(spec))
        vocab_dim = self.names.index("vocab")
        if spec[vocab_dim] != LOCAL or any(s is not None for i, s in enumerate(spec)
                                           if i != vocab_dim):
            return None
        return (LOCAL,)

    def host_active_axes(self, num_tokens: int) -> tuple[str, ...] | None:
        """host_vocab_axes when num_tokens tokens should move rows inside each host (active_axes'
        rule over the devices of one host); else None, and a staged table is gathered as fsdp
        gathers it."""
        if self.host_vocab_axes is None:
            return None
        return active_axes(self.host_vocab_axes, self.rules.placement, num_tokens,
                           self.vocab_size, tied=self.tied, mode=self.mode)

    def use(self, value: jax.Array, dtype=None) -> jax.Array:
        """The table's value as lookup and loss take it: one copy per host
        (host_copies) under a per-host strategy (per_host), else the array itself. Pass the
        same result to both uses of a tied table, so its gradient crosses hosts once.

        A staged strategy's copy is cast to `dtype` (the compute dtype) first, as its layers
        are (ShardingRules.stage): half the bytes across hosts; its gradient still adds up in
        float32 on each device, and crosses hosts in `dtype`, once, as 1/N shards. It is used
        split inside the host where the tokens should move rows (host_active_axes: lookup and
        loss decide), else gathered whole inside the host, as host sharding's copy is."""
        if not self.per_host:
            return value
        if self.rules.staged and dtype is not None:
            value = value.astype(dtype)
        return host_copies(value, self.names, self.rules)

    def lookup(self, table: jax.Array, tokens: jax.Array, *, dtype) -> jax.Array:
        """The rows [B, S, embed] in `dtype` of tokens [B, S] (sharded P('group', 'seq') with a
        mesh) from `table` (use's result; the table must be [vocab, embed])."""
        if self.rules is None:
            return jnp.take(table, tokens, axis=0).astype(dtype)
        mesh = self.rules.mesh
        b, s = tokens.shape
        flat = _flat_tokens(tokens, mesh)
        axes = self.active_axes(b * s)
        host_axes = self.host_active_axes(b * s)
        if axes is not None:
            out = parallel_lookup(table, flat, mesh=mesh, axes=axes, dtype=dtype)
        elif host_axes is not None:
            out = parallel_lookup(table, flat, mesh=self.rules.placement, axes=host_axes,
                                  dtype=dtype, per_host=True)
        elif self.per_host:
            out = _lookup_per_host(table, flat, self.rules.placement)
        else:
            out = jnp.take(table, flat, axis=0)
        return _unflatten(out, mesh, b, s).astype(dtype)

    def loss(self, hidden: jax.Array, targets: jax.Array, weight: jax.Array, project: Callable,
             loss_fn: Callable, *, dtype, chunk_tokens: int = LOSS_CHUNK_TOKENS,
             plain_cross_entropy: bool = False):
        """loss_fn(project(hidden, weight), targets) -> (sum, count) over chunks of
        chunk_tokens tokens per device (chunked_lm_loss), weight being use's result of this
        table (the head). plain_cross_entropy: loss_fn is the plain next-token cross-entropy
        (targets < 0 not counted), which parallel_loss computes where the vocabulary is split;
        any other loss_fn runs on gathered chunks of logits."""
        mesh = None if self.rules is None else self.rules.mesh
        axes = None if mesh is None else self.active_axes(targets.size)
        host_axes = None if mesh is None else self.host_active_axes(targets.size)
        if (axes is not None or host_axes is not None) and plain_cross_entropy:
            host = None if axes is not None else self.rules.placement
            return parallel_loss(hidden, targets, weight, mesh=mesh, axes=axes or host_axes,
                                 vocab_dim=self.names.index("vocab"), dtype=dtype,
                                 chunk_tokens=chunk_tokens, host_mesh=host)
        # one copy per host (use's host_copies): each host's devices loop with their host's copy
        host = self.rules.placement if self.per_host else None
        return chunked_lm_loss(hidden, targets, project, weight, loss_fn, mesh=mesh,
                               chunk_tokens=chunk_tokens, host_mesh=host)
