"""JAX's CUDA plugin for tests/e2e/test_gpu_compile.py (about 1.5 GB, one per jaxlib, so each fresh
environment downloads it), installed early: a run that includes that file starts
`python -m train.tools.aot --install` in the background as it begins (tests/conftest.py), when the
plugin is missing, so that the download overlaps the first tests instead of holding up a worker;
the file's cuda_plugin fixture waits for it, then checks, and installs itself if it did not work."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
PID_VAR = "BASP_TEST_PLUGIN_INSTALL_PID"  # the background install's process, for the workers
GPU_TESTS = ROOT / "tests" / "e2e" / "test_gpu_compile.py"
# exit 0 when the plugin is there (in this environment or in train.tools.aot's folder for it)
PROBE = ("import importlib.util, os, sys; from train.tools import aot; "
         "sys.exit(0 if importlib.util.find_spec('jax_cuda12_plugin') or "
         "os.path.isdir(os.path.join(aot.plugin_dir(), 'jax_plugins')) else 1)")


def linux_x86() -> bool:
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


def start_install(args: list[str], log_path: Path) -> subprocess.Popen | None:
    """When the pytest arguments `args` include test_gpu_compile.py: the probe, then the install
    if the probe fails, in a background process (its output in log_path)."""
    if not linux_x86():
        return None
    paths = [Path(str(a).split("::")[0]).resolve() for a in args] or [ROOT / "tests"]
    if not any(p == GPU_TESTS or p in GPU_TESTS.parents for p in paths):
        return None
    command = f"{sys.executable} -c \"{PROBE}\" || {sys.executable} -m train.tools.aot --install"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["sh", "-c", command], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    os.environ[PID_VAR] = str(proc.pid)
    return proc


def wait_for_install(timeout: float = 1800) -> None:
    """Until the background install this run started (if any) has ended. It is the controller's
    child, not this worker's: watch /proc (an ended one stays a zombie until the controller
    reaps it at the end of the run)."""
    pid = os.environ.get(PID_VAR)
    deadline = time.monotonic() + timeout
    while pid and time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return  # ended and reaped
        if state == "Z":
            return
        time.sleep(0.5)
