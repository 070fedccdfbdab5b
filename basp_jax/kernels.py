"""Local (single-device) attention kernels run inside the shard_map after the head exchange.

All take q [b, s, hq, d], k/v [b, s, hkv, d] (hq a multiple of hkv, grouped-query order: query
head h reads kv head h // (hq // hkv)) and optional segment_ids [b, s], and return [b, s, hq, d].

- "xla":       jax.nn.dot_product_attention with the XLA implementation (materialises S x S).
- "cudnn":     the same API with cuDNN flash attention (GPU, bf16/fp16).
- "pallas":    our flash attention in Pallas/Triton (basp_jax.flash; any GPU from sm80), fused
               forward and backward, segment ids (packed documents) and grouped-query heads read
               in place, tiles by the GPU's shared memory. On CPU it runs in interpret mode
               (tests). It is also the per-hop kernel of ring attention on such GPUs.
- "blockwise": online-softmax flash attention in pure JAX with a hand-written backward pass;
               memory grows with S * block, not S^2, so long sequences run on CPU. Key blocks
               that no query of a block can see (causal future, other documents) are skipped.

"auto" on a GPU from sm80 (Ampere) takes a fused kernel whenever one applies: cuDNN for unpacked
half-precision input (its fastest path), Pallas for packed input (cuDNN would take the segment
mask as a dense [b, 1, S, S] bias) and for what cuDNN refuses; on an older GPU (the T4, sm75),
on CPU and for what neither takes: blockwise from BLOCKWISE_MIN_SEQ tokens, else xla (bf16 on a
pre-Ampere GPU, and float16 on CPU: blockwise always, since the xla kernel's dot does not compile
there). Which GPU runs what: gpu_kernels, by compute capability.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from . import gpus
from .flash import FlashBlocks, flash_attention, flash_blocks
from .registry import Registry

AUTO = "auto"  # not a kernel: resolve_impl's choice among them
AUTO_DOC = ("on a GPU from sm80 cudnn for unpacked, pallas for packed data; else, and on a T4 "
            "(sm75), blockwise from 2048 tokens or in bf16, else xla")
# Below this full sequence length the S x S scores of the xla kernel are cheap enough.
BLOCKWISE_MIN_SEQ = 2048
DEFAULT_BLOCK = 512


def _runs_anywhere(platform, capability, dtype) -> str | None:
    return None


def _takes_any(q, full_seq_len) -> str | None:
    return None


def _no_options(platform: str, block_size: int, capability) -> dict:
    return {}


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A local attention kernel and what it supports: the one place that knows it.

    fn(q, k, v, *, causal, segment_ids=None, **options) -> out (the module docstring's shapes).
    supports(platform, capability, dtype): None where it runs (capability: a CUDA GPU's, None:
        unknown; dtype None: any), else why not and what to use, one line naming `impl=`.
    accepts(q, full_seq_len): None when it takes inputs of this shape, else why not.
    auto(q, full_seq_len, platform, has_segments): whether "auto" wants it where it runs and
        takes the input; auto_rank: the order "auto" asks (None: auto never picks it).
    options(platform, block_size, capability): the keyword arguments attention() passes fn.
    doc: what the config reference says of it ("" for none).
    """

    fn: Callable
    supports: Callable[..., str | None] = _runs_anywhere
    accepts: Callable[..., str | None] = _takes_any
    auto: Callable[..., bool] = lambda q, full_seq_len, platform, has_segments: True
    auto_rank: int | None = None
    options: Callable[..., dict] = _no_options
    doc: str = ""

    def bind(self, platform: str, block_size: int = DEFAULT_BLOCK,
             capability: tuple[int, int] | None = None) -> Callable:
        """fn with the options it takes on `platform` (the mesh's: compiling for a GPU topology
        from a CPU host must not fall back to Pallas's interpret mode) and GPU generation."""
        options = self.options(platform, block_size, capability)
        return functools.partial(self.fn, **options) if options else self.fn


# Every kernel registers itself below its function; "auto" resolves among them (resolve_impl).
KERNELS: Registry[Kernel] = Registry("attention impl")


def impl_names() -> tuple[str, ...]:
    """What `impl=` (and model.attn_impl) takes: "auto" and every registered kernel."""
    return (AUTO, *KERNELS.names())


def describe() -> str:
    """The choices as the config reference lists them: 'auto (...), xla, cudnn (GPU, ...), ...'."""
    return KERNELS.describe((AUTO, AUTO_DOC))


