"""Tokenize a corpus once into the token file `data.source=tokens` reads, with a checked sidecar.

    python -m train.tools.tokenize INPUT --tokenizer tokenizer.json -o train.bin
        [--text-key text] [--eos-id N] [--workers K] [--overwrite]

INPUT is a .txt file (one document per non-empty line), a .jsonl file (one JSON object per line,
the document in --text-key) or a directory (its *.txt and *.jsonl files, recursively, in sorted
path order). Documents are read exactly as `data.source=text|jsonl` reads them and each is followed
by the eos id, so training on the output equals training on the text.

Streaming: the input is read in chunks of lines, tokenized in K worker processes, and written in
document order as results arrive, with a bounded number of chunks in flight (constant memory
however large the corpus). The stream is uint16 when every id fits, else uint32. Next to it,
OUTPUT.json records dtype, token count, byte size, the largest id, vocabulary size, eos id, the
tokenizer's sha256, the sources and a seal (sample_sha256: the claims and a sample of the file
hashed together); the trainer checks it instead of scanning the file at start, and scans the
file when the seal does not match.
Both files are written to temporary names and renamed into place, so a failed or interrupted run
leaves no half-written output, and an existing output is kept unless --overwrite is given.

Exit status 0 on success, 2 with one line on stderr for bad input, 128 + the signal with one line
after Ctrl-C (SIGINT) or SIGTERM (nothing written, temporaries removed).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import multiprocessing
import os
import signal
import sys
import threading

import numpy as np

from ..config import paths
from ..data import DataError, parse_lines, sidecar_seal

FORMAT = "basp-jax tokens"
SIDECAR_SUFFIX = ".json"
CHUNK_BYTES = 4 << 20  # lines per task: ~4 MiB of text, a few seconds of one worker
MAX_WORKERS = 256  # processes; each holds a tokenizer
MAX_ID = 2**32 - 1  # the largest id a uint32 stream holds
EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>")


class TokenizeError(ValueError):
    """Input that cannot be tokenized as asked; the message is one line."""


def sidecar_path(path: str) -> str:
    return path + SIDECAR_SUFFIX


# ---- reading: chunks of raw lines, parsed in the workers ----------------------------------------


def input_files(path: str) -> list[tuple[str, str]]:
    """(file, 'text' | 'jsonl') of every input file, in the order their documents are written."""
    if os.path.isdir(path):
        found = []
        for root, dirs, files in os.walk(path):
            dirs.sort()
            found += [os.path.join(root, f) for f in files if f.endswith((".txt", ".jsonl"))]
        if not found:
            raise TokenizeError(f"directory {path!r} holds no .txt or .jsonl files")
        return [(f, "jsonl" if f.endswith(".jsonl") else "text") for f in sorted(found)]
    if not os.path.isfile(path):
        raise TokenizeError(f"input {path!r} does not exist")
    return [(path, "jsonl" if path.endswith(".jsonl") else "text")]


def _chunks(files, chunk_bytes: int):
    """(file, kind, first line number, [raw lines]) of about chunk_bytes each, in order."""
    for path, kind in files:
        try:
            f = open(path, "rb")
        except OSError as e:
            raise TokenizeError(f"cannot read {path!r}: {e.strerror}") from None
        with f:
            lines, size, first = [], 0, 1
            for lineno, raw in enumerate(f, 1):
                lines.append(raw)
                size += len(raw)
                if size >= chunk_bytes:
                    yield path, kind, first, lines
                    lines, size, first = [], 0, lineno + 1
            if lines:
                yield path, kind, first, lines


# ---- the workers ---------------------------------------------------------------------------------

_worker: dict = {}


def _init_worker(tokenizer_path: str, text_key: str, eos_id: int, dtype: str) -> None:
    from tokenizers import Tokenizer

    _worker.update(tok=Tokenizer.from_file(tokenizer_path), text_key=text_key, eos_id=eos_id,
                   dtype=np.dtype(dtype))


def _encode(task) -> tuple[int, bytes, int, int, int, str | None]:
    """(input bytes, token bytes, tokens, documents, largest id, error line or None) of a chunk."""
    path, kind, first, lines = task
    size = sum(map(len, lines))
    try:
        docs = parse_lines(path, kind, first, lines, _worker["text_key"])
    except DataError as e:
        return size, b"", 0, 0, -1, str(e)
    ids = []
    try:
        encoded = _worker["tok"].encode_batch(docs, add_special_tokens=False)
    except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception, e.g. no [UNK])
        return size, b"", 0, 0, -1, encode_failure(path, first, e)
    for enc in encoded:
        ids.extend(enc.ids)
        ids.append(_worker["eos_id"])
    arr = np.asarray(ids, dtype=np.int64)
    top = int(arr.max()) if len(arr) else -1
    if top > np.iinfo(_worker["dtype"]).max:
        return size, b"", 0, 0, top, f"token id {top} does not fit {_worker['dtype'].name}"
    return size, arr.astype(_worker["dtype"]).tobytes(), len(arr), len(docs), top, None


def encode_failure(path: str, first: int, err: Exception) -> str:
    """The one line for a tokenizer that loaded but cannot encode these documents."""
    detail = " ".join(str(err).split())[:200] or type(err).__name__
    return (f"the tokenizer cannot encode the documents of {path} from line {first} ({detail}); "
            "use a tokenizer whose vocabulary covers them (e.g. one with an unknown-token entry)")


def _run_tasks(tasks, workers: int, init_args):
    """Results of _encode over tasks, in order; at most 2 * workers tasks in flight."""
    if workers == 1:
        _init_worker(*init_args)
        yield from map(_encode, tasks)
        return
    # spawn: the tokenizers library's own thread pool does not survive a fork
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=init_args) as pool:
        pending = collections.deque()
        for task in tasks:
            pending.append(pool.apply_async(_encode, (task,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# ---- the command ---------------------------------------------------------------------------------


def _load_tokenizer(path: str):
    from models.tokenizer import load_tokenizer

    return load_tokenizer(path, TokenizeError)


def default_eos(tok) -> int:
    """The id of the tokenizer's end-of-text token, when it has one of the usual names."""
    for name in EOS_NAMES:
        found = tok.token_to_id(name)
        if found is not None:
            return found
    raise TokenizeError("the tokenizer has no end-of-text token of a known name "
                        f"({', '.join(EOS_NAMES)}); pass --eos-id N")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_output(output: str, *, overwrite: bool, workers: int) -> None:
    """-o names a new (or, with overwrite, a replaceable) .bin file in an existing directory."""
    if output.endswith(".npy"):
        raise TokenizeError(f"-o {output!r}: the output is a raw .bin stream, not .npy")
    for path in (output, sidecar_path(output)):
        if os.path.exists(path) and not overwrite:
            raise TokenizeError(f"{path!r} exists; pass --overwrite to replace it")
        if os.path.exists(path) and not os.path.isfile(path):
            raise TokenizeError(f"{path!r} exists and is not a file; choose another -o")
    out_dir = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(out_dir):
        raise TokenizeError(f"the directory of -o {output!r} does not exist")
    if not 1 <= workers <= MAX_WORKERS:
        raise TokenizeError(f"--workers must lie in [1, {MAX_WORKERS}] (processes), got {workers}")


