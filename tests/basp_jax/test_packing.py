"""Packing documents into a layout's rows (basp_jax.packing): the one cutter, the one first-fit
packer, and the data pipeline's documents packed once for the layout a step chooses."""

import collections

import numpy as np
import pytest

from basp_jax import LayoutError, packing
from basp_jax.adaptive import layout_set
from basp_jax.packing import Piece
from tests.helpers.documents import EXACT_WIDTHS, SET_WIDTHS, documents

N, HOST = 8, 4  # devices, devices per emulated host
S = 128  # the static layout's row: 1 row of 128 tokens on (1, 8)
HEADS, KV = 8, 2


def _set(**kwargs):
    return layout_set(N, 1, S, HEADS, KV, devices_per_host=HOST, **kwargs)


def _live(tokens, targets, segment_ids, order=None):
    """The multiset of (token, target, position in its segment) of every prediction."""
    if order is not None:
        back = np.argsort(order)
        tokens, targets, segment_ids = tokens[:, back], targets[:, back], segment_ids[:, back]
    out = collections.Counter()
    for tok, tgt, seg in zip(tokens, targets, segment_ids):
        start = np.concatenate([[True], seg[1:] != seg[:-1]])
        pos = np.arange(len(seg)) - np.maximum.accumulate(np.where(start, np.arange(len(seg)), 0))
        out.update((int(a), int(b), int(p)) for a, b, p in zip(tok, tgt, pos) if b >= 0)
    return out


def _expected(docs, seq_len):
    pieces = packing.pieces_of_documents(docs, seq_len)
    return collections.Counter((int(a), int(b), i) for p in pieces
                               for i, (a, b) in enumerate(zip(p.tokens, p.targets)))


