"""Adaptive layouts: per step, the layout with the most groups whose rows hold the step's documents.

A static BASP run fixes B rows of S tokens on B groups of N/B devices. A step whose documents all
fit in S/k tokens can run k*B rows of S/k tokens on k*B groups of N/(kB) devices instead: the same
tokens (and so the same memory) per device, but every all-to-all inside k times fewer devices,
and often inside one host where the static layout's crossed hosts. This module is the groundwork:

    layouts = layout_set(8, 1, 4096, 32, 8, devices_per_host=4)   # (1,8) (2,4) (4,2) (8,1)
    packed = pack_step(pieces_of_documents(docs, layouts[0].seq_len), layouts)
    packed.layout, packed.tokens, packed.targets, packed.segment_ids   # [k*B, S/k] numpy int32
    gain = predicted_gain(shape, layouts, [[len(d) for d in docs], ...], hw=cost.HARDWARE[...])

Why switching layouts moves no parameter: under 'fsdp' a parameter is split over the flattened
('group', 'seq') axes, i.e. over all N devices in the mesh's flattened device order, and
make_mesh lays every (g, sp) out as the same host-major device list reshaped, so that order is
the same for every layout of the set (and so is the fallback dimension ShardingRules picks when
N does not divide the split one: it depends on N only). 'host' places parameters on
('host', 'local'), the same list reshaped by devices per host, whatever (g, sp) is.
'replicated' is the same everywhere. 'hsdp' splits over 'seq' only, replicated over 'group':
its placement changes with sp, so a switch would move every parameter; it is refused.
Optimizer state follows the parameters' shardings, so it does not move either.

The packing follows the static pipeline's conventions (train.sources, train.data): a document of
L tokens (its eos included) gives L - 1 predictions and fits a row of S' positions when
L <= S' + 1; one longer than the base layout's S is cut, as train.sources.document_pieces cuts
it, into pieces overlapping by one token; targets are -1 where no loss is taken; segment ids
number a row's pieces from 0 and padding (token 0, target -1) is a segment of its own after them.
Every (token, target) pair of a piece keeps its position within its piece, so under causal
attention within segments the loss sum, its count and the gradients are those of the static
packing of the same pieces, whatever rows they land in.

Nothing here imports models or train: a step is any function of a Layout (LayoutSteps caches
one compiled step per layout of the set).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np

from . import cost
from .layout import Layout, LayoutError, mode_of
from .mesh import GROUP, SEQ
from .sharding import PARAM_SHARDINGS


# ------------------------------------------------------------------------------------ the set

def shares_placement(param_sharding: str) -> bool:
    """Whether parameters under this strategy (basp_jax.sharding.PARAM_SHARDINGS) sit on the same
    devices in every layout of a set: split over the whole flattened mesh, per host, or nowhere.
    A split over part of the ('group', 'seq') mesh (hsdp: 'seq') follows the layout's sp."""
    strategy = PARAM_SHARDINGS.get(param_sharding)  # (a ValueError naming the choices)
    return strategy.per_host or tuple(strategy.split_axes) in ((), (GROUP, SEQ))


def check_param_sharding(param_sharding: str) -> None:
    """Raise a one-line LayoutError for a strategy whose parameters would move between layouts."""
    if not shares_placement(param_sharding):
        ok = [name for name in PARAM_SHARDINGS.names() if shares_placement(name)]
        raise LayoutError(
            f"param_sharding={param_sharding!r} places parameters by the layout's sp, so switching "
            f"layouts would move every parameter; adaptive layouts need one of {', '.join(ok)}")


def host_ring(sp: int, devices_per_host: int) -> int:
    """The ring that keeps each all-to-all inside one host when a seq group spans hosts (1 when
    it does not, or when the hosts do not tile the group)."""
    if sp <= devices_per_host or sp % devices_per_host:
        return 1
    return sp // devices_per_host


