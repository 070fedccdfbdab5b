"""The model's chunked cross-entropy (Transformer.loss, through basp_jax.vocab.Table.loss) against
the whole [tokens, vocab] computation: the same loss and gradients; the vocabulary-split tables
used where they are stored."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import basp_jax
import models

pytestmark = pytest.mark.slow  # every test here takes seconds


@pytest.mark.parametrize("tied", [False, True])
def test_model_loss_on_mesh_equals_loss_of_logits(tied):
    """Transformer.loss on the (2, 4) mesh, 4 chunks per device, against causal_lm_loss of the
    model's whole logits: loss and every parameter gradient."""
    config = dataclasses.replace(models.ModelConfig.preset("tiny"), num_layers=1,
                                 tie_word_embeddings=tied)
    layout = basp_jax.Layout.plan(8, 2, 64, config.num_heads, config.num_kv_heads, groups=2)
    model = models.init_model(config, mesh=basp_jax.make_mesh(layout), seed=1)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 64), 0, config.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1).at[:, -1].set(-100).at[0, 3:9].set(-100)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params, chunked):
        module = nnx.merge(graphdef, params)
        if chunked:  # 16 tokens per device: 4 per chunk
            total, count = module.loss(tokens, targets, chunk_tokens=4)
        else:
            total, count = models.causal_lm_loss(module(tokens), targets)
        return total / count

    want, want_g = jax.jit(jax.value_and_grad(lambda p: loss(p, False)))(params)
    got, got_g = jax.jit(jax.value_and_grad(lambda p: loss(p, True)))(params)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for (path, g), (_, w) in zip(jax.tree_util.tree_leaves_with_path(got_g),
                                 jax.tree_util.tree_leaves_with_path(want_g)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


# each strategy once, and tied and untied tables once each
@pytest.mark.parametrize("strategy,tied", [("fsdp", False), ("hsdp", True)])
def test_vocab_sharded_lookup_and_loss_equal_the_gathering_ones_and_move_no_table(tied, strategy):
    """basp_jax.vocab (the embedding and the head stored sharded on the vocabulary under
    fsdp/hsdp): loss and every parameter gradient equal the same model computed by gathering the
    tables (vocab_parallel "never"), on the (2, 4) mesh; and no collective of the compiled step
    carries a whole [vocab, hidden] table, where the gathering program does."""
    from basp_jax.compiled import comm

    # A vocabulary large enough that a whole table (2 MiB) outweighs the layer's collectives.
    config = dataclasses.replace(models.ModelConfig.preset("tiny"), num_layers=1,
                                 tie_word_embeddings=tied, vocab_size=4096)
    layout = basp_jax.Layout.plan(8, 2, 64, config.num_heads, config.num_kv_heads, groups=2)
    model = models.init_model(config, mesh=basp_jax.make_mesh(layout), seed=2,
                              param_sharding=strategy)
    want_axes = ("group", "seq") if strategy == "fsdp" else ("seq",)
    assert model.embed_tokens.table.vocab_axes == model.head_table.vocab_axes == want_axes
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 64), 0, config.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1).at[:, -1].set(-100).at[1, 10:20].set(-100)
    graphdef, params = nnx.split(model, nnx.Param)
    gathering = nnx.clone(model)
    gathering.embed_tokens.table = dataclasses.replace(gathering.embed_tokens.table, mode="never")
    gathering.head_table = dataclasses.replace(gathering.head_table, mode="never")
    graphdef_gathering = nnx.graphdef(gathering)

    def loss(params, graphdef):
        total, count = nnx.merge(graphdef, params).loss(tokens, targets, chunk_tokens=8)
        return total / count

    def compiled(graphdef):
        return jax.jit(jax.value_and_grad(lambda p: loss(p, graphdef))).lower(params).compile()

    got_fn, want_fn = compiled(graphdef), compiled(graphdef_gathering)
    (got, got_g), (want, want_g) = got_fn(params), want_fn(params)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for (path, g), (_, w) in zip(jax.tree_util.tree_leaves_with_path(got_g),
                                 jax.tree_util.tree_leaves_with_path(want_g)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    table = config.vocab_size * config.hidden_size * 4  # float32 bytes

    def largest(fn):
        return max(c.bytes for c in comm.parse_collectives(fn.as_text(), 8))

    assert largest(want_fn) >= table  # the gathering program moves a whole table
    assert largest(got_fn) < table / 2, largest(got_fn)


@pytest.mark.parametrize("strategy", ["replicated", "hsdp"])
def test_a_replicated_heads_gradient_is_reduced_once_not_once_per_chunk(strategy):
    """With the head replicated over the token shards (replicated parameters; hsdp with sp=1, B=8
    on 8 devices), the gathering loss's chunks accumulate the head's gradient on each device and
    the compiled step all-reduces it once, where it used to all-reduce the [vocab, hidden] table
    once per chunk (8 times here, twice each: over seq, then over group)."""
    from basp_jax.compiled import comm

    config = dataclasses.replace(models.ModelConfig.preset("tiny"), num_layers=1, vocab_size=4096)
    groups = 2 if strategy == "replicated" else 8
    layout = basp_jax.Layout.plan(8, groups, 256, config.num_heads, config.num_kv_heads,
                                  groups=groups)
    model = models.init_model(config, mesh=basp_jax.make_mesh(layout), seed=2,
                              param_sharding=strategy)
    assert model.head_table.vocab_axes is None
    tokens = jax.random.randint(jax.random.PRNGKey(3), (groups, 256), 0, config.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1).at[:, -1].set(-100)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params):
        total, count = nnx.merge(graphdef, params).loss(tokens, targets, chunk_tokens=8)
        return total / count

    compiled = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
    reduces = [c for c in comm.parse_collectives(compiled.as_text(), 8) if c.kind == "all-reduce"]
    assert all(c.executions == 1 for c in reduces), [(c.bytes, c.executions) for c in reduces]
    # At most twice the gradient: the tied table's two uses (lookup and head) reduced as two
    # buffers, and the layers' reduced over seq, then over group. One reduction per chunk read
    # 34 MiB here (the 2 MiB table 8 times over seq and 8 over group) against 2.5 MiB of gradient.
    grads = sum(x.size * 4 for x in jax.tree.leaves(params))
    assert sum(c.bytes for c in reduces) <= 2 * grads + 64, (reduces, grads)
    # and the loss and gradients are the whole [tokens, vocab] computation's
    def whole(params):
        total, count = models.causal_lm_loss(nnx.merge(graphdef, params)(tokens), targets)
        return total / count

    want, want_g = jax.jit(jax.value_and_grad(whole))(params)
    got, got_g = compiled(params)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
