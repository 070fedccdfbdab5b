"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5's hybrid layers.

    qkv = silu(causal depthwise conv(in_proj_qkv(x)))            channels [q | k | v]
    q, k = l2norm per head;  q /= sqrt(head_k_dim)
    beta = sigmoid(in_proj_b(x));  g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)   per head
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S^T_{t-1,decayed} k_t))^T,  o_t = S_t^T q_t
    out = out_proj(RMSNorm(o) * silu(in_proj_z(x)))

The delta rule has two equal forms: `gated_delta_rule_recurrent` (a scan over tokens, the
definition) and `gated_delta_rule_chunked` (a scan over chunks of CHUNK tokens with the
within-chunk work as matrix products and one triangular solve, the form that trains; as
transformers' torch_chunk_gated_delta_rule). Both compute in float32, and every decay is an exp
of a difference of cumulative log-decays that is <= 0, so nothing overflows.

Packed documents: `starts` [B, S] marks each token that begins a document; there the conv does
not look back past it and the recurrent state restarts from zero (as cu_seqlens does upstream).

On a mesh the projections, gates and the output norm are token-local and run on each device's
sequence shard; the conv and the delta rule need whole sequences, so they run inside a
shard_map after the same all-to-all as attention's (basp_jax.attention, over 'seq', inside each
group): each device then holds whole sequences for 1/sp of the heads, and a second all-to-all
returns its output to sequence shards. BASP (groups > 1) and Ulysses (one group) are the same
code. When sp does not divide the key heads but divides the value heads, q and k are repeated
to the value heads first (exact, more bytes); a layout whose sp divides neither, or a ring
(whose devices would hold parts of one sequence's recurrence), is refused when the model is
built.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from basp_jax.attention import heads_to_seq, seq_to_heads
from basp_jax.mesh import SEQ
from basp_jax.remat import name_exchange
from basp_jax.sharding import rows_spec

from .config import ModelConfig, ModelError
from .layers import Linear, constrain, param
from .options import RunOptions

CHUNK = 64  # tokens per chunk of the chunked delta rule (transformers' and fla's default)
L2NORM_EPS = 1e-6  # as fla's l2norm: x * rsqrt(sum(x^2) + eps)


def document_starts(segment_ids: jax.Array | None, batch: int, seq_len: int) -> jax.Array:
    """bool [B, S]: True where a token begins a document (the first token, and each whose
    segment id differs from the previous token's)."""
    first = jnp.zeros((batch, seq_len), bool).at[:, 0].set(True)
    if segment_ids is None:
        return first
    changed = segment_ids[:, 1:] != segment_ids[:, :-1]
    return first.at[:, 1:].set(changed)


def causal_conv(x: jax.Array, weight: jax.Array, starts: jax.Array) -> jax.Array:
    """Depthwise causal convolution: out[t] = sum_d weight[:, K-1-d] * x[t-d] over the lags d
    whose token is in t's document. x [B, S, C], weight [C, K] -> [B, S, C] (before silu)."""
    seq_len, width = x.shape[1], weight.shape[-1]
    document = jnp.cumsum(starts, axis=1)  # a token's document index within its row
    out = x * weight[:, width - 1]
    for lag in range(1, width):
        earlier = jnp.pad(x, ((0, 0), (lag, 0), (0, 0)))[:, :seq_len]
        earlier_doc = jnp.pad(document, ((0, 0), (lag, 0)), constant_values=-1)[:, :seq_len]
        same = (earlier_doc == document)[..., None]
        out = out + jnp.where(same, earlier, 0) * weight[:, width - 1 - lag]
    return out


def _l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def _prepare(q, k, v, g, beta):
    """float32 [B, H, S, D] (q, k normalised and repeated to the value heads, q scaled) and
    [B, H, S] (g, beta)."""
    repeats = v.shape[2] // k.shape[2]  # each q/k head serves `repeats` consecutive value heads
    q, k = (jnp.repeat(t, repeats, axis=2) for t in (q, k))
    q, k, v, g, beta = (t.astype(jnp.float32) for t in (q, k, v, g, beta))
    q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    q, k, v = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))
    return q, k, v, jnp.swapaxes(g, 1, 2), jnp.swapaxes(beta, 1, 2)


