"""Epochs over token files on Grain: windows or packed documents, shuffled without replacement.

Each source is a finite list of rows (windows of one stream, or bins of first-fit packed
documents). `epochs(sources, weights, seed)` turns them into one grain MapDataset indexed by a
global row number: `.shuffle(seed)` permutes a source's rows, `.repeat()` runs epoch after epoch
(grain reshuffles each epoch with seed + epoch) and `MapDataset.mix` interleaves several sources
by weight. The row of global index g is a pure function of (seed, g), computed by grain's index
arithmetic without reading the rows before it: step t's rows are g = t * rows_per_step + r, so a
resumed run needs only the step (which the checkpoint holds), and a process reads only its rows.

Why not grain's FirstFitPackIterDataset: it is an IterDataset (its position is iterator state,
checkpointed and restored per process), which would lose the (seed, step) -> batch property; the
packing here is planned once, at start-up, from the documents' lengths (basp_jax.packing:
the one cutter and first-fit packer, which adaptive layouts use too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from basp_jax.packing import document_pieces, first_fit

if TYPE_CHECKING:
    import grain


class Windows:
    """Rows of C = seq_len + 1 tokens of one stream, starting every seq_len tokens (a row's last
    token is the next one's first: its target), the tail shorter than a row left out."""

    def __init__(self, stream: np.ndarray, length: int):
        self.stream, self.length = stream, length
        self.count = (len(stream) - 1) // (length - 1)

    def row(self, i: int) -> tuple[np.ndarray, None]:
        start = i * (self.length - 1)
        return np.asarray(self.stream[start:start + self.length], dtype=np.int64), None


class Packed:
    """Rows of whole documents (documents end with eos_id, which they keep), first-fit packed
    into `length` tokens and padded; segment ids number the documents of a row, -1 the padding.
    The packing is planned once from the lengths, in an order shuffled by the seed."""

    def __init__(self, stream: np.ndarray, length: int, eos_id: int, seed: int,
                 chunk: int = 1 << 26):
        self.stream, self.length = stream, length
        ends = [start + np.flatnonzero(np.asarray(stream[start:start + chunk]) == eos_id) + 1
                for start in range(0, len(stream), chunk)]
        ends = np.concatenate(ends + [np.array([len(stream)])]).astype(np.int64)
        ends = np.unique(ends[ends > 0])  # (a stream ending in eos has no empty last document)
        self.documents = len(ends)
        self.starts, self.lengths = document_pieces(ends, length)
        order = np.random.default_rng([seed, 0xFAC]).permutation(len(self.starts))
        bins = first_fit(self.lengths, length, order=order)
        self.offsets = np.cumsum([0] + [len(b) for b in bins])
        self.pieces = np.fromiter((p for b in bins for p in b), dtype=np.int64)
        self.count = len(bins)

    @property
    def documents_per_row(self) -> int:
        """The most runs of segment ids a row holds: its documents (or cuts of them), and its
        padding where the documents leave any."""
        widths = self.lengths[self.pieces]
        counts = np.diff(self.offsets)
        filled = np.add.reduceat(widths, self.offsets[:-1]) if len(widths) else np.zeros(0)
        return int(np.max(counts + (filled < self.length))) if self.count else 1

    def row_tokens(self, i: int) -> list[np.ndarray]:
        """The pieces of row i, each its tokens (a document or a cut of one), in row order."""
        return [np.asarray(self.stream[s:s + n], dtype=np.int64) for s, n in
                ((int(self.starts[p]), int(self.lengths[p]))
                 for p in self.pieces[self.offsets[i]:self.offsets[i + 1]])]

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return row_of(self.row_tokens(i), self.length)


def row_of(pieces: list[np.ndarray], length: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, segment ids) of one row of `length`: the pieces one after the other, segment ids
    numbering them, then padding (token 0, segment -1)."""
    raw = np.zeros(length, dtype=np.int64)
    seg = np.full(length, -1, dtype=np.int64)
    at = 0
    for s, tokens in enumerate(pieces):
        raw[at:at + len(tokens)] = tokens
        seg[at:at + len(tokens)] = s
        at += len(tokens)
    return raw, seg


def grain_missing() -> str | None:
    """Why grain cannot be imported, or None. It is imported only where it is used, so
    synthetic data trains without it (a GPU image may lack it)."""
    try:
        import grain  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def epochs(sources: list, weights: list[float] | None, seed: int) -> grain.MapDataset:
    """The global row index -> (source number, row number) of endless seeded epochs; with several
    sources, mixed by weight (grain keeps each source's own epochs)."""
    import grain  # Pipeline checked it first (grain_missing)

    parts = [grain.MapDataset.range(src.count).shuffle(seed=(seed + 7919 * k) % 2**32).repeat()
             .map(lambda i, k=k: (k, int(i))) for k, src in enumerate(sources)]
    if len(parts) == 1:
        return parts[0]
    return grain.MapDataset.mix(parts, weights=weights)