def _segment_mask(segment_ids: jax.Array | None) -> jax.Array | None:
    if segment_ids is None:
        return None
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [b, 1, s, s]


def xla_attention(q, k, v, *, causal: bool, segment_ids=None):
    return jax.nn.dot_product_attention(
        q, k, v, mask=_segment_mask(segment_ids), is_causal=causal, implementation="xla"
    )


def cudnn_attention(q, k, v, *, causal: bool, segment_ids=None):
    # cuDNN takes a boolean mask as a bias, i.e. it materialises [b, 1, s, s] for packed input.
    return jax.nn.dot_product_attention(
        q, k, v, mask=_segment_mask(segment_ids), is_causal=causal, implementation="cudnn"
    )


def _cudnn_runs(platform: str, capability, dtype) -> str | None:
    if platform != "gpu":
        return f"impl='cudnn' needs a GPU but the mesh is on {platform}; use 'auto'"
    return _fused_runs("cudnn", platform, capability)


def cudnn_supported(q: jax.ShapeDtypeStruct, platform: str) -> bool:
    """Whether cuDNN flash attention accepts these inputs (GPU, half precision, head_dim <= 128)."""
    head_dim = q.shape[-1]
    return (
        platform == "gpu"
        and q.dtype in (jnp.bfloat16, jnp.float16)
        and head_dim <= 128
        and head_dim % 8 == 0
    )


PALLAS_MAX_HEAD_DIM = 256


def pallas_supported(q: jax.ShapeDtypeStruct, full_seq_len: int) -> str | None:
    """None when the Pallas kernel takes these inputs, else why not (one line). Any sequence
    length: the kernel pads to whole blocks."""
    if q.shape[-1] > PALLAS_MAX_HEAD_DIM:
        return f"the pallas kernel takes head_dim <= {PALLAS_MAX_HEAD_DIM}, got {q.shape[-1]}"
    return None


# cuDNN's flash attention (its frontend refuses SDPA below Ampere) and Triton, under the Pallas
# kernel (XLA: "Triton support is only enabled for Ampere GPUs (compute capability 8.0) and up"),
# need sm80. A deviceless compile for a T4 does build a cuDNN custom call: cuDNN refuses it on the
# device, so it is refused here, before compiling.
FUSED_MIN_CC = (8, 0)


def _fused_runs(name: str, platform: str, capability) -> str | None:
    """Why a fused (cuDNN or Triton) kernel does not run on this GPU, or None."""
    if platform == "gpu" and capability is not None and tuple(capability) < FUSED_MIN_CC:
        return (f"impl={name!r} needs a GPU of compute capability 8.0 (Ampere) or newer and this "
                f"one is {_sm(capability)}; use 'auto', 'blockwise' or 'xla'")
    return None


# The xla kernel (jax.nn.dot_product_attention) asks for a half x half -> f32 dot algorithm.
# Below sm80 XLA has no bf16 one (a T4 compile fails with "Unsupported algorithm ...
# ALG_DOT_BF16_BF16_F32"), and the CPU has no f16 one ("The precision 'F16_F16_F32' is not
# supported by dot_general on CPU"); the blockwise kernel's plain dots compile in both (on a T4
# XLA runs bf16 ones in f32: no bf16 tensor cores).
BF16_DOT_MIN_CC = gpus.BF16_MIN_CC


def _xla_dot_unsupported(platform: str, capability, dtype) -> str | None:
    """Why the xla kernel's dot does not compile here in `dtype`, or None."""
    if dtype is None:
        return None
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16 and platform == "gpu" and capability is not None and \
            tuple(capability) < BF16_DOT_MIN_CC:
        return f"does not compile for {_sm(capability)} (XLA has no bf16 dot below sm80)"
    if dtype == jnp.float16 and platform == "cpu":
        return "does not compile on CPU (XLA's CPU backend has no f16 x f16 -> f32 dot)"
    return None


def _xla_runs(platform: str, capability, dtype) -> str | None:
    if why := _xla_dot_unsupported(platform, capability, dtype):
        return (f"impl='xla' in {jnp.dtype(dtype).name} {why}; use 'auto' or 'blockwise', or "
                "float32 compute")
    return None


