"""Layers under a scan (stacked parameters) against the same layers in a Python loop, and a
checkpoint of either resumed by the other."""

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


def test_a_checkpoint_resumes_whatever_the_layers_layout(tmp_path, caplog):
    """A run stopped with its layers as a list resumes with them scanned by period, and one
    stopped scanned resumes as a list (train.checkpoint.relayout: the checkpoint read in its
    layout, restacked on the devices): the steps after the stop have the losses of a run that
    was never stopped, in the layout it started with. (tiny-qwen3-moe with every second MLP
    sparse: a period of 2 layers; the optimizer state's moments restacked with the
    parameters.)"""
    from train.loop import run

    from tests.helpers.trainer import tiny_config

    def config(run_dir, scan):
        return tiny_config(run_dir, "model.preset=tiny-qwen3-moe",
                           "model.shape.num_layers=4", "model.shape.decoder_sparse_step=2",
                           f"model.scan_layers={scan}",
                           "train.steps=4", "model.dtype=float32")

    for first, then in (("false", "true"), ("true", "false")):
        straight = run(config(tmp_path / f"straight-{first}", first))["losses"]
        run_dir = tmp_path / f"{first}-{then}"
        cut = run(config(run_dir, first), stop_at=2)
        caplog.clear()
        with caplog.at_level("INFO", logger="train.checkpoint.store"):
            resumed = run(config(run_dir, then))
        words = ("as a list", "by a period of 2")
        assert [r.getMessage().count("restacking") for r in caplog.records] == [1], words
        assert words[first == "true"] in caplog.records[0].getMessage()
        assert resumed["start_step"] == 2
        np.testing.assert_allclose(cut["losses"] + resumed["losses"], straight, rtol=2e-6,
                                   err_msg=f"{first} -> {then}")


def test_shapes_and_abstract_arrays_convert_between_layouts():
    """The checks before a resume compare the checkpoint's shapes in this run's layout; the
    restore reads each layer's slice with the stack's sharding of the rest."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from train.checkpoint import relayout

    shapes = {"layers.0.mlp.kernel": (4, 8), "layers.1.mlp.kernel": (4, 8),
              "layers.2.mlp.kernel": (4, 8), "layers.3.mlp.kernel": (4, 8), "norm.weight": (4,),
              "0.mu.layers.0.mlp.kernel": (4, 8), "0.mu.layers.1.mlp.kernel": (4, 8),
              "0.mu.layers.2.mlp.kernel": (4, 8), "0.mu.layers.3.mlp.kernel": (4, 8)}
    assert relayout.layout_of(shapes) is None
    by_two = relayout.shapes_in_layout(shapes, 2)
    assert by_two == {"layers.blocks.0.mlp.kernel": (2, 4, 8),
                      "layers.blocks.1.mlp.kernel": (2, 4, 8), "norm.weight": (4,),
                      "0.mu.layers.blocks.0.mlp.kernel": (2, 4, 8),
                      "0.mu.layers.blocks.1.mlp.kernel": (2, 4, 8)}
    assert relayout.layout_of(by_two) == 2
    assert relayout.shapes_in_layout(by_two, 1) == {
        "layers.mlp.kernel": (4, 4, 8), "norm.weight": (4,), "0.mu.layers.mlp.kernel": (4, 4, 8)}
    assert relayout.shapes_in_layout(relayout.shapes_in_layout(by_two, 1), None) == shapes
    mesh = jax.make_mesh((2, 4), ("group", "seq"))
    stacked = {"layers": {"blocks": {j: {"kernel": jax.ShapeDtypeStruct(
        (2, 4, 8), np.float32, sharding=NamedSharding(mesh, P(None, "seq", None)))}
        for j in range(2)}}}
    listed = relayout.abstract_in_layout(stacked, None)
    assert sorted(listed["layers"]) == [0, 1, 2, 3]
    assert listed["layers"][3]["kernel"].shape == (4, 8)
    assert listed["layers"][3]["kernel"].sharding.spec == P("seq", None)
    again = relayout.abstract_in_layout(listed, 2)["layers"]["blocks"][1]["kernel"]
    assert again.shape == (2, 4, 8) and again.sharding.spec == P(None, "seq", None)