def expand(base: Layout, *, param_sharding: str = "fsdp", host_rings: bool = False,
           zigzag: bool = False) -> tuple[Layout, ...]:
    """The adaptive set grown from a static layout: base, then for k = 2, 4, ... the layout of
    k*B rows of S/k tokens on k*groups groups, while k*groups divides the devices and k divides
    S. A k that Layout.plan refuses (S/k not divisible by the smaller sp or 2*sp under zig-zag,
    heads that need padding when base did not pad) is left out and the next k still tried: the
    set is whatever subset of the powers of two is valid, so the choice never compiles a layout
    that cannot run. host_rings: a layout whose seq group spans hosts runs its all-to-all inside
    each host and a ring across them (ring = sp / devices_per_host), as basp_jax.cost offers,
    in zig-zag token order with zigzag (or when base has it; Layout.plan drops zigzag without a
    ring, so a ringless base cannot carry it).
    Base layouts with pad_rows are refused: which rows are masked has no meaning once the rows
    are repacked."""
    check_param_sharding(param_sharding)
    if base.pad_rows:
        raise LayoutError(f"an adaptive set needs a layout without pad rows, got "
                          f"pad_rows={base.pad_rows}; use a batch the groups divide")
    zigzag = zigzag or base.zigzag
    if host_rings:
        base = base.replan(ring=host_ring(base.sp, base.devices_per_host), zigzag=zigzag)
    found, k = [base], 2
    while base.groups * k <= base.num_devices:
        groups = base.groups * k
        if base.num_devices % groups == 0 and base.seq_len % k == 0:
            sp = base.num_devices // groups
            ring = host_ring(sp, base.devices_per_host) if host_rings else 1
            try:
                found.append(base.replan(batch=base.batch * k, seq_len=base.seq_len // k,
                                         groups=groups, mode=mode_of(groups), ring=ring,
                                         zigzag=zigzag))
            except LayoutError:
                pass
        k *= 2
    return tuple(found)


def layout_set(num_devices: int, batch: int, seq_len: int, num_heads: int,
               num_kv_heads: int | None = None, devices_per_host: int | None = None, *,
               mode: str = "basp", groups: int | None = None, param_sharding: str = "fsdp",
               pad_heads: bool = False, zigzag: bool = False, host_rings: bool = False
               ) -> tuple[Layout, ...]:
    """The static layout Layout.plan makes of these arguments, then its adaptive siblings
    (expand): every layout over the same devices in the same order, most groups last."""
    check_param_sharding(param_sharding)
    base = Layout.plan(num_devices, batch, seq_len, num_heads, num_kv_heads,
                       devices_per_host=devices_per_host, mode=mode, groups=groups,
                       pad_heads=pad_heads, zigzag=zigzag)
    return expand(base, param_sharding=param_sharding, host_rings=host_rings, zigzag=zigzag)


def relabel(tree, shardings):
    """`tree`'s arrays carrying `shardings` (a pytree like it, of Shardings or of arrays whose
    shardings to take): the step of another layout of the set takes parameters placed for this
    one only after this, and it copies nothing. A LayoutError when a leaf's placement differs
    (that would be a transfer, which an adaptive switch must never do).

    Why it is needed at all: jit accepts the other mesh's arrays as inputs (it compiles the same
    program: the placements are equivalent), but names the shardings of outputs it infers on the
    first argument's mesh, and an activation split over 'group' of another group count cannot
    be named there (jax's IndivisibleError); relabelled, the step's own mesh is the only one.
    Not jax.device_put: for an array that spans processes it runs an identity program, a copy
    of every parameter (jax._src.dispatch._different_device_order_reshard)."""
    def one(x, target):
        target = getattr(target, "sharding", target)
        if not x.sharding.is_equivalent_to(target, x.ndim):
            here, there = (getattr(s, "spec", s) for s in (x.sharding, target))
            raise LayoutError(f"an array of shape {tuple(x.shape)} is placed {here} here and "
                              f"{there} in the other layout: switching would move it; use a "
                              f"param_sharding that shares_placement")
        # The same per-device buffers under the new name: no copy, no program, no communication,
        # also where jax.device_put would run an identity program (arrays spanning processes).
        return jax.make_array_from_single_device_arrays(
            x.shape, target, [shard.data for shard in x.addressable_shards])

    return jax.tree.map(one, tree, shardings)


class LayoutSteps:
    """One compiled step per layout, built on first use: `steps(layout)(*args)`. `build(layout)`
    returns the (jitted) step for that layout's shapes and mesh; each is built once, so a run
    that visits every layout compiles len(set) programs, never one per step."""

    def __init__(self, build: Callable[[Layout], Callable]):
        self._build = build
        self._steps: dict[Layout, Callable] = {}

    def __call__(self, layout: Layout) -> Callable:
        if layout not in self._steps:
            self._steps[layout] = self._build(layout)
        return self._steps[layout]

    def __len__(self) -> int:
        return len(self._steps)


