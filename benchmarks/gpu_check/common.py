"""What every section of the check shares: the shapes of a mode, the time budget, how a section
records itself (ok, skipped with its reason, failed with its error), and the environment."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax",
            "orbax-checkpoint", "safetensors", "tokenizers", "numpy")
GiB = 2**30


class Shapes:
    """The sizes one mode uses: a GPU gets the real ones, --cpu-smoke tiny ones (each tiny one
    stands in for the real one in the same place, so the JSON has the same structure)."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        # (query heads, kv heads, head_dim): Llama-3.2-1B's and Llama-3.1-8B's attention for the
        # timings; the 8B's and Qwen3.5's head_dim 256 for the correctness checks (one shape on
        # the CPU, where every compile costs seconds)
        self.time_heads = ((4, 2, 16),) if smoke else ((32, 8, 64), (32, 8, 128))
        self.check_heads = ((4, 2, 16),) if smoke else ((32, 8, 128), (16, 4, 256))
        self.documents = (0, 4, 64)  # 0: unpacked; else documents packed into the row
        self.check_seq = 128 if smoke else 2048  # against the S x S float32 reference
        # the CPU computes bf16 in f32 anyway; float16 is skipped there (no f16 dot on the CPU)
        self.check_dtypes = ("float32", "float16") if smoke else ("bfloat16", "float16")
        # relative error bounds against the float32 reference: bf16 as
        # tests/basp_jax/test_attention.py bounds the bf16 blockwise kernel; fp16 has 3 more bits
        self.tolerance = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}
        self.short_seq, self.long_seq = (256, 512) if smoke else (16384, 65536)
        # the long length: every head shape and packing on a GPU; the CPU runs one of each kernel
        self.long_documents = (0,) if smoke else self.documents
        self.step_seq = 256 if smoke else 16384
        self.preset = "tiny" if smoke else "llama-3.2-1b"
        self.big_preset = "tiny" if smoke else "llama-3.1-8b"  # its first 2 layers
        self.gemm_presets = ("tiny",) if smoke else ("llama-3.2-1b", "llama-3.1-8b")
        self.dtype = "float32" if smoke else "bfloat16"
        self.block_size = 16 if smoke else 512  # Pallas tiles off a GPU (interpret mode)
        self.profile_steps = 2


class Budget:
    """The check's time limit (scripts/gpu_check.sh stops it at 8 minutes): a section or case
    that would not finish inside it is skipped, saying so, so that the JSON ends complete."""

    def __init__(self, limit_s: float):
        self.limit_s = limit_s
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def short(self, needs_s: float) -> str | None:
        """Why something that takes about `needs_s` seconds is not started, or None."""
        left = self.limit_s - self.elapsed()
        if left >= needs_s:
            return None
        return (f"out of time: {max(left, 0):.0f} s of the check's {self.limit_s:.0f} s left, "
                f"this needs about {needs_s:.0f} s")


def skip(reason: str) -> dict:
    print(f"  skipped: {reason}", flush=True)
    return {"status": "skipped", "reason": reason}


def failed(e: BaseException) -> dict:
    line = " ".join(str(e).split())[:400] or type(e).__name__
    print(f"  FAILED: {type(e).__name__}: {line}", flush=True)
    return {"status": "failed", "error": f"{type(e).__name__}: {line}",
            "traceback": traceback.format_exc(limit=6)}


def out_of_memory(e: BaseException) -> bool:
    return "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


def section(title: str, fn, *args, budget: Budget | None = None, needs_s: float = 0.0) -> dict:
    """fn(*args), or skipped when the budget is short, or failed: one failing check must not
    hide the others."""
    print(title, flush=True)
    if budget is not None and (why := budget.short(needs_s)):
        return skip(why)
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return failed(e)


def timed(fn, args, repeats: int, cap_s: float = 3.0) -> tuple[float, list[float]]:
    """(compile + first call s, the timed calls' s): up to `repeats` calls, blocking on each,
    fewer where they pass cap_s (a slow kernel's second call tells as much as its fifth)."""
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times: list[float] = []
    while len(times) < repeats and (not times or sum(times) < cap_s):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return first, times


def environment() -> dict:
    import jax

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    dev = jax.devices()[0]
    info = {
        "python": platform.python_version(),
        "versions": versions,
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "device_count": jax.device_count(),
        "compute_capability": getattr(dev, "compute_capability", None),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "mem_fraction": os.environ.get("XLA_CLIENT_MEM_FRACTION")
        or os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
    }
    print(f"python {info['python']}; " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(f"device: {info['device_kind']} ({dev.platform}, {info['device_count']} visible"
          + (f", compute capability {info['compute_capability']}" if info["compute_capability"]
             else "") + ")", flush=True)
    return info


def capability(on_gpu: bool):
    import jax

    from basp_jax.kernels import device_capability

    return device_capability(jax.devices()[0]) if on_gpu else None
