"""Rematerialisation that never repeats a collective, and that can park residuals in host memory.

Every all-to-all result inside basp_jax.attention (and the ring's k/v hops and the gathered segment
ids) is tagged with `jax.ad_checkpoint.checkpoint_name(x, EXCHANGE_NAME)`. A model that wraps its
layers in `jax.checkpoint(..., policy=save_exchanges(policy))` then recomputes only local work in
the backward pass: 4 all-to-alls per layer forward and 4 backward, as basp_jax.cost counts, instead
of 12 with plain full rematerialisation. The price is memory: per layer q, k, v in the head layout
and the attention output (~(2 + 2 * kv_heads / heads) x hidden values per token) are kept.

For long sequences those residuals do not fit on the device. A model that also tags each layer's
input (`name_layer_input`, the first thing its layer does with it; every later use must read the
tagged value) can move them to pinned host memory between the forward and the backward pass
(`offload_layer_inputs`): the device then holds one layer's working set, the host
num_layers x tokens x hidden values (and the exchanges too with `exchanges=True`).
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

EXCHANGE_NAME = "basp_exchange"
LAYER_INPUT_NAME = "basp_layer_input"
HOST_MEMORY = "pinned_host"  # the memory kind JAX names page-locked host memory by (CPU and GPU)


def name_exchange(x: jax.Array) -> jax.Array:
    """Tag a collective's result as a residual that `save_exchanges` policies keep."""
    return checkpoint_name(x, EXCHANGE_NAME)


def name_layer_input(x: jax.Array) -> jax.Array:
    """Tag a layer's input as the residual `offload_layer_inputs` moves to host memory. Use the
    returned value everywhere in the layer: an untagged use would keep the input on the device."""
    return checkpoint_name(x, LAYER_INPUT_NAME)


def save_exchanges(policy=None):
    """A jax.checkpoint policy that saves the exchanges' outputs on top of `policy` (None: save
    nothing else, i.e. full rematerialisation except the exchanges)."""
    names = jax.checkpoint_policies.save_only_these_names(EXCHANGE_NAME)
    if policy is None:
        return names
    return jax.checkpoint_policies.save_from_both_policies(policy, names)


def offload_layer_inputs(*, exchanges: bool):
    """A jax.checkpoint policy that keeps each layer's input in pinned host memory (copied there
    in the forward pass, back in the backward) and recomputes the rest of the layer from it.
    exchanges=False: the backward pass repeats the layer's all-to-alls (12 per layer instead of
    8) and the host holds hidden values per token per layer; True: the exchanges' outputs are
    offloaded too (8 per layer; ~(3 + 2 * kv_heads / heads) x hidden values on the host)."""
    names = [LAYER_INPUT_NAME] + ([EXCHANGE_NAME] if exchanges else [])
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=names,
        offload_src="device", offload_dst=HOST_MEMORY)
