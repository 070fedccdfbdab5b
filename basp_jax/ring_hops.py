"""The kernels a ring hop runs (basp_jax.ring): one (query piece, key piece) attention with its
log-sum-exp, and that piece's gradients from the whole attention's output and log-sum-exp.

- blockwise: pure JAX (CPU, GPUs before sm80);
- pallas: our Triton kernel (basp_jax.flash): any key offset, documents read in place;
- cudnn: cuDNN's kernels (basp_jax.cudnn_call) wherever a hop is one of the shapes its masks
  express. Under a causal mask a hop is the diagonal (the queries' own piece: causal), a piece
  wholly before the queries (every key) or wholly after them (none); which of the last two is
  known only on the device (it depends on the ring rank), so one kernel under cuDNN's padding
  mask serves both, with all of the queries or none (no conditional: a GPU resolves one on the
  host). With packed documents a piece wholly before the queries shares at most one document
  with them (documents are contiguous: two that both spanned the gap would overlap): the
  queries' first and the keys' last, when their ids are equal. The padding mask takes a row's
  first n queries and first m keys, so the keys run reversed (their order does not matter
  without a causal mask). Rows outside the lengths get output 0 and log-sum-exp -inf, and
  their gradients are zeroed, whatever the kernel leaves there. The diagonal with documents,
  every hop with documents without a causal mask, and any hop cuDNN refuses while it is
  traced run the Pallas kernel (`blocks`, `interpret`).
cuDNN's statistics are the same log-sum-exp as ours (natural log of the scaled scores) laid out
[b, hq, sq] where ours is [b, sq, hq]: transposed on the way in and out.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import cudnn_call
from .blockwise import blockwise_attention_vjp, blockwise_attention_with_lse
from .flash import FlashBlocks, flash_attention_vjp, flash_attention_with_lse

HOP_KERNELS = ("blockwise", "pallas", "cudnn")
# Each hop runs under a named scope of its shape, so a compiled program's report tells which
# kernel each kind of hop runs (basp_jax.compiled.hlo.ring_hop_kernels).
HOP_SCOPES = {"diagonal": "ring_hop_diagonal", "off_diagonal": "ring_hop_off_diagonal",
              "unmasked": "ring_hop_unmasked"}


def hop_shape(*, causal: bool, diagonal: bool) -> str:
    """A hop's shape: the queries' own piece under a causal mask, another piece under it, or
    any piece without one."""
    if not causal:
        return "unmasked"
    return "diagonal" if diagonal else "off_diagonal"


class HopKernel(NamedTuple):
    """Which kernel a ring's hops run, and the Pallas kernel's tiles and mode (its own hops, or
    the hops cuDNN's masks cannot express)."""

    name: str = "blockwise"
    blocks: FlashBlocks | None = None
    interpret: bool = False

    @property
    def split(self) -> bool:
        """Whether dq's kernel runs apart from dk/dv's (Pallas): the ring then sums dq over all
        hops first (basp_jax.ring._ring_attention_bwd)."""
        return self.name == "pallas"

    def route(self, *, causal: bool, diagonal: bool, documents: bool) -> str:
        """The kernel one hop runs: blockwise, pallas, or cuDNN's "causal" (the diagonal),
        "full" (no mask) or "off_diagonal" (a piece before the queries or after them, told
        apart on the device)."""
        if self.name != "cudnn":
            return self.name
        if documents and (diagonal or not causal):
            return "pallas"
        if not causal:
            return "full"
        return "causal" if diagonal else "off_diagonal"


def forward(kernel: HopKernel, q, k, v, *, causal: bool, block_size: int, diagonal: bool,
            q_segment_ids=None, k_segment_ids=None, k_shift=0):
    """One hop: (out [b, sq, hq, d], lse [b, sq, hq] float32)."""
    with jax.named_scope(HOP_SCOPES[hop_shape(causal=causal, diagonal=diagonal)]):
        return _forward(kernel, q, k, v, causal=causal, block_size=block_size,
                        diagonal=diagonal, q_segment_ids=q_segment_ids,
                        k_segment_ids=k_segment_ids, k_shift=k_shift)


def _forward(kernel: HopKernel, q, k, v, *, causal, block_size, diagonal, q_segment_ids,
             k_segment_ids, k_shift):
    seg = dict(q_segment_ids=q_segment_ids, k_segment_ids=k_segment_ids, k_shift=k_shift)
    route = _checked(kernel.route(causal=causal, diagonal=diagonal,
                                  documents=q_segment_ids is not None), q, k, v)
    if route == "blockwise":
        return blockwise_attention_with_lse(q, k, v, causal=causal, block_size=block_size, **seg)
    if route == "pallas":
        return flash_attention_with_lse(q, k, v, causal=causal, blocks=kernel.blocks,
                                        interpret=kernel.interpret, **seg)
    if route in ("causal", "full"):
        out, stats = cudnn_call.forward(q, k, v, mask="causal" if route == "causal" else "none")
        return out, _lse(stats)
    return _off_diagonal_forward(q, k, v, q_segment_ids, k_segment_ids, k_shift)


def backward(kernel: HopKernel, q, k, v, out, lse, d_out, *, causal: bool, block_size: int,
             diagonal: bool, wrt: str = "qkv", q_segment_ids=None, k_segment_ids=None,
             k_shift=0):
    """One hop's (dq, dk, dv) from the whole attention's out, lse and d_out. wrt="q" or "kv"
    (the Pallas kernel only) runs only dq's kernel or dk/dv's (the others None)."""
    with jax.named_scope(HOP_SCOPES[hop_shape(causal=causal, diagonal=diagonal)]):
        return _backward(kernel, q, k, v, out, lse, d_out, causal=causal,
                         block_size=block_size, diagonal=diagonal, wrt=wrt,
                         q_segment_ids=q_segment_ids, k_segment_ids=k_segment_ids,
                         k_shift=k_shift)


def _backward(kernel: HopKernel, q, k, v, out, lse, d_out, *, causal, block_size, diagonal, wrt,
              q_segment_ids, k_segment_ids, k_shift):
    seg = dict(q_segment_ids=q_segment_ids, k_segment_ids=k_segment_ids, k_shift=k_shift)
    route = _checked(kernel.route(causal=causal, diagonal=diagonal,
                                  documents=q_segment_ids is not None), q, k, v)
    if route == "pallas":
        return flash_attention_vjp(q, k, v, out, lse, d_out, causal=causal, blocks=kernel.blocks,
                                   interpret=kernel.interpret, wrt=wrt, **seg)
    if wrt != "qkv":
        raise ValueError(f"the {route} hop computes dq, dk and dv together")
    if route == "blockwise":
        return blockwise_attention_vjp(q, k, v, out, lse, d_out, causal=causal,
                                       block_size=block_size, **seg)
    if route in ("causal", "full"):
        return cudnn_call.backward(q, k, v, out, _stats(lse), d_out,
                                   mask="causal" if route == "causal" else "none")
    return _off_diagonal_backward(q, k, v, out, lse, d_out, q_segment_ids, k_segment_ids, k_shift)


def _checked(route: str, q, k, v) -> str:
    """`route`, or the Pallas kernel where cuDNN refuses these inputs while they are traced
    (basp_jax.cudnn_call.check: the dtype, cuDNN's version, the head_dim, the GPU), with one
    logged note per reason."""
    if route not in ("causal", "full", "off_diagonal"):
        return route
    try:
        cudnn_call.check(q, k, v, mask="padding", packed=False)
    except (NotImplementedError, RuntimeError) as e:
        cudnn_call.note_refusal(e, q, "in ring attention its hops run the Pallas kernel", __name__)
        return "pallas"
    return route


def _lse(stats):
    return jnp.swapaxes(stats, 1, 2)  # cuDNN's [b, hq, sq] -> ours [b, sq, hq]


def _stats(lse):
    return jnp.swapaxes(lse, 1, 2)


def _lengths(q, k, q_seg, k_seg, k_shift):
    """(queries, keys) per row that an off-diagonal hop's padding mask takes, and the masks
    [b, sq] of those queries and [b, sk] of those keys (in _flip's order). The whole key piece
    before the queries: every query and key, or with packed documents the one document the pieces
    share (the queries' first run and the keys' last, when their ids are equal); after them
    (k_shift > 0): none (the kernel still gets at least one key per row)."""
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    before = jnp.asarray(k_shift) < 0
    if q_seg is None:
        queries = jnp.full((b,), sq, jnp.int32)
        keys = jnp.full((b,), sk, jnp.int32)
    else:
        first, last = q_seg[:, :1], k_seg[:, -1:]
        shared = first[:, 0] == last[:, 0]
        queries = jnp.where(shared, jnp.sum(q_seg == first, axis=1), 0).astype(jnp.int32)
        keys = jnp.sum(k_seg == last, axis=1).astype(jnp.int32)
    queries = jnp.where(before, queries, 0)
    inside = jnp.arange(sq)[None] < queries[:, None]
    seen = jnp.arange(sk)[None] < jnp.where(queries > 0, keys, 0)[:, None]
    return (queries, jnp.maximum(keys, 1)), inside, seen


def _flip(q_seg):
    """The keys' order for the padding mask: reversed with packed documents (their last
    document first), as they are without (every key counts)."""
    return (lambda x: x[:, ::-1]) if q_seg is not None else (lambda x: x)


def _off_diagonal_forward(q, k, v, q_seg, k_seg, k_shift):
    """An off-diagonal hop, one padding-mask kernel whichever side the key piece lies on (no
    conditional: the side is known only on the device); with documents the keys reversed, so
    that their last document comes first. Rows outside the lengths are masked whatever the
    kernel wrote."""
    lengths, inside, _ = _lengths(q, k, q_seg, k_seg, k_shift)
    flip = _flip(q_seg)
    out, stats = cudnn_call.forward(q, flip(k), flip(v), mask="padding", lengths=lengths)
    return (jnp.where(inside[:, :, None, None], out, 0).astype(q.dtype),
            jnp.where(inside[:, :, None], _lse(stats), -jnp.inf))


def _off_diagonal_backward(q, k, v, out, lse, d_out, q_seg, k_seg, k_shift):
    lengths, inside, seen = _lengths(q, k, q_seg, k_seg, k_shift)
    inside, seen = inside[:, :, None, None], seen[:, :, None, None]
    # rows outside the lengths are masked on the way in and out, whatever the kernel does with
    # them (leaves them unwritten, say): the other queries' rows of d_out, and of the gradients
    flip = _flip(q_seg)
    dq, dk, dv = cudnn_call.backward(q, flip(k), flip(v), out, _stats(lse),
                                     jnp.where(inside, d_out, 0).astype(d_out.dtype),
                                     mask="padding", lengths=lengths)
    dk, dv = (flip(jnp.where(seen, x, 0).astype(x.dtype)) for x in (dk, dv))
    return jnp.where(inside, dq, 0).astype(q.dtype), dk, dv
