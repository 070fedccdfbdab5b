"""2 processes x 4 CPU devices (jax.distributed on localhost, gloo) train like 1 process x 8."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from train.loop import run

from train_helpers import tiny_config, tiny_overrides

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["basp", "ulysses"])
def test_two_processes_match_one(tmp_path, mode):
    """basp: each process holds whole rows (its group); ulysses: half of every row's sequence."""
    reference = run(tiny_config(tmp_path / "single", "train.microbatch_size=2", "train.grad_accum=2"))

    port = _free_port()
    run_dir = tmp_path / "multi"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    procs = []
    for pid in range(2):
        args = tiny_overrides(
            run_dir, "train.microbatch_size=2", "train.grad_accum=2", "runtime.cpu_devices=4",
            f"parallel.mode={mode}",
            f"runtime.distributed.coordinator=127.0.0.1:{port}",
            "runtime.distributed.num_processes=2", f"runtime.distributed.process_id={pid}",
        )
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=300))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    # process 0 logs; process 1 stays quiet
    assert "done:" in outputs[0][0] and "done:" not in outputs[1][0]
    expected = {"basp": "basp: 2 group(s) x sp=4", "ulysses": "ulysses: 1 group(s) x sp=8"}[mode]
    assert f"layout: {expected} on 8 devices (2 host(s))" in outputs[0][1]
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [l["loss"] for l in lines]
    np.testing.assert_allclose(losses, reference["losses"], rtol=2e-5)
    assert (run_dir / "checkpoints" / "5").is_dir()
