"""The model as pure pytrees on the mesh, the optimizer, and the jitted train step.

The NNX model is split once into a graphdef and its parameters; parameters and optimizer state are
plain pytrees of jax arrays placed by the run's basp_jax.sharding.ShardingRules (FSDP over the
whole mesh by default, never replicated unless asked). `train_step(params, opt_state, batch)` runs the
microbatches of one step under `lax.scan`, sums loss and gradients, divides by the token count of
the whole step, constrains the gradients to the parameters' sharding and applies the optax update,
all in one jit with params and optimizer state donated. Under staged_keep parameter sharding
the layers are gathered across hosts once before the scan, for every microbatch. Where each
host can keep its own gradient sum (basp_jax.sharding.sums_per_host) the microbatches run
mapped over the groups instead (train.program.per_group): gradients cross hosts once a step.

Under float16 compute (a T4: fp16 tensor cores, no bf16) the loss is scaled before
differentiation and the gradients unscaled after (dynamic loss scaling, LossScale): the scale
lives in the optimizer state, so checkpoints carry it and a resume goes on with it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from basp_jax.param_use import LayerParams
from basp_jax.sharding import ShardingRules, abstract_arrays, activation_spec
from models.hf import is_stacked
from models.layers import param_names
from models.transformer import build_sharded, with_values

from ..config.schema import OptimizerConfig
from . import objective, per_group

BATCH_SPEC = activation_spec(None, "batch", "sequence")  # [accum, B, S]

def compute_dtype(name: str, device) -> str:
    """model.dtype as `device` computes it: "auto" by basp_jax.gpus.auto_compute_dtype on a GPU
    (bfloat16 from sm80, float16 with loss scaling on a T4), float32 on the CPU."""
    if name != "auto":
        return name
    from basp_jax import gpus, kernels

    if device.platform != "gpu":
        return "float32"
    return gpus.auto_compute_dtype(kernels.device_capability(device))


@dataclasses.dataclass(frozen=True)
class LossScale:
    """Dynamic loss scaling for float16 compute: the loss is multiplied by `scale` before the
    backward pass so small gradients survive fp16 (its smallest normal is 6e-5), and the
    gradients are divided by it after. A step whose gradients overflow is skipped (as every
    non-finite step is) and halves the scale; `growth_interval` finite steps in a row double it.
    The values are the usual ones (PyTorch's GradScaler, apex)."""

    initial: float = 2.0**15
    growth_interval: int = 2000
    factor: float = 2.0
    min_scale: float = 1.0


class LossScaleState(NamedTuple):
    scale: jax.Array  # float32 scalar: this step's
    good_steps: jax.Array  # int32: finite steps since the scale last changed


def loss_scaling(dtype: str) -> LossScale | None:
    """The loss scaling a compute dtype needs: float16's range is too narrow for gradients."""
    return LossScale() if dtype == "float16" else None


def initial_loss_scale(ls: LossScale) -> LossScaleState:
    """The state a run's loss scaling starts from (also a resume into float16 from a checkpoint
    of another compute dtype, which holds none)."""
    return LossScaleState(jnp.asarray(ls.initial, jnp.float32), jnp.zeros((), jnp.int32))


def _loss_scale_holder(ls: LossScale) -> optax.GradientTransformation:
    """Keeps the loss scale in the optimizer state (so checkpoints carry it); its update passes
    the gradients through: the train step reads the scale and sets the next (_next_scale),
    because that depends on whether the whole step was finite."""
    def init(params):
        del params
        return initial_loss_scale(ls)

    def update(updates, state, params=None):
        del params
        return updates, state

    return optax.GradientTransformation(init, update)


def _next_scale(state: LossScaleState, finite, ls: LossScale) -> LossScaleState:
    grow = state.good_steps + 1 >= ls.growth_interval
    scale = jnp.where(finite, jnp.where(grow, state.scale * ls.factor, state.scale),
                      jnp.maximum(state.scale / ls.factor, ls.min_scale))
    good = jnp.where(finite & ~grow, state.good_steps + 1, 0).astype(jnp.int32)
    return LossScaleState(scale.astype(jnp.float32), good)


@dataclasses.dataclass
class ModelParts:
    """A model split for training: params (trainable) and rest (other state) as pure pytrees."""

    graphdef: Any
    abstract_state: Any  # nnx.State of ShapeDtypeStructs, to rebuild the module
    params: Any  # pure dict of jax arrays
    rest: Any  # pure dict of non-Param variables (usually empty)

    def module(self, params=None):
        """An nnx module with `params` (default: the current ones) merged in."""
        params_state, rest_state = self.abstract_state
        params_state = with_values(params_state, self.params if params is None else params)
        return nnx.merge(self.graphdef, params_state, with_values(rest_state, self.rest))

    def shardings(self, rules: ShardingRules):
        """The parameters' NamedShardings under `rules` (from their logical axis names)."""
        return rules.shardings(param_names(self.abstract_state[0]), self.params)


def build_model(make: Callable[[], nnx.Module], rules: ShardingRules, *,
                init_params: bool = True) -> ModelParts:
    """Initialise `make()` directly onto the mesh (models.build_sharded): every parameter
    created already placed by `rules`. With init_params=False the params are ShapeDtypeStructs
    carrying their shardings (a restore target)."""
    return ModelParts(*build_sharded(make, rules, init_params=init_params))


def from_module(model: nnx.Module, rules: ShardingRules) -> ModelParts:
    """Split an existing (e.g. pretrained) module and place its parameters by `rules`."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    parts = ModelParts(graphdef, (abstract_arrays(params), abstract_arrays(rest)),
                       nnx.to_pure_dict(params), nnx.to_pure_dict(rest))
    parts.params = jax.device_put(parts.params, parts.shardings(rules))
    parts.rest = jax.device_put(parts.rest, rules.replicated)
    return parts


def decay_mask(params):
    """Weight decay on matrices only: norms and biases (rank < 2) are not decayed."""
    def is_matrix(path, p):
        names = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
        return p.ndim - (1 if is_stacked(names) else 0) >= 2  # a layer stack: one rank more

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def make_schedule(cfg: OptimizerConfig, steps: int) -> optax.Schedule:
    """Linear warmup from 0 to lr, then cosine decay to lr * min_lr_ratio at `steps`. A warm-up
    longer than the run is clamped to it (the trainer prints a note)."""
    warmup = min(cfg.warmup_steps, steps)
    if warmup >= steps:
        return optax.linear_schedule(0.0, cfg.lr, max(warmup, 1))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else cfg.lr,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=steps,
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def make_optimizer(
    cfg: OptimizerConfig, steps: int, loss_scale: LossScale | None = None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with the schedule (and gradient clipping); with `loss_scale`, the first state of the
    chain holds the loss scale (LossScaleState)."""
    schedule = make_schedule(cfg, steps)
    parts = [_loss_scale_holder(loss_scale)] if loss_scale is not None else []
    if cfg.clip_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm))
    parts.append(
        optax.adamw(
            schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
            mask=decay_mask, mu_dtype=cfg.mu_dtype,
        )
    )
    return optax.chain(*parts), schedule


