"""Parameters and states as flat dicts of numpy arrays, to compare two runs leaf by leaf."""

import jax
import numpy as np
from flax import nnx


def flat_params(params) -> dict:
    """A pytree of arrays (the trainer's parameters) -> {key path: numpy array}."""
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(params)}


def flat_state(state) -> dict:
    """An NNX state (a model's) -> {path tuple: numpy array}."""
    return {k: np.asarray(v[...] if isinstance(v, nnx.Variable) else v)
            for k, v in nnx.to_flat_state(state)}
