"""NaN/Inf loss or gradients: the step never changes the parameters; skip or stop by config; a
non-finite state is never checkpointed. (A learning rate of 1e6 without clipping makes the
gradient norm NaN after a step or two.)"""

import jax
import numpy as np
import pytest

from train.loop import run
from tests.helpers.trainer import ROOT, tiny_config, tiny_overrides, train_cmd as _train, train_env

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compile_cache")]  # tests/conftest.py

BLOW_UP = ("optimizer.lr=1e6", "optimizer.clip_norm=null", "optimizer.warmup_steps=0")


def _finite(tree) -> bool:
    return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree))


def test_skip_keeps_training_on_finite_parameters_and_checkpoints(tmp_path):
    cfg = tiny_config(tmp_path / "run", *BLOW_UP, "train.steps=4", "checkpoint.every=1",
                      "checkpoint.async_save=false")
    summary = run(cfg)
    assert summary["steps"] == 4 and _finite(summary["params"])
    records = [__import__("json").loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["skipped"] for r in records]
    assert not skipped[0] and any(skipped), skipped
    assert all(r["skipped"] == (not np.isfinite(float(r["grad_norm"]))) for r in records)
    # The checkpoints hold the finite state: resuming for one more step starts from it.
    again = run(tiny_config(tmp_path / "run", *BLOW_UP, "train.steps=5", "checkpoint.every=1",
                             "checkpoint.allow_changed=train.steps"))
    assert again["start_step"] == 4 and _finite(again["params"])


def test_stop_exits_1_with_one_line_and_keeps_the_last_finite_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    result = _train(*tiny_overrides(run_dir, *BLOW_UP, "train.steps=4", "checkpoint.every=1",
                                    "train.on_nonfinite=stop"))
    assert result.returncode == 1, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: training: step ") and "train.on_nonfinite=stop" in last, last
    assert "Traceback" not in result.stderr
    bad_step = int(last.split("step ")[1].split(":")[0])
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps and max(steps) == bad_step - 1, (steps, bad_step)  # the bad step was never saved
    assert f"the last checkpoint (step {bad_step - 1}) holds finite state" in last


def _checkpoint_params(run_dir, step):
    """The parameters saved at `step`, read back as numpy arrays (no target needed)."""
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer().restore(run_dir / "checkpoints" / str(step) / "params")


def test_a_finite_gradient_times_a_nan_lr_never_reaches_the_parameters(tmp_path):
    """Validation refuses lr=nan, weight_decay=nan, clip_norm=nan (tests/train/test_config.py);
    here a NaN learning rate gets past it (set on the dataclass) to show the second line of
    defence: loss and gradient norm are finite but the update is not, and the step counts as
    non-finite, so every checkpoint still holds the initial, finite parameters."""
    run_dir = tmp_path / "run"
    cfg = tiny_config(run_dir, "train.steps=3", "checkpoint.every=1", "checkpoint.async_save=false")
    cfg.optimizer.lr = float("nan")
    summary = run(cfg)
    assert _finite(summary["params"])
    import json

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [True, True, True]
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in records)
    for step in (1, 2, 3):
        assert _finite(_checkpoint_params(run_dir, step)), step


def test_stop_on_a_nan_update_says_no_checkpoint_was_written(tmp_path):
    """on_nonfinite=stop when the first update is the non-finite one: the message does not claim
    a checkpoint that does not exist, and none was written."""
    from train.loop import NonFiniteError

    run_dir = tmp_path / "run"
    cfg = tiny_config(run_dir, "train.steps=3", "train.on_nonfinite=stop")
    cfg.optimizer.weight_decay = float("nan")
    import pytest

    with pytest.raises(NonFiniteError) as info:
        run(cfg)
    assert "step 1: the update (loss" in str(info.value)
    assert "no checkpoint was written" in str(info.value)
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]


def test_sigterm_finishes_the_step_checkpoints_and_resumes(tmp_path):
    """SIGTERM mid-run: exit 0 after a checkpoint of the last finished step; the same command
    then resumes from it."""
    import json
    import signal
    import subprocess
    import sys
    import time

    run_dir = tmp_path / "run"
    args = [sys.executable, str(ROOT / "train.py"),
            *tiny_overrides(run_dir, "train.steps=400", "checkpoint.every=1000")]
    proc = subprocess.Popen(args, cwd=ROOT, env=train_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "received SIGTERM" in err
    done = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert done[-1] < 400
    steps = [int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]
    assert max(steps) == done[-1]
    resumed = run(tiny_config(run_dir, "train.steps=400", "checkpoint.every=1000"), stop_at=done[-1] + 2)
    assert resumed["start_step"] == done[-1]


def test_a_checkpoint_holding_a_nan_is_refused_and_kept(tmp_path, capsys):
    """A NaN in a checkpoint's parameters (damaged on disk): the resume stops with one line naming
    the step, the parameter and the earlier step to resume from, exit status 2, before anything
    compiles; every checkpoint keeps its bytes (was: every step skipped, exit 0, and the final
    checkpoint saved the NaN again)."""
    from tests.helpers.trainer import set_checkpoint_value, snapshot
    from train import cli

    run_dir = tmp_path / "run"
    overrides = tiny_overrides(run_dir, "train.steps=6", "checkpoint.every=2")
    run(tiny_config(run_dir, "train.steps=6", "checkpoint.every=2"), stop_at=4)
    set_checkpoint_value(run_dir, 4, "layers.mlp.down_proj.kernel", np.nan)
    before = snapshot(run_dir / "checkpoints")
    capsys.readouterr()
    status = cli.main(overrides)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: checkpoint: "), lines[0]
    assert "step 4" in lines[0] and "layers.mlp.down_proj.kernel" in lines[0], lines[0]
    assert "resume from step 2" in lines[0], lines[0]
    assert "compiled" not in out + err
    assert snapshot(run_dir / "checkpoints") == before
