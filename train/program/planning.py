"""From the config's parallel section to a Layout and a parameter sharding, before anything compiles.

    parallel.mode = basp | ulysses   the layout Layout.plan gives (groups = gcd(B, N) for basp)
    parallel.mode = auto             the planner's fastest predicted layout for parallel.hardware:
                                     groups, ring split, head padding and masked pad rows
    parallel.mode = adaptive         basp's layout and its adaptive siblings (adaptive_set): each
                                     step runs the one with the most groups that holds its documents
    parallel.param_sharding = auto   on several hosts: staged_keep (FSDP's shards, gathered across
                                     hosts once per step: the least inter-host traffic) where the
                                     planner says it fits in memory, else host, staged, hsdp where
                                     that fits, else fsdp; on one host: hsdp or fsdp
    parallel.zigzag                  with a ring, the layout's zig-zag token order (Layout.zigzag)
    model.remat = auto               the fastest predicted remat policy (and tiling) that fits
                                     parallel.hardware's device and host memory, or where it
                                     leaves little free the leanest within 1% (memory_policy)
"""

from __future__ import annotations

import dataclasses
import os

from basp_jax import Layout, LayoutError
from basp_jax import adaptive
from basp_jax.planner import cost, memory
from basp_jax.planner.hardware import HARDWARE, Hardware
from basp_jax.planner.precisions import Precisions
from basp_jax.planner.shape import ModelShape
from basp_jax.planner import strategies as planner_strategies
from basp_jax.remat import REMAT_POLICIES, auto_policies

from ..config import dtypes
from ..config.schema import Config, ConfigError, replace


def model_shape(mcfg) -> ModelShape:
    return mcfg.shape  # models.ModelConfig.shape: the one place a model's sizes become a shape


def hardware(cfg: Config, devices_per_host: int) -> Hardware:
    p = cfg.parallel
    if p.hardware not in HARDWARE:
        raise ConfigError(
            f"parallel.hardware={p.hardware!r} is unknown; use one of {', '.join(HARDWARE)}"
        )
    hw = dataclasses.replace(HARDWARE[p.hardware], devices_per_host=devices_per_host)
    if p.memory_gb is not None:
        hw = dataclasses.replace(hw, memory_bytes=p.memory_gb * 1e9)
    return hw


def precisions(cfg: Config) -> Precisions:
    """Bytes per value for basp_jax.planner (cost.predict, memory.memory_terms): the compute
    dtype's (activations, the gathered weights, their gradients), the hosts' gradient sums',
    which cross hosts in float32 under float16 compute (train.program.per_group), the master
    parameters' and Adam's first moment's."""
    compute = _compute_dtype(cfg)
    act = dtypes.nbytes(compute)
    master = dtypes.nbytes(cfg.model.param_dtype)
    mu = cfg.optimizer.mu_dtype
    return Precisions(act=act, sum=4 if compute == "float16" else act, master=master,
                      moments=None if mu is None else dtypes.nbytes(mu))


def fp8_planned(cfg: Config) -> bool:
    """Whether the projections run in FP8 on parallel.hardware (model.fp8; "auto": on sm90+),
    for the predicted compute time."""
    from models import fp8

    return fp8.enabled_on_target(cfg.model.fp8, cfg.parallel.hardware)


def predicted_step_s(cfg: Config, mcfg, run_plan) -> float:
    """basp_jax.planner.cost's step time for a run plan on parallel.hardware (train.tools.aot's report)."""
    hw = hardware(cfg, run_plan.layout.devices_per_host)
    return cost.predict(model_shape(mcfg), run_plan.layout, run_plan.strategy, hw=hw,
                        grad_accum=cfg.train.grad_accum, remat=run_plan.remat,
                        tile_tokens=run_plan.tile_tokens, fp8=fp8_planned(cfg),
                        attn_impl=planned_attn_impl(cfg, mcfg, run_plan.layout),
                        precisions=precisions(cfg), expert_parallel=cfg.model.expert_parallel,
                        offload_state=cfg.optimizer.offload is True).step_s


