"""Ring-hybrid sequence parallelism: when sp exceeds what the heads allow, split the `seq` axis
into `ring` runs of `inner` devices (sp = ring * inner).

Inside a run, an all-to-all (over `inner` consecutive devices) turns sequence shards into head
shards, exactly as in Ulysses; the run then holds one contiguous chunk of S / ring tokens. Across
runs, k/v chunks travel around a ring with `ppermute` (ring - 1 hops) and each device merges the
partial attention of its query chunk by log-sum-exp. Causal chunks entirely in the future are
skipped (no compute). Each hop runs cuDNN's kernels or our Pallas kernel on a GPU from sm80, the
blockwise one elsewhere (kernels.ring_hop_kernel; basp_jax.ring_hops: which hop runs what).

Load balance under causal masking: with contiguous chunks, the last rank of the ring attends to
every earlier chunk while the first attends only to its own, and each ring step waits for the
busiest. With a zig-zag layout (Layout.zigzag) the sequence is cut into 2 x ring halves and rank
r holds halves r and 2 ring - 1 - r, so every rank does the same work at every step. The caller
then feeds the tokens in `Layout.token_order` (basp_jax.layout.zigzag_order: a permutation of the
sequence axis, done once at data loading, not per layer).

The runs, the ring's hops and the token order are the layout's (basp_jax.layout.Layout).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import ring_hops
from .fp8_exchange import fp8_all_to_all
from .layout import Layout
from .mesh import SEQ
from .remat import name_exchange


def _merge(out, lse, out_t, lse_t):
    """Combine two partial softmax attentions of the same queries by their log-sum-exp."""
    m = jnp.maximum(lse, lse_t)
    w, w_t = jnp.exp(lse - m), jnp.exp(lse_t - m)
    total = w + w_t
    merged = (out * w[..., None] + out_t * w_t[..., None]) / total[..., None]
    return merged, m + jnp.log(total)


def ring_local_attention(q, k, v, seg, *, layout: Layout, causal: bool, block_size: int,
                         hop_kernel: ring_hops.HopKernel = ring_hops.HopKernel(),
                         fp8_exchange: bool = False):
    """The per-device body inside shard_map: q [b, s/sp, h, d] -> [b, s/sp, h, d].

    `seg` is this device's [b, s/sp] segment ids or None. With layout.zigzag, the sequence axis
    is in layout.token_order. hop_kernel: the kernel the hops run (kernels.ring_hop_kernel;
    default blockwise). fp8_exchange: q, k, v's
    all-to-alls in float8 (basp_jax.fp8_exchange); the hops carry them dequantized.

    The k/v hops happen here, outside the attention proper (`_ring_attention`, with its own
    backward pass): their transposes send the k/v gradients back, and remat policies see them
    as the exchanges they are. The attention keeps only its final output and log-sum-exp for the
    backward pass, not every ring step's partial result, and each hop is merged and summed
    before the next runs (`_after`): BENCHMARKS.md, "Figures behind design choices".
    """
    inner = layout.a2a
    groups = layout.a2a_runs

    def seq_to_heads(xs):
        if inner == 1:
            return xs
        if fp8_exchange:
            xs = fp8_all_to_all(xs, 2, 1, inner, tuple(map(tuple, groups)))
        else:
            xs = tuple(lax.all_to_all(x, SEQ, 2, 1, tiled=True, axis_index_groups=groups)
                       for x in xs)
        q, k, v = xs  # k and v tagged apart (basp_jax.remat.name_exchange)
        return name_exchange(q), name_exchange(k, kv=True), name_exchange(v, kv=True)

    def heads_to_seq(x):
        if inner == 1:
            return x
        return name_exchange(lax.all_to_all(x, SEQ, 1, 2, tiled=True, axis_index_groups=groups))

    q, k, v = seq_to_heads((q, k, v))
    full_seg = None if seg is None else name_exchange(
        lax.all_gather(seg, SEQ, axis=1, tiled=True), kv=True)
    # ks[step]: the k/v chunk a device holds at ring step `step` (that of ring rank - step)
    ks, vs = [k], [v]
    for _ in range(layout.ring - 1):
        k, v = (name_exchange(lax.ppermute(x, SEQ, layout.ring_hops), kv=True) for x in (k, v))
        ks.append(k)
        vs.append(v)
    rank = lax.axis_index(SEQ) // inner
    static = _Ring(layout.ring, layout.zigzag, causal, block_size, hop_kernel)
    out = _ring_attention(q, tuple(ks), tuple(vs), full_seg, rank, static)
    return heads_to_seq(out)


class _Ring(NamedTuple):
    """What the ring attention needs to know that is not an array."""

    ring: int
    zigzag: bool
    causal: bool
    block_size: int
    hop_kernel: ring_hops.HopKernel


def _hop_forward(q, k, v, static: _Ring, *, diagonal: bool, **kw):
    """One (query piece, k/v piece) attention: (out, lse). diagonal: the query piece's own."""
    return ring_hops.forward(static.hop_kernel, q, k, v, causal=static.causal,
                             block_size=static.block_size, diagonal=diagonal, **kw)


