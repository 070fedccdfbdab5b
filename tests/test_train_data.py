"""Data: deterministic rows from (seed, step), token files, tokenized text, packing, vocab checks."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from train.config import DataConfig
from train.data import DataError, Pipeline


def _pipe(cfg, vocab=256, accum=2, micro=4, seed=0):
    return Pipeline(cfg, vocab_size=vocab, grad_accum=accum, microbatch=micro, seed=seed)


def test_synthetic_rows_are_a_function_of_seed_step_row():
    p = _pipe(DataConfig(source="synthetic", seq_len=32))
    a = p.rows(3, np.arange(8))
    b = p.rows(3, np.array([5, 1]))
    np.testing.assert_array_equal(b["tokens"], a["tokens"][[5, 1]])
    assert not np.array_equal(p.rows(4, np.arange(8))["tokens"], a["tokens"])
    np.testing.assert_array_equal(a["targets"][:, :-1], a["tokens"][:, 1:])
    other_seed = _pipe(DataConfig(source="synthetic", seq_len=32), seed=1)
    assert not np.array_equal(other_seed.rows(3, np.arange(8))["tokens"], a["tokens"])


def test_synthetic_chain_is_learnable():
    p = _pipe(DataConfig(source="synthetic", seq_len=256, branching=4))
    rows = p.rows(0, np.arange(8))["tokens"]
    # every transition is one of the token's 4 successors
    for row in rows:
        for x, y in zip(row[:-1], row[1:]):
            assert y in p.source.table[x]
    assert p.source.entropy < np.log(4)


def test_token_files_bin_and_npy(tmp_path):
    stream = np.arange(1000, dtype=np.uint16) % 200
    stream.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", stream.astype(np.uint32))
    a = _pipe(DataConfig(source="tokens", path=str(tmp_path / "t.bin"), seq_len=16))
    b = _pipe(DataConfig(source="tokens", path=str(tmp_path / "t.npy"), seq_len=16))
    ra, rb = a.rows(7, np.arange(8)), b.rows(7, np.arange(8))
    np.testing.assert_array_equal(ra["tokens"], rb["tokens"])
    # windows of the stream: consecutive values mod 200
    diffs = (ra["tokens"][:, 1:].astype(int) - ra["tokens"][:, :-1]) % 200
    assert (diffs == 1).all()
    np.testing.assert_array_equal(ra["targets"][:, :-1], ra["tokens"][:, 1:])


def test_token_id_beyond_vocab_is_an_error(tmp_path):
    np.full(100, 300, dtype=np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(DataError, match="outside the model's vocabulary"):
        _pipe(DataConfig(source="tokens", path=str(tmp_path / "t.bin"), seq_len=16))


def test_too_short_stream_is_an_error(tmp_path):
    np.zeros(10, dtype=np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(DataError, match="fewer than one row"):
        _pipe(DataConfig(source="tokens", path=str(tmp_path / "t.bin"), seq_len=16))


def test_packing_segments_and_masks(tmp_path):
    # documents of lengths 3, 5, ... separated by eos=0
    stream = np.array([1, 2, 3, 0, 4, 5, 6, 7, 8, 0] * 20, dtype=np.uint16)
    stream.tofile(tmp_path / "t.bin")
    p = _pipe(DataConfig(source="tokens", path=str(tmp_path / "t.bin"), seq_len=12, pack=True,
                         eos_id=0))
    r = p.rows(0, np.arange(8))
    for tok, tgt, seg in zip(r["tokens"], r["targets"], r["segment_ids"]):
        for i in range(len(tok)):
            next_is_new_doc = tok[i] == 0
            assert (tgt[i] == -1) == next_is_new_doc
            if i and tok[i - 1] == 0:
                assert seg[i] == seg[i - 1] + 1
            elif i:
                assert seg[i] == seg[i - 1]


def _tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": 0, "[UNK]": 1}
    for w in "the cat sat on a mat dog ran far away".split():
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_text_and_jsonl_tokenize_the_same(tmp_path):
    docs = ["the cat sat on a mat", "a dog ran far away", "the dog sat"] * 5
    (tmp_path / "d.txt").write_text("\n".join(docs) + "\n")
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    tok = _tokenizer(tmp_path)
    cfg = dict(tokenizer=tok, eos_id=0, seq_len=8, pack=True)
    a = _pipe(DataConfig(source="text", path=str(tmp_path / "d.txt"), **cfg))
    b = _pipe(DataConfig(source="jsonl", path=str(tmp_path / "d.jsonl"), **cfg))
    np.testing.assert_array_equal(a.source.stream, b.source.stream)
    assert a.source.stream[:7].tolist() == [2, 3, 4, 5, 6, 7, 0]
    with pytest.raises(DataError, match="vocab_size"):
        _pipe(DataConfig(source="text", path=str(tmp_path / "d.txt"), **cfg), vocab=5)


def test_global_batch_places_rows_on_the_mesh():
    devices = np.asarray(jax.devices()[:8]).reshape(2, 4)
    mesh = Mesh(devices, ("group", "seq"))
    sharding = NamedSharding(mesh, P(None, "group", "seq"))
    p = _pipe(DataConfig(source="synthetic", seq_len=16), accum=2, micro=4)
    batch = p.global_batch(5, sharding)
    full = p.rows(5, np.arange(8))
    assert batch["tokens"].shape == (2, 4, 16) and batch["tokens"].sharding == sharding
    np.testing.assert_array_equal(np.asarray(batch["tokens"]), full["tokens"].reshape(2, 4, 16))
    np.testing.assert_array_equal(np.asarray(batch["targets"]), full["targets"].reshape(2, 4, 16))
