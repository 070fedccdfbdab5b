"""A resume that would change the run's meaning: every key of train.config.resume.RULES that
changed since the checkpoint is refused with one line and exit 2, before anything compiles and
without touching run.dir or the data, unless checkpoint.allow_changed names it; then the run goes
on, says so in the log and records the change in metrics.jsonl. The data file's identity (size,
sampled sha256) is in every checkpoint, so a file replaced under the same name and size is seen;
a token file's sidecar is trusted only when its seal matches the file.

One module fixture trains (and compiles) once; the refusals run in-process on copies of it and
compile nothing; one allowed resume compiles once more.
"""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from train.config import resume
from train import cli
from train.config.schema import ConfigError
from train.loop import run

from tests.helpers.trainer import snapshot, tiny_config, tiny_overrides

COMPILE_CACHE = False  # tests/conftest.py: it counts XLA compilations

VOCAB = 256
TOKENS = 600_000  # 1.2 MB of uint16: more than the 256 KiB that sample_sha256 reads


def _stream(path, seed: int) -> None:
    np.random.default_rng(seed).integers(0, VOCAB, TOKENS, dtype=np.uint16).tofile(path)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    _stream(d / "train.bin", 0)
    _stream(d / "other.bin", 1)  # same size, other tokens
    return d


def _base(data_dir):
    # one device and no TensorBoard: what a resume checks does not depend on them, and the two
    # compilations of this file stay short
    return ("runtime.cpu_devices=1", "metrics.tensorboard=false", "train.steps=4",
            "checkpoint.every=2", "data.source=tokens", f"data.path={data_dir / 'train.bin'}")


@pytest.fixture(scope="module")
def good_run(tmp_path_factory, data_dir):
    """A run.dir stopped after 2 of 4 steps (checkpoints 1 and 2) on a token file."""
    run_dir = tmp_path_factory.mktemp("good") / "run"
    run(tiny_config(run_dir, *_base(data_dir)), stop_at=2)
    return run_dir


