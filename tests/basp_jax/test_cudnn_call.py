"""basp_jax.cudnn_call on CPU: the packed layout's conversion is JAX's own; everything around the
kernels (custom_vjp, the vmap fold, shard_map, a backward from given statistics) is exact
against the float32 reference, with the kernels computed by tests/helpers/cudnn_emulator (what
cuDNN computes, read from the same operands). The GPU check runs the real kernels; the
GPU-compile tier compiles them. JAX's private names this relies on are checked here first."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from basp_jax import cudnn, cudnn_call

from tests.helpers import cudnn_emulator
from tests.helpers.reference import random_documents, reference_attention

B, S, HQ, HKV, D = 2, 40, 4, 2, 8


@pytest.fixture
def emulated(monkeypatch):
    cudnn_emulator.install(monkeypatch, cudnn_call)


def _fresh_seed() -> int:
    return int(np.random.default_rng().integers(1 << 30))


def _qkv(seed, b=B, s=S, hq=HQ, hkv=HKV, d=D):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    return (jax.random.normal(keys[0], (b, s, hq, d)), jax.random.normal(keys[1], (b, s, hkv, d)),
            jax.random.normal(keys[2], (b, s, hkv, d)), jax.random.normal(keys[3], (b, s, hq, d)))


def _documents(rng, rows, length, most):
    return jnp.asarray(random_documents(rng, rows, length, most))


def test_jax_keeps_the_private_names_bound_here():
    fused = cudnn_call._fused_module()
    assert fused is not None, f"jax {jax.__version__} moved one of {cudnn_call._PRIVATE}"
    assert {m for m in cudnn_call.MASKS.values()} <= set(fused.MaskType.__members__)


@pytest.mark.parametrize("mask,packed", [("causal", False), ("padding", False),
                                         ("padding_causal", True)])
def test_the_kernels_lower_to_cudnns_custom_calls_with_this_jaxs_rules(mask, packed):
    """The primitives bound with this jax's own abstract evaluation and CUDA lowering, lowered
    for CUDA (no GPU needed to lower): a parameter or operand a jax renames fails here. The
    forward and backward are cuDNN's fused-attention custom calls; packed, with the bound."""
    import re

    q = jnp.zeros((B, S, HQ, 64), jnp.bfloat16)
    k = jnp.zeros((B, S, HKV, 64), jnp.bfloat16)
    kw = {}
    if packed:
        lengths, offsets, _ = cudnn.packed_layout(jnp.zeros((B, S), jnp.int32), 4)
        kw = dict(lengths=(lengths, lengths), offsets=(offsets, offsets))
    elif mask == "padding":
        n = jnp.full((B,), S // 2, jnp.int32)
        kw = dict(lengths=(n, n))

    def step(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: cudnn_call.attention(q, k, v, mask=mask, **kw),
                           q, k, v)
        return out, vjp(out)

    text = jax.jit(step).trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
    assert set(re.findall(r"__cudnn\$\w+", text)) == {"__cudnn$fmhaSoftmax",
                                                       "__cudnn$fmhaSoftmaxBackward"}
    assert ("max_seg_per_batch\\22: 4" in text) == packed
    name = cudnn_call.MASKS[mask]  # the backend config names the mask type as the enum does
    assert f"mask_type\\22: \\22{name}\\22" in text, name


@pytest.mark.parametrize("hkv", [HQ, HKV])
def test_the_packed_conversion_is_jaxs(hkv):
    """ragged() gives what JAX's wrapper gives cuDNN: its _fix_seqlen_offsets, whose key offsets
    are strided by the key's own heads (jax 0.10 strides them by the query's: asked here with
    a query of the key's heads, which every version answers alike)."""
    seed = _fresh_seed()
    segments = _documents(np.random.default_rng(seed), 3, S, 6)
    lengths, offsets, _ = cudnn.packed_layout(segments, 6)
    q = jnp.zeros((3, S, HQ, D))
    k = jnp.zeros((3, S, hkv, D))
    (q_len, kv_len), (q_off, kv_off) = cudnn_call.ragged((lengths, lengths), (offsets, offsets),
                                                         q.shape, k.shape)
    fix = cudnn_call.FUSED._fix_seqlen_offsets
    want_q_len, _, want_q_off, _ = fix(lengths, lengths, offsets, offsets, q, q)
    _, want_kv_len, _, want_kv_off = fix(lengths, lengths, offsets, offsets, k, k)
    for got, want in ((q_len, want_q_len), (kv_len, want_kv_len), (q_off, want_q_off),
                      (kv_off, want_kv_off)):
        np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}")


def _check_against_reference(run, q, k, v, cotangent, *, causal, segments=None, seed=0):
    """Outputs, then gradients of <out, cotangent>, against the float32 reference (the
    outputs themselves: the inner product of random arrays may sit near 0)."""
    def ref(q, k, v):
        return reference_attention(q, k, v, causal=causal, segment_ids=segments)

    got, got_vjp = jax.vjp(run, q, k, v)
    want, want_vjp = jax.vjp(ref, q, k, v)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5, err_msg=f"seed {seed}")
    for g, w, name in zip(got_vjp(cotangent), want_vjp(cotangent), "qkv"):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5, err_msg=f"d{name}, seed {seed}")


@pytest.mark.parametrize("causal", [True, False])
def test_unpacked_attention_forward_and_gradients(emulated, causal):
    seed = _fresh_seed()
    q, k, v, ct = _qkv(seed)
    run = lambda q, k, v: cudnn_call.attention(  # noqa: E731
        q, k, v, mask="causal" if causal else "none")
    _check_against_reference(jax.jit(run), q, k, v, ct, causal=causal, seed=seed)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("bound", [1, 7])
