"""ModelConfig: the shapes and switches of one decoder, from a Hugging Face config.json or a preset.

One dataclass covers Llama 3 / 3.1 / 3.2, Qwen2 / Qwen2.5 (and Qwen1.5, which uses the qwen2 code
path), Qwen3 and the Qwen3.5 text model. The switches that distinguish the families:

    llama        rope_scaling type 'llama3', tied embeddings in 3.2-1B/3B, no biases
    qwen2        bias on q/k/v (attention_bias=True), no bias on o_proj
    qwen3        per-head RMSNorm on q and k (qk_norm=True), explicit head_dim, no biases
    qwen3_moe    qwen3's attention; the MLP of every decoder_sparse_step-th layer not in
                 mlp_only_layers is a sparse mixture of experts (models.moe): a router picks
                 num_experts_per_tok of num_experts SwiGLU experts per token
    qwen3_5_text a hybrid: `layer_types` names each layer's token mixer, 'linear_attention'
                 (Gated DeltaNet, models.linear_attention; the linear_* shapes) or
                 'full_attention' (with a sigmoid output gate, attention_output_gate=True, and
                 RoPE on the first partial_rotary_factor of each head); every RMSNorm but the
                 DeltaNet's gated one scales by (1 + weight) (rms_norm_zero_centered=True)
    qwen3_5_moe_text  the qwen3_5_text hybrid whose every MLP is sparse, with a shared expert
                 (shared_expert_intermediate_size) beside the routed ones, gated per token by a
                 sigmoid; its router always renormalises the top-k weights
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import struct
from typing import Any

from basp_jax.planner.shape import ModelShape

from . import moe_config
from .errors import ModelError
from .presets import FULL_ATTENTION, LINEAR_ATTENTION, MODEL_SHAPES, PRESET_FIELDS  # noqa: F401

log = logging.getLogger(__name__)

MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5_moe_text")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}
# The Qwen3.5 text models: the hybrid's layers and norms, dense or with sparse MLPs
QWEN3_5_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)
# Multimodal model types whose text model is one of ours: {its type: the text model's type}.
# Their checkpoints keep the text model under model.language_model. (models.safetensors_io).
MULTIMODAL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
LINEAR_SHAPE_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                       "linear_value_head_dim", "linear_conv_kernel_dim")
ROPE_TYPES = ("default", "llama3", "linear")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int  # tokens in the vocabulary (the embedding's rows)
    hidden_size: int  # the model width d
    intermediate_size: int  # the SwiGLU MLP's inner width
    num_layers: int  # decoder layers
    num_heads: int  # query heads of an attention layer
    num_kv_heads: int  # key/value heads (grouped-query attention); divide num_heads
    head_dim: int  # channels per attention head (even)
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: dict | None = None  # {'rope_type': 'llama3', 'factor': ..., ...} or None
    rms_norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_word_embeddings: bool = False  # the LM head is the embedding table
    attention_bias: bool = False  # bias on q/k/v projections
    attention_out_bias: bool = False  # bias on o_proj (llama/qwen3 attention_bias=True only)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    max_position_embeddings: int = 8192  # the context it was trained for (recorded in exports)
    model_type: str = "llama"  # one of MODEL_TYPES (qwen3_5_text: the Qwen3.5 hybrid)
    initializer_range: float = 0.02  # standard deviation of the initial weights
    bos_token_id: int | None = None  # beginning-of-sequence id (exports, generation)
    eos_token_id: int | list[int] | None = None  # end-of-sequence id(s) (exports, generation)
    # the hybrid's (Qwen3.5) token mixer per layer, a list of linear_attention / full_attention
    # (null: every layer full attention); the linear_* fields shape its Gated DeltaNet layers
    layer_types: tuple[str, ...] | None = None
    linear_num_key_heads: int = 0  # Gated DeltaNet query/key heads
    linear_num_value_heads: int = 0  # Gated DeltaNet value heads (a multiple of its key heads)
    linear_key_head_dim: int = 0  # channels per Gated DeltaNet query/key head
    linear_value_head_dim: int = 0  # channels per Gated DeltaNet value head
    linear_conv_kernel_dim: int = 4  # width of the Gated DeltaNet's causal depthwise conv
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * this channels of a head
    attention_output_gate: bool = False  # attention output * sigmoid(gate); q_proj emits the gate
    rms_norm_zero_centered: bool = False  # RMSNorm scales by (1 + weight), weight stored centred
    num_experts: int = 0  # SwiGLU experts of a sparse MLP (models.moe); 0: all dense
    num_experts_per_tok: int = 0  # experts each token goes through (top-k)
    moe_intermediate_size: int = 0  # each expert's inner width
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to one
    decoder_sparse_step: int = 1  # layer i's MLP is sparse when (i + 1) % this == 0 (1: all)
    mlp_only_layers: tuple[int, ...] = ()  # layers whose MLP stays dense whatever the step says
    router_aux_loss_coef: float = 0.001  # the load-balancing loss's weight in the training loss
    # a SwiGLU every token runs through beside its routed experts, its output scaled by
    # sigmoid(x @ shared_expert_gate) (Qwen3.5-MoE); 0: none
    shared_expert_intermediate_size: int = 0
    # the routers' z-loss weight (ST-MoE: the mean squared log-sum-exp of each token's router
    # logits; keeps the logits small). Not a Hugging Face field: set it with
    # model.shape.router_z_loss_coef; 0 leaves it out of the program
    router_z_loss_coef: float = 0.0

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ModelError(
                f"unknown model_type {self.model_type!r}; supported: {', '.join(MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ModelError(f"head_dim={self.head_dim} must be even for RoPE")
        self._check_hybrid()
        moe_config.check(self)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ModelError(
                f"rope_scaling must be a mapping (e.g. {{rope_type: llama3, factor: 8.0, ...}}) "
                f"or null, got {self.rope_scaling!r}")
        for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
            _check_positive(name, getattr(self, name))
        if not isinstance(self.max_position_embeddings, int) or \
                isinstance(self.max_position_embeddings, bool) or self.max_position_embeddings <= 0:
            raise ModelError(f"max_position_embeddings must be a positive integer, got "
                             f"{self.max_position_embeddings!r}")
        _check_token_ids("bos_token_id", self.bos_token_id, self.vocab_size, many=False)
        _check_token_ids("eos_token_id", self.eos_token_id, self.vocab_size, many=True)
        for key in ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings"):
            if key in (self.rope_scaling or {}):
                _check_positive(f"rope_scaling.{key}", self.rope_scaling[key])
        rope_type = self.rope_type
        if rope_type not in ROPE_TYPES:
            raise ModelError(
                f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )
        if rope_type == "llama3":
            missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                                   "original_max_position_embeddings") if k not in self.rope_scaling]
            if missing:
                raise ModelError(f"rope_scaling type 'llama3' lacks {', '.join(missing)}")
        if rope_type == "linear" and "factor" not in self.rope_scaling:
            raise ModelError("rope_scaling type 'linear' lacks factor")

    def _check_hybrid(self) -> None:
        """The layer types and the linear layers' shapes (Qwen3.5)."""
        _check_positive("partial_rotary_factor", self.partial_rotary_factor)
        if self.partial_rotary_factor > 1 or self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ModelError(
                f"partial_rotary_factor={self.partial_rotary_factor} must be at most 1 and give an "
                f"even, non-zero number of rotated channels of head_dim={self.head_dim}")
        if self.layer_types is None:
            return
        _check_layer_type_names(self.layer_types)
        if not isinstance(self.layer_types, tuple):  # frozen and hashed: stored as a tuple
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_layers:
            raise ModelError(f"layer_types names {len(self.layer_types)} layers but num_layers is "
                             f"{self.num_layers}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ModelError(f"unknown layer type {unknown[0]!r} in layer_types; supported: "
                             f"{', '.join(LAYER_TYPES)}")
        if LINEAR_ATTENTION not in self.layer_types:
            return
        for name in LINEAR_SHAPE_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelError(f"{name} must be a positive integer for linear_attention "
                                 f"layers, got {value!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ModelError(
                f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}")

    # -- derived -----------------------------------------------------------------------------

    @property
    def rotary_dim(self) -> int:
        """The channels of each head RoPE rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_layers(self) -> int:
        """How many layers are linear_attention ones (the cost model counts them apart)."""
        return 0 if self.layer_types is None else self.layer_types.count(LINEAR_ATTENTION)

    @property
    def is_hybrid(self) -> bool:
        """Whether any layer is not full attention (then the layers are not one scanned stack)."""
        return self.layer_types is not None and LINEAR_ATTENTION in self.layer_types

    @property
    def is_moe(self) -> bool:
        """Whether any layer's MLP is a sparse mixture of experts."""
        return self.num_experts > 0

    def layer_is_sparse(self, index: int) -> bool:
        """Whether layer `index`'s MLP is the experts (as transformers' Qwen3MoeDecoderLayer)."""
        return (self.is_moe and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    @property
    def sparse_layers(self) -> int:
        return sum(self.layer_is_sparse(i) for i in range(self.num_layers))

    @property
    def layers_alike(self) -> bool:
        """Whether every layer has the same parameters' shapes, so the layers can be one
        scanned stack: no hybrid's mixers, and all MLPs sparse or all dense."""
        return self.layer_period == 1

    @property
    def layer_period(self) -> int:
        """The fewest consecutive layers whose kinds (token mixer; MLP sparse or dense) repeat
        through the whole stack: 1 where the layers are alike, a hybrid's pattern (Qwen3.5: 3
        Gated DeltaNet layers and 1 attention layer, 4), num_layers where nothing repeats."""
        kinds = [(self.layer_type(i), self.layer_is_sparse(i)) for i in range(self.num_layers)]
        return next(p for p in range(1, self.num_layers + 1) if not self.num_layers % p
                    and all(kind == kinds[i % p] for i, kind in enumerate(kinds)))

    def layer_type(self, index: int) -> str:
        return FULL_ATTENTION if self.layer_types is None else self.layer_types[index]

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def shape(self) -> ModelShape:
        """The sizes basp_jax's cost model plans with; they also count this model's parameters
        and training FLOPs (one formula for the planner and the trainer's MFU)."""
        return ModelShape(**{f.name: getattr(self, f.name)
                             for f in dataclasses.fields(ModelShape)})

    def num_params(self) -> int:
        """Total parameter count, as Hugging Face reports it (tied embeddings counted once)."""
        return self.shape.num_params

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict) -> "ModelConfig":
        """From a Hugging Face config: a directory with config.json, a config.json path, or a dict."""
        if isinstance(path_or_dict, dict):
            return _from_hf_dict(path_or_dict, source="config dict")
        path = os.fspath(path_or_dict)
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ModelError(f"no config.json at {file}")
        try:
            with open(file) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ModelError(f"cannot read {file}: {str(e).splitlines()[0]}") from None
        except RecursionError:  # objects or arrays nested thousands deep
            raise ModelError(f"cannot read {file}: JSON nested too deeply") from None
        if not isinstance(data, dict):
            raise ModelError(f"{file} does not hold a JSON object")
        return _from_hf_dict(data, source=file)

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        """A named preset with the published shapes: see PRESETS for the names."""
        key = name.lower()
        if key not in PRESETS:
            raise ModelError(f"unknown preset {name!r}; use one of {', '.join(PRESETS)}")
        return PRESETS[key]

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that `transformers` (4.x and 5.x) loads as the matching model."""
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "attention_dropout": 0.0,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.model_type in ("llama", "qwen3", "qwen3_moe"):
            out["attention_bias"] = self.attention_bias
        if self.model_type == "llama":
            out["mlp_bias"] = False
        if self.model_type in ("qwen2", "qwen3", "qwen3_moe"):
            out["use_sliding_window"] = False
            out["sliding_window"] = None
        if self.model_type in moe_config.MOE_TYPES:
            out.update(moe_config.hf_keys(self))
        if self.model_type in QWEN3_5_TYPES:  # its RoPE lives in rope_parameters
            del out["rope_scaling"], out["rope_theta"]
            out.update(self._qwen3_5_hf())
        return out

    def _qwen3_5_hf(self) -> dict[str, Any]:
        """The Qwen3.5 text config's own keys (transformers 5 only: its RoPE in rope_parameters)."""
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor}
        layer_types = self.layer_types or (FULL_ATTENTION,) * self.num_layers
        out = {"attention_bias": self.attention_bias, "rope_parameters": rope,
               "layer_types": list(layer_types)}
        out.update({name: getattr(self, name) for name in LINEAR_SHAPE_FIELDS})
        return out


