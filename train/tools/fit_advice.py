"""Whether a step can fit a GPU before and after it is compiled: the refusals made before
compiling (the state alone, or the planner's estimate far past the memory) and, for a compiled
step that does not fit, what would (would_fit)."""

from __future__ import annotations

from .aot_errors import DoesNotFitUncompiled

GiB = 2**30


def check_state_fits(cfg, mcfg, target: str, num_devices: int) -> None:
    """Refuse, in one line, a step whose master weights and Adam moments (the part of memory no
    layout, remat policy or kernel can shrink) do not fit even spread over all num_devices GPUs:
    in device memory, or with optimizer.offload=true in the host memory each GPU may use."""
    from basp_jax import gpus
    from basp_jax.planner.hardware import HARDWARE
    from basp_jax.planner.memory import state_bytes_per_param

    from ..program import planning

    p = planning.precisions(cfg)
    per_param = state_bytes_per_param(p.master, p.moments)
    need = planning.model_shape(mcfg).num_params * per_param / num_devices
    if cfg.optimizer.offload is True:
        budget, where = HARDWARE[target].host_memory_bytes, "the host memory each GPU may use"
    else:
        budget, where = gpus.usable_memory_bytes(gpus.get(target)), f"what JAX may take on {target}"
    if need <= budget:
        return
    fewest = -(-need * num_devices // budget)
    raise DoesNotFitUncompiled(
        f"does not fit, not compiled: the parameters and optimizer state alone need "
        f"{need / GiB:.1f} GiB per GPU sharded over {num_devices} GPU(s) "
        f"({per_param} bytes per parameter), more than {where} ({budget / GiB:.1f} GiB); use at "
        f"least {fewest:.0f} GPUs of this kind (--hosts / --gpus-per-host), a GPU with more memory"
        + ("" if cfg.optimizer.offload is True else ", or optimizer.offload=true"))


# The planner's memory formula is within 15% of the compiled programs; a step it puts at more than
# this many times the memory is refused without compiling (the compile says the same, minutes
# later), while one nearer the edge is compiled and the report says whether it fits.
REFUSE_ABOVE_PLANNED = 2.0


def check_planned_fit(cfg, mcfg, target: str, num_devices: int) -> None:
    """Refuse, in one line, a step the planner's memory formula puts at more than
    REFUSE_ABOVE_PLANNED times what JAX may take on each GPU (cfg with parallel.hardware=target
    and its cluster set, as report() passes it)."""
    from basp_jax import gpus

    from ..program.planning import memory_estimate, memory_policy, plan

    per_host = cfg.parallel.devices_per_host
    layout, strategy = plan(cfg, mcfg, num_devices, per_host)
    remat, tile = memory_policy(cfg, mcfg, layout, strategy, per_host)
    need = memory_estimate(cfg, mcfg, layout, strategy, remat=remat, tile_tokens=tile)[0]
    usable = gpus.usable_memory_bytes(gpus.get(target))
    if need <= REFUSE_ABOVE_PLANNED * usable:
        return
    raise DoesNotFitUncompiled(
        f"does not fit, not compiled: the planner puts the step ({layout.short_name}, "
        f"{strategy} parameters, model.remat={remat}) at {need / GiB:.1f} GiB per GPU, "
        f"{need / usable:.1f}x what JAX may take on {target} ({usable / GiB:.1f} GiB; the "
        f"formula is within 15% of compiled steps); lower data.seq_len, use more GPUs "
        f"(--hosts / --gpus-per-host) or a GPU with more memory")


def would_fit(cfg, r: dict, num_devices: int, devices_per_host: int) -> str:
    """What would fit when the compiled step does not: model.remat=auto at this length, else the
    longest shorter data.seq_len (halving) and the fewest hosts (doubling, up to 8x) that fit at
    this length, by the planner's formula scaled to what this compile measured (the formula is
    within 15% of compiled programs; the scale takes this one's error out). A suggestion, not a
    compiled result."""
    from ..config.schema import replace
    from ..program.planning import memory_estimate, memory_policy, plan
    from ..prepare import model_config

    mcfg = model_config(cfg)
    scale = r["peak_bytes_per_device"] / r["formula_memory_bytes"]
    usable = r["usable_memory_bytes"]

    def fits(variant, devices=num_devices) -> bool:
        try:
            layout, strategy = plan(variant, mcfg, devices, devices_per_host)
        except ValueError:  # a length this layout cannot split
            return False
        remat, tile = memory_policy(variant, mcfg, layout, strategy, devices_per_host)
        need = memory_estimate(variant, mcfg, layout, strategy, remat=remat, tile_tokens=tile)[0]
        return need * scale <= usable

    def with_remat(variant, devices=num_devices) -> str | None:
        """'' when `variant` fits as it is, ' model.remat=auto' when it fits with it, else None."""
        if fits(variant, devices):
            return ""
        if cfg.model.remat != "auto" and fits(replace(variant, "model.remat=auto"), devices):
            return " model.remat=auto"
        return None

    if (extra := with_remat(cfg)) is not None:
        return extra.strip()
    options = []
    seq = cfg.data.seq_len // 2
    while seq >= 256 and not options:
        if (extra := with_remat(replace(cfg, f"data.seq_len={seq}"))) is not None:
            options.append(f"data.seq_len={seq}{extra}")
        seq //= 2
    hosts = num_devices // devices_per_host
    for more in (2 * hosts, 4 * hosts, 8 * hosts):
        devices = more * devices_per_host
        variant = replace(cfg, f"runtime.devices={devices}")
        if (extra := with_remat(variant, devices)) is not None:
            options.append(f"--hosts {more} ({devices} GPUs){extra}")
            break
    return " or ".join(options) or \
        "nothing shorter nor up to 8x the hosts: a smaller model (or a GPU with more memory)"
