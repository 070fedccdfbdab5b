"""Decoder building blocks: Linear, Embed, RMSNorm, RoPE (incl. llama3 scaling), SwiGLU, attention.

Parameters are stored in `param_dtype` and cast to the compute `dtype` at use. Every nnx.Param carries
logical axis names (`out_sharding` metadata), the keys of basp_jax.sharding.RULES, which place it on
a mesh (param_names, basp_jax.sharding.ShardingRules); nothing here reaches for a global mesh.
Attribute names follow Hugging Face's so the checkpoint mapping is mechanical (see models/hf.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import Mesh, NamedSharding

import basp_jax
from basp_jax import kernels as basp_kernels
from basp_jax.attention import ATTENTION_SCOPE
from basp_jax.sharding import ShardingRules, activation_spec
from basp_jax.vocab import Table

from .config import ModelConfig
from .fp8 import fp8_matmul
from .options import RunOptions


def param(value: jax.Array, names: tuple[str, ...]) -> nnx.Param:
    """An nnx.Param with logical axis names and no eager placement (there is no global mesh)."""
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def axis_names(variable: nnx.Variable) -> tuple[str, ...]:
    """The logical axis names of a parameter (a stacked layer's begin with 'layers')."""
    return tuple(variable.get_metadata()["out_sharding"])


def param_names(state: nnx.State) -> dict:
    """The logical axis names of every parameter of `state`, as a pure dict like
    nnx.to_pure_dict(state) with a tuple of names for each array."""
    flat = [(tuple(path), axis_names(v)) for path, v in nnx.to_flat_state(state)]
    return traverse_util.unflatten_dict(dict(flat))


def constrain(x: jax.Array, mesh: Mesh | None) -> jax.Array:
    """Constrain [B, S, ...] activations to rows over groups, sequence over a group (no-op
    without a mesh)."""
    if mesh is None:
        return x
    spec = activation_spec("batch", "sequence", *([None] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel [in, out] (Hugging Face stores the transpose, [out, in]).
    fp8: the product as an FP8 matmul (models.fp8; the bias is added in `dtype`)."""

    def __init__(self, in_features: int, out_features: int, names: tuple[str | None, str | None], *,
                 use_bias: bool, rngs: nnx.Rngs, dtype, param_dtype, init_std: float,
                 fp8: bool = False):
        self.kernel = param(
            init_std * jax.random.normal(rngs.params(), (in_features, out_features), param_dtype),
            names,
        )
        self.bias = param(jnp.zeros((out_features,), param_dtype), (names[1],)) if use_bias else None
        self.dtype = dtype
        self.fp8 = fp8

    def __call__(self, x: jax.Array) -> jax.Array:
        x, kernel = x.astype(self.dtype), self.kernel[...].astype(self.dtype)
        y = fp8_matmul(x, kernel) if self.fp8 else jnp.einsum("...i,io->...o", x, kernel)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class Embed(nnx.Module):
    """Token embedding table [vocab, embed]; `attend` reuses it as the output projection (tied).

    `rules` (basp_jax.sharding.ShardingRules, with a mesh) says where the table is stored and so
    how the lookup runs: `table`, a basp_jax.vocab.Table, asks the parameter strategy.
    """

    def __init__(self, vocab: int, features: int, *, rngs: nnx.Rngs, dtype, param_dtype,
                 init_std: float, rules: ShardingRules | None = None,
                 vocab_parallel_mode: str = "auto", tied: bool = False):
        self.weight = param(
            init_std * jax.random.normal(rngs.params(), (vocab, features), param_dtype),
            ("vocab", "embed"),
        )
        self.dtype = dtype
        self.table = Table(axis_names(self.weight), self.weight.shape, rules,
                           mode=vocab_parallel_mode, tied=tied)

    def __call__(self, tokens: jax.Array, copies: jax.Array | None = None) -> jax.Array:
        """The rows [B, S, embed] of tokens [B, S]; copies: the table as Table.use gave it to a
        tied head, so both uses share it (default: the weight's own)."""
        table = self.table.use(self.weight[...], self.dtype) if copies is None else copies
        return self.table.lookup(table, tokens, dtype=self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits [..., vocab] in float32 from hidden states [..., embed]."""
        return jnp.einsum("...d,vd->...v", x.astype(self.dtype), self.weight[...].astype(self.dtype),
                          preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
    """x / rms(x) * weight, normalised in float32 and cast back (as transformers does).

    zero_centered (Qwen3.5): the weight is stored as its offset from one, initialised to zeros,
    and the scale (1 + weight) is applied in float32 before the cast (as Qwen3_5RMSNorm)."""

    def __init__(self, features: int, names: tuple[str | None], *, eps: float, dtype, param_dtype,
                 zero_centered: bool = False):
        init = jnp.zeros if zero_centered else jnp.ones
        self.weight = param(init((features,), param_dtype), names)
        self.eps = eps
        self.dtype = dtype
        self.zero_centered = zero_centered

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.zero_centered:
            return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(self.dtype)
        return self.weight[...].astype(self.dtype) * x32.astype(self.dtype)


def rms_norm(features: int, names: tuple[str | None], config: ModelConfig, options: RunOptions
             ) -> RMSNorm:
    """The config's RMSNorm over `features` (its epsilon and centring, the run's dtypes)."""
    return RMSNorm(features, names, eps=config.rms_norm_eps, dtype=options.dtype,
                   param_dtype=options.param_dtype, zero_centered=config.rms_norm_zero_centered)


# ---------------------------------------------------------------------------------------------
# Rotary position embedding


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies [rotary_dim // 2] (float32), with llama3 or linear scaling applied."""
    dim = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    inv_freq = inv_freq.astype(np.float32)
    scaling = config.rope_scaling or {}
    if config.rope_type == "linear":
        return (inv_freq / scaling["factor"]).astype(np.float32)
    if config.rope_type != "llama3":
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate x [B, S, H, Dh] by positions [B, S] (rotate-half convention, as in Hugging Face);
    with fewer frequencies than Dh / 2 (partial rotary) only the first 2 * len(inv_freq)
    channels turn, the rest pass through."""
    rotary = 2 * len(inv_freq)
    if rotary < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotary], positions, inv_freq),
                                x[..., rotary:]], axis=-1)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, S, Dh/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------------------------------------
# Attention and MLP


def local_attention(q, k, v, *, segment_ids, impl: str, document_bound: int | None = None):
    """Single-device attention through the basp_jax kernels (no mesh, no all-to-all)."""
    device = jax.devices()[0]
    capability = basp_kernels.device_capability(device)
    name = basp_kernels.resolve_impl(impl, q, q.shape[1], device.platform, segment_ids is not None,
                                     capability)
    kernel = basp_kernels.KERNELS.get(name).bind(device.platform, capability=capability,
                                                 document_bound=document_bound)
    with jax.named_scope(ATTENTION_SCOPE):  # as basp_jax.attention names it
        return kernel(q, k, v, causal=True, segment_ids=segment_ids)


class Attention(nnx.Module):
    """Grouped-query self-attention: projections, optional per-head q/k norm, RoPE, BASP attention."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, options: RunOptions):
        d, hd = config.hidden_size, config.head_dim
        hq, hkv = config.num_heads, config.num_kv_heads
        std = config.initializer_range
        dtype, param_dtype = options.dtype, options.param_dtype
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, init_std=std, fp8=options.fp8)
        # with the output gate (Qwen3.5), q_proj emits each head's query then its gate
        self.gated = config.attention_output_gate
        q_width = hq * hd * (2 if self.gated else 1)
        self.q_proj = Linear(d, q_width, ("qkv_embed", "q_heads"), use_bias=config.attention_bias, **kw)
        self.k_proj = Linear(d, hkv * hd, ("qkv_embed", "kv_heads"), use_bias=config.attention_bias, **kw)
        self.v_proj = Linear(d, hkv * hd, ("qkv_embed", "kv_heads"), use_bias=config.attention_bias, **kw)
        self.o_proj = Linear(hq * hd, d, ("o_heads", "embed"), use_bias=config.attention_out_bias, **kw)
        if config.qk_norm:
            self.q_norm = rms_norm(hd, ("head_dim",), config, options)
            self.k_norm = rms_norm(hd, ("head_dim",), config, options)
        else:
            self.q_norm = self.k_norm = None
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, hd
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(config))  # static, hashable
        self.mesh = options.mesh
        self.options = options  # kernel, and the layout's ring and token order

    def qkv(self, x, positions):
        """q [B, S, Hq, Dh], k and v [B, S, Hkv, Dh], q and k normed (Qwen3) and rotated."""
        return self.project(x, positions)[:3]

    def project(self, x, positions):
        """(q, k, v as qkv gives them, the output gate [B, S, Hq * Dh] or None)."""
        b, s, _ = x.shape
        q = self.q_proj(x).reshape(b, s, self.num_heads, -1)
        gate = None
        if self.gated:
            q, gate = jnp.split(q, 2, axis=-1)
            gate = gate.reshape(b, s, self.num_heads * self.head_dim)
        k = self.k_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = np.asarray(self.inv_freq, np.float32)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v, gate

    @property
    def output_projection(self) -> Linear:
        return self.o_proj

    def mix(self, x, positions, segment_ids):
        """The attention output [B, S, Hq * Dh] before o_proj (gated when the config says)."""
        # Global (or per-document) positions, before the all-to-all.
        q, k, v, gate = self.project(x, positions)
        return self._gate(self.attend(q, k, v, segment_ids), gate)

    def _gate(self, out, gate):
        return out if gate is None else out * jax.nn.sigmoid(gate).astype(out.dtype)

    def __call__(self, x, positions, segment_ids):
        return self.o_proj(self.mix(x, positions, segment_ids))

    def attend(self, q, k, v, segment_ids):
        """The attention of rotated q, k, v: [B, S, Hq * Dh] (before the output projection),
        through basp_jax.attention's all-to-alls on a mesh."""
        b, s = q.shape[:2]
        q, k, v = (constrain(t, self.mesh) for t in (q, k, v))
        if self.mesh is None:
            out = local_attention(q, k, v, segment_ids=segment_ids, impl=self.options.attn_impl,
                                  document_bound=self.options.document_bound)
        else:
            out = basp_jax.attention(q, k, v, mesh=self.mesh, layout=self.options.layout,
                                     causal=True, segment_ids=segment_ids,
                                     impl=self.options.attn_impl,
                                     fp8_exchange=self.options.fp8_exchange,
                                     document_bound=self.options.document_bound)
        return constrain(out.reshape(b, s, self.num_heads * self.head_dim), self.mesh)

    def decode(self, x, index, cache_k, cache_v):
        """Attention of the T tokens x [B, T, D] that follow the `index` tokens already in the
        cache (one device, no mesh): their keys and values are written into cache_k / cache_v
        [B, L, Hkv, Dh] at index..index+T-1, and each token attends causally to the cache up to
        its own position index + t (the slots beyond hold zeros and are masked out).
        Returns (output [B, T, D], cache_k, cache_v)."""
        b, t, _ = x.shape
        query_pos = index + jnp.arange(t, dtype=jnp.int32)
        q, k, v, gate = self.project(x, jnp.broadcast_to(query_pos, (b, t)))
        cache_k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), (0, index, 0, 0))
        cache_v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), (0, index, 0, 0))
        mask = jnp.arange(cache_k.shape[1])[None, :] <= query_pos[:, None]  # [T, L]
        # jax.nn.dot_product_attention runs float16 as F16_F16_F32, a dot the CPU lacks: float16
        # attends in float32 here (one device, a few tokens: the cost is small)
        dtype = jnp.float32 if q.dtype == jnp.float16 else q.dtype
        out = jax.nn.dot_product_attention(q.astype(dtype), cache_k.astype(dtype),
                                           cache_v.astype(dtype), mask=mask[None, None],
                                           implementation="xla").astype(q.dtype)
        out = self._gate(out.reshape(b, t, self.num_heads * self.head_dim), gate)
        return self.o_proj(out), cache_k, cache_v


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype,
                 fp8: bool = False, intermediate_size: int | None = None):
        d, f = config.hidden_size, intermediate_size or config.intermediate_size
        kw = dict(use_bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                  init_std=config.initializer_range, fp8=fp8)
        self.gate_proj = Linear(d, f, ("mlp_up_embed", "mlp_up"), **kw)
        self.up_proj = Linear(d, f, ("mlp_up_embed", "mlp_up"), **kw)
        self.down_proj = Linear(f, d, ("mlp_down", "embed"), **kw)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
