"""2 processes x 4 CPU devices (jax.distributed on localhost, gloo) train like 1 process x 8."""

import json
import re
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from train.loop import run

from tests.helpers.flags import ONE_PASS, TEST_XLA_FLAGS
from tests.helpers.trainer import adaptive_documents, cache_env, tiny_config, tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("compile_cache")  # this run's (tests/conftest.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_take_the_adaptive_layouts_of_one(tmp_path):
    """parallel.mode=adaptive on 2 processes: each builds the whole step's rows and packs them
    the same way, so both run the same layout's program every step; the layouts and losses are
    a single process's, a checkpoint is written and evaluation runs on the static layout."""
    data = adaptive_documents(tmp_path, "parallel.mode=adaptive", "eval.every=3",
                              f"eval.path={tmp_path / 'docs.bin'}")
    reference = run(tiny_config(tmp_path / "single", *data))
    run_dir = tmp_path / "multi"
    procs = _launch(run_dir, *data, "checkpoint.every=3", "runtime.distributed.peer_timeout_s=30")
    try:
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:
        _kill_leftovers(procs)
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    single = [json.loads(l) for l in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    assert [l["layout"] for l in lines] == [l["layout"] for l in single]
    assert len({l["layout"] for l in lines}) > 1
    np.testing.assert_allclose([l["loss"] for l in lines], reference["losses"], rtol=2e-5)
    assert lines[-1]["eval_loss"] == pytest.approx(single[-1]["eval_loss"], rel=2e-5)
    assert (run_dir / "checkpoints" / "3").is_dir()


def _launch(run_dir, *extra, per_process=((), ()), pids=(0, 1),
            port: int | None = None) -> list[subprocess.Popen]:
    """Processes 0 and 1 (or those of `pids`) of a 2 x 4-device run (jax.distributed on
    localhost, gloo, the coordinator on `port` or a free one) with `extra` overrides, and
    per_process[i] for process i alone."""
    port = port or _free_port()
    env = cache_env(dict(os.environ, JAX_PLATFORMS="cpu"))
    env["XLA_FLAGS"] = TEST_XLA_FLAGS  # tests/helpers/flags.py; the device count is the run's
    procs = []
    for pid in pids:
        args = tiny_overrides(
            run_dir, "train.microbatch_size=2", "runtime.cpu_devices=4",
            f"runtime.distributed.coordinator=127.0.0.1:{port}",
            "runtime.distributed.num_processes=2", f"runtime.distributed.process_id={pid}",
            *extra, *per_process[pid],
        )
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
    return procs


def _wait_for_steps(procs, run_dir, steps: int, timeout: float = 240) -> None:
    """Until metrics.jsonl holds `steps` lines (training is under way); fails if a process ends."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.02)


def _kill_leftovers(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


# (victim, signal, the survivor's exit status (or the statuses either of which is right), a
# fragment of its message (or fragments))
PEER_FAILURES = [
    # the survivor's next collective fails at once (gloo: connection closed by peer); on a
    # loaded machine its heartbeat watch may notice the silence first (either is the truth)
    (1, signal.SIGKILL, 3, ("error: peer: a collective failed",
                            "error: peer: process 1 of 2 has sent no heartbeat for 10 s")),
    # a frozen peer sends nothing: train.process.peers notices the silence after peer_timeout_s
    # (its 10 s of silence: once per CI, ONE_PASS)
    pytest.param(1, signal.SIGSTOP, 3, "error: peer: process 1 of 2 has sent no heartbeat for 10 s",
                 marks=ONE_PASS),
    # the coordinator dies: JAX's own client aborts the survivor within a second (SIGABRT), with
    # its message, from a C++ thread; or the survivor's collective fails first (gloo: connection
    # reset by the dead peer) and train.process.peers ends it with our message (either is the truth)
    (0, signal.SIGKILL, (-signal.SIGABRT, 3), ("This most likely indicates that another task died",
                                              "error: peer: a collective failed")),
]


@pytest.mark.slow
@pytest.mark.parametrize("victim, sig, status, fragment", PEER_FAILURES,
                         ids=["kill-worker", "freeze-worker", "kill-coordinator"])
def test_a_failed_peer_stops_the_other_process_with_a_clear_message(tmp_path, victim, sig, status,
                                                                   fragment):
    """Kill or freeze one process mid-training: the other exits non-zero with a message that says
    what happened, within two minutes (not a hang)."""
    run_dir = tmp_path / "run"
    procs = _launch(run_dir, "train.steps=100000", "checkpoint.every=3",
                    "runtime.distributed.peer_timeout_s=10")
    try:
        _wait_for_steps(procs, run_dir, 5)
        procs[victim].send_signal(sig)
        hit_at = time.monotonic()
        survivor = procs[1 - victim]
        _, err = survivor.communicate(timeout=120)
        elapsed = time.monotonic() - hit_at
    finally:
        _kill_leftovers(procs)
    statuses = status if isinstance(status, tuple) else (status,)
    assert survivor.returncode in statuses, err[-3000:]
    # peer_timeout_s (10 s, for the frozen peer) + at most 5 s that process 0 waits to see a
    # peer's end before leaving + slack for a loaded machine; well below the two-minute bound
    assert elapsed < 30, elapsed
    fragments = fragment if isinstance(fragment, tuple) else (fragment,)
    assert any(f in err for f in fragments), err[-3000:]
    if survivor.returncode == 3:  # our own message: one line, with what to do
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
        assert "Rerun the same command on every host to resume (the newest checkpoint is step" \
            in errors[0], errors[0]
    print(f"{sig.name} process {victim}: the other exited {survivor.returncode} after "
          f"{elapsed:.1f} s")


@pytest.mark.slow
def test_a_process_that_stops_on_bad_input_stops_the_other(tmp_path):
    """Process 1 alone has a bad data path: it exits 2 with its own line; process 0, waiting for it
    in a collective, exits 3 naming process 1 and its error (instead of waiting for ever)."""
    np.arange(5000, dtype=np.uint16).__mod__(256).astype(np.uint16).tofile(tmp_path / "ok.bin")
    procs = _launch(
        tmp_path / "run", "data.source=tokens", "runtime.distributed.peer_timeout_s=10",
        per_process=([f"data.path={tmp_path / 'ok.bin'}"],
                     [f"data.path={tmp_path / 'missing.bin'}"]),
    )
    try:
        errs = [p.communicate(timeout=180)[1] for p in procs]
    finally:
        _kill_leftovers(procs)
    assert procs[1].returncode == 2, errs[1][-3000:]
    assert errs[1].strip().splitlines() == [
        f"error: data: token file '{tmp_path / 'missing.bin'}' does not exist"], errs[1][-3000:]
    assert procs[0].returncode == 3, errs[0][-3000:]
    lines = [line for line in errs[0].splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "error: peer: process 1 of 2 stopped with an error (DataError: " \
        "token file" in lines[0], errs[0][-3000:]


@pytest.mark.slow
@ONE_PASS  # the stop's signal handling is ours; both passes resume runs (tests/e2e/test_crash.py)
def test_two_processes_stop_together_on_one_sigterm_and_resume_to_the_losses_of_one(tmp_path):
    """2 processes train as 1 process of 8 devices, stopped and resumed on the way. Under
    Ulysses each process holds half of every row's sequence, and the all-to-alls cross between
    the processes (BASP, where each process holds whole rows, is the adaptive test's above).
    A scheduler's SIGTERM may reach one process only (or first): both finish the same step,
    save it, exit 0; the same command again resumes there and ends with the single process's
    losses and held-out loss (each process builds its own rows of the held-out batch), process 0
    alone logging, writing the TensorBoard events and the Hugging Face export, under a tight
    peer watchdog (no false alarm while compiling, exporting or finishing unevenly)."""
    steps = 20  # SIGTERM after 3: 17 steps of margin
    common = (f"train.steps={steps}", "train.grad_accum=2", "eval.every=5")
    reference = run(tiny_config(tmp_path / "single", "train.microbatch_size=2", *common))
    run_dir = tmp_path / "run"
    args = (*common, "checkpoint.every=1000", "parallel.mode=ulysses",
            "runtime.distributed.peer_timeout_s=5")
    procs = _launch(run_dir, *args)
    metrics = run_dir / "metrics.jsonl"
    try:
        _wait_for_steps(procs, run_dir, 3)
        procs[1].send_signal(signal.SIGTERM)
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        _kill_leftovers(procs)
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    assert "layout: ulysses: 1 group(s) x sp=8 on 8 devices (2 host(s))" in outputs[0][1]
    match = re.search(r"received a stop signal on another process: finished step (\d+) and saved",
                      outputs[0][1])
    assert match, outputs[0][1][-3000:]
    stopped = int(match.group(1))
    assert 3 <= stopped < steps
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()
                  if p.name.isdigit())[-1] == stopped

    procs = _launch(run_dir, *args, f"checkpoint.export_hf={tmp_path / 'hf'}")
    try:
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:
        _kill_leftovers(procs)
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    assert f"at step {stopped}" in outputs[0][1]
    # process 0 logs; process 1 stays quiet
    assert "done:" in outputs[0][0] and "done:" not in outputs[1][0]
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    np.testing.assert_allclose([l["loss"] for l in lines], reference["losses"], rtol=2e-5)
    single = [json.loads(line) for line in
              (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["eval_loss"] == pytest.approx(single[-1]["eval_loss"], rel=2e-5)
    assert (run_dir / "checkpoints" / str(steps)).is_dir()
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))  # written by process 0
    assert (tmp_path / "hf" / "config.json").is_file()


# Start-up as python train.py does it (train.cli): signals end the process at once, then
# runtime.configure joins the run; "joined" says jax.distributed.initialize has returned.
_JOIN_THEN_WAIT = """
import sys, time
from train.process import runtime
from train.process.stop import exit_at_once_outside_the_loop
from tests.helpers.trainer import tiny_config
exit_at_once_outside_the_loop()
runtime.configure(tiny_config(*sys.argv[1:]))
print("joined", flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_sigterm_after_joining_the_run_still_ends_the_process_at_once(tmp_path):
    """jax.distributed.initialize must not take SIGTERM over: JAX's preemption service installs
    a C-level handler that silently replaced ours (a SIGTERM while the step compiled was
    swallowed, and the scheduler's SIGKILL came after its grace period)."""
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = TEST_XLA_FLAGS  # tests/helpers/flags.py; the device count is the run's
    procs = [subprocess.Popen(
        [sys.executable, "-c", _JOIN_THEN_WAIT, str(tmp_path / "run"), "runtime.cpu_devices=4",
         f"runtime.distributed.coordinator=127.0.0.1:{port}",
         "runtime.distributed.num_processes=2", f"runtime.distributed.process_id={pid}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for pid in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "joined", p.communicate()[1][-3000:]
        procs[1].send_signal(signal.SIGTERM)
        try:
            _, err = procs[1].communicate(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail("SIGTERM after jax.distributed.initialize was swallowed: the process "
                        "still runs 20 s later")
    finally:
        _kill_leftovers(procs)
    assert procs[1].returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "error: interrupted: SIGTERM outside the training loop" in err, err[-3000:]


def _errors(procs, timeout: float = 180) -> list[str]:
    try:
        return [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        _kill_leftovers(procs)


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    return lines[0]


@pytest.mark.slow
def test_processes_given_different_configs_all_stop_before_compiling(tmp_path):
    """Process 1 alone is given another optimizer.lr: every process refuses at start-up in one
    line naming the key, exit status 2, nothing compiled and run.dir never made."""
    run_dir = tmp_path / "run"
    procs = _launch(run_dir, "runtime.distributed.peer_timeout_s=60",
                    per_process=((), ("optimizer.lr=0.5",)))
    for p, err in zip(procs, _errors(procs)):
        assert p.returncode == 2, err[-3000:]
        line = _one_line(err)
        assert line.startswith("error: config: ") and "optimizer.lr" in line and "0.5" in line
    assert not run_dir.exists()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["peer never starts", "two process 0s"])
def test_a_run_that_cannot_assemble_ends_after_join_timeout_s_in_one_line(tmp_path, case):
    """jax.distributed.initialize waits for every process (JAX's default: 300 s, then an abort
    with a C++ stack trace): a peer that never starts, or a process_id given twice, ends each
    process after join_timeout_s with one line (3: a peer is missing), or at once where the
    second process 0 finds the coordinator's port taken (2)."""
    timeout = 4
    start = time.monotonic()
    if case == "peer never starts":
        procs = _launch(tmp_path / "run", f"runtime.distributed.join_timeout_s={timeout}",
                        pids=(0,))
    else:
        procs = _launch(tmp_path / "run", f"runtime.distributed.join_timeout_s={timeout}",
                        per_process=((), ("runtime.distributed.process_id=0",)))
    errs = _errors(procs, timeout=120)
    elapsed = time.monotonic() - start
    for p, err in zip(procs, errs):
        line = _one_line(err)  # (no C++ stack trace)
        assert p.returncode in (2, 3), err[-3000:]
        if p.returncode == 3:
            assert line.startswith("error: peer: ") and "join_timeout_s" in line, line
        else:
            assert line.startswith("error: config: ") and "process_id" in line, line
    # start-up (imports, on a loaded machine) + join_timeout_s; JAX's own wait is 300 s
    assert elapsed < 100, elapsed
    assert not (tmp_path / "run").exists()


def test_jax_heartbeat_is_a_backstop_behind_the_peer_watch():
    from train.process.runtime import jax_heartbeat_timeout_s

    assert jax_heartbeat_timeout_s(30.0) == 100  # JAX's default when ours is shorter
    assert jax_heartbeat_timeout_s(0) == 100  # our watch off: JAX's as it is
    assert jax_heartbeat_timeout_s(600.0) == 1200  # never before our one-line verdict


def test_jax_join_timeout_is_a_backstop_behind_ours():
    from train.process.runtime import jax_initialization_timeout_s

    assert 4 < jax_initialization_timeout_s(4.0) < 60  # after ours, long before JAX's 300 s
    assert jax_initialization_timeout_s(600.0) > 600


def test_joining_waits_for_late_peers_longer_than_a_silent_peer_is_tolerated_mid_run():
    """Processes a scheduler starts tens of seconds apart are not dead peers: the join (ours and
    JAX's), the start-up agreement and the watch of a peer that has not beaten yet follow
    join_timeout_s (JAX's own default), not peer_timeout_s; a peer silent mid-run is still
    caught after peer_timeout_s."""
    from train.config.runtime_section import DistributedConfig
    from train.process.peers import PeerWatchdog
    from train.process.runtime import JAX_DEFAULT_INIT_S, jax_initialization_timeout_s

    dist = DistributedConfig()
    assert dist.join_timeout_s == JAX_DEFAULT_INIT_S and dist.peer_timeout_s == 30
    assert jax_initialization_timeout_s(dist.join_timeout_s) > dist.join_timeout_s
    watch = PeerWatchdog(dist.peer_timeout_s, str, join_s=dist.join_timeout_s)
    assert watch.startup_grace_s == dist.join_timeout_s and watch.timeout_s == 30
    assert PeerWatchdog(30, str).startup_grace_s == 120  # the first compile, without join_s


@pytest.mark.slow
@ONE_PASS
def test_processes_started_45_s_apart_train_under_the_default_timeouts(tmp_path):
    """Process 1 starts 45 s after process 0 (a scheduler, a container, CUDA start-up), longer
    than peer_timeout_s (30 s): process 0 waits for it at the join, and both train."""
    run_dir, port = tmp_path / "run", _free_port()
    procs = _launch(run_dir, "train.steps=2", pids=(0,), port=port)
    try:
        time.sleep(45)
        assert procs[0].poll() is None, procs[0].communicate()[1][-3000:]
        procs += _launch(run_dir, "train.steps=2", pids=(1,), port=port)
        outputs = [p.communicate(timeout=240) for p in procs]
    finally:
        _kill_leftovers(procs)
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