# ------------------------------------------------------------------------------------ packing

@dataclasses.dataclass(frozen=True)
class Piece:
    """A run of positions that stays together in one row: its input tokens and their targets
    (-1: no loss), int32, equal lengths. Its width is the positions it takes in a row."""

    tokens: np.ndarray
    targets: np.ndarray

    @property
    def width(self) -> int:
        return len(self.tokens)


def piece_widths(doc_lengths: Sequence[int], seq_len: int) -> np.ndarray:
    """The widths of the pieces documents of these lengths (tokens, eos included) become in rows
    of seq_len positions: L - 1 for a document that fits (L <= seq_len + 1), else the widths of
    train.sources.document_pieces' cuts (rows of seq_len + 1 tokens overlapping by one)."""
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    if np.any(lengths < 2):
        raise ValueError(f"every document needs at least 2 tokens (one prediction), got lengths "
                         f"{sorted(set(lengths[lengths < 2].tolist()))}")
    full = (lengths - 1) // seq_len  # pieces of seq_len predictions each
    rest = (lengths - 1) % seq_len
    widths = np.repeat(np.full(len(lengths), seq_len), full)
    return np.sort(np.concatenate([widths, rest[rest > 0]]))[::-1]


def pieces_of_documents(documents: Sequence[np.ndarray], seq_len: int) -> list[Piece]:
    """Documents (1-D token arrays, eos included) as pieces for rows of seq_len positions (the
    static layout's S): a document of L tokens is one piece of L - 1 predictions when
    L <= seq_len + 1, else cut as train.sources.document_pieces cuts it (rows of seq_len + 1
    tokens overlapping by one token, no prediction lost or repeated)."""
    out = []
    for doc in documents:
        doc = np.asarray(doc, dtype=np.int32)
        if len(doc) < 2:
            raise ValueError(f"a document of {len(doc)} token(s) has no prediction; every "
                             "document needs at least 2 tokens")
        for start in range(0, len(doc) - 1, seq_len):
            cut = doc[start:start + seq_len + 1]
            out.append(Piece(cut[:-1], cut[1:]))
    return out


def pieces_of_rows(tokens: np.ndarray, targets: np.ndarray, segment_ids: np.ndarray,
                   order: np.ndarray | None = None) -> list[Piece]:
    """The pieces of rows the static pipeline built (train.data's tokens, targets, segment_ids
    [rows, S], in the token `order` of its layout, None: natural): each run of one segment id,
    without its trailing positions whose target is -1 (no later position of its segment sees
    them under causal attention, so dropping them changes no loss or gradient), runs with no
    target at all (padding) left out. Row-major, deterministic."""
    tokens, targets, segment_ids = (np.asarray(x) for x in (tokens, targets, segment_ids))
    if order is not None:
        back = np.argsort(order)
        tokens, targets, segment_ids = tokens[:, back], targets[:, back], segment_ids[:, back]
    out = []
    for tok, tgt, seg in zip(tokens, targets, segment_ids):
        cuts = np.flatnonzero(np.diff(seg)) + 1
        for a, b in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(seg)]])):
            live = np.flatnonzero(tgt[a:b] >= 0)
            if len(live):
                end = a + int(live[-1]) + 1
                out.append(Piece(tok[a:end].astype(np.int32), tgt[a:end].astype(np.int32)))
    return out


def first_fit_decreasing(widths: Sequence[int], rows: int, capacity: int
                         ) -> list[list[int]] | None:
    """Bins (rows) of piece indices: widest first (ties: lower index first), each into the first
    row with room. None when a piece finds no room, or is wider than a row. Deterministic."""
    widths = np.asarray(widths, dtype=np.int64)
    if len(widths) and widths.max() > capacity:
        return None
    room = np.full(rows, capacity, dtype=np.int64)
    bins: list[list[int]] = [[] for _ in range(rows)]
    for i in np.lexsort((np.arange(len(widths)), -widths)):
        fits = np.flatnonzero(room >= widths[i])
        if not len(fits):
            return None
        bins[fits[0]].append(int(i))
        room[fits[0]] -= widths[i]
    return bins


