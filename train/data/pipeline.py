"""Training batches: synthetic tokens, token files, or tokenized text / JSONL, one step at a time.

The batch of step t is [grad_accum, microbatch, seq_len] and a pure function of (seed, t): global
row r = a * microbatch + b of step t is row g = t * grad_accum * microbatch + r of an endless
sequence of seeded epochs (train.data.sources, on Grain), so any process builds exactly the rows its
devices hold and nothing else, and a resumed run continues from step t with the same rows (the
checkpoint's step is the whole iterator state). Sources:

    synthetic   a fixed random Markov chain over the vocabulary (learnable: the loss falls to the
                chain's entropy), `branching` successors per token; rows keyed (seed, t, r)
    tokens      one long stream in a .bin (raw uint16/uint32) or .npy file, memory-mapped, or
                several mixed by weight (data.mix); an epoch visits every window of seq_len + 1
                tokens (consecutive windows share one token) once, in a seeded order. A .bin
                written by `python -m train.tools.tokenize` has a sidecar FILE.json that is checked
                instead of scanning every id at start-up
    text/jsonl  documents (non-empty lines / the `text_key` field of each JSON line) tokenized with
                a local tokenizer.json, joined with eos_id into one stream

With pack=true, documents end at eos_id and an epoch visits every document once: they are
first-fit packed into rows (split only when longer than a row) and padded; each row gets segment
ids (a token attends only within its document, positions restart) and no prediction crosses a
document boundary. The next step's batch is built on a background thread while a step runs
(global_batch(..., prefetch=...)).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
from typing import Callable

import numpy as np

from basp_jax.packing import Piece

from ..config.schema import DataConfig
from ..config.fingerprint import sample_sha256
from . import sources
from .synthetic import MarkovSource


class DataError(ValueError):
    """Data that cannot be used as configured; the message is one line."""


class StreamSource:
    """Held-out evaluation rows: consecutive windows from the start of one token stream, so
    every evaluation sees the same tokens, each once."""

    def __init__(self, stream: np.ndarray, num_rows: int, name: str):
        self.stream = stream
        self.num_rows = num_rows
        self.name = name

    def rows(self, step: int, row_ids: np.ndarray, length: int) -> np.ndarray:
        n = len(self.stream)
        if n < length:
            raise DataError(
                f"{self.name} holds {n} tokens, fewer than one row of seq_len+1={length}"
            )
        offsets = (step * self.num_rows + np.arange(self.num_rows)) * (length - 1)
        if offsets[-1] + length > n:
            raise DataError(
                f"{self.name} holds {n} tokens, fewer than the {offsets[-1] + length} that "
                f"{self.num_rows} consecutive rows of seq_len={length - 1} need; use a longer "
                "file or fewer rows (eval.batches)")
        out = np.stack([np.asarray(self.stream[o : o + length]) for o in offsets[row_ids]])
        return out.astype(np.int64)


def _check_file(path: str, what: str) -> None:
    if not os.path.exists(path):
        raise DataError(f"{what} {path!r} does not exist")
    if not os.path.isfile(path):
        raise DataError(f"{what} {path!r} is not a regular file")
    if not os.access(path, os.R_OK):
        raise DataError(f"{what} {path!r} is not readable (check its permissions)")


def check_files(cfg: DataConfig) -> None:
    """The files the training data reads exist, with the messages opening them gives: checked
    before anything else reads them (train.prepare records their identity for resuming)."""
    if cfg.source == "synthetic":
        return
    for path in (list(cfg.mix) if cfg.mix else [cfg.path]):
        if cfg.source == "tokens":
            _check_file(path, "token file")
        else:  # tokenized here: the tokenizer is opened first (_tokenize)
            _check_file(cfg.tokenizer, "tokenizer file")
            _check_file(path, "data file")


def _load_token_file(path: str, dtype: str) -> np.ndarray:
    _check_file(path, "token file")
    if path.endswith(".npy"):
        try:
            arr = np.load(path, mmap_mode="r")
        except (ValueError, EOFError, OSError) as e:  # not .npy, empty, truncated
            raise DataError(f"cannot read {path!r} as .npy: {str(e).splitlines()[0]}") from None
        if arr.ndim != 1 or arr.dtype not in (np.uint16, np.uint32, np.int32, np.int64):
            raise DataError(
                f"{path!r} must hold one 1-D stream of uint16/uint32 token ids, got "
                f"{arr.dtype} of shape {arr.shape}"
            )
        return arr
    size = os.path.getsize(path)
    itemsize = np.dtype(dtype).itemsize
    if size == 0:  # (numpy cannot even map an empty file)
        raise DataError(f"token file {path!r} is empty; tokenize a corpus into it "
                        "(python -m train.tools.tokenize) or point data.path at another file")
    if size % itemsize:
        raise DataError(f"{path!r} has {size} bytes, not a multiple of {dtype} ({itemsize} bytes)")
    return np.memmap(path, dtype=dtype, mode="r")


def parse_lines(path: str, source: str, first: int, lines, text_key: str) -> list[str]:
    """The documents of raw lines (bytes) numbered from `first`: non-empty lines (text) or their
    JSON objects' `text_key` field (jsonl). Shared with train.tools.tokenize, so both read alike."""
    docs = []
    for lineno, raw in enumerate(lines, first):  # decoded line by line, so an error names its line
        try:
            line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # drop a leading BOM
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{lineno}: not UTF-8 text ({e.reason})") from None
        if not line.strip():
            continue
        if source == "text":
            docs.append(line.rstrip("\r\n"))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        except RecursionError:  # arrays or objects nested thousands deep
            raise DataError(f"{path}:{lineno}: JSON nested too deeply to read") from None
        if not isinstance(obj, dict) or not isinstance(obj.get(text_key), str):
            raise DataError(f"{path}:{lineno}: no string field {text_key!r}")
        docs.append(obj[text_key])
    return docs