def opt_state_shardings(tx, params, param_shardings, replicated):
    """The optimizer state's shapes and shardings: each moment placed like the parameter it
    mirrors, everything else (step counts) `replicated`."""
    abstract = jax.eval_shape(tx.init, params)
    return abstract, optax.tree_map_params(tx, lambda _, sharding: sharding, abstract,
                                           param_shardings, transform_non_params=lambda _: replicated)


def init_opt_state(tx, params, shardings):
    return jax.jit(tx.init, out_shardings=shardings)(params)


def all_finite(tree) -> jax.Array:
    """Whether every floating-point element of `tree` is finite (a scalar bool): the check of the
    updated state that every step variant applies before keeping it (train.program.streamed too)."""
    checks = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(checks)) if checks else jnp.bool_(True)


def make_micro_loss(parts: ModelParts, loss_fn: Callable) -> Callable:
    """micro_loss(params, tokens, targets, segment_ids) -> (loss sum, token count) of one
    microbatch: what the train step differentiates and the eval step (train.observe.evaluate) sums.
    The model's positions follow its layout's token order (models.Transformer)."""
    graphdef, (abs_params, abs_rest), rest = parts.graphdef, parts.abstract_state, parts.rest

    def micro_loss(params, tokens, targets, segment_ids):
        model = nnx.merge(graphdef, with_values(abs_params, params), with_values(abs_rest, rest))
        # The logits exist a chunk of tokens at a time (basp_jax.vocab.chunked_lm_loss).
        return model.loss(tokens, targets, segment_ids, loss_fn=loss_fn)

    return micro_loss


