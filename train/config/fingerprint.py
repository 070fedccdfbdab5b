"""A cheap fingerprint of a file, for noticing one rewritten or replaced under the same name: the
resume record (train.config.resume) and the token files' sidecars (train.data,
train.tools.tokenize) use it; hf_fingerprint does the same for a Hugging Face model directory
(train.process.agreement).
"""

from __future__ import annotations

import hashlib
import os

SAMPLE_BLOCKS, SAMPLE_BLOCK = 64, 4096  # sample_sha256 reads at most 256 KiB of a file


def sample_sha256(path: str, extra: bytes = b"") -> str:
    """sha256 of `extra`, the file's size and SAMPLE_BLOCKS blocks spread evenly over it (the
    whole file when it is smaller): a cheap fingerprint that a file rewritten or replaced under
    the same name and size fails to match, unless the change misses every sampled block."""
    size = os.path.getsize(path)
    digest = hashlib.sha256(extra + b"%d\n" % size)
    with open(path, "rb") as f:
        if size <= SAMPLE_BLOCKS * SAMPLE_BLOCK:
            digest.update(f.read())
        else:  # first and last block included
            stride = (size - SAMPLE_BLOCK) / (SAMPLE_BLOCKS - 1)
            for i in range(SAMPLE_BLOCKS):
                f.seek(int(i * stride))
                digest.update(f.read(SAMPLE_BLOCK))
    return digest.hexdigest()


def hf_fingerprint(path: str, weights: bool = True) -> dict:
    """{'files', 'bytes', 'sample_sha256'} of what a run reads in a Hugging Face directory:
    config.json and (weights) the safetensors files and their index, each by name, size and
    sample_sha256 (at most 256 KiB read a file: a few MB for a model of many shards). Another
    copy of the same model matches; other weights of the same shape do not. OSError when the
    directory or a file cannot be read."""
    names = sorted(name for name in os.listdir(path) if name == "config.json" or (
        weights and name.endswith((".safetensors", ".safetensors.index.json"))))
    digest = hashlib.sha256()
    total = 0
    for name in names:
        file = os.path.join(path, name)
        size = os.path.getsize(file)
        total += size
        digest.update(b"%s\n%s\n" % (os.fsencode(name), sample_sha256(file).encode()))
    return {"files": len(names), "bytes": total, "sample_sha256": digest.hexdigest()}
