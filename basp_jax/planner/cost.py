"""A topology cost model: predicted communication and step time of a layout on given hardware.

Alpha-beta per link class: a collective on a group costs `latency * (peers)` plus, for each device,
`intra-host bytes / intra bandwidth + inter-host bytes / inter bandwidth per GPU` (the slower link
class dominates; the two run concurrently, so the model takes the larger of the two byte terms plus
latency). Compute is the model's training FLOPs at a stated efficiency. Communication is assumed
not to overlap compute (the paper's Ulysses all-to-alls sit on the critical path); `overlap` in
[0, 1] hides that share of the parameter collectives, which frameworks prefetch.

Everything is per optimizer step per device: microbatches x layers x (attention all-to-alls +
parameter gathers and gradient reductions). A way to run the step is a Layout (groups, sp, ring,
head padding, pad rows: basp_jax.layout) and a parameter sharding strategy.
"""

from __future__ import annotations

import dataclasses
import math

from .. import gpus
from . import calibration
from .calibration import Calibration
from ..layout import Layout, LayoutError, _divisors, auto_mode, mode_of
from ..remat import REMAT_POLICIES, RematPolicy
from ..sharding import PARAM_SHARDINGS, Strategy, sums_per_host
from ..vocab import prefer_vocab_parallel


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # per device, bf16 dense
    intra_bw: float  # bytes/s per device per direction inside a host (NVLink)
    inter_bw: float  # bytes/s per device across hosts (its share of the NICs)
    intra_latency: float = 5e-6
    inter_latency: float = 10e-6
    devices_per_host: int = 8
    memory_bytes: float = 80e9  # what the planner may use per device
    efficiency: float = 0.4  # achieved fraction of peak for the model's FLOPs
    # Each GPU's share of its host: pinned memory the offload policies may fill, and its PCIe
    # link's bytes/s per direction (basp_jax.remat.REMAT_POLICIES "offload*").
    host_memory_bytes: float = 128e9
    host_bw: float = 25e9
    fp8_peak_flops: float | None = None  # per device, dense FP8 (None: no FP8 tensor cores)
    # measured rates of this GPU kind (basp_jax.planner.calibration), read in place of
    # `efficiency` where one was measured
    calibration: Calibration | None = dataclasses.field(default=None, compare=False)

    def describe_compute(self) -> str:
        """One line: which compute model the step times come from."""
        if self.calibration is not None:
            return f"compute from the {self.calibration.target} calibration ({self.calibration.source})"
        return (f"compute at {self.efficiency:.0%} of the peak (no calibration measured for this "
                f"GPU kind)")

    def compute_seconds(self, flops: float, fp8_flops: float = 0.0) -> float:
        """Seconds for `flops` at this efficiency, `fp8_flops` of them (model.fp8's projections)
        at the FP8 peak where the GPU has one, the rest at the bf16 peak."""
        if not self.fp8_peak_flops:
            return flops / (self.peak_flops * self.efficiency)
        return ((flops - fp8_flops) / self.peak_flops
                + fp8_flops / self.fp8_peak_flops) / self.efficiency


def _cluster(gpu: str, description: str, intra_bw: float, inter_bw: float,
             devices_per_host: int, host_memory: float, host_bw: float) -> Hardware:
    """A cluster preset of `gpu` (basp_jax.gpus): its peak FLOP/s, and the memory JAX may take."""
    g = gpus.get(gpu)
    return Hardware(f"{g.device_kind}, {description}", g.peak_flops, intra_bw, inter_bw,
                    devices_per_host=devices_per_host, memory_bytes=gpus.usable_memory_bytes(g),
                    host_memory_bytes=host_memory, host_bw=host_bw,
                    fp8_peak_flops=g.fp8_peak_flops, calibration=calibration.for_target(gpu))


