"""Data: deterministic rows from (seed, step), token files, tokenized text, packing, vocab checks."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from train.config.schema import DataConfig
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


def _documents(tmp_path, lengths, name="d.bin"):
    """A token file of documents numbered 1.., document d being (len - 1) tokens d then eos 0."""
    stream = np.concatenate([np.r_[np.full(n - 1, d + 1), 0] for d, n in enumerate(lengths)])
    stream.astype(np.uint16).tofile(tmp_path / name)
    return str(tmp_path / name)


def _epoch(p, count=None):
    """The rows of the first epoch (one source: global rows 0 .. rows per epoch - 1)."""
    return p.rows(0, np.arange(count or p.source.count))


def test_packing_never_splits_a_document_that_fits(tmp_path):
    rng = np.random.default_rng(1)
    lengths = rng.integers(2, 12, size=60).tolist() + [13, 40, 75]  # S+1=13 fits; 40, 75 do not
    path = _documents(tmp_path, lengths)
    p = _pipe(DataConfig(source="tokens", path=path, seq_len=12, pack=True, eos_id=0),
              vocab=1024)
    r = _epoch(p)
    seen = {}  # document -> [(tokens it holds, predictions it makes)] over the epoch
    for tok, tgt, seg in zip(r["tokens"], r["targets"], r["segment_ids"]):
        raw = np.r_[tok, -2]  # (the row's last target stands for its last raw token)
        for s in np.unique(seg):
            where = np.flatnonzero(seg == s)
            assert (np.diff(where) == 1).all()  # a segment is contiguous
            doc = int(tok[where[0]])
            if doc == 0:  # padding: no prediction
                assert (tgt[where] == -1).all()
                continue
            inside = tgt[where][tgt[where] >= 0]
            assert (inside == np.r_[raw[where[1:]], tgt[where[-1]]][tgt[where] >= 0]).all()
            seen.setdefault(doc, []).append((len(where), len(inside)))
    for d, n in enumerate(lengths, 1):
        if n <= 13:  # whole, in one row, once: n - 1 predictions (eos predicts nothing)
            assert len(seen[d]) == 1 and seen[d][0][1] == n - 1, (d, n, seen[d])
        else:  # split only because it must be: every prediction made once
            assert sum(k for _, k in seen[d]) == n - 1, d
    assert p.source.count < len(lengths)  # rows hold several documents


def test_packed_eos_and_padding_masks(tmp_path):
    path = _documents(tmp_path, [4, 6] * 10)
    p = _pipe(DataConfig(source="tokens", path=path, seq_len=12, pack=True, eos_id=0))
    r = _epoch(p)
    for tok, tgt, seg in zip(r["tokens"], r["targets"], r["segment_ids"]):
        for i in range(len(tok) - 1):
            if seg[i + 1] != seg[i]:
                assert tgt[i] == -1 and seg[i + 1] == seg[i] + 1  # segments count up
            else:
                assert tgt[i] == (tok[i + 1] if tok[i] else -1)  # eos/padding: no prediction


def test_documents_per_row_is_the_most_runs_any_row_holds(tmp_path):
    """The bound the trainer sizes cuDNN's packed layout by: no row of the epoch holds more
    runs of segment ids (documents, cuts, padding), and one holds that many."""
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    path = _documents(tmp_path, rng.integers(2, 9, size=80).tolist() + [30])
    p = _pipe(DataConfig(source="tokens", path=path, seq_len=24, pack=True, eos_id=0),
              vocab=1024)
    seg = _epoch(p)["segment_ids"]
    runs = 1 + np.sum(seg[:, 1:] != seg[:, :-1], axis=1)
    assert p.documents_per_row >= runs.max() >= p.documents_per_row - 1, (seed, runs)
    assert _pipe(DataConfig(source="synthetic", seq_len=24)).documents_per_row is None
    windows = _pipe(DataConfig(source="tokens", path=path, seq_len=24, eos_id=0), vocab=1024)
    assert windows.documents_per_row is None


def test_one_epoch_visits_every_window_exactly_once(tmp_path):
    np.arange(1001, dtype=np.uint16).tofile(tmp_path / "t.bin")
    p = _pipe(DataConfig(source="tokens", path=str(tmp_path / "t.bin"), seq_len=10), vocab=2048)
    assert p.source.count == 100
    steps = [p.rows(t, np.arange(8))["tokens"] for t in range(25)]  # 200 rows: two epochs
    firsts = np.concatenate(steps)[:, 0]
    first, second = firsts[:100], firsts[100:]
    assert sorted(first) == sorted(second) == list(range(0, 1000, 10))
    assert not np.array_equal(first, second)  # each epoch its own order
    assert not np.array_equal(first, np.sort(first))  # shuffled
    other = _pipe(DataConfig(source="tokens", path=str(tmp_path / "t.bin"), seq_len=10),
                  vocab=2048, seed=1)
    assert not np.array_equal(other.rows(0, np.arange(8))["tokens"], steps[0])


def test_resumed_mid_epoch_gives_the_same_batches(tmp_path):
    """A run stopped at step 7 (of 12-step epochs) and resumed builds the batches it would have
    built: a new Pipeline (as a restarted process makes) needs only the step."""
    devices = np.asarray(jax.devices()[:8]).reshape(2, 4)
    sharding = NamedSharding(Mesh(devices, ("group", "seq")), P(None, "group", "seq"))
    path = _documents(tmp_path, np.random.default_rng(0).integers(2, 20, 300).tolist())
    cfg = DataConfig(source="tokens", path=path, seq_len=16, pack=True, eos_id=0)
    first = _pipe(cfg, vocab=1024)
    through = [first.global_batch(t, sharding, prefetch=True) for t in range(12)]
    first.close()
    resumed = _pipe(cfg, vocab=1024)
    again = [resumed.global_batch(t, sharding, prefetch=True) for t in range(7, 12)]
    resumed.close()
    for a, b in zip(through[7:], again):
        for name in ("tokens", "targets", "segment_ids"):
            np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))
    assert not np.array_equal(np.asarray(through[7]["tokens"]), np.asarray(through[8]["tokens"]))


def test_two_processes_read_disjoint_rows(tmp_path):
    np.arange(2001, dtype=np.uint16).tofile(tmp_path / "t.bin")
    p = _pipe(DataConfig(source="tokens", path=str(tmp_path / "t.bin"), seq_len=12), vocab=4096)
    devices = np.asarray(jax.devices()[:8]).reshape(2, 4)
    sharding = NamedSharding(Mesh(devices, ("group", "seq")), P(None, "group", "seq"))
    index_map = sharding.devices_indices_map((2, 4, 12))
    # two processes of 4 devices each, as jax.distributed would place them
    hosts = [{d: i for d, i in index_map.items() if d.id // 4 == k} for k in (0, 1)]
    ids = [p.row_ids(h) for h in hosts]
    assert len(ids[0]) == len(ids[1]) == 4 and not set(ids[0]) & set(ids[1])
    assert sorted(np.r_[ids[0], ids[1]]) == list(range(8))
    full = p.rows(3, np.arange(8))["tokens"]
    for rows in ids:  # what each process builds is its part of the one global batch
        np.testing.assert_array_equal(p.rows(3, rows)["tokens"], full[rows])


def test_mixture_weights_are_respected(tmp_path):
    np.full(4001, 1, dtype=np.uint16).tofile(tmp_path / "a.bin")
    np.full(2001, 2, dtype=np.uint16).tofile(tmp_path / "b.bin")
    mix = {str(tmp_path / "a.bin"): 3, str(tmp_path / "b.bin"): 1}
    p = _pipe(DataConfig(source="tokens", mix=mix, seq_len=10), accum=1, micro=8)
    rows = np.concatenate([p.rows(t, np.arange(8))["tokens"][:, 0] for t in range(100)])
    assert abs((rows == 1).mean() - 0.75) < 0.02
    assert "weight 3" in p.name and "weight 1" in p.name
    # each source runs its own epochs: the first 200 rows of b are its 200 windows, once each
    b = [i for k, i in (p.epochs[g] for g in range(1200)) if k == 1]
    assert len(b) > 200 and sorted(b[:200]) == list(range(200))


@pytest.mark.parametrize("cfg, fragment", [
    (dict(source="tokens", path="a.bin", mix={"b.bin": 1}), "data.path and data.mix are both set"),
    (dict(source="text", mix={"b.bin": 1}, tokenizer="t.json", eos_id=0),
     "data.mix mixes token files: it needs data.source=tokens"),
    (dict(source="tokens", mix={"b.bin": 0}), "weight of 'b.bin' must be a positive number"),
    (dict(source="tokens", mix={"b.txt": 1}), "token files must end in .bin or .npy"),
])
def test_bad_mixtures_are_one_line_errors(cfg, fragment):
    from train.config.schema import ConfigError

    with pytest.raises(ConfigError, match=fragment):
        DataConfig(seq_len=8, **cfg).validate()


def test_prefetch_builds_the_next_batch_off_the_calling_thread(monkeypatch):
    import threading

    devices = np.asarray(jax.devices()[:8]).reshape(2, 4)
    sharding = NamedSharding(Mesh(devices, ("group", "seq")), P(None, "group", "seq"))
    p = _pipe(DataConfig(source="synthetic", seq_len=16))
    built, build = [], p._build
    monkeypatch.setattr(p, "_build", lambda t, s: built.append(
        (t, threading.current_thread() is threading.main_thread())) or build(t, s))
    a = p.global_batch(0, sharding, prefetch=True)
    b = p.global_batch(1, sharding, prefetch=False)  # the one built in the background
    p.close()
    assert built == [(0, True), (1, False)]
    np.testing.assert_array_equal(np.asarray(b["tokens"]), p.rows(1, np.arange(8))["tokens"]
                                  .reshape(2, 4, 16))
    assert not np.array_equal(np.asarray(a["tokens"]), np.asarray(b["tokens"]))


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


def test_mixture_paths_expand_the_home_directory(tmp_path, monkeypatch):
    from train.config.schema import load_config

    monkeypatch.setenv("HOME", str(tmp_path))
    from tests.helpers.trainer import tiny_overrides

    cfg = load_config(None, tiny_overrides(tmp_path / "r", "data.source=tokens",
                                           "data.mix={~/a.bin: 2, ~/b.bin: 1}"))
    assert cfg.data.mix == {str(tmp_path / "a.bin"): 2, str(tmp_path / "b.bin"): 1}


@pytest.mark.slow
@pytest.mark.usefixtures("compile_cache")  # its runs share one compile
def test_a_run_on_a_mixture_stopped_mid_epoch_resumes_to_the_same_losses(tmp_path):
    """Two token files mixed 3:1 (epochs of 31 and 15 windows, 4 rows a step): stopped after
    step 3 of 5 and resumed, the run trains on the batches of an uninterrupted one (the tiny
    config's program: compiled once per test session)."""
    from tests.helpers.trainer import tiny_config
    from train.loop import run

    rng = np.random.default_rng(0)
    rng.integers(0, 256, 2000).astype(np.uint16).tofile(tmp_path / "a.bin")
    rng.integers(0, 256, 1000).astype(np.uint16).tofile(tmp_path / "b.bin")
    data = ("data.source=tokens", f"data.mix={{{tmp_path}/a.bin: 3, {tmp_path}/b.bin: 1}}")
    first = run(tiny_config(tmp_path / "cut", *data), stop_at=3)
    second = run(tiny_config(tmp_path / "cut", *data))
    straight = run(tiny_config(tmp_path / "straight", *data))
    assert second["start_step"] == 3
    assert first["losses"] + second["losses"] == straight["losses"]