def _read_documents(path: str, source: str, text_key: str) -> list[str]:
    _check_file(path, "data file")
    with open(path, "rb") as f:
        docs = parse_lines(path, source, 1, f, text_key)
    if not docs:
        raise DataError(f"{path!r} holds no documents")
    return docs


def _tokenize(cfg: DataConfig, vocab_size: int) -> np.ndarray:
    from tokenizers import Tokenizer

    _check_file(cfg.tokenizer, "tokenizer file")
    try:
        tok = Tokenizer.from_file(cfg.tokenizer)
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise DataError(f"cannot load tokenizer {cfg.tokenizer!r}: {str(e).splitlines()[0]}") from None
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise DataError(
            f"tokenizer {cfg.tokenizer!r} has {size} tokens, more than the model's "
            f"vocab_size={vocab_size}; use the model's own tokenizer"
        )
    docs = _read_documents(cfg.path, cfg.source, cfg.text_key)
    ids = []
    try:
        encoded = tok.encode_batch(docs, add_special_tokens=False)
    except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception, e.g. no [UNK])
        detail = " ".join(str(e).split())[:200] or type(e).__name__
        raise DataError(f"tokenizer {cfg.tokenizer!r} loads but cannot encode the documents of "
                        f"{cfg.path!r} ({detail}); use a tokenizer whose vocabulary covers them "
                        "(e.g. one with an unknown-token entry)") from None
    for enc in encoded:
        ids.extend(enc.ids)
        ids.append(cfg.eos_id)
    return np.asarray(ids, dtype=np.uint32)


def _check_ids(stream: np.ndarray, vocab_size: int, name: str, chunk: int = 1 << 26) -> None:
    """Every id of a token stream lies in [0, vocab_size): one pass over the file at start-up
    (chunked, memory-mapped), so a file tokenized for another model stops the run before anything
    compiles rather than at the step that happens to draw a bad id. Skipped when the element type
    cannot hold an id that large."""
    if np.issubdtype(stream.dtype, np.unsignedinteger) and np.iinfo(stream.dtype).max < vocab_size:
        return
    for start in range(0, len(stream), chunk):
        block = np.asarray(stream[start:start + chunk])
        bad = (block >= vocab_size) | (block < 0)
        if bad.any():
            i = int(np.argmax(bad))
            raise DataError(
                f"{name}: token id {int(block[i])} at position {start + i} is outside the model's "
                f"vocabulary [0, {vocab_size}); the data was tokenized for another model"
            )


SIDECAR_FORMAT = "basp-jax tokens"  # written by train.tools.tokenize next to the file, as FILE.json
# the sidecar's claims its seal covers: a hand-edited value no longer matches
SIDECAR_CLAIMS = ("dtype", "tokens", "bytes", "max_id", "vocab_size", "eos_id")


def sidecar_seal(path: str, meta: dict) -> str:
    """What train.tools.tokenize stores as the sidecar's sample_sha256: its claims and a sample of
    the token file, hashed together."""
    claims = json.dumps({k: meta.get(k) for k in SIDECAR_CLAIMS}, sort_keys=True)
    return sample_sha256(path, claims.encode())


