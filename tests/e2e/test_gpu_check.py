"""scripts/gpu_check.sh (benchmarks/gpu_check.py) on the CPU: --cpu-smoke runs every section on
tiny shapes, and says which GPU-only parts it skipped; without the flag and without a GPU it
stops with one line instead of checking nothing."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from tests.helpers.flags import TEST_XLA_FLAGS

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    return {**env, "PYTHON": sys.executable, **extra}


@pytest.mark.slow
def test_the_script_runs_every_section_and_names_what_it_skipped(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", str(out), "--cpu-smoke", "--steps", "2",
                           "--repeats", "1"], cwd=ROOT, capture_output=True,
                          # the suite's CPU code generation (tests/helpers/flags.py): tiny
                          # programs, compiled a third faster
                          env=_env(XLA_FLAGS=TEST_XLA_FLAGS),
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["mode"] == "cpu-smoke" and r["failed"] == []
    env = r["environment"]
    assert env["platform"] == "cpu" and env["versions"]["jax"] and env["python"]

    kernels = r["kernels"]
    assert sorted(kernels) == sorted(f"{k}, {p}" for k in ("xla", "cudnn", "pallas", "blockwise")
                                     for p in ("packed", "unpacked"))
    for name, row in kernels.items():
        if name.startswith("cudnn"):  # skipped, visibly and with the reason
            assert row == {"status": "skipped", "reason": "--cpu-smoke: impl='cudnn' needs a GPU "
                                                          "but the mesh is on cpu; use 'auto'"}
        else:
            assert row["status"] == "ok", (name, row)
            assert set(row["errors"]) == {"out", "dq", "dk", "dv"}
            assert max(row["errors"].values()) <= row["tolerance"]
    timing = r["timing"]  # ours against cuDNN and JAX's own Pallas kernel (interpreted here)
    assert sorted(timing) == sorted(f"{k}, 256 tokens" for k in ("xla", "cudnn", "pallas",
                                                                  "blockwise", "upstream pallas"))
    assert timing["cudnn, 256 tokens"]["status"] == "skipped"
    # jax 0.12.1 dropped its Triton Pallas examples: JAX's own kernel is then skipped, saying so
    upstream = importlib.util.find_spec("jax.experimental.pallas.ops.gpu.attention") is not None
    if not upstream:
        assert timing["upstream pallas, 256 tokens"] == {
            "status": "skipped", "reason": f"jax {jax.__version__} ships no "
                                          "jax.experimental.pallas.ops.gpu.attention"}
    for impl in ("xla", "pallas", "blockwise") + (("upstream pallas",) if upstream else ()):
        row = timing[f"{impl}, 256 tokens"]
        assert row["status"] == "ok" and row["median_s"] > 0 and row["seq_len"] == 256, row

    train = r["train"]
    assert train["status"] == "ok" and len(train["losses"]) == 2 and train["step_s"] > 0
    assert train["tokens_per_s"] > 0 and train["predicted_peak_bytes"] > 0
    assert train["mfu"] is None  # no peak FLOP/s for a CPU
    assert train["measured_peak_bytes"] is None
    assert "CPU devices keep no memory statistics" in train["measured_peak_reason"]
    fp8 = r["train_fp8"]  # emulated by XLA on the CPU: the path runs, its speed means nothing
    assert fp8["status"] == "ok" and fp8["fp8"] and not train["fp8"], fp8
    assert fp8["seq_len"] == train["seq_len"] and fp8["speedup_vs_bf16"] > 0
    assert fp8["final_loss_drift"] < 0.05  # 2 steps of the tiny model: FP8 rounding only
    # cuDNN: 2 checks and 1 timing; the memory statistics of both train runs
    assert proc.stdout.count("skipped: --cpu-smoke") == 5
    assert f"0 failed, {3 if upstream else 4} skipped" in proc.stdout


def test_without_a_gpu_and_without_the_flag_it_stops_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out",
                           str(tmp_path / "x.json")], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "no GPU visible to JAX" in lines[0] and "--cpu-smoke" in lines[0]
    assert not (tmp_path / "x.json").exists()
