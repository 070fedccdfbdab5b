"""Optimizer pieces: the learning-rate schedule and the weight-decay mask on real parameter trees."""

import dataclasses

import jax
import numpy as np
from flax import nnx

import models
from train.config.schema import OptimizerConfig
from train.program.step import decay_mask, make_schedule


def test_schedule_warmup_then_cosine_to_min():
    cfg = OptimizerConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    s = make_schedule(cfg, steps=110)
    np.testing.assert_allclose([float(s(0)), float(s(5)), float(s(10))], [0.0, 5e-4, 1e-3], rtol=1e-6)
    np.testing.assert_allclose(float(s(60)), 1e-4 + 0.5 * (1e-3 - 1e-4), rtol=1e-5)
    np.testing.assert_allclose(float(s(110)), 1e-4, rtol=1e-5)
    flat = make_schedule(OptimizerConfig(lr=1e-3, warmup_steps=0, min_lr_ratio=1.0), steps=10)
    np.testing.assert_allclose([float(flat(0)), float(flat(9))], [1e-3, 1e-3], rtol=1e-6)


def test_no_weight_decay_on_norms_and_biases():
    config = dataclasses.replace(models.ModelConfig.preset("tiny"), model_type="qwen2",
                                 attention_bias=True, qk_norm=False)
    abstract = nnx.eval_shape(lambda: models.Transformer(config, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    mask = decay_mask(params)
    decayed = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(mask)}
    shapes = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(params)}
    norms = [k for k in decayed if "norm" in k]
    biases = [k for k in decayed if "bias" in k]
    assert norms and biases
    assert not any(decayed[k] for k in norms + biases)
    # Layers are stacked: a layer's norm is [layers, hidden], its kernels [layers, in, out].
    assert len(shapes["['layers']['input_layernorm']['weight']"]) == 2
    matrices = [k for k in shapes if k not in norms + biases]
    assert matrices and all(decayed[k] for k in matrices)
