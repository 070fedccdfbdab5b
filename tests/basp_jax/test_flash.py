"""basp_jax.flash (the Pallas flash attention, interpret mode on CPU) against a dense float32
reference: forward, log-sum-exp and gradients; causal or not, packed or not, grouped-query heads,
key offsets (ring hops), lengths that are not multiples of the blocks; and the ring with it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from basp_jax import Layout, activation_sharding, attention, make_mesh
from basp_jax.flash import (FlashBlocks, _kv_ranges, _q_ranges, flash_attention_vjp,
                            flash_attention_with_lse, flash_blocks)
from tests.helpers.flags import WHOLE_MATRIX
from tests.helpers.reference import packed_segment_ids, reference_attention

BLOCKS = FlashBlocks.square(16)


def dense_attention(q, k, v, *, causal, q_seg=None, k_seg=None, k_shift=0):
    """(out, lse [b, sq, hq]) in float32 from an explicit mask; key j at position k_shift + j.
    A query that sees no key: out 0, lse -inf."""
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x.astype(jnp.float32), group, axis=2) for x in (k, v))
    q = q.astype(jnp.float32)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    mask = jnp.ones(scores.shape, bool)
    if causal:
        mask &= (jnp.arange(q.shape[1])[:, None] >= k_shift + jnp.arange(k.shape[1])[None, :])
    if q_seg is not None:
        mask &= q_seg[:, None, :, None] == k_seg[:, None, None, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)
    probs = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]), 0)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v), jnp.swapaxes(lse, 1, 2)


def _inputs(seed, b, sq, sk, hq, hkv, d, dtype=jnp.float32):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(keys[0], (b, sq, hq, d), dtype)
    k = jax.random.normal(keys[1], (b, sk, hkv, d), dtype)
    v = jax.random.normal(keys[2], (b, sk, hkv, d), dtype)
    d_out = jax.random.normal(keys[3], (b, sq, hq, d), jnp.float32)
    d_lse = jax.random.normal(keys[4], (b, sq, hq), jnp.float32)
    return q, k, v, d_out, d_lse


def _both(fn, q, k, v, d_out, d_lse):
    """(out, lse, dq, dk, dv) of fn(q, k, v) -> (out, lse) for cotangents on both, jitted."""
    def run(q, k, v, d_out, d_lse):
        (out, lse), vjp = jax.vjp(fn, q, k, v)
        d_lse = jnp.where(jnp.isfinite(lse), d_lse, 0.0)  # rows that see nothing: no gradient
        return (out, lse, *vjp((d_out.astype(out.dtype), d_lse)))

    return jax.jit(run)(q, k, v, d_out, d_lse)


def _compare(got, want, atol, case):
    for name, g, w in zip(["out", "lse", "dq", "dk", "dv"], got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_array_equal(np.isfinite(g), np.isfinite(w), err_msg=f"{name}: {case}")
        finite = np.isfinite(w)
        np.testing.assert_allclose(g[finite], w[finite], atol=atol, rtol=atol,
                                   err_msg=f"{name}: {case}")


# (sq, sk, hq, hkv, causal, packed, k_shift): GQA groups 1, 4 and 8; lengths that are not
# multiples of the 16-token blocks (padded); key offsets before and after the queries. The fast
# tier runs two (every feature at once); interpret mode compiles for seconds per case.
CASES = [
    (40, 40, 4, 1, True, True, 0),
    (48, 32, 4, 2, True, True, 24),
    pytest.param(32, 32, 4, 4, True, False, 0, marks=[pytest.mark.slow, WHOLE_MATRIX]),
    pytest.param(24, 40, 8, 2, False, True, 0, marks=[pytest.mark.slow, WHOLE_MATRIX]),
    pytest.param(32, 48, 8, 1, True, False, -16, marks=[pytest.mark.slow, WHOLE_MATRIX]),
]


@pytest.mark.parametrize("sq,sk,hq,hkv,causal,packed,k_shift", CASES)
def test_flash_matches_dense_reference(sq, sk, hq, hkv, causal, packed, k_shift):
    q, k, v, d_out, d_lse = _inputs(sq + sk + hkv, 2, sq, sk, hq, hkv, 16)
    q_seg = k_seg = None
    if packed:  # documents across the whole (shifted) span, as a ring's chunks see them
        seg = packed_segment_ids(jax.random.PRNGKey(sq * sk), 2, max(sq, sk) + abs(k_shift))
        q_seg = seg[:, :sq]
        k_seg = seg[:, max(k_shift, 0):max(k_shift, 0) + sk]

    def flash(q, k, v):
        return flash_attention_with_lse(q, k, v, causal=causal, q_segment_ids=q_seg,
                                        k_segment_ids=k_seg, k_shift=k_shift, blocks=BLOCKS,
                                        interpret=True)

    def dense(q, k, v):
        return dense_attention(q, k, v, causal=causal, q_seg=q_seg, k_seg=k_seg, k_shift=k_shift)

    case = f"sq={sq} sk={sk} hq={hq} hkv={hkv} causal={causal} packed={packed} shift={k_shift}"
    got = _both(flash, q, k, v, d_out, d_lse)
    want = _both(dense, q, k, v, d_out, d_lse)
    if k_shift > 0 and causal:  # the first queries see no key: output 0, lse -inf
        assert not np.isfinite(np.asarray(got[1])[:, 0]).any() and not np.asarray(got[0])[:, 0].any()
    _compare(got, want, 2e-5, case)

    # the ring's backward: a share of the gradient from the whole attention's out and lse
    out, lse = want[0], want[1]
    dq, dk, dv = jax.jit(lambda q, k, v, out, lse, d_out: flash_attention_vjp(
        q, k, v, out, lse, d_out, causal=causal, q_segment_ids=q_seg, k_segment_ids=k_seg,
        k_shift=k_shift, blocks=BLOCKS, interpret=True))(q, k, v, out, lse, d_out)
    _, vjp = jax.vjp(lambda q, k, v: dense(q, k, v)[0], q, k, v)
    for name, g, w in zip(["dq", "dk", "dv"], (dq, dk, dv), vjp(d_out)):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5, err_msg=f"vjp {name}: {case}")

    # dq's kernel alone and dk/dv's alone (the ring sums dq over its hops before dk/dv): the same
    for wrt, want_parts in (("q", (dq, None, None)), ("kv", (None, dk, dv))):
        parts = jax.jit(lambda q, k, v, out, lse, d_out: flash_attention_vjp(
            q, k, v, out, lse, d_out, causal=causal, q_segment_ids=q_seg, k_segment_ids=k_seg,
            k_shift=k_shift, blocks=BLOCKS, interpret=True, wrt=wrt))(q, k, v, out, lse, d_out)
        for name, g, w in zip(["dq", "dk", "dv"], parts, want_parts):
            if w is None:
                assert g is None, f"wrt={wrt} {name}: {case}"
            else:
                np.testing.assert_array_equal(g, w, err_msg=f"wrt={wrt} {name}: {case}")


@pytest.mark.parametrize("head_dim", [128, 256])
def test_flash_at_the_models_head_dims(head_dim):
    """head_dim 128 (the 8B configs) and 256 (Qwen3.5), packed, causal, grouped-query heads, a
    key offset: forward and gradients against the dense reference (interpret mode)."""
    sq, sk, hq, hkv, shift = 32, 32, 4, 2, 8
    q, k, v, d_out, d_lse = _inputs(head_dim, 1, sq, sk, hq, hkv, head_dim)
    seg = packed_segment_ids(jax.random.PRNGKey(head_dim), 1, sq + shift)
    q_seg, k_seg = seg[:, :sq], seg[:, shift:shift + sk]

    def flash(q, k, v):
        return flash_attention_with_lse(q, k, v, causal=True, q_segment_ids=q_seg,
                                        k_segment_ids=k_seg, k_shift=shift, blocks=BLOCKS,
                                        interpret=True)

    def dense(q, k, v):
        return dense_attention(q, k, v, causal=True, q_seg=q_seg, k_seg=k_seg, k_shift=shift)

    _compare(_both(flash, q, k, v, d_out, d_lse), _both(dense, q, k, v, d_out, d_lse), 5e-5,
             f"head_dim={head_dim}")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow)])
def test_flash_half_precision_accumulates_in_float32(dtype):
    """Half-precision inputs and outputs, float32 sums: within the input's rounding of the
    float32 reference on the same (rounded) inputs."""
    q, k, v, d_out, d_lse = _inputs(3, 1, 64, 64, 8, 2, 32, dtype)
    seg = packed_segment_ids(jax.random.PRNGKey(5), 1, 64)

    def flash(q, k, v):
        return flash_attention_with_lse(q, k, v, causal=True, q_segment_ids=seg,
                                        k_segment_ids=seg, blocks=BLOCKS, interpret=True)

    got = _both(flash, q, k, v, d_out, d_lse)
    assert got[0].dtype == dtype and got[1].dtype == jnp.float32 and got[2].dtype == dtype
    want = _both(lambda q, k, v: dense_attention(q, k, v, causal=True, q_seg=seg, k_seg=seg),
                 q, k, v, d_out, d_lse)
    _compare(got, want, 3e-2, str(dtype))


def test_flash_blocks_skip_other_documents_and_the_causal_future():
    """Key blocks [lo, hi) per query block (and query blocks per key block): only the blocks of
    a query block's own documents, in its causal past (shifted for a ring hop); with documents
    of one block each, only the diagonal."""
    seg = jnp.repeat(jnp.arange(4), 16)[None]  # 4 documents of 16 tokens, blocks of 16
    sizes = dict(bq=16, bk=16, sq_pad=64, sk_pad=64)
    lo, hi = _kv_ranges(1, seg, seg, 0, causal=False, sk=64, **sizes)
    np.testing.assert_array_equal(lo[0], [0, 1, 2, 3])
    np.testing.assert_array_equal(hi[0], [1, 2, 3, 4])
    lo, hi = _q_ranges(1, seg, seg, 0, causal=False, sq=64, **sizes)
    np.testing.assert_array_equal(hi[0] - lo[0], [1, 1, 1, 1])
    # unpacked and causal, the keys 16 tokens later (a ring hop): query block i sees i - 1 blocks
    lo, hi = _kv_ranges(1, None, None, 16, causal=True, sk=64, **sizes)
    np.testing.assert_array_equal(hi[0] - lo[0], [0, 1, 2, 3])
    lo, hi = _q_ranges(1, None, None, 16, causal=True, sq=64, **sizes)
    np.testing.assert_array_equal(lo[0], [1, 2, 3, 4])
    # any segment ids (here not sorted) keep every block that shares one
    seg = jnp.asarray([[3] * 16 + [0] * 16 + [3] * 16 + [1] * 16])
    lo, hi = _kv_ranges(1, seg, seg, 0, causal=False, sk=64, **sizes)
    overlap = np.asarray(seg).reshape(4, 16)
    for i in range(4):
        for j in range(4):
            if np.intersect1d(overlap[i], overlap[j]).size:
                assert lo[0, i] <= j < hi[0, i], (i, j)


def test_flash_tiles_follow_the_gpu():
    """Bigger tiles where a block may take more shared memory (H100 over A100 over sm86/89)."""
    from basp_jax import gpus

    h100, a100, l4 = (flash_blocks(gpus.GPUS[n].shared_memory_per_block_optin)
                      for n in ("h100-80gb", "a100-40gb", "l4-24gb"))
    area = lambda b: (b.q * b.k, b.q_bwd * b.k_bwd)  # noqa: E731
    assert area(h100) >= area(a100) >= area(l4) and area(h100) != area(l4)
    assert gpus.shared_memory_per_block((9, 0)) == gpus.GPUS["h100-80gb"].shared_memory_per_block_optin
    assert gpus.shared_memory_per_block((8, 9)) is not None
    assert gpus.shared_memory_per_block(None) is None


def test_flash_rejects_bad_heads_in_one_line():
    q, k, v, _, _ = _inputs(0, 1, 16, 16, 6, 4, 16)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        flash_attention_with_lse(q, k, v, causal=True, interpret=True)


def test_ring_hops_take_a_fused_kernel_on_an_ampere_or_newer_gpu():
    from basp_jax.kernels import ring_hop_kernel

    bf16, f32 = jnp.bfloat16, jnp.float32
    for cc in ((8, 0), (8, 9), (9, 0)):
        hop = ring_hop_kernel("auto", "gpu", cc, 128, 512, bf16)
        assert hop.name == "cudnn" and isinstance(hop.blocks, FlashBlocks) and not hop.interpret
        assert ring_hop_kernel("pallas", "gpu", cc, 128, 512, bf16).name == "pallas"
        assert ring_hop_kernel("auto", "gpu", cc, 128, 512, f32).name == "pallas"  # cuDNN: f16
    assert ring_hop_kernel("auto", "gpu", (9, 0), 256, 512, bf16).name == "cudnn"
    assert ring_hop_kernel("auto", "gpu", (8, 0), 256, 512, bf16).name == "pallas"  # Ampere: 128
    assert ring_hop_kernel("auto", "gpu", (7, 5), 128, 512, bf16).name == "blockwise"  # T4
    assert ring_hop_kernel("blockwise", "gpu", (9, 0), 128, 512, bf16).name == "blockwise"
    assert ring_hop_kernel("auto", "cpu", None, 128, 512, bf16).name == "blockwise"  # CPU ...
    assert ring_hop_kernel("pallas", "cpu", None, 128, 512).interpret  # ... unless a test asks


def _ring_case(ring, zigzag, packed, hq, hkv, seed):
    """attention() on a (1, 8) mesh with `ring` runs and the Pallas hop kernel vs one device."""
    b, s, d = 1, 64, 16
    layout = Layout.plan(8, batch=b, seq_len=s, num_heads=hq, num_kv_heads=hkv, groups=1,
                         ring=ring, zigzag=zigzag)
    assert layout.ring == ring
    mesh = make_mesh(layout)
    sharding = activation_sharding(mesh)
    q, k, v, d_out, _ = _inputs(seed, b, s, s, hq, hkv, d)
    seg = packed_segment_ids(jax.random.PRNGKey(seed + 1), b, s) if packed else None
    order = np.asarray(layout.token_order) if zigzag else np.arange(s)

    def fn(q, k, v, seg):
        return attention(q, k, v, mesh=mesh, layout=layout, causal=True, segment_ids=seg,
                         impl="pallas", block_size=16)

    def run(q, k, v, d_out, seg):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
        return (out, *vjp(d_out))

    perm = lambda x: None if x is None else x[:, order]  # noqa: E731
    args = [jax.device_put(perm(x), sharding) for x in (q, k, v, d_out)]
    args.append(None if seg is None else jax.device_put(perm(seg), sharding))
    traced = jax.jit(run).trace(*args)
    assert "flash_attention_dkv" in str(traced.jaxpr)  # every hop's kernels are the Pallas ones
    got = traced.lower().compile()(*args)
    _, vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, causal=True, segment_ids=seg),
                     q, k, v)
    want = (reference_attention(q, k, v, causal=True, segment_ids=seg), *vjp(d_out))
    case = f"ring={ring} zigzag={zigzag} packed={packed} hq={hq} hkv={hkv}"
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(perm(w)), atol=5e-5, rtol=5e-5,
                                   err_msg=f"{name}: {case}")


def test_ring_of_2_with_the_pallas_hop_kernel_matches_one_device():
    _ring_case(2, zigzag=False, packed=True, hq=8, hkv=2, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("ring,zigzag,packed,hq,hkv", [(2, True, True, 4, 1), (4, False, False, 8, 8)])
def test_rings_with_the_pallas_hop_kernel_match_one_device(ring, zigzag, packed, hq, hkv):
    """A zig-zag ring (packed, MQA) and a ring of 4 (MHA): in interpret mode each hop's kernel
    costs seconds, so the zig-zag one is a ring of 2 (a zig-zag ring of 4 with the blockwise
    kernel: tests/basp_jax/test_attention.py)."""
    _ring_case(ring, zigzag=zigzag, packed=packed, hq=hq, hkv=hkv, seed=4)
