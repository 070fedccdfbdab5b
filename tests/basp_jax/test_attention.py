"""basp_jax.attention against an independent single-device reference, forward and gradients."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from basp_jax import Layout, activation_sharding, attention, make_mesh
from tests.helpers.flags import WHOLE_MATRIX
from tests.helpers.reference import packed_segment_ids, reference_attention

B, S, HQ, D = 8, 64, 8, 16
LAYOUTS = [(1, 8), (2, 4), (4, 2), (8, 1)]
KV_HEADS = [HQ, HQ // 2, 2, 1]
# float32 throughout; the blockwise kernel reorders sums, so its tolerance is a little looser.
TOL = {"xla": 2e-5, "blockwise": 5e-5}


def _inputs(seed, hkv):
    kq, kk, kv, kd, ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(kq, (B, S, HQ, D), jnp.float32)
    k = jax.random.normal(kk, (B, S, hkv, D), jnp.float32)
    v = jax.random.normal(kv, (B, S, hkv, D), jnp.float32)
    d_out = jax.random.normal(kd, (B, S, HQ, D), jnp.float32)
    return q, k, v, d_out, packed_segment_ids(ks, B, S)


def _value_and_grads(fn, q, k, v, d_out):
    """fn's output and its q, k, v gradients for the cotangent d_out, as one compiled program
    (op by op, every kernel's loops would compile piecewise: minutes per test)."""
    def both(q, k, v, d_out):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(d_out))

    return jax.jit(both)(q, k, v, d_out)


# Under every jaxlib: BASP (2,4) with both kernels and Ulysses (1,8) with XLA's; the other
# layouts and kernels under the older one (WHOLE_MATRIX).
EVERY_JAXLIB = {("xla", 2, 4), ("blockwise", 2, 4), ("xla", 1, 8)}
ATTENTION_CASES = [pytest.param(impl, groups, sp, id=f"{groups}-{sp}-{impl}",
                                marks=() if (impl, groups, sp) in EVERY_JAXLIB else WHOLE_MATRIX)
                   for groups, sp in LAYOUTS for impl in ("xla", "blockwise")]


@pytest.mark.slow
@pytest.mark.parametrize("impl,groups,sp", ATTENTION_CASES)
def test_attention_matches_reference(impl, groups, sp):
    layout = Layout.plan(num_devices=8, batch=B, seq_len=S, num_heads=HQ, num_kv_heads=HQ, groups=groups)
    assert (layout.groups, layout.sp) == (groups, sp)
    mesh = make_mesh(layout)
    sharding = activation_sharding(mesh)
    # A quarter of the (kv heads, causal, packed) product per layout, rotated so that each layout
    # runs every kv head count and every (causal, packed) pair, and over the four layouts every
    # combination runs once (the full product per layout quadrupled the suite's time).
    li = LAYOUTS.index((groups, sp))
    combos = [(True, False), (False, True), (True, True), (False, False)]
    cases = [(hkv, *combos[(hi + li) % 4]) for hi, hkv in enumerate(KV_HEADS)]
    for seed, (hkv, causal, packed) in enumerate(cases):
        q, k, v, d_out, seg = _inputs(seed + 100 * groups, hkv)
        seg = seg if packed else None

        @jax.jit
        def parallel(q, k, v, d_out, seg):
            fn = lambda q, k, v: attention(
                q, k, v, mesh=mesh, causal=causal, segment_ids=seg, impl=impl, block_size=16
            )
            return _value_and_grads(fn, q, k, v, d_out)

        placed = [jax.device_put(x, sharding) for x in (q, k, v, d_out)]
        got = parallel(*placed, None if seg is None else jax.device_put(seg, sharding))
        want = _value_and_grads(
            lambda q, k, v: reference_attention(q, k, v, causal=causal, segment_ids=seg), q, k, v, d_out
        )
        case = f"impl={impl} layout=({groups},{sp}) hkv={hkv} causal={causal} packed={packed}"
        assert got[0].sharding.is_equivalent_to(sharding, 4), case
        for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
            np.testing.assert_allclose(g, w, atol=TOL[impl], rtol=TOL[impl], err_msg=f"{name}: {case}")