KERNELS.register("xla", Kernel(xla_attention, supports=_xla_runs, auto_rank=3))
KERNELS.register("cudnn", Kernel(
    cudnn_attention, supports=_cudnn_runs, auto_rank=0, doc="GPU, sm80+",
    # its fastest path; packed input would cost a dense [b, 1, S, S] mask
    auto=lambda q, full_seq_len, platform, has_segments: (
        cudnn_supported(q, platform) and not has_segments)))


def device_capability(device) -> tuple[int, int] | None:
    """A CUDA device's compute capability, e.g. (7, 5) for a T4 (a deviceless compile target's
    devices have it too); None for other devices."""
    raw = getattr(device, "compute_capability", None)  # "8.0" on CUDA devices
    if getattr(device, "platform", None) != "gpu" or not raw:
        return None
    try:
        major, minor = (int(x) for x in str(raw).split(".")[:2])
    except ValueError:
        return None
    return major, minor


def gpu_kernels(capability: tuple[int, int] | None) -> tuple[str, ...]:
    """The registered kernels a GPU of this compute capability runs (None: unknown, e.g. a
    non-CUDA GPU; assumed to run all)."""
    return tuple(name for name, k in KERNELS.items() if k.supports("gpu", capability, None) is None)


def _sm(capability) -> str:
    return f"sm{capability[0]}{capability[1]}"


def kernel_unsupported(impl: str, platform: str, capability: tuple[int, int] | None,
                       dtype=None) -> str | None:
    """None when `impl` runs on this platform/GPU in `dtype`, else why not and what to use (one
    line). "auto" always runs."""
    if impl == AUTO:
        return None
    return KERNELS.get(impl).supports(platform, capability, dtype)


def resolve_impl(impl: str, q_shape_dtype, full_seq_len: int, platform: str, has_segments: bool,
                 capability: tuple[int, int] | None = None) -> str:
    """Turn "auto" into a concrete kernel: on a GPU from sm80 cudnn (unpacked) or pallas (packed,
    or what cuDNN refuses) where they apply; blockwise for long S (and for bf16 below sm80);
    else xla. capability: the GPU's compute capability (device_capability), None: any GPU."""
    if impl != AUTO and impl not in KERNELS:
        raise ValueError(f"unknown attention impl {impl!r}; use one of {', '.join(impl_names())}")
    if impl != AUTO:
        kernel = KERNELS.get(impl)
        if why := kernel.supports(platform, capability, q_shape_dtype.dtype):
            raise ValueError(why)
        if why := kernel.accepts(q_shape_dtype, full_seq_len):
            raise ValueError(f"impl={impl!r}: {why}; use 'auto' or 'blockwise'")
        return impl
    # "auto": the first kernel, by auto_rank, that runs here, takes the input and wants it
    ranked = sorted((k for k in KERNELS.items() if k[1].auto_rank is not None),
                    key=lambda k: k[1].auto_rank)
    for name, kernel in ranked:
        if kernel.supports(platform, capability, q_shape_dtype.dtype) is None \
                and kernel.accepts(q_shape_dtype, full_seq_len) is None \
                and kernel.auto(q_shape_dtype, full_seq_len, platform, has_segments):
            return name
    return AUTO_FALLBACK


def pallas_blocks(platform: str, block_size: int, capability) -> FlashBlocks:
    """The Pallas kernel's tiles: on a GPU by its shared memory (basp_jax.gpus); on CPU
    (interpret mode, tests) `block_size` for every block."""
    if platform != "gpu":
        return FlashBlocks.square(block_size)
    return flash_blocks(gpus.shared_memory_per_block(capability))


def pallas_attention(q, k, v, *, causal: bool, segment_ids=None,
                     blocks: FlashBlocks | None = None, interpret: bool | None = None):
    """Our Pallas/Triton flash attention (basp_jax.flash): kv heads read in place. Off a GPU it
    runs in interpret mode (slow: for tests)."""
    if interpret is None:
        interpret = jax.devices()[0].platform != "gpu"
    return flash_attention(q, k, v, causal=causal, segment_ids=segment_ids, blocks=blocks,
                           interpret=interpret)


def _pallas_options(platform: str, block_size: int, capability) -> dict:
    return {"interpret": platform != "gpu",
            "blocks": pallas_blocks(platform, block_size, capability)}


KERNELS.register("pallas", Kernel(
    pallas_attention, supports=lambda platform, capability, dtype: _fused_runs(
        "pallas", platform, capability),
    accepts=lambda q, full_seq_len: pallas_supported(q, full_seq_len), auto_rank=1,
    auto=lambda q, full_seq_len, platform, has_segments: platform == "gpu",  # CPU: interpret
    options=_pallas_options, doc="Triton, GPU, sm80+"))


