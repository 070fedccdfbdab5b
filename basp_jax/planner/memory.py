"""The fitted memory model: peak device memory of a train step by term, the pinned host memory
an offload policy or a strategy's host-local copy fills, and what a parameter strategy keeps per
device."""

from __future__ import annotations

from ..layout import Layout
from ..remat import REMAT_POLICIES
from ..sharding import PARAM_SHARDINGS, sums_per_host
from .precisions import Precisions
from .shape import ModelShape

# Factors fitted to compiled GPU programs: which buffers XLA keeps alive at the peak cannot be
# counted from the model alone, so each term is a count of values times a factor. Fitted jointly,
# they trade off against each other: read them as a fit, not as counts of buffers. The programs
# and figures of each fit: BENCHMARKS.md section 6, "Fit history".
_GRADIENT_BUFFERS = 0.85  # the float32 gradient and what the update holds beside it
# With several microbatches: the float32 sum and the microbatch's gradient beside it
_ACCUMULATE_BUFFERS = 2.0
# Where each host keeps its own sum (train.program.per_group): one float32 sum split over a
# host's devices (the microbatch's gradient is the compute-dtype copies')
_HOST_SUM_BUFFERS = 1.0
_SAVED_SHARE = 0.55  # of _saved_per_token that XLA keeps
_WORKING_FACTOR = 2.95  # a layer's recompute, its gathered weights and the chunked loss's buffers
# A tiled layer (models.tiling, tile_tokens) keeps per token only what attention needs whole: the
# layer input and the residual stream's gradient (hidden width), and q, k, v and the output on
# both sides of the all-to-alls with their gradients (the exchanged heads' width, padded heads
# included).
_TILED_WORKING_HIDDENS = 8.55  # values of hidden width per token
_TILED_WORKING_EXCHANGED = 0.64  # per value of q, k, v and output as exchanged
# The ring attention's working set (the query pieces, output and its cotangent, every ring step's
# k/v chunk, one float32 running sum and one hop's outputs at a time: basp_jax.ring), per float32
# query-sized buffer per step and piece. Rounded up: the factor just below it puts a step that
# does not fit under the limit.
_RING_WORKING = 0.38
# A sparse layer's routed (token, expert) rows (models.moe: the group's pairs on each device
# where the experts are split over it): values of the rows' input, gate, up, their product and
# output (hidden x 2 + moe_intermediate x 3) per row, forward and backward.
_ROUTED_FACTOR = 3.4  # fitted: Qwen3-30B-A3B under BASP and Ulysses (BENCHMARKS.md section 6)
# The streamed step's working set (train.program.streamed, optimizer.offload) as a share of the
# `working` term: it gathers no weights.
_STREAMED_WORKING_SHARE = 0.78


def state_bytes_per_param(master: int, moments: int | None) -> int:
    """Master weight and Adam's second moment in the master dtype, first moment in its own
    (None: the master dtype)."""
    return 2 * master + (moments or master)