def planned_attn_impl(cfg: Config, mcfg, layout: Layout) -> str:
    """The kernel model.attn_impl runs on parallel.hardware (basp_jax.kernels.resolve_impl's
    rule: "auto" runs cuDNN on unpacked input from sm80, our Pallas kernel on packed documents;
    a ring's hops run our kernel), for a calibrated GPU's attention rate."""
    import jax

    from basp_jax import gpus, kernels

    impl = cfg.model.attn_impl
    capability = gpus.get(cfg.parallel.hardware).compute_capability
    if layout.ring > 1:
        return "pallas" if impl == "auto" and capability >= (8, 0) else impl
    q_heads, _ = layout.exchanged_heads
    q = jax.ShapeDtypeStruct((1, layout.seq_len, q_heads // layout.sp, mcfg.head_dim),
                             _compute_dtype(cfg))
    try:
        return kernels.resolve_impl(impl, q, layout.seq_len, "gpu", has_segments=cfg.data.pack,
                                    capability=capability)
    except ValueError:  # a kernel this GPU cannot run: the compile says so; predict as given
        return impl


def plan(cfg: Config, mcfg, num_devices: int, devices_per_host: int) -> tuple[Layout, str]:
    """The layout (pad rows, ring and token order included) and the parameter sharding."""
    p = cfg.parallel
    shape = model_shape(mcfg)
    hw = hardware(cfg, devices_per_host)
    # model.remat=auto is decided after the layout (memory_policy); the layout and sharding are
    # chosen under the leanest policy it may pick, so none is ruled out for memory it need not use
    remat, tile = cfg.model.remat, cfg.model.tile_tokens
    if remat == "auto":
        remat, tile = AUTO_REMAT[-1], tile or AUTO_TILE_TOKENS
    # ranked at the planner's default compute width whatever model.dtype is: only the state's
    # bytes are the config's here
    state = precisions(cfg)
    common = dict(hw=hw, grad_accum=cfg.train.grad_accum, remat=remat, tile_tokens=tile,
                  precisions=Precisions(master=state.master, moments=state.moments),
                  offload_state=cfg.optimizer.offload is True, fp8=fp8_planned(cfg),
                  expert_parallel=cfg.model.expert_parallel)
    if p.mode == "auto":
        try:
            layout, best = cost.auto_layout(
                shape, batch=cfg.train.microbatch_size, seq_len=cfg.data.seq_len,
                num_devices=num_devices, zigzag=p.zigzag, **common)
        except ValueError as err:
            raise ConfigError(f"parallel.mode=auto: {err}") from None
        # (under optimizer.offload, cost.plan_table offers no host sharding)
        strategy = best.param_sharding if p.param_sharding == "auto" else p.param_sharding
        return layout, strategy

    layout = Layout.plan(
        num_devices=num_devices, batch=cfg.train.microbatch_size, seq_len=cfg.data.seq_len,
        num_heads=mcfg.num_heads, num_kv_heads=mcfg.num_kv_heads, devices_per_host=devices_per_host,
        mode="basp" if p.mode == "adaptive" else p.mode, groups=p.groups, pad_heads=p.pad_heads,
        ring=p.ring, zigzag=p.zigzag,
    )
    if p.param_sharding != "auto":
        return layout, p.param_sharding
    # Fewest inter-host bytes first (basp_jax.planner.strategies), the first whose memory fits;
    # the last (fsdp, the least memory) is taken whether or not it fits (check_memory says so).
    # Adaptive layouts take only a placement every layout of the set shares (not hsdp).
    choices = planner_strategies.ranked(
        layout, streamed=cfg.optimizer.offload is True, distinct=False,
        keep=lambda name: p.mode != "adaptive" or adaptive.shares_placement(name))
    for strategy in choices[:-1]:
        pred = cost.predict(shape, layout, strategy, **common)
        # (staged_offload's host-local copies, an offload policy's residuals: host memory)
        if pred.memory_bytes <= hw.memory_bytes and \
                pred.host_memory_bytes <= hw.host_memory_bytes:
            return layout, strategy
    return layout, choices[-1]


def layout_note(cfg: Config, layout: Layout) -> str | None:
    """The start-up note of a parallel.mode=basp run that takes fewer groups than its microbatch
    has rows because the rows and devices share no larger factor (B=3 on 8 devices: one group of
    8, Ulysses's layout under basp's name); None where basp gets the groups it can."""
    batch, devices = cfg.train.microbatch_size, layout.num_devices
    if cfg.parallel.mode != "basp" or cfg.parallel.groups is not None \
            or layout.groups >= min(batch, devices):
        return None
    fits = [d for d in range(min(batch, devices), 0, -1) if devices % d == 0][0]
    examples = " or ".join(str(n) for n in sorted({fits, devices}))
    groups = f"{layout.groups} group" + ("s" if layout.groups > 1 else "")
    ulysses = " (Ulysses's layout: every all-to-all spans all devices)" if layout.groups == 1 \
        else ""
    return (f"note: parallel.mode=basp runs {groups} of {layout.sp} devices{ulysses} because "
            f"train.microbatch_size={batch} and the {devices} devices share no factor above "
            f"{layout.groups} (groups = gcd({batch}, {devices})); a microbatch_size that divides "
            f"{devices} or is a multiple of it (e.g. {examples}) gets a group per row or per "
            "device, and parallel.mode=auto may add masked rows instead")


def adaptive_set(cfg: Config, layout: Layout, strategy: str) -> tuple[Layout, ...]:
    """parallel.mode=adaptive: the static layout (first) and its siblings of more groups over the
    same devices (basp_jax.adaptive.expand), with a ring where a group spans hosts when
    parallel.ring asks for one; () for any other mode. A one-line ConfigError for a parameter
    sharding that would move between layouts, pad rows, or a ring that is not the hosts'."""
    p = cfg.parallel
    if p.mode != "adaptive":
        return ()
    host_ring = adaptive.host_ring(layout.sp, layout.devices_per_host)
    if p.ring not in (1, host_ring):
        raise ConfigError(
            f"parallel.mode=adaptive runs a ring only to keep each all-to-all inside a host: "
            f"parallel.ring={p.ring}, but the static layout's group of sp={layout.sp} spans "
            f"{host_ring} host(s); set parallel.ring={host_ring} or 1")
    try:
        layouts = adaptive.expand(layout, param_sharding=strategy, host_rings=p.ring > 1,
                                  zigzag=p.zigzag and p.ring > 1)
    except LayoutError as err:
        raise ConfigError(f"parallel.mode=adaptive: {err}") from None
    assert layouts[0] == layout, (layouts[0], layout)  # the static layout stays the run's
    return layouts


def resolve_offload(cfg: Config, mcfg, num_devices: int, devices_per_host: int) -> Config:
    """cfg with optimizer.offload=auto decided: false where the ordinary step's planned device
    and host memory fit parallel.hardware (it moves no state over PCIe), else true where the
    streamed step (train.program.streamed) applies and fits, else false (check_memory or train.tools.aot then
    say it does not fit)."""
    if cfg.optimizer.offload != "auto":
        return cfg
    if cfg.parallel.mode == "adaptive":  # (the streamed step has no adaptive layouts)
        return replace(cfg, "optimizer.offload=false")
    from .streamed import check_offload

    ordinary = replace(cfg, "optimizer.offload=false")
    if _planned_fit(ordinary, mcfg, num_devices, devices_per_host) is not None:
        return ordinary
    streaming = replace(cfg, "optimizer.offload=true")
    try:
        fit = _planned_fit(streaming, mcfg, num_devices, devices_per_host)
        check_offload(streaming, fit[1] if fit else "fsdp", _compute_dtype(cfg), mcfg)
    except ConfigError:
        return ordinary
    return streaming if fit is not None else ordinary


def _planned_fit(cfg: Config, mcfg, num_devices: int, devices_per_host: int):
    """(layout, strategy) of cfg's plan when its estimated device and host memory fit
    parallel.hardware, else None."""
    layout, strategy = plan(cfg, mcfg, num_devices, devices_per_host)
    remat, tile = memory_policy(cfg, mcfg, layout, strategy, devices_per_host)
    need, _ = memory_estimate(cfg, mcfg, layout, strategy, remat=remat, tile_tokens=tile)
    host = host_memory_estimate(cfg, mcfg, layout, strategy, remat=remat)
    hw = hardware(cfg, devices_per_host)
    fits = need <= hw.memory_bytes and host <= hw.host_memory_bytes
    return (layout, strategy) if fits else None


class ResourceError(ValueError):
    """The run cannot fit the memory it has; the one-line message names the sizes and the fix."""


def device_memory(device) -> float | None:
    """Bytes one device can use: the accelerator's limit, or on CPU the host's available memory
    shared by the emulated devices of this process; None when unknown."""
    if device.platform != "cpu":
        try:
            return float(device.memory_stats()["bytes_limit"])
        except Exception:  # noqa: BLE001 (no stats on this backend)
            return None
    available = host_memory_available()
    if available is None:
        return None
    import jax

    return available / jax.local_device_count()


def host_memory_available() -> float | None:
    """Bytes of memory this machine has available: Linux's MemAvailable (/proc/meminfo), else
    the available pages os.sysconf counts, else its physical pages (macOS counts no available
    ones: the total is what it can never exceed); None when none is known."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: line.split()[1] for line in f}
        return float(info["MemAvailable"]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        pass
    for pages in ("SC_AVPHYS_PAGES", "SC_PHYS_PAGES"):
        try:
            return float(os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError, AttributeError):
            continue
    return None


# model.remat=auto: the policies tried (basp_jax.remat.REMAT_POLICIES' `auto` order, the leanest
# last), and the chunk size tried when no untiled one fits
AUTO_REMAT = auto_policies()
AUTO_TILE_TOKENS = 4096
# Where the fastest policy that fits leaves less than AUTO_HEADROOM of the device's budget
# (parallel.hardware's, what JAX may take) free by the formula's prediction, model.remat=auto
# takes the leanest one predicted at most AUTO_HEADROOM_COST slower: memory a step need not fill
# is left to what runs beside it and to the formula's error (tests/e2e/test_gpu_compile.py
# bounds it; BENCHMARKS.md, "Figures behind design choices", has an example). No shipped config
# changes policy.
AUTO_HEADROOM = 0.25
AUTO_HEADROOM_COST = 0.01


def memory_policy(cfg: Config, mcfg, layout: Layout, strategy: str,
                  devices_per_host: int) -> tuple[str, int | None]:
    """(model.remat, model.tile_tokens) the step runs with: the configured ones, or with
    model.remat=auto the fastest predicted (basp_jax.planner.cost.predict) of AUTO_REMAT whose
    device memory fits parallel.hardware and whose offloaded residuals fit its host's share per
    GPU (or the leanest nearly as fast, AUTO_HEADROOM); untiled where one fits
    (model.tile_tokens, when set, is kept), else with AUTO_TILE_TOKENS. Nothing fits: the
    leanest (offload, tiled), which check_memory or train.tools.aot then refuse."""
    if cfg.optimizer.offload is True:  # the streamed step keeps each layer's input on the host
        return "offload", cfg.model.tile_tokens or AUTO_TILE_TOKENS
    if cfg.model.remat != "auto":
        return cfg.model.remat, cfg.model.tile_tokens
    hw = hardware(cfg, devices_per_host)
    tiles = [cfg.model.tile_tokens] if cfg.model.tile_tokens else [None, AUTO_TILE_TOKENS]
    # with one device per sequence some policies are another one (full_kv, inputs: full)
    policies = [r for r in AUTO_REMAT
                if layout.sp > 1 or REMAT_POLICIES.get(r).without_exchanges is None]
    for tile in tiles:
        fitting = []
        for remat in policies:
            pred = cost.predict(model_shape(mcfg), layout, strategy, hw=hw, remat=remat,
                                fp8=fp8_planned(cfg),
                                tile_tokens=tile, grad_accum=cfg.train.grad_accum,
                                precisions=precisions(cfg),
                                expert_parallel=cfg.model.expert_parallel,
                                offload_state=cfg.optimizer.offload is True)
            if pred.memory_bytes <= hw.memory_bytes and \
                    pred.host_memory_bytes <= hw.host_memory_bytes:
                fitting.append((pred.step_s, remat, pred.memory_bytes))
        if fitting:
            step_s, remat, need = min(fitting)
            if need > (1 - AUTO_HEADROOM) * hw.memory_bytes:
                near = [f for f in fitting if f[0] <= (1 + AUTO_HEADROOM_COST) * step_s]
                remat = min(near, key=lambda f: f[2])[1]
            return remat, tile
    return AUTO_REMAT[-1], tiles[-1]


def _compute_dtype(cfg: Config) -> str:
    """model.dtype; "auto" unresolved (train.tools.aot --plan) as parallel.hardware would compute."""
    dtype = cfg.model.dtype
    if dtype == "auto":
        from basp_jax import gpus

        gpu = gpus.GPUS.get(cfg.parallel.hardware)
        dtype = "float32" if gpu is None else gpu.auto_dtype  # bf16, or fp16 (a T4)
    return dtype


def memory_estimate(cfg: Config, mcfg, layout: Layout, strategy: str, *,
                    remat: str | None = None, tile_tokens: int | None = None
                    ) -> tuple[float, str]:
    """The bytes per device a train step holds (basp_jax.planner.memory.memory_terms, the
    planner's formula: within 15% of the compiled GPU programs of the paper's models) and a
    breakdown. remat / tile_tokens: the plan's (memory_policy), else the config's."""
    q_heads, kv_heads = layout.exchanged_heads
    sizes = precisions(cfg)
    terms = memory.memory_terms(
        model_shape(mcfg), layout.tokens_per_device, memory.shard_devices(layout, strategy),
        q_heads=q_heads, kv_heads=kv_heads, remat=remat or cfg.model.remat,
        precisions=sizes, tile_tokens=tile_tokens or cfg.model.tile_tokens,
        ring=layout.ring, zigzag=layout.zigzag, kept_share=memory.kept_share(layout, strategy),
        grad_accum=cfg.train.grad_accum,
        host_sums=memory.host_sum_devices(layout, strategy, cfg.train.grad_accum),
        step_copies=memory.step_copy_bytes(model_shape(mcfg), layout, strategy,
                                           cfg.train.grad_accum, sizes),
        offload_state=cfg.optimizer.offload is True,
        expert_split=model_shape(mcfg).expert_split(
            layout.sp, min(layout.devices_per_host, layout.num_devices),
            cfg.model.expert_parallel))
    detail = ", ".join(f"{name} {value / 1e9:.3g} GB" for name, value in terms.items())
    return sum(terms.values()), detail


def host_memory_estimate(cfg: Config, mcfg, layout: Layout, strategy: str, *,
                         remat: str | None = None) -> float:
    """Pinned host memory per device the remat policy fills per step (basp_jax.planner.memory.
    host_memory_bytes; 0 unless it offloads), the host-local copy of a strategy that keeps it
    there (basp_jax.planner.memory.host_copy_bytes), with optimizer.offload the state it holds
    too."""
    q_heads, kv_heads = layout.exchanged_heads
    shape, sizes = model_shape(mcfg), precisions(cfg)
    host = memory.host_memory_bytes(shape, layout.tokens_per_device, q_heads=q_heads,
                                    kv_heads=kv_heads, remat=remat or cfg.model.remat,
                                    precisions=sizes)
    host += memory.host_copy_bytes(shape, layout, strategy, sizes)
    host *= cfg.train.grad_accum  # XLA gives each microbatch's residuals their own buffers
    if cfg.optimizer.offload is True:
        host += shape.num_params * memory.state_bytes_per_param(
            sizes.master, sizes.moments) / memory.shard_devices(layout, strategy)
    return host


def check_memory(cfg: Config, mcfg, layout: Layout, strategy: str, devices, *,
                 remat: str | None = None, tile_tokens: int | None = None) -> None:
    """Refuse a run whose estimated memory per device exceeds what a device has, before the data
    pipeline generates a row or anything compiles (seq_len=1e9 would otherwise grow the process
    to tens of GB first)."""
    limit = device_memory(devices[0])
    need, detail = memory_estimate(cfg, mcfg, layout, strategy, remat=remat,
                                   tile_tokens=tile_tokens)
    if limit is not None and need > limit:
        raise ResourceError(_too_big(cfg, need, limit, devices[0].platform, detail))
    check_host_memory(cfg, mcfg, layout, strategy, devices, remat=remat, device_need=need)


def check_host_memory(cfg: Config, mcfg, layout: Layout, strategy: str, devices, *,
                      remat: str | None = None, device_need: float = 0.0) -> None:
    """Refuse, on every platform, a run whose host memory (this process's devices' pinned host
    memory: offloaded residuals and, with optimizer.offload, the master weights and Adam moments;
    on CPU the devices' own memory, device_need each, too) exceeds what the machine has
    available: it would pass every other check, write run.dir and die allocating."""
    available = host_memory_available()
    if available is None:
        return
    import jax

    local = sum(1 for d in devices if d.process_index == jax.process_index())
    pinned = host_memory_estimate(cfg, mcfg, layout, strategy, remat=remat) * local
    need = pinned + (device_need * local if devices[0].platform == "cpu" else 0.0)
    if need <= available:
        return
    what = (f"optimizer.offload=true keeps the master weights and Adam moments of "
            f"{mcfg.num_params() / 1e9:.3g}B parameters there" if cfg.optimizer.offload is True
            else f"model.remat={remat or cfg.model.remat} offloads residuals there")
    if devices[0].platform == "cpu":
        what += f"; the {local} CPU devices' memory is host memory too"
    raise ResourceError(
        f"the run needs about {need / 1e9:.3g} GB of host memory on this machine ({what}) but "
        f"{available / 1e9:.3g} GB is available; use a smaller model or more hosts, lower "
        f"data.seq_len={cfg.data.seq_len} or train.microbatch_size="
        f"{cfg.train.microbatch_size}, or free memory")


def check_compiled_memory(cfg: Config, compiled, devices) -> None:
    """The compiled step's own memory analysis (arguments + outputs + temporaries) against the
    device's memory, before the first step runs."""
    limit = device_memory(devices[0])
    try:
        m = compiled.memory_analysis()
        need = float(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                     - m.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 (not every backend reports it)
        return
    if limit is not None and need > limit:
        raise ResourceError(_too_big(cfg, need, limit, devices[0].platform,
                                     "from the compiled train step's memory analysis"))


def _too_big(cfg: Config, need: float, limit: float, platform: str, detail: str) -> str:
    remat = "" if cfg.model.remat != "none" else ", set model.remat=full"
    return (f"the train step needs about {need / 1e9:.3g} GB per device ({detail}) but a "
            f"{platform} device has {limit / 1e9:.3g} GB; lower data.seq_len={cfg.data.seq_len} "
            f"or train.microbatch_size={cfg.train.microbatch_size}{remat}, or use more devices")