def _copy(good_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(good_run, run_dir)
    return run_dir


COMPILES = []  # XLA compilations seen (jax.monitoring has no way to remove a listener)
jax.monitoring.register_event_duration_secs_listener(
    lambda event, *a, **k: COMPILES.append(event) if "backend_compile" in event else None)


def _refused(capsys, argv, *watched) -> str:
    """cli.main(argv): exit 2, one stderr line, no compilation, nothing under `watched` changed."""
    before = snapshot(*watched)
    capsys.readouterr()
    jax.clear_caches()  # a program compiled by an earlier test would otherwise go unseen
    COMPILES.clear()
    status = cli.main(argv)
    compiles = list(COMPILES)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1, err
    assert not compiles, compiles
    assert snapshot(*watched) == before
    return lines[0]


@pytest.mark.slow
def test_the_checkpoint_records_what_a_resume_checks(good_run, data_dir):
    meta = json.loads((good_run / "checkpoints" / "2" / "meta" / "metadata").read_text())
    record = meta["resume"]
    assert {k for k in record if resume.rule(k) is None} == set()  # only the table's keys
    assert record["optimizer.lr"] == 0.003 and record["model.shape.vocab_size"] == VOCAB
    file = record["data.file"]
    assert file["path"] == str(data_dir / "train.bin") and file["bytes"] == 2 * TOKENS
    assert file["mtime_ns"] == os.stat(data_dir / "train.bin").st_mtime_ns
    assert len(file["sample_sha256"]) == 64


# (overrides, the one line's fragment); "{run}" and "{data}" are filled in
ON_PURPOSE = [
    (["optimizer.lr=1e-3"], "error: config: optimizer.lr=0.001 differs from the checkpoint's lr "
                            "0.003 (the learning-rate schedule); to change it on purpose add "
                            "checkpoint.allow_changed=optimizer.lr (the change is logged and "
                            "recorded in metrics.jsonl), or undo it"),
    (["optimizer.b1=0.8"], "optimizer.b1=0.8 differs from the checkpoint's b1 0.9"),
    (["optimizer.b2=0.99"], "checkpoint.allow_changed=optimizer.b2"),
    (["optimizer.weight_decay=0"], "optimizer.weight_decay=0.0 differs"),
    (["optimizer.warmup_steps=3"], "optimizer.warmup_steps=3 differs from the checkpoint's "
                                   "warmup_steps 1"),
    (["optimizer.min_lr_ratio=0.5"], "checkpoint.allow_changed=optimizer.min_lr_ratio"),
    (["optimizer.eps=1e-6"], "checkpoint.allow_changed=optimizer.eps"),
    (["optimizer.clip_norm=0.5"], "checkpoint.allow_changed=optimizer.clip_norm"),
    (["train.steps=6"], "train.steps=6 differs from the checkpoint's steps 4 (the learning-rate "
                        "schedule (it decays over train.steps))"),
    (["train.microbatch_size=2"], "checkpoint.allow_changed=train.microbatch_size"),
    (["train.grad_accum=2"], "checkpoint.allow_changed=train.grad_accum"),
    (["data.seq_len=32"], "data.seq_len=32 differs from the checkpoint's seq_len 64"),
    (["model.dtype=bfloat16"], "checkpoint.allow_changed=model.dtype"),
    # float16 adds a loss scale to the optimizer state: still the compute dtype's line, not a
    # changed optimizer's
    (["model.dtype=float16"], "error: config: model.dtype=float16 differs from the checkpoint's "
                              "dtype float32 (the compute dtype); to change it on purpose add "
                              "checkpoint.allow_changed=model.dtype"),
    (["model.shape.rope_theta=500000"], "model.shape.rope_theta=500000.0 differs from the "
                                        "checkpoint's rope_theta 10000.0 (the model's "
                                        "architecture)"),
    (["data.path={data}/other.bin"], "error: config: data.file={data}/other.bin (1200000 bytes, "
                                     "sampled sha256 "),
    (["data.source=synthetic"], "data.source=synthetic differs from the checkpoint's source "
                                "tokens (where the tokens come from), data.file=null differs"),
    (["optimizer.lr=1e-3", "optimizer.b1=0.8"],
     "; to change them on purpose add checkpoint.allow_changed=optimizer.lr,optimizer.b1"),
    (["optimizer.lr=1e-3", "optimizer.b1=0.8", "checkpoint.allow_changed=optimizer.lr"],
     "error: config: optimizer.b1=0.8 differs from the checkpoint's b1 0.9 (the update); to "
     "change it on purpose add checkpoint.allow_changed=optimizer.lr,optimizer.b1"),
]
FIXED = [
    (["optimizer.mu_dtype=bfloat16"], "error: config: optimizer.mu_dtype=bfloat16 differs from "
                                      "the checkpoint's mu_dtype float32: it decides the dtype of "
                                      "the optimizer's first moment, so it cannot change on "
                                      "resume; restore it, or use a new run.dir"),
    (["model.param_dtype=bfloat16"], "model.param_dtype=bfloat16 differs from the checkpoint's "
                                     "param_dtype float32: it decides the dtype of the "
                                     "checkpoint's parameters"),
    (["run.seed=7", "optimizer.lr=1e-3", "checkpoint.allow_changed=optimizer.lr"],
     "error: config: run.seed=7 differs from the checkpoint's seed 0: it decides the data order"),
]


@pytest.mark.parametrize("extra, fragment", ON_PURPOSE + FIXED,
                         ids=[" ".join(c[0]) for c in ON_PURPOSE + FIXED])
def test_a_changed_key_is_refused_unless_allowed(good_run, data_dir, tmp_path, capsys, extra,
                                                 fragment):
    run_dir = _copy(good_run, tmp_path)
    fill = lambda s: s.replace("{data}", str(data_dir)).replace("{run}", str(run_dir))  # noqa
    argv = tiny_overrides(run_dir, *_base(data_dir), *map(fill, extra))
    line = _refused(capsys, argv, run_dir, data_dir)
    assert fill(fragment) in line, line


def test_a_data_file_replaced_under_the_same_name_and_size_is_refused(good_run, data_dir,
                                                                      tmp_path, capsys):
    run_dir = _copy(good_run, tmp_path)
    replaced = tmp_path / "data"
    replaced.mkdir()
    _stream(replaced / "train.bin", 2)  # another corpus, the same name and size
    record = json.loads((run_dir / "checkpoints" / "2" / "meta" / "metadata").read_text())
    argv = tiny_overrides(run_dir, *_base(data_dir)[:-1], f"data.path={replaced / 'train.bin'}")
    # the checkpoint was written for data_dir/train.bin: make it name this one, as if replaced
    record["resume"]["data.file"]["path"] = str(replaced / "train.bin")
    (run_dir / "checkpoints" / "2" / "meta" / "metadata").write_text(json.dumps(record))
    line = _refused(capsys, argv, run_dir, replaced)
    assert line.startswith(f"error: config: data.file={replaced}/train.bin (1200000 bytes, "
                           "sampled sha256 "), line
    assert f"differs from the checkpoint's file {replaced}/train.bin (1200000 bytes" in line
    assert "checkpoint.allow_changed=data.file" in line


def test_a_damaged_record_is_a_damaged_checkpoint(good_run, data_dir, tmp_path, capsys):
    run_dir = _copy(good_run, tmp_path)
    path = run_dir / "checkpoints" / "2" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    meta["resume"] = []
    path.write_text(json.dumps(meta))
    line = _refused(capsys, tiny_overrides(run_dir, *_base(data_dir)), run_dir, data_dir)
    assert line.startswith(f"error: checkpoint: checkpoint {run_dir}/checkpoints/2 cannot be read "
                           "(ValueError: meta resume holds list, not an object)"), line


@pytest.mark.slow
def test_allowed_changes_go_on_are_logged_and_recorded(good_run, data_dir, tmp_path, capsys):
    """lr and the data file changed on purpose: the run resumes at step 2, says what changed,
    records it in the first metrics.jsonl line after the checkpoint; its checkpoints then hold
    the new values, so the same command again has nothing to allow."""
    run_dir = _copy(good_run, tmp_path)
    changed = ("optimizer.lr=1e-3", f"data.path={data_dir / 'other.bin'}",
               "checkpoint.allow_changed=optimizer.lr,data.file")
    capsys.readouterr()
    assert cli.main(tiny_overrides(run_dir, *_base(data_dir), *changed)) == 0
    err = capsys.readouterr().err
    assert (f"resumed with changes (checkpoint.allow_changed): optimizer.lr 0.003 -> 0.001, "
            f"data.file {data_dir}/train.bin (1200000 bytes") in err, err
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert "changed" not in records[1] and "changed" not in records[3]
    assert records[2]["changed"]["optimizer.lr"] == {"from": 0.003, "to": 0.001}
    assert records[2]["changed"]["data.file"]["to"]["path"] == str(data_dir / "other.bin")
    meta = json.loads((run_dir / "checkpoints" / "4" / "meta" / "metadata").read_text())
    assert meta["resume"]["optimizer.lr"] == 0.001
    # the new values are the checkpoint's now: without the flag nothing differs
    assert cli.main(tiny_overrides(run_dir, *_base(data_dir), *changed[:2])) == 0
    assert "already holds step 4 of 4" in capsys.readouterr().out


@pytest.mark.slow
def test_a_compute_dtype_changed_to_float16_and_back_resumes(good_run, data_dir, tmp_path,
                                                             capsys):
    """checkpoint.allow_changed=model.dtype, float32 -> float16: float16 keeps its loss scale in
    the optimizer state, which the checkpoint lacks; the run resumes with a fresh one (2**15 in
    metrics.jsonl from the first resumed step). Back to float32 the checkpoint's scale is
    dropped on restore (train.program.state restores without compiling)."""
    from train.prepare import check
    from train.program.state import build_state
    from train.program.step import LossScaleState

    run_dir = _copy(good_run, tmp_path)
    to16 = ("model.dtype=float16", "checkpoint.allow_changed=model.dtype")
    assert cli.main(tiny_overrides(run_dir, *_base(data_dir), *to16)) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("loss_scale") for r in records] == [None, None, 2.0**15, 2.0**15]
    assert records[2]["changed"]["model.dtype"] == {"from": "float32", "to": "float16"}
    assert all(np.isfinite(r["loss"]) and not r["skipped"] for r in records)

    back = tiny_config(run_dir, *_base(data_dir), "train.steps=6",
                       "checkpoint.allow_changed=model.dtype,train.steps")
    checked = check(back, is_writer=False)
    restored = build_state(checked.cfg, checked.mcfg, checked.plan, run_dir=checked.run_dir,
                           latest=checked.latest, saved_dtype=checked.saved_dtype)
    try:
        assert checked.changes["model.dtype"] == ("float16", "float32")
        assert restored.start == 4
        state = restored.opt_state
        assert not any(isinstance(s, LossScaleState) for s in state)
        assert jax.tree.structure(state) == \
            jax.tree.structure(restored.program.abstract_opt_state)
    finally:
        restored.ckpt.close()


