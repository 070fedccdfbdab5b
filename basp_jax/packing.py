"""Packing documents into rows: one document cutter and one first-fit packer.

A document of L tokens (its eos included) gives L - 1 predictions. Cut for rows of S positions
(`document_pieces` with length = S + 1 tokens), it is one piece when L <= S + 1, else pieces of
S + 1 tokens overlapping by one token (no prediction lost or repeated), its last one shorter.
A piece of n tokens takes n - 1 positions of a row as a `Piece` (inputs and their targets).

The data pipeline (train.data) cuts and first-fit packs a corpus into rows of S + 1 tokens once,
at start-up (`first_fit` with open bins); adaptive layouts (basp_jax.adaptive) take each step's
pieces and pack them once more, into the rows of the layout with the most groups that holds them
(`pack_microbatches`: `first_fit` into a fixed number of rows). Segment ids number a row's
pieces from 0; padding (token 0, target -1) is a segment of its own after them. Every (token,
target) pair keeps its position within its piece, so under causal attention within segments the
loss sum, its count and the gradients do not depend on which rows the pieces land in.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from .layout import Layout, LayoutError

OPEN_BINS = 16  # open bins of the streaming packer: more pack tighter, each piece checks all


# ------------------------------------------------------------------------------------ cutting

def document_pieces(ends: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) in tokens of the pieces of documents ending (exclusive) at `ends`, one
    after the other from 0: a document of up to `length` tokens is one piece; a longer one is
    cut into pieces of `length` overlapping by one token, its last piece shorter. Only documents
    that cannot fit are split."""
    ends = np.asarray(ends, dtype=np.int64)
    begins = np.concatenate([[0], ends[:-1]])
    sizes = ends - begins
    step = length - 1
    count = np.maximum(1, -(-(sizes - 1) // step))  # pieces per document
    first = np.repeat(np.cumsum(count) - count, count)
    k = np.arange(count.sum()) - first  # piece number within its document
    doc = np.repeat(np.arange(len(sizes)), count)
    starts = begins[doc] + k * step
    lengths = np.minimum(length, ends[doc] - starts)
    return starts, lengths


def _check_lengths(lengths: np.ndarray) -> None:
    if np.any(lengths < 2):
        raise ValueError(f"every document needs at least 2 tokens (one prediction), got lengths "
                         f"{sorted(set(lengths[lengths < 2].tolist()))}")


def piece_widths(doc_lengths: Sequence[int], seq_len: int) -> np.ndarray:
    """The widths (positions) of the pieces documents of these lengths (tokens, eos included)
    become in rows of seq_len positions, widest first."""
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    _check_lengths(lengths)
    return np.sort(document_pieces(np.cumsum(lengths), seq_len + 1)[1] - 1)[::-1]


@dataclasses.dataclass(frozen=True)
class Piece:
    """A run of positions that stays together in one row: its input tokens and their targets
    (-1: no loss), int32, equal lengths. Its width is the positions it takes in a row."""

    tokens: np.ndarray
    targets: np.ndarray

    @property
    def width(self) -> int:
        return len(self.tokens)

    @classmethod
    def of_tokens(cls, tokens: np.ndarray) -> Piece:
        """The piece of n tokens: n - 1 inputs, each predicting the next."""
        tokens = np.asarray(tokens, dtype=np.int32)
        return cls(tokens[:-1], tokens[1:])


def pieces_of_documents(documents: Sequence[np.ndarray], seq_len: int) -> list[Piece]:
    """Documents (1-D token arrays, eos included) cut into pieces for rows of seq_len positions
    (document_pieces)."""
    lengths = np.asarray([len(d) for d in documents], dtype=np.int64)
    _check_lengths(lengths)
    stream = np.concatenate([np.asarray(d, dtype=np.int32) for d in documents])
    starts, sizes = document_pieces(np.cumsum(lengths), seq_len + 1)
    return [Piece.of_tokens(stream[s:s + n]) for s, n in zip(starts, sizes)]


# ------------------------------------------------------------------------------------ packing

def first_fit(sizes: Sequence[int], capacity: int, *, rows: int | None = None,
              order: Sequence[int] | None = None) -> list[list[int]] | None:
    """Bins of item indices, each item (taken in `order`; default: largest first, ties by
    index) put into the first bin with room for it.

    rows=R: exactly R bins (a layout's rows); None when an item finds no room or is larger than
    a bin. rows=None: as many bins as it takes, OPEN_BINS of them open at a time: when no open
    bin has room the fullest is closed and the item opens a new one in its place; an item that
    fills a bin alone closes it at once. Deterministic."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if order is None:
        order = np.lexsort((np.arange(len(sizes)), -sizes))
    if len(sizes) and sizes.max() > capacity:
        return None
    opened = rows if rows is not None else OPEN_BINS
    room = np.full(opened, capacity, dtype=np.int64)
    bins: list[list[int]] = [[] for _ in range(opened)]
    closed: list[list[int]] = []
    for i in order:
        size = int(sizes[i])
        if rows is None and size == capacity:
            closed.append([int(i)])
            continue
        fits = np.flatnonzero(room >= size)
        if len(fits):
            b = int(fits[0])
        elif rows is not None:
            return None
        else:
            b = int(np.argmin(room))
            closed.append(bins[b])
            bins[b], room[b] = [], capacity
        bins[b].append(int(i))
        room[b] -= size
    if rows is not None:
        return bins
    return closed + [b for b in bins if b]


def choose_layout(doc_lengths: Sequence[int], layouts: Sequence[Layout]) -> int:
    """The index in `layouts` (a layout set, the static layout first: basp_jax.adaptive) of the
    layout with the most groups whose rows hold every document of the step whole (a document
    longer than a row rules the layout out), else 0: the static layout, where documents longer
    than S are cut (piece_widths)."""
    return _choose([piece_widths(doc_lengths, layouts[0].seq_len)], layouts)[0]


def _choose(widths: Sequence[np.ndarray], layouts: Sequence[Layout]
            ) -> tuple[int, list[list[list[int]]] | None]:
    """(index, bins of each microbatch) of the layout with the most groups into whose rows
    first_fit packs every microbatch's widths; (0, None) when only the static one is left."""
    for i in sorted(range(1, len(layouts)), key=lambda i: -layouts[i].groups):
        bins = [first_fit(w, layouts[i].seq_len, rows=layouts[i].batch) for w in widths]
        if all(b is not None for b in bins):
            return i, bins
    return 0, None


@dataclasses.dataclass(frozen=True)
class PackedStep:
    """One step's rows for one layout of the set: tokens, targets (-1: no loss) and segment ids
    [layout.batch, layout.seq_len] int32 ([accum, ...] from pack_microbatches), in the layout's
    token order (zig-zag under a ring)."""

    index: int  # in the set
    layout: Layout
    tokens: np.ndarray
    targets: np.ndarray
    segment_ids: np.ndarray

    def arrays(self) -> dict[str, np.ndarray]:
        """The batch as train.data builds it: {'tokens', 'targets', 'segment_ids'}."""
        return {"tokens": self.tokens, "targets": self.targets, "segment_ids": self.segment_ids}


def fill_rows(pieces: Sequence[Piece], bins: list[list[int]], layout: Layout, index: int = 0
              ) -> PackedStep:
    """Rows of `layout` holding pieces[bins[r]] in row r, one after the other, each its own
    segment (0, 1, ...), then padding: token 0, target -1, segment one past the row's last."""
    rows, length = layout.batch, layout.seq_len
    if len(bins) != rows:
        raise ValueError(f"{len(bins)} bins for a layout of {rows} rows")
    tokens = np.zeros((rows, length), np.int32)
    targets = np.full((rows, length), -1, np.int32)
    segs = np.zeros((rows, length), np.int32)
    for r, row in enumerate(bins):
        at = 0
        for s, p in enumerate(row):
            piece = pieces[p]
            if at + piece.width > length:
                raise ValueError(f"row {r} overflows: {at + piece.width} > {length} positions")
            tokens[r, at:at + piece.width] = piece.tokens
            targets[r, at:at + piece.width] = piece.targets
            segs[r, at:at + piece.width] = s
            at += piece.width
        segs[r, at:] = len(row)
    order = layout.token_order
    if order is not None:
        tokens, targets, segs = tokens[:, order], targets[:, order], segs[:, order]
    return PackedStep(index, layout, tokens, targets, segs)


def pack(pieces: Sequence[Piece], layout: Layout, index: int = 0) -> PackedStep | None:
    """The pieces first-fit packed (largest first) into `layout`'s rows; None when they do not
    fit."""
    bins = first_fit([p.width for p in pieces], layout.seq_len, rows=layout.batch)
    return None if bins is None else fill_rows(pieces, bins, layout, index)


def pack_step(pieces: Sequence[Piece], layouts: Sequence[Layout]) -> PackedStep:
    """A step's pieces packed into the layout with the most groups that holds them all. A
    LayoutError when not even the static layout (layouts[0]) does: the step holds more than its
    B rows of S."""
    index, bins = _choose([np.asarray([p.width for p in pieces])], layouts)
    if bins is None:
        base = layouts[0]
        packed = pack(pieces, base, 0)
        if packed is None:
            total = sum(p.width for p in pieces)
            raise LayoutError(
                f"the step's {len(pieces)} pieces ({total} positions) do not fit {base.batch} "
                f"rows of {base.seq_len}; give a step no more than the static layout holds")
        return packed
    return fill_rows(pieces, bins[0], layouts[index], index)


def pack_microbatches(rows: Sequence[Sequence[Sequence[Piece]]], layouts: Sequence[Layout]
                      ) -> PackedStep:
    """A step of microbatches, each its rows of pieces as the data pipeline packed them for the
    static layout (train.data.Pipeline.row_pieces: [accum][B] lists), packed once for one layout
    of the set, the same for every microbatch (one compiled step takes them all): the layout with
    the most groups into whose rows first_fit packs every microbatch's pieces; else the static
    layout, each row holding its own pieces. Arrays [accum, rows, S'] int32; a pure function of
    the pieces, so a resumed run (same seed and step) chooses and packs the same way."""
    micro = [[p for row in m for p in row] for m in rows]
    index, bins = _choose([np.asarray([p.width for p in m], dtype=np.int64) for m in micro],
                          layouts)
    if bins is None:  # the static layout: the pipeline's rows as they are
        bins = []
        for m in rows:
            sizes = np.cumsum([0] + [len(row) for row in m])
            bins.append([list(range(a, b)) for a, b in zip(sizes[:-1], sizes[1:])])
    filled = [fill_rows(m, b, layouts[index], index) for m, b in zip(micro, bins)]
    return PackedStep(index, layouts[index], *(np.stack([getattr(f, name) for f in filled])
                                               for name in ("tokens", "targets", "segment_ids")))
