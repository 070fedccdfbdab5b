"""Layers unlike each other scanned over the pattern they repeat (models.transformer.Period): the
Qwen3.5 hybrid's 3 Gated DeltaNet + 1 attention layers, a Qwen3-MoE with dense layers between
sparse ones. The scanned stack equals the list of layers it replaces (loss and every gradient,
on one device and on BASP), its parameters convert to and from the list's (models.layer_stack),
and it decodes as the list does."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util

import models
from models import layer_stack
from models.config import FULL_ATTENTION, LINEAR_ATTENTION

from tests.helpers.flags import WHOLE_MATRIX
from tests.helpers.one_device import assert_equal_to_one_device, mean_loss_and_grads

BATCH, SEQ = 2, 64


def _hybrid(repeats: int = 2) -> models.ModelConfig:
    """tiny-qwen3.5's pattern repeated: 4 * repeats layers."""
    base = models.ModelConfig.preset("tiny-qwen3.5")
    return dataclasses.replace(base, num_layers=4 * repeats,
                               layer_types=((LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)) * repeats)


def _alternating_moe() -> models.ModelConfig:
    """tiny-qwen3-moe with every second layer's MLP sparse (decoder_sparse_step=2)."""
    return dataclasses.replace(models.ModelConfig.preset("tiny-qwen3-moe"), decoder_sparse_step=2)


def test_layer_period_is_the_shortest_repeating_pattern():
    assert models.ModelConfig.preset("tiny").layer_period == 1
    assert models.ModelConfig.preset("qwen3-30b-a3b").layer_period == 1
    assert models.ModelConfig.preset("qwen3.5-9b").layer_period == 4
    assert models.ModelConfig.preset("qwen3.5-35b-a3b").layer_period == 4
    assert _alternating_moe().layer_period == 2
    assert models.ModelConfig.preset("tiny-qwen3.5").layer_period == 4  # = its 4 layers
    odd = dataclasses.replace(_hybrid(), layer_types=(LINEAR_ATTENTION,) * 7 + (FULL_ATTENTION,))
    assert odd.layer_period == 8  # nothing repeats
    irregular = dataclasses.replace(_alternating_moe(), mlp_only_layers=(3,))  # D S D D
    assert irregular.layer_period == 4


def test_what_scans_and_what_stays_a_list():
    for config, period in ((_hybrid(), 4), (_alternating_moe(), 2),
                           (models.ModelConfig.preset("tiny"), 1)):
        model = models.abstract_model(config)
        assert model.scanned and model.period == period
        assert not models.abstract_model(config, scan_layers=False).scanned
    # one repeat of the pattern is the whole stack: a list (a scan of one step buys nothing)
    assert not models.abstract_model(_hybrid(repeats=1)).scanned
    # but one layer alone is a stack of one, as any alike layers
    one = dataclasses.replace(models.ModelConfig.preset("tiny"), num_layers=1)
    assert models.abstract_model(one).scanned and models.abstract_model(one).period == 1


def _as(model_from, model_to):
    """model_to with model_from's parameters (their layers restacked for it)."""
    params = nnx.to_pure_dict(nnx.state(model_from, nnx.Param))
    state = nnx.state(model_to, nnx.Param)
    nnx.replace_by_pure_dict(state, layer_stack.restack(params, model_to.period))
    nnx.update(model_to, state)
    return model_to


def _batch(vocab, seed=0):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, vocab, (BATCH, SEQ)), jnp.int32)
    targets = jnp.roll(tokens, -1, axis=-1).at[:, -1].set(-100)
    return tokens, targets


def _grads_as_list(grads, period):
    flat = nnx.to_pure_dict(grads)
    return nnx.State(layer_stack.restack(flat, None)) if period else grads


# slow (25-30 s for the hybrid, 5-13 s for the MoE on 2 cores); under newer jaxlibs each kind
# keeps its case with full remat (the periods recomputed in the backward pass)
@pytest.mark.slow
@pytest.mark.parametrize("make,remat", [
    pytest.param(_hybrid, "full", id="full-hybrid"),
    pytest.param(_hybrid, "none", id="none-hybrid", marks=WHOLE_MATRIX),
    pytest.param(_alternating_moe, "full", id="full-alternating_moe"),
    pytest.param(_alternating_moe, "none", id="none-alternating_moe", marks=WHOLE_MATRIX)])
def test_scanned_periods_equal_the_list_on_one_device(make, remat):
    config = make()
    listed = models.Transformer(config, rngs=nnx.Rngs(3), scan_layers=False, remat=remat)
    scanned = _as(listed, models.Transformer(config, rngs=nnx.Rngs(0), remat=remat))
    assert scanned.scanned and not listed.scanned
    tokens, targets = _batch(config.vocab_size)
    want = mean_loss_and_grads(listed, tokens, targets)
    loss, grads = mean_loss_and_grads(scanned, tokens, targets)
    assert_equal_to_one_device((loss, _grads_as_list(grads, scanned.period)), want, make.__name__)