def gated_delta_rule_recurrent(q, k, v, g, beta, starts):
    """The gated delta rule token by token. q, k [B, S, Hk, Dk], v [B, S, Hv, Dv], g (log
    decay, <= 0) and beta [B, S, Hv], starts bool [B, S]. Returns [B, S, Hv, Dv] in v's dtype."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, _, dk = k.shape
    state = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32)

    def step(state, token):
        q_t, k_t, v_t, g_t, beta_t, start_t = token
        decay = jnp.where(start_t[:, None], 0.0, jnp.exp(g_t))  # a document start forgets
        state = state * decay[..., None, None]
        remembered = jnp.einsum("bhkv,bhk->bhv", state, k_t)
        delta = (v_t - remembered) * beta_t[..., None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        return state, jnp.einsum("bhkv,bhk->bhv", state, q_t)

    tokens = tuple(jnp.moveaxis(t, 2, 0) for t in (q, k, v, g, beta)) + (starts.T,)
    _, out = jax.lax.scan(step, state, tokens)  # [S, B, H, Dv]
    return jnp.transpose(out, (1, 0, 2, 3)).astype(dtype)


def _chunks(x, chunk, pad):
    """[B, H, S, ...] -> [B, H, N, chunk, ...], the sequence zero-padded by `pad`."""
    widths = [(0, 0)] * x.ndim
    widths[2] = (0, pad)
    x = jnp.pad(x, widths)
    return x.reshape(*x.shape[:2], -1, chunk, *x.shape[3:])


def _diagonal_blocks(x, size):
    """[..., n, n] -> [..., n // size, size, size]: the blocks of `size` on x's diagonal."""
    count = x.shape[-1] // size
    blocks = x.reshape(*x.shape[:-2], count, size, count, size)
    return jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)


def unit_lower_inverse(system: jax.Array) -> jax.Array:
    """The inverse of unit-lower-triangular matrices [..., n, n], in matrix products only.

    Blocked forward substitution, bottom up: with the inverses of the two diagonal halves A and D
    of a block [[A, 0], [C, D]] known, its inverse is [[A^-1, 0], [-D^-1 C A^-1, D^-1]]; log2(n)
    levels of batched products. It replaces LAPACK's triangular solve, whose batched CPU kernel
    waits forever on a pool thread when several emulated CPU devices run it at once, and which
    runs as many tiny solves on a GPU. n is padded to a power of two with the identity."""
    n = system.shape[-1]
    size = 1 << (n - 1).bit_length()
    if size != n:
        widths = [(0, 0)] * (system.ndim - 2) + [(0, size - n), (0, size - n)]
        system = jnp.pad(system, widths) + jnp.diag(jnp.arange(size) >= n).astype(system.dtype)
    inverses = jnp.ones((*system.shape[:-2], size, 1, 1), system.dtype)  # unit diagonal
    half = 1
    while half < size:
        lower = _diagonal_blocks(system, 2 * half)[..., half:, :half]  # C of each pair
        first, second = inverses[..., 0::2, :, :], inverses[..., 1::2, :, :]  # A^-1, D^-1
        corner = -(second @ lower @ first)
        top = jnp.concatenate([first, jnp.zeros_like(first)], axis=-1)
        bottom = jnp.concatenate([corner, second], axis=-1)
        inverses = jnp.concatenate([top, bottom], axis=-2)
        half *= 2
    return inverses[..., 0, :n, :n]


