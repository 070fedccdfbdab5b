"""Position ids for RoPE: global positions per shard, per-document positions under packing."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from basp_jax import Layout, activation_sharding, make_mesh, position_ids, shard_positions
from tests.helpers.reference import packed_segment_ids


def _numpy_document_positions(segment_ids):
    out = np.zeros_like(segment_ids)
    for row in range(segment_ids.shape[0]):
        for i in range(1, segment_ids.shape[1]):
            same = segment_ids[row, i] == segment_ids[row, i - 1]
            out[row, i] = out[row, i - 1] + 1 if same else 0
    return out


def test_global_positions():
    np.testing.assert_array_equal(position_ids(2, 5), np.tile(np.arange(5), (2, 1)))


def test_document_positions_restart_at_each_segment_on_a_sharded_array():
    mesh = make_mesh(Layout.plan(8, batch=2, seq_len=64, num_heads=8))
    seg = packed_segment_ids(jax.random.PRNGKey(0), 2, 64, max_docs=5)
    sharded = jax.device_put(seg, activation_sharding(mesh))
    got = jax.jit(lambda s: position_ids(2, 64, s), out_shardings=activation_sharding(mesh))(sharded)
    np.testing.assert_array_equal(got, _numpy_document_positions(np.asarray(seg)))


def test_shard_positions_inside_shard_map_are_global():
    mesh = make_mesh(Layout.plan(8, batch=2, seq_len=64, num_heads=8))  # (2, 4): 16 tokens each

    def local(x):
        return x + shard_positions(x.shape[1])[None, :]

    fn = jax.shard_map(local, mesh=mesh, in_specs=P("group", "seq"), out_specs=P("group", "seq"))
    got = jax.jit(fn)(jnp.zeros((2, 64), jnp.int32))
    np.testing.assert_array_equal(got, np.tile(np.arange(64), (2, 1)))
