"""python -m train.tools.tokenize: the same stream (and losses) as tokenizing the text at start-up, in
order across chunks, files and worker processes; a checked sidecar instead of a scan; outputs
never overwritten unasked; one-line errors."""

import json
import os

import numpy as np
import pytest

from train.config.schema import DataConfig
from train.data import DataError, Pipeline
from train.loop import run
from train.tools.tokenize import main, tokenize

from tests.helpers.trainer import compile_cache_at, tiny_config

COMPILE_CACHE = False  # tests/conftest.py: its cache test starts from an empty cache


WORDS = "the cat sat on a mat dog ran far away".split()


def _tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def _docs(n, seed):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(3, 15)))) for _ in range(n)]


def _pipe(cfg, vocab=256):
    return Pipeline(cfg, vocab_size=vocab, grad_accum=1, microbatch=4, seed=0)


@pytest.fixture
def corpus(tmp_path):
    """A directory of two .txt files and a .jsonl file (with blank lines and a BOM)."""
    src = tmp_path / "corpus"
    (src / "b").mkdir(parents=True)
    (src / "a.txt").write_text("\ufeff" + "\n".join(_docs(300, 0)) + "\n\n")
    (src / "b" / "c.jsonl").write_text(
        "\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(_docs(200, 1))) + "\n")
    (src / "b" / "d.txt").write_text("\n".join(_docs(250, 2)))
    (src / "notes.md").write_text("not part of the corpus\n")
    return src


def test_stream_equals_the_in_memory_text_path_across_chunks_and_workers(tmp_path, corpus):
    tok = _tokenizer(tmp_path)
    out = tmp_path / "train.bin"
    # small chunks: many tasks, completed out of order by 2 processes, written in order
    meta = tokenize(str(corpus), tok, str(out), eos_id=0, workers=2, chunk_bytes=2000)
    expected = []
    for name, source in (("a.txt", "text"), ("b/c.jsonl", "jsonl"), ("b/d.txt", "text")):
        cfg = DataConfig(source=source, path=str(corpus / name), tokenizer=tok, eos_id=0,
                         seq_len=8)
        expected.append(np.asarray(_pipe(cfg).source.stream))
    expected = np.concatenate(expected)
    stream = np.fromfile(out, dtype=np.uint16)
    np.testing.assert_array_equal(stream, expected)
    assert meta == json.loads((tmp_path / "train.bin.json").read_text())
    assert (meta["dtype"], meta["tokens"], meta["documents"], meta["eos_id"]) == (
        "uint16", len(expected), 750, 0)
    assert meta["max_id"] == int(expected.max()) and meta["vocab_size"] == 12
    assert meta["bytes"] == os.path.getsize(out) and len(meta["tokenizer_sha256"]) == 64
    assert sorted(os.listdir(tmp_path)) == ["corpus", "tokenizer.json", "train.bin",
                                           "train.bin.json"]  # no temporary left


@pytest.mark.slow
def test_tokenize_then_train_gives_the_text_paths_losses(tmp_path):
    tok = _tokenizer(tmp_path)
    (tmp_path / "d.txt").write_text("\n".join(_docs(400, 3)) + "\n")
    assert main([str(tmp_path / "d.txt"), "--tokenizer", tok, "-o", str(tmp_path / "t.bin"),
                 "--eos-id", "0", "--workers", "1"]) == 0
    common = ("runtime.cpu_devices=1", "train.steps=3", "data.seq_len=32", "data.pack=true",
              "data.eos_id=0")
    with compile_cache_at(tmp_path / "cache"):  # the second run reuses the first one's programs
        text = run(tiny_config(tmp_path / "text", *common, "data.source=text",
                               f"data.path={tmp_path / 'd.txt'}", f"data.tokenizer={tok}"))
        tokens = run(tiny_config(tmp_path / "tokens", *common, "data.source=tokens",
                                 f"data.path={tmp_path / 't.bin'}"))
    assert len(text["losses"]) == 3
    assert tokens["losses"] == text["losses"]  # the same ids in the same rows: exactly equal


def test_a_checked_sidecar_replaces_the_scan(tmp_path, monkeypatch):
    import train.data.pipeline

    tok = _tokenizer(tmp_path)
    (tmp_path / "d.txt").write_text("\n".join(_docs(50, 4)) + "\n")
    path = str(tmp_path / "t.bin")
    tokenize(str(tmp_path / "d.txt"), tok, path, eos_id=0, workers=1)
    cfg = DataConfig(source="tokens", path=path, seq_len=8, eos_id=0, pack=True)

    def no_scan(*args):
        raise AssertionError("scanned despite a checked sidecar")

    monkeypatch.setattr(train.data.pipeline, "_check_ids", no_scan)
    assert "checked sidecar" in _pipe(cfg).name

    def refused(cfg, vocab=256, *match):
        with pytest.raises(DataError) as info:
            _pipe(cfg, vocab)
        assert "\n" not in str(info.value)
        for m in match:
            assert m in str(info.value), str(info.value)

    refused(DataConfig(source="tokens", path=path, seq_len=8, dtype="uint32"), 256,
            "holds uint16 token ids", "data.dtype=uint32")
    refused(cfg, 10, "12-token vocabulary", "vocab_size=10")
    refused(DataConfig(source="tokens", path=path, seq_len=8, eos_id=1), 256, "data.eos_id=0")
    with open(path, "ab") as f:  # appended to after tokenization
        f.write(b"\0\0")
    refused(cfg, 256, "file changed after tokenization")
    (tmp_path / "t.bin.json").write_text("{not json")
    refused(cfg, 256, "sidecar", "cannot be read")


def test_outputs_are_kept_unless_asked_and_errors_are_one_line(tmp_path, capsys):
    tok = _tokenizer(tmp_path)
    (tmp_path / "d.txt").write_text("the cat sat\na dog ran\n")
    out = tmp_path / "t.bin"
    out.write_bytes(b"precious")
    args = [str(tmp_path / "d.txt"), "--tokenizer", tok, "-o", str(out), "--workers", "1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite" in err and out.read_bytes() == b"precious"
    # eos by name: the tokenizer's <eos>
    assert main([*args, "--overwrite"]) == 0
    assert np.fromfile(out, np.uint16).tolist() == [2, 3, 4, 0, 6, 8, 9, 0]
    capsys.readouterr()
    (tmp_path / "bad.jsonl").write_text('{"text": "the cat"}\n{"body": "sat"}\n')
    for bad, fragment in (
            ([str(tmp_path / "bad.jsonl"), "--tokenizer", tok, "-o", str(tmp_path / "b.bin")],
             "bad.jsonl:2: no string field 'text'"),
            ([str(tmp_path / "missing.txt"), "--tokenizer", tok, "-o", str(tmp_path / "b.bin")],
             "does not exist"),
            ([str(tmp_path / "d.txt"), "--tokenizer", str(tmp_path / "d.txt"), "-o",
              str(tmp_path / "b.bin")], "cannot load tokenizer")):
        assert main([*bad, "--workers", "1"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and fragment in err, err
    assert not (tmp_path / "b.bin").exists() and not (tmp_path / "b.bin.json").exists()
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "d.txt", "t.bin", "t.bin.json",
                                           "tokenizer.json"]


def test_an_export_records_the_end_of_document_id_of_the_sidecar(tmp_path):
    """data.eos_id left null on a tokenized file: the export's config.json and
    generation_config.json name the id its sidecar records (the run's documents ended with it),
    not null; a sidecar whose seal fails is not trusted for it."""
    import models
    from train.checkpoint import hf_export

    from tests.helpers.trainer import tiny_config

    tok = _tokenizer(tmp_path)
    (tmp_path / "d.txt").write_text("\n".join(_docs(50, 5)) + "\n")
    path = tmp_path / "t.bin"
    tokenize(str(tmp_path / "d.txt"), tok, str(path), eos_id=0, workers=1)
    cfg = tiny_config(tmp_path / "run", "data.source=tokens", f"data.path={path}")
    assert cfg.data.eos_id is None

    def exported_eos() -> tuple:
        export = tmp_path / "export"
        export.mkdir(exist_ok=True)
        hf_config = models.ModelConfig.preset("tiny").to_hf()  # (no bos/eos of its own)
        (export / "config.json").write_text(json.dumps(hf_config))
        hf_export.write(cfg, str(export))
        generation = json.loads((export / "generation_config.json").read_text())
        return (json.loads((export / "config.json").read_text())["eos_token_id"],
                generation.get("eos_token_id"))

    assert exported_eos() == (0, 0)
    side = json.loads((tmp_path / "t.bin.json").read_text())
    side["eos_id"] = 3  # edited by hand: the seal no longer matches
    (tmp_path / "t.bin.json").write_text(json.dumps(side))
    assert exported_eos() == (None, None)


def test_sigterm_is_one_line_and_leaves_no_temporary(tmp_path):
    """SIGTERM while the output is being written ends the command as Ctrl-C does: one line, exit
    status 128 + 15 (the trainer's), the temporaries removed. The input is a named pipe nobody
    writes to, so the command waits in its read with the temporary open."""
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers.trainer import ROOT

    src = tmp_path / "corpus"
    src.mkdir()
    os.mkfifo(src / "a.txt")
    out = tmp_path / "out" / "train.bin"
    out.parent.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "train.tools.tokenize", str(src), "--tokenizer",
         _tokenizer(tmp_path), "-o", str(out), "--workers", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list(out.parent.glob("*.tmp-*")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the command never started writing"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    lines = err.splitlines()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert len(lines) == 1 and lines[0].startswith("error: tokenize:") and "SIGTERM" in err, err
    assert os.listdir(out.parent) == []
