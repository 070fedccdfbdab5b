"""How a layer gets its parameters under a parameter strategy: the one wrapper a model's layer
loop calls, so the model knows no strategy.

A strategy (basp_jax.sharding.Strategy) says where parameters are stored; its `use`, a ParamUse,
says where a layer uses them and when they are moved there. A model runs each layer as

    layers = LayerParams(rules, dtype)
    wrap, policy = layers.checkpoint(remat_policy)        # jax.checkpoint the body? with what
    body = lambda x, layer: forward(x, layers.in_body(layer))   # (wrapped when `wrap`)
    x = body(x, layers.before_body(layer))

and a train step that differentiates several microbatches may hand the model its layers once
for all of them (LayerParams.once_per_step). The built-in uses:

    ParamUse()                      used where stored (fsdp, hsdp, host, replicated)
    ParamUse(axes, copy=None)       gathered to `axes` inside the rematerialised body, so the
                                    backward gathers again (staged)
    ParamUse(axes, copy="device")   gathered before the body and kept on the device for the
                                    backward; once per step with several microbatches
                                    (staged_keep, ZeRO++'s hpZ)
    ParamUse(axes, copy="host")     gathered inside the body, the copy parked in pinned host
                                    memory for the backward (staged_offload)

A new strategy registers a Strategy with its own ParamUse (a subclass may override `gather`);
tests/basp_jax/test_param_use.py registers one without touching the models.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from flax import nnx
from jax.sharding import NamedSharding

from .remat import name_host_copy, offload_host_copy

COPY_PLACES = (None, "device", "host")


@dataclasses.dataclass(frozen=True)
class ParamUse:
    """Where a strategy's layers use their parameters.

    axes: the axes of the strategy's placement mesh a split parameter axis keeps where it is
        used: the others are gathered (across hosts, for the staged strategies) before a layer
        uses it. None: used where stored, nothing gathered.
    copy: where the gathered copy waits from the forward to the backward pass: None (nowhere:
        the backward gathers again), "device" or "host" (pinned host memory)."""

    axes: tuple[str, ...] | None = None
    copy: str | None = None

    def __post_init__(self):
        if self.copy not in COPY_PLACES:
            raise ValueError(f"ParamUse copy={self.copy!r}; use one of {COPY_PLACES}")
        if self.copy is not None and self.axes is None:
            raise ValueError(f"ParamUse copy={self.copy!r} keeps a gathered copy, but axes=None "
                             "gathers nothing; give the axes the parameters are used on")

    @property
    def gathers(self) -> bool:
        return self.axes is not None

    def gather(self, rules, x: jax.Array, names) -> jax.Array:
        """Parameter x (axes named `names`) placed where its layer uses it (rules: a
        basp_jax.sharding.ShardingRules, its use_spec);
        its gradient summed there, then onto the stored shards (two reductions, not one over
        the whole mesh)."""
        use = NamedSharding(rules.placement, rules.use_spec(names, x.shape))
        stored = NamedSharding(rules.placement, rules.spec(names, x.shape))
        return _gather_to(x, use, stored)


class LayerParams:
    """A layer's parameters as the layer loop of a model uses them under `rules` (a
    basp_jax.sharding.ShardingRules, or None without a mesh), matrices cast to `dtype`
    where they are gathered (half the bytes to move and keep)."""

    def __init__(self, rules, dtype):
        self.rules = rules
        self.dtype = dtype
        self.use = rules.use if rules is not None else ParamUse()

    def checkpoint(self, policy):
        """(whether the layer body is rematerialised, its jax.checkpoint policy), given the run's
        remat `policy` (None: not rematerialised). A copy kept in host memory needs the body
        rematerialised, saving every other residual where no policy said otherwise."""
        if self.use.copy != "host":
            return policy is not None, policy
        return True, offload_host_copy(policy if policy is not None
                                       else jax.checkpoint_policies.everything_saveable)

    def before_body(self, state: nnx.State) -> nnx.State:
        """A layer's parameters as its rematerialised body receives them: gathered here where
        the copy is kept on the device for the backward."""
        return self.gather(state) if self.use.copy == "device" else state

    def in_body(self, state: nnx.State) -> nnx.State:
        """A layer's parameters inside its body: gathered here unless before_body did."""
        if self.use.copy == "device":
            return state
        state = self.gather(state)
        return name_host_copy(state) if self.use.copy == "host" else state

    def gather(self, state: nnx.State) -> nnx.State:
        """The parameters of `state` (a layer, or a slice of a scanned stack) as the strategy's
        use places them (ParamUse.gather). Matrices are cast to the compute dtype first, as
        every projection casts them; vectors keep theirs (Gated DeltaNet's decay parameters
        and the (1 + w) norms are used in float32). Without a gathering use: `state`."""
        if self.rules is None or not self.use.gathers:
            return state

        def gather(v):
            if not isinstance(v, nnx.Param):
                return v
            names = tuple(v.get_metadata()["out_sharding"])
            names = names[len(names) - v[...].ndim:]  # a scanned slice: without 'layers'
            return v.replace(self.rules.stage(v[...], names, self.dtype if v[...].ndim >= 2
                                              else None))

        return jax.tree.map(gather, state, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def once_per_step(self, params: dict, names: dict, microbatches: int) -> dict:
        """The parameters (a pure dict; `names`: their axis names, models.param_names) a step of
        `microbatches` differentiates: where the gathered copies are kept on the device anyway
        and there are several microbatches, the layers (params['layers']) gathered once for all
        of them, so each crosses hosts once a step (gathering them again in the loop moves
        nothing); else `params`."""
        if (self.rules is None or self.use.copy != "device" or microbatches == 1
                or "layers" not in params):
            return params

        def gather(x, n):
            matrix = x.ndim - (1 if n[0] == "layers" else 0) >= 2  # a stack: one axis more
            return self.rules.stage(x, n, self.dtype if matrix else None)

        return {**params, "layers": jax.tree.map(gather, params["layers"], names["layers"])}


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_to(x: jax.Array, use: NamedSharding, stored: NamedSharding) -> jax.Array:
    """x, placed as `use`; its cotangent summed as `use` places it (inside each host), then
    onto `stored` (across hosts, on the stored shards) where the layer's backward produced it,
    so the two reductions stay apart instead of one over the whole mesh."""
    return jax.lax.with_sharding_constraint(x, use)


def _gather_to_fwd(x, use, stored):
    return jax.lax.with_sharding_constraint(x, use), None


def _gather_to_bwd(use, stored, _, g):
    g = jax.lax.with_sharding_constraint(g, use)
    return (jax.lax.with_sharding_constraint(g, stored),)


_gather_to.defvjp(_gather_to_fwd, _gather_to_bwd)