def _hop_backward(q, k, v, out, lse, d_out, static: _Ring, *, diagonal: bool,
                  wrt: str = "qkv", **kw):
    """One hop's (dq, dk, dv) from the whole attention's out, lse and d_out; with the Pallas
    kernel wrt="q" or "kv" runs only dq's kernel or dk/dv's (the others None)."""
    return ring_hops.backward(static.hop_kernel, q, k, v, out, lse, d_out, causal=static.causal,
                              block_size=static.block_size, diagonal=diagonal, wrt=wrt, **kw)


def _after(inputs, sums):
    """(inputs, sums) through one optimization barrier: the next hop's kernel inputs, released
    only once the running sums (the merged outputs, the gradient sums) are computed, and those
    sums as values later merges start from. Without it XLA runs every hop's kernel first and
    fuses all the merges or additions into one computation at the end, holding every hop's
    output at once (every hop's output in the forward pass, every dq piece in the backward)."""
    return lax.optimization_barrier((inputs, sums))


def _plan(q, full_seg, rank, static: _Ring):
    """Closures over the ring's chunking: pieces(x, owner) -> [(piece, position in units of
    pieces)], the piece length, and each step's k/v segment ids."""
    ring = static.ring
    chunk = q.shape[1]  # tokens per ring chunk: S / ring
    if static.zigzag:
        piece = chunk // 2

        def pieces(x, owner):
            halves = (owner, 2 * ring - 1 - owner)
            if x is None:
                return [(None, h) for h in halves]
            return [(x[:, :piece], halves[0]), (x[:, piece:], halves[1])]
    else:
        piece = chunk

        def pieces(x, owner):
            return [(x, owner)]

    def chunk_seg(index):
        if full_seg is None:
            return None
        return lax.dynamic_slice_in_dim(full_seg, index * chunk, chunk, axis=1)

    return pieces, piece, chunk_seg


def _ring_forward(q, ks, vs, full_seg, rank, static: _Ring):
    """(outs in q's dtype, lses float32) per query piece: every step's chunk merged by
    log-sum-exp into a float32 sum, one query piece after the other (so one such sum exists at a
    time, each hop merged before the next one runs: `_after`)."""
    pieces, piece, chunk_seg = _plan(q, full_seg, rank, static)
    q_pieces = pieces(q, rank)
    q_seg_pieces = pieces(chunk_seg(rank), rank)
    kv_pieces = []  # per step: [(k piece, v piece, segment ids)] of the chunk held then
    for step in range(static.ring):
        source = (rank - step) % static.ring  # whose k/v chunk this device holds now
        kv_pieces.append(list(zip(pieces(ks[step], source), pieces(vs[step], source),
                                  pieces(chunk_seg(source), source))))
    outs, lses = [], []
    for n, ((q_piece, q_pos), (q_seg, _)) in enumerate(zip(q_pieces, q_seg_pieces)):
        acc = None  # (out, lse)
        for step in range(static.ring):
            # At step 0, piece n of the own chunk is the diagonal of query piece n, where every
            # query sees at least itself: take it first so the running log-sum-exp is finite
            # before anything is merged into it.
            kvs = list(enumerate(kv_pieces[step]))
            order = kvs if step else [kvs[n]] + kvs[:n] + kvs[n + 1:]
            for m, ((k_piece, k_pos), (v_piece, _), (k_seg, _)) in order:
                (q_in, k_in, v_in), (acc, outs) = _after((q_piece, k_piece, v_piece),
                                                         (acc, outs))
                out_t, lse_t = _hop_forward(
                    q_in, k_in, v_in, static, diagonal=step == 0 and m == n,
                    q_segment_ids=q_seg, k_segment_ids=k_seg, k_shift=(k_pos - q_pos) * piece)
                if acc is None:
                    acc = (out_t.astype(jnp.float32), lse_t)
                else:
                    acc = _merge(*acc, out_t, lse_t)
        outs.append(acc[0].astype(q.dtype))
        lses.append(acc[1])
    return outs, lses


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring_attention(q, ks, vs, full_seg, rank, static: _Ring):
    """Attention of this device's query chunk q [b, S/ring, h, d] to every chunk of the ring
    (ks, vs: the chunk held at each step), merged by log-sum-exp."""
    return _ring_attention_fwd(q, ks, vs, full_seg, rank, static)[0]