def test_packed_attention_forward_and_gradients(emulated, causal, bound):
    seed = _fresh_seed()
    q, k, v, ct = _qkv(seed)
    segments = _documents(np.random.default_rng(seed), B, S, bound)
    lengths, offsets, fits = cudnn.packed_layout(segments, bound)
    assert bool(fits)

    def run(q, k, v):
        return cudnn_call.attention(q, k, v, mask="padding_causal" if causal else "padding",
                                    lengths=(lengths, lengths), offsets=(offsets, offsets))

    _check_against_reference(jax.jit(run), q, k, v, ct, causal=causal, segments=segments,
                             seed=seed)


def test_packed_attention_under_vmap_folds_the_mapped_axis(emulated):
    """vmap over a leading axis (the per-group step's) and gradients of it, and vmap of the
    gradients: the fold puts the mapped rows into the batch and the lengths stay per row."""
    seed = _fresh_seed()
    groups = 3
    q, k, v, ct = _qkv(seed, b=groups * B)
    segments = _documents(np.random.default_rng(seed), groups * B, S, 5)
    shape = lambda x: x.reshape(groups, B, *x.shape[1:])  # noqa: E731
    q, k, v, ct, segments = map(shape, (q, k, v, ct, segments))

    def one_group(q, k, v, seg):
        lengths, offsets, _ = cudnn.packed_layout(seg, 5)
        return cudnn_call.attention(q, k, v, mask="padding_causal", lengths=(lengths, lengths),
                                    offsets=(offsets, offsets))

    def loss(q, k, v):
        return jnp.vdot(jax.vmap(one_group)(q, k, v, segments), ct)

    def want_loss(q, k, v):
        ref = jax.vmap(lambda q, k, v, s: reference_attention(q, k, v, causal=True,
                                                              segment_ids=s))
        return jnp.vdot(ref(q, k, v, segments), ct)

    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    want = jax.value_and_grad(want_loss, argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got[0], want[0], rtol=2e-5, atol=1e-4, err_msg=f"seed {seed}")
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5, err_msg=f"seed {seed}")
    per_group = jax.vmap(jax.grad(lambda q, k, v, s, c: jnp.vdot(one_group(q, k, v, s), c)))
    np.testing.assert_allclose(per_group(q, k, v, segments, ct), want[1][0], atol=2e-5,
                               err_msg=f"seed {seed}")


def test_inside_shard_map_on_every_device(emulated):
    seed = _fresh_seed()
    devices = np.array(jax.devices()[:4])
    mesh = jax.sharding.Mesh(devices, ("rows",))
    q, k, v, ct = _qkv(seed, b=4)
    run = jax.shard_map(lambda q, k, v: cudnn_call.attention(q, k, v, mask="causal"), mesh=mesh,
                        in_specs=(P("rows"),) * 3, out_specs=P("rows"), check_vma=False)
    _check_against_reference(jax.jit(run), q, k, v, ct, causal=True, seed=seed)


def test_the_forward_statistics_and_a_backward_from_given_ones(emulated):
    """forward's statistics are the log-sum-exp [b, hq, sq]; backward with the output and
    statistics of the whole attention gives this part's gradients (what a ring sums)."""
    seed = _fresh_seed()
    q, k, v, ct = _qkv(seed)
    out, stats = cudnn_call.forward(q, k, v, mask="causal")
    np.testing.assert_allclose(stats, cudnn_emulator.lse_reference(q, k, causal=True),
                               rtol=1e-5, atol=1e-5)
    grads = cudnn_call.backward(q, k, v, out, stats, ct, mask="causal")
    _, vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, causal=True), q, k, v)
    for g, w in zip(grads, vjp(ct)):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5, err_msg=f"seed {seed}")


def test_padding_lengths_apart_for_queries_and_keys(emulated):
    """The first n queries attend to the first m keys (what a ring hop with documents uses):
    the other queries' outputs are 0."""
    seed = _fresh_seed()
    q, k, v, ct = _qkv(seed)
    n, m = jnp.asarray([5, 0], jnp.int32), jnp.asarray([9, 1], jnp.int32)
    out = cudnn_call.attention(q, k, v, mask="padding", lengths=(n, m))
    kk, vv = (jnp.repeat(x[0, :9], HQ // HKV, axis=1) for x in (k, v))
    probs = jax.nn.softmax(jnp.einsum("qhd,khd->hqk", q[0, :5], kk) / np.sqrt(D), axis=-1)
    np.testing.assert_allclose(out[0, :5], jnp.einsum("hqk,khd->qhd", probs, vv), atol=2e-5)
    assert not np.any(np.asarray(out[0, 5:])) and not np.any(np.asarray(out[1]))


def test_the_check_refuses_float32_before_anything_else():
    """A dtype cuDNN does not take is refused while tracing (so basp_jax.cudnn falls back to our
    kernel), not at lowering."""
    q, k, v, _ = _qkv(0)
    with pytest.raises(NotImplementedError, match="bfloat16 or float16"):
        cudnn_call.check(q, k, v, mask="causal", packed=False)


def test_the_check_refuses_a_packed_layout_past_int32_offsets():
    """The packed layout's offsets count elements (token x heads x head_dim) in int32: 4M tokens
    of 4 heads of 128 (the long-context 8B per GPU) reach 2^31, and our kernel takes them."""
    q = jax.ShapeDtypeStruct((1, 4194304, 4, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 4194304, 1, 128), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="int32 element offsets"):
        cudnn_call.check(q, k, k, mask="padding_causal", packed=True)
