"""A sparse mixture-of-experts MLP as transformers' Qwen3MoeSparseMoeBlock and
Qwen3_5MoeSparseMoeBlock compute it, and the router statistics its load-balancing loss is made of.

    router logits = x @ gate            [tokens, experts], float32
    probs = softmax(logits)             float32
    weights, experts = top_k(probs, k)  renormalised to sum to one when norm_topk_prob
    y = sum_k weights_k * down_e(silu(gate_e(x)) * up_e(x))   e = the token's k-th expert
      (+ sigmoid(x @ shared_expert_gate) * shared_expert(x)   Qwen3.5-MoE's shared SwiGLU)

Dropless with static shapes: no capacity and no dropped token. The T * k (token, expert) pairs
are sorted by expert and the experts run as grouped matmuls with jax.lax.ragged_dot, whose group
sizes are the tokens each expert got, then the outputs are put back in token order. ragged_dot
needs no padding of each expert's tokens to a common size (a dense dispatch would compute
T * experts rows, or drop tokens beyond a capacity); on CPU it masks to a dense product
internally, on GPUs XLA lowers it to grouped GEMMs.

On a mesh the router runs on the activations as they are placed, and the experts in a
shard_map, in one of two ways (RunOptions.expert_parallel):
- split over a sequence group ("seq": each of the group's sp devices holds experts/sp of them):
  the group's tokens are gathered inside the group, each device runs every (token, expert) pair
  of its own experts, and the partial outputs are summed and scattered back to the devices that
  hold the tokens (an all-gather and a reduce-scatter of [tokens, hidden] over the seq axis, as
  attention's all-to-alls: inside the group, so inside the host where groups are placed in hosts;
  nothing routed crosses hosts). Dropless with static shapes: each device's grouped matmuls
  take all sp x tokens x k pairs as rows, those of other devices' experts in a trailing part no
  group covers (zero rows), so no bound on an expert's tokens is needed;
- whole ("none"): every device runs its own tokens through whole copies of the expert weights.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from basp_jax import grouped_matmul as gmm
from basp_jax.mesh import GROUP, SEQ
from basp_jax.sharding import rows_spec

from .config import ModelConfig
from .layers import MLP, Linear, constrain, param


# the axes of expert_mesh: sets of consecutive groups, and the groups of one set (a host's)
GROUP_SETS, GROUPS_LOCAL = "group_sets", "groups_local"


class RouterStats(NamedTuple):
    """Sums over tokens (and layers) of per-token terms, so sums over sharded tokens add up:
    counts [experts] (top-k assignments), probs [experts] (router probabilities), tokens (how
    many token-layer rows were routed), z (squared log-sum-exps of the router logits). float32."""

    counts: jax.Array
    probs: jax.Array
    tokens: jax.Array
    z: jax.Array

    def __add__(self, other: "RouterStats") -> "RouterStats":
        return RouterStats(*(a + b for a, b in zip(self, other)))

    def total(self) -> "RouterStats":
        """A stack of per-layer stats ([layers, ...] leaves) summed over the layers."""
        return RouterStats(*(x.sum(axis=0) for x in self))


def router_z_loss(stats: RouterStats) -> jax.Array:
    """ST-MoE's router z-loss: the mean over token-layer rows of logsumexp(router logits)^2."""
    return stats.z / jnp.maximum(stats.tokens, 1.0)


def load_balancing_loss(stats: RouterStats) -> jax.Array:
    """transformers' load_balancing_loss_func (Switch Transformer eqs. 4-6) of router stats summed
    over the layers and every token of a microbatch: experts * sum_e f_e * P_e, f_e the share of
    top-k assignments to e and P_e its mean probability, each over the token-layer rows. (Its
    gradient flows through P only: the counts come from top-k indices.)"""
    rows = jnp.maximum(stats.tokens, 1.0)
    return stats.counts.shape[-1] * jnp.sum((stats.counts / rows) * (stats.probs / rows))


class ExpertKernel(nnx.Module):
    """One projection of every expert: kernel [experts, in, out] (each expert's Hugging Face
    weight is [out, in]: mlp.experts.{e}.<name>.weight)."""

    def __init__(self, experts: int, in_features: int, out_features: int, names, *, rngs,
                 param_dtype, init_std: float):
        shape = (experts, in_features, out_features)
        self.kernel = param(init_std * jax.random.normal(rngs.params(), shape, param_dtype),
                            names)