def memory_terms(shape: ModelShape, tokens_per_device: float, shard_group: int, *,
                 q_heads: int, kv_heads: int, remat: str = "full",
                 precisions: Precisions = Precisions(), tile_tokens: int | None = None,
                 ring: int = 1, zigzag: bool = False, offload_state: bool = False,
                 kept_share: float = 0.0, grad_accum: int = 1,
                 host_sums: int | None = None,
                 step_copies: float = 0.0, expert_split: int = 1) -> dict[str, float]:
    """Peak memory per device of a train step (layers under a scan, chunked loss), by term
    (a hybrid's layers scanned by period as models.transformer runs them; run as a list,
    model.scan_layers=false, XLA holds several layers' recomputed outputs beyond this):

    - state: parameters and Adam's second moment in the master dtype, its first moment in
      precisions.moments (default: the master dtype), over the devices that shard them (exactly
      the compiled program's arguments);
    - grads: the float32 gradient sum and the update's working copy, sharded alike;
    - saved: what the backward pass keeps of every layer (by remat policy, _saved_per_token;
      a hybrid's Gated DeltaNet layers their own tensors, _linear_tensor_widths);
    - working: one layer being recomputed and differentiated (_working_bytes);
    - ring (ring > 1): the ring attention's working set (_ring_bytes);
    - kept: the layers' weights in the compute dtype that the forward keeps for the backward,
      kept_share of them per device (staged_keep: 1/devices per host, its host-local copies),
      plus step_copies bytes (step_copy_bytes: the copies a step that keeps each host's
      gradient sum holds beyond those).
    - routed (mixtures of experts): one sparse layer's (token, expert) rows, expert_split x
      the device's tokens x top-k of them where the experts are split over expert_split
      devices (ModelShape.expert_split; _ROUTED_FACTOR);
    - accumulate (grad_accum > 1): the float32 gradient sum of the microbatches and the
      microbatch's gradient beside it, sharded as the parameters (_ACCUMULATE_BUFFERS: with
      one microbatch XLA folds the sum away); where each host keeps its own sum
      (host_sums: the devices of a host, host_sum_devices), that sum split over them
      (_HOST_SUM_BUFFERS).
    The last five carry factors fitted to compiled programs (above). What an offload policy
    keeps in host memory is host_memory_bytes, not a term here. With offload_state (the
    streamed step) the state is in host memory, the gradient is the layers' in the compute
    dtype, nothing is saved on the device, and the working set is _STREAMED_WORKING_SHARE of
    the same term.
    """
    p, act = shape.num_params, precisions.act
    per_token = _saved_per_token(shape, remat, q_heads, kv_heads)
    # a hybrid's Gated DeltaNet layers keep their own exchanged tensors
    saved_per_token = (shape.attention_layers * per_token
                       + shape.linear_layers * _linear_saved_per_token(shape, remat))
    working = _working_bytes(shape, tokens_per_device, q_heads, kv_heads, act, tile_tokens,
                             expert_split)
    routed = (_ROUTED_FACTOR * expert_split * tokens_per_device * shape.num_experts_per_tok
              * (2 * shape.hidden_size + 3 * shape.moe_intermediate_size) * act)
    ring_working = _ring_bytes(shape, tokens_per_device, q_heads, ring, zigzag)
    if offload_state:
        return {"ring": ring_working, "state": 0.0, "routed": routed,
                "grads": shape.num_layers * shape.layer_params * act / shard_group,
                "saved": 0.0, "working": _STREAMED_WORKING_SHARE * working}
    per_param = state_bytes_per_param(precisions.master, precisions.moments)
    return {
        "ring": ring_working,
        "state": p * per_param / shard_group,
        "grads": _GRADIENT_BUFFERS * p * 4 / shard_group,
        "saved": _SAVED_SHARE * tokens_per_device * saved_per_token * act,
        "working": working,
        "routed": routed,
        "kept": kept_share * act * _layer_weights(shape) + step_copies,
        "accumulate": 0.0 if grad_accum < 2 else (
            _HOST_SUM_BUFFERS * p * 4 / host_sums if host_sums
            else _ACCUMULATE_BUFFERS * p * 4 / shard_group),
    }


def memory_bytes(*args, **kwargs) -> float:
    """The sum of memory_terms (same arguments)."""
    return sum(memory_terms(*args, **kwargs).values())


def _working_bytes(shape: ModelShape, tokens_per_device: float, q_heads: int, kv_heads: int,
                   act_bytes: int, tile_tokens: int | None, expert_split: int = 1) -> float:
    """memory_terms' working: one layer being recomputed and differentiated (its gathered
    weights, twice, and ~ (hidden x 6 + intermediate x 4) values per token), with what the loss
    holds; with tile_tokens the intermediate's share is one chunk's and the per-token share the
    attention's whole-shard tensors (_TILED_WORKING_HIDDENS, _TILED_WORKING_EXCHANGED). Of a
    hybrid's two kinds of layer, the larger is the one being recomputed at the peak."""
    layer_params = max(_used_layer_params(shape, expert_split),
                       shape.linear_layer_params if shape.linear_layers else 0)
    inter = _dense_intermediate(shape)
    if tile_tokens is None:
        layer_per_token = 6 * shape.hidden_size + 4 * inter
        return _WORKING_FACTOR * act_bytes * (
            2 * layer_params + tokens_per_device * layer_per_token)
    exchanged = (2 * q_heads + 2 * kv_heads) * shape.head_dim
    chunk = min(tile_tokens, tokens_per_device)
    return act_bytes * (
        _WORKING_FACTOR * (2 * layer_params + chunk * 4 * inter)
        + tokens_per_device * (_TILED_WORKING_HIDDENS * shape.hidden_size
                               + _TILED_WORKING_EXCHANGED * exchanged))