def checked_sidecar(path: str, cfg: DataConfig, vocab_size: int) -> dict | None:
    """The sidecar train.tools.tokenize wrote for token file `path` (None: it has none), after checking
    it against the file (byte size) and the run (data.dtype, data.eos_id, the model's vocabulary).
    Its claims are trusted only when its seal (sample_sha256: the claims and a sample of the file)
    matches: then it replaces the scan of every id (_check_ids) and start-up reads 256 KiB of
    data; a sidecar edited by hand, an older one without a seal or a file changed in place under
    it gives None, and the file is scanned as if it had none."""
    side = path + ".json"
    if path.endswith(".npy") or not os.path.isfile(side):
        return None
    _check_file(path, "token file")
    fix = "re-run python -m train.tools.tokenize (or delete the sidecar to have the file scanned)"
    try:
        with open(side) as f:
            meta = json.load(f)
        if meta.get("format") != SIDECAR_FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, not {SIDECAR_FORMAT!r}")
        dtype, tokens, size = meta["dtype"], meta["tokens"], meta["bytes"]
        vocab, eos, top = meta["vocab_size"], meta["eos_id"], meta["max_id"]
        if dtype not in ("uint16", "uint32") or not all(
                isinstance(v, int) for v in (tokens, size, vocab, eos, top)):
            raise ValueError("a field has the wrong type")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise DataError(f"token file sidecar {side!r} cannot be read ({type(e).__name__}: "
                        f"{' '.join(str(e).split())}); {fix}") from None
    if dtype != cfg.dtype:
        raise DataError(f"{path!r} holds {dtype} token ids (its sidecar says) but data.dtype="
                        f"{cfg.dtype}; set data.dtype={dtype}")
    found = os.path.getsize(path)
    if found != size or size != tokens * np.dtype(dtype).itemsize:
        raise DataError(f"{path!r} has {found} bytes but its sidecar records {tokens} {dtype} "
                        f"tokens ({size} bytes): the file changed after tokenization; {fix}")
    if meta.get("sample_sha256") != sidecar_seal(path, meta):
        return None  # edited by hand, or the file changed (or an older sidecar): scan every id
    if vocab > vocab_size or top >= vocab_size:
        raise DataError(f"{path!r} was tokenized with a {vocab}-token vocabulary (largest id "
                        f"{top}), more than the model's vocab_size={vocab_size}; tokenize with "
                        f"the model's own tokenizer, or (a model trained from scratch) give the "
                        f"model that vocabulary: model.shape={{vocab_size: {vocab}}}")
    if cfg.eos_id is not None and cfg.eos_id != eos:
        raise DataError(f"data.eos_id={cfg.eos_id} but the documents of {path!r} end with id "
                        f"{eos} (its sidecar says); set data.eos_id={eos}")
    return meta