def make_micro_objective(parts: ModelParts, loss_fn: Callable) -> Callable:
    """micro_objective(params, tokens, targets, segment_ids) -> (the sum the train step
    differentiates, (loss sum, token count, weighted aux loss)) of one microbatch
    (train.program.objective: the loss, plus a sparse model's load-balancing term)."""
    graphdef, (abs_params, abs_rest), rest = parts.graphdef, parts.abstract_state, parts.rest

    def micro_objective(params, tokens, targets, segment_ids):
        model = nnx.merge(graphdef, with_values(abs_params, params), with_values(abs_rest, rest))
        return objective.objective(model, tokens, targets, segment_ids, loss_fn)

    return micro_objective


def _accumulate(grad_fn, params, batch, param_shardings, packed: bool):
    """The float32 sums of the microbatches' gradients (constrained to the parameters' sharding),
    losses, loss tokens and weighted aux losses, under lax.scan over the accumulation axis of
    `batch`. `params` may be the parameters as the layers use them (LayerParams.once_per_step: the
    same values, staged matrices in the compute dtype), whose gradients are the parameters'."""
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    zeros = jax.lax.with_sharding_constraint(zeros, param_shardings)

    def body(carry, micro):
        grad_sum, sums = carry
        segment_ids = micro["segment_ids"] if packed else None
        terms, grads = grad_fn(params, micro["tokens"], micro["targets"], segment_ids)
        grads = jax.lax.with_sharding_constraint(grads, param_shardings)
        grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
        return (grad_sum, tuple(a + t for a, t in zip(sums, terms))), None

    init = (zeros, (jnp.zeros((), jnp.float32),) * 3)
    (grad_sum, (loss_sum, count, aux_sum)), _ = jax.lax.scan(body, init, batch)
    return grad_sum, loss_sum, count, aux_sum


def make_step_gradients(parts: ModelParts, param_shardings, *, loss_fn: Callable, packed: bool,
                        loss_scale: LossScale | None = None, with_aux: bool = False) -> Callable:
    """step_gradients(params, batch, scale) -> (the mean gradient of the step's objective in the
    parameters' dtypes and sharding, loss sum, loss tokens; with_aux: and the sum of the
    microbatches' aux losses weighted by their loss tokens): the microbatches of `batch`
    ([accum, B, S] arrays) under lax.scan; scale: the loss scale (None without loss_scale).
    The objective is the loss, plus a sparse model's load-balancing term
    (train.program.objective)."""
    micro_objective = make_micro_objective(parts, loss_fn)
    names = param_names(parts.abstract_state[0])

    def _used_once(params, batch):
        """The parameters the microbatches differentiate: under a strategy that keeps the
        host-local copies for the backward (staged_keep) with several microbatches, the layers
        staged once for all of them (gathered across hosts once a step, not once a microbatch;
        the copies are what the backward keeps anyway); else the parameters (staged_offload
        keeps them in host memory, a microbatch at a time: gathered once per microbatch)."""
        model = parts.module(params)
        layers = LayerParams(model.options.rules, model.dtype)
        return layers.once_per_step(params, names, microbatches=batch["tokens"].shape[0])

    def grad_fn_at(scale, loss_of=micro_objective, micro_tokens=None):
        """((loss sum, count, weighted aux loss), gradients of scale x the objective) of one
        microbatch (of micro_tokens tokens: default, the tokens given)."""
        def scaled(params, tokens, targets, segment_ids):
            if loss_scale is None:  # the program as it is without scaling, not one times 1.0
                return loss_of(params, tokens, targets, segment_ids)
            # The scale multiplies the microbatch's mean loss (as in PyTorch's GradScaler and
            # apex), not its sum: a sum over 64K tokens would overflow at a 64K times smaller scale
            total, terms = loss_of(params, tokens, targets, segment_ids)
            return total * (scale / (micro_tokens or tokens.size)), terms

        def grad_fn(params, tokens, targets, segment_ids):
            (_, terms), grads = jax.value_and_grad(scaled, has_aux=True)(params, tokens, targets,
                                                                         segment_ids)
            return terms, grads

        return grad_fn

    model = parts.module()
    options = model.options
    # built here, outside any jit and mesh context: the model as one group traces it
    # (not for sparse layers yet: the load-balancing statistic is over the whole microbatch,
    # which a group's map does not see)
    view = (per_group.GroupView(parts, model.config, options)
            if per_group.applies(options.rules, options.layout, accum=2)
            and not model.config.is_moe else None)

    def accumulated(params, batch, scale):
        """(float32 gradient sum, loss sum, loss tokens, weighted aux loss sum) of the step's
        microbatches."""
        accum, micro_tokens = batch["tokens"].shape[0], batch["tokens"][0].size
        if view is not None and per_group.applies(options.rules, options.layout, accum):
            grad_fn = grad_fn_at(scale, view.micro_objective(loss_fn), micro_tokens)
            return per_group.accumulate(view, grad_fn, params, batch, param_shardings, packed)
        return _accumulate(grad_fn_at(scale), _used_once(params, batch), batch, param_shardings,
                           packed)

    def step_gradients(params, batch, scale):
        grad_sum, loss_sum, count, aux_sum = accumulated(params, batch, scale)
        denom = jnp.maximum(count, 1.0)
        if scale is not None:  # the mean gradient of the unscaled loss
            denom = denom * (scale / batch["tokens"][0].size)
        grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grad_sum, params)
        grads = jax.lax.with_sharding_constraint(grads, param_shardings)
        return (grads, loss_sum, count) + ((aux_sum,) if with_aux else ())

    return step_gradients


