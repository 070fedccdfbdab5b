"""Tiny trainer configs and runs for the tests (kept small: every run compiles in a few seconds)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.flags import TEST_XLA_FLAGS

ROOT = Path(__file__).resolve().parents[2]  # the repository

TINY_SHAPE = (
    "model.shape={vocab_size: 256, hidden_size: 64, intermediate_size: 128, num_layers: 2, "
    "num_heads: 8, num_kv_heads: 4, head_dim: 8}"
)


def shipped_configs(pattern: str = "**/*.yaml") -> list[Path]:
    """The runnable configs under configs/ that match pattern, sorted; a file named _*.yaml is
    a base that others include (configs/gpu/_base.yaml), not a config of its own."""
    return sorted(p for p in (ROOT / "configs").glob(pattern) if not p.name.startswith("_"))


def tiny_overrides(run_dir, *extra: str) -> list[str]:
    return [
        f"run.dir={run_dir}",
        "run.seed=0",
        "model.preset=tiny",
        TINY_SHAPE,
        "data.source=synthetic",
        "data.seq_len=64",
        "train.steps=5",
        "train.microbatch_size=4",
        "train.grad_accum=1",
        "optimizer.lr=3e-3",
        "optimizer.warmup_steps=1",
        "parallel.mode=basp",
        "checkpoint.every=0",
        "checkpoint.async_save=true",
        "metrics.progress=false",
        "runtime.cpu_devices=8",
        *extra,
    ]


def tiny_config(run_dir, *extra: str):
    from train.config.schema import load_config

    return load_config(None, tiny_overrides(run_dir, *extra))


def enable_compile_cache(path) -> None:
    """Share compiled programs between the runs of one test session (many compile the same step)."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                 "jax_persistent_cache_min_entry_size_bytes")


@contextlib.contextmanager
def compile_cache_at(path):
    """This process's compiles read and write the persistent cache in `path` inside the block;
    JAX's options are as found afterwards. JAX opens its cache folder once per process, so the
    cache object is reset on the way in (this folder is the one used) and out (the next block
    compiles without it)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    before = {name: getattr(jax.config, name) for name in CACHE_OPTIONS}
    cc.reset_cache()
    enable_compile_cache(path)
    try:
        yield path
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        cc.reset_cache()


def cache_env(env: dict) -> dict:
    """env with this test run's persistent compilation cache (tests/conftest.py) turned on for a
    subprocess: a program that an earlier test or process compiled is read, not compiled again."""
    folder = os.environ.get("BASP_TEST_COMPILE_CACHE")
    if folder:
        env.update(JAX_COMPILATION_CACHE_DIR=folder, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


def train_env(cache: bool = True) -> dict:
    """The environment of a `python train.py` subprocess: CPU, the trainer sets the device count
    itself, and the run's compilation cache (cache_env) unless cache=False (a test that needs the
    start-up to take as long as it does without one)."""
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = TEST_XLA_FLAGS  # not the device count: the trainer sets its own
    return cache_env(env) if cache else env


def train_cmd(*args, timeout=240) -> subprocess.CompletedProcess:
    """Run `python train.py ARGS` from the repository root; text output captured."""
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=train_env(),
        capture_output=True, text=True, timeout=timeout,
    )


def train_shipped_steps(config: str, run_dir, steps: int = 4, timeout: float = 150) -> list:
    """`python train.py --config configs/CONFIG` for its first `steps` steps (warm-up 1, no
    checkpoint) under a time limit: the metrics.jsonl rows that carry a loss (exit 0 asserted)."""
    import json

    result = train_cmd("--config", str(ROOT / "configs" / config), f"run.dir={run_dir}",
                       f"train.steps={steps}", "optimizer.warmup_steps=1", "checkpoint.every=0",
                       "metrics.progress=false", timeout=timeout)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "loss" in row]


def snapshot(*dirs) -> dict:
    """path -> (size, mtime_ns, sha256) of every file and directory under dirs."""
    out = {}
    for top in dirs:
        for root, subdirs, files in os.walk(top):
            for name in subdirs + files:
                path = Path(root) / name
                st = path.stat()
                digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
                out[str(path)] = (st.st_size, st.st_mtime_ns, digest)
    return out


def set_checkpoint_value(run_dir, step: int, name: str, value: float) -> None:
    """Set the first element of parameter `name` (dotted, e.g. layers.mlp.down_proj.kernel) of
    checkpoint `step` in run_dir to `value`, as damage on disk would: its params item is
    rewritten with the same structure."""
    import shutil

    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    path = Path(run_dir) / "checkpoints" / str(step) / "params"
    params = jax.tree.map(np.array, ocp.StandardCheckpointer().restore(path))
    leaf = params
    for key in name.split("."):
        leaf = leaf[key]
    leaf.reshape(-1)[0] = value
    with ocp.StandardCheckpointer() as writer:
        writer.save(path.with_name("params.new"), params)
    shutil.rmtree(path)
    path.with_name("params.new").rename(path)


def adaptive_documents(folder, *extra: str, steps: int = 6) -> list[str]:
    """Overrides that train on a token file of documents of 6-40 tokens (packed_stream, written
    to folder/docs.bin once), one row of 64 tokens per microbatch on 2 x 4 devices under host
    parameter sharding: a static layout of (1,8) across both hosts, whose steps mostly fit more
    groups (parallel.mode=adaptive)."""
    path = Path(folder) / "docs.bin"
    if not path.exists():
        packed_stream(path)
    return ["data.source=tokens", f"data.path={path}", "data.pack=true", "data.eos_id=0",
            "train.microbatch_size=1", f"train.steps={steps}", "parallel.devices_per_host=4",
            "parallel.param_sharding=host", *extra]


def packed_stream(path, vocab=256, seed=0):
    """Documents of random lengths from a small Markov-like generator, separated by eos=0."""
    import numpy as np

    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(300):
        n = int(rng.integers(5, 40))
        start = int(rng.integers(1, vocab))
        parts.append((start + np.arange(n) * 7) % (vocab - 1) + 1)
        parts.append([0])
    np.concatenate(parts).astype(np.uint16).tofile(path)
