"""The decoder: embed -> N x (RMSNorm, token mixer, RMSNorm, SwiGLU) -> RMSNorm -> logits.

One implementation for Llama 3, Qwen 2/2.5/3, Qwen3-MoE and the Qwen3.5 hybrid; the config's
switches pick the family's details. A layer's token mixer is attention, or for the hybrid's
linear_attention layers (ModelConfig.layer_types) a Gated DeltaNet (models.linear_attention); its
MLP is SwiGLU, or for a Qwen3-MoE's sparse layers a mixture of experts (models.moe), whose
routers' statistics the layers hand out for the load-balancing loss (loss_and_aux). The N layers
are one Block of stacked parameters run under lax.scan (scan_layers=True, the default: the
program holds one layer, so compile time does not grow with depth), or a list; layers unlike
each other (a hybrid's; dense MLPs among sparse ones) are always a list.
With a mesh, activations are placed by their logical axes ('batch', 'sequence':
basp_jax.sharding.activation_spec), attention runs through basp_jax.attention and the embedding
and loss through basp_jax.vocab (which ask the run's ShardingRules how); without one, everything
runs on one device.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

import basp_jax
from basp_jax.param_use import LayerParams
from basp_jax.remat import name_layer_input
from basp_jax.sharding import ShardingRules, abstract_arrays, activation_spec
from basp_jax.vocab import LOSS_CHUNK_TOKENS, Table

from . import tiling
from .config import LINEAR_ATTENTION, ModelConfig, ModelError
from .layers import MLP, Attention, Embed, Linear, axis_names, constrain, param_names, rms_norm
from .linear_attention import GatedDeltaNet
from .loss import causal_lm_loss
from .moe import RouterStats, SparseMoE, load_balancing_loss, router_z_loss
from .options import RunOptions


class Block(nnx.Module):
    """One pre-norm decoder layer; its token mixer is `self_attn` (Attention) or, for a
    linear_attention layer, `linear_attn` (GatedDeltaNet), as Hugging Face names them."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, options: RunOptions,
                 layer_index: int = 0):
        self.input_layernorm = rms_norm(config.hidden_size, ("norm",), config, options)
        if config.layer_type(layer_index) == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(config, rngs=rngs, options=options)
        else:
            self.self_attn = Attention(config, rngs=rngs, options=options)
        self.post_attention_layernorm = rms_norm(config.hidden_size, ("norm",), config, options)
        # a sparse layer's MLP is the experts (models.moe), as transformers' Qwen3-MoE decides
        self.sparse = config.layer_is_sparse(layer_index)
        if self.sparse:
            self.mlp = SparseMoE(config, rngs=rngs, dtype=options.dtype,
                                 split_experts=options.experts_split(config),
                                 grouped_matmul=options.grouped_matmul,
                                 param_dtype=options.param_dtype, mesh=options.mesh)
        else:
            self.mlp = MLP(config, rngs=rngs, dtype=options.dtype,
                           param_dtype=options.param_dtype, fp8=options.fp8)
        self.mesh = options.mesh
        self.tile_tokens, self.dtype = options.tile_tokens, options.dtype

    def __call__(self, x, positions, segment_ids):
        return self.forward(x, positions, segment_ids)[0]

    def forward(self, x, positions, segment_ids):
        """(the layer's output, its router's RouterStats, or None for a dense MLP)."""
        # the offload policies keep this tagged value (in host memory), so every use reads it
        x = name_layer_input(x)
        if self.tile_tokens is not None:
            return self._tiled(x, positions, segment_ids)
        # named scopes: a profiler trace (train.observe.profiling) shows each op under its part
        with jax.named_scope("attention"):
            x = x + self.mixer(self.input_layernorm(x), positions, segment_ids)
        x = constrain(x, self.mesh)
        with jax.named_scope("mlp"):
            out, stats = self.mlp_and_stats(self.post_attention_layernorm(x))
        return constrain(x + out, self.mesh), stats

    def mlp_and_stats(self, x):
        """(the MLP's output, the router's RouterStats or None)."""
        return self.mlp(x) if self.sparse else (self.mlp(x), None)

    @property
    def mixer(self) -> Attention | GatedDeltaNet:
        """The layer's token mixer (mix: its output before the projection)."""
        return self.linear_attn if hasattr(self, "linear_attn") else self.self_attn

    def _tiled(self, x, positions, segment_ids):
        """__call__ with everything after attention (output projection, residual adds, norm,
        MLP) over chunks of tile_tokens tokens per device (models.tiling), so no [tokens,
        intermediate] buffer of the whole shard exists. (Tiling the q/k/v projections too made
        XLA keep extra copies of q, k, v: BENCHMARKS.md, "Figures behind design choices".)"""
        mixer = self.mixer
        with jax.named_scope("attention"):
            out = mixer.mix(self.input_layernorm(x), positions, segment_ids)
        if self.sparse:  # the experts sort each device's tokens whole: they are not tiled
            x = constrain(x + mixer.output_projection(out), self.mesh)
            with jax.named_scope("mlp"):
                out, stats = self.mlp(self.post_attention_layernorm(x))
            return constrain(x + out, self.mesh), stats
        with jax.named_scope("mlp"):
            x = tiling.map_module_chunks(
                _output_and_mlp,
                (mixer.output_projection, self.post_attention_layernorm, self.mlp), (x, out),
                mesh=self.mesh, chunk_tokens=self.tile_tokens, dtype=self.dtype)
        return constrain(x, self.mesh), None

    def decode(self, x, index, cache_k, cache_v):
        """The layer on tokens that follow `index` cached ones (Attention.decode)."""
        attn, cache_k, cache_v = self.self_attn.decode(self.input_layernorm(x), index, cache_k,
                                                       cache_v)
        x = x + attn
        return x + self.mlp_and_stats(self.post_attention_layernorm(x))[0], cache_k, cache_v


