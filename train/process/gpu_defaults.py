"""What a GPU run sets unless the user already has: XLA flags that overlap communication with
compute, the share of GPU memory JAX takes, and a persistent compilation cache.

    added, kept = apply_env(os.environ)   # before JAX starts its backends (train.process.runtime, train.tools.aot)
    cache = enable_compilation_cache()   # any time before the first compile
    print(describe(added, kept, *cache))  # the start-up line

One list, read by the trainer (train.process.runtime) and the compile-for-GPU command (train.tools.aot), so the
program train.tools.aot reports is the program a run compiles. A flag or variable the user set (in
XLA_FLAGS or the environment) always wins, whatever its value.

Sources, cited per flag below:
  [JT-perf]    NVIDIA JAX-Toolbox, docs/GPU_performance.md ("Tips for High-Performance LLMs with JAX
               and XLA"; github.com/NVIDIA/JAX-Toolbox, read at bcbbfa5, July 2026)
  [JT-images]  JAX-Toolbox docs/getting-started/environment-variables.md (set in NVIDIA's JAX images)
  [JT-maxtext] JAX-Toolbox docs/frameworks/maxtext/README.md and example_slurm.sub (their MaxText
               recipe's XLA_FLAGS and XLA_PYTHON_CLIENT_MEM_FRACTION)
  [MT]         MaxText GPU recipes: docs/run_maxtext/run_maxtext_single_host_gpu.md and
               src/maxtext/configs/gpu/a3/*/*.sh (github.com/AI-Hypercomputer/maxtext, e591f30)
Every flag exists in XLA of jax 0.10.2 (tests/e2e/test_gpu_compile.py compiles with them against
the installed jaxlib: XLA aborts the process on a flag it does not know).
"""

from __future__ import annotations

import os
import re

# (flag, value). Values are the recipes' own, not tuned here.
XLA_FLAGS = (
    # Schedule async collectives (FSDP gathers and reduce-scatters, attention's all-to-alls) to
    # overlap compute instead of waiting at once: [JT-perf] "Optimization level", [JT-images],
    # [JT-maxtext], [MT] (every GPU recipe). XLA leaves it off unless asked (or at O1).
    ("xla_gpu_enable_latency_hiding_scheduler", "true"),
    # FSDP under the scanned layer loop: gather the next layer's parameters, and reduce-scatter
    # the previous layer's gradients, while this layer computes: [JT-perf] "Collective
    # pipelining", [JT-maxtext] (MaxText's recipes spell them --xla_gpu_pipeline_*=on, a newer
    # enum form that jax 0.10's XLA does not have).
    ("xla_gpu_enable_pipelined_all_gather", "true"),
    ("xla_gpu_enable_pipelined_reduce_scatter", "true"),
    ("xla_gpu_enable_pipelined_all_reduce", "true"),
    # Unroll the layer loop twice so one layer's collectives overlap the other's compute:
    # [JT-perf] "While-loop unrolling", [JT-maxtext], [MT].
    ("xla_gpu_enable_while_loop_double_buffering", "true"),
    # Few large collectives: a threshold at least one layer's parameters (gathers) or gradients
    # (scatters) combines them per layer ([JT-perf] "FSDP communication"; values of [JT-maxtext]),
    # also across gather dimensions ([JT-maxtext], [MT]).
    ("xla_gpu_all_gather_combine_threshold_bytes", str(1 << 30)),
    ("xla_gpu_reduce_scatter_combine_threshold_bytes", str(128 << 20)),
    ("xla_gpu_all_reduce_combine_threshold_bytes", str(1 << 30)),
    ("xla_gpu_enable_all_gather_combine_by_dim", "false"),
    ("xla_gpu_enable_reduce_scatter_combine_by_dim", "false"),
)

# JAX takes 75% of GPU memory by default; [JT-perf] "We typically set it to 0.9 or 0.8",
# [JT-maxtext] example_slurm.sub sets 0.90. The rest is for cuDNN/cuBLAS workspaces and NCCL.
MEM_FRACTION = "0.9"
# jaxlib >= 0.10 reads the first; the second is its deprecated name (setting both is an error).
MEM_FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def _has_flag(flags: str, name: str) -> bool:
    return re.search(rf"(^|\s)--{re.escape(name)}(=|\s|$)", flags) is not None


def xla_flags(existing: str = "") -> tuple[str, list[str], list[str]]:
    """XLA_FLAGS with the defaults the user's `existing` flags do not set: (flags, added, kept),
    added/kept as `--name=value` of ours and the names the user set themselves."""
    added, kept = [], []
    for name, value in XLA_FLAGS:
        if _has_flag(existing, name):
            kept.append(f"--{name}")
        else:
            added.append(f"--{name}={value}")
    return " ".join([existing.strip(), *added]).strip(), added, kept


def apply_env(environ=os.environ) -> tuple[list[str], list[str]]:
    """Set XLA_FLAGS and the memory fraction in `environ` where the user has not: (what was set,
    what the user had set and is kept). Must run before JAX starts a GPU backend."""
    flags, added, kept = xla_flags(environ.get("XLA_FLAGS", ""))
    environ["XLA_FLAGS"] = flags
    done = [f"XLA_FLAGS += {' '.join(added)}"] if added else []
    user_fraction = next((v for v in MEM_FRACTION_VARS if environ.get(v)), None)
    if user_fraction:
        kept.append(f"{user_fraction}={environ[user_fraction]}")
    else:
        environ[MEM_FRACTION_VARS[0]] = MEM_FRACTION
        done.append(f"{MEM_FRACTION_VARS[0]}={MEM_FRACTION}")
    return done, kept


def default_cache_dir() -> str:
    """Shared by every run of this user (the cache is keyed by program, flags and versions)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "basp-jax", "jax-compilation-cache")


def enable_compilation_cache() -> tuple[str, bool]:
    """Turn on JAX's persistent compilation cache unless the user set a directory
    (JAX_COMPILATION_CACHE_DIR or jax.config): (the directory, whether it is ours)."""
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current:
        return current, False
    path = default_cache_dir()
    jax.config.update("jax_compilation_cache_dir", path)
    return path, True


def describe(done: list[str], kept: list[str], cache: str, cache_is_ours: bool) -> str:
    """The start-up line of a GPU run: what was set, and what the user had set instead."""
    done = done + ([f"compilation cache {cache}"] if cache_is_ours else [])
    kept = kept + ([] if cache_is_ours else [f"compilation cache {cache}"])
    return (f"gpu defaults: {'; '.join(done) or 'none needed'}"
            + (f" (yours kept: {', '.join(kept)})" if kept else ""))