def _check_apart(input_path: str, files: list[tuple[str, str]], tokenizer: str,
                 output: str) -> None:
    """The output and its sidecar are none of the files read (same path, symlink or hard link:
    --overwrite would replace the corpus), and no later run would read the output as input."""
    written = [("-o", output), ("the sidecar", sidecar_path(output))]
    read = [("the input", f) for f, _ in files] + [("--tokenizer", tokenizer)]
    try:
        paths.check_apart(written, read, why={"-o": "the output replaces that file",
                                              "the sidecar": "the sidecar replaces that file"})
    except paths.PathError as e:
        raise TokenizeError(str(e)) from None
    if (os.path.isdir(input_path) and output.endswith((".txt", ".jsonl"))
            and paths.relation(output, input_path) == "inside"):
        raise TokenizeError(f"-o {output!r} lies inside the input directory {input_path!r} and "
                            "ends in .txt/.jsonl: a later run would read the token file as text; "
                            "name it .bin or write it elsewhere")


def tokenize(input_path: str, tokenizer: str, output: str, *, text_key: str = "text",
             eos_id: int | None = None, workers: int = 1, overwrite: bool = False,
             progress: bool | None = None, chunk_bytes: int = CHUNK_BYTES) -> dict:
    """Write `output` and its sidecar (see the module docstring); returns the sidecar's dict."""
    from tqdm import tqdm

    try:  # `--tokenizer=~/t.json` reaches us unexpanded; URLs are not read
        input_path, tokenizer, output = (paths.local(key, value) for key, value in (
            ("the input", input_path), ("--tokenizer", tokenizer), ("-o", output)))
    except paths.PathError as e:
        raise TokenizeError(str(e)) from None
    files = input_files(input_path)
    _check_apart(input_path, files, tokenizer, output)
    _check_output(output, overwrite=overwrite, workers=workers)
    tok = _load_tokenizer(tokenizer)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eos_id = default_eos(tok) if eos_id is None else eos_id
    if not 0 <= eos_id <= MAX_ID:
        raise TokenizeError(f"--eos-id must be a token id in [0, {MAX_ID}] (uint32), got {eos_id}")
    # uint16 when every id the tokenizer (and eos) can produce fits
    dtype = "uint16" if max(vocab_size, eos_id + 1) <= 1 << 16 else "uint32"
    total_bytes = sum(os.path.getsize(f) for f, _ in files)
    tmp = f"{output}.tmp-{os.getpid()}"
    tmp_side = f"{sidecar_path(output)}.tmp-{os.getpid()}"
    tokens = docs = 0
    top = -1
    try:
        with open(tmp, "wb") as out, tqdm(total=total_bytes, unit="B", unit_scale=True,
                                          desc="tokenize", disable=None if progress is None
                                          else not progress) as bar:
            # closing: an error stops the worker processes now, not when the traceback is freed
            results = contextlib.closing(_run_tasks(_chunks(files, chunk_bytes), workers,
                                                    (tokenizer, text_key, eos_id, dtype)))
            with results as chunks:
                for size, data, n, d, t, error in chunks:
                    if error:
                        raise TokenizeError(error)
                    out.write(data)
                    tokens, docs, top = tokens + n, docs + d, max(top, t)
                    bar.update(size)
        if not docs:
            raise TokenizeError(f"{input_path!r} holds no documents")
        meta = {
            "format": FORMAT, "version": 1, "dtype": dtype, "tokens": tokens,
            "bytes": tokens * np.dtype(dtype).itemsize, "documents": docs, "max_id": top,
            "vocab_size": vocab_size, "eos_id": eos_id,
            "tokenizer": os.path.abspath(tokenizer), "tokenizer_sha256": _sha256(tokenizer),
            "text_key": text_key, "sources": [os.path.abspath(f) for f, _ in files],
        }
        meta["sample_sha256"] = sidecar_seal(tmp, meta)  # the trainer trusts the claims by it
        with open(tmp_side, "w") as f:
            json.dump(meta, f, indent=1)
        # the old sidecar goes first: a crash between the renames leaves a token file without
        # one (trainer: checks the ids itself), never a new file under the old description
        if os.path.exists(sidecar_path(output)):
            os.remove(sidecar_path(output))
        os.replace(tmp, output)
        os.replace(tmp_side, sidecar_path(output))
    finally:
        for path in (tmp, tmp_side):
            if os.path.exists(path):
                os.remove(path)
    return meta