class Pipeline:
    """Builds the rows of each step for this process; `global_batch` places them on the mesh.

    held_out=True gives evaluation rows (train.observe.evaluate): consecutive windows from the start of a
    file, or synthetic rows no training step draws; its errors start with "eval: "."""

    def __init__(self, cfg: DataConfig, *, vocab_size: int, grad_accum: int, microbatch: int,
                 seed: int, pad_rows: int = 0, seq_order=None, held_out: bool = False):
        try:
            self._open(cfg, vocab_size, grad_accum, microbatch, seed, pad_rows, seq_order,
                       held_out)
        except DataError as e:
            if not held_out:
                raise
            raise DataError(f"eval: {e}") from None

    def _open(self, cfg: DataConfig, vocab_size: int, grad_accum: int, microbatch: int,
              seed: int, pad_rows: int, seq_order, held_out: bool) -> None:
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.accum = grad_accum
        self.batch = microbatch
        # Masked rows appended to each microbatch when the layout needs more rows than the data
        # gives (e.g. B=3 on 8 devices padded to 4 rows for 4 groups): token 0, target -1, so they
        # add nothing to the loss, its token count or the gradients.
        self.pad_rows = pad_rows
        # A permutation of the sequence axis applied to every row (zig-zag ring attention);
        # tokens, targets and segment ids move together, so every (token, target) pair is kept.
        self.seq_order = seq_order
        self.seq_len = cfg.seq_len
        self.num_rows = grad_accum * microbatch
        self.pack = cfg.pack
        self.eos_id = cfg.eos_id
        if cfg.eos_id is not None and cfg.eos_id >= vocab_size:
            raise DataError(
                f"data.eos_id={cfg.eos_id} is not below the model's vocab_size={vocab_size}"
            )
        self.held_out = held_out
        self.epochs = None  # global row index -> (source, row): train.data.sources
        if cfg.source == "synthetic":
            self.source = MarkovSource(vocab_size, cfg.branching, seed, held_out, cfg.documents)
            self.name = f"synthetic Markov chain (branching {cfg.branching})" + (
                f", {cfg.documents} documents" if cfg.documents else "")
        else:
            if not held_out and (why := sources.grain_missing()):  # before reading any file
                raise DataError(f"data.source={cfg.source} reads its rows through grain, which "
                                f"cannot be imported ({why}): pip install grain")
            paths = [cfg.path] if held_out or not cfg.mix else list(cfg.mix)
            streams, names = [], []
            for path in paths:
                stream, how = self._stream(cfg, path, vocab_size)
                streams.append(stream)
                names.append(f"{path} ({len(stream):,} tokens{how})")
            if held_out:
                self.source = StreamSource(streams[0], self.num_rows, paths[0])
            else:
                self.sources = [self._rows_of(s, p, seed) for s, p in zip(streams, paths)]
                weights = [float(cfg.mix[p]) for p in paths] if cfg.mix else None
                self.epochs = sources.epochs(self.sources, weights, seed)
                names = [f"{n}: {s.count:,} {'packed rows' if self.pack else 'windows'}"
                         + (f", weight {w:g}" if weights else "")
                         for n, s, w in zip(names, self.sources, weights or [None] * len(paths))]
                self.source = self.sources[0]
            self.name = "; ".join(names)
        self._prefetch = None  # (step, future) of the batch built in the background
        self._pool = None
        # Fail now, not at step 0 of a compiled run, when the stream is too short.
        self.rows(0, np.arange(1))

    def _stream(self, cfg: DataConfig, path: str, vocab_size: int) -> tuple[np.ndarray, str]:
        """One source's checked token stream and how it was checked."""
        if cfg.source == "tokens":
            sidecar = checked_sidecar(path, cfg, vocab_size)
            stream = _load_token_file(path, cfg.dtype)
            if sidecar is None:  # no record of its ids that can be trusted: scan them all
                _check_ids(stream, vocab_size, path)
            how = (", checked sidecar" if sidecar else ", every id scanned: its sidecar's seal "
                   "does not match the file" if os.path.isfile(path + ".json") else "")
            return stream, how
        stream = _tokenize(dataclasses.replace(cfg, path=path), vocab_size)
        _check_ids(stream, vocab_size, f"{path} tokenized with {cfg.tokenizer}")
        return stream, " after tokenization"

    def _rows_of(self, stream: np.ndarray, path: str, seed: int):
        length = self.seq_len + 1
        if len(stream) < length and not self.pack:
            raise DataError(f"{path} holds {len(stream)} tokens, fewer than one row of "
                            f"seq_len+1={length}")
        if self.pack:
            rows = sources.Packed(stream, length, self.eos_id, seed)
        else:
            rows = sources.Windows(stream, length)
        if rows.count == 0:
            raise DataError(f"{path} holds {len(stream)} tokens: no row of seq_len+1={length}")
        if self.pack and not (rows.lengths > 1).any():  # every row all padding and lone tokens
            raise DataError(
                f"{path} holds {len(stream)} tokens in {rows.documents} document(s) of one token "
                f"each (data.eos_id={self.eos_id} ends them): packed rows hold nothing to predict; "
                "use a file of longer documents, or the right data.eos_id")
        return rows

    @property
    def documents_per_row(self) -> int | None:
        """The most documents (and a padding run) any packed training row holds, known from the
        start-up packing; None where that is not known ahead (windows, synthetic or held-out
        rows)."""
        if not self.pack or self.held_out or self.cfg.source == "synthetic":
            return None
        return max(s.documents_per_row for s in self.sources)

    def rows(self, step: int, row_ids: np.ndarray) -> dict[str, np.ndarray]:
        """tokens, targets (-1: no loss) and segment_ids [len(row_ids), seq_len] int32."""
        row_ids = np.asarray(row_ids)
        seg = None
        if isinstance(self.source, MarkovSource) and self.source.doc_lengths:
            raw, seg = self.source.document_rows(step, row_ids, self.seq_len + 1)
        elif self.epochs is None:
            raw = self.source.rows(step, row_ids, self.seq_len + 1)  # ids checked at start-up
        else:
            drawn = [self.sources[k].row(i) for k, i in
                     (self.epochs[step * self.num_rows + int(r)] for r in row_ids)]
            raw = np.stack([d[0] for d in drawn])
            if self.pack:
                seg = np.stack([d[1] for d in drawn])
        tokens, targets = raw[:, :-1], raw[:, 1:].copy()
        if seg is not None:  # packed documents: segments given, -1 padding
            targets[(seg[:, 1:] != seg[:, :-1]) | (seg[:, 1:] < 0)] = -1
            # padding: a segment of its own after the row's last document
            seg = np.where(seg < 0, seg.max(axis=1, keepdims=True) + 1, seg)
            segment_ids = seg[:, :-1]
        elif self.pack:
            is_eos = raw == self.eos_id
            # a token's document = number of eos strictly before it; eos ends its own document
            seg = np.concatenate(
                [np.zeros((len(raw), 1), np.int64), np.cumsum(is_eos, axis=1)[:, :-1]], axis=1
            )
            targets[seg[:, 1:] != seg[:, :-1]] = -1  # no prediction across a document boundary
            segment_ids = seg[:, :-1]
        else:
            segment_ids = np.zeros_like(tokens)
        out = {
            "tokens": tokens.astype(np.int32),
            "targets": targets.astype(np.int32),
            "segment_ids": segment_ids.astype(np.int32),
        }
        if self.seq_order is not None:
            out = {name: x[:, self.seq_order] for name, x in out.items()}
        return out

    def row_pieces(self, step: int, row_ids: np.ndarray) -> list[list[Piece]]:
        """Each row's documents (or cuts of one) as the start-up packing put them in the row,
        each a piece of inputs and targets (packed data: data.pack=true): what adaptive layouts
        pack into their own rows (basp_jax.packing.pack_microbatches), no row built first. A
        piece of one token (no prediction) is left out. The same predictions as `rows`."""
        if not self.pack:
            raise DataError("row pieces need packed documents (data.pack=true)")
        length = self.seq_len + 1
        if isinstance(self.source, MarkovSource) and self.source.doc_lengths:
            docs = self.source.documents(step, np.asarray(row_ids), length)
        elif self.epochs is None:  # synthetic rows: documents end at each eos
            docs = [np.split(raw, np.flatnonzero(raw[:-1] == self.eos_id) + 1)
                    for raw in self.source.rows(step, np.asarray(row_ids), length)]
        else:
            docs = [self.sources[k].row_tokens(i) for k, i in
                    (self.epochs[step * self.num_rows + int(r)] for r in row_ids)]
        return [[Piece.of_tokens(d) for d in row if len(d) > 1] for row in docs]

    def global_batch(self, step: int, sharding, prefetch: bool = False) -> dict:
        """The step's [accum, B + pad_rows, S] arrays on `sharding`; this process builds only its
        rows (pad rows are made on the spot). prefetch=True then starts building step + 1's on a
        background thread, so the next call finds it ready (off the step's critical path)."""
        ahead, self._prefetch = self._prefetch, None
        batch = ahead[1].result() if ahead and ahead[0] == step else self._build(step, sharding)
        if prefetch:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, "basp-data")
            self._prefetch = (step + 1, self._pool.submit(self._build, step + 1, sharding))
        return batch

    def close(self) -> None:
        """Ends the prefetch thread (a batch being built is dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool, self._prefetch = None, None

    def row_ids(self, index_map: dict) -> np.ndarray:
        """The global rows that the devices of index_map (device -> index into the step's
        [accum, B + pad_rows, S] batch; a process's addressable devices) hold, pad rows left out."""
        rows_per_micro = self.batch + self.pad_rows
        wanted = set()
        for index in index_map.values():
            a_range = range(*index[0].indices(self.accum))
            b_range = range(*index[1].indices(rows_per_micro))
            wanted.update(a * self.batch + b for a in a_range for b in b_range if b < self.batch)
        return np.array(sorted(wanted), dtype=np.int64)

    def _build(self, step: int, sharding) -> dict:
        import jax

        rows_per_micro = self.batch + self.pad_rows
        shape = (self.accum, rows_per_micro, self.seq_len)
        row_ids = self.row_ids(sharding.addressable_devices_indices_map(shape))
        local = self.rows(step, row_ids)
        position = {int(r): i for i, r in enumerate(row_ids)}
        fill = {"tokens": 0, "targets": -1, "segment_ids": 0}

        def make(name: str) -> Callable:
            data = local[name]

            def callback(index):
                a_range = range(*index[0].indices(self.accum))
                b_range = range(*index[1].indices(rows_per_micro))
                out = np.full((len(a_range), len(b_range), self.seq_len), fill[name], np.int32)
                for i, a in enumerate(a_range):
                    for j, b in enumerate(b_range):
                        if b < self.batch:
                            out[i, j] = data[position[a * self.batch + b]]
                return out[..., index[2]]

            return callback

        names = ("tokens", "targets", "segment_ids") if self.pack else ("tokens", "targets")
        return {n: jax.make_array_from_callback(shape, sharding, make(n)) for n in names}
