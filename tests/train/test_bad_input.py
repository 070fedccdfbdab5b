"""Bad input: one line on stderr (what is wrong, what would work), exit status 2, no traceback,
nothing compiled, and nothing in run.dir written, overwritten or deleted.

Each case runs the real command line (train.cli.main) in-process against a copy of a run
directory that already holds checkpoints, metrics and a config from an earlier good run, and
compares every file's bytes and mtime before and after. XLA compilations are counted with
jax.monitoring. A few cases also run as a subprocess (python train.py) to show the same from a shell.
"""

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

from tests.helpers.flags import TEST_XLA_FLAGS
from tests.helpers.trainer import TINY_SHAPE, snapshot as _snapshot, tiny_config, tiny_overrides

COMPILE_CACHE = False  # tests/conftest.py: it counts the XLA compilations before each error

ROOT = Path(__file__).resolve().parents[2]


# two groups of sp=4 on the 8 devices; checkpoints every 2 steps
BASE = ("train.steps=6", "train.microbatch_size=2", "checkpoint.every=2")


# ------------------------------------------------------------------ fixtures: a finished run, inputs

@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    """A run.dir stopped after 4 of 6 steps, with checkpoints of steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("good") / "run"
    run(tiny_config(run_dir, *BASE), stop_at=4)
    assert sorted(os.listdir(run_dir / "checkpoints"), key=int) == ["2", "4"]
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
                         ("hf_shapes", {"intermediate_size": 96}),
                         ("hf_heads0", {"num_attention_heads": 0, "head_dim": None}),
                         ("hf_theta", {"rope_theta": "abc"}),
                         ("hf_eps", {"rms_norm_eps": "abc"})):
        shutil.copytree(d / "hf_good", d / name)
        config = json.loads((d / name / "config.json").read_text())
        config.update(change)
        (d / name / "config.json").write_text(json.dumps(config))
    # one NaN weight in an otherwise good checkpoint (a bad download or conversion)
    from models.safetensors_io import Checkpoint, write_safetensors

    shutil.copytree(d / "hf_good", d / "hf_nan")
    weights = Checkpoint(str(d / "hf_nan"))
    tensors = {name: weights.get(name).copy() for name in weights.keys()}
    tensors["model.norm.weight"][3] = np.nan
    write_safetensors(str(d / "hf_nan" / "model.safetensors"), tensors)
    (d / "dup.yaml").write_text("train:\n  steps: 6\n  microbatch_size: 2\n  steps: 60\n")

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


def _meta_data_step(run_dir: Path) -> None:
    """A newest checkpoint whose meta says data_step -3 (hand-edited, or written by a bug)."""
    meta = run_dir / "checkpoints" / "4" / "meta" / "metadata"
    meta.write_text(meta.read_text().replace('"data_step": 4', '"data_step": -3'))


def _orbax_metadata_list(step: int):
    def damage(run_dir: Path) -> None:
        (run_dir / "checkpoints" / str(step) / "_CHECKPOINT_METADATA").write_text("[]")
    return damage


def _metrics_is_a_directory(run_dir: Path) -> None:
    (run_dir / "metrics.jsonl").unlink()
    (run_dir / "metrics.jsonl").mkdir()


LONG_NAME = "x" * 300
LLAMA3_X = ("model.shape.rope_scaling={rope_type: llama3, factor: x, low_freq_factor: 1.0, "
            "high_freq_factor: 4.0, original_max_position_embeddings: 8192}")
HF = ["model.preset=null", "model.shape={}"]

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
     "error: layout: seq_len=66 is not divisible by sp=4", _fresh),
    ("heads no layout splits", ["model.shape.num_heads=6", "model.shape.num_kv_heads=6"],
     "error: layout: num_heads=6 is not divisible by", _fresh),
    ("batch/devices without layout", ["parallel.groups=3"], "error: layout:"),
    ("more devices than exist", ["runtime.devices=16"],
     "error: config: runtime.devices=16 but only 8 cpu device(s) are visible"),
    ("missing data file", ["data.source=tokens", "data.path=/nonexistent/tokens.bin"],
     "error: data: token file '/nonexistent/tokens.bin' does not exist"),
    ("data path is a directory", ["data.source=tokens", "data.path={inputs}/a_directory.bin"],
     "is not a regular file"),
    ("unreadable .npy", ["data.source=tokens", "data.path={inputs}/garbage.npy"],
     "error: data: cannot read", _fresh),
    ("token ids >= vocab", ["data.source=tokens", "data.path={inputs}/ids_too_big.bin"],
     "error: data: {inputs}/ids_too_big.bin: token id 300 at position 2 is outside the model's "
     "vocabulary [0, 256)", _fresh),
    ("text not UTF-8", ["data.source=text", "data.path={inputs}/latin1.txt",
                        "data.tokenizer={inputs}/big_tokenizer.json", "data.eos_id=0",
                        "model.shape.vocab_size=512"],
     "error: data: {inputs}/latin1.txt:1: not UTF-8 text", _fresh),
    ("tokenizer vocab > model vocab", ["data.source=text", "data.path={inputs}/docs.txt",
                                       "data.tokenizer={inputs}/big_tokenizer.json",
                                       "data.eos_id=0"],
     "has 300 tokens, more than the model's vocab_size=256", _fresh),
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
     "error: data: cannot read '{inputs}/empty.npy' as .npy", _fresh),
    ("truncated HF weights, fresh run.dir", ["model.preset=null", "model.shape={}",
                                             "model.hf_path={inputs}/hf_truncated"],
     "error: model: {inputs}/hf_truncated/model.safetensors is truncated or damaged (", _fresh),
    ("HF dir of another type, fresh run.dir", ["model.preset=null", "model.shape={}",
                                               "model.hf_path={inputs}/hf_gpt2"],
     "unknown model_type 'gpt2'", _fresh),
    # a resume compares the config with the checkpoint before planning or reading the data: a
    # new data file whose ids do not fit is first a change to allow
    ("changed data on resume", ["data.source=tokens", "data.path={inputs}/ids_too_big.bin"],
     "error: config: data.source=tokens differs from the checkpoint's"),
    ("changed seed on resume", ["run.seed=1"],
     "error: config: run.seed=1 differs from the checkpoint's seed 0"),
    ("changed optimizer on resume", ["optimizer.clip_norm=null"],
     "error: checkpoint: checkpoint {run}/checkpoints/4 holds another optimizer state: "
     "0.0.count has shape absent there and () in this config; the optimizer settings changed"),
    ("resume=false over checkpoints", ["checkpoint.resume=false"],
     "error: config: checkpoint.resume=false but {run}/checkpoints holds steps [2, 4]"),
    ("checkpoint beyond train.steps", ["train.steps=3"],
     "error: config: run.dir holds a checkpoint of step 4, beyond train.steps=3"),
    ("run.dir is a file", ["run.dir={inputs}/a_file"],
     "error: config: run.dir '{inputs}/a_file' is a file, not a directory"),
    ("export_hf is a file", ["checkpoint.export_hf={inputs}/a_file"],
     "error: config: checkpoint.export_hf '{inputs}/a_file' is a file"),
    # --- values that are wrong in a way the checks above did not see
    ("lr nan", ["optimizer.lr=nan"], "error: config: optimizer.lr: expected a finite number, got "
                                     "'nan'"),
    ("weight_decay nan", ["optimizer.weight_decay=nan"], "optimizer.weight_decay: expected a finite"),
    ("clip_norm nan", ["optimizer.clip_norm=nan"], "optimizer.clip_norm: expected a finite number"),
    ("NaN in the HF weights", HF + ["model.hf_path={inputs}/hf_nan"],
     "error: model: {inputs}/hf_nan: weight norm.weight holds NaN or Inf values", _fresh),
    ("checkpoint meta data_step -3", [],
     "error: checkpoint: checkpoint {run}/checkpoints/4 cannot be read (ValueError: meta "
     "data_step=-3, expected an integer in [0, 4])", _meta_data_step),
    ("_CHECKPOINT_METADATA is [] (newest)", [],
     "error: checkpoint: checkpoint {run}/checkpoints/4 cannot be read (ValueError: "
     "_CHECKPOINT_METADATA holds list, not an object)", _orbax_metadata_list(4)),
    ("_CHECKPOINT_METADATA is [] (older)", [],
     "error: checkpoint: checkpoint {run}/checkpoints/2 cannot be read (ValueError: "
     "_CHECKPOINT_METADATA holds list, not an object): it is corrupt; move it out of "
     "{run}/checkpoints (the newest, step 4, is unaffected)", _orbax_metadata_list(2)),
    ("metrics.jsonl is a directory", [],
     "error: config: {run}/metrics.jsonl is not a regular file", _metrics_is_a_directory),
    ("cudnn on CPU", ["model.attn_impl=cudnn"],
     "error: config: model.attn_impl=cudnn needs a GPU but the devices are cpu"),
    ("run.dir name too long", ["run.dir={inputs}/" + LONG_NAME + "/run"],
     "error: config: run.dir: the name 'xxxxxxxx"),
    ("run.dir under a file", ["run.dir={inputs}/a_file/run"],
     "error: config: run.dir '{inputs}/a_file/run' cannot be created: {inputs}/a_file is a file"),
    ("export_hf under a file", ["checkpoint.export_hf={inputs}/a_file/hf"],
     "error: config: checkpoint.export_hf '{inputs}/a_file/hf' cannot be created: "
     "{inputs}/a_file is a file"),
    ("export_hf name too long", ["checkpoint.export_hf={inputs}/" + LONG_NAME],
     "error: config: checkpoint.export_hf: the name 'xxxx"),
    ("export_hf holds other files", ["checkpoint.export_hf={inputs}/hf_good"],
     "error: config: checkpoint.export_hf '{inputs}/hf_good' holds other files and is not an "
     "earlier export of this run.dir"),
    ("export_hf is model.hf_path", HF + ["model.hf_path={inputs}/hf_good",
                                         "checkpoint.export_hf={inputs}/hf_good"],
     "error: config: checkpoint.export_hf '{inputs}/hf_good' is the same path as model.hf_path "
     "'{inputs}/hf_good'; an export replaces its whole directory", _fresh),
    ("rope_scaling=5", ["model.shape.rope_scaling=5"],
     "error: model: rope_scaling must be a mapping"),
    ("llama3 rope factor x", [LLAMA3_X],
     "error: model: rope_scaling.factor must be a positive number, got 'x'"),
    ("HF config with 0 heads", HF + ["model.hf_path={inputs}/hf_heads0"],
     "error: model: {inputs}/hf_heads0/config.json: num_attention_heads must be a positive "
     "integer, got 0"),
    ("HF rope_theta abc", HF + ["model.hf_path={inputs}/hf_theta"],
     "rope_theta must be a number, got 'abc'"),
    ("HF rms_norm_eps abc", HF + ["model.hf_path={inputs}/hf_eps"],
     "rms_norm_eps must be a number, got 'abc'"),
    ("unknown metrics.device", ["metrics.device=h100"],
     "error: config: metrics.device: expected one of a100-40gb, "),
    ("seed -1", ["run.seed=-1"], "error: config: run.seed must lie in [0, 4294967295], got -1"),
    ("seed 2**64", [f"run.seed={2**64}"], "error: config: run.seed must lie in [0, 4294967295]"),
    ("seq_len 1e9", ["data.seq_len=1000000000"],
     "error: resources: the train step needs about", _fresh),
    ("duplicate YAML keys", ["--config", "{inputs}/dup.yaml"],
     "error: config: config file '{inputs}/dup.yaml': key 'steps' appears twice (lines 2 and 4)"),
]


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


@pytest.mark.slow
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


@pytest.mark.parametrize("extra, fragment, damage, environ", [
    (["train.stepz=3"], "error: config: unknown config key 'train.stepz'", None, {}),
    (["runtime.devices=16"], "error: config: runtime.devices=16 but only 8 cpu device(s)", None, {}),
    (["model.shape.intermediate_size=96"], "holds another model", None, {}),
    ([], "cannot be read (", _corrupt_newest, {}),
    # jax.distributed.initialize in the process itself: not tried in-process
    (["runtime.distributed.enabled=true"], "error: config: runtime.distributed: joining the "
     "multi-process run failed (coordinator_address should be defined.)", None, {}),
    (["runtime.distributed.enabled=true"], "error: config: environment variable "
     "JAX_NUM_PROCESSES='abc' must be an integer >= 1", None, {"JAX_NUM_PROCESSES": "abc"}),
], ids=["unknown key", "devices", "another model", "corrupt", "distributed, no cluster",
        "JAX_NUM_PROCESSES=abc"])
def test_bad_input_from_a_shell(good_run, tmp_path, extra, fragment, damage, environ):
    """The same through `python train.py`: exit 2, exactly one line on stderr (no warnings from
    libraries at exit either), nothing written."""
    run_dir = tmp_path / "run"
    shutil.copytree(good_run, run_dir)
    if damage:
        damage(run_dir)
    before = _snapshot(run_dir)
    env = dict(os.environ, JAX_PLATFORMS="cpu", **environ)
    env["XLA_FLAGS"] = TEST_XLA_FLAGS  # tests/helpers/flags.py; the device count is the run's
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


@pytest.mark.slow
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