def make_train_step(
    parts: ModelParts,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    mesh: Mesh,
    param_shardings,
    opt_shardings,
    *,
    loss_fn: Callable,
    packed: bool,
    loss_scale: LossScale | None = None,
):
    """jit(train_step)(params, opt_state, batch, step) -> (params, opt_state, metrics).

    loss_fn(logits, targets) -> (sum, count) is applied to chunks of tokens and summed, so it must
    add up over tokens (models.causal_lm_loss does). With `loss_scale`, `tx` is
    make_optimizer(..., loss_scale) (its first state is the scale) and metrics hold loss_scale.
    """
    step_gradients = make_step_gradients(parts, param_shardings, loss_fn=loss_fn,
                                         packed=packed, loss_scale=loss_scale, with_aux=True)
    sparse = parts.module().config.is_moe

    def train_step(params, opt_state, batch, step):
        scale = opt_state[0].scale if loss_scale is not None else None
        grads, loss_sum, count, aux_sum = step_gradients(params, batch, scale)
        grad_norm = optax.tree.norm(grads)
        with jax.named_scope("optimizer"):  # what a profile's update ops are named by
            updates, new_opt_state = tx.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
        # A NaN/Inf loss, gradient or updated state (e.g. a finite gradient times a NaN learning
        # rate) leaves parameters and optimizer state as they were: none is ever checkpointed.
        finite = jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm) & all_finite(
            (new_params, new_opt_state))
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        params = jax.tree.map(keep, new_params, params)
        opt_state = jax.tree.map(keep, new_opt_state, opt_state)
        extra = {}
        if loss_scale is not None:  # set whether or not the step was kept: an overflow halves it
            opt_state = (_next_scale(opt_state[0], finite, loss_scale),) + tuple(opt_state[1:])
            extra["loss_scale"] = scale
        if sparse:  # the routers' load-balancing loss (unscaled), the objective's other term
            extra["aux_loss"] = aux_sum / jnp.maximum(count, 1.0)
        metrics = {
            **extra,
            "finite": finite,
            "loss": loss_sum / jnp.maximum(count, 1.0),
            "grad_norm": grad_norm,
            "lr": schedule(step),
            "tokens": count,
            # the next step's counter, for the caller to pass on: it stays on the devices
            "next_step": step + 1,
        }
        return params, opt_state, metrics

    return jit_train_step(train_step, mesh, param_shardings, opt_shardings, packed)


def jit_train_step(train_step, mesh: Mesh, param_shardings, opt_shardings, packed: bool):
    """(jit(train_step), the batch's sharding): train_step(params, opt_state, batch, step) ->
    (params, opt_state, metrics) with params and optimizer state donated."""
    batch_sharding = NamedSharding(mesh, BATCH_SPEC)
    replicated = NamedSharding(mesh, P())
    batch_shardings = {"tokens": batch_sharding, "targets": batch_sharding}
    if packed:
        batch_shardings["segment_ids"] = batch_sharding
    return jax.jit(
        train_step,
        in_shardings=(param_shardings, opt_shardings, batch_shardings, replicated),
        out_shardings=(param_shardings, opt_shardings, replicated),
        donate_argnums=(0, 1),
    ), batch_sharding
