"""The train step with parameters and optimizer state in host memory (optimizer.offload=true).

An 8B model's float32 master weights and Adam moments are 80 GB: more than one GPU holds before
a single activation. Here they live in pinned host memory, and the step streams them through the
device one layer at a time:

    forward    a scan over the layers: layer i's weights copied in, run, its input copied to the
               host (nothing else of the layer is kept)
    loss       the final norm and the chunked loss, differentiated with jax.vjp
    backward   a reversed scan: layer i's weights and input copied in, the layer recomputed and
               differentiated, its weight gradient stacked on the device in the compute dtype
               (half the size of the master weights in bf16) and its squared norm summed
    check      a scan over the layers: weights and moments of layer i copied in, the update
               computed and checked finite, nothing written (the embedding, final norm and head
               likewise, once)
    update     a scan over the layers: weights and moments of layer i copied in, the optax
               update applied with its gradient, the results copied back (the old values where
               the check failed); the embedding, final norm and head (used whole on the device
               anyway) are updated once

The layer loop is written out rather than left to jax.grad: the cotangent JAX gives a master
weight is float32 (its dtype) and lives in device memory whatever memory the weight is in, so
jax.grad would stack a float32 gradient of the whole stack on the device (BENCHMARKS.md,
"Figures behind design choices"), and moving it to the host inside the transposed scan is not
expressible (custom_vjp
rules must return device-typed cotangents). Here each layer's gradient is cast to the compute
dtype before it is stacked. The update uses the run's own optax
transformation on views of the state (a layer's slice, zero-size stand-ins for everything
else), so the optimizer state keeps the layout of the ordinary step and checkpoints move between
the two. Gradient clipping uses the global norm of the whole step (the sum of the backward's
squared norms); the step is kept only if the loss, that norm, the learning rate and the updated
state are finite (train.program.step.all_finite, the ordinary step's check). The state is written a
layer at a time, so the updated state is checked first, by a pass over the layers that computes
their update and writes nothing: the weights and moments cross to the device once more per step.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from basp_jax.param_use import LayerParams
from basp_jax.sharding import PARAM_SHARDINGS
from models.layers import axis_names
from models.transformer import with_values

from ..config.schema import Config, ConfigError
from .step import ModelParts, all_finite, jit_train_step

HOST_MEMORY = "pinned_host"
_DEVICE, _HOST = jax.memory.Space.Device, jax.memory.Space.Host
LAYERS = "layers"  # the params key of the scanned layer stack


def check_offload(cfg: Config, strategy: str, compute_dtype: str, mcfg=None) -> None:
    """Refuse, in one line, what the streamed step does not do (before anything compiles);
    mcfg: the model's config (layers unlike each other are no stack of alike ones); strategy: the parameter
    sharding, or "auto" (the planner then offers only those the streamed step runs)."""
    if cfg.optimizer.offload is not True:  # false, or auto before planning.resolve_offload
        return
    fix = "or set optimizer.offload=false"
    if mcfg is not None and not mcfg.layers_alike:
        kinds = ("linear_attention and full_attention layers" if mcfg.is_hybrid
                 else "dense and sparse MLPs")
        raise ConfigError(f"optimizer.offload=true streams the layers of a stack of alike "
                          f"layers, and this {mcfg.model_type} model's {kinds} differ; set "
                          f"optimizer.offload=false")
    if cfg.train.grad_accum != 1:
        raise ConfigError(f"optimizer.offload=true runs one microbatch per step, got "
                          f"train.grad_accum={cfg.train.grad_accum}; set train.grad_accum=1 "
                          f"(raise train.microbatch_size instead) {fix}")
    if cfg.model.remat not in ("auto", "offload"):
        raise ConfigError(f"optimizer.offload=true keeps each layer's input in host memory and "
                          f"recomputes the layer in the backward pass, which is model.remat="
                          f"offload; set model.remat=offload (or auto), not "
                          f"{cfg.model.remat!r}, {fix}")
    if not cfg.model.scan_layers:
        raise ConfigError(f"optimizer.offload=true streams the layers of a scanned stack; set "
                          f"model.scan_layers=true {fix}")
    entry = PARAM_SHARDINGS.get("fsdp" if strategy == "auto" else strategy)
    if entry.use.copy is not None:
        raise ConfigError(f"optimizer.offload=true copies each layer's weights in again for its "
                          f"backward, so {strategy} (which keeps the forward's host-local copy) "
                          f"does not apply; set parallel.param_sharding=staged (the same "
                          f"two-stage gathers) {fix}")
    if not entry.streams:
        raise ConfigError(f"optimizer.offload=true keeps the weights in host memory, so {strategy} "
                          f"parameter sharding (device copies of the weights per host) does not "
                          f"apply; set parallel.param_sharding=staged (on several hosts) or fsdp "
                          f"{fix}")
    if compute_dtype == "float16":
        raise ConfigError(f"optimizer.offload=true has no loss scaling for float16 compute; set "
                          f"model.dtype=bfloat16 or float32 {fix}")


def in_host_memory(shardings):
    """The same shardings in pinned host memory (the caller leaves scalars such as step counts
    on the device: train.program.state.build_program)."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), shardings)


