"""The `runtime` section of a config: where a run's processes and devices come from (the CPU's
emulated devices or the GPUs, jax.distributed's processes) and how long the process waits on its
peers and its steps. train.config.schema assembles it with the other sections."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional

from .errors import ConfigError

# train.process.peers polls the peers every min(1 s, timeout / 4); shorter timeouts would fire on noise
MIN_PEER_TIMEOUT_S = 2.0
MAX_PEER_TIMEOUT_S = 7 * 24 * 3600.0  # a week: no live peer is silent longer (0 turns it off)
MAX_CPU_DEVICES = 1024  # emulated CPU devices; XLA's CPU client refuses absurd counts
MAX_PROCESSES = 1 << 20


@dataclasses.dataclass
class DistributedConfig:
    enabled: Optional[bool] = None  # null: when coordinator is set or JAX_COORDINATOR_ADDRESS is
    coordinator: Optional[str] = None  # host:port of process 0
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    # multi-process: when a peer (or the coordinator) is silent this long, stop with exit status 3
    # instead of hanging in a collective; 0 disables
    peer_timeout_s: float = 30.0
    # multi-process: how long each process waits at start-up for the others to join the run (a
    # scheduler or container may start them minutes apart), then stops with exit status 3
    join_timeout_s: float = 300.0

    def validate(self) -> None:
        if self.peer_timeout_s != 0 and not (
                MIN_PEER_TIMEOUT_S <= self.peer_timeout_s <= MAX_PEER_TIMEOUT_S):
            raise ConfigError(
                f"runtime.distributed.peer_timeout_s must be 0 (off) or lie in "
                f"[{MIN_PEER_TIMEOUT_S:g}, {MAX_PEER_TIMEOUT_S:g}] seconds, got "
                f"{self.peer_timeout_s:g}")
        if not MIN_PEER_TIMEOUT_S <= self.join_timeout_s <= MAX_PEER_TIMEOUT_S:
            raise ConfigError(
                f"runtime.distributed.join_timeout_s must lie in [{MIN_PEER_TIMEOUT_S:g}, "
                f"{MAX_PEER_TIMEOUT_S:g}] seconds, got {self.join_timeout_s:g}")
        if self.coordinator and (self.num_processes is None or self.process_id is None):
            raise ConfigError(
                "runtime.distributed.coordinator needs num_processes and process_id as well"
            )
        if self.num_processes is not None and not 0 < self.num_processes <= MAX_PROCESSES:
            raise ConfigError(
                f"runtime.distributed.num_processes must lie in [1, {MAX_PROCESSES}], got "
                f"{self.num_processes}")
        if self.process_id is not None and self.num_processes is not None and not (
            0 <= self.process_id < self.num_processes
        ):
            raise ConfigError(
                f"runtime.distributed.process_id={self.process_id} must lie in "
                f"[0, num_processes={self.num_processes})"
            )


@dataclasses.dataclass
class RuntimeConfig:
    # auto: the GPUs when JAX has a CUDA backend that finds one, else cpu_devices emulated CPU
    # devices; gpu: GPUs or stop with one line naming the pip extra to install (the configs in
    # configs/gpu); cpu: the CPU even where GPUs are (emulating cpu_devices)
    platform: Literal["auto", "cpu", "gpu"] = "auto"
    cpu_devices: Optional[int] = None  # required unless platform=gpu: CPU devices (per process) to emulate
    devices: Optional[int] = None  # use the first N devices of all processes (null: all of them)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    # a step that runs longer ends the run (one line, exit status 4, checkpoints kept): seconds;
    # null: 20x the median step, at least 300 s; 0: off
    step_timeout_s: Optional[float] = None

    def validate(self) -> None:
        """The device counts and the step timeout (runtime.distributed validates itself)."""
        if self.step_timeout_s is not None and not (
                math.isfinite(self.step_timeout_s) and self.step_timeout_s >= 0):
            raise ConfigError(f"runtime.step_timeout_s must be null (20x the median step), 0 "
                              f"(off) or a number of seconds > 0, got {self.step_timeout_s}")
        if self.platform != "gpu":
            if self.cpu_devices is None:
                raise ConfigError("runtime.cpu_devices is required: CPU devices to emulate when "
                                  "training on the CPU (runtime.platform=gpu needs none)")
        if self.cpu_devices is not None and self.cpu_devices <= 0 and not (
                self.platform == "gpu" and self.cpu_devices == 0):
            raise ConfigError(
                f"runtime.cpu_devices must be a positive integer, got {self.cpu_devices} "
                f"(CPU devices to emulate when training on the CPU; runtime.platform=gpu needs "
                f"none)"
            )
        if self.cpu_devices is not None and self.cpu_devices > MAX_CPU_DEVICES:
            raise ConfigError(f"runtime.cpu_devices={self.cpu_devices} is more CPU devices than "
                              f"can be emulated; use at most {MAX_CPU_DEVICES}")
        if self.devices is not None and self.devices <= 0:
            raise ConfigError(
                f"runtime.devices must be a positive integer or null (all devices), "
                f"got {self.devices}"
            )