# Named like the GPU targets of basp_jax.gpus (and python -m train.tools.aot --target).
# Host memory per GPU: a DGX A100 has 1 TB for 8 GPUs, a DGX H100/H200 2 TB (the planner may
# fill 90% of the share with pinned buffers); PCIe Gen4 x16 moves ~25 GB/s per direction, Gen5
# ~50 GB/s (what a copy engine reaches, not the link's 32 / 64 GB/s).
HARDWARE = {
    # The paper's testbed: 2 nodes x 4 A100-SXM4-40GB (NVLink3), 400 Gb/s InfiniBand per node.
    "a100-40gb": _cluster("a100-40gb", "NVLink3, 400 Gb/s IB per node of 4", 250e9, 400e9 / 8 / 4, 4,
                          0.9 * 1e12 / 8, 25e9),
    "a100-80gb": _cluster("a100-80gb", "NVLink3, 400 Gb/s IB per node of 4", 250e9, 400e9 / 8 / 4, 4,
                          0.9 * 1e12 / 8, 25e9),
    # H100/H200 HGX: NVLink4, one 400 Gb/s NIC per GPU.
    "h100-80gb": _cluster("h100-80gb", "NVLink4, 400 Gb/s IB per GPU", 370e9, 400e9 / 8, 8,
                          0.9 * 2e12 / 8, 50e9),
    "h200-141gb": _cluster("h200-141gb", "NVLink4, 400 Gb/s IB per GPU", 370e9, 400e9 / 8, 8,
                           0.9 * 2e12 / 8, 50e9),
    # One-GPU and PCIe machines, no NVLink: GPUs of one host talk over PCIe (Gen3 x16 on the T4,
    # ~12 GB/s; Gen4 ~25 GB/s), hosts over Ethernet. Clusters of 4 per host: AWS g4dn.12xlarge
    # (T4, 50 Gb/s), GCP g2-standard-48 (L4, 100 Gb/s), AWS g5.12xlarge (A10G, 40 Gb/s), a
    # workstation (RTX 4090, 10 GbE). Host memory per GPU: Colab's runtimes for the T4 (12.7 GB
    # for its one GPU) and the L4 (53 GB); 192 GB / 4 on g5.12xlarge; 128 GB / 4 for the
    # workstation.
    "t4-16gb": _cluster("t4-16gb", "PCIe Gen3, 50 Gb/s Ethernet per node of 4", 12e9,
                        50e9 / 8 / 4, 4, 0.9 * 12.7e9, 12e9),
    "l4-24gb": _cluster("l4-24gb", "PCIe Gen4, 100 Gb/s Ethernet per node of 4", 25e9,
                        100e9 / 8 / 4, 4, 0.9 * 53e9, 25e9),
    "a10g-24gb": _cluster("a10g-24gb", "PCIe Gen4, 40 Gb/s Ethernet per node of 4", 25e9,
                          40e9 / 8 / 4, 4, 0.9 * 192e9 / 4, 25e9),
    "rtx4090-24gb": _cluster("rtx4090-24gb", "PCIe Gen4, 10 Gb/s Ethernet per node of 4", 25e9,
                             10e9 / 8 / 4, 4, 0.9 * 128e9 / 4, 25e9),
}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer (Llama / Qwen): what the cost model needs, and the
    one place its parameter count and training FLOPs are computed (the trainer's MFU reads them
    through models.ModelConfig.shape)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on the q/k/v projections (Qwen2)
    attention_out_bias: bool = False  # bias on the output projection
    qk_norm: bool = False  # per-head RMSNorm weights on q and k (Qwen3)
    attention_output_gate: bool = False  # q_proj also emits a gate per query channel (Qwen3.5)
    # Hybrids (Qwen3.5): how many of the layers are Gated DeltaNet ones instead of attention, and
    # their shapes (models.linear_attention)
    linear_layers: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4

    @property
    def attention_layers(self) -> int:
        return self.num_layers - self.linear_layers

    @property
    def layer_params(self) -> int:
        """An attention layer's parameters."""
        d, hd = self.hidden_size, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        attn = (3 if self.attention_output_gate else 2) * d * q + 2 * d * kv
        if self.attention_bias:
            attn += q * (2 if self.attention_output_gate else 1) + 2 * kv
        if self.attention_out_bias:
            attn += d
        if self.qk_norm:
            attn += 2 * hd
        return attn + self._mlp_and_norm_params

    @property
    def _mlp_and_norm_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size

    @property
    def linear_layer_params(self) -> int:
        """A Gated DeltaNet layer's parameters: the q/k/v, z, beta and decay projections, the
        conv, the decay's A and bias, the gated norm and out_proj."""
        d, nv = self.hidden_size, self.linear_num_value_heads
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        value_dim = nv * self.linear_value_head_dim
        conv_dim = 2 * key_dim + value_dim
        mixer = (d * conv_dim + d * value_dim + 2 * d * nv + conv_dim * self.linear_conv_kernel_dim
                 + 2 * nv + self.linear_value_head_dim + value_dim * d)
        return mixer + self._mlp_and_norm_params

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def num_params(self) -> int:
        """Every parameter, as Hugging Face counts them (tied embeddings once)."""
        layers = self.attention_layers * self.layer_params
        if self.linear_layers:
            layers += self.linear_layers * self.linear_layer_params
        return layers + self.embedding_params + self.hidden_size

    def dense_flops_per_token(self) -> float:
        """6 N, forward and backward: N counts every parameter except the input embedding table
        when it is not tied to the output projection (a lookup costs no FLOPs)."""
        n = self.num_params
        if not self.tie_word_embeddings:
            n -= self.vocab_size * self.hidden_size
        return 6.0 * n

    def attention_flops_per_token(self, seq_len: int, causal: bool = True) -> float:
        """Attention scores and values, forward and backward: PaLM's 12 L Hq Dh S (appendix B)
        counts the full S x S scores; causal (MaxText's and Megatron's count) halves it, counting
        only the scores a causal kernel computes."""
        attn = 12 * self.attention_layers * self.num_heads * self.head_dim * seq_len
        return attn / 2 if causal else attn

    def linear_attention_flops_per_token(self) -> float:
        """The delta rule's own work (beyond its projections' 6N), forward and backward: per
        token and value head, the recurrent form's four products with the [Dk, Dv] state
        (decay, read, write, output), 2 FLOPs per element each, times 3. Independent of the
        sequence length."""
        state = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        return 3 * 4 * 2 * self.linear_layers * state

    @property
    def fp8_params(self) -> int:
        """The layers' projection matrices model.fp8 runs in FP8 (models.fp8): q, k, v, o, gate,
        up, down; a Gated DeltaNet's qkv, z and out (its beta and decay ones stay in bf16)."""
        d, hd = self.hidden_size, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        mlp = 3 * d * self.intermediate_size
        attention = (3 if self.attention_output_gate else 2) * d * q + 2 * d * kv + mlp
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        value_dim = self.linear_num_value_heads * self.linear_value_head_dim
        linear = d * (2 * key_dim + value_dim) + 2 * d * value_dim + mlp
        return self.attention_layers * attention + self.linear_layers * linear

    def fp8_flops_per_token(self) -> float:
        """Of train_flops_per_token, those model.fp8 runs as FP8 matmuls: 6 x fp8_params."""
        return 6.0 * self.fp8_params

    def train_flops_per_token(self, seq_len: int, causal: bool = True) -> float:
        """Training FLOPs per token: what the planner's compute time and the trainer's MFU use."""
        return (self.dense_flops_per_token() + self.attention_flops_per_token(seq_len, causal)
                + self.linear_attention_flops_per_token())


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes one device sends, split by link class, and the number of collective launches."""

    intra: float = 0.0
    inter: float = 0.0
    launches: int = 0

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.intra + other.intra, self.inter + other.inter, self.launches + other.launches)

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


def collective_traffic(kind: str, buffer_bytes: float, group_size: int, remote_share: float) -> Traffic:
    """Wire bytes of one bandwidth-optimal collective over `group_size` devices."""
    if group_size <= 1:
        return Traffic()
    factor = 2.0 if kind == "all-reduce" else 1.0
    wire = factor * buffer_bytes * (group_size - 1) / group_size
    return Traffic(wire * (1 - remote_share), wire * remote_share, 1)


def plan_layout(shape: ModelShape, *, num_devices: int, batch: int, seq_len: int, groups: int,
                devices_per_host: int | None = None, ring: int = 1, pad_heads: bool = False,
                pad_rows: int = 0, zigzag: bool = False, mode: str = "basp") -> Layout:
    """The validated Layout of `shape`'s heads for one (groups, sp) split: what the planner
    enumerates and predicts. devices_per_host defaults to one host."""
    per_host = num_devices if devices_per_host is None else min(devices_per_host, num_devices)
    return Layout.plan(num_devices, batch, seq_len, shape.num_heads, shape.num_kv_heads,
                       devices_per_host=per_host, mode=mode, groups=groups, ring=ring,
                       pad_heads=pad_heads, pad_rows=pad_rows, zigzag=zigzag)


def layout_name(layout: Layout, param_sharding: str) -> str:
    """e.g. 'basp (2,4) hsdp [ring 2, pad heads, +1 pad rows]', as the planner prints it."""
    kind = mode_of(layout.groups)
    extras = [f"ring {layout.ring}"] if layout.ring > 1 else []
    extras += ["pad heads"] if layout.pad_heads else []
    extras += [f"+{layout.pad_rows} pad rows"] if layout.pad_rows else []
    extra = f" [{', '.join(extras)}]" if extras else ""
    return f"{kind} ({layout.groups},{layout.sp}) {param_sharding}{extra}"


def shard_devices(layout: Layout, param_sharding: str) -> int:
    """How many devices share (shard) each parameter under a strategy."""
    return PARAM_SHARDINGS.get(param_sharding).shard_devices(layout)


def kept_share(layout: Layout, param_sharding: str, *, offloaded: bool = False) -> float:
    """The share of the layers' weights each device keeps from forward to backward under a
    strategy (memory_terms' kept): a staged strategy's host-local copy when it keeps it on the
    device (keep_host_copy); offloaded: in pinned host memory (offload_host_copy) instead."""
    strategy = PARAM_SHARDINGS.get(param_sharding)
    if not (strategy.offload_host_copy if offloaded else strategy.keep_host_copy):
        return 0.0
    return 1.0 / min(layout.devices_per_host, layout.num_devices)


def host_sum_devices(layout: Layout, param_sharding: str, grad_accum: int) -> int | None:
    """The devices of a host, where a step keeps each host's float32 gradient sum split over
    them (basp_jax.sharding.sums_per_host; memory_terms' host_sums), else None."""
    if grad_accum > 1 and sums_per_host(param_sharding, layout, grad_accum):
        return min(layout.devices_per_host, layout.num_devices)
    return None


def step_copy_bytes(shape: ModelShape, layout: Layout, param_sharding: str, grad_accum: int,
                    act_bytes: int = 2) -> float:
    """Device memory a step that keeps each host's gradient sum (basp_jax.sharding.sums_per_host)
    holds for its host-local copies in the compute dtype, 1/devices per host of each, beyond
    what the strategy keeps anyway (kept_share): host sharding's whole model, staged_keep's
    vocabulary tables; 0 elsewhere."""
    if host_sum_devices(layout, param_sharding, grad_accum) is None:  # (one microbatch: folded)
        return 0.0
    dph = min(layout.devices_per_host, layout.num_devices)
    copied = shape.num_params - kept_share(layout, param_sharding) * dph * _layer_weights(shape)
    return act_bytes * copied / dph


def host_copy_bytes(shape: ModelShape, layout: Layout, param_sharding: str,
                    act_bytes: int = 2) -> float:
    """Pinned host memory per device that a strategy keeping its host-local copy there fills
    (staged_offload: 1/devices per host of the layers in the compute dtype; 0 for the others),
    copied there forward and back backward once per microbatch."""
    return kept_share(layout, param_sharding, offloaded=True) * act_bytes * _layer_weights(shape)


def _layer_weights(shape: ModelShape) -> float:
    """The layers' parameters: every one but the tables and the final norm."""
    return shape.num_params - shape.embedding_params - shape.hidden_size


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
    (basp_jax.sharding.Strategy.sync)."""
    g, sp, n, dph = layout.groups, layout.sp, layout.num_devices, layout.devices_per_host
    if sync == "groups" and g > 1:  # hsdp: the local 1/sp shard all-reduced across groups
        return collective_traffic("all-reduce", all_params / sp, g, _remote_share(g, dph, spread=sp))
    if sync == "hosts" and n > dph:  # host: every element crosses hosts once
        return Traffic(inter=min_inter_host_gradient_bytes(all_params, n, dph), launches=1)
    if sync not in (None, "groups", "hosts"):
        raise ValueError(f"unknown gradient sync {sync!r}; basp_jax.planner.cost prices groups, hosts")
    return Traffic()


@dataclasses.dataclass(frozen=True)
class Prediction:
    layout: Layout
    param_sharding: str  # a name of basp_jax.sharding.PARAM_SHARDINGS
    all_to_all: Traffic
    params: Traffic
    compute_s: float
    all_to_all_s: float
    params_s: float
    step_s: float
    memory_bytes: float
    host_memory_bytes: float = 0.0  # pinned host memory the offload policy fills per device
    host_s: float = 0.0  # its copies to the host and back per step, not overlapped

    @property
    def name(self) -> str:
        return layout_name(self.layout, self.param_sharding)


def vocab_parallel(shape: ModelShape, param_sharding: str, shard_group: int,
                   tokens_per_device: float | None = None, num_devices: int | None = None) -> bool:
    """Whether the embedding and LM head are used split on the vocabulary over shard_group
    devices (basp_jax.vocab): where they are stored under a strategy that allows it (fsdp,
    hsdp), or a staged strategy's host-local copies (shard_group: the devices of a host; they
    are stored over all num_devices, split on the vocabulary where that divides it), at token
    counts where it is preferred (prefer_vocab_parallel; None: any count)."""
    strategy = PARAM_SHARDINGS.get(param_sharding)
    staged = strategy.use_axes is not None
    stored = num_devices if staged and num_devices else shard_group
    if not ((strategy.vocab_parallel or staged) and shard_group > 1
            and shape.vocab_size % stored == 0):
        return False
    return tokens_per_device is None or prefer_vocab_parallel(
        tokens_per_device, shard_group, shape.vocab_size, shape.tie_word_embeddings)


def predict(
    shape: ModelShape,
    layout: Layout,
    param_sharding: str,
    *,
    hw: Hardware,
    grad_accum: int = 1,
    act_bytes: int = 2,
    param_bytes: int | None = None,
    sum_bytes: int | None = None,
    overlap: float = 0.0,
    remat: str = "full",
    master_bytes: int = 4,
    moment_bytes: int | None = None,
    tile_tokens: int | None = None,
    offload_state: bool = False,
    fp8: bool = False,
    attn_impl: str = "auto",
) -> Prediction:
    """Predicted per-step time and memory of a layout (for `shape`'s heads; its batch with its
    pad rows, its devices per host) under a parameter sharding strategy, on `hw`'s links. With
    offload_state the master weights and moments live in host memory and stream through the
    device a layer at a time (train.program.streamed: remat is then "offload" whatever it says). fp8:
    the layers' projections run at hw's FP8 peak (model.fp8). act_bytes: the compute dtype's;
    param_bytes: the gathered weights' and their gradients' (None: act_bytes, as the layers
    compute in it); sum_bytes: the hosts' gradient sums' where they cross hosts once a step
    (None: param_bytes; 4 under float16 compute, train.program.per_group). attn_impl: the
    attention kernel, for a calibrated GPU's rates (model.attn_impl)."""
    if offload_state:
        remat = "offload"
    q_heads, kv_heads = layout.exchanged_heads
    shard_group = shard_devices(layout, param_sharding)
    policy = REMAT_POLICIES.get(remat)
    a2a = _attention_traffic(shape, layout, policy, act_bytes).scale(shape.attention_layers)
    if shape.linear_layers:
        a2a = a2a + _linear_exchange_traffic(shape, layout, policy, act_bytes).scale(
            shape.linear_layers)
    a2a = a2a.scale(grad_accum)
    param_bytes = act_bytes if param_bytes is None else param_bytes
    params = _param_traffic(shape, layout, param_sharding, grad_accum=grad_accum,
                            act_bytes=act_bytes, param_bytes=param_bytes,
                            master_bytes=master_bytes,
                            sum_bytes=param_bytes if sum_bytes is None else sum_bytes)
    compute_s = _compute_seconds(shape, layout, hw, grad_accum, fp8, remat=remat,
                                 attn_impl=attn_impl)
    a2a_s, params_s = a2a.time(hw), params.time(hw) * (1 - overlap)
    memory = memory_bytes(shape, layout.tokens_per_device, shard_group, q_heads=q_heads,
                          kv_heads=kv_heads, remat=remat, act_bytes=act_bytes,
                          master_bytes=master_bytes, moment_bytes=moment_bytes,
                          tile_tokens=tile_tokens, ring=layout.ring, zigzag=layout.zigzag,
                          offload_state=offload_state,
                          kept_share=kept_share(layout, param_sharding), grad_accum=grad_accum,
                          host_sums=host_sum_devices(layout, param_sharding, grad_accum),
                          step_copies=step_copy_bytes(shape, layout, param_sharding, grad_accum,
                                                      act_bytes))
    host, host_s = _host_traffic(shape, layout, shard_group, hw, remat=remat,
                                 act_bytes=act_bytes, grad_accum=grad_accum,
                                 master_bytes=master_bytes, moment_bytes=moment_bytes,
                                 offload_state=offload_state)
    copy = host_copy_bytes(shape, layout, param_sharding, act_bytes) * grad_accum
    host, host_s = host + copy, host_s + 2 * copy / hw.host_bw
    return Prediction(layout, param_sharding, a2a, params, compute_s, a2a_s, params_s,
                      compute_s + a2a_s + params_s + host_s, memory, host, host_s)


def _attention_traffic(shape: ModelShape, layout: Layout, policy: RematPolicy,
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


def _linear_exchange_traffic(shape: ModelShape, layout: Layout, policy: RematPolicy,
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


def _param_traffic(shape: ModelShape, layout: Layout, param_sharding: str, *, grad_accum: int,
                   act_bytes: int, param_bytes: int, sum_bytes: int,
                   master_bytes: int = 4) -> Traffic:
    """Parameters per step: gathered forward and backward (ZeRO-3), gradients reduce-scattered,
    per microbatch; HSDP adds one cross-group all-reduce of the local shard per microbatch, host
    sharding one cross-host all-reduce of the host-local shard (per microbatch too: the step
    constrains each microbatch's gradient to the stored sharding, which in XLA's partitioner
    finishes its reduction there, so with grad_accum=A they cross hosts A times, as the
    compiled programs show: docs/limitations.md); a staged strategy gathers the layers in two
    stages (_staged_traffic); staged_keep its vocabulary tables too, across hosts to host-local
    copies per microbatch, in the compute dtype, used split inside the host (staged's follow
    fsdp). The gradients leave in the dtype the layers computed them in (param_bytes: bf16
    reduce-scatters under bf16 compute, as the compiled GPU programs show), not in the float32
    of the master weights; a host strategy's gathered tables are used (and their gradient
    summed across hosts) in the master dtype. Where each host keeps its gradient sum apart over
    the microbatches (basp_jax.sharding.sums_per_host: host and staged_keep with one BASP group
    per host), everything that crosses hosts does so once a step: the host-local copies
    gathered before the microbatches, the hosts' sums reduced after them, in sum_bytes a
    parameter (float32 under float16 compute)."""
    tokens_per_device = layout.tokens_per_device
    all_params = shape.num_params * param_bytes
    strategy = PARAM_SHARDINGS.get(param_sharding)
    table_sharding = strategy.tables or param_sharding  # staged: fsdp's tables (Strategy.tables)
    staged = strategy.use_axes is not None
    staged_tables = PARAM_SHARDINGS.get(table_sharding).use_axes is not None
    shard_group = strategy.shard_devices(layout)
    dph = min(layout.devices_per_host, layout.num_devices)
    # staged_keep's tables: used split over the devices of the host-local copy's host
    table_group = dph if staged_tables else shard_devices(layout, table_sharding)
    table_share = 0.0 if staged_tables else _shard_share(table_sharding, layout)
    tables = shape.embedding_params * param_bytes
    per_micro = Traffic()
    if vocab_parallel(shape, table_sharding, table_group, tokens_per_device, layout.num_devices):
        # basp_jax.vocab: the embedding and LM head stay where they are stored; the
        # tokens' rows move instead. Embedding: its rows reduce-scattered forward, their
        # cotangent gathered backward; loss: the hidden states gathered forward and again when
        # rematerialised, their f32 cotangent reduce-scattered.
        rows = table_group * tokens_per_device * shape.hidden_size * act_bytes
        per_micro = (collective_traffic("reduce-scatter", rows, table_group, table_share)
                     + collective_traffic("all-gather", rows, table_group, table_share).scale(3)
                     + collective_traffic("reduce-scatter", 2 * rows, table_group, table_share))
        gathered_tables = 0.0
    else:
        gathered_tables = tables
    layers = all_params - tables
    once = sums_per_host(param_sharding, layout, grad_accum)  # (one microbatch: the same bytes)
    # the hosts' sums cross in sum_bytes a parameter, the rest in param_bytes
    summed = sum_bytes / param_bytes if once else 1.0
    per_step = Traffic()
    if staged:
        per_step = _staged_traffic(layers, layout, strategy, grad_accum, sums_once=once,
                                   sum_scale=summed)
    if staged and not staged_tables:
        per_micro = per_micro + _gathered_traffic(gathered_tables, table_group, table_share)
    elif staged:
        # the tables' host-local copies (basp_jax.vocab.Table.use), in the compute dtype:
        # gathered across hosts per microbatch (in the GPU program; the CPU one hoists it)
        # and their gradient back across hosts once, onto the stored 1/N shards
        hosts = max(layout.num_devices // dph, 1)
        cross = (collective_traffic("all-gather", tables / dph, hosts, 1.0)
                 + collective_traffic("reduce-scatter", tables / dph * summed, hosts, 1.0))
        if once:
            per_step = per_step + cross
        else:
            per_micro = per_micro + cross
        if gathered_tables:  # too many tokens for rows inside the host: each device uses the
            # whole copy, gathered inside the host (its gradient summed there first)
            per_micro = per_micro + collective_traffic("all-gather", tables, dph, 0.0)
    else:
        per_micro = per_micro + _gathered_traffic(
            layers + gathered_tables, shard_group, _shard_share(param_sharding, layout))
    synced = all_params * summed
    if strategy.sync == "hosts" and not once:  # its tables' gradient crosses in the master dtype
        synced += gathered_tables * (master_bytes / param_bytes - 1)
    sync = _gradient_sync(strategy.sync, layout, synced)
    if once:
        return per_micro.scale(grad_accum) + sync + per_step
    return (per_micro + sync).scale(grad_accum) + per_step


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
    if strategy.keep_host_copy:
        gathers = 1
    elif strategy.offload_host_copy:
        gathers = grad_accum
    else:  # forward, and again for the recomputed backward
        gathers = 2 * grad_accum
    cross = collective_traffic("all-gather", host_copy, hosts, 1.0).scale(gathers) + \
        collective_traffic("reduce-scatter", host_copy * sum_scale, hosts, 1.0).scale(
            1 if sums_once else grad_accum)
    return cross + _gathered_traffic(layer_bytes, min(dph, layout.num_devices), 0.0).scale(
        grad_accum)


def _compute_seconds(shape: ModelShape, layout: Layout, hw: Hardware, grad_accum: int,
                     fp8: bool = False, *, remat: str = "full", attn_impl: str = "auto") -> float:
    """The step's training FLOPs on one device (padded heads computed too) at hw's efficiency,
    or at its calibration's measured rates (dense work, the attention kernel, the remat policy);
    fp8: the projections' at its FP8 peak (rate)."""
    q_heads, _ = layout.exchanged_heads
    attention_flops = shape.attention_flops_per_token(layout.seq_len) * q_heads / shape.num_heads
    if layout.ring > 1 and not layout.zigzag:
        # Contiguous causal chunks: each ring step waits for the busiest rank (zig-zag order
        # gives every rank the same causal work).
        attention_flops *= 2 - 1 / layout.ring
    tokens = layout.tokens_per_device * grad_accum
    fp8_flops = shape.fp8_flops_per_token() * tokens if fp8 else 0.0
    if hw.calibration is not None:
        dense = (shape.dense_flops_per_token() + shape.linear_attention_flops_per_token()) * tokens
        return hw.calibration.compute_seconds(dense, attention_flops * tokens, attn_impl=attn_impl,
                                              remat=remat, fp8_flops=fp8_flops)
    flops = (shape.dense_flops_per_token() + attention_flops) * tokens
    return hw.compute_seconds(flops, fp8_flops)


def _host_traffic(shape: ModelShape, layout: Layout, shard_group: int, hw: Hardware, *,
                  remat: str, act_bytes: int, grad_accum: int, master_bytes: int,
                  moment_bytes: int | None, offload_state: bool) -> tuple[float, float]:
    """(pinned host bytes per device, seconds of copies to and from it per step): the offload
    policy's residuals, and with offload_state the optimizer state streamed through."""
    q_heads, kv_heads = layout.exchanged_heads
    host = host_memory_bytes(shape, layout.tokens_per_device, q_heads=q_heads,
                             kv_heads=kv_heads, remat=remat, act_bytes=act_bytes) * grad_accum
    host_s = 2 * host / hw.host_bw  # to the host forward, back backward (no overlap assumed)
    if offload_state:
        state = shape.num_params * state_bytes_per_param(master_bytes, moment_bytes) / shard_group
        host += state
        # master weights in forward and backward, every state read by the finiteness check of the
        # update (train.program.streamed), then read and written by the update
        host_s += (2 * shape.num_params * master_bytes / shard_group + 3 * state) / hw.host_bw
    return host, host_s


def _tensor_widths(shape: ModelShape, q_heads: int, kv_heads: int) -> dict[str, float]:
    """Values per token per layer of each tensor a remat policy may keep (basp_jax.remat.TENSORS),
    in units of the compute dtype, with the exchanged (padded, replicated) heads."""
    hd, hidden, inter = shape.head_dim, shape.hidden_size, shape.intermediate_size
    return {"input": hidden,
            "exchanged": (2 * q_heads + 2 * kv_heads) * hd,
            "exchanged_kv": 2 * kv_heads * hd,
            "projections": (q_heads + 2 * kv_heads) * hd + 2 * hidden + 3 * inter,
            "elementwise": 2 * hidden + 2 * inter}


def _linear_tensor_widths(shape: ModelShape) -> dict[str, float]:
    """_tensor_widths of a hybrid's Gated DeltaNet layer (models.linear_attention): its exchanged
    q, k, v and output, and the float32 gates and decays (two values of the compute dtype each);
    its projections qkv, z, beta and decay. (Where the layout's sp does not divide the key heads,
    q and k are repeated to the value heads: not counted.)"""
    hidden, inter, heads = shape.hidden_size, shape.intermediate_size, shape.linear_num_value_heads
    key_dim = shape.linear_num_key_heads * shape.linear_key_head_dim
    value_dim = heads * shape.linear_value_head_dim
    return {"input": hidden,
            "exchanged": 2 * key_dim + 2 * value_dim + 2 * 2 * heads,
            # its exchanges are not named k/v apart (basp_jax.remat): full_kv keeps none of them
            "exchanged_kv": 0,
            "projections": 2 * key_dim + 2 * value_dim + 2 * heads + 2 * hidden + 3 * inter,
            "elementwise": 2 * hidden + 2 * inter}


def _linear_saved_per_token(shape: ModelShape, remat: str) -> float:
    """_saved_per_token of a Gated DeltaNet layer."""
    widths = _linear_tensor_widths(shape)
    return sum(widths[t] for t in REMAT_POLICIES.get(remat).saves)


def _saved_per_token(shape: ModelShape, remat: str, q_heads: int, kv_heads: int) -> float:
    """Values per token per layer the backward pass keeps on the device under a remat policy
    (basp_jax.remat.REMAT_POLICIES: its `saves`; the offload policies keep nothing there)."""
    widths = _tensor_widths(shape, q_heads, kv_heads)
    return sum(widths[t] for t in REMAT_POLICIES.get(remat).saves)


def _offloaded_per_token(shape: ModelShape, remat: str, q_heads: int, kv_heads: int) -> float:
    """Values per token per layer in host memory (the policy's `offloads`): the layer input,
    and with offload_exchanges attention's exchanged q, k, v and output."""
    widths = _tensor_widths(shape, q_heads, kv_heads)
    return sum(widths[t] for t in REMAT_POLICIES.get(remat).offloads)


def host_memory_bytes(shape: ModelShape, tokens_per_device: float, *, q_heads: int,
                      kv_heads: int, remat: str, act_bytes: int = 2) -> float:
    """Pinned host memory per device that an offload policy fills per step (0 for the others):
    every layer's offloaded residuals, copied there forward and back backward."""
    return (shape.num_layers * tokens_per_device * act_bytes
            * _offloaded_per_token(shape, remat, q_heads, kv_heads))


# Factors fitted to the compiled GPU programs (BENCHMARKS.md section 6): the paper's five models
# at 16K tokens, B=2, 2 x 4 A100-40GB (BASP and Ulysses, FSDP and HSDP: 15 programs) together with
# BASP FSDP at 16K-512K tokens on 2 x 4 A100-40GB and 8 x H100-80GB (44 programs): all 59 within
# 12% (16K only fitted to 3% but missed 128K by 27%). Fitted jointly, the factors trade off
# against each other: read them as a fit, not as counts of buffers. Refitted after the
# vocab-parallel embedding and loss and the major-dimension parameter sharding.
_GRADIENT_BUFFERS = 0.85  # the float32 gradient and what the update holds beside it
# With several microbatches, two float32 gradients more: the compiled 8B step on 2 x 4
# A100-40GB at grad_accum=2 holds 7.5 (fsdp) and 7.9 GiB (staged_keep) more than at 1, and at
# grad_accum=4 5.9 GiB (staged_keep), where this counts 7.5
_ACCUMULATE_BUFFERS = 2.0
# Where each host keeps its own sum (train.program.per_group) one float32 sum split over a
# host's devices: the same step under staged_keep holds 7.51 GiB more at grad_accum=2 than at 1,
# one float32 gradient over 4 devices being 7.48 (the microbatch's gradient is the bf16 copies')
_HOST_SUM_BUFFERS = 1.0
_SAVED_SHARE = 0.55  # of _saved_per_token that XLA keeps
_WORKING_FACTOR = 2.95  # a layer's recompute, its gathered weights and the chunked loss's buffers
# A hybrid's (Qwen3.5) layers run as a Python list, not under a scan (models.transformer): XLA's
# scheduler then recomputes many layers' forward passes ahead of their backward ones and holds
# their outputs together (at the peak of the 9B hybrid's step at 16K on 2 x 4 A100-40GB: ~117
# [tokens, intermediate] and ~115 [tokens, hidden] bf16 buffers, 14.6 GiB, where one layer's
# working set holds a few). Per layer, this share of the working set's per-token values (hidden
# x 6 + intermediate x 4): fitted to that step's three compiled programs (BENCHMARKS.md
# section 6), at 16K only.
_UNSCANNED_RECOMPUTE = 0.68


# A tiled layer (models.tiling, tile_tokens) keeps per token only what attention needs whole: the
# layer input and the residual stream's gradient (hidden width), and q, k, v and the output on
# both sides of the all-to-alls with their gradients (the exchanged heads' width, padded heads
# included). Fitted to compiled 8B steps at 512K tokens per device (offload, vocabulary-parallel
# loss, the attention kernel reading grouped-query heads in place) under jax 0.10.2 and 0.12.0.1,
# whose XLAs differ by 10-24% here: 8 x H100 4M (32 q / 8 kv heads exchanged: 57.9 / 49.8 GiB),
# 4 x 4M on 32 H100 (57.0 / 46.0) and one 16M sequence on 32 (heads 32 / 32: 60.5 / 54.8). The
# fit centres the two versions: each within 14% (0.10.2 under, 0.12 over). With k/v repeated to
# the query heads (before the kernel read them in place) the same steps took 66.8 / 58.3 GiB.
_TILED_WORKING_HIDDENS = 8.55  # values of hidden width per token
_TILED_WORKING_EXCHANGED = 0.64  # per value of q, k, v and output as exchanged
# The ring attention's working set (the query pieces, output and its cotangent, every ring step's
# k/v chunk, one float32 running sum and one hop's outputs at a time: basp_jax.ring), per float32
# query-sized buffer per step and piece: fitted to the compiled 8B step with one 16M-token
# sequence on 32 x H100 (ring 4 x all-to-all 8, zig-zag, offload, tiles of 4,096, the
# Pallas/Triton hop kernel of basp_jax.flash) under jax 0.10.2: 58.68 GiB with the state streamed
# (predicted 59.27) and 71.25 with it on the device (predicted 71.74; 0.37 would predict 71.10,
# under the 71.19 JAX may take, and optimizer.offload=auto would keep that state on the device).
# Before each hop's output was merged and its gradients summed as they came (all 16 hops'
# outputs held at once) the factor was 0.46 (74.68 / 82.4 GiB), with the pure-JAX blockwise
# hops 2.9 (242.9 GiB), and 271.5 GiB before the ring had its own backward pass, which keeps no
# step's partial output.
_RING_WORKING = 0.38


def state_bytes_per_param(master_bytes: int, moment_bytes: int | None) -> int:
    """Master weight and Adam's second moment in the master dtype, first moment in its own."""
    return 2 * master_bytes + (moment_bytes or master_bytes)


# The streamed step's working set (train.program.streamed, optimizer.offload) as a share of the tiled
# `working` term: fitted to the compiled 8B step on one H100 at 512K tokens (47.69 GiB under jax
# 0.10.2, 46.64 under 0.12.0.1, the attention kernel reading grouped-query heads in place; it
# gathers no weights). Refitted with the tiled factors above.
_STREAMED_WORKING_SHARE = 0.78


def memory_terms(shape: ModelShape, tokens_per_device: float, shard_group: int, *,
                 q_heads: int, kv_heads: int, remat: str = "full", act_bytes: int = 2,
                 master_bytes: int = 4, moment_bytes: int | None = None,
                 tile_tokens: int | None = None, ring: int = 1,
                 zigzag: bool = False, offload_state: bool = False,
                 kept_share: float = 0.0, grad_accum: int = 1,
                 host_sums: int | None = None,
                 step_copies: float = 0.0) -> dict[str, float]:
    """Peak memory per device of a train step (layers under a scan, chunked loss), by term:

    - state: parameters and Adam's second moment in the master dtype, its first moment in
      `moment_bytes` (default: the master dtype), over the devices that shard them (exactly the
      compiled program's arguments);
    - grads: the float32 gradient sum and the update's working copy, sharded alike;
    - saved: what the backward pass keeps of every layer (by remat policy, _saved_per_token;
      a hybrid's Gated DeltaNet layers their own tensors, _linear_tensor_widths);
    - working: one layer being recomputed and differentiated (its gathered weights, twice,
      and ~ (hidden x 6 + intermediate x 4) values per token), with what the loss holds; with
      tile_tokens the intermediate's share is one chunk's and the per-token share the
      attention's whole-shard tensors (_TILED_WORKING_HIDDENS, _TILED_WORKING_EXCHANGED);
    - ring (ring > 1): the ring attention's working set, in float32 buffers the size of the
      device's queries per ring step and query piece (2 pieces in zig-zag order; _RING_WORKING).
    - recompute (hybrids): the layers' recomputed outputs XLA holds ahead of their backward
      pass when the layers are a Python list (_UNSCANNED_RECOMPUTE);
    - kept: the layers' weights in the compute dtype that the forward keeps for the backward,
      kept_share of them per device (staged_keep: 1/devices per host, its host-local copies),
      plus step_copies bytes (step_copy_bytes: the copies a step that keeps each host's
      gradient sum holds beyond those).
    - accumulate (grad_accum > 1): the float32 gradient sum of the microbatches and the
      microbatch's gradient beside it, sharded as the parameters (_ACCUMULATE_BUFFERS: with
      one microbatch XLA folds the sum away); where each host keeps its own sum
      (host_sums: the devices of a host, host_sum_devices), that sum split over them
      (_HOST_SUM_BUFFERS).
    The last five carry factors fitted to compiled programs (above). What an offload policy
    keeps in host memory is host_memory_bytes, not a term here. With offload_state (the
    streamed step) the state is in host memory, the gradient is the layers' in the compute
    dtype, nothing is saved on the device, and the working set is _STREAMED_WORKING_SHARE of
    the same term.
    """
    p = shape.num_params
    per_token = _saved_per_token(shape, remat, q_heads, kv_heads)
    exchanged = (2 * q_heads + 2 * kv_heads) * shape.head_dim
    layer_per_token = 6 * shape.hidden_size + 4 * shape.intermediate_size
    # a hybrid's Gated DeltaNet layers keep their own exchanged tensors, and the largest of its
    # two kinds of layer is the one being recomputed at the peak
    saved_per_token = (shape.attention_layers * per_token
                       + shape.linear_layers * _linear_saved_per_token(shape, remat))
    layer_params = max(shape.layer_params, shape.linear_layer_params if shape.linear_layers else 0)
    recompute = (_UNSCANNED_RECOMPUTE * shape.num_layers * tokens_per_device * layer_per_token
                 * act_bytes) if shape.linear_layers else 0.0
    if tile_tokens is None:
        working = _WORKING_FACTOR * act_bytes * (
            2 * layer_params + tokens_per_device * layer_per_token)
    else:
        chunk = min(tile_tokens, tokens_per_device)
        working = act_bytes * (
            _WORKING_FACTOR * (2 * layer_params + chunk * 4 * shape.intermediate_size)
            + tokens_per_device * (_TILED_WORKING_HIDDENS * shape.hidden_size
                                   + _TILED_WORKING_EXCHANGED * exchanged))
    pieces = 2 if zigzag else 1
    ring_working = 0.0 if ring == 1 else (
        _RING_WORKING * ring * pieces * tokens_per_device * q_heads * shape.head_dim * 4)
    if offload_state:
        return {"ring": ring_working, "state": 0.0,
                "grads": shape.num_layers * shape.layer_params * act_bytes / shard_group,
                "saved": 0.0, "working": _STREAMED_WORKING_SHARE * working}
    return {
        "ring": ring_working,
        "state": p * state_bytes_per_param(master_bytes, moment_bytes) / shard_group,
        "grads": _GRADIENT_BUFFERS * p * 4 / shard_group,
        "saved": _SAVED_SHARE * tokens_per_device * saved_per_token * act_bytes,
        "working": working,
        "recompute": recompute,
        "kept": kept_share * act_bytes * _layer_weights(shape) + step_copies,
        "accumulate": 0.0 if grad_accum < 2 else (
            _HOST_SUM_BUFFERS * p * 4 / host_sums if host_sums
            else _ACCUMULATE_BUFFERS * p * 4 / shard_group),
    }


def memory_bytes(*args, **kwargs) -> float:
    """The sum of memory_terms (same arguments)."""
    return sum(memory_terms(*args, **kwargs).values())


def candidates(shape: ModelShape, *, batch: int, seq_len: int, num_devices: int,
               max_pad_rows: int = 0, devices_per_host: int | None = None,
               zigzag: bool = False) -> list[tuple[Layout, str]]:
    """Every (layout, parameter sharding) the attention can run: (groups, sp) x ring split x
    {fsdp, host, hsdp} (host on several hosts; hsdp where it differs from both), with head
    padding where no ring split divides the heads, and up to max_pad_rows masked rows; rings in
    zig-zag token order with zigzag. Ties go to the earlier sharding: fewest inter-host bytes
    first (host, hsdp, fsdp: basp_jax.sharding.Strategy.auto_rank)."""
    out = []
    # each group count once, with the fewest pad rows that make the rows divisible by it (more
    # would only add masked work): one split per divisor, however large max_pad_rows is
    # (the group counts of the modes the planner may pick: basp_jax.layout.MODES)
    splits = sorted((-batch % g, g) for g in _divisors(num_devices)
                    if -batch % g <= max_pad_rows and auto_mode(g) is not None)
    for pad, g in splits:
        layouts = _ring_splits(shape, num_devices=num_devices, batch=batch, seq_len=seq_len,
                               groups=g, devices_per_host=devices_per_host, pad_rows=pad,
                               zigzag=zigzag, mode=auto_mode(g))
        for layout in layouts:
            for sharding in _shardings(layout):
                out.append((layout, sharding))
    return out


def _ring_splits(shape: ModelShape, *, zigzag: bool = False, **split) -> list[Layout]:
    """The layouts of one (groups, sp) split worth predicting: without a ring where the heads
    allow it, plus the ring that keeps each all-to-all inside one host where the group spans
    hosts (ring attention across them: with grouped-query attention only the narrow k/v hop
    between hosts); else every ring that makes the heads fit, and head padding without a ring.
    None when the split is invalid (Layout.plan says why)."""
    try:
        plain = plan_layout(shape, **split, pad_heads=True)
    except LayoutError:
        return []
    if shape.linear_layers:  # a hybrid's linear-attention layers: no ring, whole value heads
        fits = not plain.pad_heads and shape.linear_num_value_heads % plain.sp == 0
        return [plain] if fits else []
    rings = _divisors(plain.sp)[1:] if plain.pad_heads else _host_rings(plain)
    found = []
    for ring in rings:
        try:
            found.append(plan_layout(shape, **split, ring=ring, zigzag=zigzag))
        except LayoutError:
            continue
    return found + [plain]


def _host_rings(layout: Layout) -> list[int]:
    """The ring split whose all-to-all runs fill one host each, when the group spans hosts."""
    dph = layout.devices_per_host
    if layout.sp <= dph or layout.sp % dph:
        return []
    return [layout.sp // dph]


def _shardings(layout: Layout) -> list[str]:
    """The parameter shardings that differ from each other for one split, in auto_rank order
    (basp_jax.sharding.Strategy)."""
    offered = [(s.auto_rank, name) for name, s in PARAM_SHARDINGS.items()
               if s.auto_rank is not None and s.applies(layout) and not s.same_as_another(layout)]
    return [name for _, name in sorted(offered)]


def plan_table(shape: ModelShape, *, batch: int, seq_len: int, num_devices: int, hw: Hardware,
               grad_accum: int = 1, memory_limit: float | None = None, max_pad_rows: int = 0,
               overlap: float = 0.0, remat: str = "full", master_bytes: int = 4,
               moment_bytes: int | None = None, tile_tokens: int | None = None,
               zigzag: bool = False, offload_state: bool = False,
               fp8: bool = False, attn_impl: str = "auto") -> list[Prediction]:
    """Predictions for every valid candidate, fastest first; those over memory last. With
    offload_state (the streamed step) host sharding is no candidate: it keeps per-host device
    copies of the weights, which the streamed step keeps in host memory instead."""
    limit = hw.memory_bytes if memory_limit is None else memory_limit
    preds = [
        predict(shape, layout, sharding, hw=hw, grad_accum=grad_accum, overlap=overlap,
                remat=remat, master_bytes=master_bytes, moment_bytes=moment_bytes,
                tile_tokens=tile_tokens, offload_state=offload_state, fp8=fp8,
                attn_impl=attn_impl)
        for layout, sharding in candidates(shape, batch=batch, seq_len=seq_len,
                                           num_devices=num_devices, max_pad_rows=max_pad_rows,
                                           devices_per_host=hw.devices_per_host,
                                           zigzag=zigzag)
        if not (offload_state and not PARAM_SHARDINGS.get(sharding).streamed)
    ]
    return sorted(preds, key=lambda p: (p.memory_bytes > limit, p.step_s))


def default_pad_rows(batch: int, num_devices: int) -> int:
    """How many masked rows the planner may add: none when the batch divides the devices (the
    paper's case), else enough to reach the next batch size that forms more groups, never more
    than the batch itself."""
    if num_devices % batch == 0:
        return 0
    best = math.gcd(batch, num_devices)
    # gcd(batch + pad, num_devices) repeats with period num_devices: no later pad does better
    for pad in range(1, min(batch, num_devices) + 1):
        if math.gcd(batch + pad, num_devices) > best:
            return pad
    return 0


def auto_layout(shape: ModelShape, *, batch: int, seq_len: int, num_devices: int, hw: Hardware,
                devices_per_host: int | None = None, grad_accum: int = 1,
                memory_limit: float | None = None, max_pad_rows: int | None = None,
                overlap: float = 0.0, remat: str = "full", zigzag: bool = False,
                master_bytes: int = 4, moment_bytes: int | None = None,
                tile_tokens: int | None = None,
                offload_state: bool = False, fp8: bool = False) -> tuple[Layout, Prediction]:
    """mode="auto": the fastest predicted layout that fits in memory, as a validated Layout.

    The Layout's batch includes any pad rows (Layout.pad_rows, which the trainer masks out of
    the loss); the prediction says which parameter sharding it assumed. zigzag: the layout's
    token order when it has a ring (Layout.plan).
    """
    if devices_per_host is not None:
        hw = dataclasses.replace(hw, devices_per_host=devices_per_host)
    if max_pad_rows is None:
        max_pad_rows = default_pad_rows(batch, num_devices)
    preds = plan_table(shape, batch=batch, seq_len=seq_len, num_devices=num_devices, hw=hw,
                       grad_accum=grad_accum, memory_limit=memory_limit,
                       max_pad_rows=max_pad_rows, overlap=overlap, remat=remat,
                       master_bytes=master_bytes, moment_bytes=moment_bytes,
                       tile_tokens=tile_tokens, zigzag=zigzag, offload_state=offload_state,
                       fp8=fp8)
    if not preds:
        raise ValueError(
            f"no layout splits seq_len={seq_len} over {num_devices} devices; use a multiple of "
            f"{num_devices}"
        )
    best = preds[0]
    return best.layout.replan(zigzag=zigzag), best
