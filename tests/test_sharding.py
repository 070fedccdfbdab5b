"""Which dimension of a parameter basp_jax.sharding shards."""

from jax.sharding import PartitionSpec as P

import basp_jax


def test_parameters_shard_their_major_large_dimension_and_tables_their_vocabulary():
    """basp_jax.sharding.param_spec, Llama-3.1-8B's stacked shapes over 8 devices: the MLP's
    [4096, 14336] on 4096 (a minor sharded dimension made XLA copy each stacked matrix
    transposed, 0.9 GiB), the tables on the vocabulary (models.vocab_parallel needs it), the
    layer count never."""
    from basp_jax.sharding import param_spec

    mesh = basp_jax.make_mesh(basp_jax.Layout.plan(8, 2, 64, 8, 2, groups=2))
    fsdp = ("group", "seq")
    want = {
        (32, 4096, 14336): P(None, fsdp, None),   # gate_proj, up_proj
        (32, 14336, 4096): P(None, fsdp, None),   # down_proj
        (32, 4096, 1024): P(None, fsdp, None),    # k_proj, v_proj
        (128256, 4096): P(fsdp, None),            # embed_tokens
        (4096, 128256): P(None, fsdp),            # lm_head
        (32, 4096): P(None, fsdp),                # stacked norm weights
        (12,): P(),                               # nothing divides: replicated
    }
    for shape, spec in want.items():
        assert param_spec(shape, mesh, "fsdp") == spec, shape