@pytest.mark.slow
@pytest.mark.parametrize("seq_len,block", [(48, 32)])
def test_blockwise_pads_sequences_that_are_not_a_block_multiple(seq_len, block):
    """One device, a sequence the block does not divide: padded keys must stay invisible."""
    from basp_jax.blockwise import blockwise_attention

    kq, kk, kv, kd, ks = jax.random.split(jax.random.PRNGKey(7), 5)
    q = jax.random.normal(kq, (2, seq_len, 4, 8))
    k = jax.random.normal(kk, (2, seq_len, 2, 8))
    v = jax.random.normal(kv, (2, seq_len, 2, 8))
    d_out = jax.random.normal(kd, q.shape)
    seg = packed_segment_ids(ks, 2, seq_len)
    for causal, s in itertools.product([True, False], [None, seg]):
        got = _value_and_grads(
            lambda q, k, v: blockwise_attention(q, k, v, causal=causal, segment_ids=s, block_size=block),
            q, k, v, d_out,
        )
        want = _value_and_grads(
            lambda q, k, v: reference_attention(q, k, v, causal=causal, segment_ids=s), q, k, v, d_out
        )
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5)


@pytest.mark.slow
def test_blockwise_bfloat16_is_close_to_float32_reference():
    from basp_jax.blockwise import blockwise_attention

    kq, kk, kv = jax.random.split(jax.random.PRNGKey(3), 3)
    q = jax.random.normal(kq, (1, 128, 4, 32))
    k = jax.random.normal(kk, (1, 128, 4, 32))
    v = jax.random.normal(kv, (1, 128, 4, 32))
    got = blockwise_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), causal=True, block_size=32)
    assert got.dtype == jnp.bfloat16
    want = reference_attention(q, k, v, causal=True)
    np.testing.assert_allclose(got.astype(jnp.float32), want, atol=3e-2, rtol=3e-2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "hq,hkv,groups,impl",
    [(28, 4, 1, "xla"), (12, 12, 1, "xla"), (14, 2, 2, "blockwise"), (6, 1, 2, "xla")],
)
def test_query_heads_that_sp_does_not_divide_are_padded_exactly(hq, hkv, groups, impl):
    """28 heads / 4 kv on sp=8 (pad to 32), MHA 12 on sp=8, 14/2 and MQA 6/1 on sp=4."""
    layout = Layout.plan(8, batch=2, seq_len=32, num_heads=hq, num_kv_heads=hkv, groups=groups, pad_heads=True)
    mesh = make_mesh(layout)
    sharding = activation_sharding(mesh)
    kq, kk, kv, kd, ks = jax.random.split(jax.random.PRNGKey(hq), 5)
    q = jax.random.normal(kq, (2, 32, hq, 8))
    k, v = (jax.random.normal(key, (2, 32, hkv, 8)) for key in (kk, kv))
    d_out = jax.random.normal(kd, q.shape)
    seg = packed_segment_ids(ks, 2, 32)
    fn = lambda q, k, v: attention(q, k, v, mesh=mesh, segment_ids=seg, impl=impl, block_size=16)
    got = jax.jit(lambda *a: _value_and_grads(fn, *a))(*(jax.device_put(x, sharding) for x in (q, k, v, d_out)))
    want = _value_and_grads(lambda q, k, v: reference_attention(q, k, v, causal=True, segment_ids=seg), q, k, v, d_out)
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5, err_msg=name)


# (ring 4 x all-to-all 2 with 8/2 heads: tests/models/test_layout_families.py, the whole model)
RING_CASES = [(1, 2, 4, 4), (1, 8, 4, 1), (2, 2, 2, 2)]  # BASP's (2 groups) under every jaxlib


@pytest.mark.slow
@pytest.mark.parametrize("groups,ring,hq,hkv", [
    case if case[0] > 1 else pytest.param(*case, marks=WHOLE_MATRIX) for case in RING_CASES])
def test_ring_hybrid_matches_reference(groups, ring, hq, hkv):
    """sp beyond the head count: all-to-all inside runs of sp/ring devices, ring across them
    (sp=8 with 4 query heads needs ring >= 2; ring=8 is pure ring attention). Each layout runs
    causal and not, packed and not (two of the four pairs, rotated: every pair on two layouts)."""
    layout = Layout.plan(8, batch=2, seq_len=64, num_heads=hq, num_kv_heads=hkv, groups=groups, ring=ring)
    assert layout.ring == ring and not layout.pad_heads
    mesh = make_mesh(layout)
    sharding = activation_sharding(mesh)
    kq, kk, kv, kd, ks = jax.random.split(jax.random.PRNGKey(ring * 10 + hq), 5)
    q = jax.random.normal(kq, (2, 64, hq, 8))
    k, v = (jax.random.normal(key, (2, 64, hkv, 8)) for key in (kk, kv))
    d_out = jax.random.normal(kd, q.shape)
    seg = packed_segment_ids(ks, 2, 64)
    pairs = list(itertools.product([True, False], [False, True]))  # (causal, packed)
    i = RING_CASES.index((groups, ring, hq, hkv))
    for causal, packed in (pairs[i], pairs[3 - i]):
        s = seg if packed else None
        fn = lambda q, k, v: attention(q, k, v, mesh=mesh, layout=layout, causal=causal, segment_ids=s, block_size=8)
        got = jax.jit(lambda *a: _value_and_grads(fn, *a))(*(jax.device_put(x, sharding) for x in (q, k, v, d_out)))
        want = _value_and_grads(lambda q, k, v: reference_attention(q, k, v, causal=causal, segment_ids=s), q, k, v, d_out)
        for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
            np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5, err_msg=f"{name} causal={causal} packed={packed}")


