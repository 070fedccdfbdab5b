"""The prediction of a train step and the layout search: predicted communication, memory and
step time of a layout on given hardware, and the fastest layout that fits.

Compute is the model's training FLOPs at a stated efficiency, or at a calibration's measured
rates. Communication (basp_jax.planner.traffic) is assumed not to overlap compute (the paper's
Ulysses all-to-alls sit on the critical path); `overlap` in [0, 1] hides that share of the
parameter collectives, which frameworks prefetch. Memory is the fitted model of
basp_jax.planner.memory. A way to run the step is a Layout (groups, sp, ring, head padding, pad
rows: basp_jax.layout) and a parameter sharding strategy.
"""

from __future__ import annotations

import dataclasses
import math

from ..layout import Layout, LayoutError, divisors, auto_mode, mode_of
from ..remat import REMAT_POLICIES
from ..sharding import PARAM_SHARDINGS
from .hardware import Hardware
from .memory import (host_copy_bytes, host_sum_devices, kept_share, memory_bytes, shard_devices,
                     step_copy_bytes)
from . import strategies
from .precisions import Precisions
from .shape import ModelShape
from .traffic import (Traffic, attention_traffic, expert_dispatch_traffic, host_traffic,
                      linear_exchange_traffic, param_traffic)



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


def layout_name(layout: Layout, param_sharding: str) -> str:
    """e.g. 'basp (2,4) hsdp [ring 2, pad heads, +1 pad rows]', as the planner prints it."""
    kind = mode_of(layout.groups)
    extras = [f"ring {layout.ring}"] if layout.ring > 1 else []
    extras += ["pad heads"] if layout.pad_heads else []
    extras += [f"+{layout.pad_rows} pad rows"] if layout.pad_rows else []
    extra = f" [{', '.join(extras)}]" if extras else ""
    return f"{kind} ({layout.groups},{layout.sp}) {param_sharding}{extra}"


def plan_layout(shape: ModelShape, *, num_devices: int, batch: int, seq_len: int, groups: int,
                devices_per_host: int | None = None, ring: int = 1, pad_heads: bool = False,
                pad_rows: int = 0, zigzag: bool = False, mode: str = "basp") -> Layout:
    """The validated Layout of `shape`'s heads for one (groups, sp) split: what the planner
    enumerates and predicts. devices_per_host defaults to one host."""
    per_host = num_devices if devices_per_host is None else min(devices_per_host, num_devices)
    return Layout.plan(num_devices, batch, seq_len, shape.num_heads, shape.num_kv_heads,
                       devices_per_host=per_host, mode=mode, groups=groups, ring=ring,
                       pad_heads=pad_heads, pad_rows=pad_rows, zigzag=zigzag)


def predict(
    shape: ModelShape,
    layout: Layout,
    param_sharding: str,
    *,
    hw: Hardware,
    grad_accum: int = 1,
    precisions: Precisions = Precisions(),
    overlap: float = 0.0,
    remat: str = "full",
    tile_tokens: int | None = None,
    offload_state: bool = False,
    fp8: bool = False,
    attn_impl: str = "auto",
    expert_parallel: str = "auto",
) -> Prediction:
    """Predicted per-step time and memory of a layout (for `shape`'s heads; its batch with its
    pad rows, its devices per host) under a parameter sharding strategy, on `hw`'s links. With
    offload_state the master weights and moments live in host memory and stream through the
    device a layer at a time (train.program.streamed: remat is then "offload" whatever it says).
    fp8: the layers' projections run at hw's FP8 peak (model.fp8). precisions: the bytes of the
    compute dtype, the gathered weights, the hosts' sums, the master weights and the moments
    (basp_jax.planner.precisions). attn_impl: the attention kernel, for a calibrated GPU's
    rates (model.attn_impl). expert_parallel: where a sparse model's experts run
    (model.expert_parallel: ModelShape.expert_split)."""
    if offload_state:
        remat = "offload"
    act = precisions.act
    q_heads, kv_heads = layout.exchanged_heads
    shard_group = shard_devices(layout, param_sharding)
    policy = REMAT_POLICIES.get(remat)
    a2a = attention_traffic(shape, layout, policy, act).scale(shape.attention_layers)
    if shape.linear_layers:
        a2a = a2a + linear_exchange_traffic(shape, layout, policy, act).scale(
            shape.linear_layers)
    if shape.sparse_layers:  # the routed tokens' exchanges: priced with attention's
        a2a = a2a + expert_dispatch_traffic(shape, layout, policy, act, expert_parallel).scale(
            shape.sparse_layers)
    a2a = a2a.scale(grad_accum)
    params = param_traffic(shape, layout, param_sharding, grad_accum=grad_accum,
                           precisions=precisions)
    compute_s = _compute_seconds(shape, layout, hw, grad_accum, fp8, remat=remat,
                                 attn_impl=attn_impl)
    a2a_s, params_s = a2a.time(hw), params.time(hw) * (1 - overlap)
    memory = memory_bytes(shape, layout.tokens_per_device, shard_group, q_heads=q_heads,
                          kv_heads=kv_heads, remat=remat, precisions=precisions,
                          tile_tokens=tile_tokens, ring=layout.ring, zigzag=layout.zigzag,
                          offload_state=offload_state,
                          kept_share=kept_share(layout, param_sharding), grad_accum=grad_accum,
                          host_sums=host_sum_devices(layout, param_sharding, grad_accum),
                          step_copies=step_copy_bytes(shape, layout, param_sharding, grad_accum,
                                                      precisions),
                          expert_split=shape.expert_split(
                              layout.sp, min(layout.devices_per_host, layout.num_devices),
                              expert_parallel))
    host, host_s = host_traffic(shape, layout, shard_group, hw, remat=remat,
                                precisions=precisions, grad_accum=grad_accum,
                                offload_state=offload_state)
    copy = host_copy_bytes(shape, layout, param_sharding, precisions) * grad_accum
    host, host_s = host + copy, host_s + 2 * copy / hw.host_bw
    return Prediction(layout, param_sharding, a2a, params, compute_s, a2a_s, params_s,
                      compute_s + a2a_s + params_s + host_s, memory, host, host_s)


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


