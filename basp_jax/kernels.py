"""Local (single-device) attention kernels run inside the shard_map after the head exchange.

All take q [b, s, hq, d], k/v [b, s, hkv, d] (hq a multiple of hkv, grouped-query order: query
head h reads kv head h // (hq // hkv)) and optional segment_ids [b, s], and return [b, s, hq, d].

- "xla":       jax.nn.dot_product_attention with the XLA implementation (materialises S x S).
- "cudnn":     cuDNN flash attention (GPU, bf16/fp16; basp_jax.cudnn, its kernels bound by
               basp_jax.cudnn_call); packed documents on Hopper and newer through
               cuDNN's packed layout (per-document lengths and offsets, no S x S mask; a step
               whose rows hold more documents than its bound runs "pallas"), before Hopper as
               a dense segment mask. Input cuDNN refuses while it is traced runs "pallas",
               with one logged note; so does every program after XLA refused to compile
               cuDNN's (train.program.compile_fallback, basp_jax.cudnn_call.refuse_for_process).
- "pallas":    our flash attention in Pallas/Triton (basp_jax.flash; any GPU from sm80), fused
               forward and backward, segment ids (packed documents) and grouped-query heads read
               in place, tiles by the GPU's shared memory. On CPU it runs in interpret mode
               (tests). It is also the per-hop kernel of ring attention on such GPUs.
- "blockwise": online-softmax flash attention in pure JAX with a hand-written backward pass;
               memory grows with S * block, not S^2, so long sequences run on CPU. Key blocks
               that no query of a block can see (causal future, other documents) are skipped.

"auto" on a GPU from sm80 (Ampere) takes a fused kernel whenever one applies: cuDNN for
half-precision input (its fastest path), packed input too from Hopper (its packed layout), Pallas
for packed input before Hopper (where cuDNN would take the segment mask as a dense [b, 1, S, S]
bias) and for what cuDNN refuses; on an older GPU (the T4, sm75),
on CPU and for what neither takes: blockwise from BLOCKWISE_MIN_SEQ tokens, else xla (bf16 on a
pre-Ampere GPU, and float16 on CPU: blockwise always, since the xla kernel's dot does not compile
there). Which GPU runs what: gpu_kernels, by compute capability.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from . import cudnn, cudnn_call, gpus
from .blockwise import DEFAULT_BLOCK, blockwise_attention
from .flash import FlashBlocks, flash_attention, flash_blocks
from .ring_hops import HopKernel
from .registry import Registry

AUTO = "auto"  # not a kernel: resolve_impl's choice among them
AUTO_DOC = ("on a GPU from sm80 cudnn (packed data: from sm90, pallas before); else, and on a "
            "T4 (sm75), blockwise from 2048 tokens or in bf16, else xla")
# Below this full sequence length the S x S scores of the xla kernel are cheap enough.
BLOCKWISE_MIN_SEQ = 2048


def _runs_anywhere(platform, capability, dtype) -> str | None:
    return None


def _takes_any(q, full_seq_len) -> str | None:
    return None


def _no_options(platform: str, block_size: int, capability, document_bound=None) -> dict:
    return {}


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A local attention kernel and what it supports: the one place that knows it.

    fn(q, k, v, *, causal, segment_ids=None, **options) -> out (the module docstring's shapes).
    supports(platform, capability, dtype): None where it runs (capability: a CUDA GPU's, None:
        unknown; dtype None: any), else why not and what to use, one line naming `impl=`.
    accepts(q, full_seq_len): None when it takes inputs of this shape, else why not.
    auto(q, full_seq_len, platform, has_segments, capability): whether "auto" wants it where
        it runs and takes the input; auto_rank: the order "auto" asks (None: auto never picks
        it).
    options(platform, block_size, capability, document_bound): the keyword arguments
        attention() passes fn (document_bound: the most documents a packed row holds, from the
        data; None: unknown).
    doc: what the config reference says of it ("" for none).
    """

    fn: Callable
    supports: Callable[..., str | None] = _runs_anywhere
    accepts: Callable[..., str | None] = _takes_any
    auto: Callable[..., bool] = lambda q, full_seq_len, platform, has_segments, capability: True
    auto_rank: int | None = None
    options: Callable[..., dict] = _no_options
    doc: str = ""

    def bind(self, platform: str, block_size: int = DEFAULT_BLOCK,
             capability: tuple[int, int] | None = None,
             document_bound: int | None = None) -> Callable:
        """fn with the options it takes on `platform` (the mesh's: compiling for a GPU topology
        from a CPU host must not fall back to Pallas's interpret mode), GPU generation and
        bound on documents per packed row."""
        options = self.options(platform, block_size, capability, document_bound)
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


