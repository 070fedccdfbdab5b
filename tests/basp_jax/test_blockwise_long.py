"""Blockwise attention at S = 16384 on one CPU device: forward and backward in bounded memory
(BENCHMARKS.md section 3 has the same at 32768)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from basp_jax.blockwise import blockwise_attention
from basp_jax.kernels import xla_attention

pytestmark = pytest.mark.slow  # every test here takes seconds

S, SHAPE = 16384, (1, 16384, 1, 32)
# The programs this file runs (not only compiles) get optimised machine code: the suite's
# -O0 (tests/helpers/flags.py) makes S^2 exponentials 1.7x slower, for the same results.
RUN_OPTIONS = {"xla_backend_optimization_level": 3}


def _loss(kernel):
    return lambda q, k, v: (kernel(q, k, v) ** 2).sum()


def test_blockwise_runs_16k_tokens_in_bounded_memory():
    blockwise = lambda q, k, v: blockwise_attention(q, k, v, causal=True, block_size=1024)
    spec = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
    step = jax.jit(jax.value_and_grad(_loss(blockwise), argnums=(0, 1, 2)))
    compiled = step.lower(spec, spec, spec).compile(RUN_OPTIONS)
    temp = compiled.memory_analysis().temp_size_in_bytes
    xla_step = jax.jit(jax.value_and_grad(_loss(lambda q, k, v: xla_attention(q, k, v, causal=True)), argnums=(0, 1, 2)))
    xla_temp = xla_step.lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes
    assert xla_temp >= S * S * 4  # the xla kernel holds S^2 float32 scores
    assert temp < 128 * 2**20, f"blockwise needs {temp / 2**20:.0f} MiB of temporaries"

    q, k, v = (jax.random.normal(key, SHAPE) for key in jax.random.split(jax.random.PRNGKey(0), 3))
    out = jax.jit(blockwise).lower(q, k, v).compile(RUN_OPTIONS)(q, k, v)
    loss, grads = compiled(q, k, v)
    assert np.isfinite(float(loss)) and all(np.isfinite(np.asarray(g)).all() for g in grads)
    # The last query rows attend over (nearly) all S keys: check them against a direct softmax.
    rows = np.arange(S - 8, S)
    scores = jnp.einsum("qd,kd->qk", q[0, rows, 0], k[0, :, 0]) / np.sqrt(SHAPE[-1])
    scores = jnp.where(np.arange(S)[None, :] <= rows[:, None], scores, -jnp.inf)
    want = jax.nn.softmax(scores, axis=-1) @ v[0, :, 0]
    np.testing.assert_allclose(out[0, rows, 0], want, atol=2e-5, rtol=2e-5)