def ring_hop_kernel(impl: str, platform: str, capability, head_dim: int,
                    block_size: int) -> tuple[FlashBlocks, bool] | None:
    """The Pallas kernel's (tiles, interpret) for a ring's hops, or None for the blockwise one.
    On a GPU from sm80 every hop is the fused kernel unless impl='blockwise' asks otherwise; on
    CPU only impl='pallas' takes it (interpret mode is slow: tests)."""
    if impl == "blockwise" or head_dim > PALLAS_MAX_HEAD_DIM:
        return None
    if platform == "gpu" and _fused_runs("pallas", platform, capability) is None:
        return pallas_blocks(platform, block_size, capability), False
    if impl == "pallas" and platform != "gpu":
        return pallas_blocks(platform, block_size, capability), True
    return None


# ----------------------------------------------------------------------------------------------
# Blockwise (flash) attention.
#
# Layout inside: q as [b, hkv, g, sq, d] (g = hq // hkv query heads per kv head), k/v [b, hkv, sk, d].
# Sequences are padded to a multiple of the block size; padded keys are masked out and padded
# query rows are sliced off. Key positions are shifted by `k_shift` relative to query positions
# (0 for self-attention; a ring step attends to another chunk of the sequence). Masked scores
# are excluded with `where`; a row that sees no key gets output 0 and lse = -inf, and loops only
# visit the key blocks a query block can see, so fully masked (causal-future) chunks cost nothing.


def _block_mask(qi, kj, block_q, block_k, k_len, k_shift, causal, q_seg, k_seg):
    """[b or 1, 1, 1, block_q, block_k] boolean: key valid, causal, same segment."""
    k_local = kj * block_k + jnp.arange(block_k)
    mask = jnp.broadcast_to(k_local[None, :] < k_len, (block_q, block_k))
    if causal:
        q_pos = qi * block_q + jnp.arange(block_q)
        mask = mask & (q_pos[:, None] >= k_shift + k_local[None, :])
    mask = mask[None]
    if q_seg is not None:
        mask = mask & (q_seg[:, :, None] == k_seg[:, None, :])
    return mask[:, None, None]