def gated_delta_rule_chunked(q, k, v, g, beta, starts, chunk: int = CHUNK):
    """gated_delta_rule_recurrent computed a chunk of tokens at a time (same arguments).

    Within a chunk, position i sees j <= i with decay exp(c_i - c_j) (c: the cumulative log
    decay in the chunk) when no document starts in (j, i]; the WY form turns the chunk's delta
    updates into one unit-lower-triangular solve. Across chunks a scan carries the state."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    seq_len = q.shape[2]
    pad = (-seq_len) % chunk
    q, k, v = (_chunks(t, chunk, pad) for t in (q, k, v))  # [B, H, N, C, D]
    g, beta = (_chunks(t, chunk, pad) for t in (g, beta))  # [B, H, N, C]
    # documents begun so far in each chunk, per position: equal counts = no start between
    begun = _chunks(starts[:, None].astype(jnp.int32), chunk, pad)  # [B, 1, N, C]
    begun = jnp.cumsum(begun, axis=-1)
    c = jnp.cumsum(g, axis=-1)

    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    linked = causal & (begun[..., :, None] == begun[..., None, :])  # i sees j
    decay = jnp.exp(jnp.where(linked, c[..., :, None] - c[..., None, :], -jnp.inf))
    from_start = jnp.where(begun == 0, jnp.exp(c), 0.0)  # decay since the chunk began
    last_c, last_begun = c[..., -1:], begun[..., -1:]
    to_end = jnp.where(begun == last_begun, jnp.exp(last_c - c), 0.0)  # decay to the chunk's end
    chunk_decay = jnp.where(last_begun[..., 0] == 0, jnp.exp(last_c[..., 0]), 0.0)  # [B, H, N]

    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    interactions = jnp.einsum("...id,...jd->...ij", k_beta, k) * decay
    inverse = unit_lower_inverse(jnp.tril(interactions, -1) + jnp.eye(chunk, dtype=jnp.float32))
    new_values = inverse @ v_beta
    k_read = inverse @ (k_beta * from_start[..., None])
    attn = jnp.einsum("...id,...jd->...ij", q, k) * decay
    q_read = q * from_start[..., None]
    k_write = k * to_end[..., None]

    b, h, _, _, dk = k.shape
    state = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32)

    def step(state, block):
        new_values, k_read, q_read, k_write, attn, chunk_decay = block
        v_new = new_values - jnp.einsum("bhcd,bhdv->bhcv", k_read, state)
        out = jnp.einsum("bhcd,bhdv->bhcv", q_read, state) + jnp.einsum("bhij,bhjv->bhiv", attn,
                                                                          v_new)
        state = state * chunk_decay[..., None, None] + jnp.einsum("bhcd,bhcv->bhdv", k_write,
                                                                   v_new)
        return state, out

    blocks = tuple(jnp.moveaxis(t, 2, 0) for t in (new_values, k_read, q_read, k_write, attn,
                                                    chunk_decay))
    _, out = jax.lax.scan(step, state, blocks)  # [N, B, H, C, Dv]
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, -1, v.shape[-1])[:, :, :seq_len]
    return jnp.swapaxes(out, 1, 2).astype(dtype)


def _whole_sequence_mix(q, k, v, g, beta, conv, segment_ids):
    """silu(conv) of q, k, v ([B, S, H, D], conv weights [H, D, K] each) and the chunked delta
    rule, on whole sequences (one device's rows, or its heads after the all-to-all)."""
    b, s = q.shape[:2]
    starts = document_starts(segment_ids, b, s)

    def conv_silu(x, weight):
        flat = causal_conv(x.reshape(b, s, -1), weight.reshape(-1, weight.shape[-1]), starts)
        return jax.nn.silu(flat).reshape(x.shape)

    q, k, v = (conv_silu(x, w) for x, w in zip((q, k, v), conv))
    return gated_delta_rule_chunked(q, k, v, g, beta, starts)


def _heads_slice(weight, sp):
    """This device's heads [H / sp, ...] of a weight [H, ...] all devices hold (the heads
    seq_to_heads gave it: the r-th block along 'seq')."""
    if sp == 1:
        return weight
    per_device = weight.shape[0] // sp
    return lax.dynamic_slice_in_dim(weight, lax.axis_index(SEQ) * per_device, per_device, axis=0)


def _check_layout(config: ModelConfig, options: RunOptions, sp: int) -> None:
    """What the linear layers need of a layout, before anything compiles: no ring, and sp
    dividing the key heads or, with q and k repeated, the value heads."""
    layout = options.layout
    if layout is not None and layout.ring > 1:
        raise ModelError(
            f"linear_attention layers need whole sequences on a device after the all-to-all; "
            f"parallel.ring={layout.ring} splits them: use ring=1")
    heads = config.linear_num_value_heads
    if sp > 1 and heads % sp:
        raise ModelError(
            f"linear_num_value_heads={heads} is not divisible by the layout's sp={sp}; use a "
            f"layout whose seq degree divides it (e.g. sp="
            f"{max(d for d in range(1, sp) if heads % d == 0)})")


class GatedRMSNorm(nnx.Module):
    """RMSNorm(x) * weight * silu(gate), over the last axis, in float32 (Qwen3_5RMSNormGated)."""

    def __init__(self, features: int, names: tuple[str | None], *, eps: float, dtype, param_dtype):
        self.weight = param(jnp.ones((features,), param_dtype), names)
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x, gate):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        out = self.weight[...].astype(jnp.float32) * x32 * jax.nn.silu(gate.astype(jnp.float32))
        return out.astype(self.dtype)