def _output_and_mlp(modules, x, attended):
    """A chunk's layer output: x + o_proj(attention), then + mlp(norm(...)) (Block._tiled)."""
    o_proj, norm, mlp = modules
    x = x + o_proj(attended)
    return x + mlp(norm(x))


PERIOD_BLOCKS = "blocks"  # Period's attribute: a parameter path ('layers', 'blocks', j, ...)


class Period(nnx.Module):
    """`period` consecutive layers unlike each other (a hybrid's pattern: config.layer_period),
    `blocks[j]` being layer j of the pattern; stacked over the pattern's repeats like a Block."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, options: RunOptions,
                 period: int):
        self.blocks = nnx.List([Block(config, rngs=rngs, options=options, layer_index=j)
                                for j in range(period)])


def _stacked_layers(config: ModelConfig, rngs: nnx.Rngs, options: RunOptions,
                    period: int) -> Block | Period:
    """The layers as one module whose parameters carry a leading [num_layers / period] axis
    (each layer its own init): a Block where the layers are alike (period 1), else a Period."""

    @nnx.split_rngs(splits=config.num_layers // period)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs):
        if period == 1:
            return Block(config, rngs=rngs, options=options)
        return Period(config, rngs=rngs, options=options, period=period)

    return make(rngs)


def _add_stats(total: RouterStats | None, stats: RouterStats | None) -> RouterStats | None:
    return stats if total is None else total if stats is None else total + stats


class Transformer(nnx.Module):
    """A causal decoder LM. `model(tokens [B, S], segment_ids=None, positions=None)` -> logits
    [B, S, vocab] float32.

    segment_ids [B, S] (packed documents; tokens attend within their segment) and positions [B, S]
    (default: 0..S-1, or restarting at each new segment) are optional. How it runs is one
    models.RunOptions (`options=`, or its fields as keywords: `mesh=mesh, remat="full"`). With a
    mesh, B must be divisible by the layout's groups and S by its sp; logits come back sharded
    as activations (basp_jax.ACTIVATION_SPEC). The options' layout (the one the mesh was made
    from) adds a ring and its token order: with layout.zigzag, tokens come in layout.token_order and so
    do default positions.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, options: RunOptions | None = None,
                 **option_fields):
        options = RunOptions.of(options, **option_fields)
        if options.layout is not None:  # the layout's own checks, before anything compiles
            options.layout_for(config, options.layout.batch, options.layout.seq_len)
        self.config = config
        self.options = options
        self.mesh = options.mesh
        self.dtype = dtype = options.dtype
        param_dtype = options.param_dtype
        std = config.initializer_range
        self.embed_tokens = Embed(config.vocab_size, config.hidden_size, rngs=rngs, dtype=dtype,
                                  param_dtype=param_dtype, init_std=std, rules=options.rules,
                                  vocab_parallel_mode=options.vocab_parallel,
                                  tied=config.tie_word_embeddings)
        # scan_layers: one Block of stacked [num_layers, ...] parameters run under lax.scan, so
        # the step compiles one layer whatever the depth; else a list of Blocks in a Python loop.
        # Layers unlike each other (a hybrid's; dense MLPs among sparse ones) are stacked by
        # the pattern they repeat (config.layer_period): one Period of stacked
        # [num_layers / period, ...] parameters, the scan compiling one period.
        period = config.layer_period
        # (a pattern that repeats once, its whole depth, is a list: one scan step buys nothing)
        self.scanned = options.scan_layers and (period == 1 or period < config.num_layers)
        self.period = period if self.scanned else None
        if self.scanned:
            self.layers = _stacked_layers(config, rngs, options, period)
        else:
            self.layers = nnx.List([Block(config, rngs=rngs, options=options, layer_index=i)
                                    for i in range(config.num_layers)])
        self.norm = rms_norm(config.hidden_size, ("norm",), config, options)
        # the head as the strategy places it (basp_jax.vocab.Table): the loss asks it how to run
        if config.tie_word_embeddings:
            self.lm_head = None
            self.head_table = self.embed_tokens.table
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, ("embed", "vocab"),
                                  use_bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                                  init_std=std)
            kernel = self.lm_head.kernel
            self.head_table = Table(axis_names(kernel), kernel.shape, options.rules,
                                    mode=options.vocab_parallel)

    def hidden_states(self, tokens, segment_ids=None, positions=None, _table=None):
        """Final normalised hidden states [B, S, hidden] in the compute dtype. (_table: the
        embedding as the tied head's loss uses it, basp_jax.vocab.Table.use, so both share it.)"""
        return self.hidden_and_router_stats(tokens, segment_ids, positions, _table)[0]

    def hidden_and_router_stats(self, tokens, segment_ids=None, positions=None, _table=None):
        """(hidden_states, the sparse layers' models.moe.RouterStats summed over them and over
        every token, or None without sparse layers)."""
        x, positions, segment_ids = self.embed_inputs(tokens, segment_ids, positions, _table)
        # how the parameter strategy hands each layer its parameters: before the
        # rematerialised body, inside it, and the body's remat policy (basp_jax.param_use)
        params = LayerParams(self.options.rules, self.dtype)
        remat, policy = params.checkpoint(self.options.remat_policy)  # (None: not wrapped)

        def run_layer(x, graphdef, layer):
            layer = params.in_body(layer)
            return nnx.merge(graphdef, layer).forward(x, positions, segment_ids)

        if remat:
            # Under lax.scan one layer's recomputation cannot be merged with its forward pass;
            # several layers in a Python loop (a list, or a period's) XLA would merge and
            # schedule together without prevent_cse, keeping their intermediates alive to the
            # backward pass (BENCHMARKS.md section 6, "Figures behind design choices").
            run_layer = jax.checkpoint(run_layer, policy=policy, prevent_cse=self.period != 1,
                                       static_argnums=(1,))

        def body(x, graphdef, layer):
            return run_layer(x, graphdef, params.before_body(layer))

        def run_layers(x, layers):  # Blocks in turn: (x, their router stats summed)
            total = None
            for layer in layers:
                x, stats = body(x, *nnx.split(layer))
                total = _add_stats(total, stats)
            return x, total

        if not self.scanned:
            x, total = run_layers(x, self.layers)
            return self.norm(x), total
        graphdef, stacked = nnx.split(self.layers)
        if self.period == 1:
            step = lambda x, layer: body(x, graphdef, layer)  # noqa: E731
        else:  # each repeat of the pattern: its layers in turn, each rematerialised apart
            step = lambda x, state: run_layers(x, nnx.merge(graphdef, state).blocks)  # noqa: E731
        x, stats = jax.lax.scan(step, x, stacked)
        return self.norm(x), None if stats is None else stats.total()

    def embed_inputs(self, tokens, segment_ids=None, positions=None, _table=None):
        """(the first layer's input [B, S, hidden], positions, segment_ids), placed on the mesh:
        what every layer reads (the layers' own loop is hidden_states', or
        train.program.streamed's where the layers' weights stream from host memory)."""
        if tokens.ndim != 2:
            raise ModelError(f"tokens must be [batch, seq], got shape {tokens.shape}")
        b, s = tokens.shape
        if positions is None:
            positions = basp_jax.position_ids(b, s, segment_ids, order=self._token_order(b, s))
        if self.mesh is not None:
            tokens = constrain(tokens, self.mesh)
            positions = constrain(positions, self.mesh)
            if segment_ids is not None:
                segment_ids = constrain(segment_ids, self.mesh)
        return constrain(self.embed_tokens(tokens, copies=_table), self.mesh), positions, segment_ids

    def _token_order(self, batch: int, seq_len: int):
        """The order of the sequence axis the layout wants for [batch, seq_len] (None: natural)."""
        if self.options.layout is None or not self.options.layout.zigzag:
            return None
        return self.options.layout_for(self.config, batch, seq_len).token_order

    def init_cache(self, batch: int, length: int, dtype=None) -> tuple[jax.Array, jax.Array]:
        """An empty key/value cache for `decode`: (k, v), each [num_layers, batch, length,
        num_kv_heads, head_dim] in the compute dtype, preallocated to the whole generation."""
        self._check_decodable()
        c = self.config
        shape = (c.num_layers, batch, length, c.num_kv_heads, c.head_dim)
        dtype = self.dtype if dtype is None else dtype
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

    def decode(self, tokens, cache, index):
        """Incremental forward for sampling, on one device: tokens [B, T] sit at positions
        index..index+T-1 after the `index` tokens whose keys and values are in `cache`
        (init_cache; a prompt's prefill is index=0, T=its length; then T=1 per new token).
        Returns (final normalised hidden states [B, T, hidden], the updated cache); logits are
        `self.logits(hidden)`. The same parameters and layers as __call__; RoPE at the
        offset positions, attention causal against the cache."""
        if self.mesh is not None:
            raise ModelError("decode runs on one device: load the model without a mesh "
                             "(e.g. models.from_pretrained(path))")
        self._check_decodable()
        cache_k, cache_v = cache
        x = self.embed_tokens(tokens)
        def decode_layers(x, layers, cache_k, cache_v):  # Blocks in turn, a cache row each
            ks, vs = [], []
            for i, layer in enumerate(layers):
                x, k, v = layer.decode(x, index, cache_k[i], cache_v[i])
                ks.append(k)
                vs.append(v)
            return x, (jnp.stack(ks), jnp.stack(vs))

        if not self.scanned:
            x, cache = decode_layers(x, self.layers, cache_k, cache_v)
            return self.norm(x), cache
        graphdef, stacked = nnx.split(self.layers)
        period, shape = self.period, cache_k.shape

        def body(x, layer_and_cache):  # one repeat of the layers' pattern (one layer if alike)
            module = nnx.merge(graphdef, layer_and_cache[0])
            return decode_layers(x, [module] if period == 1 else module.blocks,
                                 *layer_and_cache[1:])

        by_repeat = (shape[0] // period, period, *shape[1:])  # cache rows as [repeat, j]
        x, (cache_k, cache_v) = jax.lax.scan(
            body, x, (stacked, cache_k.reshape(by_repeat), cache_v.reshape(by_repeat)))
        return self.norm(x), (cache_k.reshape(shape), cache_v.reshape(shape))

    def _check_decodable(self):
        if self.config.is_hybrid:
            raise ModelError("cached decoding (models.sampler) has no recurrent state for "
                             "linear_attention layers yet; run the model on whole sequences")

    def logits(self, x):
        """Logits [B, S, vocab] float32 from hidden states."""
        if self.lm_head is None:
            out = self.embed_tokens.attend(x)
        else:
            out = jnp.einsum("...d,dv->...v", x.astype(self.dtype),
                             self.lm_head.kernel[...].astype(self.dtype),
                             preferred_element_type=jnp.float32)
        return constrain(out.astype(jnp.float32), self.mesh)

    def __call__(self, tokens, segment_ids=None, positions=None):
        if self.mesh is not None and self.mesh.size > 1 and not isinstance(tokens, jax.core.Tracer):
            # Called eagerly on a multi-device mesh: run the forward as one compiled program.
            # Op-by-op, each collective is its own program on 8 CPU-device threads, and XLA's CPU
            # rendezvous aborts the process when they do not all arrive within 40 s.
            return _compiled_call(self, tokens, segment_ids, positions)
        return self.logits(self.hidden_states(tokens, segment_ids, positions))

    def loss(self, tokens, targets, segment_ids=None, positions=None, *,
             loss_fn=causal_lm_loss, chunk_tokens: int = LOSS_CHUNK_TOKENS):
        """loss_fn(self(tokens, ...), targets) -> (sum, count), with the logits computed and
        differentiated chunk_tokens tokens per device at a time (basp_jax.vocab.Table.loss):
        no [tokens, vocab] float32 buffer of the whole batch exists, forward or backward."""
        weight, table = self._head_weight()
        hidden = self.hidden_states(tokens, segment_ids, positions, _table=table)
        return self._loss_of_hidden(hidden, targets, weight, loss_fn, chunk_tokens)

    def loss_and_aux(self, tokens, targets, segment_ids=None, positions=None, *,
                     loss_fn=causal_lm_loss, chunk_tokens: int = LOSS_CHUNK_TOKENS):
        """(loss sum, count) as `loss` gives them, and the load-balancing loss of the sparse
        layers' routers over every token of the batch (models.moe.load_balancing_loss; 0.0
        without sparse layers), unscaled: the trainer adds router_aux_loss_coef times it."""
        weight, table = self._head_weight()
        hidden, stats = self.hidden_and_router_stats(tokens, segment_ids, positions, _table=table)
        loss = self._loss_of_hidden(hidden, targets, weight, loss_fn, chunk_tokens)
        return (*loss, _aux_loss(stats))

    def loss_and_router_losses(self, tokens, targets, segment_ids=None, positions=None, *,
                               loss_fn=causal_lm_loss, chunk_tokens: int = LOSS_CHUNK_TOKENS):
        """(loss sum, count, the load-balancing loss, the routers' z-loss
        (models.moe.router_z_loss)): loss_and_aux's, and the z-loss beside it (0.0 without
        sparse layers); the trainer weighs them by router_aux_loss_coef and
        router_z_loss_coef."""
        weight, table = self._head_weight()
        hidden, stats = self.hidden_and_router_stats(tokens, segment_ids, positions, _table=table)
        loss = self._loss_of_hidden(hidden, targets, weight, loss_fn, chunk_tokens)
        z = jnp.zeros((), jnp.float32) if stats is None else router_z_loss(stats)
        return (*loss, _aux_loss(stats), z)

    def forward_with_aux(self, tokens, segment_ids=None, positions=None):
        """(logits as __call__ gives them, the load-balancing loss as loss_and_aux's), traced
        (call it under jit on a mesh)."""
        hidden, stats = self.hidden_and_router_stats(tokens, segment_ids, positions)
        return self.logits(hidden), _aux_loss(stats)

    def _head_weight(self):
        """(the weight the loss projects with, as the head's Table uses it; the same for the
        embedding's lookup when tied, else None)."""
        param = self.embed_tokens.weight if self.lm_head is None else self.lm_head.kernel
        # tied: one set for the lookup and the projection
        weight = self.head_table.use(param[...], self.dtype)
        return weight, weight if self.lm_head is None else None

    def loss_of_last_layer(self, x, targets, *, loss_fn=causal_lm_loss,
                           chunk_tokens: int = LOSS_CHUNK_TOKENS):
        """`loss` from the last layer's output [B, S, hidden] (the final norm, then the chunked
        loss), for a caller that runs the layers itself (train.program.streamed)."""
        weight, _ = self._head_weight()
        return self._loss_of_hidden(self.norm(x), targets, weight, loss_fn, chunk_tokens)

    def _loss_of_hidden(self, hidden, targets, weight, loss_fn, chunk_tokens):
        project = _project_tied if self.lm_head is None else _project_untied
        with jax.named_scope("loss"):
            return self.head_table.loss(
                hidden, targets, weight, functools.partial(project, dtype=self.dtype), loss_fn,
                dtype=self.dtype, chunk_tokens=chunk_tokens,
                plain_cross_entropy=loss_fn is causal_lm_loss)


def _aux_loss(stats: RouterStats | None) -> jax.Array:
    return jnp.zeros((), jnp.float32) if stats is None else load_balancing_loss(stats)


def _project_tied(x, weight, *, dtype):  # weight [vocab, embed], as Embed.attend
    return jnp.einsum("...d,vd->...v", x.astype(dtype), weight.astype(dtype),
                      preferred_element_type=jnp.float32)


def _project_untied(x, weight, *, dtype):  # weight [embed, vocab], as Transformer.logits
    return jnp.einsum("...d,dv->...v", x.astype(dtype), weight.astype(dtype),
                      preferred_element_type=jnp.float32)


def _compiled_call(model: Transformer, tokens, segment_ids, positions):
    # Token arrays placed and the logits' sharding stated: jit cannot name a sharding it infers
    # when the parameters live on a per-host mesh (basp_jax.sharding.host_mesh), a second mesh
    # over the same devices.
    graphdef, state = nnx.split(model)
    rows = basp_jax.activation_sharding(model.mesh)
    tokens, segment_ids, positions = (None if x is None else jax.device_put(x, rows)
                                      for x in (tokens, segment_ids, positions))
    logits = NamedSharding(model.mesh, activation_spec("batch", "sequence", None))
    return _forward_program(graphdef, logits)(state, tokens, segment_ids, positions)


@functools.lru_cache(maxsize=16)
def _forward_program(graphdef, logits_sharding):
    """The forward of one model structure, compiled once."""
    def forward(state, tokens, segment_ids, positions):
        return nnx.merge(graphdef, state)(tokens, segment_ids, positions)

    return jax.jit(forward, out_shardings=logits_sharding)


def abstract_model(config: ModelConfig, *, options: RunOptions | None = None,
                   **option_fields) -> Transformer:
    """The model with ShapeDtypeStructs in place of parameters (no memory, no compute)."""
    options = RunOptions.of(options, **option_fields)
    return nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), options=options))