@pytest.mark.slow
@pytest.mark.parametrize("groups,ring,packed", [(1, 2, False), (2, 4, True)])
def test_zigzag_ring_matches_reference(groups, ring, packed):
    """Inputs in the layout's token order, output mapped back: equal to the reference, forward and
    gradients; unpacked on (1, 8) with ring 2, packed documents on (2, 4) with ring 4. (The
    trainer's zig-zag runs, against one device: unpacked on (1, 8) with ring 2 in
    tests/train/test_loop.py, packed on (4, 2) with ring 2 in tests/train/test_layouts.py.)"""
    from basp_jax.layout import zigzag_order

    layout = Layout.plan(8, batch=2, seq_len=64, num_heads=4, num_kv_heads=2, groups=groups, ring=ring,
                         zigzag=True)
    mesh = make_mesh(layout)
    order = layout.token_order
    np.testing.assert_array_equal(order, zigzag_order(64, ring))
    inverse = np.argsort(order)
    kq, kk, kv, kd, ks = jax.random.split(jax.random.PRNGKey(ring), 5)
    q = jax.random.normal(kq, (2, 64, 4, 8))
    k, v = (jax.random.normal(key, (2, 64, 2, 8)) for key in (kk, kv))
    d_out = jax.random.normal(kd, q.shape)
    s = packed_segment_ids(ks, 2, 64) if packed else None

    def fn(q, k, v):
        permuted_seg = None if s is None else s[:, order]
        out = attention(q[:, order], k[:, order], v[:, order], mesh=mesh, layout=layout,
                        segment_ids=permuted_seg, block_size=8)
        return out[:, inverse]

    got = jax.jit(lambda *a: _value_and_grads(fn, *a))(q, k, v, d_out)
    want = _value_and_grads(lambda q, k, v: reference_attention(q, k, v, causal=True, segment_ids=s), q, k, v, d_out)
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5, err_msg=f"{name} packed={packed}")


@pytest.mark.parametrize("ring", [2, 4, 8])
def test_zigzag_gives_every_rank_the_same_causal_work_at_every_step(ring):
    """Count visible (query, key) pairs per rank and ring step under the zigzag assignment."""
    from basp_jax.layout import zigzag_order

    seq = 16 * ring
    chunks = zigzag_order(seq, ring).reshape(ring, -1)  # true positions held by each rank
    for step in range(ring):
        work = [int((chunks[r][:, None] >= chunks[(r - step) % ring][None, :]).sum()) for r in range(ring)]
        assert len(set(work)) == 1, (step, work)
    contiguous = np.arange(seq).reshape(ring, -1)
    last_step = [int((contiguous[r][:, None] >= contiguous[(r - 1) % ring][None, :]).sum()) for r in range(ring)]
    assert len(set(last_step)) > 1  # without zigzag the ranks are unbalanced


@pytest.mark.slow
# The ring is contiguous: zig-zag only reorders the tokens (Layout.token_order) and splits each
# hop's work, with the same exchanges, at three times the compile time.
@pytest.mark.parametrize("ring,zigzag,packed", [(1, False, True), (2, False, True)])
def test_rematerialisation_repeats_no_exchange(ring, zigzag, packed):
    """Under jax.checkpoint with save_exchanges (what every model remat policy uses) the backward
    pass recomputes no all-to-all, ring hop or segment gather: two checkpointed layers compile to
    exactly the collectives they have without remat. (That plain full remat repeats them shows in
    the train step, tests/train/test_collectives.py; here XLA merges the copies.)"""
    from basp_jax.compiled import comm
    from basp_jax.remat import save_exchanges

    layout = Layout.plan(num_devices=8, batch=2, seq_len=S, num_heads=HQ, num_kv_heads=HQ, groups=2,
                         ring=ring, zigzag=zigzag)
    mesh = make_mesh(layout)
    x, _, _, _, seg = _inputs(0, HQ)
    x, seg = x[:2], seg[:2] if packed else None

    def layer(x):
        out = attention(jnp.sin(x), jnp.cos(x), x, mesh=mesh, layout=layout, segment_ids=seg,
                        impl="blockwise", block_size=8)
        return x + out

    def counts(policy):
        fn = layer if policy is None else jax.checkpoint(layer, policy=policy)
        loss = lambda x: jnp.sum(jnp.sin(fn(fn(x))))  # noqa: E731
        # Under a loop, as in the train step (in straight-line code XLA would merge the copies).
        step = lambda xs: jax.lax.map(jax.grad(loss), xs)  # noqa: E731
        found = comm.parse_collectives(jax.jit(step).lower(x[None]).compile().as_text(), 8)
        return {kind: sum(c.kind == kind for c in found)
                for kind in ("all-to-all", "collective-permute", "all-gather")}

    base = counts(None)
    assert base["all-to-all"] == 2 * 8, base
    assert counts(save_exchanges()) == base