@pytest.mark.slow
@pytest.mark.parametrize("groups", [2, pytest.param(1, marks=WHOLE_MATRIX)])
def test_scanned_periods_on_basp_and_ulysses_equal_the_list_on_one_device(groups):
    import basp_jax

    config = _hybrid()
    listed = models.Transformer(config, rngs=nnx.Rngs(3), scan_layers=False, remat="full")
    tokens, targets = _batch(config.vocab_size, seed=1)
    want = mean_loss_and_grads(listed, tokens, targets)
    layout = basp_jax.Layout.plan(8, BATCH, SEQ, 8, 2, groups=groups)
    sharded = models.init_model(config, mesh=basp_jax.make_mesh(layout), layout=layout,
                                remat="full")
    sharded = _as(listed, sharded)
    assert sharded.period == 4
    loss, grads = mean_loss_and_grads(sharded, tokens, targets)
    np.testing.assert_allclose(float(loss), float(want[0]), rtol=1e-6)
    got, reference = (traverse_util.flatten_dict(nnx.to_pure_dict(g))
                      for g in (_grads_as_list(grads, 4), want[1]))
    assert got.keys() == reference.keys()
    for name, grad in reference.items():
        # relative to the parameter's largest gradient: the Gated DeltaNet's recurrence makes
        # the mesh's float32 sums differ from one device's by up to ~1e-3 of it (test_qwen35)
        scale = max(np.abs(grad).max(), 1e-6)
        assert np.abs(got[name] - grad).max() / scale < 2e-3, (groups, name)


def test_restack_round_trips_and_refuses_a_partial_pattern():
    config = _hybrid()
    params = nnx.to_pure_dict(nnx.state(models.abstract_model(config, scan_layers=False),
                                        nnx.Param))
    params = jax.tree.map(
        lambda s: np.random.default_rng(0).normal(size=s.shape).astype(np.float32), params)
    stacked = layer_stack.restack({"params": params, "step": 3}, 4)
    blocks = stacked["params"]["layers"]["blocks"]
    assert sorted(blocks) == [0, 1, 2, 3] and stacked["step"] == 3
    np.testing.assert_array_equal(blocks[3]["self_attn"]["q_proj"]["kernel"][1],
                                  params["layers"][7]["self_attn"]["q_proj"]["kernel"])
    back = layer_stack.restack(stacked, None)["params"]
    flat, want = (traverse_util.flatten_dict(t) for t in (back, params))
    assert flat.keys() == want.keys()
    assert all(np.array_equal(flat[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="multiple of 3"):
        layer_stack.stack(params["layers"], 3)


def test_scanned_alternating_moe_decodes_as_the_list():
    """models.sampler's KV-cached decoding through the stack by period (cache rows per layer)."""
    config = _alternating_moe()
    listed = models.Transformer(config, rngs=nnx.Rngs(3), scan_layers=False, dtype="float32")
    scanned = _as(listed, models.Transformer(config, rngs=nnx.Rngs(0), dtype="float32"))
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, 10)
    assert models.sampler.generate(scanned, prompt, max_new_tokens=6) == \
        models.sampler.generate(listed, prompt, max_new_tokens=6)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["staged_keep", pytest.param("staged_offload",
                                                                  marks=WHOLE_MATRIX)])
def test_scanned_periods_under_staged_parameters_equal_one_device(strategy):
    """The layers' parameters gathered inside each host of 2 x 4 (basp_jax.param_use: before
    the rematerialised layer and kept on the device, or inside it with the copy in host
    memory), every layer of each period apart: the loss and every gradient equal one
    device's."""
    import basp_jax

    config = _hybrid()
    tokens, targets = _batch(config.vocab_size, seed=2)
    want = mean_loss_and_grads(models.init_model(config, seed=3, remat="full"), tokens, targets)
    layout = basp_jax.Layout.plan(8, BATCH, SEQ, 8, 2, groups=2, devices_per_host=4)
    model = models.init_model(config, seed=3, mesh=basp_jax.make_mesh(layout), layout=layout,
                              param_sharding=strategy, remat="full")
    assert model.period == 4
    loss, grads = mean_loss_and_grads(model, tokens, targets)
    np.testing.assert_allclose(float(loss), float(want[0]), rtol=1e-6)
    got, reference = (traverse_util.flatten_dict(nnx.to_pure_dict(g)) for g in (grads, want[1]))
    assert got.keys() == reference.keys()
    for name, grad in reference.items():  # as test_scanned_periods_on_basp_and_ulysses_...
        scale = max(np.abs(grad).max(), 1e-6)
        assert np.abs(got[name] - grad).max() / scale < 2e-3, (strategy, name)
