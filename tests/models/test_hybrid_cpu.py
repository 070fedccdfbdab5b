"""The Qwen3.5 hybrid on emulated CPU devices, without transformers: the delta rule's triangular
inverse, and train.py on the tiny hybrid preset (the config a newcomer tries first).

The chunked delta rule once solved its triangular systems with LAPACK's batched solve, whose CPU
kernel waits forever on a pool thread when several emulated devices run it at once: the first
train step hung at 0% CPU. The trainer runs here as a subprocess with a time limit, so a hang
fails this test instead of the worker."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.linear_attention import unit_lower_inverse
from tests.helpers.trainer import train_shipped_steps


@pytest.mark.parametrize("n", [1, 5, 16, 64])
def test_unit_lower_inverse_inverts_and_differentiates(n):
    """Its inverse times the matrix is the identity (n a power of two or padded to one), and
    its gradient is numpy's inverse's: d(sum(w * L^-1)) / dL = -(L^-T w L^-T), lower part."""
    rng = np.random.default_rng(n)
    system = np.tril(rng.normal(size=(3, 2, n, n)) * 0.3, -1) + np.eye(n)
    inverse = np.asarray(jax.jit(unit_lower_inverse)(jnp.asarray(system, jnp.float32)))
    np.testing.assert_allclose(inverse @ system, np.broadcast_to(np.eye(n), system.shape),
                               atol=1e-5)

    weights = rng.normal(size=system.shape)
    grad = jax.jit(jax.grad(lambda s: jnp.sum(unit_lower_inverse(s) * weights)))(
        jnp.asarray(system, jnp.float32))
    exact_inverse = np.linalg.inv(system)
    expected = -np.swapaxes(exact_inverse, -1, -2) @ weights @ np.swapaxes(exact_inverse, -1, -2)
    lower = np.tril(np.ones((n, n), bool), -1)  # the strictly lower part is what the inverse reads
    np.testing.assert_allclose(np.asarray(grad)[..., lower], expected[..., lower], atol=1e-4)


def test_the_tiny_hybrid_trains_on_eight_cpu_devices(tmp_path):
    """configs/qwen3.5_tiny_cpu.yaml for 4 steps (BASP, 2 groups x sp=4, forward and backward):
    it ends within the time limit, exit 0, and its loss falls."""
    losses = [row["loss"] for row in train_shipped_steps("qwen3.5_tiny_cpu.yaml", tmp_path / "run")]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