def _cudnn_options(platform: str, block_size: int, capability, document_bound=None) -> dict:
    """The GPU generation (cuDNN's packed layout on Hopper and newer), the packed layout's bound
    on documents per row (basp_jax.cudnn.layout_bound) and, for a step whose rows hold more, our
    Pallas kernel."""
    if platform != "gpu":
        return {}
    return {"capability": capability, "bound": cudnn.layout_bound(document_bound),
            "fallback": KERNELS.get("pallas").bind(platform, block_size, capability)}


def _cudnn_runs(platform: str, capability, dtype) -> str | None:
    if platform != "gpu":
        return f"impl='cudnn' needs a GPU but the mesh is on {platform}; use 'auto'"
    return _fused_runs("cudnn", platform, capability)


def cudnn_supported(q: jax.ShapeDtypeStruct, platform: str, capability=None) -> bool:
    """Whether cuDNN flash attention accepts these inputs (GPU, half precision, head_dim <= 128,
    or 256 on Hopper and newer)."""
    head_dim = q.shape[-1]
    return (
        platform == "gpu"
        and q.dtype in (jnp.bfloat16, jnp.float16)
        and head_dim <= (256 if cudnn.packed_supported(capability) else 128)
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
    cudnn.attention, supports=_cudnn_runs, auto_rank=0, doc="GPU, sm80+",
    options=_cudnn_options,
    # packed input only from Hopper (its packed layout); before, cuDNN would take the
    # documents as a dense [b, 1, S, S] mask: our kernel instead
    auto=lambda q, full_seq_len, platform, has_segments, capability: (
        cudnn_supported(q, platform, capability)
        and (not has_segments or cudnn.packed_supported(capability)))))


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
    """Turn "auto" into a concrete kernel: on a GPU from sm80 cudnn (packed input from sm90) or
    pallas (packed before sm90, or what cuDNN refuses) where they apply; blockwise for long S
    (and for bf16 below sm80); else xla. capability: the GPU's compute capability (device_capability), None: any GPU."""
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
                and kernel.auto(q_shape_dtype, full_seq_len, platform, has_segments,
                                capability):
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


def _pallas_options(platform: str, block_size: int, capability, document_bound=None) -> dict:
    return {"interpret": platform != "gpu",
            "blocks": pallas_blocks(platform, block_size, capability)}


KERNELS.register("pallas", Kernel(
    pallas_attention, supports=lambda platform, capability, dtype: _fused_runs(
        "pallas", platform, capability),
    accepts=lambda q, full_seq_len: pallas_supported(q, full_seq_len), auto_rank=1,
    auto=lambda q, full_seq_len, platform, has_segments, capability: platform == "gpu",  # CPU:
    # interpret mode
    options=_pallas_options, doc="Triton, GPU, sm80+"))


def ring_hop_kernel(impl: str, platform: str, capability, head_dim: int, block_size: int,
                    dtype=None) -> HopKernel:
    """The kernel a ring's hops run (basp_jax.ring_hops). On a GPU from sm80: cuDNN's where it
    takes the input (half precision, its head_dims) unless impl asks for pallas or blockwise,
    with our Pallas kernel for the hops its masks cannot express; else the Pallas kernel. On
    CPU the blockwise kernel, unless impl='pallas' asks for the Pallas one (interpret mode is
    slow: tests)."""
    if impl == "blockwise" or head_dim > PALLAS_MAX_HEAD_DIM:
        return HopKernel("blockwise")
    if platform == "gpu" and _fused_runs("pallas", platform, capability) is None:
        blocks = pallas_blocks(platform, block_size, capability)
        q = jax.ShapeDtypeStruct((1, 1, 1, head_dim), dtype or jnp.float32)
        if impl in (AUTO, "cudnn") and cudnn_call.FUSED is not None and \
                cudnn_supported(q, platform, capability):
            return HopKernel("cudnn", blocks)
        return HopKernel("pallas", blocks)
    if impl == "pallas" and platform != "gpu":
        return HopKernel("pallas", pallas_blocks(platform, block_size, capability), True)
    return HopKernel("blockwise")


KERNELS.register("blockwise", Kernel(
    blockwise_attention, auto_rank=2, doc="memory-efficient, pure JAX",
    auto=lambda q, full_seq_len, platform, has_segments, capability: (
        full_seq_len >= BLOCKWISE_MIN_SEQ),
    options=lambda platform, block_size, capability, document_bound=None: {
        "block_size": block_size}))
# What "auto" takes when no kernel above wants the input: blockwise runs everywhere.
AUTO_FALLBACK = "blockwise"