def init_opt_state(tx, params, shardings):
    """tx.init(params) built a leaf at a time where `shardings` put it (host memory): the whole
    state is never on the device. Every leaf of make_optimizer's state starts at zero (Adam's
    moments and the step counts; tests/train/test_streamed.py checks it against tx.init)."""
    abstract = jax.eval_shape(tx.init, params)
    return jax.tree.map(lambda a, s: jnp.zeros(a.shape, a.dtype, device=s), abstract, shardings)


def _to_device(tree):
    return jax.tree.map(lambda a: jax.device_put(a, _DEVICE), tree)


def _to_host(tree):
    return jax.tree.map(lambda a: jax.device_put(a, _HOST), tree)


def _split_layers(parts: ModelParts, params):
    """(model_with(outer params) -> the module, the outer params on the device, the layer
    stack's graphdef, its state in host memory): the pieces the streamed passes run."""
    graphdef, (abs_params, abs_rest), rest = parts.graphdef, parts.abstract_state, parts.rest
    stack = params[LAYERS]
    outer = _to_device({k: v for k, v in params.items() if k != LAYERS})

    def model_with(outer_params):
        values = {**outer_params, LAYERS: stack}
        return nnx.merge(graphdef, with_values(abs_params, values), with_values(abs_rest, rest))

    layer_def, layer_state = nnx.split(model_with(outer).layers)
    return model_with, outer, layer_def, layer_state


def _staged(model, weights):
    """A layer's weights, on the device, as the layer uses them: under a staged strategy
    gathered across hosts to the host-local copy (basp_jax.param_use.LayerParams.gather),
    whose gradient is reduce-scattered back onto the stored shards; else as they are."""
    return LayerParams(model.options.rules, model.dtype).gather(weights)


