"""basp_jax.sharding: the one table from logical axis names to mesh axes, as the model reads it."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import basp_jax
import models
from basp_jax.sharding import ShardingRules, activation_spec, host_mesh
from models.layers import param_names

FSDP = ("group", "seq")


def _mesh(groups=2, devices_per_host=4):
    return basp_jax.make_mesh(basp_jax.Layout.plan(8, 2, 64, 8, 2, groups=groups,
                                                   devices_per_host=devices_per_host))


def _specs(config, rules):
    """{'layers.mlp.down_proj.kernel': spec, ...} of the model's parameters under `rules`."""
    state = nnx.state(models.abstract_model(config), nnx.Param)
    pure = nnx.to_pure_dict(state)
    flat = jax.tree_util.tree_flatten_with_path(rules.shardings(param_names(state), pure))[0]
    return {".".join(str(k.key) for k in path): s.spec for path, s in flat}


def test_llama_8b_splits_each_matrix_on_its_major_axis_and_the_tables_on_the_vocabulary():
    """Llama-3.1-8B's parameters by their own axis names over 8 devices: the MLP's [4096, 14336]
    on 4096 (a minor split made XLA copy each stacked matrix transposed, 0.9 GiB), the tables on
    the vocabulary (basp_jax.vocab needs it), the layer stack never."""
    specs = _specs(models.ModelConfig.preset("llama-3.1-8b"), ShardingRules("fsdp", _mesh()))
    assert specs == {
        "embed_tokens.weight": P(FSDP, None),                  # [128256, 4096]
        "lm_head.kernel": P(None, FSDP),                       # [4096, 128256]
        "norm.weight": P(FSDP),
        "layers.input_layernorm.weight": P(None, FSDP),        # [32, 4096]
        "layers.post_attention_layernorm.weight": P(None, FSDP),
        "layers.self_attn.q_proj.kernel": P(None, FSDP, None),  # [32, 4096, 4096]
        "layers.self_attn.k_proj.kernel": P(None, FSDP, None),  # [32, 4096, 1024]
        "layers.self_attn.v_proj.kernel": P(None, FSDP, None),
        "layers.self_attn.o_proj.kernel": P(None, FSDP, None),
        "layers.mlp.gate_proj.kernel": P(None, FSDP, None),     # [32, 4096, 14336]
        "layers.mlp.up_proj.kernel": P(None, FSDP, None),
        "layers.mlp.down_proj.kernel": P(None, FSDP, None),     # [32, 14336, 4096]
    }


def test_each_strategy_splits_over_its_own_mesh_axes():
    config = models.ModelConfig.preset("tiny")
    mesh = _mesh()
    want = {"fsdp": FSDP, "hsdp": "seq", "host": "local"}
    for strategy, axes in want.items():
        specs = _specs(config, ShardingRules(strategy, mesh, devices_per_host=4))
        assert specs["embed_tokens.weight"] == P(axes, None), strategy
        assert specs["layers.mlp.down_proj.kernel"] == P(None, axes, None), strategy
    assert set(_specs(config, ShardingRules("replicated", mesh)).values()) == {P()}
    assert ShardingRules("host", mesh, 4).placement.axis_names == ("host", "local")


def test_an_axis_the_mesh_does_not_divide_falls_back_and_never_to_the_layers():
    rules = ShardingRules("fsdp", _mesh())
    assert rules.spec(("vocab", "embed"), (99, 64)) == P(None, FSDP)  # a tiny test vocabulary
    assert rules.spec(("layers", "mlp_down", "embed"), (8, 12, 20)) == P()  # only 'layers' divides
    assert rules.spec(("norm",), (12,)) == P()
    assert rules.spec(("q_heads",), (64,)) == P()  # a whole axis by the table: a q bias


def test_rules_refuse_one_mesh_axis_on_two_axes_and_unknown_names():
    rules = ShardingRules("fsdp", _mesh())
    with pytest.raises(ValueError, match="'qkv_embed' and 'o_heads' .* both map to mesh axis"):
        rules.spec(("qkv_embed", "o_heads"), (64, 64))
    with pytest.raises(ValueError, match="'batch' and 'batch' .* both map to mesh axis 'group'"):
        activation_spec("batch", "batch")
    with pytest.raises(ValueError, match="logical axis 'hidden' is not in basp_jax.sharding.RULES"):
        rules.spec(("hidden",), (64,))
    with pytest.raises(ValueError, match="has 1 axis names"):
        rules.spec(("norm",), (64, 64))
    with pytest.raises(ValueError, match="unknown parameter sharding 'zero'"):
        ShardingRules("zero", _mesh())
    with pytest.raises(ValueError, match="param_sharding='host' needs devices_per_host"):
        ShardingRules("host", _mesh())
    with pytest.raises(ValueError, match="devices_per_host=3 does not divide the mesh's 8"):
        host_mesh(_mesh(), 3)
    assert host_mesh(_mesh(), 4).devices.tolist() == _mesh().devices.reshape(2, 4).tolist()


def test_activations_rows_over_groups_sequence_over_a_group():
    assert basp_jax.ACTIVATION_SPEC == P("group", "seq")
    assert activation_spec("batch", "sequence", None) == P("group", "seq", None)
    assert activation_spec(None, "batch", "sequence") == P(None, "group", "seq")
    assert activation_spec(("batch", "sequence")) == P(FSDP)  # one flat token axis


def test_optimizer_moments_are_placed_like_their_parameters():
    """The trainer's shardings: every Adam moment like its parameter (bf16 first moment
    included), the step counts replicated."""
    from train.config.schema import OptimizerConfig
    from train.program.step import build_model, make_optimizer, opt_state_shardings

    config = models.ModelConfig.preset("tiny")
    rules = ShardingRules("hsdp", _mesh())
    parts = build_model(lambda: models.Transformer(config, rngs=nnx.Rngs(0), options=models.RunOptions(
        mesh=rules.mesh, param_sharding="hsdp")), rules, init_params=False)
    param_sh = parts.shardings(rules)
    tx, _ = make_optimizer(OptimizerConfig(lr=1e-3, mu_dtype="bfloat16"), 10)
    abstract, shardings = opt_state_shardings(tx, parts.params, param_sh, rules.replicated)
    adam = next(s for s in jax.tree.leaves(shardings, is_leaf=lambda x: hasattr(x, "mu"))
                if hasattr(s, "mu"))
    assert adam.mu == param_sh and adam.nu == param_sh
    assert adam.count == rules.replicated
    placed = jax.jit(tx.init, out_shardings=shardings)(
        jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), parts.params))
    mu = jax.tree.leaves(next(s for s in jax.tree.leaves(placed, is_leaf=lambda x: hasattr(x, "mu"))
                              if hasattr(s, "mu")).mu)
    assert mu[0].dtype == jnp.bfloat16