def choose_layout(doc_lengths: Sequence[int], layouts: Sequence[Layout]) -> int:
    """The index in `layouts` (a layout_set: the static layout first) of the layout with the most
    groups whose rows hold every document of the step whole (first_fit_decreasing; a document
    longer than a row rules the layout out), else 0: the static layout, where documents longer
    than S are cut as the static pipeline cuts them (piece_widths)."""
    return _choose(piece_widths(doc_lengths, layouts[0].seq_len), layouts)[0]


def _choose(widths: np.ndarray, layouts: Sequence[Layout]) -> tuple[int, list[list[int]] | None]:
    """(index, bins) of the layout with the most groups that packs these widths; (0, its bins or
    None) when only the static one is left."""
    order = sorted(range(len(layouts)), key=lambda i: -layouts[i].groups)
    for i in order:
        bins = first_fit_decreasing(widths, layouts[i].batch, layouts[i].seq_len)
        if bins is not None or layouts[i] is layouts[0]:
            return i, bins
    return 0, None


@dataclasses.dataclass(frozen=True)
class PackedStep:
    """One step's rows for one layout of the set: tokens, targets (-1: no loss) and segment ids
    [layout.batch, layout.seq_len] int32, in the layout's token order (zig-zag under a ring)."""

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
    """The pieces first-fit-decreasing packed into `layout`'s rows; None when they do not fit."""
    bins = first_fit_decreasing([p.width for p in pieces], layout.batch, layout.seq_len)
    return None if bins is None else fill_rows(pieces, bins, layout, index)


def pack_step(pieces: Sequence[Piece], layouts: Sequence[Layout]) -> PackedStep:
    """A step's pieces packed into the layout with the most groups that holds them all
    (first-fit decreasing). A LayoutError when not even the static layout (layouts[0]) does:
    the step holds more than its B rows of S; pack_rows keeps the static rows instead."""
    index, bins = _choose(np.asarray([p.width for p in pieces]), layouts)
    if bins is None:
        base = layouts[0]
        total = sum(p.width for p in pieces)
        raise LayoutError(
            f"the step's {len(pieces)} pieces ({total} positions) do not fit {base.batch} rows of "
            f"{base.seq_len} by first-fit decreasing; give a step no more than the static "
            f"layout holds (or use pack_rows, which keeps the static rows)")
    return fill_rows(pieces, bins, layouts[index], index)


def pack_rows(tokens: np.ndarray, targets: np.ndarray, segment_ids: np.ndarray,
              layouts: Sequence[Layout]) -> PackedStep:
    """The static pipeline's rows of a step (train.data: [B, S], in layouts[0]'s token order)
    repacked into the layout with the most groups that holds all their pieces whole; the rows
    themselves when only the static layout does (so this never fails on a step the static
    pipeline built)."""
    base = layouts[0]
    pieces = pieces_of_rows(tokens, targets, segment_ids, base.token_order)
    index, bins = _choose(np.asarray([p.width for p in pieces]), layouts)
    if index == 0:
        return PackedStep(0, base, *(np.asarray(x, np.int32)
                                     for x in (tokens, targets, segment_ids)))
    return fill_rows(pieces, bins, layouts[index], index)


def pack_microbatches(tokens: np.ndarray, targets: np.ndarray, segment_ids: np.ndarray,
                      layouts: Sequence[Layout]) -> PackedStep:
    """A step of grad_accum microbatches (train.data's rows [accum, B, S] in natural token
    order) repacked for one layout of the set, the same for every microbatch (one compiled step
    takes them all): the layout with the most groups into whose rows first-fit decreasing packs
    every microbatch's pieces; the static rows themselves (in layouts[0]'s token order) when only
    the static layout does. Arrays [accum, rows, S'] int32; a pure function of the rows, so a
    resumed run (same seed and step) chooses and packs the same way."""
    tokens, targets, segment_ids = (np.asarray(x) for x in (tokens, targets, segment_ids))
    pieces = [pieces_of_rows(*micro) for micro in zip(tokens, targets, segment_ids)]
    widths = [[p.width for p in micro] for micro in pieces]
    for i in sorted(range(1, len(layouts)), key=lambda i: -layouts[i].groups):
        layout = layouts[i]
        bins = [first_fit_decreasing(w, layout.batch, layout.seq_len) for w in widths]
        if all(b is not None for b in bins):
            rows = [fill_rows(micro, b, layout, i) for micro, b in zip(pieces, bins)]
            return PackedStep(i, layout, *(np.stack([getattr(r, name) for r in rows])
                                           for name in ("tokens", "targets", "segment_ids")))
    base, order = layouts[0], layouts[0].token_order
    arrays = [np.asarray(x, np.int32) for x in (tokens, targets, segment_ids)]
    if order is not None:
        arrays = [x[..., order] for x in arrays]
    return PackedStep(0, base, *arrays)