def _dense_intermediate(shape: ModelShape) -> int:
    """The dense MLPs' width where a layer has one (a model whose every MLP is sparse: 0; its
    experts' rows are memory_terms' routed)."""
    return shape.intermediate_size if shape.sparse_layers < shape.num_layers else 0


def _used_layer_params(shape: ModelShape, expert_split: int) -> float:
    """The largest attention layer's parameters as one device uses them: a sparse layer's
    experts split over expert_split devices."""
    if not shape.sparse_layers:
        return shape.layer_params
    dense_mlp = 3 * shape.hidden_size * shape.intermediate_size
    shared = 3 * shape.hidden_size * shape.shared_expert_intermediate_size  # whole on each
    sparse = (shape.layer_params - dense_mlp + shared
              + (shape.sparse_mlp_params - shared) / expert_split)
    return max(sparse, shape.layer_params if shape.sparse_layers < shape.num_layers else 0)


def _ring_bytes(shape: ModelShape, tokens_per_device: float, q_heads: int, ring: int,
                zigzag: bool) -> float:
    """memory_terms' ring: the ring attention's working set, in float32 buffers the size of the
    device's queries per ring step and query piece (2 pieces in zig-zag order; _RING_WORKING)."""
    if ring == 1:
        return 0.0
    pieces = 2 if zigzag else 1
    return _RING_WORKING * ring * pieces * tokens_per_device * q_heads * shape.head_dim * 4


def host_memory_bytes(shape: ModelShape, tokens_per_device: float, *, q_heads: int,
                      kv_heads: int, remat: str,
                      precisions: Precisions = Precisions()) -> float:
    """Pinned host memory per device that an offload policy fills per step (0 for the others):
    every layer's offloaded residuals, copied there forward and back backward."""
    return (shape.num_layers * tokens_per_device * precisions.act
            * _offloaded_per_token(shape, remat, q_heads, kv_heads))
def _tensor_widths(shape: ModelShape, q_heads: int, kv_heads: int) -> dict[str, float]:
    """Values per token per layer of each tensor a remat policy may keep (basp_jax.remat.TENSORS),
    in units of the compute dtype, with the exchanged (padded, replicated) heads."""
    hd, hidden, inter = shape.head_dim, shape.hidden_size, shape.intermediate_size
    return {"input": hidden,
            "exchanged": (2 * q_heads + 2 * kv_heads) * hd,
            "exchanged_kv": 2 * kv_heads * hd,
            "projections": (q_heads + 2 * kv_heads) * hd + 2 * hidden + 3 * inter,
            "elementwise": 2 * hidden + 2 * inter}


def _linear_tensor_widths(shape: ModelShape) -> dict[str, float]:
    """_tensor_widths of a hybrid's Gated DeltaNet layer (models.linear_attention): its exchanged
    q, k, v and output, and the float32 gates and decays (two values of the compute dtype each);
    its projections qkv, z, beta and decay. (Where the layout's sp does not divide the key heads,
    q and k are repeated to the value heads: not counted.)"""
    hidden, inter, heads = shape.hidden_size, shape.intermediate_size, shape.linear_num_value_heads
    key_dim = shape.linear_num_key_heads * shape.linear_key_head_dim
    value_dim = heads * shape.linear_value_head_dim
    return {"input": hidden,
            "exchanged": 2 * key_dim + 2 * value_dim + 2 * 2 * heads,
            # its exchanges are not named k/v apart (basp_jax.remat): full_kv keeps none of them
            "exchanged_kv": 0,
            "projections": 2 * key_dim + 2 * value_dim + 2 * heads + 2 * hidden + 3 * inter,
            "elementwise": 2 * hidden + 2 * inter}


