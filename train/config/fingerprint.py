"""A cheap fingerprint of a file, for noticing one rewritten or replaced under the same name: the
resume record (train.config.resume) and the token files' sidecars (train.data, train.tools.tokenize) use it.
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