def candidates(shape: ModelShape, *, batch: int, seq_len: int, num_devices: int,
               max_pad_rows: int = 0, devices_per_host: int | None = None,
               zigzag: bool = False) -> list[tuple[Layout, str]]:
    """Every (layout, parameter sharding) the attention can run: (groups, sp) x ring split x
    {fsdp, host, hsdp} (host on several hosts; hsdp where it differs from both), with head
    padding where no ring split divides the heads, and up to max_pad_rows masked rows; rings in
    zig-zag token order with zigzag. Ties go to the earlier sharding: fewest inter-host bytes
    first (host, hsdp, fsdp: basp_jax.planner.strategies)."""
    out = []
    # each group count once, with the fewest pad rows that make the rows divisible by it (more
    # would only add masked work): one split per divisor, however large max_pad_rows is
    # (the group counts of the modes the planner may pick: basp_jax.layout.MODES)
    splits = sorted((-batch % g, g) for g in divisors(num_devices)
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
    rings = divisors(plain.sp)[1:] if plain.pad_heads else _host_rings(plain)
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
    """The parameter shardings that differ from each other for one split, in the planner's
    order (basp_jax.planner.strategies)."""
    return strategies.ranked(layout)


def plan_table(shape: ModelShape, *, batch: int, seq_len: int, num_devices: int, hw: Hardware,
               grad_accum: int = 1, memory_limit: float | None = None, max_pad_rows: int = 0,
               overlap: float = 0.0, remat: str = "full",
               precisions: Precisions = Precisions(), tile_tokens: int | None = None,
               zigzag: bool = False, offload_state: bool = False,
               fp8: bool = False, attn_impl: str = "auto",
               expert_parallel: str = "auto") -> list[Prediction]:
    """Predictions for every valid candidate, fastest first; those over memory last. With
    offload_state (the streamed step) host sharding is no candidate: it keeps per-host device
    copies of the weights, which the streamed step keeps in host memory instead."""
    limit = hw.memory_bytes if memory_limit is None else memory_limit
    preds = [
        predict(shape, layout, sharding, hw=hw, grad_accum=grad_accum, overlap=overlap,
                remat=remat, precisions=precisions, tile_tokens=tile_tokens,
                offload_state=offload_state, fp8=fp8, attn_impl=attn_impl,
                expert_parallel=expert_parallel)
        for layout, sharding in candidates(shape, batch=batch, seq_len=seq_len,
                                           num_devices=num_devices, max_pad_rows=max_pad_rows,
                                           devices_per_host=hw.devices_per_host,
                                           zigzag=zigzag)
        if not (offload_state and not PARAM_SHARDINGS.get(sharding).streams)
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
                precisions: Precisions = Precisions(), tile_tokens: int | None = None,
                offload_state: bool = False, fp8: bool = False,
                expert_parallel: str = "auto") -> tuple[Layout, Prediction]:
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
                       precisions=precisions, tile_tokens=tile_tokens, zigzag=zigzag,
                       offload_state=offload_state, fp8=fp8, expert_parallel=expert_parallel)
    if not preds:
        raise ValueError(
            f"no layout splits seq_len={seq_len} over {num_devices} devices; use a multiple of "
            f"{num_devices}"
        )
    best = preds[0]
    return best.layout.replan(zigzag=zigzag), best
