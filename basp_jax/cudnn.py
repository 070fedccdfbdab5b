"""cuDNN's fused attention, on packed documents too.

jax.nn.dot_product_attention takes packed documents only as a boolean mask, which cuDNN reads
as a dense [b, 1, S, S] bias. On Hopper and newer cuDNN also has a packed ("ragged") layout:
each row's documents as lengths and start offsets, each attended alone (causal within itself),
no S x S buffer. `packed_layout` derives them from the segment ids inside the step: a document
is a run of equal ids, so ids must not repeat apart (the packer numbers its documents in order).
The layout holds a static number of documents per row (`bound`); a step whose rows hold more
runs the fallback kernel instead (lax.cond), so documents are never merged. Unpacked and
packed, the kernels are called below JAX's wrapper (basp_jax.cudnn_call), which vmap and the
per-host parameter mesh break.

JAX checks the GPU's compute capability while tracing, through the default backend
(`check_compute_capability` in jax._src.cudnn.fused_attention_stablehlo): a compile for a GPU
from a host without one would see no Hopper and refuse the layout (and head_dim 256).
`capability_seen_as` answers that check with the target's capability: whatever traces a step
for GPU devices wraps its whole lowering in it (the backward pass is traced after the forward's
call returns; train.program.state.TrainProgram.lower does). Both are private JAX names: FUSED
is None where a jax version lacks any of them, and the packed path is then not offered
(tests/basp_jax/test_cudnn_packed.py fails on such a jax).
"""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp
from jax import lax

from . import cudnn_call

# the named scope of the fallback kernel's call: a compiled program's report counts its kernels
# apart (basp_jax.compiled.hlo), as they run only in a step over the bound
FALLBACK_SCOPE = "over_document_bound"
PACKED_MIN_CC = (9, 0)  # cuDNN's packed layout, and head_dim up to 256: Hopper and newer
# Documents per row the packed layout holds at most (more: the fallback kernel), and where the
# data does not say. cuDNN's statistics are [rows x bound, heads, S] float32: 2 x bound /
# head_dim times q's bytes (bf16), as much as q at 64 and head_dim 128.
DOCUMENT_BOUND = 64


def layout_bound(documents_per_row: int | None) -> int:
    """The packed layout's bound: the data's most documents per row, at most DOCUMENT_BOUND."""
    return min(documents_per_row or DOCUMENT_BOUND, DOCUMENT_BOUND)


_PRIVATE = ("check_compute_capability", "is_cuda_compute_capability_equal")


def _fused_module():
    return cudnn_call.jax_cudnn_module(_PRIVATE)


FUSED = _fused_module()


def packed_supported(capability) -> bool:
    """Whether cuDNN's packed layout runs on a GPU of this compute capability with this jax."""
    return FUSED is not None and cudnn_call.FUSED is not None and capability is not None \
        and tuple(capability) >= PACKED_MIN_CC