def _as_stored(model, grads):
    """A layer's gradient placed as its weights are stored (a layer slice of the stack's
    sharding): reduce-scattered where it is produced, not summed whole on every device and then
    cut, which XLA otherwise picks for the stacked gradient, all-reducing it across hosts."""
    rules = model.options.rules
    if rules is None:
        return grads

    def place(v):
        names = axis_names(v)
        names = names[len(names) - v[...].ndim:]  # a slice of the stack: without 'layers'
        return v.replace(jax.lax.with_sharding_constraint(
            v[...], rules.sharding(names, v[...].shape)))

    return jax.tree.map(place, grads, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_streamed_micro_loss(parts: ModelParts, loss_fn: Callable) -> Callable:
    """micro_loss(params, tokens, targets, segment_ids) -> (loss sum, token count), as
    train.program.step.make_micro_loss's, for parameters in host memory: a forward pass streaming the
    layers in one at a time (what the evaluation of an optimizer.offload run sums)."""
    def micro_loss(params, tokens, targets, segment_ids):
        model_with, outer, layer_def, layer_state = _split_layers(parts, params)
        model = model_with(outer)
        x, positions, segs = model.embed_inputs(tokens, segment_ids)

        def forward(x, weights):
            weights = _staged(model, _to_device(weights))
            return nnx.merge(layer_def, weights)(x, positions, segs), None

        x, _ = jax.lax.scan(forward, x, layer_state)
        return model.loss_of_last_layer(x, targets, loss_fn=loss_fn)

    return micro_loss


def streamed_loss_and_grads(parts: ModelParts, params, tokens, targets, segment_ids, *,
                            loss_fn: Callable, grad_dtype):
    """((loss sum, token count), gradients of the mean loss, their squared norm) of one
    microbatch, with params['layers'] (in host memory) streamed a layer at a time; the layers'
    gradient is stacked on the device in `grad_dtype` (the compute dtype: a fraction of the
    master weights and moments it stands beside in host memory)."""
    model_with, outer, layer_def, layer_state = _split_layers(parts, params)

    def embed(outer_params):  # (first layer's input, (positions, segment ids) as placed)
        x, positions, segs = model_with(outer_params).embed_inputs(tokens, segment_ids)
        return x, (positions, segs)

    x0, embed_vjp, (positions, segs) = jax.vjp(embed, outer, has_aux=True)
    model = model_with(outer)

    def layer(weights, x):
        return nnx.merge(layer_def, _staged(model, weights))(x, positions, segs)

    def forward(x, weights):
        return layer(_to_device(weights), x), jax.device_put(x, _HOST)

    x_last, inputs = jax.lax.scan(forward, x0, layer_state)

    def loss_of(outer_params, x):
        return model_with(outer_params).loss_of_last_layer(x, targets, loss_fn=loss_fn)

    (loss, count), tail_vjp = jax.vjp(loss_of, outer, x_last)
    seed = 1.0 / jnp.maximum(count, 1.0)  # the gradient of the mean loss, as the ordinary step's
    g_outer, ct = tail_vjp((seed.astype(loss.dtype), jnp.zeros_like(count)))

    def backward(carry, xs):
        ct, sumsq = carry
        weights, x = xs
        _, vjp = jax.vjp(layer, _to_device(weights), jax.device_put(x, _DEVICE))
        g_weights, ct = vjp(ct)
        g_weights = _as_stored(model, jax.tree.map(lambda g: g.astype(grad_dtype), g_weights))
        sumsq = sumsq + sum(jnp.sum(jnp.square(g.astype(jnp.float32)))
                            for g in jax.tree.leaves(g_weights))
        return (ct, sumsq), g_weights

    (ct0, sumsq), g_stack = jax.lax.scan(backward, (ct, jnp.zeros((), jnp.float32)),
                                         (layer_state, inputs), reverse=True)
    (g_embed,) = embed_vjp(ct0)
    g_outer = jax.tree.map(jnp.add, g_outer, g_embed)
    sumsq = sumsq + optax.tree.norm(g_outer, squared=True)
    grads = {**g_outer, LAYERS: nnx.to_pure_dict(g_stack)}
    return (loss, count), grads, sumsq


def _views(tx, opt_state, params):
    """Which leaves of the optimizer state mirror a layer-stack parameter ('L'), another
    parameter ('P') or nothing ('N', e.g. step counts), as a state-structured tree."""
    kinds = {k: jax.tree.map(lambda _, k=k: "L" if k == LAYERS else "P", v)
             for k, v in params.items()}
    return optax.tree_map_params(tx, lambda _, kind: kind, opt_state, kinds,
                                 transform_non_params=lambda _: "N")


def _stand_in(x):
    return jnp.zeros((0,), x.dtype)  # a zero-size leaf: the update does nothing to it


def _update_outer(tx, kinds, grads, opt_state, params, clipped):
    """The optax update of the parameters outside the layer stack, once, on the device (the
    stack's leaves stand in as empty arrays): (their params and state on the device, the updated
    params and state)."""
    outer_params = {k: (jax.tree.map(_stand_in, v) if k == LAYERS else _to_device(v))
                    for k, v in params.items()}
    outer_grads = {k: (jax.tree.map(_stand_in, v) if k == LAYERS else
                       jax.tree.map(clipped, v, outer_params[k])) for k, v in grads.items()}
    outer_state = jax.tree.map(
        lambda kind, s: _stand_in(s) if kind == "L" else
        (jax.device_put(s, _DEVICE) if kind == "P" else s), kinds, opt_state)
    updates, new_outer_state = tx.update(outer_grads, outer_state, outer_params)
    return outer_params, outer_state, optax.apply_updates(outer_params, updates), new_outer_state


def make_streamed_update(tx: optax.GradientTransformation):
    """update(grads, opt_state, params, clip_scale, keep) -> (params, opt_state, kept): the optax
    update of the whole model applied to the layer stack one layer at a time (state and
    weights in host memory) and to the other parameters once. The state is written a layer at a
    time, so the updated state's finiteness (train.program.step.all_finite, the ordinary step's check)
    is found first, by a pass over the layers that writes nothing; where `keep` is false or the
    updated state is not finite (e.g. a finite gradient times a huge learning rate), the old
    values are written back and `kept` is false."""
    def update(grads, opt_state, params, clip_scale, keep):
        kinds = _views(tx, opt_state, params)

        def clipped(g, p):  # in the parameter's dtype, as the ordinary step's gradients
            return g.astype(p.dtype) * clip_scale.astype(p.dtype)

        pick = lambda kind, x, want: x if kind == want else None  # noqa: E731
        is_none = lambda x: x is None  # noqa: E731
        layer_state = jax.tree.map(lambda kind, s: pick(kind, s, "L"), kinds, opt_state)
        outer_params, outer_state, new_outer, new_outer_state = _update_outer(
            tx, kinds, grads, opt_state, params, clipped)

        def layer_candidate(w, g, s):
            """(layer weights, their state view, updated weights, updated state view) of one
            layer, on the device ([1, ...]: a stack of one)."""
            one = lambda x: jax.device_put(x, _DEVICE)[None]  # noqa: E731
            w = jax.tree.map(one, w)
            g = jax.tree.map(clipped, jax.tree.map(one, g), w)
            s = jax.tree.map(lambda x: None if x is None else one(x), s, is_leaf=is_none)
            view_params = {k: (w if k == LAYERS else jax.tree.map(_stand_in, v))
                           for k, v in params.items()}
            view_grads = {k: (g if k == LAYERS else jax.tree.map(_stand_in, v))
                          for k, v in grads.items()}
            view_state = jax.tree.map(
                lambda kind, layer, full: layer if kind == "L" else
                (_stand_in(full) if kind == "P" else full), kinds, s, opt_state,
                is_leaf=is_none)
            updates, new_state = tx.update(view_grads, view_state, view_params)
            return w, view_state, optax.apply_updates(w, updates[LAYERS]), new_state

        stack = (params[LAYERS], grads[LAYERS], layer_state)

        # the check: every layer's updated state (stand-ins are empty: they pass), nothing written
        def check_layer(ok, xs):
            _, _, new_w, new_state = layer_candidate(*xs)
            return ok & all_finite((new_w, new_state)), None

        keep, _ = jax.lax.scan(check_layer, keep & all_finite((new_outer, new_outer_state)),
                               stack)

        def choose(new, old):
            return jnp.where(keep, new, old)

        new_outer = {k: _to_host(jax.tree.map(choose, v, outer_params[k]))
                     for k, v in new_outer.items() if k != LAYERS}
        new_outer_state = jax.tree.map(
            lambda kind, new, old: None if kind == "L" else
            (jax.device_put(choose(new, old), _HOST) if kind == "P" else choose(new, old)),
            kinds, new_outer_state, outer_state)

        # the layer stack, a layer at a time
        def layer_update(_, xs):
            w, view_state, new_w, new_state = layer_candidate(*xs)
            new_w = jax.tree.map(lambda n, o: choose(n, o)[0], new_w, w)
            new_s = jax.tree.map(
                lambda kind, n, o: choose(n, o)[0] if kind == "L" else None,
                kinds, new_state, view_state)
            return None, (_to_host(new_w), jax.tree.map(lambda x: jax.device_put(x, _HOST),
                                                        new_s))

        _, (new_stack, new_layer_state) = jax.lax.scan(layer_update, None, stack)
        new_params = {**new_outer, LAYERS: new_stack}
        new_state = jax.tree.map(lambda kind, o, l: l if kind == "L" else o,
                                 kinds, new_outer_state, new_layer_state, is_leaf=is_none)
        return new_params, new_state, keep

    return update


def make_streamed_train_step(parts: ModelParts, tx, schedule, mesh: Mesh, param_shardings,
                             opt_shardings, *, loss_fn: Callable, packed: bool, grad_dtype,
                             clip_norm: float | None):
    """jit(train_step)(params, opt_state, batch, step) -> (params, opt_state, metrics), as
    train.program.step.make_train_step's, for parameters and optimizer state in host memory
    (param_shardings / opt_shardings: in_host_memory of the ordinary ones). One microbatch per
    step (train.grad_accum=1)."""
    update = make_streamed_update(tx)

    def train_step(params, opt_state, batch, step):
        micro = jax.tree.map(lambda x: x[0], batch)
        (loss_sum, count), grads, sumsq = streamed_loss_and_grads(
            parts, params, micro["tokens"], micro["targets"],
            micro["segment_ids"] if packed else None, loss_fn=loss_fn, grad_dtype=grad_dtype)
        grad_norm = jnp.sqrt(sumsq)
        lr = schedule(step)
        finite = jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm) & jnp.isfinite(lr)
        # the clip optax would apply to the whole gradient (the views' own clips then do nothing)
        clip_scale = (jnp.ones((), jnp.float32) if clip_norm is None else
                      jnp.where(grad_norm < clip_norm, 1.0, clip_norm / grad_norm))
        # finite: also the updated state's (as the ordinary step's), checked before it is written
        params, opt_state, finite = update(grads, opt_state, params, clip_scale, finite)
        metrics = {"finite": finite, "loss": loss_sum / jnp.maximum(count, 1.0),
                   "grad_norm": grad_norm, "lr": lr, "tokens": count, "next_step": step + 1}
        return params, opt_state, metrics

    return jit_train_step(train_step, mesh, param_shardings, opt_shardings, packed)
