"""Rematerialisation that never repeats a collective: attention names what it exchanged.

Every all-to-all result inside basp_jax.attention (and the ring's k/v hops and the gathered segment
ids) is tagged with `jax.ad_checkpoint.checkpoint_name(x, EXCHANGE_NAME)`. A model that wraps its
layers in `jax.checkpoint(..., policy=save_exchanges(policy))` then recomputes only local work in
the backward pass: 4 all-to-alls per layer forward and 4 backward, as basp_jax.cost counts, instead
of 12 with plain full rematerialisation. The price is memory: per layer q, k, v in the head layout
and the attention output (~(2 + 2 * kv_heads / heads) x hidden values per token) are kept.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

EXCHANGE_NAME = "basp_exchange"


def name_exchange(x: jax.Array) -> jax.Array:
    """Tag a collective's result as a residual that `save_exchanges` policies keep."""
    return checkpoint_name(x, EXCHANGE_NAME)


def save_exchanges(policy=None):
    """A jax.checkpoint policy that saves the exchanges' outputs on top of `policy` (None: save
    nothing else, i.e. full rematerialisation except the exchanges)."""
    names = jax.checkpoint_policies.save_only_these_names(EXCHANGE_NAME)
    if policy is None:
        return names
    return jax.checkpoint_policies.save_from_both_policies(policy, names)
