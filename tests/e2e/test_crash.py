"""Crash safety: SIGKILL the trainer at several points, rerun the same command, and get exactly the
losses of an uninterrupted run; a checkpoint cut off mid-write is ignored, never resumed from.

One run.dir lives through three crashes:
    1. killed while tracing/compiling the first step (before any checkpoint exists)
    2. killed between checkpoints, after step 3 was logged (checkpoint.every=2)
    3. killed while the asynchronous checkpoint two saves later (usually step 6) is being written
    4. the same command again, run to the end
Every loss ever logged (steps redone after a resume are logged again) must equal the uninterrupted
run's loss of that step, bit for bit.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train.loop import run

from tests.helpers.flags import TEST_XLA_FLAGS
from tests.helpers.trainer import cache_env, tiny_config, tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compile_cache")]  # tests/conftest.py
ARGS = ("train.steps=12", "train.microbatch_size=2", "checkpoint.every=2", "checkpoint.keep=3")


def _env(**extra):
    env = cache_env(dict(os.environ, JAX_PLATFORMS="cpu", **extra))
    env["XLA_FLAGS"] = TEST_XLA_FLAGS  # tests/helpers/flags.py; the device count is the run's
    return env


def _start(run_dir: Path, log: Path, script: str = "train.py", **env) -> subprocess.Popen:
    with open(log, "w") as err:
        return subprocess.Popen(
            [sys.executable, str(ROOT / script), *tiny_overrides(run_dir, *ARGS)],
            cwd=ROOT, env=_env(**env), stdout=subprocess.DEVNULL, stderr=err,
        )


def _wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the trainer exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _complete(run_dir: Path) -> list[int]:
    ckpt = run_dir / "checkpoints"
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.exists() else []


def _partial(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name)


@pytest.mark.slow
def test_sigkill_at_several_points_then_rerun_gives_the_uninterrupted_losses(tmp_path):
    reference = run(tiny_config(tmp_path / "straight", *ARGS))["losses"]
    run_dir = tmp_path / "run"
    outcomes = []

    # 1. while tracing/compiling the first step: nothing to resume from
    proc = _start(run_dir, tmp_path / "1.log")
    _wait_for(lambda: "layout:" in (tmp_path / "1.log").read_text(), proc, "planning the layout")
    proc.kill()
    proc.wait()
    assert proc.returncode == -9
    assert "compiled the train step" not in (tmp_path / "1.log").read_text()
    assert _records(run_dir) == [] and _complete(run_dir) == []
    outcomes.append("killed before the first step had compiled: no checkpoint, no metrics")

    # 2. between checkpoints, after step 3 was logged
    proc = _start(run_dir, tmp_path / "2.log")
    _wait_for(lambda: len(_records(run_dir)) >= 3 and _complete(run_dir), proc,
              "step 3 and a complete checkpoint")
    proc.kill()
    proc.wait()
    assert proc.returncode == -9
    assert "resumed" not in (tmp_path / "2.log").read_text()  # started afresh after crash 1
    # usually 2 (the first save is step 2's: checkpoint.every=2); a slow machine may have gone
    # further before the kill landed, which changes nothing below
    newest = max(_complete(run_dir))
    assert newest <= 8, f"the kill came too late (newest checkpoint {newest})"
    seen = _records(run_dir)  # a resume drops the lines after its checkpoint: keep them here
    redone = [r["step"] for r in seen if r["step"] > newest]
    outcomes.append(f"killed after step {len(_records(run_dir))}: newest checkpoint {newest}")

    # 3. while the asynchronous checkpoint two saves later is being written
    crash = newest + 4 - newest % 2
    proc = _start(run_dir, tmp_path / "3.log", script="tests/e2e/crash_during_checkpoint.py",
                  CRASH_AT_SAVE_STEP=str(crash))
    proc.wait(timeout=240)
    assert proc.returncode == -9, (tmp_path / "3.log").read_text()[-3000:]
    assert f"resumed from {run_dir / 'checkpoints'} at step {newest}" in (tmp_path / "3.log").read_text()
    assert crash not in _complete(run_dir), "the interrupted checkpoint must not look complete"
    assert any(name.startswith(f"{crash}.") for name in _partial(run_dir)), _partial(run_dir)
    assert max(_complete(run_dir)) == crash - 2
    seen += _records(run_dir)
    redone += [r["step"] for r in _records(run_dir) if r["step"] > crash - 2]
    outcomes.append(f"killed while writing checkpoint {crash}: left {_partial(run_dir)}, newest "
                    f"complete {crash - 2}")

    # 4. the same command again: resumes from crash - 2 (ignoring the partial one) and finishes
    proc = _start(run_dir, tmp_path / "4.log")
    proc.wait(timeout=240)
    log = (tmp_path / "4.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    assert f"resumed from {run_dir / 'checkpoints'} at step {crash - 2}" in log
    assert _complete(run_dir)[-1] == 12 and _partial(run_dir) == []

    final = _records(run_dir)
    assert [r["step"] for r in final] == list(range(1, 13))  # one line per step
    for r in seen + final:  # every logged loss, including those of steps redone after a resume
        assert r["loss"] == reference[r["step"] - 1], (r["step"], r["loss"], reference[r["step"] - 1])
    assert redone  # some steps really were trained twice
    print("; ".join(outcomes) + f"; rerun finished; steps trained twice: {redone}; all losses "
          "bit-identical to the uninterrupted run")
