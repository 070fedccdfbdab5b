"""What a run does to its run.dir and outputs when the world is hostile: one owner per
run.dir, exports that never destroy (nor replace files put in their directory during the run,
nor write a value their dtype cannot hold), a metrics.jsonl cut mid-line, a full disk (under the
checkpoints or the export), SIGINT while starting up. The bad values themselves are in
tests/train/test_bad_input.py."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from train import cli
from train.loop import run
from tests.helpers.trainer import ROOT, tiny_config, tiny_overrides, train_cmd, train_env

pytestmark = pytest.mark.usefixtures("compile_cache")  # this run's (tests/conftest.py)


def _steps(run_dir) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _wait_for_steps(run_dir, n: int, proc, timeout: float = 180) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps in {metrics} (exit status {proc.poll()})")


@pytest.mark.slow
def test_a_second_run_on_a_busy_run_dir_exits_2_naming_the_owner(tmp_path, capsys):
    """Two runs started on one run.dir: the second one stops with one line naming the first one's
    pid and host, before it reads or writes anything; the first keeps every metrics line."""
    run_dir = tmp_path / "run"
    args = tiny_overrides(run_dir, "train.steps=400", "checkpoint.every=1000")
    first = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT,
                             env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        _wait_for_steps(run_dir, 2, first)
        capsys.readouterr()
        status = cli.main(args)
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert status == 2 and len(lines) == 1, lines
        assert lines[0].startswith(f"error: run.dir: {run_dir} is in use by pid {first.pid} on "
                                   f"{socket.gethostname()} (started "), lines[0]
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0, err[-2000:]
    done = _steps(run_dir)
    assert done == list(range(1, len(done) + 1))  # nothing replaced the file it appended to
    assert not (run_dir / ".lock").exists()
    assert not [p for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name]


@pytest.mark.slow
def test_stale_lock_export_and_a_metrics_line_without_newline(tmp_path, capsys):
    """A lock file left by a dead owner does not block; a warm-up longer than the run is clamped
    with a note; the export goes through a temporary directory (mode from the umask, marked as
    this run's) and a later export of the same run replaces it; a metrics.jsonl whose last line
    lost its newline (a crash mid-write) resumes without merging lines."""
    run_dir, export = tmp_path / "run", tmp_path / "hf"
    run_dir.mkdir()
    (run_dir / ".lock").write_text(json.dumps({"pid": 2**22 + 7, "host": socket.gethostname(),
                                               "started": "2026-01-01T00:00:00"}))
    common = ("optimizer.warmup_steps=20", f"checkpoint.export_hf={export}")
    run(tiny_config(run_dir, "train.steps=2", *common))
    err = capsys.readouterr().err
    assert ("note: optimizer.warmup_steps=20 is longer than the run; warming up over "
            "train.steps=2 instead") in err
    assert not (run_dir / ".lock").exists()
    umask = os.umask(0)
    os.umask(umask)
    weights = export / "model.safetensors"
    assert weights.stat().st_mode & 0o777 == 0o666 & ~umask
    assert export.stat().st_mode & 0o777 == 0o777 & ~umask
    marker = json.loads((export / ".basp-export.json").read_text())
    assert marker["run_dir"] == str(run_dir)  # and every file it wrote
    assert set(marker["files"]) == {p.name for p in export.iterdir()} - {".basp-export.json"}
    first_export = weights.read_bytes()

    metrics = run_dir / "metrics.jsonl"
    metrics.write_text(metrics.read_text().rstrip("\n"))
    summary = run(tiny_config(run_dir, "train.steps=3", "checkpoint.allow_changed=train.steps",
                              *common))
    assert summary["start_step"] == 2
    assert _steps(run_dir) == [1, 2, 3]
    assert weights.read_bytes() != first_export  # step 3's weights replaced the earlier export
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # no temporary left


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_keeps_the_newest_checkpoint(tmp_path):
    """run.dir on a 3 MB file system: a later checkpoint (about 1.2 MB each) does not fit. Exit 1
    with one error line naming the path and the newest complete checkpoint (orbax's threads logged
    ~160 lines of tracebacks); that checkpoint is whole, and once there is space the same command
    resumes from it and finishes."""
    small = tmp_path / "small"
    small.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(small)],
                           capture_output=True, text=True)
    if mount.returncode:
        pytest.skip(f"mounting a small tmpfs needs root (CI runs as root): {mount.stderr.strip()}")
    try:
        run_dir = small / "run"
        command = tiny_overrides(run_dir, "train.steps=6", "checkpoint.every=2")
        proc = train_cmd(*command)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and "ERROR:absl" not in proc.stderr, proc.stderr[-3000:]
        assert len(errors) == 1, errors
        assert errors[0].startswith(f"error: disk: no space left on the device writing {run_dir}/"
                                    "checkpoints"), errors[0]
        # Which step is the newest depends on the checkpoint's size; the message must name it.
        checkpoints = run_dir / "checkpoints"
        complete = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
        assert complete and complete[-1] < 6, sorted(p.name for p in checkpoints.iterdir())
        newest = complete[-1]
        assert f"the newest complete checkpoint is step {newest} in {checkpoints};" in errors[0]
        assert {"params", "opt_state", "meta"} <= {p.name for p in (checkpoints / str(newest)).iterdir()}

        subprocess.run(["mount", "-o", "remount,size=64m", str(small)], check=True)
        proc = train_cmd(*command)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert _steps(run_dir) == list(range(1, 7))
        assert 6 in [int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()]
    finally:
        subprocess.run(["umount", str(small)], check=False)


# ------------------------------------------------------------------ exports that cannot be written

@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run.dir that ran its 2 steps: the same command with an export only exports (nothing
    is left to train, so nothing compiles)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    run(tiny_config(run_dir, "train.steps=2"))
    return run_dir


def _error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err[-3000:]
    return [line for line in err.splitlines() if line.startswith("error")]


@pytest.mark.slow
def test_files_put_into_the_export_directory_during_the_run_are_kept(tmp_path, capsys,
                                                                     monkeypatch):
    """checkpoint.export_hf is empty when the run starts, and files arrive there while it
    trains (one named as an export's weights): the export stops with one line naming them, exit
    status 1, and they keep their bytes; the run's checkpoints stay (was: the export took the
    directory for an earlier export of this run and deleted them)."""
    from train import loop

    run_dir, export = tmp_path / "run", tmp_path / "hf"
    export.mkdir()
    theirs = {"notes.txt": b"my notes\n", "model.safetensors": b"someone else's weights"}
    save = loop.save_checkpoint

    def save_and_meanwhile(run, state, step, force, **copy):
        if step == 1:  # after the first of 2 steps
            for name, data in theirs.items():
                (export / name).write_bytes(data)
        return save(run, state, step, force, **copy)

    monkeypatch.setattr(loop, "save_checkpoint", save_and_meanwhile)
    capsys.readouterr()
    status = cli.main(tiny_overrides(run_dir, "train.steps=2", "checkpoint.every=1",
                                     f"checkpoint.export_hf={export}"))
    errors = _error_lines(capsys.readouterr().err)
    assert status == 1 and len(errors) == 1, errors
    assert errors[0].startswith(f"error: export: checkpoint.export_hf '{export}' holds files"), \
        errors[0]
    assert "notes.txt" in errors[0] and "model.safetensors" in errors[0]
    assert {p.name: p.read_bytes() for p in export.iterdir()} == theirs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # no temporary left
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["1", "2"]


@pytest.mark.slow
def test_a_weight_the_export_dtype_cannot_hold_writes_nothing(finished, tmp_path, capsys):
    """A finite weight of 1e6 (float16 holds up to 65504) and checkpoint.export_dtype=float16:
    one line naming the parameter and its largest |value|, exit status 1, no export and no
    temporary written, the checkpoints as they were (was: exit 0 and inf in the export)."""
    from tests.helpers.trainer import set_checkpoint_value, snapshot

    run_dir, export = tmp_path / "run", tmp_path / "hf"
    shutil.copytree(finished, run_dir)
    set_checkpoint_value(run_dir, 2, "layers.mlp.down_proj.kernel", 1e6)
    before = snapshot(run_dir / "checkpoints")
    capsys.readouterr()
    status = cli.main(tiny_overrides(run_dir, "train.steps=2", f"checkpoint.export_hf={export}",
                                     "checkpoint.export_dtype=float16"))
    out, err = capsys.readouterr()
    errors = _error_lines(err)
    assert status == 1 and len(errors) == 1, errors
    assert errors[0].startswith("error: export: "), errors[0]
    assert "mlp.down_proj" in errors[0] and "1e+06" in errors[0] and "float16" in errors[0]
    assert "compiled" not in out + err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert snapshot(run_dir / "checkpoints") == before


@pytest.mark.slow
def test_an_export_onto_a_full_disk_is_one_line(finished, tmp_path, capsys):
    """checkpoint.export_hf on a 64 KB file system, too small for the weights: safetensors'
    own error (not an OSError: it escaped as a 29-line traceback) is the trainer's one-line disk
    error, exit status 1; no temporary is left there and the checkpoints are as they were."""
    from tests.helpers.trainer import snapshot

    small = tmp_path / "small"
    small.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)],
                           capture_output=True, text=True)
    if mount.returncode:
        pytest.skip(f"mounting a small tmpfs needs root (CI runs as root): {mount.stderr.strip()}")
    try:
        run_dir = tmp_path / "run"
        shutil.copytree(finished, run_dir)
        before = snapshot(run_dir / "checkpoints")
        capsys.readouterr()
        status = cli.main(tiny_overrides(run_dir, "train.steps=2",
                                         f"checkpoint.export_hf={small / 'hf'}"))
        errors = _error_lines(capsys.readouterr().err)
        assert status == 1 and len(errors) == 1, errors
        assert errors[0].startswith(f"error: disk: no space left on the device writing {small}/"), \
            errors[0]
        assert os.listdir(small) == []
        assert snapshot(run_dir / "checkpoints") == before
    finally:
        subprocess.run(["umount", str(small)], check=False)


@pytest.mark.parametrize("delay", [1.0, 3.0])
def test_sigint_during_start_up_exits_130_with_one_line(tmp_path, delay):
    """Ctrl-C while Python imports JAX or the trainer plans the run (was: a KeyboardInterrupt
    traceback, then a segfault in the interpreter's shutdown)."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"),
                             *tiny_overrides(run_dir, "train.steps=4")],
                            cwd=ROOT, env=train_env(cache=False), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # no cache: compiling is start-up
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    # the start-up log lines (train.observe.report.log_start, and the compile's announcement:
    # train.program.compile_progress) come first when the run got that far
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(
        ("layout:", "model:", "mfu:", "compiling ", "still compiling "))]
    assert proc.returncode == 130, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: interrupted: SIGINT"), err[-2000:]
    assert not (run_dir / "checkpoints").exists() or not any(
        p.name.isdigit() for p in (run_dir / "checkpoints").iterdir())


