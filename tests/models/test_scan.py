"""Layers under a scan (stacked parameters) against the same layers in a Python loop, and the
refusal to resume a checkpoint written with per-layer parameters."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import basp_jax
import models

from tests.helpers.flags import WHOLE_MATRIX


def _loop_params(stacked: dict, num_layers: int) -> dict:
    """The stacked parameters as the loop model's (one entry per layer)."""
    layers = {i: jax.tree.map(lambda x: x[i], stacked["layers"]) for i in range(num_layers)}
    return {**stacked, "layers": layers}


@pytest.mark.slow
@pytest.mark.parametrize("remat", [pytest.param("none", marks=WHOLE_MATRIX),
                                   "full"])  # under every jaxlib
def test_scanned_layers_equal_a_loop_of_layers(remat):
    config = dataclasses.replace(models.ModelConfig.preset("tiny"), num_layers=3)
    layout = basp_jax.Layout.plan(8, 2, 64, config.num_heads, config.num_kv_heads, groups=2)
    mesh = basp_jax.make_mesh(layout)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 64)), jnp.int32)
    segments = jnp.asarray(np.repeat([[1] * 20 + [2] * 44], 2, axis=0), jnp.int32)

    def loss_and_grads(scan_layers, params=None):
        model = models.init_model(config, mesh=mesh, remat=remat, scan_layers=scan_layers)
        graphdef, state = nnx.split(model, nnx.Param)
        if params is not None:
            nnx.replace_by_pure_dict(state, params)

        def loss(state):
            total, count = nnx.merge(graphdef, state).loss(tokens, tokens, segments)
            return total / count

        value, grads = jax.jit(jax.value_and_grad(loss))(state)
        return value, nnx.to_pure_dict(state), nnx.to_pure_dict(grads)

    value, params, grads = loss_and_grads(True)
    assert params["layers"]["mlp"]["up_proj"]["kernel"].shape[0] == 3
    loop_value, _, loop_grads = loss_and_grads(False, _loop_params(params, 3))
    np.testing.assert_allclose(value, loop_value, rtol=1e-6)
    want = _loop_params(grads, 3)
    for (path, g), (_, w) in zip(jax.tree_util.tree_leaves_with_path(want),
                                 jax.tree_util.tree_leaves_with_path(loop_grads)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def test_checkpoint_with_per_layer_parameters_is_refused(tmp_path):
    """A run.dir whose checkpoint was written before the layers were stacked: one line naming
    the change, before anything compiles."""
    import orbax.checkpoint as ocp

    from train.checkpoint.store import CheckpointError, checkpoint_dir, inspect_latest

    config = dataclasses.replace(models.ModelConfig.preset("tiny"), num_layers=2)
    old = nnx.to_pure_dict(nnx.state(models.abstract_model(config, scan_layers=False), nnx.Param))
    new = nnx.to_pure_dict(nnx.state(models.abstract_model(config), nnx.Param))
    zeros = lambda tree: jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), tree)  # noqa: E731
    manager = ocp.CheckpointManager(checkpoint_dir(str(tmp_path)),
                                    item_names=("params", "opt_state", "meta"))
    manager.save(3, args=ocp.args.Composite(
        params=ocp.args.StandardSave(zeros(old)), opt_state=ocp.args.StandardSave({"count": np.zeros((), np.int32)}),
        meta=ocp.args.JsonSave({"data_step": 3, "seed": 0})))
    manager.wait_until_finished()
    manager.close()
    with pytest.raises(CheckpointError, match=r"per-layer parameters \(layers.0...") as error:
        inspect_latest(str(tmp_path), new, {})
    assert "\n" not in str(error.value)
