"""basp_jax.vocab and basp_jax.tiling: the chunked cross-entropy (chunked_lm_loss) against the
whole [tokens, vocab] computation (the same loss and gradients, a fraction of the temporaries),
the vocabulary-parallel lookup in chunks, and the chunk sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import basp_jax
import models
from basp_jax import vocab
from basp_jax.tiling import chunk_len
from basp_jax.vocab import chunked_lm_loss


def _project_untied(h, w):
    return jnp.einsum("...d,dv->...v", h, w, preferred_element_type=jnp.float32)


def _project_tied(h, w):
    return jnp.einsum("...d,vd->...v", h, w, preferred_element_type=jnp.float32)


def _inputs(tokens, dim, vocab, tied, masked, seed=0):
    kh, kw, kt = jax.random.split(jax.random.PRNGKey(seed), 3)
    hidden = jax.random.normal(kh, (2, tokens, dim), jnp.float32)
    weight = 0.5 * jax.random.normal(kw, (vocab, dim) if tied else (dim, vocab), jnp.float32)
    targets = jax.random.randint(kt, (2, tokens), 0, vocab)
    if masked:
        targets = targets.at[0, :5].set(-100).at[1, 7:19].set(-1)
    return hidden, weight, targets


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_chunked_loss_and_gradients_equal_the_whole_computation(tied, masked):
    hidden, weight, targets = _inputs(48, 16, 96, tied, masked)
    project = _project_tied if tied else _project_untied

    def whole(h, w):
        return models.causal_lm_loss(project(h, w), targets)

    def chunked(h, w):  # 2 rows x 8 positions per chunk: 6 chunks
        return chunked_lm_loss(h, targets, project, w, models.causal_lm_loss, chunk_tokens=16)

    (want, want_n), want_g = jax.value_and_grad(whole, argnums=(0, 1), has_aux=True)(hidden, weight)
    (got, got_n), got_g = jax.value_and_grad(chunked, argnums=(0, 1), has_aux=True)(hidden, weight)
    assert float(got_n) == float(want_n) == (96 - 17 if masked else 96)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for name, g, w in zip(["d_hidden", "d_weight"], got_g, want_g):
        scale = float(jnp.abs(w).max())
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * scale, err_msg=name)


@pytest.mark.slow  # seconds
def test_chunked_loss_temporaries_fall():
    """Compiled memory (CPU): the whole computation holds [tokens, vocab] float32 logits and
    their gradient; chunked, only one chunk's worth (2 x 2048 tokens, vocab 4096: 64 MiB per
    buffer against 2 MiB per 128-token chunk)."""
    hidden, weight, targets = _inputs(2048, 32, 4096, tied=False, masked=False)

    def temporaries(fn):
        grad = jax.jit(jax.grad(lambda h, w: fn(h, w)[0], argnums=(0, 1)))
        return grad.lower(hidden, weight).compile().memory_analysis().temp_size_in_bytes

    whole = temporaries(lambda h, w: models.causal_lm_loss(_project_untied(h, w), targets))
    chunked = temporaries(lambda h, w: chunked_lm_loss(h, targets, _project_untied, w,
                                                       models.causal_lm_loss, chunk_tokens=128))
    logits_bytes = 2 * 2048 * 4096 * 4
    assert whole >= logits_bytes, whole
    assert chunked < logits_bytes / 8, (chunked, whole)


def test_chunk_len_is_the_largest_divisor_that_fits():
    assert chunk_len(524288, 1, 4096) == 4096
    assert chunk_len(96, 2, 64) == 32  # 2 rows x 32 <= 64; 48 would not fit
    assert chunk_len(97, 1, 64) == 1  # a prime: one token at a time
    assert chunk_len(12, 1, 1000) == 12


def test_vocab_parallel_lookup_in_chunks_equals_the_whole(monkeypatch):
    """At long sequences the vocabulary-parallel lookup gathers its rows in chunks (rows of 32
    shards x 512K tokens would be 256 GiB): the same rows and table gradient as in one piece."""
    layout = basp_jax.Layout.plan(8, 2, 64, 8, 2, groups=2)
    mesh = basp_jax.make_mesh(layout)
    rng = np.random.default_rng(3)
    table = jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 64, (8 * 32,)), jnp.int32)
    cotangent = jnp.asarray(rng.normal(size=(8 * 32, 16)), jnp.float32)

    def rows_and_grad():
        def f(t):
            rows = vocab.parallel_lookup(t, tokens, mesh=mesh, axes=("group", "seq"),
                                         dtype=jnp.float32)
            return jnp.sum(rows * cotangent), rows
        (_, rows), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(table)
        return np.asarray(rows), np.asarray(grad)

    whole = rows_and_grad()
    monkeypatch.setattr(vocab, "LOOKUP_WHOLE_BYTES", 0)
    monkeypatch.setattr(vocab, "LOOKUP_CHUNK_BYTES", 8 * 16 * 4 * 4)  # 4 tokens a chunk
    chunked = rows_and_grad()
    np.testing.assert_array_equal(whole[0], np.asarray(table)[np.asarray(tokens)])
    np.testing.assert_allclose(chunked[0], whole[0], rtol=0, atol=0)
    np.testing.assert_allclose(chunked[1], whole[1], rtol=1e-6, atol=1e-6)
