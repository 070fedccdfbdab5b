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

from .config import Config


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
        env_int = lambda name: int(os.environ[name]) if os.environ.get(name) else None  # noqa: E731
        jax.distributed.initialize(
            coordinator_address=dist.coordinator,  # None: JAX_COORDINATOR_ADDRESS or the cluster
            num_processes=dist.num_processes if dist.num_processes is not None
            else env_int("JAX_NUM_PROCESSES"),
            process_id=dist.process_id if dist.process_id is not None else env_int("JAX_PROCESS_ID"),
        )
