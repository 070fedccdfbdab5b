"""Rematerialisation that repeats only the collectives a policy lets go, and that can park
residuals in host memory.

Every all-to-all result inside basp_jax.attention (and the ring's k/v hops and the gathered segment
ids) is tagged with `jax.ad_checkpoint.checkpoint_name` (name_exchange: EXCHANGE_NAME for q's and
the output's, KV_EXCHANGE_NAME for k's, v's and the rest). A model that wraps its
layers in `jax.checkpoint(..., policy=save_exchanges(policy))` then recomputes only local work in
the backward pass: 4 all-to-alls per layer forward and 4 backward, as basp_jax.planner.traffic counts, instead
of 12 with plain full rematerialisation. The price is memory: per layer q, k, v in the head layout
and the attention output (~(2 + 2 * kv_heads / heads) x hidden values per token) are kept.

Inside one host the repeated all-to-alls are cheap beside long sequences' attention, and those
residuals are most of what the step holds: "full_kv" keeps only k's and v's exchanges (a
quarter of q's width each under Llama's grouped-query heads), "inputs" none (plain full
rematerialisation, 12 all-to-alls per layer).

For long sequences those residuals do not fit on the device. A model that also tags each layer's
input (`name_layer_input`, the first thing its layer does with it; every later use must read the
tagged value) can move them to pinned host memory between the forward and the backward pass
(`offload_layer_inputs`): the device then holds one layer's working set, the host
num_layers x tokens x hidden values (and the exchanges too with `exchanges=True`).

REMAT_POLICIES names every policy a model may run under (models.RunOptions.remat, the config's
model.remat) with what basp_jax.planner.memory needs of it: the per-token tensors each layer keeps on the
device and in host memory (TENSORS), and whether the planner's model.remat=auto may choose it.
A new policy is one entry here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

from .registry import Registry

EXCHANGE_NAME = "basp_exchange"  # q's exchange and the output's (query heads wide)
KV_EXCHANGE_NAME = "basp_exchange_kv"  # k's and v's (grouped-query heads: narrower), ring hops, ids
LAYER_INPUT_NAME = "basp_layer_input"
HOST_COPY_NAME = "basp_host_copy"  # a layer's weights gathered to its host (staged_offload)
HOST_MEMORY = "pinned_host"  # the memory kind JAX names page-locked host memory by (CPU and GPU)


def name_exchange(x: jax.Array, *, kv: bool = False) -> jax.Array:
    """Tag a collective's result as a residual that `save_exchanges` policies keep; kv: one of
    k's or v's (or another as small: the ring's k/v hops, gathered segment ids), which
    `save_exchanges(kv_only=True)` keeps while q's and the output's exchanges repeat."""
    return checkpoint_name(x, KV_EXCHANGE_NAME if kv else EXCHANGE_NAME)


def name_layer_input(x: jax.Array) -> jax.Array:
    """Tag a layer's input as the residual `offload_layer_inputs` moves to host memory. Use the
    returned value everywhere in the layer: an untagged use would keep the input on the device."""
    return checkpoint_name(x, LAYER_INPUT_NAME)


def name_host_copy(tree):
    """Tag each array of a layer's host-local weights (basp_jax.sharding's staged strategies) as
    the residual `offload_host_copy` keeps in host memory for the backward pass."""
    return jax.tree.map(lambda x: checkpoint_name(x, HOST_COPY_NAME), tree)


def offload_host_copy(policy=None):
    """`policy` (None: save nothing else), with the layer's host-local weights (name_host_copy)
    kept in pinned host memory from the forward to the backward pass instead of gathered across
    hosts again: the device holds no copy of the layers between the two passes."""
    offloaded = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[HOST_COPY_NAME],
        offload_src="device", offload_dst=HOST_MEMORY)
    rest = policy or jax.checkpoint_policies.nothing_saveable

    def combined(prim, *args, **params):
        if prim.name == "name" and params.get("name") == HOST_COPY_NAME:
            return offloaded(prim, *args, **params)
        return rest(prim, *args, **params)

    return combined


def save_exchanges(policy=None, *, kv_only: bool = False):
    """A jax.checkpoint policy that saves the exchanges' outputs on top of `policy` (None: save
    nothing else, i.e. full rematerialisation except the exchanges); kv_only: only k's and v's
    (name_exchange(kv=True)), so the backward pass repeats q's and the output's all-to-alls."""
    kept = (KV_EXCHANGE_NAME,) if kv_only else (EXCHANGE_NAME, KV_EXCHANGE_NAME)
    names = jax.checkpoint_policies.save_only_these_names(*kept)
    if policy is None:
        return names
    return jax.checkpoint_policies.save_from_both_policies(policy, names)


def offload_layer_inputs(*, exchanges: bool):
    """A jax.checkpoint policy that keeps each layer's input in pinned host memory (copied there
    in the forward pass, back in the backward) and recomputes the rest of the layer from it.
    exchanges=False: the backward pass repeats the layer's all-to-alls (12 per layer instead of
    8) and the host holds hidden values per token per layer; True: the exchanges' outputs are
    offloaded too (8 per layer; ~(3 + 2 * kv_heads / heads) x hidden values on the host)."""
    names = [LAYER_INPUT_NAME] + ([EXCHANGE_NAME, KV_EXCHANGE_NAME] if exchanges else [])
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=names,
        offload_src="device", offload_dst=HOST_MEMORY)


# The per-token tensors of one decoder layer that a policy may keep for the backward pass;
# basp_jax.planner.memory gives each its width (values per token, in the compute dtype):
#   input        the layer's input (hidden)
#   exchanged    attention's q, k, v and output in the head layout, the exchanges' results
#   exchanged_kv only k's and v's of them (grouped-query heads: a fraction of q's width)
#   projections  the other projections' outputs: q, k, v before the exchange, the attention and
#                MLP inputs and the MLP's three (the dots a "dots" policy saves)
#   elementwise  the norms' and SwiGLU's elementwise results
TENSORS = ("input", "exchanged", "exchanged_kv", "projections", "elementwise")


@dataclasses.dataclass(frozen=True)
class RematPolicy:
    """A rematerialisation policy: the jax.checkpoint policy (None: no rematerialisation, the
    layer is not wrapped), which TENSORS each layer keeps on the device (`saves`) and in pinned
    host memory (`offloads`), auto_rank: its place in the order model.remat=auto tries (None:
    never chosen; the last is the leanest, the planner's fallback when nothing fits), doc:
    what the config reference says of it, and without_exchanges: the policy whose program it
    compiles to where attention exchanges nothing (one device per sequence), which the planner
    then names instead (None: itself)."""

    policy: Any
    saves: tuple[str, ...]
    offloads: tuple[str, ...] = ()
    auto_rank: int | None = None
    doc: str = ""
    without_exchanges: str | None = None

    def __post_init__(self):
        for kind in (*self.saves, *self.offloads):
            if kind not in TENSORS:
                raise ValueError(f"unknown remat tensor {kind!r}; use one of {', '.join(TENSORS)}")

    @property
    def repeated_exchanges(self) -> tuple[str, ...]:
        """Which of attention's forward all-to-alls ("q", "k", "v", "out") the backward pass
        repeats: those whose results are kept neither on the device nor on the host (4 more per
        layer than the 8 of the forward and backward with none kept, 2 with only k and v)."""
        kept = self.saves + self.offloads
        if "exchanged" in kept:
            return ()
        return ("q", "out") if "exchanged_kv" in kept else ("q", "k", "v", "out")


# Every policy keeps the outputs of attention's exchanges (save_exchanges) or offloads them,
# except "full_kv", "inputs" and "offload": the backward pass never repeats the all-to-alls BASP
# exists to cut unless the policy says so. The price: per layer q, k, v in the head layout and
# the attention output.
REMAT_POLICIES: Registry[RematPolicy] = Registry("remat policy")
REMAT_POLICIES.register("none", RematPolicy(
    None, tuple(t for t in TENSORS if t != "exchanged_kv"), doc="keep everything"))
REMAT_POLICIES.register("full", RematPolicy(
    save_exchanges(), ("input", "exchanged"), auto_rank=0,
    doc="recompute each layer, keeping its input and the all-to-alls' outputs on the device"))
# Long sequences on the devices of one host: q after its all-to-all and the output after the
# all-to-all back are query-heads wide (4x k's or v's for Llama-3.1-8B), so keep only k and v and
# repeat the other two all-to-alls backward (10 per layer, not 8), with q's projection; the
# attention kernel's forward, which the backward reruns under every policy here, gives the output.
REMAT_POLICIES.register("full_kv", RematPolicy(
    save_exchanges(kv_only=True), ("input", "exchanged_kv"), auto_rank=1,
    doc="as full, keeping only k's and v's all-to-all outputs (q's and the output's repeat)",
    without_exchanges="full"))
# The same from each layer's input alone: all four all-to-alls repeat backward (12 per layer), and
# k's and v's projections with q's; the device keeps hidden values per token per layer.
REMAT_POLICIES.register("inputs", RematPolicy(
    jax.checkpoint_policies.nothing_saveable, ("input",), auto_rank=2,
    doc="recompute each layer from its input alone (the all-to-alls repeat backward)",
    without_exchanges="full"))
# Save the projections (dots without batch dims); recompute attention scores and elementwise ops.
REMAT_POLICIES.register("dots", RematPolicy(
    save_exchanges(jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
    ("input", "exchanged", "projections"), doc="as full, keeping the projections too"))
# Long sequences: each layer's input waits in pinned host memory for the backward pass, which
# recomputes the layer from it (the device holds about one layer's activations). "offload"
# repeats the layer's all-to-alls backward (12 per layer); "offload_exchanges" offloads their
# outputs too (8 per layer, ~3.5x the host memory for Llama-3.1-8B).
REMAT_POLICIES.register("offload", RematPolicy(
    offload_layer_inputs(exchanges=False), (), ("input",), auto_rank=4,
    doc="each layer's input in pinned host memory; the all-to-alls repeat backward"))
REMAT_POLICIES.register("offload_exchanges", RematPolicy(
    offload_layer_inputs(exchanges=True), (), ("input", "exchanged"), auto_rank=3,
    doc="as offload, the all-to-alls' outputs offloaded too"))


def auto_policies() -> tuple[str, ...]:
    """The policies model.remat=auto tries, in its order (the leanest last)."""
    ranked = sorted((p.auto_rank, name) for name, p in REMAT_POLICIES.items()
                    if p.auto_rank is not None)
    return tuple(name for _, name in ranked)