class Experts(nnx.Module):
    """The experts' SwiGLU weights, named as transformers' per-expert checkpoints name them."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype):
        e, d, f = config.num_experts, config.hidden_size, config.moe_intermediate_size
        kw = dict(rngs=rngs, param_dtype=param_dtype, init_std=config.initializer_range)
        # split on the expert axis, where the experts split over a seq group are used
        self.gate_proj = ExpertKernel(e, d, f, ("expert", "expert_in", "expert_out"), **kw)
        self.up_proj = ExpertKernel(e, d, f, ("expert", "expert_in", "expert_out"), **kw)
        self.down_proj = ExpertKernel(e, f, d, ("expert", "expert_in", "expert_out"), **kw)


class SparseMoE(nnx.Module):
    """The sparse MLP: `gate` (the router, [hidden, experts], no bias) and `experts`.
    `moe(x)` -> (y [B, S, hidden], RouterStats of x's tokens)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype, mesh=None,
                 split_experts: int = 1, grouped_matmul: str = "auto"):
        self.gate = Linear(config.hidden_size, config.num_experts, ("mlp_up_embed", "router"),
                           use_bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                           init_std=config.initializer_range)
        self.experts = Experts(config, rngs=rngs, param_dtype=param_dtype)
        if config.shared_expert_intermediate_size:  # a dense SwiGLU on the activations as placed
            self.shared_expert = MLP(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                                     intermediate_size=config.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(config.hidden_size, 1, ("mlp_up_embed", "router"),
                                             use_bias=False, rngs=rngs, dtype=dtype,
                                             param_dtype=param_dtype,
                                             init_std=config.initializer_range)
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.dtype = dtype
        self.mesh = mesh
        # over how many devices the experts split (models.options.RunOptions.experts_split): 1
        # (whole), a seq group's, or a host's where seq groups are smaller than a host
        self.split_experts = split_experts
        device = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
        # the experts' grouped matmuls (basp_jax.grouped_matmul: XLA's ragged_dot or ours)
        self.grouped_matmul = gmm.resolve_impl(
            grouped_matmul, device.platform, (config.hidden_size, config.moe_intermediate_size))
        self.platform = device.platform

    def route(self, x):
        """(top-k weights [B, S, k] in the compute dtype, experts [B, S, k], RouterStats)."""
        logits = jnp.einsum("...d,de->...e", x.astype(self.dtype),
                            self.gate.kernel[...].astype(self.dtype),
                            preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        weights, experts = jax.lax.top_k(probs, self.top_k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        n = probs.shape[-1]
        counts = jax.nn.one_hot(experts, n, dtype=jnp.float32).sum(axis=-2)
        z = jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
        stats = RouterStats(counts.reshape(-1, n).sum(0), probs.reshape(-1, n).sum(0),
                            jnp.float32(probs.size // n), z)
        return weights.astype(self.dtype), experts, stats

    def __call__(self, x):
        y, stats = self.routed(x)
        if hasattr(self, "shared_expert"):
            with jax.named_scope("shared_expert"):
                y = y + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y, stats

    def routed(self, x):
        """(the routed experts' weighted sum [B, S, hidden], RouterStats of x's tokens)."""
        weights, experts, stats = self.route(x)
        kernels = tuple(k.kernel[...].astype(self.dtype) for k in
                        (self.experts.gate_proj, self.experts.up_proj, self.experts.down_proj))
        matmul = gmm.grouped_matmul_fn(self.grouped_matmul, self.platform)
        if self.mesh is None:
            return _dispatch(x.astype(self.dtype), weights, experts, kernels, matmul), stats
        mesh, rows = self.mesh, rows_spec()  # each device's own tokens
        if self.split_experts > 1:  # experts / split of them on each device of the split
            mesh, grid_rows, axes = expert_mesh(self.mesh, self.split_experts)
            rows = rows if mesh is self.mesh else grid_rows
            local = jax.shard_map(functools.partial(_dispatch_in_group, matmul=matmul, axes=axes),
                                  mesh=mesh, in_specs=(rows, rows, rows, P(axes)),
                                  out_specs=rows, check_vma=False)
        else:  # whole copies of the expert weights
            local = jax.shard_map(functools.partial(_dispatch, matmul=matmul), mesh=mesh,
                                  in_specs=(rows, rows, rows, P()),
                                  out_specs=rows, check_vma=False)
        x = constrain(x.astype(self.dtype), self.mesh)
        # a shard_map on the host-split mesh is traced under that mesh (the step's context mesh,
        # jax.set_mesh, is the run's: a shard_map refuses another)
        scope = (contextlib.nullcontext() if mesh is self.mesh
                 else jax.sharding.use_abstract_mesh(mesh.abstract_mesh))
        with jax.named_scope(gmm.EXPERTS_SCOPE), scope:  # named: the aot report's expert rows
            y = local(x, weights, experts, kernels)
        return constrain(y, self.mesh), stats


def _dispatch(x, weights, experts, kernels, matmul=jax.lax.ragged_dot):
    """Every token of x [..., hidden] through its k experts (experts, weights [..., k]), the
    outputs weighted and summed: the pairs sorted by expert, the experts as ragged_dots."""
    gate, up, down = kernels
    shape, k = x.shape, experts.shape[-1]
    x = x.reshape(-1, shape[-1])
    flat = experts.reshape(-1)  # pair p = token p // k, its (p % k)-th expert
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    rows = x[order // k]
    h = jax.nn.silu(matmul(rows, gate, sizes)) * matmul(rows, up, sizes)
    out = matmul(h, down, sizes)
    out = jnp.zeros_like(out).at[order].set(out, unique_indices=True)  # back in pair order
    out = out.reshape(-1, k, shape[-1]) * weights.reshape(-1, k, 1)
    return out.sum(axis=1).reshape(shape)


@functools.cache
def expert_mesh(mesh: Mesh, split: int):
    """(the mesh the experts' shard_map runs on, the [B, S, ...] rows' PartitionSpec there (None
    on `mesh` itself: rows_spec()), the mesh axes the experts split over) for experts split over `split` devices: the seq axis of
    `mesh` where split is its size; else the same devices as (group sets, GROUPS_LOCAL, seq),
    the split over the split / sp consecutive groups of a set and their seq devices (a host's
    devices: basp_jax.mesh orders the groups host-major). XLA sees the same device assignment
    for both meshes, so the rows do not move."""
    groups, sp = mesh.shape[GROUP], mesh.shape[SEQ]
    if split == sp:
        return mesh, None, SEQ  # (the caller's rows_spec(), which depends on the trace)
    local = split // sp
    grid = np.asarray(mesh.devices).reshape(groups // local, local, sp)
    auto = (jax.sharding.AxisType.Auto,) * 3
    split_mesh = Mesh(grid, (GROUP_SETS, GROUPS_LOCAL, SEQ), axis_types=auto)
    return split_mesh, P((GROUP_SETS, GROUPS_LOCAL), SEQ), (GROUPS_LOCAL, SEQ)


def _dispatch_in_group(x, weights, experts, kernels, matmul=jax.lax.ragged_dot, axes=SEQ):
    """_dispatch inside a shard_map whose kernels hold this device's slice of the expert axis
    split over `axes`: the tokens of the devices along `axes` (the seq group, or a host's
    devices) gathered, every pair routed to one of this device's experts run, the weighted
    outputs summed over those devices and each device's own tokens' sums scattered back."""
    gate, up, down = kernels
    shape, k, mine_count = x.shape, experts.shape[-1], gate.shape[0]
    x = jax.lax.all_gather(x.reshape(-1, shape[-1]), axes, tiled=True)  # [sp * tokens, hidden]
    experts = jax.lax.all_gather(experts.reshape(-1, k), axes, tiled=True).reshape(-1)
    weights = jax.lax.all_gather(weights.reshape(-1, k), axes, tiled=True)
    local = experts - jax.lax.axis_index(axes) * mine_count
    mine = (local >= 0) & (local < mine_count)
    key = jnp.where(mine, local, mine_count)  # other devices' pairs sort last, in no group
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=mine_count + 1)[:mine_count].astype(jnp.int32)
    rows = x[order // k]
    h = jax.nn.silu(matmul(rows, gate, sizes)) * matmul(rows, up, sizes)
    out = matmul(h, down, sizes)
    out = jnp.zeros_like(out).at[order].set(out, unique_indices=True)  # back in pair order
    out = jnp.where(mine[:, None], out, 0).reshape(-1, k, shape[-1]) * weights[..., None]
    return jax.lax.psum_scatter(out.sum(axis=1), axes, tiled=True).reshape(shape)