def _kv_block_end(qi, num_k, block_q, block_k, k_shift, causal):
    """Key blocks [0, end) that query block qi can see."""
    if not causal:
        return num_k
    last_visible = (qi + 1) * block_q - 1 - k_shift  # local index of the last key it may see
    return jnp.clip(last_visible // block_k + 1, 0, num_k)


def _q_block_start(kj, num_q, block_q, block_k, k_shift, causal):
    """First query block that can see key block kj."""
    if not causal:
        return 0
    return jnp.clip((k_shift + kj * block_k) // block_q, 0, num_q)


def segment_overlap(q_seg, k_seg, block_q, block_k):
    """[num_q, num_k] boolean: whether any query of block qi may share a segment with any key of
    block kj in some row, from each block's min and max segment id (disjoint ranges share none).

    Exact for any segment ids; it prunes well when they are non-decreasing along the sequence,
    as packing makes them (documents are contiguous: the data pipeline's cumulative count of
    eos tokens, and each contiguous piece of a zig-zag or ring chunk).
    """
    b = q_seg.shape[0]
    q = q_seg.reshape(b, -1, block_q)
    k = k_seg.reshape(b, -1, block_k)
    q_min, q_max = q.min(-1)[:, :, None], q.max(-1)[:, :, None]
    k_min, k_max = k.min(-1)[:, None, :], k.max(-1)[:, None, :]
    return jnp.any((k_max >= q_min) & (k_min <= q_max), axis=0)


def _first_last(row):
    """[first, last + 1) of the True entries of a boolean vector; [0, 0) when there are none."""
    n = row.shape[0]
    any_ = row.any()
    first = jnp.where(any_, jnp.argmax(row), 0)
    end = jnp.where(any_, n - jnp.argmax(row[::-1]), 0)
    return first, end


def _kv_block_range(qi, num_k, block_q, block_k, k_shift, causal, overlap):
    """Key blocks [start, end) that query block qi can see: causally and, with segment ids, the
    blocks whose segments its own can meet (packed documents: the blocks of its documents)."""
    end = _kv_block_end(qi, num_k, block_q, block_k, k_shift, causal)
    if overlap is None:
        return 0, end
    first, last = _first_last(overlap[qi])
    return first, jnp.minimum(end, last)


def _q_block_range(kj, num_q, block_q, block_k, k_shift, causal, overlap):
    """Query blocks [start, end) that can see key block kj."""
    start = _q_block_start(kj, num_q, block_q, block_k, k_shift, causal)
    if overlap is None:
        return start, num_q
    first, last = _first_last(overlap[:, kj])
    return jnp.maximum(start, first), last


def _slice(x, start, size, axis):
    return lax.dynamic_slice_in_dim(x, start * size, size, axis=axis)


def _scores(q_blk, k_blk, scale):
    return jnp.einsum("bhgqd,bhkd->bhgqk", q_blk, k_blk, preferred_element_type=jnp.float32) * scale


def _flash_forward(q, k, v, q_seg, k_seg, k_shift, *, causal, k_len, block_q, block_k, scale):
    b, hkv, g, sq, d = q.shape
    num_q, num_k = sq // block_q, k.shape[2] // block_k
    overlap = None if q_seg is None else segment_overlap(q_seg, k_seg, block_q, block_k)

    def row(qi):
        q_blk = _slice(q, qi, block_q, 3)
        q_seg_blk = None if q_seg is None else _slice(q_seg, qi, block_q, 1)

        def step(kj, carry):
            acc, m, l = carry
            k_blk, v_blk = _slice(k, kj, block_k, 2), _slice(v, kj, block_k, 2)
            k_seg_blk = None if k_seg is None else _slice(k_seg, kj, block_k, 1)
            mask = _block_mask(qi, kj, block_q, block_k, k_len, k_shift, causal, q_seg_blk, k_seg_blk)
            s = jnp.where(mask, _scores(q_blk, k_blk, scale), -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            # Rows that have seen no key yet keep m = -inf; shift by 0 there to avoid inf - inf.
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.where(mask, jnp.exp(s - shift[..., None]), 0.0)
            alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - shift, -jnp.inf))
            l = alpha * l + p.sum(-1)
            pv = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(v.dtype), v_blk,
                            preferred_element_type=jnp.float32)
            return alpha[..., None] * acc + pv, m_new, l

        init = (
            jnp.zeros((b, hkv, g, block_q, d), jnp.float32),
            jnp.full((b, hkv, g, block_q), -jnp.inf, jnp.float32),
            jnp.zeros((b, hkv, g, block_q), jnp.float32),
        )
        start, end = _kv_block_range(qi, num_k, block_q, block_k, k_shift, causal, overlap)
        acc, m, l = lax.fori_loop(start, jnp.maximum(start, end), step, init)
        seen = l > 0
        out = acc / jnp.where(seen, l, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
        return out.astype(q.dtype), lse

    out, lse = lax.map(row, jnp.arange(num_q))  # [num_q, b, hkv, g, block_q, (d)]
    out = jnp.moveaxis(out, 0, 3).reshape(b, hkv, g, sq, d)
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, hkv, g, sq)
    return out, lse