def with_values(abstract_state, pure):
    """A copy of an abstract nnx.State holding the arrays of the pure dict `pure`."""
    state = jax.tree.map(lambda x: x, abstract_state)  # a copy to fill
    nnx.replace_by_pure_dict(state, pure)
    return state


def build_sharded(make: Callable[[], nnx.Module], rules: ShardingRules, *,
                  init_params: bool = True):
    """`make()` initialised directly onto the mesh, every parameter created already placed by
    `rules` (its logical axis names, basp_jax.sharding.RULES), so no device ever holds the whole
    model: (graphdef, (abstract params, abstract rest) nnx.States, params, rest), the last two
    pure dicts of arrays (rest: the usually empty non-parameter state, replicated).

    With init_params=False the params are ShapeDtypeStructs carrying their shardings (a restore
    target); only the non-parameter state is computed. The one builder of sharded models:
    init_model and the trainer (train.program.step.build_model) both use it.
    """
    graphdef, abs_params, abs_rest = nnx.split(nnx.eval_shape(make), nnx.Param, ...)
    pure_params, pure_rest = nnx.to_pure_dict(abs_params), nnx.to_pure_dict(abs_rest)
    param_sh = rules.shardings(param_names(abs_params), pure_params)
    rest_sh = jax.tree.map(lambda _: rules.replicated, pure_rest)

    def init():
        _, params, rest = nnx.split(make(), nnx.Param, ...)
        return (nnx.to_pure_dict(params) if init_params else None), nnx.to_pure_dict(rest)

    if not init_params and not jax.tree.leaves(abs_rest):
        params, rest = None, pure_rest  # a restore target alone: nothing to compute or compile
    else:
        params, rest = jax.jit(init, out_shardings=(param_sh if init_params else None, rest_sh))()
    if not init_params:
        params = abstract_arrays(pure_params, param_sh)
    return graphdef, (abs_params, abs_rest), params, rest


def init_model(config: ModelConfig, *, seed: int = 0, options: RunOptions | None = None,
               **option_fields) -> Transformer:
    """A randomly initialised Transformer whose parameters are created already sharded.

    With a mesh, initialisation runs under jit with out_shardings from options.rules
    (build_sharded), so no device ever holds the whole model. The values equal Transformer(config, rngs=nnx.Rngs(seed)) on one
    device (to the last ulp).
    """
    options = RunOptions.of(options, **option_fields)

    def make():
        return Transformer(config, rngs=nnx.Rngs(seed), options=options)

    if options.mesh is None:
        return make()
    graphdef, (abs_params, abs_rest), params, rest = build_sharded(make, options.rules)
    return nnx.merge(graphdef, with_values(abs_params, params), with_values(abs_rest, rest))
