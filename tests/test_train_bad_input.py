"""Bad input: one line on stderr (what is wrong, what would work), exit status 2, no traceback,
nothing compiled, and nothing in run.dir written, overwritten or deleted.

Each case runs the real command line (train.cli.main) in-process against a copy of a run
directory that already holds checkpoints, metrics and a config from an earlier good run, and
compares every file's bytes and mtime before and after. XLA compilations are counted with
jax.monitoring. A few cases also run as a subprocess (python train.py) to show the same from a shell.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from train import cli
from train.loop import run

from train_helpers import TINY_SHAPE, tiny_config, tiny_overrides

ROOT = Path(__file__).resolve().parent.parent


# two groups of sp=4 on the 8 devices; checkpoints every 2 steps
BASE = ("train.steps=6", "train.microbatch_size=2", "checkpoint.every=2")


# ------------------------------------------------------------------ fixtures: a finished run, inputs

@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    """A run.dir stopped after 4 of 6 steps, with checkpoints of steps 1 (orbax always saves the
    first), 2 and 4."""
    run_dir = tmp_path_factory.mktemp("good") / "run"
    run(tiny_config(run_dir, *BASE), stop_at=4)
    assert sorted(os.listdir(run_dir / "checkpoints"), key=int) == ["1", "2", "4"]
    return run_dir


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, good_run):
    """Data, tokenizer and Hugging Face directories, each wrong in one way."""
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers

    import models

    d = tmp_path_factory.mktemp("inputs")
    np.array([1, 2, 300, 4] * 100, dtype=np.uint16).tofile(d / "ids_too_big.bin")  # vocab is 256
    (d / "garbage.npy").write_bytes(b"not a numpy file at all")
    (d / "a_directory.bin").mkdir()
    (d / "latin1.txt").write_bytes(b"caf\xe9 au lait\n")
    vocab = {f"w{i}": i for i in range(300)}  # 300 tokens > the model's 256
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "big_tokenizer.json"))
    (d / "docs.txt").write_text("w1 w2 w3\nw4 w5\n" * 50)
    (d / "bad.yaml").write_text("train:\n  steps: [1,\n")
    (d / "a_file").write_text("not a directory\n")

    cfg = tiny_config(d / "unused")
    mcfg = models.ModelConfig.preset("tiny")
    import dataclasses
    import yaml

    shape = yaml.safe_load(TINY_SHAPE.split("=", 1)[1])
    module = models.init_model(dataclasses.replace(mcfg, **shape), seed=0)
    models.save_pretrained(module, str(d / "hf_good"))
    shutil.copytree(d / "hf_good", d / "hf_truncated")
    weights = d / "hf_truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # an interrupted download or copy
    np.save(d / "empty.npy", np.zeros(0, np.uint16))
    (d / "empty.npy").write_bytes(b"")
    for name, change in (("hf_gpt2", {"model_type": "gpt2"}),
                         ("hf_shapes", {"intermediate_size": 96})):
        shutil.copytree(d / "hf_good", d / name)
        config = json.loads((d / name / "config.json").read_text())
        config.update(change)
        (d / name / "config.json").write_text(json.dumps(config))
    del cfg
    return d


# ------------------------------------------------------------------ the cases

def _corrupt_newest(run_dir: Path) -> None:
    """Truncate the array data of the newest checkpoint (a disk error, a bad copy)."""
    for root, _, files in os.walk(run_dir / "checkpoints" / "4" / "params"):
        for name in files:
            path = Path(root) / name
            if "/d" in root and path.stat().st_size > 64:
                path.write_bytes(path.read_bytes()[:64])


def _fresh(run_dir: Path) -> None:
    """No run.dir yet: a failing first run must not even create it."""
    shutil.rmtree(run_dir)


def _half_written(run_dir: Path) -> None:
    """A step directory that looks final but lacks an item (an interrupted copy or rsync)."""
    shutil.rmtree(run_dir / "checkpoints" / "4" / "params")


# (name, extra overrides (with {inputs} / {run} placeholders), fragment of the one line, how to
# damage the run.dir copy first, run.dir override)
CASES = [
    ("unknown key", ["train.stepz=3"], "error: config: unknown config key 'train.stepz'"),
    ("wrong type", ["train.microbatch_size=two"],
     "error: config: train.microbatch_size: expected an integer"),
    ("zero steps", ["train.steps=0"], "error: config: train.steps must be a positive integer"),
    ("negative seq_len", ["data.seq_len=-64"], "error: config: data.seq_len must be an integer > 1"),
    ("negative lr", ["optimizer.lr=-1e-3"], "error: config: optimizer.lr is required and must be > 0"),
    ("bad YAML file", ["--config", "{inputs}/bad.yaml"], "error: config: config file"),
    ("config is a directory", ["--config", "{inputs}"], "error: config: cannot read config file"),
    ("seq_len not divisible by sp", ["data.seq_len=66"],
     "error: layout: seq_len=66 is not divisible by sp=4"),
    ("heads no layout splits", ["model.shape.num_heads=6", "model.shape.num_kv_heads=6"],
     "error: layout: num_heads=6 is not divisible by"),
    ("batch/devices without layout", ["parallel.groups=3"], "error: layout:"),
    ("more devices than exist", ["runtime.devices=16"],
     "error: config: runtime.devices=16 but only 8 cpu device(s) are visible"),
    ("missing data file", ["data.source=tokens", "data.path=/nonexistent/tokens.bin"],
     "error: data: token file '/nonexistent/tokens.bin' does not exist"),
    ("data path is a directory", ["data.source=tokens", "data.path={inputs}/a_directory.bin"],
     "is not a regular file"),
    ("unreadable .npy", ["data.source=tokens", "data.path={inputs}/garbage.npy"],
     "error: data: cannot read"),
    ("token ids >= vocab", ["data.source=tokens", "data.path={inputs}/ids_too_big.bin"],
     "error: data: {inputs}/ids_too_big.bin: token id 300 at position 2 is outside the model's "
     "vocabulary [0, 256)"),
    ("text not UTF-8", ["data.source=text", "data.path={inputs}/latin1.txt",
                        "data.tokenizer={inputs}/big_tokenizer.json", "data.eos_id=0",
                        "model.shape.vocab_size=512"],
     "error: data: {inputs}/latin1.txt:1: not UTF-8 text"),
    ("tokenizer vocab > model vocab", ["data.source=text", "data.path={inputs}/docs.txt",
                                       "data.tokenizer={inputs}/big_tokenizer.json",
                                       "data.eos_id=0"],
     "has 300 tokens, more than the model's vocab_size=256"),
    ("HF dir of another model type", ["model.preset=null", "model.shape={}",
                                      "model.hf_path={inputs}/hf_gpt2"],
     "error: model: {inputs}/hf_gpt2/config.json: unknown model_type 'gpt2'"),
    ("HF dir with mismatched shapes", ["model.preset=null", "model.shape={}",
                                       "model.hf_path={inputs}/hf_shapes"],
     "error: model: tensor model.layers.0.mlp.down_proj.weight has shape (64, 128) in "
     "{inputs}/hf_shapes but its config.json needs (64, 96)"),
    ("checkpoint of another model shape", ["model.shape.intermediate_size=96"],
     "error: checkpoint: checkpoint {run}/checkpoints/4 holds another model: parameter "
     "layers.mlp.down_proj.kernel has shape (2, 128, 64) there and (2, 96, 64) in this config"),
    ("corrupt checkpoint", [], "error: checkpoint: checkpoint {run}/checkpoints/4 cannot be read (",
     _corrupt_newest),
    ("half-written checkpoint", [],
     "error: checkpoint: checkpoint {run}/checkpoints/4 lacks params: it is corrupt or "
     "half-written; move {run}/checkpoints/4 out of the way to resume from step 2", _half_written),
    ("empty .npy", ["data.source=tokens", "data.path={inputs}/empty.npy"],
     "error: data: cannot read '{inputs}/empty.npy' as .npy"),
    ("truncated HF weights, fresh run.dir", ["model.preset=null", "model.shape={}",
                                             "model.hf_path={inputs}/hf_truncated"],
     "error: model: {inputs}/hf_truncated/model.safetensors is truncated: tensor", _fresh),
    ("HF dir of another type, fresh run.dir", ["model.preset=null", "model.shape={}",
                                               "model.hf_path={inputs}/hf_gpt2"],
     "unknown model_type 'gpt2'", _fresh),
    ("changed seed on resume", ["run.seed=1"],
     "error: config: run.seed=1 differs from the checkpoint's seed 0"),
    ("changed optimizer on resume", ["optimizer.clip_norm=null"],
     "error: checkpoint: checkpoint {run}/checkpoints/4 holds another optimizer state: "
     "0.0.count has shape absent there and () in this config; the optimizer settings changed"),
    ("resume=false over checkpoints", ["checkpoint.resume=false"],
     "error: config: checkpoint.resume=false but {run}/checkpoints holds steps [1, 2, 4]"),
    ("checkpoint beyond train.steps", ["train.steps=3"],
     "error: config: run.dir holds a checkpoint of step 4, beyond train.steps=3"),
    ("run.dir is a file", ["run.dir={inputs}/a_file"],
     "error: config: run.dir '{inputs}/a_file' is a file, not a directory"),
    ("export_hf is a file", ["checkpoint.export_hf={inputs}/a_file"],
     "error: config: checkpoint.export_hf '{inputs}/a_file' is a file"),
]


def _snapshot(*dirs: Path) -> dict:
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


class CompileCounter:
    """Counts XLA backend compilations while active (jax.monitoring duration events)."""

    def __init__(self):
        self.count = 0
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        if self.active and "backend_compile" in event:
            self.count += 1


@pytest.fixture(scope="module")
def compiles():
    return CompileCounter()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line_and_touches_nothing(case, good_run, inputs, tmp_path,
                                                              capsys, compiles):
    name, extra, fragment, *damage = case
    run_dir = tmp_path / "run"
    shutil.copytree(good_run, run_dir)
    for hurt in damage:
        hurt(run_dir)
    fill = lambda s: s.replace("{inputs}", str(inputs)).replace("{run}", str(run_dir))  # noqa: E731
    extra = [fill(x) for x in extra]
    config = []
    if extra[:1] == ["--config"]:
        config, extra = extra[:2], extra[2:]
    argv = config + tiny_overrides(run_dir, *BASE, *extra)
    existed = run_dir.exists()
    before = _snapshot(run_dir, inputs)
    capsys.readouterr()

    jax.clear_caches()  # a program compiled by an earlier case would otherwise go unseen
    compiles.active, compiles.count = True, 0
    try:
        status = cli.main(argv)
    finally:
        compiles.active = False
    err = capsys.readouterr().err

    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1, err
    print(lines[0])
    assert fill(fragment) in lines[0], lines[0]
    assert "Traceback" not in err
    assert compiles.count == 0, f"{name}: {compiles.count} XLA compilations before the error"
    assert run_dir.exists() == existed, f"{name}: run.dir was created"
    assert _snapshot(run_dir, inputs) == before, f"{name}: run.dir or inputs changed"


@pytest.mark.parametrize("extra, fragment, damage", [
    (["train.stepz=3"], "error: config: unknown config key 'train.stepz'", None),
    (["runtime.devices=16"], "error: config: runtime.devices=16 but only 8 cpu device(s)", None),
    (["model.shape.intermediate_size=96"], "holds another model", None),
    ([], "cannot be read (", _corrupt_newest),
])
def test_bad_input_from_a_shell(good_run, tmp_path, extra, fragment, damage):
    """The same through `python train.py`: exit 2, exactly one line on stderr (no warnings from
    libraries at exit either), nothing written."""
    run_dir = tmp_path / "run"
    shutil.copytree(good_run, run_dir)
    if damage:
        damage(run_dir)
    before = _snapshot(run_dir)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"),
         *tiny_overrides(run_dir, *BASE, *extra)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0], proc.stderr[-2000:]
    assert proc.stdout == ""
    assert _snapshot(run_dir) == before


def test_the_good_run_dir_still_resumes(good_run, tmp_path, compiles):
    """The fixture is a real, resumable run (so the cases above fail for their one reason), and
    the compile counter does see the compilations of a run that gets going."""
    run_dir = tmp_path / "run"
    shutil.copytree(good_run, run_dir)
    jax.clear_caches()
    compiles.active, compiles.count = True, 0
    try:
        summary = run(tiny_config(run_dir, *BASE))
    finally:
        compiles.active = False
    assert summary["start_step"] == 4 and summary["steps"] == 6
    assert compiles.count > 0