def _text_config(data: dict, source: str) -> dict:
    """The text model's config of a multimodal one (its text_config; whether the head is tied
    is the outer config's say, as transformers ties them)."""
    text = data.get("text_config")
    if not isinstance(text, dict):
        raise ModelError(f"{source}: a {data['model_type']} config needs a text_config object")
    text = dict(text)
    text.setdefault("model_type", MULTIMODAL_TYPES[data["model_type"]])
    if "tie_word_embeddings" in data:
        text["tie_word_embeddings"] = data["tie_word_embeddings"]
    if data.get("vision_config") is not None:
        log.warning("%s: the %s model's vision tower is not loaded; its text model is",
                    source, data["model_type"])
    return text


def _get(data: dict, key: str, source: str, default=dataclasses.MISSING):
    if key in data and data[key] is not None:
        return data[key]
    if default is dataclasses.MISSING:
        raise ModelError(f"{source} lacks {key!r}")
    return default


def float32(value: float) -> float:
    """value as float32 holds it: rounded, 0.0 below its smallest subnormal, inf beyond its
    largest (~3.4e38); the model computes its RoPE frequencies, norms and initial weights in
    float32, so a value finite only in Python's float64 (1e39) is inf there."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _check_layer_type_names(value) -> None:
    """layer_types is a list of names (a string or a number would be split or fail to hash)."""
    allowed = f"{LINEAR_ATTENTION!r} or {FULL_ATTENTION!r}"
    if not isinstance(value, (list, tuple)):
        raise ModelError(f"layer_types must be a list with one entry per layer, each {allowed}, "
                         f"got {value!r}")
    bad = next((i for i, name in enumerate(value) if not isinstance(name, str)), None)
    if bad is not None:
        raise ModelError(f"layer_types[{bad}] is {value[bad]!r}; each entry must be {allowed}")


def _check_positive(name: str, value) -> None:
    """A positive number, still positive and finite in float32."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise ModelError(f"{name} must be a positive number, got {value!r}")
    if not 0 < float32(value) < math.inf:
        raise ModelError(f"{name}={value!r} is {float32(value)} in float32, which the model "
                         f"computes it in; use a positive number float32 holds (1.4e-45 to 3.4e38)")


