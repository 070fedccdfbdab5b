"""JAX's CUDA plugin for compiling without a GPU: installed beside this environment by
`python -m train.tools.aot --install`, put on the path before JAX starts (use_plugin), and the
deviceless GPU topology it compiles for (gpu_devices). Only this command puts it on its path, so
`import jax` elsewhere stays quiet on CPU-only machines."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
import tempfile

from .aot_errors import AotError

# JAX's CUDA plugins, tried in this order for the installed jaxlib: a jaxlib release sometimes
# reaches the registry before one of them (the cuDNN wheel is the one built for that CUDA).
PLUGIN_FLAVOURS = (("cuda12", "nvidia-cudnn-cu12>=9.8,<10"),
                   ("cuda13", "nvidia-cudnn-cu13>=9.8,<10"))


def jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        raise AotError("jaxlib is not installed; pip install -e . first") from None


def plugin_dir() -> str:
    """Where --install puts the CUDA plugin: beside this environment, one folder per jaxlib."""
    base = os.environ.get("BASP_GPU_COMPILE_DIR") or os.path.join(sys.prefix, "basp-gpu-compile")
    return os.path.join(base, f"jaxlib-{jaxlib_version()}")


def _plugin_installed_here() -> bool:
    return importlib.util.find_spec("jax_cuda12_plugin") is not None or \
        importlib.util.find_spec("jax_cuda13_plugin") is not None


def plugin_platform() -> bool:
    """Whether JAX ships its CUDA plugin for this machine (Linux x86_64 only)."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


def _check_platform() -> None:
    if not plugin_platform():
        raise AotError(
            f"compiling for a GPU needs JAX's CUDA plugin, which exists for Linux x86_64 only "
            f"(this is {platform.system()} {platform.machine()}); run it on a Linux x86_64 machine")


def plugin_ready() -> bool:
    """Whether the CUDA plugin is installed, in this environment or by --install."""
    return _plugin_installed_here() or os.path.isdir(os.path.join(plugin_dir(), "jax_plugins"))


def install_plugin() -> str:
    """pip-install the CUDA plugin matching this jaxlib, and cuDNN (for fused attention), into
    plugin_dir(): the CUDA 12 one, else the CUDA 13 one where only that is published for this
    jaxlib. Only the three packages: no CUDA runtime libraries are needed to compile."""
    _check_platform()
    version = jaxlib_version()
    target = plugin_dir()
    os.makedirs(os.path.dirname(target), exist_ok=True)
    # Two installs at once (parallel test workers, two shells) would interleave pip's writes into
    # one folder: the second waits for the first, then installs over a complete copy.
    with open(target + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        tried = []
        for flavour, cudnn in PLUGIN_FLAVOURS:
            packages = [f"jax-{flavour}-plugin=={version}", f"jax-{flavour}-pjrt=={version}", cudnn]
            print(f"installing {', '.join(packages)} into {target}", flush=True)
            cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade",
                   "--target", target, *packages]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if not done.returncode:
                return target
            tried.append(f"{' '.join(packages)} (exit {done.returncode})")
            if "No matching distribution" not in done.stderr:
                break  # a failure other than "not published": the next flavour would not help
            print(f"jax-{flavour}-plugin=={version} is not published; trying the next CUDA",
                  flush=True)
    sys.stderr.write(done.stdout + done.stderr)
    raise AotError(f"pip could not install {'; nor '.join(tried)}; see its output above")


def use_plugin() -> None:
    """Make the CUDA plugin importable and keep JAX on the CPU (must run before `import jax`).
    The XLA flags and memory fraction a GPU run of the trainer sets (train.process.gpu_defaults) are set
    here too, so the program compiled is the one a run would compile."""
    global _plugin_started
    if _plugin_started:  # a second command in the same process (tests/e2e/aot_worker.py)
        return
    os.environ["JAX_PLATFORMS"] = "cpu"  # compile for the GPU topology; run nothing on a GPU
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no CUDA driver is needed
    if "jax" in sys.modules:
        raise RuntimeError("train.tools.cuda_plugin.use_plugin() must run before jax is imported")
    from ..process import gpu_defaults

    gpu_defaults.apply_env(os.environ)
    if not _plugin_installed_here():
        _add_plugin_folder()
    _start_jax()
    _plugin_started = True


_plugin_started = False


def _add_plugin_folder() -> None:
    _check_platform()
    folder = plugin_dir()
    if not os.path.isdir(os.path.join(folder, "jax_plugins")):
        raise AotError(
            f"JAX's CUDA plugin is not installed (looked in this environment and {folder}); run "
            f"`python -m train.tools.aot --install` once (jax-cuda12-plugin/pjrt=={jaxlib_version()}, "
            "or the cuda13 ones, and cuDNN: about 1.5 GB), or pip install \"jax[cuda12]\"")
    sys.path.insert(0, folder)


def _start_jax() -> None:
    """Import JAX and start its backends (which loads the CUDA plugin) without its notices."""
    with without_driver_notices():
        import jax

        jax.devices()


def gpu_devices(target: str, hosts: int, gpus_per_host: int):
    """The devices of a deviceless topology of `hosts` x `gpus_per_host` GPUs of `target`."""
    from jax.experimental import topologies

    from basp_jax import gpus

    with without_driver_notices():
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=gpus.target_config(target),
            topology=f"1x{hosts}x{gpus_per_host}")
    return list(topology.devices)


# What the CUDA plugin prints (from C++, before its logging is set up) on a machine without a GPU.
_DRIVER_NOTICES = ("All log messages before absl::InitializeLog()",
                   "Could not find cuda drivers on your machine")


@contextlib.contextmanager
def without_driver_notices():
    """Drop the plugin's 'no CUDA driver' notices from stderr (file descriptor 2, where its C++
    code writes them); every other line written meanwhile is passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            for line in capture.read().decode(errors="replace").splitlines(keepends=True):
                if not any(n in line for n in _DRIVER_NOTICES):
                    sys.stderr.write(line)