def _flash_backward(q, k, v, q_seg, k_seg, k_shift, out, lse, d_out, d_lse, *, causal, k_len,
                    block_q, block_k, scale):
    b, hkv, g, sq, d = q.shape
    num_q, num_k = sq // block_q, k.shape[2] // block_k
    overlap = None if q_seg is None else segment_overlap(q_seg, k_seg, block_q, block_k)
    # d lse / d score = p, so a cotangent on lse enters exactly like -delta.
    delta = jnp.einsum("bhgqd,bhgqd->bhgq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    delta = delta - d_lse

    def probs_and_dscores(qi, kj):
        q_blk, do_blk = _slice(q, qi, block_q, 3), _slice(d_out, qi, block_q, 3)
        k_blk, v_blk = _slice(k, kj, block_k, 2), _slice(v, kj, block_k, 2)
        q_seg_blk = None if q_seg is None else _slice(q_seg, qi, block_q, 1)
        k_seg_blk = None if k_seg is None else _slice(k_seg, kj, block_k, 1)
        mask = _block_mask(qi, kj, block_q, block_k, k_len, k_shift, causal, q_seg_blk, k_seg_blk)
        s = _scores(q_blk, k_blk, scale)
        p = jnp.where(mask, jnp.exp(s - _slice(lse, qi, block_q, 3)[..., None]), 0.0)
        dp = jnp.einsum("bhgqd,bhkd->bhgqk", do_blk, v_blk, preferred_element_type=jnp.float32)
        ds = p * (dp - _slice(delta, qi, block_q, 3)[..., None])
        return q_blk, do_blk, k_blk, p, ds

    # Pass A: dq, one query block at a time over the key blocks it sees.
    def dq_row(qi):
        def step(kj, dq):
            _, _, k_blk, _, ds = probs_and_dscores(qi, kj)
            return dq + jnp.einsum("bhgqk,bhkd->bhgqd", ds.astype(k.dtype), k_blk,
                                   preferred_element_type=jnp.float32)

        init = jnp.zeros((b, hkv, g, block_q, d), jnp.float32)
        start, end = _kv_block_range(qi, num_k, block_q, block_k, k_shift, causal, overlap)
        return lax.fori_loop(start, jnp.maximum(start, end), step, init)

    # Pass B: dk and dv, one key block at a time over the query blocks that see it.
    def dkv_col(kj):
        def step(qi, carry):
            dk, dv = carry
            q_blk, do_blk, _, p, ds = probs_and_dscores(qi, kj)
            dv = dv + jnp.einsum("bhgqk,bhgqd->bhkd", p.astype(d_out.dtype), do_blk,
                                 preferred_element_type=jnp.float32)
            dk = dk + jnp.einsum("bhgqk,bhgqd->bhkd", ds.astype(q.dtype), q_blk,
                                 preferred_element_type=jnp.float32)
            return dk, dv

        zeros = jnp.zeros((b, hkv, block_k, d), jnp.float32)
        start, end = _q_block_range(kj, num_q, block_q, block_k, k_shift, causal, overlap)
        return lax.fori_loop(start, jnp.maximum(start, end), step, (zeros, zeros))

    dq = jnp.moveaxis(lax.map(dq_row, jnp.arange(num_q)), 0, 3).reshape(q.shape) * scale
    dk, dv = lax.map(dkv_col, jnp.arange(num_k))
    dk = jnp.moveaxis(dk, 0, 2).reshape(k.shape) * scale
    dv = jnp.moveaxis(dv, 0, 2).reshape(v.shape)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _flash(q, k, v, q_seg, k_seg, k_shift, causal, k_len, block_q, block_k, scale):
    return _flash_forward(q, k, v, q_seg, k_seg, k_shift, causal=causal, k_len=k_len,
                          block_q=block_q, block_k=block_k, scale=scale)


def _flash_fwd(q, k, v, q_seg, k_seg, k_shift, causal, k_len, block_q, block_k, scale):
    out, lse = _flash_forward(q, k, v, q_seg, k_seg, k_shift, causal=causal, k_len=k_len,
                              block_q=block_q, block_k=block_k, scale=scale)
    return (out, lse), (q, k, v, q_seg, k_seg, k_shift, out, lse)


def _flash_bwd(causal, k_len, block_q, block_k, scale, residuals, cotangents):
    q, k, v, q_seg, k_seg, k_shift, out, lse = residuals
    d_out, d_lse = cotangents
    dq, dk, dv = _flash_backward(q, k, v, q_seg, k_seg, k_shift, out, lse, d_out, d_lse,
                                 causal=causal, k_len=k_len, block_q=block_q, block_k=block_k,
                                 scale=scale)
    return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_seq(x, length, axis, value=0):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _grouped(q, k, v, q_segment_ids, k_segment_ids, block_size):
    """q, k, v [b, s, h, d] padded to whole blocks in the kernels' layout (q [b, hkv, g, sq, d],
    k/v [b, hkv, sk, d]), the padded segment ids, and the block sizes."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    block_q, block_k = min(block_size, sq), min(block_size, sk)
    sq_pad, sk_pad = -(-sq // block_q) * block_q, -(-sk // block_k) * block_k
    q = _pad_seq(q, sq_pad, 1)
    k, v = _pad_seq(k, sk_pad, 1), _pad_seq(v, sk_pad, 1)
    q_seg = k_seg = None
    if q_segment_ids is not None:
        q_seg = _pad_seq(q_segment_ids.astype(jnp.int32), sq_pad, 1, value=-1)
        k_seg = _pad_seq(k_segment_ids.astype(jnp.int32), sk_pad, 1, value=-1)
    qg = _group_queries(q, hkv)
    kg, vg = (x.transpose(0, 2, 1, 3) for x in (k, v))
    return qg, kg, vg, q_seg, k_seg, block_q, block_k


def _group_queries(x, hkv):
    """[b, s, hq, d] -> [b, hkv, g, s, d] (or [b, s, hq] -> [b, hkv, g, s])."""
    b, s, hq = x.shape[:3]
    x = x.reshape(b, s, hkv, hq // hkv, *x.shape[3:])
    return jnp.moveaxis(x, 1, 3)


def _ungroup_queries(x, sq):
    """The inverse of _group_queries, with the padded rows beyond sq sliced off."""
    b, hkv, g, s = x.shape[:4]
    return jnp.moveaxis(x, 3, 1).reshape(b, s, hkv * g, *x.shape[4:])[:, :sq]


def blockwise_attention_with_lse(q, k, v, *, causal: bool, q_segment_ids=None, k_segment_ids=None,
                                 k_shift=0, block_size: int = DEFAULT_BLOCK):
    """Flash attention in pure JAX, returning (out [b, sq, hq, d], lse [b, sq, hq] float32).

    Key j sits at position k_shift + j relative to query 0 (causal masking uses it). Both outputs
    are differentiable, so chunks of a sequence can be merged by their log-sum-exp (ring attention).
    Memory is O(S x block) in forward and backward.
    """
    sq, d = q.shape[1], q.shape[3]
    qg, kg, vg, q_seg, k_seg, block_q, block_k = _grouped(q, k, v, q_segment_ids,
                                                          k_segment_ids, block_size)
    shift = jnp.asarray(k_shift, jnp.int32)
    out, lse = _flash(qg, kg, vg, q_seg, k_seg, shift, causal, k.shape[1], block_q, block_k,
                      1.0 / math.sqrt(d))
    return _ungroup_queries(out, sq), _ungroup_queries(lse, sq)


def blockwise_attention_vjp(q, k, v, out, lse, d_out, *, causal: bool, q_segment_ids=None,
                            k_segment_ids=None, k_shift=0, block_size: int = DEFAULT_BLOCK):
    """(dq, dk, dv): the gradients through the keys k, v's share of a larger attention of the
    queries q, whose final output, log-sum-exp and output cotangent are out, lse and d_out
    ([b, sq, hq, d], [b, sq, hq] float32, [b, sq, hq, d]). Flash attention's backward with the
    whole attention's lse gives each share's probabilities exactly, so a ring attention sums
    these over its chunks without keeping any chunk's partial output (basp_jax.ring)."""
    sq, sk, d = q.shape[1], k.shape[1], q.shape[3]
    hkv = k.shape[2]
    qg, kg, vg, q_seg, k_seg, block_q, block_k = _grouped(q, k, v, q_segment_ids,
                                                          k_segment_ids, block_size)
    sq_pad = qg.shape[3]
    # padded query rows: zero cotangent, lse 0 (finite), so they contribute nothing
    og, dog = (_group_queries(_pad_seq(x, sq_pad, 1), hkv) for x in (out, d_out))
    lseg = _group_queries(_pad_seq(lse.astype(jnp.float32), sq_pad, 1), hkv)
    dq, dk, dv = _flash_backward(qg, kg, vg, q_seg, k_seg, jnp.asarray(k_shift, jnp.int32), og,
                                 lseg, dog, jnp.zeros_like(lseg), causal=causal, k_len=sk,
                                 block_q=block_q, block_k=block_k, scale=1.0 / math.sqrt(d))
    dk, dv = (x.transpose(0, 2, 1, 3)[:, :sk] for x in (dk, dv))
    return _ungroup_queries(dq, sq), dk, dv


def blockwise_attention(q, k, v, *, causal: bool, segment_ids=None, block_size: int = DEFAULT_BLOCK):
    """Flash self-attention in pure JAX: O(S * block) memory in forward and backward."""
    out, _ = blockwise_attention_with_lse(q, k, v, causal=causal, q_segment_ids=segment_ids,
                                          k_segment_ids=segment_ids, block_size=block_size)
    return out


KERNELS.register("blockwise", Kernel(
    blockwise_attention, auto_rank=2, doc="memory-efficient, pure JAX",
    auto=lambda q, full_seq_len, platform, has_segments: full_seq_len >= BLOCKWISE_MIN_SEQ,
    options=lambda platform, block_size, capability: {"block_size": block_size}))
# What "auto" takes when no kernel above wants the input: blockwise runs everywhere.
AUTO_FALLBACK = "blockwise"
