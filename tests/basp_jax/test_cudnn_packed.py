"""basp_jax.cudnn on CPU: the packed layout's lengths and offsets, derived from segment ids,
describe the same attention as the segment mask (forward and gradients, fresh random documents);
a step whose rows hold more documents than the layout's bound runs the fallback kernel; JAX's
private cuDNN names it relies on are where it looks (this test fails when a jax moves them).
The cuDNN kernel itself needs a GPU: the GPU check runs it, the GPU-compile tier compiles it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from basp_jax import cudnn, cudnn_call

from tests.helpers import cudnn_emulator
from tests.helpers.reference import random_documents, reference_attention

B, S, HQ, HKV, D = 3, 48, 4, 2, 8


def _documents_as_cudnn_reads_them(q, k, lengths, offsets):
    """[b, s] document of each token (-1 - position: none) as cuDNN reads the layout, after
    JAX's wrapper turned the per-row lengths and offsets into one list of segments over the
    flattened batch (its _fix_seqlen_offsets, with more than one document per row)."""
    b, s, heads, dim = q.shape
    if offsets.shape[1] - 1 > 1:
        fused = cudnn._fused_module()
        lengths, _, offsets, _ = fused._fix_seqlen_offsets(lengths, lengths, offsets, offsets,
                                                           q, k)
        starts = offsets.reshape(-1)[:lengths.size] // (heads * dim)  # per token, not element
        lengths = lengths.reshape(-1)
    else:  # one document per row: each row's own length from its start
        starts = jnp.where(offsets[:, 0] >= 0, offsets[:, 0] + jnp.arange(b) * s, -1)
        lengths = lengths[:, 0]
    pos = jnp.arange(b * s)
    inside = (pos[:, None] >= starts[None]) & (pos[:, None] < starts[None] + lengths[None]) & \
        (lengths[None] > 0) & (starts[None] >= 0)
    return jnp.where(inside.any(-1), jnp.argmax(inside, -1), -1 - pos).reshape(b, s)


def _layout_attention(q, k, v, lengths, offsets, *, causal):
    """Attention whose mask is built from the packed layout alone, read as cuDNN reads it: a
    query sees the keys of its own document, the earlier ones where causal."""
    doc = _documents_as_cudnn_reads_them(q, k, lengths, offsets)
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    mask = (doc[:, :, None] == doc[:, None, :])[:, None]
    if causal:
        mask = mask & jnp.tril(jnp.ones((q.shape[1],) * 2, bool))[None, None]
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def _random_documents(rng, rows: int, most: int) -> np.ndarray:
    return random_documents(rng, rows, S, most)


def _qkv(seed):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    return (jax.random.normal(keys[0], (B, S, HQ, D)), jax.random.normal(keys[1], (B, S, HKV, D)),
            jax.random.normal(keys[2], (B, S, HKV, D)), jax.random.normal(keys[3], (B, S, HQ, D)))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("bound", [1, 5, 16])
def test_the_layout_is_the_segment_mask_forward_and_gradients(causal, bound):
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    segments = jnp.asarray(_random_documents(rng, B, bound))
    lengths, offsets, fits = cudnn.packed_layout(segments, bound)
    assert bool(fits), seed
    q, k, v, cotangent = _qkv(seed)

    def from_layout(q, k, v):
        return jnp.vdot(_layout_attention(q, k, v, lengths, offsets, causal=causal), cotangent)

    def from_segments(q, k, v):
        return jnp.vdot(reference_attention(q, k, v, causal=causal, segment_ids=segments),
                        cotangent)

    got = jax.value_and_grad(from_layout, argnums=(0, 1, 2))(q, k, v)
    want = jax.value_and_grad(from_segments, argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, err_msg=f"seed {seed}")
    for g, w, name in zip(got[1], want[1], "qkv"):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5, err_msg=f"d{name}, seed {seed}")


def test_lengths_offsets_and_the_bound():
    segments = jnp.asarray([[1, 1, 1, 2, 2, 3, 3, 3], [4] * 8, [1, 2, 3, 4, 5, 6, 7, 8],
                            [0, 0, 7, 7, 7, 7, 0, 0]], jnp.int32)
    lengths, offsets, fits = cudnn.packed_layout(segments[:2], 4)
    # JAX's wrapper takes each row's starts, -1 after them (its docstring's example:
    # [[0, 1, 2, -1], [0, 1, -1, -1]] for rows of 3 and 2 one-token documents)
    np.testing.assert_array_equal(lengths, [[3, 2, 3, -1], [8, -1, -1, -1]])
    np.testing.assert_array_equal(offsets, [[0, 3, 5, -1, -1], [0, -1, -1, -1, -1]])
    assert bool(fits)
    # a row of 8 documents does not fit 4: the layout would merge them, the step must not use it
    assert not bool(cudnn.packed_layout(segments[2:3], 4)[2])
    assert bool(cudnn.packed_layout(segments[2:3], 8)[2])
    # ids repeated apart are separate documents (runs), as the packer never writes them
    np.testing.assert_array_equal(cudnn.packed_layout(segments[3:], 4)[0], [[2, 4, 2, -1]])


@pytest.fixture
def fake_cudnn(monkeypatch):
    """cuDNN's kernels computed on CPU (tests/helpers/cudnn_emulator): the masks the packed
    path binds them with, recorded."""
    return cudnn_emulator.install(monkeypatch, cudnn_call)


def test_a_row_over_the_bound_runs_the_fallback_kernel(fake_cudnn):
    q, k, v, _ = _qkv(1)
    fallback_used = []

    def fallback(q, k, v, *, causal, segment_ids):
        fallback_used.append(True)
        return reference_attention(q, k, v, causal=causal, segment_ids=segment_ids) + 1000.0

    run = jax.jit(lambda q, k, v, seg: cudnn.attention(
        q, k, v, causal=True, segment_ids=seg, capability=(9, 0), bound=4, fallback=fallback))
    rng = np.random.default_rng(0)
    few, many = _random_documents(rng, B, 4), _random_documents(rng, B, 4)
    many[1] = np.arange(S) // 4 + 1  # 12 documents in one row
    want = reference_attention(q, k, v, causal=True, segment_ids=jnp.asarray(few))
    np.testing.assert_allclose(run(q, k, v, jnp.asarray(few)), want, atol=1e-5)
    over = run(q, k, v, jnp.asarray(many))  # the whole step takes the fallback
    want = reference_attention(q, k, v, causal=True, segment_ids=jnp.asarray(many)) + 1000.0
    np.testing.assert_allclose(over, want, atol=1e-4)
    assert fallback_used and set(fake_cudnn) == {"PADDING_CAUSAL"}


def test_the_packed_layout_needs_hopper_and_the_check_sees_the_target():
    assert cudnn.packed_supported((9, 0)) and cudnn.packed_supported((10, 0))
    assert not cudnn.packed_supported((8, 0)) and not cudnn.packed_supported(None)
    fused = cudnn._fused_module()
    before = fused.check_compute_capability
    with cudnn.capability_seen_as((9, 0)):
        assert fused.check_compute_capability("9.0") and not fused.check_compute_capability("10.0")
        assert fused.is_cuda_compute_capability_equal("9.0")
    assert fused.check_compute_capability is before
    assert fused.check_compute_capability("9.0") is False  # this host has no GPU


def test_jax_keeps_the_private_names_the_packed_path_uses():
    """jax._src.cudnn.fused_attention_stablehlo's trace-time capability checks (the kernels'
    primitives: tests/basp_jax/test_cudnn_call.py). A jax that moves them makes basp_jax.cudnn
    offer no packed path (FUSED is None): this test says so first."""
    fused = cudnn._fused_module()
    assert fused is not None, f"jax {jax.__version__} moved one of {cudnn._PRIVATE}"
    assert cudnn.packed_supported((9, 0))


def test_a_refusal_while_tracing_runs_the_fallback_with_one_note(fake_cudnn, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise NotImplementedError("The head dim must be <= 256 and a multiple of 8, but got 7.")

    monkeypatch.setattr(cudnn_call, "check", refuse)
    q, k, v, _ = _qkv(2)
    segments = jnp.asarray(_random_documents(np.random.default_rng(2), B, 3))
    used = []

    def fallback(q, k, v, *, causal, segment_ids):
        used.append(True)
        return reference_attention(q, k, v, causal=causal, segment_ids=segment_ids)

    for _ in range(2):
        out = cudnn.attention(q, k, v, causal=True, segment_ids=segments, capability=(9, 0),
                              fallback=fallback)
    np.testing.assert_allclose(out, reference_attention(q, k, v, causal=True,
                                                        segment_ids=segments), atol=1e-5)
    assert len(used) == 2
    notes = [r for r in caplog.records if "cuDNN attention refused" in r.getMessage()]
    assert len(notes) == 1 and "head dim must be" in notes[0].getMessage()
    with pytest.raises(NotImplementedError):  # no fallback (CPU, tests): the error itself
        cudnn.attention(q, k, v, causal=True, segment_ids=segments, capability=(9, 0))


def test_under_vmap_the_bound_stays_one_conditional(fake_cudnn):
    """The per-group step maps the model over groups: the over-the-bound check must stay a
    conditional (one kernel runs), not become a select that runs cuDNN and the fallback."""
    q, k, v, _ = _qkv(3)
    segments = jnp.asarray(_random_documents(np.random.default_rng(3), B, 4))

    def fallback(q, k, v, *, causal, segment_ids):
        return reference_attention(q, k, v, causal=causal, segment_ids=segment_ids)

    def one(q, k, v, seg):
        return cudnn.attention(q, k, v, causal=True, segment_ids=seg, capability=(9, 0),
                               bound=4, fallback=fallback)

    stack = lambda x: jnp.stack([x, x])  # noqa: E731
    for mapped, args in ((jax.vmap(one), map(stack, (q, k, v, segments))),
                         (jax.vmap(jax.vmap(one)), map(stack, map(stack, (q, k, v, segments))))):
        jaxpr = str(jax.make_jaxpr(mapped)(*args))
        assert " cond[" in jaxpr and "select_n" not in jaxpr.split(" cond[")[1][:200], \
            jaxpr[:2000]
    out = jax.vmap(one)(*map(stack, (q, k, v, segments)))
    want = reference_attention(q, k, v, causal=True, segment_ids=segments)
    np.testing.assert_allclose(out[1], want, atol=1e-5)
