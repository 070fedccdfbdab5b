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
                     runtime.platform: gpu stops with one line (ConfigError) when JAX has no GPU,
                     naming the pip extra to install; cpu keeps JAX off the GPUs. Where a GPU
                     run is expected (and JAX is not imported yet), train.process.gpu_defaults fills in
                     XLA flags, the memory fraction and a compilation cache the user has not
                     set, and says so on stdout.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import math
import os
import re
import socket
import sys
import threading

from . import gpu_defaults
from .peers import PEER_FAILURE_STATUS
from ..config.schema import Config, ConfigError

CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")
NVIDIA_DRIVER_VERSION = "/proc/driver/nvidia/version"
# the oldest NVIDIA driver each of JAX's CUDA builds runs on (JAX's installation guide)
MIN_DRIVER = {"cuda13": 580, "cuda12": 525}
JAX_DEFAULT_HEARTBEAT_S = 100  # jax.distributed.initialize's heartbeat_timeout_seconds default
JAX_DEFAULT_INIT_S = 300  # and its initialization_timeout default
JOIN_BACKSTOP_S = 30  # JAX's own join deadline comes this long after join_deadline's
CPU_CACHE_HANGS_FROM = (0, 12, 1)  # see _compile_cpu_programs_afresh


def _want_distributed(cfg: Config) -> bool:
    dist = cfg.runtime.distributed
    if dist.enabled is not None:
        return dist.enabled
    return bool(dist.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS"))


def configure(cfg: Config) -> None:
    platform = cfg.runtime.platform
    expect_gpu = platform == "gpu" or (platform == "auto" and _gpu_likely())
    # XLA reads XLA_FLAGS once, as JAX starts: a process that imported JAX already (a notebook,
    # tests) has made its choice, and a start-up line about flags set now would not be true
    fresh = "jax" not in sys.modules
    settings = gpu_defaults.apply_env(os.environ) if expect_gpu and fresh else None
    if platform != "auto" and not os.environ.get("JAX_PLATFORMS") and fresh:
        # Named platforms make a failing CUDA backend an exception (caught below) instead of
        # JAX's multi-line warning and a silent fall back to the CPU; the CPU stays available.
        # (In a process that runs JAX already, its backends stay: select_devices picks.)
        os.environ["JAX_PLATFORMS"] = "cpu" if platform == "cpu" else "cuda,cpu"
    n = cfg.runtime.cpu_devices
    if platform != "gpu":
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            # older jax reads only the XLA flag; harmless when jax_num_cpu_devices is honoured
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    import jax

    if platform != "gpu":
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
        # JAX's preemption service installs a C-level SIGTERM handler of its own in initialize,
        # silently replacing train.process.stop's (measured, jax 0.10.2 and 0.12): a SIGTERM while the
        # step compiles would then be swallowed, and it knows no SIGINT. train.process.stop agrees on
        # the stop step itself (see there why JAX's reached_preemption_sync_point cannot).
        jax.config.update("jax_enable_preemption_service", False)
        coordinator = dist.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
        if process_id == 0 and coordinator:
            check_coordinator_port_free(coordinator)
        try:
            with join_deadline(dist.join_timeout_s, process_id, num_processes, coordinator):
                jax.distributed.initialize(
                    coordinator_address=dist.coordinator,  # None: JAX_COORDINATOR_ADDRESS or the cluster
                    num_processes=num_processes, process_id=process_id,
                    initialization_timeout=jax_initialization_timeout_s(dist.join_timeout_s),
                    heartbeat_timeout_seconds=jax_heartbeat_timeout_s(dist.peer_timeout_s))
        except Exception as e:  # noqa: BLE001 (no cluster found, coordinator unreachable, ...)
            detail = " ".join(str(e).split())[:300] or type(e).__name__
            raise ConfigError(
                f"runtime.distributed: joining the multi-process run failed ({detail}); set "
                "runtime.distributed.coordinator, num_processes and process_id (or "
                "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID), run under SLURM or "
                "Open MPI, or set runtime.distributed.enabled=false") from None
    if jax.distributed.is_initialized() and jax.process_count() > 1 \
            and jax.devices()[0].platform == "cpu":
        _compile_cpu_programs_afresh(jax)
    if platform == "gpu":
        try:
            on_gpu = jax.devices()[0].platform == "gpu"
            detail = None
        except RuntimeError as e:  # the CUDA backend failed to start
            on_gpu, detail = False, " ".join(str(e).split())[:240]
        if not on_gpu:
            raise ConfigError(no_gpu_message(jax.__version__, detail))
    if settings is not None and jax.devices()[0].platform == "gpu":
        cache = gpu_defaults.enable_compilation_cache()
        if jax.process_index() == 0:
            print(gpu_defaults.describe(*settings, *cache), flush=True)


def _compile_cpu_programs_afresh(jax) -> None:
    """Turn the persistent compilation cache off for a multi-process CPU run where jaxlib cannot
    run what it reads back: from jaxlib 0.12.1 (0.12.0.1 reads it fine) the CPU client runs a
    cached program without the processes' gloo collectives, and the first step waits forever."""
    if not (jax.config.jax_compilation_cache_dir and jax.config.jax_enable_compilation_cache):
        return
    version = _jaxlib_version()
    if tuple(int(part) for part in re.findall(r"\d+", version)[:4]) < CPU_CACHE_HANGS_FROM:
        return
    jax.config.update("jax_enable_compilation_cache", False)
    if jax.process_index() == 0:
        print(f"compilation cache off: jaxlib {version} cannot run a cached program across CPU "
              "processes; each run compiles its own", flush=True)


def _jaxlib_version() -> str:
    from jaxlib import version

    return version.__version__


def jax_heartbeat_timeout_s(peer_timeout_s: float) -> int:
    """JAX's own heartbeat (its coordination service aborts every process, with a C++ stack
    trace, once a peer has missed it this long): a backstop behind train.process.peers' watch, which says
    the same in one line after peer_timeout_s. Twice our timeout, never under JAX's default of
    100 s (a peer_timeout_s of 0 turns our watch off and leaves JAX's as it is)."""
    return max(JAX_DEFAULT_HEARTBEAT_S, math.ceil(2 * peer_timeout_s))


def jax_initialization_timeout_s(join_timeout_s: float) -> int:
    """How long jax.distributed.initialize waits for every process to join: JOIN_BACKSTOP_S
    after join_deadline has ended the process with its one line (JAX's own end is an abort with
    a C++ stack trace). join_timeout_s, not peer_timeout_s: processes that a scheduler starts
    tens of seconds apart are not dead peers."""
    return math.ceil(join_timeout_s) + JOIN_BACKSTOP_S


@contextlib.contextmanager
def join_deadline(timeout_s: float, process_id, num_processes, coordinator):
    """While the block runs (jax.distributed.initialize, which returns once every process has
    joined): after timeout_s the process ends with one line and PEER_FAILURE_STATUS. A thread
    does it, since the main thread waits inside JAX's C++ (which releases the GIL)."""
    if timeout_s <= 0:
        yield
        return
    joined = threading.Event()

    def watch():
        if joined.wait(timeout_s):
            return
        me = "this process" if process_id is None else f"process {process_id}"
        of = "" if num_processes is None else f" of {num_processes}"
        at = f" at {coordinator}" if coordinator else ""
        print(f"error: peer: {me}{of} waited {timeout_s:g} s (runtime.distributed."
              f"join_timeout_s) for the other processes to join the run{at}: one has not "
              "started, was given another coordinator or num_processes, or two were given the "
              "same process_id; start every process with its own process_id, or raise "
              f"join_timeout_s (exit status {PEER_FAILURE_STATUS})", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(PEER_FAILURE_STATUS)

    threading.Thread(target=watch, name="join-deadline", daemon=True).start()
    try:
        yield
    finally:
        joined.set()


def check_coordinator_port_free(coordinator: str) -> None:
    """Process 0 hosts the coordination service on the coordinator's port: a listener there
    already is most often another process 0 (two processes given process_id 0), which JAX would
    let share the port, both then waiting forever. Refused with one line (ConfigError)."""
    port = coordinator.rsplit(":", 1)[-1]
    if not port.isdigit():
        return  # JAX says what is wrong with the address
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this host
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (TIME_WAIT is free)
            probe.bind((host, int(port)))
            return
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return  # e.g. no permission: JAX will say
            raise ConfigError(
                f"runtime.distributed.coordinator {coordinator}: port {port} is in use on this "
                "host, where process 0 serves the run: another process was given process_id 0 "
                "too, or another program holds the port; give each process its own process_id "
                "or choose a free port") from None
        finally:
            probe.close()


def _gpu_likely() -> bool:
    """Before JAX starts: a CUDA build of JAX and a visible NVIDIA GPU (what JAX itself checks)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (any(importlib.util.find_spec(p) for p in CUDA_PLUGINS)
            and os.path.exists(NVIDIA_DRIVER_VERSION) and visible not in ("", "-1"))


def driver_version(path: str = NVIDIA_DRIVER_VERSION) -> str | None:
    """The NVIDIA kernel driver's version, e.g. '550.54.15'; None without a driver."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    found = re.search(r"Kernel Module.*?\s(\d{3,}\.\d+(?:\.\d+)?)\s", text)
    return found.group(1) if found else None


def install_advice(driver: str | None) -> str:
    """Which extra of this project installs the CUDA build of JAX that this machine's driver runs."""
    both = (f'pip install -e ".[cuda13]" (NVIDIA driver >= {MIN_DRIVER["cuda13"]}) or '
            f'".[cuda12]" (driver >= {MIN_DRIVER["cuda12"]})')
    if driver is None:
        return f"this machine has no NVIDIA driver ({NVIDIA_DRIVER_VERSION} is missing); on a GPU host: {both}"
    major = int(driver.split(".")[0])
    for extra, minimum in MIN_DRIVER.items():
        if major >= minimum:
            return f'NVIDIA driver {driver} found: pip install -e ".[{extra}]"'
    return (f"NVIDIA driver {driver} is older than JAX's CUDA 12 build needs "
            f"({MIN_DRIVER['cuda12']}); update the driver, then {both}")


def no_gpu_message(jax_version: str, detail: str | None = None,
                   driver_path: str = NVIDIA_DRIVER_VERSION) -> str:
    """The one line for runtime.platform=gpu on a JAX without a GPU."""
    plugins = [p for p in CUDA_PLUGINS if importlib.util.find_spec(p)]
    if detail:
        what = f"JAX {jax_version}'s CUDA backend failed to start ({detail})"
    elif plugins:
        what = f"JAX {jax_version} ({plugins[0]}) found no visible GPU"
    else:
        what = f"JAX {jax_version} is the CPU-only build (no CUDA plugin)"
    return (f"runtime.platform=gpu but {what}; {install_advice(driver_version(driver_path))}; "
            "or train on the CPU with runtime.platform=cpu runtime.cpu_devices=N")


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
