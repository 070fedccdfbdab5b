"""A step that never ends: the step watchdog (train.process.step_watch) ends the run with one
line and exit status 4, keeping the checkpoints; a second SIGINT/SIGTERM while a step runs leaves
at once (train.process.stop). The hangs are made by a `python train.py` whose reading of one
step's metrics never returns, so the main thread is blocked as a stuck device would block it."""

import signal
import subprocess
import sys
import threading
import time

import pytest

from train.process.step_watch import (AUTO_FLOOR_S, STEP_TIMEOUT_STATUS, StepWatchdog,
                                      step_limit_s)

from tests.helpers.trainer import ROOT, tiny_overrides, train_env


def test_the_limit_is_the_configured_one_or_a_multiple_of_the_median_step():
    assert step_limit_s(12.5, []) == 12.5
    assert step_limit_s(0, [1.0] * 10) is None  # off
    assert step_limit_s(None, [1.0, 1.0]) is None  # too few steps measured
    assert step_limit_s(None, [0.1, 0.2, 50.0]) == AUTO_FLOOR_S
    assert step_limit_s(None, [20.0, 30.0, 10_000.0]) == 20 * 30.0


def test_the_watchdog_fires_only_when_progress_stops_after_it_is_armed():
    fired = []
    watch = StepWatchdog(0.4, lambda: "resume here.", interval_s=0.05, on_timeout=fired.append)
    with watch:
        time.sleep(0.8)  # not armed yet: the step is still compiling
        assert not fired
        for step in range(1, 6):  # steady progress
            watch.progress(step=step)
            time.sleep(0.1)
        assert not fired
        time.sleep(1.0)  # step 6 never ends
    assert len(fired) == 1
    assert "step 6 has not finished" in fired[0] and "runtime.step_timeout_s" in fired[0]
    assert "resume here." in fired[0] and "\n" not in fired[0]


HANG = """
import runpy, sys, time
import train.observe.report as report
finish = report.StepReport.finish
def finish_or_hang(self, step, *args, **kwargs):
    if step + 1 == {hang_at}:  # reading this step's metrics never returns
        while True:
            time.sleep(0.5)
    return finish(self, step, *args, **kwargs)
report.StepReport.finish = finish_or_hang
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


def _hanging_run(run_dir, hang_at, *extra):
    return subprocess.Popen(
        [sys.executable, "-c", HANG.format(hang_at=hang_at),
         *tiny_overrides(run_dir, "train.steps=20", "checkpoint.every=1", *extra)],
        cwd=ROOT, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _steps_saved(run_dir):
    from train.checkpoint.store import checkpoint_dir, complete_steps

    return complete_steps(checkpoint_dir(str(run_dir)))


@pytest.mark.slow
def test_a_step_past_its_timeout_ends_the_run_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    proc = _hanging_run(run_dir, 3, "runtime.step_timeout_s=3")
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == STEP_TIMEOUT_STATUS, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: step: step 3 has not finished"), err
    assert "runtime.step_timeout_s" in errors[0] and err.strip().endswith(errors[0])
    assert _steps_saved(run_dir)[-1] == 2  # the checkpoints before it are kept


@pytest.mark.slow
def test_a_second_signal_while_a_step_hangs_leaves_at_once(tmp_path):
    run_dir = tmp_path / "run"
    proc = _hanging_run(run_dir, 3, "runtime.step_timeout_s=0")
    try:
        deadline = time.monotonic() + 120
        while len(_steps_saved(run_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)  # steps 1 and 2 are saved; step 3 hangs
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)  # asks the step to finish: it never does
        time.sleep(1.0)
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "a second SIGINT while a step ran" in errors[0], err
    assert err.strip().endswith(errors[0])
    assert _steps_saved(run_dir)[-1] == 2
