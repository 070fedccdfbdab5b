"""From the config's parallel section to a Layout and a parameter sharding, before anything compiles.

    parallel.mode = basp | ulysses   the layout Layout.plan gives (groups = gcd(B, N) for basp)
    parallel.mode = auto             the planner's fastest predicted layout for parallel.hardware:
                                     groups, ring split, head padding and masked pad rows
    parallel.param_sharding = auto   hsdp (shards inside each seq group, the least inter-host
                                     traffic) where the planner says it fits in memory, else fsdp
"""

from __future__ import annotations

import dataclasses

from basp_jax import Layout
from basp_jax import cost
from basp_jax.ring import zigzag_order

from .config import Config, ConfigError


def model_shape(mcfg) -> cost.ModelShape:
    return cost.ModelShape(
        num_layers=mcfg.num_layers, hidden_size=mcfg.hidden_size,
        intermediate_size=mcfg.intermediate_size, num_heads=mcfg.num_heads,
        num_kv_heads=mcfg.num_kv_heads, head_dim=mcfg.head_dim, vocab_size=mcfg.vocab_size,
        tie_word_embeddings=mcfg.tie_word_embeddings,
    )


def hardware(cfg: Config, devices_per_host: int) -> cost.Hardware:
    p = cfg.parallel
    if p.hardware not in cost.HARDWARE:
        raise ConfigError(
            f"parallel.hardware={p.hardware!r} is unknown; use one of {', '.join(cost.HARDWARE)}"
        )
    hw = dataclasses.replace(cost.HARDWARE[p.hardware], devices_per_host=devices_per_host)
    if p.memory_gb is not None:
        hw = dataclasses.replace(hw, memory_bytes=p.memory_gb * 1e9)
    return hw


def plan(cfg: Config, mcfg, num_devices: int, devices_per_host: int) -> tuple[Layout, str]:
    """The layout (its batch includes any pad rows) and the parameter sharding strategy."""
    p = cfg.parallel
    shape = model_shape(mcfg)
    hw = hardware(cfg, devices_per_host)
    common = dict(batch=cfg.train.microbatch_size, seq_len=cfg.data.seq_len, num_devices=num_devices,
                  hw=hw, grad_accum=cfg.train.grad_accum, remat=cfg.model.remat)
    if p.mode == "auto":
        try:
            layout, best = cost.auto_layout(shape, **common)
        except ValueError as err:
            raise ConfigError(f"parallel.mode=auto: {err}") from None
        strategy = best.candidate.param_sharding if p.param_sharding == "auto" else p.param_sharding
        return layout, strategy

    layout = Layout.plan(
        num_devices=num_devices, batch=cfg.train.microbatch_size, seq_len=cfg.data.seq_len,
        num_heads=mcfg.num_heads, num_kv_heads=mcfg.num_kv_heads, devices_per_host=devices_per_host,
        mode=p.mode, groups=p.groups, pad_heads=p.pad_heads, ring=p.ring,
    )
    if p.param_sharding != "auto":
        return layout, p.param_sharding
    if layout.groups == 1:
        return layout, "fsdp"  # one group: hsdp is fsdp
    candidate = cost.Candidate(layout.groups, layout.sp, "hsdp", ring=layout.ring,
                               pad_heads=layout.pad_heads)
    predicted = cost.predict(shape, candidate, **common)
    return layout, "hsdp" if predicted.memory_bytes <= hw.memory_bytes else "fsdp"


def sequence_order(cfg: Config, layout: Layout):
    """The token order along the sequence: None (natural), or basp_jax.ring.zigzag_order when a
    ring splits the sequence (parallel.zigzag, on by default), so the causal work is balanced."""
    if layout.ring == 1 or not cfg.parallel.zigzag:
        return None
    if cfg.data.seq_len % (2 * layout.sp):
        raise ConfigError(
            f"zig-zag ring attention needs data.seq_len divisible by 2 * sp = {2 * layout.sp}, got "
            f"{cfg.data.seq_len}; change seq_len or set parallel.zigzag=false"
        )
    return zigzag_order(cfg.data.seq_len, layout.ring)