# ------------------------------------------------------------------ a token file's sidecar

@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    """t.bin and its sealed sidecar, from train.tools.tokenize with a word tokenizer of 12 ids."""
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers

    from train.tools.tokenize import tokenize

    d = tmp_path_factory.mktemp("tokenized")
    words = ["<eos>", "[UNK]"] + [f"w{i}" for i in range(10)]
    tok = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "d.txt").write_text("".join(f"w{i % 10} w{(i * 7) % 10} w3\n" for i in range(400)))
    tokenize(str(d / "d.txt"), str(d / "tokenizer.json"), str(d / "t.bin"), eos_id=0, workers=1,
             progress=False)
    return d


def _sealed_copy(tokenized, tmp_path):
    for name in ("t.bin", "t.bin.json"):
        shutil.copy(tokenized / name, tmp_path / name)
    return tmp_path / "t.bin"


def test_a_file_changed_under_its_sidecar_is_scanned_and_refused(tokenized, tmp_path, capsys):
    """Ids beyond the vocabulary written into the file in place (same size): the sidecar's seal
    no longer matches, so every id is scanned and the bad one named."""
    path = _sealed_copy(tokenized, tmp_path)
    ids = np.fromfile(path, np.uint16)
    ids[5] = 300
    ids.tofile(path)
    run_dir = tmp_path / "run"
    line = _refused(capsys, tiny_overrides(run_dir, "data.source=tokens", f"data.path={path}"),
                    tmp_path)
    assert line == (f"error: data: {path}: token id 300 at position 5 is outside the model's "
                    "vocabulary [0, 256); the data was tokenized for another model"), line
    assert not run_dir.exists()