class DepthwiseConv(nnx.Module):
    """The causal depthwise conv's weight, stored as Hugging Face's Conv1d [channels, 1, K]
    (GatedDeltaNet applies it per head: causal_conv)."""

    def __init__(self, channels: int, width: int, *, rngs: nnx.Rngs, param_dtype):
        bound = width ** -0.5  # torch's Conv1d default: fan_in = K for a depthwise conv
        weight = jax.random.uniform(rngs.params(), (channels, 1, width), param_dtype, -bound, bound)
        self.weight = param(weight, ("q_heads", None, None))


class GatedDeltaNet(nnx.Module):
    """Qwen3.5's linear-attention mixer; attribute names as Hugging Face's Qwen3_5GatedDeltaNet.

    Logical axes reuse the attention's: the input projections as q_proj ('qkv_embed' in, a whole
    'q_heads' out), out_proj as o_proj, the per-head vectors and conv channels whole."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, options: RunOptions):
        d = config.hidden_size
        nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        dtype, param_dtype = options.dtype, options.param_dtype
        kw = dict(use_bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                  init_std=config.initializer_range)
        self.key_dim, self.value_dim = nk * dk, nv * dv
        self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim = nk, nv, dk, dv
        conv_dim = 2 * self.key_dim + self.value_dim
        # FP8 (options.fp8) for the wide projections; beta's and the decay's [d, heads] ones stay
        # in dtype: a sliver of the FLOPs, and they feed the gates the recurrence compounds
        fp8 = dict(kw, fp8=options.fp8)
        self.in_proj_qkv = Linear(d, conv_dim, ("qkv_embed", "q_heads"), **fp8)
        self.in_proj_z = Linear(d, self.value_dim, ("qkv_embed", "q_heads"), **fp8)
        self.in_proj_b = Linear(d, nv, ("qkv_embed", "q_heads"), **kw)
        self.in_proj_a = Linear(d, nv, ("qkv_embed", "q_heads"), **kw)
        self.conv1d = DepthwiseConv(conv_dim, config.linear_conv_kernel_dim, rngs=rngs,
                                    param_dtype=param_dtype)
        self.dt_bias = param(jnp.ones((nv,), param_dtype), ("q_heads",))
        # A in [1, 16): the decay rates of transformers' init (its lower bound 0.01 kept > 0)
        a = jax.random.uniform(rngs.params(), (nv,), jnp.float32, 1.0, 16.0)
        self.A_log = param(jnp.log(a).astype(param_dtype), ("q_heads",))
        self.norm = GatedRMSNorm(dv, ("head_dim",), eps=config.rms_norm_eps, dtype=dtype,
                                 param_dtype=param_dtype)
        self.out_proj = Linear(self.value_dim, d, ("o_heads", "embed"), **fp8)
        self.dtype = dtype
        self.mesh = options.mesh
        self.sp = 1 if options.mesh is None else options.mesh.shape[SEQ]
        self.expand_keys = self.sp > 1 and nk % self.sp != 0  # (checked: then sp divides nv)
        _check_layout(config, options, self.sp)

    @property
    def output_projection(self) -> Linear:
        return self.out_proj

    def mix(self, x, positions, segment_ids):
        """[B, S, value_dim]: the gated, normalised delta-rule output before out_proj.
        (positions are unused: the conv and the recurrence order the tokens.)"""
        del positions
        b, s, _ = x.shape
        # q, k, v before the conv: the conv is per channel, so it runs on each head's own
        qkv = self.in_proj_qkv(x)
        q, k, v = jnp.split(qkv, [self.key_dim, 2 * self.key_dim], axis=-1)
        q = q.reshape(b, s, self.num_k_heads, self.head_k_dim)
        k = k.reshape(b, s, self.num_k_heads, self.head_k_dim)
        v = v.reshape(b, s, self.num_v_heads, self.head_v_dim)
        beta = jax.nn.sigmoid(self.in_proj_b(x).astype(jnp.float32))
        a = self.in_proj_a(x).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a)
        conv = self.conv1d.weight[...][:, 0].astype(x.dtype)  # [conv_dim, K]
        conv_q, conv_k, conv_v = jnp.split(conv, [self.key_dim, 2 * self.key_dim])
        conv_q, conv_k = (w.reshape(self.num_k_heads, self.head_k_dim, -1) for w in (conv_q,
                                                                                     conv_k))
        conv_v = conv_v.reshape(self.num_v_heads, self.head_v_dim, -1)
        if self.expand_keys:  # each value head its own copy of its key head
            repeats = self.num_v_heads // self.num_k_heads
            q, k, conv_q, conv_k = (jnp.repeat(t, repeats, axis=2 if t.ndim == 4 else 0)
                                    for t in (q, k, conv_q, conv_k))
        out = self._sequence_mix(q, k, v, g, beta, (conv_q, conv_k, conv_v), segment_ids)
        z = self.in_proj_z(x).reshape(b, s, self.num_v_heads, self.head_v_dim)
        return self.norm(out, z).reshape(b, s, self.value_dim)

    def _sequence_mix(self, q, k, v, g, beta, conv, segment_ids):
        """conv + silu and the delta rule over whole sequences: [B, S, Hv, Dv] float32-exact
        in the compute dtype; on a mesh, inside a shard_map between two all-to-alls."""
        if self.mesh is None:
            return _whole_sequence_mix(q, k, v, g, beta, conv, segment_ids)
        sp = self.sp

        def local(q, k, v, g, beta, conv, seg):
            q, k, v = (seq_to_heads(t, sp) for t in (q, k, v))
            g, beta = (seq_to_heads(t[..., None], sp)[..., 0] for t in (g, beta))
            conv = tuple(_heads_slice(w, sp) for w in conv)
            if seg is not None and sp > 1:
                seg = name_exchange(lax.all_gather(seg, SEQ, axis=1, tiled=True), kv=True)
            return heads_to_seq(_whole_sequence_mix(q, k, v, g, beta, conv, seg), sp)

        q, k, v, g, beta = (constrain(t, self.mesh) for t in (q, k, v, g, beta))
        rows = rows_spec()
        seg_spec = None if segment_ids is None else rows
        sharded = jax.shard_map(
            local, mesh=self.mesh,
            in_specs=(rows,) * 5 + ((jax.sharding.PartitionSpec(),) * 3, seg_spec),
            out_specs=rows, check_vma=False)
        return constrain(sharded(q, k, v, g, beta, conv, segment_ids), self.mesh)

    def __call__(self, x, positions, segment_ids):
        return self.out_proj(self.mix(x, positions, segment_ids))
