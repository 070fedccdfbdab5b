"""Process-level setup that must happen before JAX initialises its backends.

    configure(cfg)   emulate runtime.cpu_devices CPU devices (used only when no accelerator is
                     present: the setting affects the CPU backend alone) and join a multi-process
                     run through jax.distributed.initialize when the config or environment says so:
                     runtime.distributed.{coordinator,num_processes,process_id}, or the variables
                     JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, or a cluster that
                     jax detects itself (SLURM, Open MPI) with runtime.distributed.enabled=true.
                     Under such a launcher JAX assumes one process per GPU; with one process per
                     node set JAX_LOCAL_DEVICE_IDS to all of the node's GPUs (as
                     scripts/slurm_train.sbatch does), or each process gets one GPU.
"""

from __future__ import annotations

import os

from .config import Config, ConfigError


def _want_distributed(cfg: Config) -> bool:
    dist = cfg.runtime.distributed
    if dist.enabled is not None:
        return dist.enabled
    return bool(dist.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS"))


def configure(cfg: Config) -> None:
    n = cfg.runtime.cpu_devices
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        # older jax reads only the XLA flag; it is harmless when jax_num_cpu_devices is honoured
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    import jax

    current = getattr(jax.config, "jax_num_cpu_devices", -1)
    try:
        if current is None or current < n:  # a caller that already asked for more keeps them
            jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # backends already up (e.g. in-process tests); loop.run checks the device count
    if _want_distributed(cfg) and not jax.distributed.is_initialized():
        dist = cfg.runtime.distributed
        num_processes = dist.num_processes if dist.num_processes is not None \
            else _env_int("JAX_NUM_PROCESSES", minimum=1)
        process_id = dist.process_id if dist.process_id is not None \
            else _env_int("JAX_PROCESS_ID", minimum=0)
        try:
            jax.distributed.initialize(
                coordinator_address=dist.coordinator,  # None: JAX_COORDINATOR_ADDRESS or the cluster
                num_processes=num_processes, process_id=process_id)
        except Exception as e:  # noqa: BLE001 (no cluster found, coordinator unreachable, ...)
            detail = " ".join(str(e).split())[:300] or type(e).__name__
            raise ConfigError(
                f"runtime.distributed: joining the multi-process run failed ({detail}); set "
                "runtime.distributed.coordinator, num_processes and process_id (or "
                "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID), run under SLURM or "
                "Open MPI, or set runtime.distributed.enabled=false") from None


def _env_int(name: str, minimum: int) -> int | None:
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ConfigError(f"environment variable {name}={raw!r} must be an integer >= {minimum}")
    return value
