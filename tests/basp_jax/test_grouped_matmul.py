"""basp_jax.grouped_matmul on CPU, in Pallas' interpret mode: the forward and both gradients
equal jax.lax.ragged_dot's on fresh random inputs, with empty groups, rows past the groups, a
row count no tile divides and groups that start and end inside a tile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from basp_jax import grouped_matmul as gmm

TILES = gmm.Tiles(m=16, k=32, n=16)


def _inputs(seed, m, k, n, sizes, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.normal(size=(m, k)), dtype)
    rhs = jnp.asarray(rng.normal(size=(len(sizes), k, n)), dtype)
    weights = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)  # a cotangent of fresh values
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), weights


@pytest.mark.parametrize("m,sizes", [
    (200, [50, 0, 70, 40]),      # 40 rows past the groups; an empty group
    (96, [7, 33, 0, 0, 56]),     # every row in a group, boundaries inside tiles
    (37, [0, 37]),               # two whole tiles of 16 rows and part of a third
])
def test_forward_and_gradients_equal_ragged_dot(m, sizes):
    seed = int(np.random.default_rng().integers(1 << 16))
    lhs, rhs, group_sizes, weights = _inputs(seed, m, 64, 32, sizes)

    def loss(fn):
        return lambda l, r: jnp.sum(fn(l, r, group_sizes).astype(jnp.float32) * weights)

    ours = lambda l, r, s: gmm.grouped_matmul(l, r, s, tiles=TILES, interpret=True)
    np.testing.assert_allclose(ours(lhs, rhs, group_sizes),
                               jax.lax.ragged_dot(lhs, rhs, group_sizes), atol=2e-5, rtol=1e-5,
                               err_msg=f"seed {seed}")
    got = jax.grad(loss(ours), argnums=(0, 1))(lhs, rhs)
    want = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(lhs, rhs)
    for g, w, name in zip(got, want, ("lhs", "rhs")):
        assert np.abs(w).max() > 1e-2
        np.testing.assert_allclose(g, w, atol=5e-5, rtol=1e-5, err_msg=f"d{name}, seed {seed}")


def test_bfloat16_inputs_accumulate_in_float32():
    lhs, rhs, group_sizes, _ = _inputs(3, 64, 128, 32, [30, 34], jnp.bfloat16)
    out = gmm.grouped_matmul(lhs, rhs, group_sizes, tiles=TILES, interpret=True)
    want = jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), group_sizes)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), want, rtol=2e-2, atol=2e-1)


def test_bad_shapes_and_impls_are_one_line():
    lhs, rhs, group_sizes, _ = _inputs(0, 32, 64, 24, [32])
    with pytest.raises(ValueError, match="divisible by 16"):
        gmm.grouped_matmul(lhs, rhs, group_sizes, interpret=True)
    with pytest.raises(ValueError, match=r"lhs \[M, K\] and rhs \[G, K, N\]"):
        gmm.grouped_matmul(lhs, rhs[:, :32], group_sizes, interpret=True)
    with pytest.raises(ValueError, match="auto, xla, pallas"):
        gmm.resolve_impl("cutlass", "gpu")
    assert gmm.resolve_impl("auto", "gpu") == "pallas"
    assert gmm.resolve_impl("auto", "gpu", (2048, 768)) == "pallas"
    assert gmm.resolve_impl("auto", "gpu", (2048, 24)) == "xla"  # no tile of 16 divides 24
    assert gmm.resolve_impl("auto", "cpu") == "xla"