def _ring_attention_fwd(q, ks, vs, full_seg, rank, static: _Ring):
    outs, lses = _ring_forward(q, ks, vs, full_seg, rank, static)
    out = jnp.concatenate(outs, axis=1)
    return out, (q, ks, vs, full_seg, rank, out, tuple(lses))


def _ring_attention_bwd(static: _Ring, residuals, d_out):
    """Flash attention's backward per (query piece, k/v piece), with the final output and
    log-sum-exp (basp_jax.ring_hops.backward): dq summed here, each step's dk/dv returned for the
    hops' transposes to send home.

    Every hop's gradients are added to float32 running sums before the next hop's kernels run
    (`_after`). With the Pallas kernel, whose dq and dk/dv are separate kernels, dq is summed over
    all hops one query piece at a time and then each step's dk/dv over the query pieces: one dq
    sum exists at a time instead of one per piece, and none while the dk/dv kernels run. The
    blockwise and cuDNN hops compute all three at once: their hops run step by step, each
    step's query pieces against its k/v pieces. Either way every sum adds the same terms in the
    same order."""
    q, ks, vs, full_seg, rank, out, lses = residuals
    pieces, piece, chunk_seg = _plan(q, full_seg, rank, static)
    q_pieces = pieces(q, rank)
    q_seg_pieces = pieces(chunk_seg(rank), rank)
    out_pieces = [x for x, _ in pieces(out, rank)]
    do_pieces = [x for x, _ in pieces(d_out, rank)]

    def kv_pieces(step):
        source = (rank - step) % static.ring
        return list(zip(pieces(ks[step], source), pieces(vs[step], source),
                        pieces(chunk_seg(source), source)))

    def hop(n, m, step, sums, wrt):
        """One hop's gradients (query piece n, piece m of step's k/v chunk) once `sums` are
        computed: ((dq, dk, dv), sums)."""
        (q_piece, q_pos), (q_seg, _) = q_pieces[n], q_seg_pieces[n]
        (k_piece, k_pos), (v_piece, _), (k_seg, _) = kv_pieces(step)[m]
        (q_in, k_in, v_in, out_in, do_in), sums = _after(
            (q_piece, k_piece, v_piece, out_pieces[n], do_pieces[n]), sums)
        grads = _hop_backward(q_in, k_in, v_in, out_in, lses[n], do_in, static,
                              diagonal=step == 0 and m == n, wrt=wrt, q_segment_ids=q_seg,
                              k_segment_ids=k_seg, k_shift=(k_pos - q_pos) * piece)
        return grads, sums

    def zeros(x):
        return jnp.zeros(x.shape, jnp.float32)

    split = static.hop_kernel.split  # the Pallas kernel: dq apart from dk/dv
    dq_done, dks, dvs = [], [], []
    if split:
        for n, (q_piece, _) in enumerate(q_pieces):
            dq = zeros(q_piece)
            for step in range(static.ring):
                for m in range(len(kv_pieces(step))):
                    (dq_t, _, _), (dq, dq_done) = hop(n, m, step, (dq, dq_done), "q")
                    dq = dq + dq_t
            dq_done.append(dq.astype(q.dtype))
    else:
        dq = [zeros(x) for x, _ in q_pieces]
    for step in range(static.ring):
        kvs = kv_pieces(step)
        dk = [zeros(k) for (k, _), _, _ in kvs]
        dv = [zeros(v) for _, (v, _), _ in kvs]
        for n in range(len(q_pieces)):
            for m in range(len(kvs)):
                if split:
                    (_, dk_t, dv_t), (dk, dv, dks, dvs, dq_done) = hop(
                        n, m, step, (dk, dv, dks, dvs, dq_done), "kv")
                else:
                    (dq_t, dk_t, dv_t), (dq, dk, dv, dks, dvs) = hop(
                        n, m, step, (dq, dk, dv, dks, dvs), "qkv")
                    dq[n] = dq[n] + dq_t
                dk[m] = dk[m] + dk_t
                dv[m] = dv[m] + dv_t
        dks.append(jnp.concatenate(dk, axis=1).astype(ks[step].dtype))
        dvs.append(jnp.concatenate(dv, axis=1).astype(vs[step].dtype))
    if not split:
        dq_done = [x.astype(q.dtype) for x in dq]
    dq = jnp.concatenate(dq_done, axis=1)
    return dq, tuple(dks), tuple(dvs), None, None


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)