def _check_token_ids(name: str, value, vocab_size: int, many: bool) -> None:
    """None, or an id of the vocabulary (many: a list of them, as Hugging Face's eos_token_id)."""
    ids = value if many and isinstance(value, list) else [value]
    if value is None or (ids and all(isinstance(i, int) and not isinstance(i, bool)
                                     and 0 <= i < vocab_size for i in ids)):
        return
    what = "an id or a list of ids" if many else "an id"
    raise ModelError(f"{name} must be null or {what} of the vocabulary [0, {vocab_size}), got "
                     f"{value!r}")


def _float(value, name: str, source: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ModelError(f"{source}: {name} must be a number, got {value!r}") from None


def _from_hf_dict(data: dict, source: str) -> ModelConfig:
    if data.get("model_type") in MULTIMODAL_TYPES:
        data = _text_config(data, source)
    model_type = data.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ModelError(
            f"{source}: unknown model_type {model_type!r}; supported: "
            f"{', '.join(MODEL_TYPES + tuple(MULTIMODAL_TYPES))}"
        )
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise ModelError(f"{source}: hidden_act {act!r} is not supported; only 'silu' (SwiGLU)")
    if data.get("mlp_bias"):
        raise ModelError(f"{source}: mlp_bias=True is not supported")
    if data.get("use_sliding_window"):
        raise ModelError(f"{source}: use_sliding_window=True is not supported")

    hidden = _get(data, "hidden_size", source)
    heads = _get(data, "num_attention_heads", source)
    for name, value in (("hidden_size", hidden), ("num_attention_heads", heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelError(f"{source}: {name} must be a positive integer, got {value!r}")
    head_dim = data.get("head_dim") or hidden // heads
    # transformers 5 writes `rope_parameters` (holding rope_theta); 4.x writes `rope_scaling` and
    # a top-level `rope_theta`.
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ModelError(f"{source}: rope_scaling must be an object, got {rope!r}")
    rope = dict(rope)
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    theta = _float(rope.pop("rope_theta", None) or data.get("rope_theta") or 10000.0, "rope_theta",
                   source)
    qwen3_5 = _qwen3_5_fields(data, rope, source) if model_type in QWEN3_5_TYPES else {}
    moe = moe_config.fields(data, source) if model_type in moe_config.MOE_TYPES else {}
    # a Qwen3.5-MoE text config has no dense MLP, nor its width: an expert's stands in (unused:
    # every layer is sparse)
    dense_width = (_get(data, "intermediate_size", source)
                   if model_type not in moe_config.SHARED_EXPERT_TYPES
                   else data.get("intermediate_size") or moe["moe_intermediate_size"])
    rope_scaling = rope if rope.get("rope_type", "default") != "default" else None

    if model_type == "qwen2":
        qkv_bias, out_bias = True, False
    else:
        qkv_bias = out_bias = bool(data.get("attention_bias", False))
    eps = _float(_get(data, "rms_norm_eps", source, 1e-6), "rms_norm_eps", source)
    try:
        return ModelConfig(
            vocab_size=_get(data, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=dense_width,
            num_layers=_get(data, "num_hidden_layers", source),
            num_heads=heads,
            num_kv_heads=data.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rope_theta=theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=eps,
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            attention_out_bias=out_bias,
            qk_norm=model_type in ("qwen3", "qwen3_moe", *QWEN3_5_TYPES),
            max_position_embeddings=_get(data, "max_position_embeddings", source, 8192),
            model_type=model_type,
            initializer_range=_float(data.get("initializer_range", 0.02), "initializer_range",
                                     source),
            bos_token_id=data.get("bos_token_id"),
            eos_token_id=data.get("eos_token_id"),
            **qwen3_5,
            **moe,
        )
    except ModelError as e:
        raise ModelError(f"{source}: {e}") from None


def _qwen3_5_fields(data: dict, rope: dict, source: str) -> dict[str, Any]:
    """The hybrid's fields of a qwen3_5_text config; pops the keys of `rope` that are not scaling
    (the partial rotary factor; the multimodal RoPE sections, which text positions make plain)."""
    factor = rope.pop("partial_rotary_factor", None) or data.get("partial_rotary_factor") or 0.25
    for key in ("mrope_section", "mrope_interleaved"):
        rope.pop(key, None)
    num_layers = _get(data, "num_hidden_layers", source)
    layer_types = data.get("layer_types")
    if layer_types is None:  # transformers' default: every full_attention_interval-th layer
        interval = data.get("full_attention_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
            raise ModelError(f"{source}: full_attention_interval must be a positive integer, "
                             f"got {interval!r}")
        if isinstance(num_layers, int):
            layer_types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION
                           for i in range(num_layers)]
    if not isinstance(layer_types, (list, tuple)):
        raise ModelError(f"{source}: layer_types must be a list, got {layer_types!r}")
    fields = {name: _get(data, name, source) for name in LINEAR_SHAPE_FIELDS}
    return dict(fields, layer_types=tuple(layer_types),
                partial_rotary_factor=_float(factor, "partial_rotary_factor", source),
                attention_output_gate=True, rms_norm_zero_centered=True)


def _hashable(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


def _config_hash(self) -> int:
    return hash(tuple(_hashable(getattr(self, f.name)) for f in dataclasses.fields(self)))


# The config rides on the NNX module as static data, so it must hash although rope_scaling is a dict.
ModelConfig.__hash__ = _config_hash



# The named presets (their fields: models.presets), as ModelConfigs
PRESETS: dict[str, ModelConfig] = {name: ModelConfig(**fields)
                                   for name, fields in PRESET_FIELDS.items()}