def packed_layout(segment_ids: jax.Array, bound: int):
    """(lengths [b, bound], offsets [b, bound + 1], fits) of each row's documents, as JAX's
    cuDNN wrapper takes them: the runs of equal segment ids in order, each row's lengths and
    start offsets (within the row) first, -1 after them (so offsets' last column is -1 in a row
    that fits). fits: whether every row has at most `bound` documents (where not, the layout
    is cut and must not be used)."""
    b, s = segment_ids.shape
    starts = jnp.concatenate([jnp.ones((b, 1), bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    index = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1  # each token's document
    count = index[:, -1] + 1
    rows = jnp.arange(b)[:, None]
    where = jnp.where(starts, index, bound + 1)  # not a start: dropped below
    bounds = jnp.full((b, bound + 2), -1, jnp.int32)  # starts, then the row's end
    bounds = bounds.at[rows, where].set(jnp.arange(s, dtype=jnp.int32)[None], mode="drop")
    bounds = bounds.at[jnp.arange(b), count].set(s, mode="drop")
    inside = jnp.arange(bound + 1)[None] < count[:, None]
    offsets = jnp.where(inside, bounds[:, :bound + 1], -1)
    lengths = jnp.where(inside[:, :bound], bounds[:, 1:bound + 1] - bounds[:, :bound], -1)
    return lengths, offsets, jnp.all(count <= bound)


_PATCHING = threading.RLock()  # one lowering at a time answers for its target


@contextlib.contextmanager
def capability_seen_as(capability):
    """JAX's trace-time compute-capability checks answer for `capability` (the target's)."""
    if FUSED is None or capability is None:
        yield
        return
    with _PATCHING, _patched(tuple(capability)):
        yield


@contextlib.contextmanager
def _patched(have: tuple[int, int]):
    at_least, equal = FUSED.check_compute_capability, FUSED.is_cuda_compute_capability_equal
    FUSED.check_compute_capability = lambda c: have >= tuple(int(x) for x in c.split("."))
    FUSED.is_cuda_compute_capability_equal = lambda c: have == tuple(
        int(x) for x in c.split("."))
    try:
        yield
    finally:
        FUSED.check_compute_capability, FUSED.is_cuda_compute_capability_equal = at_least, equal


def attention(q, k, v, *, causal: bool, segment_ids=None, capability=None,
              bound: int = DOCUMENT_BOUND, fallback=None):
    """cuDNN attention (see _cudnn_attention); where cuDNN refuses the input while it is traced
    (a head_dim, a dtype, a layout its checks reject) and a fallback kernel is given, that
    kernel, with one logged note."""
    try:
        return _cudnn_attention(q, k, v, causal=causal, segment_ids=segment_ids,
                                capability=capability, bound=bound, fallback=fallback)
    except (NotImplementedError, RuntimeError) as e:
        if fallback is None:
            raise
        cudnn_call.note_refusal(e, q, "running the fallback kernel", __name__)
        return fallback(q, k, v, causal=causal, segment_ids=segment_ids)


def _cudnn_attention(q, k, v, *, causal: bool, segment_ids, capability, bound: int, fallback):
    """cuDNN attention, q [b, s, hq, d], k/v [b, s, hkv, d] -> [b, s, hq, d], through its
    kernels below JAX's wrapper (basp_jax.cudnn_call: vmap folds, no partitioning). Packed
    input on a GPU that has the packed layout (capability: the GPU's) goes through it, a step
    whose rows hold more than `bound` documents through `fallback` (an attention kernel of the
    same signature; None: cuDNN with a dense mask); before Hopper as a dense mask."""
    def dense(q, k, v):
        mask = None if segment_ids is None else \
            (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [b, 1, s, s]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                            implementation="cudnn")

    cudnn_call.raise_if_refused()  # XLA refused it while compiling an earlier program
    if segment_ids is None:
        with capability_seen_as(capability):  # a deviceless compile's target
            cudnn_call.check(q, k, v, mask="causal", packed=False)
        return cudnn_call.attention(q, k, v, mask="causal" if causal else "none")
    if not packed_supported(capability):
        return dense(q, k, v)
    with capability_seen_as(capability):  # a deviceless compile's target
        cudnn_call.check(q, k, v, mask="padding_causal", packed=bound > 1)
    lengths, offsets, fits = packed_layout(segment_ids, bound)

    def packed(q, k, v):
        return cudnn_call.attention(q, k, v, mask="padding_causal" if causal else "padding",
                                    lengths=(lengths, lengths), offsets=(offsets, offsets))

    def over_bound(q, k, v):
        with jax.named_scope(FALLBACK_SCOPE):
            if fallback is None:
                return dense(q, k, v)
            return fallback(q, k, v, causal=causal, segment_ids=segment_ids)

    return lax.cond(_everywhere(fits), packed, over_bound, q, k, v)


@jax.custom_batching.custom_vmap
def _everywhere(fits):
    """`fits`; under vmap (the per-group step's), whether it holds for every mapped instance,
    unbatched: a conditional on a batched predicate would become a select that runs both
    kernels. (Inside basp_jax.attention's shard_map the mapped axis is each device's own, so
    each device still decides for its own rows.)"""
    return fits


@_everywhere.def_vmap
def _everywhere_rule(axis_size, in_batched, fits):
    # again through _everywhere: under nested vmaps the next one out maps this result too
    return _everywhere(jnp.all(fits) if in_batched[0] else fits), False