def test_sigterm_while_compiling_exits_at_once_with_one_line(tmp_path):
    """SIGTERM while XLA compiles the train step (one long call into C++, during which Python
    runs no signal handler): exit status 143 at once with one line, before the compile ends; no
    step, no checkpoint (was: it compiled on, ran a step and checkpointed, which a preemption's
    grace period shorter than a GPU compile ends in SIGKILL)."""
    run_dir = tmp_path / "run"
    env = dict(train_env(), JAX_LOG_COMPILES="1")  # logs when each compile starts
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"),
                             *tiny_overrides(run_dir, "train.steps=2")],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        seen = []
        for line in proc.stderr:  # the step's MLIR is made: XLA compiles it next
            seen.append(line)
            if "MLIR module conversion jit(train_step)" in line:
                break
        proc.send_signal(signal.SIGTERM)
        err = "".join(seen) + proc.stderr.read()
        proc.wait(timeout=60)
    finally:
        proc.kill()
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(
        ("layout:", "model:", "mfu:", "compiling the train step", "WARNING:jax"))]
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith(
        "error: interrupted: SIGTERM outside the training loop"), err[-3000:]
    assert "Finished XLA compilation of jit(train_step)" not in err
    assert "compiled the train step" not in err
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text()
    assert not any(p.name.isdigit() for p in (run_dir / "checkpoints").iterdir())