@pytest.mark.parametrize("groups,sp,hkv,packed", [(2, 4, 2, True), (1, 8, 1, False), (1, 8, HQ, True)])
def test_pallas_kernel_matches_reference(groups, sp, hkv, packed):
    """The Pallas/Triton kernel (interpret mode on CPU, slow: one case per combination) inside the
    sequence-parallel attention: packed and not, GQA, MQA and MHA, causal, forward and gradients."""
    layout = Layout.plan(num_devices=8, batch=B, seq_len=S, num_heads=HQ, num_kv_heads=HQ, groups=groups)
    assert (layout.groups, layout.sp) == (groups, sp)
    mesh = make_mesh(layout)
    sharding = activation_sharding(mesh)
    q, k, v, d_out, seg = _inputs(hkv + 7 * groups, hkv)
    seg = seg if packed else None

    @jax.jit
    def parallel(q, k, v, d_out, seg):
        fn = lambda q, k, v: attention(q, k, v, mesh=mesh, segment_ids=seg, impl="pallas")  # noqa: E731
        return _value_and_grads(fn, q, k, v, d_out)

    placed = [jax.device_put(x, sharding) for x in (q, k, v, d_out)]
    got = parallel(*placed, None if seg is None else jax.device_put(seg, sharding))
    want = _value_and_grads(
        lambda q, k, v: reference_attention(q, k, v, causal=True, segment_ids=seg), q, k, v, d_out
    )
    case = f"layout=({groups},{sp}) hkv={hkv} packed={packed}"
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5, err_msg=f"{name}: {case}")


def test_blockwise_skips_key_blocks_of_other_documents():
    """Per-block min/max segment ids: a query block visits only the key blocks of its documents
    (and the causal past); with documents of one block each, only the diagonal."""
    from basp_jax import blockwise

    seg = jnp.repeat(jnp.arange(4), 8)[None]  # 4 documents of 8 tokens, blocks of 8
    overlap = blockwise.segment_overlap(seg, seg, 8, 8)
    np.testing.assert_array_equal(overlap, np.eye(4, dtype=bool))
    # Blocks of 16 and a document that straddles them: [0]*8 + [1]*16 + [2]*8.
    seg = jnp.asarray([[0] * 8 + [1] * 16 + [2] * 8])
    ranges = [blockwise._kv_block_range(qi, 2, 16, 16, 0, True, blockwise.segment_overlap(seg, seg, 16, 16))
              for qi in range(2)]
    assert [(int(a), int(b)) for a, b in ranges] == [(0, 1), (0, 2)]
    seg = jnp.asarray([[0] * 16 + [1] * 16])
    ranges = [blockwise._kv_block_range(qi, 2, 16, 16, 0, False, blockwise.segment_overlap(seg, seg, 16, 16))
              for qi in range(2)]
    assert [(int(a), int(b)) for a, b in ranges] == [(0, 1), (1, 2)]
    # Any segment ids stay exact: rows disagree, so a block is skipped only if no row meets it.
    seg = jnp.asarray([[0] * 16 + [1] * 16, [0] * 32])
    assert blockwise.segment_overlap(seg, seg, 16, 16).all()