# ------------------------------------------------------------------------------ predicted gain

@dataclasses.dataclass(frozen=True)
class Gain:
    """The cost model's expected step time of the static layout and of the adaptive choice over
    sampled steps; `chosen` holds each step's index in the set, `step_s` each layout's
    prediction (basp_jax.cost.predict's step_s)."""

    static_s: float
    adaptive_s: float
    chosen: tuple[int, ...]
    step_s: tuple[float, ...]

    @property
    def gain(self) -> float:
        """Static over adaptive expected step time: > 1 when adapting pays."""
        return self.static_s / self.adaptive_s

    def share(self, index: int) -> float:
        """The fraction of steps that run layout `index` of the set."""
        return self.chosen.count(index) / len(self.chosen)


def predicted_gain(shape, layouts: Sequence[Layout], steps: Sequence[Sequence[int]], *, hw,
                   param_sharding: str = "fsdp", **predict_kwargs) -> Gain:
    """The expected step time of the adaptive choice against the static layout (layouts[0]) for
    sampled steps, each a list of document lengths (tokens, eos included, as choose_layout takes
    them): the mean of basp_jax.cost.predict's step_s of each step's chosen layout, the same
    prediction the planner ranks static layouts by. `shape` is a basp_jax.cost.ModelShape;
    predict_kwargs go to predict (grad_accum, remat, overlap, ...). Since every layout of the set
    holds the same tokens per device, what differs is the all-to-alls' width and whether they
    cross hosts, and the attention FLOPs of shorter rows."""
    if not steps:
        raise ValueError("predicted_gain needs at least one sampled step")
    check_param_sharding(param_sharding)
    step_s = tuple(cost.predict(shape, layout, param_sharding, hw=hw, **predict_kwargs).step_s
                   for layout in layouts)
    chosen = tuple(choose_layout(lengths, layouts) for lengths in steps)
    adaptive = float(np.mean([step_s[i] for i in chosen]))
    return Gain(step_s[0], adaptive, chosen, step_s)


# Named document-length distributions (tokens per document, eos included) for predictions and
# benchmarks: "longtail" is lognormal(mu=6.5, sigma=1.2) + 2 (median ~670 tokens, a few percent
# beyond 8K), "full" documents that each fill a whole row (the control: nothing to adapt to).
DISTRIBUTIONS: dict[str, tuple[float, float] | None] = {"longtail": (6.5, 1.2), "full": None}


def row_documents(rng: np.random.Generator, distribution: str, length: int) -> list[int]:
    """The lengths (tokens, eos included) of the documents of one packed row of `length` tokens
    (seq_len + 1: a row's inputs and its last target), drawn from DISTRIBUTIONS[distribution]
    as a packing pipeline fills a row: documents are added while they fit; the first that does
    not ends the row (it is not kept; the rest is padding) and a document longer than the row
    is cut to it. One document of `length` tokens under "full"."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"unknown document distribution {distribution!r}; use one of "
                         f"{', '.join(DISTRIBUTIONS)}")
    params = DISTRIBUTIONS[distribution]
    if params is None:
        return [length]
    lengths, used = [], 0
    while True:
        n = int(min(rng.lognormal(*params) + 2, length))
        if used + n > length:  # (an empty row takes any: n <= length)
            return lengths
        lengths.append(n)
        used += n


def sample_steps(distribution: str, count: int, *, rows: int, seq_len: int,
                 seed: int = 0) -> list[list[int]]:
    """`count` steps of document lengths, each filling `rows` rows of seq_len + 1 tokens as the
    trainer's synthetic documents (train.data, data.documents) do: row_documents per row.
    Seeded: the same arguments give the same steps."""
    rng = np.random.default_rng(seed)
    return [[n for _ in range(rows) for n in row_documents(rng, distribution, seq_len + 1)]
            for _ in range(count)]
