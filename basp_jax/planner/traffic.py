"""Traffic of a train step: the bytes one device sends per step, by link class, and their time.

Alpha-beta per link class: a collective on a group costs `latency * (peers)` plus, for each device,
`intra-host bytes / intra bandwidth + inter-host bytes / inter bandwidth per GPU` (the slower link
class dominates; the two run concurrently, so the model takes the larger of the two byte terms plus
latency). Per optimizer step per device: microbatches x layers x (attention all-to-alls +
parameter gathers and gradient reductions), and the copies to host memory and back.
"""

from __future__ import annotations

import dataclasses

from ..layout import Layout
from ..remat import RematPolicy
from ..sharding import PARAM_SHARDINGS, Strategy, sums_per_host
from ..vocab import prefer_vocab_parallel
from .hardware import Hardware
from .memory import host_memory_bytes, shard_devices, state_bytes_per_param
from .precisions import Precisions
from .shape import ModelShape
from .strategies import gradient_sync


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes one device sends, split by link class, and the number of collective launches."""

    intra: float = 0.0
    inter: float = 0.0
    launches: int = 0

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.intra + other.intra, self.inter + other.inter,
                       self.launches + other.launches)

    def scale(self, factor: float) -> "Traffic":
        return Traffic(self.intra * factor, self.inter * factor, int(self.launches * factor))

    def time(self, hw: Hardware) -> float:
        latency = self.launches * (hw.inter_latency if self.inter else hw.intra_latency)
        return latency + max(self.intra / hw.intra_bw, self.inter / hw.inter_bw)


def _remote_share(group_size: int, devices_per_host: int, spread: int = 1) -> float:
    """Share of a device's peers on other hosts when its group of `group_size` members lies on
    consecutive devices (spread=1), or one member per run of `spread` devices (strided groups)."""
    if group_size <= 1:
        return 0.0
    span = group_size * spread
    if span <= devices_per_host:
        return 0.0
    local = max(devices_per_host // spread, 1)
    return (group_size - local) / (group_size - 1)


def _ring_crossing_share(layout: Layout) -> float:
    """Share of the ring's hops (Layout.ring_hops) that change host."""
    dph = layout.devices_per_host
    return sum(a // dph != b // dph for a, b in layout.ring_hops) / layout.sp


def collective_traffic(kind: str, buffer_bytes: float, group_size: int,
                       remote_share: float) -> Traffic:
    """Wire bytes of one bandwidth-optimal collective over `group_size` devices."""
    if group_size <= 1:
        return Traffic()
    factor = 2.0 if kind == "all-reduce" else 1.0
    wire = factor * buffer_bytes * (group_size - 1) / group_size
    return Traffic(wire * (1 - remote_share), wire * remote_share, 1)


def min_inter_host_gradient_bytes(gradient_bytes: float, num_devices: int,
                                  devices_per_host: int) -> float:
    """The fewest bytes one device must send across hosts per step to sum a gradient of
    `gradient_bytes` (a full copy per device) over `num_devices`: reduced inside each host first,
    every element then crosses hosts once, as one device's 1/devices_per_host shard in a
    bandwidth-optimal all-reduce over the hosts, 2 (hosts - 1) / hosts x the shard. Zero on one
    host. What host parameter sharding compiles to (tests/models/test_host_sharding.py)."""
    hosts = num_devices // devices_per_host
    if hosts <= 1:
        return 0.0
    return 2.0 * (hosts - 1) / hosts * gradient_bytes / devices_per_host


def _gradient_sync(sync: str | None, layout: Layout, all_params: float) -> Traffic:
    """The gradient reduction of one microbatch a strategy adds beyond its shard group's
    (basp_jax.planner.strategies.Candidacy.sync)."""
    g, sp, n, dph = layout.groups, layout.sp, layout.num_devices, layout.devices_per_host
    if sync == "groups" and g > 1:  # hsdp: the local 1/sp shard all-reduced across groups
        share = _remote_share(g, dph, spread=sp)
        return collective_traffic("all-reduce", all_params / sp, g, share)
    if sync == "hosts" and n > dph:  # host: every element crosses hosts once
        return Traffic(inter=min_inter_host_gradient_bytes(all_params, n, dph), launches=1)
    if sync not in (None, "groups", "hosts"):
        raise ValueError(
            f"unknown gradient sync {sync!r}; basp_jax.planner.traffic prices groups, hosts")
    return Traffic()


def vocab_parallel(shape: ModelShape, param_sharding: str, shard_group: int,
                   tokens_per_device: float | None = None, num_devices: int | None = None) -> bool:
    """Whether the embedding and LM head are used split on the vocabulary over shard_group
    devices (basp_jax.vocab): where they are stored under a strategy that allows it (fsdp,
    hsdp), or a staged strategy's host-local copies (shard_group: the devices of a host; they
    are stored over all num_devices, split on the vocabulary where that divides it), at token
    counts where it is preferred (prefer_vocab_parallel; None: any count)."""
    strategy = PARAM_SHARDINGS.get(param_sharding)
    staged = strategy.staged
    stored = num_devices if staged and num_devices else shard_group
    if not ((strategy.vocab_parallel or staged) and shard_group > 1
            and shape.vocab_size % stored == 0):
        return False
    return tokens_per_device is None or prefer_vocab_parallel(
        tokens_per_device, shard_group, shape.vocab_size, shape.tie_word_embeddings)



def attention_traffic(shape: ModelShape, layout: Layout, policy: RematPolicy,
                      act_bytes: int) -> Traffic:
    """One layer's attention exchanges for one microbatch: q, k, v, out forward and their
    gradients backward, each [tokens, heads, Dh], exchanged among sp / ring devices (zero heads
    padded where that degree does not divide), plus the ring's k/v hops."""
    degree, tokens = layout.a2a, layout.tokens_per_device
    q_heads, kv_heads = layout.exchanged_heads
    share = _remote_share(degree, layout.devices_per_host)
    # forward, backward, and the forward's that the policy keeps no result of, repeated
    width = {"q": q_heads, "k": kv_heads, "v": kv_heads, "out": q_heads}
    exchanges = 2 * ("q", "k", "v", "out") + policy.repeated_exchanges
    passes = 3 if "k" in policy.repeated_exchanges else 2  # the ring's k/v hops
    a2a = Traffic()
    for part in exchanges:
        buf = tokens * width[part] * shape.head_dim * act_bytes
        a2a = a2a + collective_traffic("all-to-all", buf, degree, share)
    if layout.ring > 1:
        # k and v chunks hop ring - 1 times forward (again in the backward when the exchanges
        # are repeated), and their gradients hop back as many times.
        kv_chunk = tokens * kv_heads * shape.head_dim * act_bytes
        crossing = _ring_crossing_share(layout)
        hop = Traffic(kv_chunk * (1 - crossing), kv_chunk * crossing, 1)
        a2a = a2a + hop.scale(2 * passes * (layout.ring - 1))
    return a2a


def linear_exchange_traffic(shape: ModelShape, layout: Layout, policy: RematPolicy,
                            act_bytes: int) -> Traffic:
    """One Gated DeltaNet layer's exchanges for one microbatch (models.linear_attention): q, k,
    v and the output in the compute dtype, the decay and beta gates in float32, forward and
    their gradients backward, among sp devices. (Where sp does not divide the key heads, q and
    k are repeated to the value heads first: not counted.)"""
    degree, tokens = layout.sp, layout.tokens_per_device
    share = _remote_share(degree, layout.devices_per_host)
    key_dim = shape.linear_num_key_heads * shape.linear_key_head_dim
    value_dim = shape.linear_num_value_heads * shape.linear_value_head_dim
    passes = 3 if policy.repeated_exchanges else 2  # (its exchanges are not tagged k/v apart)
    buffers = [tokens * width * act_bytes for width in (key_dim, key_dim, value_dim, value_dim)]
    buffers += [tokens * shape.linear_num_value_heads * 4] * 2
    a2a = Traffic()
    for _ in range(passes):
        for buf in buffers:
            a2a = a2a + collective_traffic("all-to-all", buf, degree, share)
    return a2a


def expert_dispatch_traffic(shape: ModelShape, layout: Layout, policy: RematPolicy,
                            act_bytes: int, expert_parallel: str = "auto") -> Traffic:
    """One sparse layer's routed-token exchanges for one microbatch where its experts are split
    over the seq group (models.moe, ModelShape.expert_split): the group's tokens all-gathered
    and the experts' outputs reduce-scattered forward, their gradients the other way backward,
    and where the layer is recomputed the forward's all-gather again (its reduce-scatter feeds
    nothing the backward needs: the compiled 30B step runs 3 all-gathers and 2 reduce-scatters
    per layer); each token's expert ids (int32) and weights gathered beside the tokens. None
    where the experts are whole on every device."""
    split = shape.expert_split(layout.sp, min(layout.devices_per_host, layout.num_devices),
                               expert_parallel)
    if split == 1:
        return Traffic()
    share = _remote_share(split, layout.devices_per_host)
    group_tokens = split * layout.tokens_per_device
    hidden = group_tokens * shape.hidden_size * act_bytes
    routing = group_tokens * shape.num_experts_per_tok * (4 + act_bytes)
    gathers = 2 if policy.policy is None else 3
    return (collective_traffic("all-gather", hidden, split, share).scale(gathers)
            + collective_traffic("reduce-scatter", hidden, split, share).scale(2)
            + collective_traffic("all-gather", routing, split, share).scale(gathers))


def param_traffic(shape: ModelShape, layout: Layout, param_sharding: str, *, grad_accum: int,
                  precisions: Precisions) -> Traffic:
    """Parameters per step: gathered forward and backward (ZeRO-3), gradients reduce-scattered,
    per microbatch; HSDP adds one cross-group all-reduce of the local shard per microbatch, host
    sharding one cross-host all-reduce of the host-local shard (per microbatch too: the step
    constrains each microbatch's gradient to the stored sharding, which in XLA's partitioner
    finishes its reduction there, so with grad_accum=A they cross hosts A times, as the
    compiled programs show: docs/limitations.md); a staged strategy gathers the layers in two
    stages (_staged_traffic); staged_keep its vocabulary tables too (_host_tables_traffic;
    staged's follow fsdp). The gradients leave in the dtype the layers computed them in
    (precisions.gathered: bf16 reduce-scatters under bf16 compute, as the compiled GPU programs
    show), not in the float32 of the master weights; a host strategy's gathered tables are used
    (and their gradient summed across hosts) in the master dtype. Where each host keeps its
    gradient sum apart over the microbatches (basp_jax.sharding.sums_per_host: host and
    staged_keep with one BASP group per host), everything that crosses hosts does so once a
    step: the host-local copies gathered before the microbatches, the hosts' sums reduced after
    them, in precisions.summed a parameter (float32 under float16 compute)."""
    param_bytes = precisions.gathered
    all_params = shape.num_params * param_bytes
    strategy = PARAM_SHARDINGS.get(param_sharding)
    table_sharding = strategy.tables or param_sharding  # staged: fsdp's tables (Strategy.tables)
    staged = strategy.staged
    staged_tables = PARAM_SHARDINGS.get(table_sharding).staged
    shard_group = strategy.shard_devices(layout)
    dph = min(layout.devices_per_host, layout.num_devices)
    # staged_keep's tables: used split over the devices of the host-local copy's host
    table_group = dph if staged_tables else shard_devices(layout, table_sharding)
    table_share = 0.0 if staged_tables else _shard_share(table_sharding, layout)
    tables = shape.embedding_params * param_bytes
    if vocab_parallel(shape, table_sharding, table_group, layout.tokens_per_device,
                      layout.num_devices):
        per_micro = _vocab_rows_traffic(shape, layout, table_group, table_share, precisions.act)
        gathered_tables = 0.0
    else:
        per_micro, gathered_tables = Traffic(), tables
    layers = all_params - tables
    once = sums_per_host(param_sharding, layout, grad_accum)  # (one microbatch: the same bytes)
    # the hosts' sums cross in precisions.summed a parameter, the rest in precisions.gathered
    summed = precisions.summed / param_bytes if once else 1.0
    per_step = Traffic()
    if staged:
        per_step = _staged_traffic(layers, layout, strategy, grad_accum, sums_once=once,
                                   sum_scale=summed)
    if staged and not staged_tables:
        per_micro = per_micro + _gathered_traffic(gathered_tables, table_group, table_share)
    elif staged:
        cross, inside = _host_tables_traffic(tables, layout, summed, gathered_tables)
        if once:
            per_step = per_step + cross
        else:
            per_micro = per_micro + cross
        if inside is not None:
            per_micro = per_micro + inside
    else:
        per_micro = per_micro + _gathered_traffic(
            layers + gathered_tables, shard_group, _shard_share(param_sharding, layout))
    synced = all_params * summed
    sync_kind = gradient_sync(param_sharding)
    if sync_kind == "hosts" and not once:  # its tables' gradient crosses in the master dtype
        synced += gathered_tables * (precisions.master / param_bytes - 1)
    sync = _gradient_sync(sync_kind, layout, synced)
    if once:
        return per_micro.scale(grad_accum) + sync + per_step
    return (per_micro + sync).scale(grad_accum) + per_step


def _vocab_rows_traffic(shape: ModelShape, layout: Layout, table_group: int, table_share: float,
                        act_bytes: int) -> Traffic:
    """The embedding and LM head used where they are stored (basp_jax.vocab), for one
    microbatch: the tokens' rows move instead of the tables. Embedding: its rows
    reduce-scattered forward, their cotangent gathered backward; loss: the hidden states
    gathered forward and again when rematerialised, their f32 cotangent reduce-scattered."""
    rows = table_group * layout.tokens_per_device * shape.hidden_size * act_bytes
    return (collective_traffic("reduce-scatter", rows, table_group, table_share)
            + collective_traffic("all-gather", rows, table_group, table_share).scale(3)
            + collective_traffic("reduce-scatter", 2 * rows, table_group, table_share))


def _host_tables_traffic(tables: float, layout: Layout, sum_scale: float,
                         gathered_tables: float) -> tuple[Traffic, Traffic | None]:
    """staged_keep's vocabulary tables as host-local copies in the compute dtype
    (basp_jax.vocab.Table.use): (across hosts: the copies gathered, per microbatch in the GPU
    program (the CPU one hoists it), and their gradient back onto the stored 1/N shards; inside
    the host per microbatch, where a device has too many tokens for rows inside the host: the
    whole copy gathered (its gradient summed there first), else None)."""
    dph = min(layout.devices_per_host, layout.num_devices)
    hosts = max(layout.num_devices // dph, 1)
    cross = (collective_traffic("all-gather", tables / dph, hosts, 1.0)
             + collective_traffic("reduce-scatter", tables / dph * sum_scale, hosts, 1.0))
    inside = collective_traffic("all-gather", tables, dph, 0.0) if gathered_tables else None
    return cross, inside


def _shard_share(param_sharding: str, layout: Layout) -> float:
    """The share of a device's shard-group peers on other hosts (none for a per-host one)."""
    strategy = PARAM_SHARDINGS.get(param_sharding)
    if strategy.per_host:
        return 0.0
    return _remote_share(strategy.shard_devices(layout), layout.devices_per_host)


def _gathered_traffic(buffer_bytes: float, group: int, remote_share: float) -> Traffic:
    """ZeRO-3 for one microbatch: gathered forward and again backward, reduce-scattered."""
    return (collective_traffic("all-gather", buffer_bytes, group, remote_share).scale(2)
            + collective_traffic("reduce-scatter", buffer_bytes, group, remote_share))


def _staged_traffic(layer_bytes: float, layout: Layout, strategy: Strategy,
                    grad_accum: int = 1, sums_once: bool = False,
                    sum_scale: float = 1.0) -> Traffic:
    """A staged strategy's layers for one step of grad_accum microbatches (basp_jax.sharding):
    the host-local copy (1/devices per host of each layer) gathered across hosts forward, and
    again for the recomputed backward unless it is kept: on the device the step gathers it once
    for all its microbatches (train.program.step), in host memory once per microbatch; the whole
    layer gathered inside the host forward and backward; the gradient reduce-scattered inside
    the host, then its host-local shard across hosts, once per microbatch (XLA's partitioner
    finishes each microbatch's reduction) or, with sums_once, once a step (sum_scale: the sum's
    bytes per the layer's, 2 for float32 sums of float16 gradients)."""
    dph = layout.devices_per_host
    hosts = max(layout.num_devices // dph, 1)
    host_copy = layer_bytes / dph
    if strategy.use.copy == "device":
        gathers = 1
    elif strategy.use.copy == "host":
        gathers = grad_accum
    else:  # forward, and again for the recomputed backward
        gathers = 2 * grad_accum
    cross = collective_traffic("all-gather", host_copy, hosts, 1.0).scale(gathers) + \
        collective_traffic("reduce-scatter", host_copy * sum_scale, hosts, 1.0).scale(
            1 if sums_once else grad_accum)
    return cross + _gathered_traffic(layer_bytes, min(dph, layout.num_devices), 0.0).scale(
        grad_accum)


def host_traffic(shape: ModelShape, layout: Layout, shard_group: int, hw: Hardware, *,
                 remat: str, precisions: Precisions, grad_accum: int,
                 offload_state: bool) -> tuple[float, float]:
    """(pinned host bytes per device, seconds of copies to and from it per step): the offload
    policy's residuals, and with offload_state the optimizer state streamed through."""
    q_heads, kv_heads = layout.exchanged_heads
    host = host_memory_bytes(shape, layout.tokens_per_device, q_heads=q_heads,
                             kv_heads=kv_heads, remat=remat, precisions=precisions) * grad_accum
    host_s = 2 * host / hw.host_bw  # to the host forward, back backward (no overlap assumed)
    if offload_state:
        per_param = state_bytes_per_param(precisions.master, precisions.moments)
        state = shape.num_params * per_param / shard_group
        host += state
        # master weights in forward and backward, every state read by the finiteness check of the
        # update (train.program.streamed), then read and written by the update
        host_s += (2 * shape.num_params * precisions.master / shard_group + 3 * state) / hw.host_bw
    return host, host_s