def test_a_sidecar_whose_claims_were_edited_is_not_trusted(tokenized, tmp_path, monkeypatch):
    """A sidecar claiming a smaller largest id (or any other edit) fails its seal: the file is
    scanned as if it had no sidecar; an untouched one replaces the scan."""
    import train.data.pipeline
    from train.config.schema import DataConfig
    from train.data import Pipeline

    path = _sealed_copy(tokenized, tmp_path)
    cfg = DataConfig(source="tokens", path=str(path), seq_len=8, eos_id=0)
    scans = []
    monkeypatch.setattr(train.data.pipeline, "_check_ids", lambda *a: scans.append(a[2]))

    def pipe():
        return Pipeline(cfg, vocab_size=VOCAB, grad_accum=1, microbatch=2, seed=0)

    assert "checked sidecar" in pipe().name and scans == []
    side = json.loads((tmp_path / "t.bin.json").read_text())
    assert side["max_id"] == 11
    side["max_id"] = 3
    (tmp_path / "t.bin.json").write_text(json.dumps(side))
    assert "every id scanned: its sidecar's seal does not match the file" in pipe().name
    assert scans == [str(path)]


def test_every_key_of_the_table_is_documented():
    """configs/README.md lists what a resume checks; a key added to RULES must be added there."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "configs" / "README.md").read_text()
    for key in resume.RULES:
        names = (f"`{key}*`",) if key.endswith(".") else (f"`{key}`", f"`{key.split('.')[-1]}`")
        assert any(n in text for n in names), key


def test_a_mixed_file_replaced_under_the_same_name_and_size_is_refused(tmp_path):
    """data.mix's paths and weights are recorded, and each file's contents as data.mix_files."""
    for name, seed in (("a.bin", 0), ("b.bin", 1)):
        _stream(tmp_path / name, seed)
    mix = (f"data.mix={{{tmp_path}/a.bin: 3, {tmp_path}/b.bin: 1}}", "data.source=tokens")
    cfg = tiny_config(tmp_path / "run", *mix)
    saved = resume.record(cfg, {})
    assert [f["path"] for f in saved["data.mix_files"]] == [str(tmp_path / "a.bin"),
                                                           str(tmp_path / "b.bin")]
    assert resume.check(saved, resume.record(cfg, {}), []) == {}  # unchanged: resumes
    _stream(tmp_path / "b.bin", 2)  # another corpus, the same name and size
    with pytest.raises(ConfigError) as e:
        resume.check(saved, resume.record(cfg, {}), [])
    line = str(e.value)
    assert line.startswith(f"data.mix_files=[{tmp_path}/a.bin (1200000 bytes"), line
    assert "checkpoint.allow_changed=data.mix_files" in line and "\n" not in line
    assert set(resume.check(saved, resume.record(cfg, {}), ["data.mix_files"])) == \
        {"data.mix_files"}


def test_changed_synthetic_documents_are_refused_unless_allowed(tmp_path):
    """data.documents draws the synthetic documents' lengths: longtail -> full is another run."""
    docs = ("data.pack=true", "data.documents=longtail")
    saved = resume.record(tiny_config(tmp_path / "run", *docs), {})
    changed = resume.record(tiny_config(tmp_path / "run", *docs, "data.documents=full"), {})
    with pytest.raises(ConfigError) as e:
        resume.check(saved, changed, [])
    line = str(e.value)
    assert line.startswith("data.documents=full differs from the checkpoint's documents "
                           "longtail"), line
    assert "checkpoint.allow_changed=data.documents" in line
    assert resume.check(saved, changed, ["data.documents"]) == {
        "data.documents": ("longtail", "full")}


