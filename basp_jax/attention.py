"""Sequence-parallel attention: all-to-all over 'seq' (sequence -> heads), local kernel, and back.

With a ('group', 'seq') mesh, the all-to-alls run inside each seq group only, so BASP (several
groups) and Ulysses (one group) are the same code. What to exchange (head padding, kv
replication, ring runs, token order) is asked of the Layout (basp_jax.mesh.layout_on).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from . import kernels
from .blockwise import DEFAULT_BLOCK
from .fp8_exchange import fp8_all_to_all
from .layout import Layout, LayoutError
from .mesh import SEQ, layout_on
from .remat import name_exchange
from .ring import ring_local_attention
from .sharding import rows_spec

# The named scope around whichever local kernel runs (here and in models.layers): XLA keeps it in
# each instruction's op_name, so readers of compiled programs (basp_jax.compiled.hlo) find the
# attention kernels by it, forward, backward and rematerialised alike.
ATTENTION_SCOPE = "attention_kernel"


def _check_inputs(q, k, v, segment_ids) -> None:
    """Shape checks at trace time, before anything compiles; one line each. (What the layout
    needs of the sizes, Layout.plan checks.)"""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise LayoutError(
            f"attention takes q, k, v of rank 4 [batch, seq, heads, head_dim]; got ranks "
            f"{q.ndim}, {k.ndim}, {v.ndim}"
        )
    if k.shape != v.shape:
        raise LayoutError(f"k and v must have the same shape; got {k.shape} and {v.shape}")
    (b, s, _, d), (bk, sk, _, dk) = q.shape, k.shape
    if (b, s, d) != (bk, sk, dk):
        raise LayoutError(
            f"q {q.shape} and k {k.shape} disagree on batch, seq or head_dim; self-attention needs "
            f"the same [batch, seq, :, head_dim]"
        )
    if segment_ids is not None:
        if segment_ids.shape != (b, s):
            raise LayoutError(f"segment_ids must have shape {(b, s)}, got {segment_ids.shape}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise LayoutError(f"segment_ids must be integers, got {segment_ids.dtype}")


def _pad_heads(q, k, v, kv_heads, group):
    """Zero-pad to kv_heads kv groups of `group` query heads each (see layout.head_padding)."""
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    q = q.reshape(b, s, hkv, hq // hkv, d)
    q = jnp.pad(q, [(0, 0), (0, 0), (0, kv_heads - hkv), (0, group - hq // hkv), (0, 0)])
    pad_kv = [(0, 0), (0, 0), (0, kv_heads - hkv), (0, 0)]
    return q.reshape(b, s, kv_heads * group, d), jnp.pad(k, pad_kv), jnp.pad(v, pad_kv)


def _unpad_heads(out, num_heads, num_kv_heads, kv_heads, group):
    b, s, _, d = out.shape
    out = out.reshape(b, s, kv_heads, group, d)[:, :, :num_kv_heads, : num_heads // num_kv_heads]
    return out.reshape(b, s, num_heads, d)


def seq_to_heads(x, sp, kv=False):
    """[b, s/sp, h, d] sequence shard -> [b, s, h/sp, d] head shard (whole sequence); kv: k or
    v, tagged apart (basp_jax.remat.name_exchange)."""
    if sp == 1:
        return x
    with jax.named_scope("seq_to_heads"):  # named scopes: what a profiler trace calls the ops
        return name_exchange(lax.all_to_all(x, SEQ, split_axis=2, concat_axis=1, tiled=True),
                             kv=kv)


def _qkv_to_heads(q, k, v, sp, fp8):
    """seq_to_heads of q, k and v; fp8: in float8 with per-head scales, all three's scales in
    one small exchange (basp_jax.fp8_exchange)."""
    if not fp8 or sp == 1:
        return seq_to_heads(q, sp), seq_to_heads(k, sp, kv=True), seq_to_heads(v, sp, kv=True)
    with jax.named_scope("seq_to_heads"):
        q, k, v = fp8_all_to_all((q, k, v), 2, 1, sp)
        return name_exchange(q), name_exchange(k, kv=True), name_exchange(v, kv=True)


def heads_to_seq(x, sp):
    """Inverse of seq_to_heads."""
    if sp == 1:
        return x
    with jax.named_scope("heads_to_seq"):
        return name_exchange(lax.all_to_all(x, SEQ, split_axis=1, concat_axis=2, tiled=True))


def _kernels(impl: str, q, mesh: Mesh, has_segments: bool, block_size: int,
             document_bound: int | None):
    """(the local kernel with its options, the ring hops' kernel) for the mesh's devices."""
    device = mesh.devices.flat[0]
    platform, capability = device.platform, kernels.device_capability(device)
    name = kernels.resolve_impl(impl, q, q.shape[1], platform, has_segments, capability)
    kernel = kernels.KERNELS.get(name).bind(platform, block_size, capability, document_bound)
    hop_kernel = kernels.ring_hop_kernel(impl, platform, capability, q.shape[3], block_size,
                                         q.dtype)
    return kernel, hop_kernel


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    layout: Layout | None = None,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    impl: str = "auto",
    block_size: int = DEFAULT_BLOCK,
    fp8_exchange: bool = False,
    document_bound: int | None = None,
) -> jax.Array:
    """Sequence-parallel multi-head attention on a ('group', 'seq') mesh.

    q [B, S, Hq, Dh], k/v [B, S, Hkv, Dh] and segment_ids [B, S] are global arrays sharded
    P('group', 'seq'); returns [B, S, Hq, Dh] with the same sharding. Tokens attend only within
    their segment when segment_ids is given (packed sequences). When Hkv is not divisible by the
    seq degree, each kv head is replicated the fewest times that make it so (k/v only). When the
    query heads are not divisible by it, zero heads are added and dropped again (exact; see
    basp_jax.layout.head_padding).

    `layout` (the one make_mesh(layout) placed; default: the mesh's plain split) may split each
    seq group into `layout.ring` runs of sp / ring devices: all-to-all inside a run, ring
    attention across runs (basp_jax.ring), so sp may exceed the head count. On a GPU from sm80
    every ring hop runs a fused kernel: cuDNN's where its masks express the hop (impl auto or
    cudnn; basp_jax.ring_hops), else our Pallas kernel; elsewhere the blockwise kernel (on CPU
    impl='pallas' asks for the Pallas one, in interpret mode). With layout.zigzag the sequence
    axis must be in layout.token_order, which balances the causal work over the ring.

    fp8_exchange: q, k and v cross the all-to-alls in float8_e4m3fn with per-head scales, their
    gradients back in float8_e5m2 (basp_jax.fp8_exchange; half the bytes of bf16); the output's
    exchange stays in q's dtype. The ring's k/v hops carry the dequantized values.

    document_bound: the most documents (runs of equal segment ids) a row of segment_ids holds,
    where the data knows it: cuDNN's packed layout is sized by it, up to
    basp_jax.cudnn.DOCUMENT_BOUND (a step over that runs the Pallas kernel). None: that bound.
    """
    _check_inputs(q, k, v, segment_ids)
    hq, hkv = q.shape[2], k.shape[2]
    layout = layout_on(mesh, q.shape[0], q.shape[1], hq, hkv, like=layout)
    sp = layout.sp
    kv_heads, group = layout.head_groups
    padded = layout.padded_heads != hq
    if padded:
        q, k, v = _pad_heads(q, k, v, kv_heads, group)
    copies = layout.kv_replication
    kernel, hop_kernel = _kernels(impl, q, mesh, segment_ids is not None, block_size,
                                  document_bound)

    def local(q, k, v, seg):
        if copies > 1:
            k, v = jnp.repeat(k, copies, axis=2), jnp.repeat(v, copies, axis=2)
        if layout.ring > 1:  # the ring's hop kernels are attention kernels too (basp_jax.compiled.hlo)
            with jax.named_scope(ATTENTION_SCOPE), jax.named_scope("ring_attention"):
                return ring_local_attention(q, k, v, seg, layout=layout, causal=causal,
                                            block_size=block_size, hop_kernel=hop_kernel,
                                            fp8_exchange=fp8_exchange)
        q, k, v = _qkv_to_heads(q, k, v, sp, fp8_exchange)
        if seg is not None and sp > 1:
            seg = lax.all_gather(seg, SEQ, axis=1, tiled=True)  # small ints, never activations
            seg = name_exchange(seg, kv=True)
        with jax.named_scope(ATTENTION_SCOPE):
            out = kernel(q, k, v, causal=causal, segment_ids=seg)
        return heads_to_seq(out, sp)

    rows = rows_spec()
    seg_spec = None if segment_ids is None else rows
    sharded = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, rows, rows, seg_spec),
        out_specs=rows,
        check_vma=False,
    )
    out = sharded(q, k, v, segment_ids)
    return _unpad_heads(out, hq, hkv, kv_heads, group) if padded else out