class _Parser(argparse.ArgumentParser):
    """argparse whose errors (e.g. --workers abc) are one line and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"error: tokenize: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m train.tools.tokenize",
        description="Tokenize a .txt/.jsonl file or a directory of them into a token file "
                    "(uint16/uint32) with a sidecar the trainer checks (data.source=tokens).")
    p.add_argument("input", help=".txt (a document per line), .jsonl, or a directory of them")
    p.add_argument("--tokenizer", required=True, help="a local tokenizer.json")
    p.add_argument("-o", "--output", required=True, help="the token file to write, e.g. train.bin")
    p.add_argument("--text-key", default="text", help="jsonl: the field holding each document")
    p.add_argument("--eos-id", type=int, default=None,
                   help="id appended after each document (default: the tokenizer's end-of-text)")
    p.add_argument("--workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) - 1)),
                   help="tokenizing processes (default: CPUs - 1, at most 8)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    return p


class Terminated(BaseException):
    """SIGTERM arrived: unwinds like Ctrl-C's KeyboardInterrupt, so the temporaries are removed."""


def _terminated(signum, frame):
    signal.signal(signum, signal.SIG_IGN)  # a second one must not cut the clean-up short
    raise Terminated()


@contextlib.contextmanager
def _sigterm_like_ctrl_c():
    """SIGTERM (a scheduler's or `kill`'s) ends the command as Ctrl-C does, in the main thread
    only (where Python delivers signals); the previous handler afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        with _sigterm_like_ctrl_c():
            meta = tokenize(args.input, args.tokenizer, args.output, text_key=args.text_key,
                            eos_id=args.eos_id, workers=args.workers, overwrite=args.overwrite)
    except (TokenizeError, DataError) as e:
        print(f"error: tokenize: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. a full disk or an unwritable directory; temporaries are removed
        print(f"error: tokenize: {e.filename or args.output}: {e.strerror or e}",
              file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated) as e:  # the trainer's status: 128 + the signal
        sig = signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.SIGTERM
        print(f"error: tokenize: interrupted ({sig.name}); nothing was written", file=sys.stderr)
        return 128 + sig
    print(f"wrote {args.output}: {meta['tokens']:,} tokens ({meta['dtype']}) from "
          f"{meta['documents']:,} documents, eos_id {meta['eos_id']}, vocabulary "
          f"{meta['vocab_size']:,}; train with data.source=tokens data.path={args.output} "
          f"data.dtype={meta['dtype']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
