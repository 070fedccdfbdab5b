"""The checkpointer and its readers (issue #24): checkpoints are written only when asked; a
reader racing the trainer's pruning reads the next newest step; checkpoints/ removed under a
running trainer ends it with one line. A YAML merge key is accepted."""

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from train import cli
from train.loop import run

from tests.helpers.trainer import enable_compile_cache, tiny_config, tiny_overrides


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
    """The runs of this file compile the same step: share it (and leave jax's config as found)."""
    import jax

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {name: getattr(jax.config, name) for name in names}
    enable_compile_cache(tmp_path_factory.mktemp("jax_cache"))
    yield
    for name, value in before.items():
        jax.config.update(name, value)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run.dir that ran its 4 steps with checkpoint.every=0 (only at the end). Every run in
    this file has 4 steps: the same program, compiled once (the schedule's length is in it)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    run(tiny_config(run_dir, "train.steps=4"))
    return run_dir


def test_checkpoints_are_written_only_when_asked(finished, tmp_path):
    """checkpoint.every=0 means only at the end, and every=1000 with save_final=false means none:
    orbax's own policy would also have saved step 1 (its first save) in both."""
    assert sorted(os.listdir(finished / "checkpoints")) == ["4"]
    run_dir = tmp_path / "run"
    run(tiny_config(run_dir, "train.steps=4", "checkpoint.every=1000",
                    "checkpoint.save_final=false"))
    assert os.listdir(run_dir / "checkpoints") == []
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text()
             .splitlines()]
    assert steps == [1, 2, 3, 4]


def test_yaml_merge_keys_are_accepted(tmp_path):
    """`<<: *anchor` (and `<<: {...}`) is valid YAML: the merged keys apply, explicit keys win,
    and a key written twice is still refused."""
    from train.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text(
        "model:\n  preset: tiny\n  shape: &small {num_layers: 2, hidden_size: 64}\n"
        "data: {source: synthetic, seq_len: 64}\n"
        "train:\n  <<: {steps: 4, microbatch_size: 2, grad_accum: 1}\n  steps: 6\n"
        f"run: {{dir: {tmp_path / 'run'}}}\nruntime: {{cpu_devices: 8}}\n"
        "optimizer: {lr: 1.0e-3}\nparallel: {mode: basp}\n")
    cfg = load_config(str(path))
    assert (cfg.train.steps, cfg.train.microbatch_size) == (6, 2)
    assert cfg.model.shape == {"num_layers": 2, "hidden_size": 64}
    path.write_text(path.read_text().replace("  steps: 6\n", "  steps: 6\n  steps: 7\n"))
    with pytest.raises(ConfigError, match="key 'steps' appears twice"):
        load_config(str(path))


# ------------------------------------------------------------------ the checkpointer and its readers

def test_generate_reads_the_next_newest_step_when_the_one_it_reads_is_pruned(
        finished, tmp_path, capsys, monkeypatch):
    """models.generate --run_dir while the trainer saves step 5 and prunes step 4 (keep=1) in the
    middle of the read: the trainer renames a pruned step away in one step (never a half-deleted
    directory), so the reader sees it gone and reads step 5; no traceback, no false 'cannot be
    restored for this model'."""
    import orbax.checkpoint as ocp

    from models import generate
    from train.checkpoint import PRUNED

    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    checkpoints = run_dir / "checkpoints"
    restore = ocp.StandardCheckpointer.restore
    read = []

    def restore_while_pruned(self, path, *args, **kwargs):
        read.append(Path(path).parent.name)
        if len(read) == 1:  # the trainer, meanwhile: step 5 complete, step 4 pruned
            shutil.copytree(checkpoints / "4", checkpoints / "5")
            (checkpoints / PRUNED).mkdir()
            os.rename(checkpoints / "4", checkpoints / PRUNED / "4")
        return restore(self, path, *args, **kwargs)

    monkeypatch.setattr(ocp.StandardCheckpointer, "restore", restore_while_pruned)
    capsys.readouterr()
    status = generate.main(["--run_dir", str(run_dir), "--prompt-ids", "1,2,3",
                            "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert read == ["4", "5"] and len(out.split()) == 2
    assert "Traceback" not in err and "error" not in err


def test_the_trainer_prunes_by_renaming_then_deletes(tmp_path, monkeypatch):
    """A pruned step leaves checkpoints/ in one rename (into checkpoints/.pruned, emptied in the
    background and at close), so no reader ever lists a step that is half deleted."""
    import jax.numpy as jnp

    import train.checkpoint as checkpoint
    from train.config import CheckpointConfig

    monkeypatch.setattr(checkpoint, "_purge", lambda directory: None)  # keep what it renamed
    ckpt = checkpoint.Checkpointer(str(tmp_path), CheckpointConfig(every=1, keep=1), 3)
    state = {"w": jnp.arange(4.0)}
    for step in (1, 2):
        assert ckpt.save(step, state, state, {"step": step})
        ckpt.wait()
    directory = tmp_path / "checkpoints"
    assert sorted(os.listdir(directory)) == [".pruned", "2"]
    assert {"params", "opt_state", "meta"} <= set(os.listdir(directory / ".pruned" / "1"))
    monkeypatch.undo()
    ckpt.close()
    assert sorted(os.listdir(directory)) == ["2"]


def test_checkpoints_removed_under_a_running_trainer_is_one_line(tmp_path, capsys, monkeypatch):
    """Someone removes run.dir/checkpoints while step 2's asynchronous save is being written:
    the run stops with exit status 1 and one line (not orbax's tracebacks from every thread),
    whether the removal cut the save short or came just after it."""
    import train.loop as loop

    save = loop.save_checkpoint

    def save_then_remove(run_, step, force):
        started = save(run_, step, force)
        if step == 2:
            t = time.monotonic()
            while time.monotonic() - t < 0.5:  # while orbax's threads write it, and after
                shutil.rmtree(run_.ckpt.directory, ignore_errors=True)
            shutil.rmtree(run_.ckpt.directory, ignore_errors=True)
        return started

    monkeypatch.setattr(loop, "save_checkpoint", save_then_remove)
    run_dir = tmp_path / "run"
    capsys.readouterr()
    status = cli.main(tiny_overrides(run_dir, "train.steps=4", "checkpoint.every=2"))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(
        ("layout:", "model:", "mfu:", "compiled the train step"))]
    assert status == 1, err[-3000:]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"error: checkpoint: saving a checkpoint to {run_dir}/checkpoints "
                               "failed ("), lines[0]
    assert "Traceback" not in err
