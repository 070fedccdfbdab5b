"""A model's loss and gradients on a mesh against one device's: the check every parallel path's
test makes. float32 on CPU: the layouts reorder reductions (all-to-alls, sharded matmuls,
gradient sums), so the mean loss agrees to rtol 1e-6 and the gradients to atol 1e-6 + rtol
1e-4; a wrong exchange or reduction moves them far beyond that."""

import numpy as np
from flax import nnx

from tests.helpers.trees import flat_state


def mean_loss_and_grads(model, tokens, targets, segment_ids=None, **loss_kwargs):
    """(mean loss, gradients as an NNX state) of model.loss, compiled."""
    @nnx.jit
    def run(model, tokens, targets, segment_ids):
        def mean_loss(model):
            total, count = model.loss(tokens, targets, segment_ids=segment_ids, **loss_kwargs)
            return total / count
        return nnx.value_and_grad(mean_loss)(model)

    return run(model, tokens, targets, segment_ids)


def assert_equal_to_one_device(got, want, label: str = "") -> None:
    """got, want: (mean loss, gradients) of mean_loss_and_grads on a mesh and on one device."""
    (loss, grads), (loss_1, grads_1) = got, want
    np.testing.assert_allclose(float(loss), float(loss_1), rtol=1e-6, err_msg=label)
    flat, reference = flat_state(grads), flat_state(grads_1)
    assert flat.keys() == reference.keys(), label
    assert max(np.abs(g).max() for g in reference.values()) > 1e-3  # the comparison can fail
    for key, g in reference.items():
        np.testing.assert_allclose(flat[key], g, atol=1e-6, rtol=1e-4,
                                   err_msg=f"{label} {key}".strip())



def objective_and_gradients(model, tokens):
    """(the trainer's objective, train.program.objective: the loss plus the routers' weighted
    terms; its weighted load-balancing sum; {parameter path: gradient}) of `model` on tokens
    [B, S] predicting the next token, compiled."""
    import jax.numpy as jnp
    from flax import traverse_util

    import models
    from train.program.objective import objective

    tokens = np.asarray(tokens)
    targets = np.roll(tokens, -1, axis=-1)
    targets[:, -1] = -100

    @nnx.jit
    def run(model):
        def total(model):
            return objective(model, jnp.asarray(tokens), jnp.asarray(targets), None,
                             models.causal_lm_loss)
        (value, (_, _, weighted)), grads = nnx.value_and_grad(total, has_aux=True)(model)
        return value, weighted, grads

    value, weighted, grads = run(model)
    return float(value), float(weighted), traverse_util.flatten_dict(
        nnx.to_pure_dict(nnx.state(grads, nnx.Param)))