def test_every_data_key_is_in_the_table():
    """Each data.* key decides the tokens a step trains on: it is in RULES, or the file it names
    is (data.path as data.file, data.tokenizer as data.tokenizer_file, data.mix's files as
    data.mix_files beside data.mix)."""
    import dataclasses

    from train.config.schema import DataConfig

    by_contents = {"path": "data.file", "tokenizer": "data.tokenizer_file"}
    for field in dataclasses.fields(DataConfig):
        key = by_contents.get(field.name, f"data.{field.name}")
        assert resume.rule(key) is not None, key


@pytest.mark.slow
def test_fp8_turned_on_resumes_with_nothing_to_allow_and_streams(good_run, data_dir, tmp_path,
                                                                  capsys):
    """model.fp8 has no state (current scaling, models.fp8): a run checkpointed without it
    resumes with it, under the streamed optimizer step too, with nothing to allow, and its losses
    go on from the checkpoint's."""
    run_dir = _copy(good_run, tmp_path)
    before = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    capsys.readouterr()
    assert cli.main(tiny_overrides(run_dir, *_base(data_dir), "model.fp8=true",
                                   "optimizer.offload=true", "model.remat=offload")) == 0
    err = capsys.readouterr().err
    assert "FP8 projections (model.fp8)" in err and "resumed with changes" not in err, err
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[:2] == before[:2]
    assert all(np.isfinite(r["loss"]) and not r["skipped"] and "changed" not in r
               for r in records[2:])