def test_auto_takes_a_fused_kernel_on_gpu():
    """On a GPU: cuDNN for unpacked half precision, Pallas for packed input and what cuDNN
    refuses; the blockwise kernel (or xla, for short sequences) everywhere else."""
    from basp_jax.kernels import resolve_impl

    bf16 = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
    f32 = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.float32)
    assert resolve_impl("auto", bf16, 4096, "gpu", has_segments=False) == "cudnn"
    assert resolve_impl("auto", bf16, 4096, "gpu", has_segments=True) == "pallas"
    assert resolve_impl("auto", f32, 4096, "gpu", has_segments=False) == "pallas"
    assert resolve_impl("auto", bf16, 4000, "gpu", has_segments=True) == "pallas"  # padded
    assert resolve_impl("auto", bf16, 4096, "cpu", has_segments=True) == "blockwise"
    wide = jax.ShapeDtypeStruct((1, 4096, 8, 512), jnp.bfloat16)
    assert resolve_impl("auto", wide, 4096, "gpu", has_segments=True) == "blockwise"
    with pytest.raises(ValueError, match="head_dim <= 256"):
        resolve_impl("pallas", wide, 4096, "gpu", has_segments=True)


class _Device:
    """What device_capability reads of a jax device."""

    def __init__(self, platform, compute_capability=None):
        self.platform, self.compute_capability = platform, compute_capability


def test_the_kernel_follows_the_gpu_generation():
    """From sm80 the fused kernels; on a T4 (sm75) blockwise or xla, blockwise whenever the
    input is bf16 (XLA has no bf16 dot there); an explicit kernel the GPU cannot run is refused
    with one line naming what would run."""
    from basp_jax import gpus
    from basp_jax import kernels as kernels_mod
    from basp_jax.kernels import device_capability, gpu_kernels, resolve_impl

    t4 = device_capability(_Device("gpu", "7.5"))
    assert t4 == (7, 5) and device_capability(_Device("cpu")) is None
    assert device_capability(_Device("gpu", "8.9")) == gpus.GPUS["l4-24gb"].compute_capability
    bf16 = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
    f32_short = jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.float32)
    bf16_short = jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.bfloat16)
    for segments in (False, True):
        assert resolve_impl("auto", bf16, 4096, "gpu", segments, t4) == "blockwise"
        assert resolve_impl("auto", bf16_short, 1024, "gpu", segments, t4) == "blockwise"
        assert resolve_impl("auto", f32_short, 1024, "gpu", segments, t4) == "xla"
    for cc in ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0)):
        assert resolve_impl("auto", bf16, 4096, "gpu", False, cc) == "cudnn"
        # packed documents: cuDNN's packed layout from Hopper, ours before (where cuDNN would
        # take them as a dense mask; impl='cudnn' still asks for that)
        packed = "cudnn" if cc >= (9, 0) else "pallas"
        assert resolve_impl("auto", bf16, 4096, "gpu", True, cc) == packed, cc
        assert resolve_impl("cudnn", bf16, 4096, "gpu", True, cc) == "cudnn"
    # head_dim 256 (Qwen3.5): cuDNN from Hopper, ours before
    wide = jax.ShapeDtypeStruct((1, 4096, 8, 256), jnp.bfloat16)
    assert resolve_impl("auto", wide, 4096, "gpu", False, (8, 0)) == "pallas"
    for segments in (False, True):
        assert resolve_impl("auto", wide, 4096, "gpu", segments, (9, 0)) == "cudnn"
    assert kernels_mod.cudnn_supported(wide, "gpu", (9, 0))
    assert not kernels_mod.cudnn_supported(wide, "gpu", (8, 0))
    for impl in ("cudnn", "pallas"):
        with pytest.raises(ValueError, match=f"impl='{impl}' needs a GPU of compute capability "
                                             "8.0 .* this one is sm75; use 'auto', 'blockwise'"):
            resolve_impl(impl, bf16, 4096, "gpu", False, t4)
    with pytest.raises(ValueError, match="impl='xla' in bfloat16 does not compile for sm75"):
        resolve_impl("xla", bf16, 4096, "gpu", False, t4)
    assert resolve_impl("xla", f32_short, 1024, "gpu", False, t4) == "xla"
    assert resolve_impl("blockwise", bf16, 4096, "gpu", True, t4) == "blockwise"
    # the CPU has no f16 x f16 -> f32 dot for the xla kernel (float16 compute, tests of it)
    f16_short = jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.float16)
    assert resolve_impl("auto", f16_short, 1024, "cpu", False) == "blockwise"
    assert resolve_impl("auto", f16_short, 1024, "gpu", False, t4) == "xla"
    with pytest.raises(ValueError, match="impl='xla' in float16 does not compile on CPU"):
        resolve_impl("xla", f16_short, 1024, "cpu", False)
    assert gpu_kernels(gpus.GPUS["t4-16gb"].compute_capability) == ("xla", "blockwise")
    assert "cudnn" in gpu_kernels(gpus.GPUS["a10g-24gb"].compute_capability)
