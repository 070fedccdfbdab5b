"""Outputs against inputs, and the checkpointer against its readers.

Every output path (run.dir, checkpoint.export_hf, tokenize -o) is refused, before anything runs,
when it is an input or another output, lies inside one or holds one, symlinks resolved: one line,
exit status 2, and every file under the workspace keeps its bytes and mtime. `~` is expanded and
a remote URL refused, a YAML merge key accepted. Checkpoints are written only when asked; a reader
racing the trainer's pruning reads the next newest step; checkpoints/ removed under a running
trainer ends it with one line.
"""

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from train import cli
from train.loop import run

from tests.helpers.trainer import ROOT, snapshot, tiny_config, tiny_overrides


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run.dir that ran its 4 steps with checkpoint.every=0 (only at the end). Every run in
    this file has 4 steps: the same program, compiled once (the schedule's length is in it)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    run(tiny_config(run_dir, "train.steps=4"))
    return run_dir


def _workspace(w: Path) -> None:
    """Inputs the cases point at: a token file, a config file, a Hugging Face folder, run dirs."""
    (w / "data").mkdir()
    np.arange(1, 400, dtype=np.uint16).tofile(w / "data" / "t.bin")
    (w / "cfg").mkdir()
    (w / "cfg" / "c.yaml").write_text("# my experiment\ntrain:\n  steps: 4\n")
    (w / "hf").mkdir()
    (w / "hf" / "config.json").write_text("{}")
    (w / "r2").mkdir()
    (w / "l2").symlink_to(w / "r2")
    (w / "r" / "checkpoints").mkdir(parents=True)
    np.arange(1, 400, dtype=np.uint16).tofile(w / "r" / "checkpoints" / "t.bin")
    (w / "r" / "config.yaml").write_text("# my own config, kept in the run's folder\n"
                                         "train:\n  steps: 4\n")
    (w / "linked").mkdir()  # run dirs whose files are symlinks to inputs
    (w / "linked" / "config.yaml").symlink_to(w / "cfg" / "c.yaml")
    (w / "linked_ckpt").mkdir()
    (w / "linked_ckpt" / "checkpoints").symlink_to(w / "data")
    (w / "lock_dir" / ".lock").mkdir(parents=True)


TOKENS = ["data.source=tokens"]
HF = ["model.preset=null", "model.shape={}"]

# (name, arguments with {W} for the workspace, the one line's beginning)
CASES = [
    ("export is run.dir", ["run.dir={W}/new", "checkpoint.export_hf={W}/new"],
     "error: config: checkpoint.export_hf '{W}/new' is the same path as run.dir '{W}/new'; an "
     "export replaces its whole directory; choose a checkpoint.export_hf that is neither run.dir "
     "nor inside or around it"),
    ("export inside run.dir", ["run.dir={W}/new", "checkpoint.export_hf={W}/new/hf"],
     "error: config: checkpoint.export_hf '{W}/new/hf' lies inside run.dir '{W}/new'"),
    ("run.dir inside export", ["run.dir={W}/out/run", "checkpoint.export_hf={W}/out"],
     "error: config: checkpoint.export_hf '{W}/out' contains run.dir '{W}/out/run'"),
    ("export is run.dir through a symlink", ["run.dir={W}/r2", "checkpoint.export_hf={W}/l2"],
     "error: config: checkpoint.export_hf '{W}/l2' is the same path as run.dir '{W}/r2'"),
    ("export holds the data", [*TOKENS, "data.path={W}/data/t.bin", "checkpoint.export_hf={W}/data"],
     "error: config: checkpoint.export_hf '{W}/data' contains data.path '{W}/data/t.bin'"),
    ("export holds the config file", ["--config", "{W}/cfg/c.yaml", "checkpoint.export_hf={W}/cfg"],
     "error: config: checkpoint.export_hf '{W}/cfg' contains the config file '{W}/cfg/c.yaml'"),
    ("export is model.hf_path", [*HF, "model.hf_path={W}/hf", "checkpoint.export_hf={W}/hf"],
     "error: config: checkpoint.export_hf '{W}/hf' is the same path as model.hf_path '{W}/hf'"),
    ("run.dir inside model.hf_path", [*HF, "model.hf_path={W}/hf", "run.dir={W}/hf/run"],
     "error: config: run.dir '{W}/hf/run' lies inside model.hf_path '{W}/hf'; the trainer would "
     "write into that input; choose a run.dir outside it"),
    ("data in run.dir/checkpoints", [*TOKENS, "data.path={W}/r/checkpoints/t.bin", "run.dir={W}/r"],
     "error: config: data.path '{W}/r/checkpoints/t.bin' is checkpoints/t.bin in run.dir '{W}/r': "
     "the trainer writes {W}/r/checkpoints (and prunes checkpoints)"),
    ("own config file is run.dir/config.yaml", ["--config", "{W}/r/config.yaml", "run.dir={W}/r"],
     "error: config: the config file '{W}/r/config.yaml' is config.yaml in run.dir '{W}/r': the "
     "trainer writes the resolved config there, and this file is not one (it has comments, an "
     "include or keys left out, which would be lost)"),
    ("run.dir/config.yaml links to the config file", ["--config", "{W}/cfg/c.yaml",
                                                      "run.dir={W}/linked"],
     "error: config: {W}/linked/config.yaml is a symlink to '{W}/cfg/c.yaml', which is the config "
     "file"),
    ("run.dir/checkpoints links to the data's folder",
     [*TOKENS, "data.path={W}/data/t.bin", "run.dir={W}/linked_ckpt"],
     "error: config: {W}/linked_ckpt/checkpoints is a symlink to '{W}/data', which contains "
     "data.path"),
    ("run.dir/.lock is a directory", ["run.dir={W}/lock_dir"],
     "error: config: {W}/lock_dir/.lock is not a regular file"),
    ("remote run.dir", ["run.dir=gs://bucket/x"],
     "error: config: run.dir 'gs://bucket/x' is a remote URL; only local paths are supported"),
    ("remote export", ["run.dir={W}/new", "checkpoint.export_hf=s3://bucket/hf"],
     "error: config: checkpoint.export_hf 's3://bucket/hf' is a remote URL"),
    ("~ is expanded", ["run.dir=~/x", "checkpoint.export_hf=~/x"],  # HOME is the workspace
     "error: config: checkpoint.export_hf '{W}/x' is the same path as run.dir '{W}/x'"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_overlapping_or_remote_outputs_exit_2_with_one_line_and_touch_nothing(
        case, tmp_path, capsys, monkeypatch):
    name, extra, fragment = case
    w = tmp_path / "w"
    w.mkdir()
    _workspace(w)
    monkeypatch.setenv("HOME", str(w))
    fill = lambda s: s.replace("{W}", str(w))  # noqa: E731
    extra = [fill(x) for x in extra]
    config = []
    if extra[:1] == ["--config"]:
        config, extra = extra[:2], extra[2:]
    argv = config + tiny_overrides(w / "run", *extra)
    before = snapshot(w)
    cwd_before = sorted(os.listdir())
    capsys.readouterr()
    status = cli.main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1, err
    assert lines[0].startswith(fill(fragment)), lines[0]
    assert "compiled" not in out + err
    assert snapshot(w) == before, f"{name}: the workspace changed"
    assert sorted(os.listdir()) == cwd_before  # no `gs:` or `~` folder where we stand
    assert not (ROOT / "gs:").exists() and not (ROOT / "~").exists()


@pytest.mark.slow
def test_a_resume_with_the_config_file_the_run_wrote_is_allowed(finished, tmp_path, capsys):
    """`--config RUN/config.yaml` (the resolved config an earlier run wrote there) resumes: that
    file holds nothing a person wrote. With nothing left to train the run writes nothing, so
    the file is left as it was (a run with steps to go replaces it with the overrides applied)."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    written = (run_dir / "config.yaml").read_text()
    capsys.readouterr()
    status = cli.main(["--config", str(run_dir / "config.yaml"), f"run.dir={run_dir}"])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert f"done: {run_dir} already holds step 4 of 4" in out
    assert (run_dir / "config.yaml").read_text() == written
    status = cli.main(["--config", str(run_dir / "config.yaml"), f"run.dir={run_dir}",
                       "train.steps=5", "checkpoint.allow_changed=train.steps"])
    assert status == 0, capsys.readouterr().err
    assert f"dir: {run_dir}\n" in (run_dir / "config.yaml").read_text()


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
    from train.config.schema import ConfigError, load_config

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


def test_tilde_is_the_home_directory(tmp_path, monkeypatch):
    """In every path key, in --config and in an include (a shell leaves `key=~/x` as typed)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    from train.config.schema import load_config

    (tmp_path / "base.yaml").write_text("train: {steps: 3}\n")
    (tmp_path / "c.yaml").write_text("include: ~/base.yaml\n")
    overrides = [o for o in tiny_overrides("~/runs/x", "checkpoint.export_hf=~/hf")
                 if not o.startswith("train.steps=")]
    cfg = load_config("~/c.yaml", overrides)
    assert (cfg.run.dir, cfg.checkpoint.export_hf) == (f"{tmp_path}/runs/x", f"{tmp_path}/hf")
    assert cfg.train.steps == 3  # from the included file
    assert cfg.sources == (f"{tmp_path}/c.yaml", f"{tmp_path}/base.yaml")


# ------------------------------------------------------------------ train.tools.tokenize -o

def _tokenizer(path: Path) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<eos>": 0, "[UNK]": 1, "cat": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return str(path)


TOKENIZE_CASES = [
    ("output is the input", "{W}/x.txt", "{W}/x.txt",
     "error: tokenize: -o '{W}/x.txt' is the same path as the input '{W}/x.txt'; the output replaces that "
     "file"),
    ("output is a symlink to the input", "{W}/x.txt", "{W}/link.txt",
     "error: tokenize: -o '{W}/link.txt' is the same path as the input '{W}/x.txt'"),
    ("output is a hard link to the input", "{W}/x.txt", "{W}/hard.txt",
     "error: tokenize: -o '{W}/hard.txt' is the same path as the input '{W}/x.txt'"),
    ("output is an input of the directory", "{W}/corpus", "{W}/corpus/a.txt",
     "error: tokenize: -o '{W}/corpus/a.txt' is the same path as the input '{W}/corpus/a.txt'"),
    ("output would be read as text", "{W}/corpus", "{W}/corpus/new.txt",
     "error: tokenize: -o '{W}/corpus/new.txt' lies inside the input directory '{W}/corpus' and ends in "
     ".txt/.jsonl"),
    ("sidecar is the tokenizer", "{W}/x.txt", "{W}/t",
     "error: tokenize: the sidecar '{W}/t.json' is the same path as --tokenizer '{W}/t.json'"),
]


@pytest.mark.parametrize("case", TOKENIZE_CASES, ids=[c[0] for c in TOKENIZE_CASES])
def test_tokenize_never_writes_over_its_inputs(case, tmp_path, capsys):
    from train.tools.tokenize import main

    name, source, output, fragment = case
    w = tmp_path
    (w / "x.txt").write_text("cat cat\ncat\n")
    (w / "link.txt").symlink_to(w / "x.txt")
    os.link(w / "x.txt", w / "hard.txt")
    (w / "corpus").mkdir()
    (w / "corpus" / "a.txt").write_text("cat\n")
    tok = _tokenizer(w / "t.json")
    fill = lambda s: s.replace("{W}", str(w))  # noqa: E731
    before = snapshot(w)
    status = main([fill(source), "--tokenizer", tok, "-o", fill(output), "--overwrite",
                   "--workers", "1"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith(fill(fragment)), lines[0]
    assert snapshot(w) == before, f"{name}: a file changed"


# ------------------------------------------------------------------ the checkpointer and its readers

def test_generate_reads_the_next_newest_step_when_the_one_it_reads_is_pruned(
        finished, tmp_path, capsys, monkeypatch):
    """train.tools.generate --run_dir while the trainer saves step 5 and prunes step 4 (keep=1) in the
    middle of the read: the trainer renames a pruned step away in one step (never a half-deleted
    directory), so the reader sees it gone and reads step 5; no traceback, no false 'cannot be
    restored for this model'."""
    import orbax.checkpoint as ocp

    from train.tools import generate
    from train.checkpoint.store import PRUNED

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


def test_a_read_given_up_leaves_no_tracebacks_behind(monkeypatch):
    """orbax's in-flight array reads of a read given up (its step pruned) report 'Event loop is
    closed' through sys.unraisablehook as they end, after the good read: those are dropped, every
    other report still reaches the hook that was there (checked by hand against a trainer pruning
    every step: 141 reads, 11 retried, nothing on stderr)."""
    import sys
    import types

    from train.checkpoint import store as checkpoint

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    checkpoint._quiet_abandoned_reads()
    checkpoint._quiet_abandoned_reads()  # once is enough: no second layer
    closed = types.SimpleNamespace(exc_value=RuntimeError("Event loop is closed"), object=None)
    other = types.SimpleNamespace(exc_value=ValueError("a bug elsewhere"), object=None)
    sys.unraisablehook(closed)
    sys.unraisablehook(other)
    assert seen == [other]


def test_the_trainer_prunes_by_renaming_then_deletes(tmp_path, monkeypatch):
    """A pruned step leaves checkpoints/ in one rename (into checkpoints/.pruned, emptied in the
    background and at close), so no reader ever lists a step that is half deleted."""
    import jax.numpy as jnp

    import train.checkpoint.store as checkpoint
    from train.config.schema import CheckpointConfig

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

    def save_then_remove(run_, state, step, force, **copy):
        started = save(run_, state, step, force, **copy)
        if step == 2:
            t = time.monotonic()
            while time.monotonic() - t < 0.5:  # while orbax's threads write it, and after
                shutil.rmtree(state.ckpt.directory, ignore_errors=True)
            shutil.rmtree(state.ckpt.directory, ignore_errors=True)
        return started

    monkeypatch.setattr(loop, "save_checkpoint", save_then_remove)
    run_dir = tmp_path / "run"
    capsys.readouterr()
    status = cli.main(tiny_overrides(run_dir, "train.steps=4", "checkpoint.every=2"))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(
        ("layout:", "model:", "mfu:", "compiling the train step", "compiled the train step"))]
    assert status == 1, err[-3000:]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"error: checkpoint: saving a checkpoint to {run_dir}/checkpoints "
                               "failed ("), lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("taken", [False, True])
def test_an_export_that_cannot_replace_the_earlier_one_keeps_it(tmp_path, monkeypatch, taken):
    """The earlier export of this run is moved aside before the new one takes its place; when
    that last move fails (here: permission denied), the earlier export goes back where it was,
    or, when something took its path meanwhile, the one line names where it is kept."""
    from train.process import outputs

    run_dir, export_dir = str(tmp_path / "run"), tmp_path / "export"
    export_dir.mkdir()
    (export_dir / "model.safetensors").write_bytes(b"earlier")
    (export_dir / outputs.EXPORT_MARKER).write_text(json.dumps(
        {"run_dir": run_dir, "files": ["model.safetensors"]}))
    new = tmp_path / ".export-new"
    new.mkdir()
    (new / "model.safetensors").write_bytes(b"newer")

    def refuse(src, dst):
        if taken:
            os.mkdir(dst)
        raise PermissionError(13, "Permission denied", dst)

    monkeypatch.setattr(outputs.os, "replace", refuse)
    with pytest.raises(outputs.ExportError) as err:  # one line, never a traceback
        outputs._replace(str(new), str(export_dir), run_dir)
    assert "\n" not in str(err.value) and "Permission denied" in str(err.value)
    kept = [p for p in tmp_path.glob(".export-old-*/export/model.safetensors")]
    if taken:
        assert len(kept) == 1 and kept[0].read_bytes() == b"earlier"
        assert str(kept[0].parent) in str(err.value) and "\n" not in str(err.value)
    else:
        assert (export_dir / "model.safetensors").read_bytes() == b"earlier" and not kept


def test_an_export_whose_folder_became_a_file_during_the_run_is_one_line(tmp_path):
    """checkpoint.export_hf's parent was a folder at the pre-flight check and is a file when the
    export starts: one line naming it (ExportError, exit status 1), nothing written."""
    from train.process import outputs

    (tmp_path / "exports").write_text("not a folder")
    export_dir = tmp_path / "exports" / "final"
    with pytest.raises(outputs.ExportError) as err:
        outputs.export_hf(None, str(export_dir), str(tmp_path / "run"), True)
    message = str(err.value)
    assert "\n" not in message and str(tmp_path / "exports") in message
    assert "no checkpoint was written" in message
    assert (tmp_path / "exports").read_text() == "not a folder"