def test_first_fit_decreasing_is_not_monotone_in_the_row_count():
    """Why the chooser tries every layout from the most groups down instead of stopping at the
    first that fails: 8 rows of 16 hold EXACT_WIDTHS, 4 rows of 32 (the same positions) do not."""
    assert packing.first_fit(EXACT_WIDTHS, 16, rows=8) is not None
    assert packing.first_fit(EXACT_WIDTHS, 32, rows=4) is None
    assert all(packing.first_fit(SET_WIDTHS, 16 * k, rows=8 // k) is not None
               for k in (1, 2, 4, 8))


@pytest.mark.parametrize("lengths, batch, groups", [
    ([w + 1 for w in EXACT_WIDTHS], 1, 8),
    ([17] * 6 + [18], 1, 4),              # one document of 17 predictions: rows of 32
    ([60, 50, 10], 1, 2),
    ([129], 1, 1),                        # fills the context
    ([25] * 4, 1, 4),                     # one document per row of 32
    ([25] * 5, 1, 1),                     # ... but a fifth has no row of 32 or 64 left
    ([300, 20], 4, 4),                    # cut into 128, 128, 43 (overlapping by one): 4 rows
    ([60] * 8, 4, 8),                     # 4 rows of 128 as 8 of 64
])
def test_packer_keeps_every_prediction_once_and_takes_the_most_groups(lengths, batch, groups):
    layouts = layout_set(N, batch, S, HEADS, KV, HOST)
    docs = documents(lengths)
    packed = packing.pack_step(packing.pieces_of_documents(docs, S), layouts)
    assert packed.layout.groups == groups and layouts[packed.index] is packed.layout
    assert packing.choose_layout(lengths, layouts) == packed.index
    assert packed.tokens.shape == (packed.layout.batch, packed.layout.seq_len)
    assert packed.tokens.dtype == packed.targets.dtype == packed.segment_ids.dtype == np.int32
    assert _live(packed.tokens, packed.targets, packed.segment_ids) == _expected(docs, S)
    # whole documents: a document that fits a row is one run of one segment
    for doc in docs:
        if len(doc) - 1 <= packed.layout.seq_len:
            hits = np.argwhere(np.isin(packed.tokens, doc[:-1]))
            assert len(set(hits[:, 0])) == 1, len(doc)
            row = hits[0, 0]
            assert len(set(packed.segment_ids[row, hits[:, 1]])) == 1
            assert np.all(np.diff(hits[:, 1]) == 1)
    # the most groups: every layout with more fails first-fit decreasing (or a piece is too wide)
    widths = [p.width for p in packing.pieces_of_documents(docs, S)]
    for lay in layouts[packed.index + 1:]:
        assert packing.first_fit(widths, lay.seq_len, rows=lay.batch) is None
    # deterministic
    again = packing.pack_step(packing.pieces_of_documents(docs, S), layouts)
    for name, x in packed.arrays().items():
        np.testing.assert_array_equal(again.arrays()[name], x)


def test_padding_is_its_own_segment_and_takes_no_loss():
    lay = _set()[1]  # 2 rows of 64
    packed = packing.pack(packing.pieces_of_documents(documents([11, 21]), S), lay, 1)
    assert packed is not None
    # widest first: the 20-prediction document opens row 0, the 10 joins it; row 1 empty
    np.testing.assert_array_equal(packed.segment_ids[0, :32], [0] * 20 + [1] * 10 + [2] * 2)
    assert set(packed.segment_ids[0, 30:]) == {2} and set(packed.segment_ids[1]) == {0}
    assert np.all(packed.targets[0, 30:] == -1) and np.all(packed.targets[1] == -1)
    assert np.all(packed.tokens[0, 30:] == 0)


def test_pieces_are_the_static_pipelines_cuts():
    """pieces_of_documents cuts with document_pieces (rows of S + 1 tokens overlapping by one),
    as the data pipeline's start-up packing does; piece_widths counts them without building
    them."""
    docs = documents([5, 129, 130, 300, 257, 2])
    stream = np.concatenate(docs)
    starts, lengths = packing.document_pieces(np.cumsum([len(d) for d in docs]), S + 1)
    ours = packing.pieces_of_documents(docs, S)
    assert len(ours) == len(starts)
    for piece, start, n in zip(ours, starts, lengths):
        np.testing.assert_array_equal(piece.tokens, stream[start:start + n - 1])
        np.testing.assert_array_equal(piece.targets, stream[start + 1:start + n])
    assert sorted(packing.piece_widths([len(d) for d in docs], S).tolist()) == \
        sorted(p.width for p in ours)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        packing.pieces_of_documents([np.array([0])], S)


def test_a_step_over_the_static_rows_is_refused():
    with pytest.raises(LayoutError, match="do not fit 1 rows of 128"):
        packing.pack_step([Piece(np.zeros(100, np.int32), np.zeros(100, np.int32))] * 2, _set())


def _pipeline(path, accum=1):
    from train.config import DataConfig
    from train.data import Pipeline

    return Pipeline(DataConfig(source="tokens", path=str(path), seq_len=S, pack=True, eos_id=0),
                    vocab_size=65536, grad_accum=accum, microbatch=1, seed=0)


def test_the_pipelines_documents_packed_once_keep_every_prediction(tmp_path):
    """The trainer's path: the documents the data pipeline's start-up packing put in a step's
    rows (Pipeline.row_pieces, resumable from (seed, step)) packed once for the chosen layout;
    every (token, target, position in its document) of the pipeline's own rows is kept, and a
    step whose documents all fit smaller rows moves to more groups."""
    rng = np.random.default_rng(1)
    lengths = np.where(rng.random(60) < 0.85, rng.integers(2, 15, 60), rng.integers(40, 400, 60))
    docs = documents(lengths.tolist(), seed=1)
    path = tmp_path / "docs.npy"
    np.save(path, np.concatenate(docs).astype(np.uint16) % 60000)
    pipe = _pipeline(path)
    layouts = _set()
    chosen = set()
    for step in range(12):
        rows = pipe.rows(step, np.arange(1))
        packed = packing.pack_microbatches([pipe.row_pieces(step, np.arange(1))], layouts)
        chosen.add(packed.layout.groups)
        assert packed.tokens.shape == (1, packed.layout.batch, packed.layout.seq_len)
        assert _live(*(x[0] for x in packed.arrays().values())) == _live(*rows.values()), step
    assert 1 in chosen and len(chosen) > 1, chosen
    # resume: a new pipeline (a resumed run's) packs step t into the same layout and rows
    again = packing.pack_microbatches([_pipeline(path).row_pieces(11, np.arange(1))], layouts)
    assert again.index == packed.index
    for name, x in packed.arrays().items():
        np.testing.assert_array_equal(again.arrays()[name], x)


def test_every_microbatch_of_a_step_takes_one_layout(tmp_path):
    """grad_accum microbatches share one compiled step: the layout is the one with the most
    groups that holds every microbatch; when one needs the static rows, all take them."""
    layouts = _set()
    small = [packing.pieces_of_documents(documents([9, 9, 9]), S)]  # fits 8 rows of 16
    whole = [packing.pieces_of_documents(documents([129]), S)]  # fills the static row
    both = packing.pack_microbatches([small, whole], layouts)
    assert both.index == 0 and both.tokens.shape == (2, 1, S)
    alone = packing.pack_microbatches([small, small], layouts)
    assert alone.layout.groups == 8 and alone.tokens.shape == (2, 8, 16)


def test_zigzag_rows_are_read_and_written_in_token_order():
    layouts = layout_set(N, 1, S, HEADS, KV, HOST, host_rings=True, zigzag=True)
    assert layouts[0].zigzag and layouts[0].ring == 2
    docs = documents([40, 30, 20])
    pieces = packing.pieces_of_documents(docs, S)
    static = packing.fill_rows(pieces, [[0, 1, 2]], layouts[0])
    packed = packing.pack_microbatches([[pieces]], layouts)
    assert packed.layout.groups == 2
    order = packed.layout.token_order
    assert _live(packed.tokens[0], packed.targets[0], packed.segment_ids[0], order) == \
        _live(static.tokens, static.targets, static.segment_ids, layouts[0].token_order)
    # the static layout's own rows are written in its zig-zag order too
    whole = packing.pack_microbatches([[packing.pieces_of_documents(documents([129]), S)]],
                                      layouts)
    assert whole.index == 0
    assert _live(whole.tokens[0], whole.targets[0], whole.segment_ids[0],
                 layouts[0].token_order) == _expected(documents([129]), S)