def _linear_saved_per_token(shape: ModelShape, remat: str) -> float:
    """_saved_per_token of a Gated DeltaNet layer."""
    widths = _linear_tensor_widths(shape)
    return sum(widths[t] for t in REMAT_POLICIES.get(remat).saves)


def _saved_per_token(shape: ModelShape, remat: str, q_heads: int, kv_heads: int) -> float:
    """Values per token per layer the backward pass keeps on the device under a remat policy
    (basp_jax.remat.REMAT_POLICIES: its `saves`; the offload policies keep nothing there)."""
    widths = _tensor_widths(shape, q_heads, kv_heads)
    return sum(widths[t] for t in REMAT_POLICIES.get(remat).saves)


def _offloaded_per_token(shape: ModelShape, remat: str, q_heads: int, kv_heads: int) -> float:
    """Values per token per layer in host memory (the policy's `offloads`): the layer input,
    and with offload_exchanges attention's exchanged q, k, v and output."""
    widths = _tensor_widths(shape, q_heads, kv_heads)
    return sum(widths[t] for t in REMAT_POLICIES.get(remat).offloads)




def shard_devices(layout: Layout, param_sharding: str) -> int:
    """How many devices share (shard) each parameter under a strategy."""
    return PARAM_SHARDINGS.get(param_sharding).shard_devices(layout)


def kept_share(layout: Layout, param_sharding: str, *, offloaded: bool = False) -> float:
    """The share of the layers' weights each device keeps from forward to backward under a
    strategy (memory_terms' kept): a staged strategy's host-local copy when it keeps it on the
    device (ParamUse copy="device"); offloaded: in pinned host memory (copy="host") instead."""
    strategy = PARAM_SHARDINGS.get(param_sharding)
    if strategy.use.copy != ("host" if offloaded else "device"):
        return 0.0
    return 1.0 / min(layout.devices_per_host, layout.num_devices)


def host_sum_devices(layout: Layout, param_sharding: str, grad_accum: int) -> int | None:
    """The devices of a host, where a step keeps each host's float32 gradient sum split over
    them (basp_jax.sharding.sums_per_host; memory_terms' host_sums), else None."""
    if grad_accum > 1 and sums_per_host(param_sharding, layout, grad_accum):
        return min(layout.devices_per_host, layout.num_devices)
    return None


def step_copy_bytes(shape: ModelShape, layout: Layout, param_sharding: str, grad_accum: int,
                    precisions: Precisions = Precisions()) -> float:
    """Device memory a step that keeps each host's gradient sum (basp_jax.sharding.sums_per_host)
    holds for its host-local copies in the compute dtype, 1/devices per host of each, beyond
    what the strategy keeps anyway (kept_share): host sharding's whole model, staged_keep's
    vocabulary tables; 0 elsewhere."""
    if host_sum_devices(layout, param_sharding, grad_accum) is None:  # (one microbatch: folded)
        return 0.0
    dph = min(layout.devices_per_host, layout.num_devices)
    copied = shape.num_params - kept_share(layout, param_sharding) * dph * _layer_weights(shape)
    return precisions.act * copied / dph


def host_copy_bytes(shape: ModelShape, layout: Layout, param_sharding: str,
                    precisions: Precisions = Precisions()) -> float:
    """Pinned host memory per device that a strategy keeping its host-local copy there fills
    (staged_offload: 1/devices per host of the layers in the compute dtype; 0 for the others),
    copied there forward and back backward once per microbatch."""
    return (kept_share(layout, param_sharding, offloaded=True) * precisions.act
            * _layer_weights(shape))


def _layer_weights(shape: ModelShape) -> float:
    """The layers' parameters: every one but the tables and the final norm."""
    return shape.num_params - shape.embedding_params - shape.hidden_size
