"""The sparse mixture-of-experts fields of models.ModelConfig (qwen3_moe, qwen3_5_moe_text):
their checks, how a config.json holds them, and the parameters they add.

A layer's MLP is sparse (models.moe) when the config has experts, the layer is not one of
mlp_only_layers and (index + 1) is a multiple of decoder_sparse_step, as transformers'
Qwen3MoeDecoderLayer decides it. Qwen3.5-MoE has neither field (every layer is sparse) and a
shared expert beside the routed ones; its router always renormalises the top-k weights.
"""

from __future__ import annotations

import math
from typing import Any

from .errors import ModelError

# the model types whose layers may be sparse (num_experts > 0)
MOE_TYPES = ("qwen3_moe", "qwen3_5_moe_text")
SHARED_EXPERT_TYPES = ("qwen3_5_moe_text",)  # those with a shared expert in every sparse MLP
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef")
# transformers' Qwen3_5MoeTextConfig: the fields it has (the others are fixed by its code)
SHARED_EXPERT_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                        "shared_expert_intermediate_size", "router_aux_loss_coef")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check(config) -> None:
    """Refuse bad sparse fields of a ModelConfig in one line; mlp_only_layers is stored as a
    tuple (the config is hashed)."""
    layers = config.mlp_only_layers
    if not isinstance(layers, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise ModelError(f"mlp_only_layers must be a list of layer indices, got {layers!r}")
    object.__setattr__(config, "mlp_only_layers", tuple(layers))
    experts = config.num_experts
    if config.model_type not in MOE_TYPES:
        if config.router_z_loss_coef:
            raise ModelError(f"router_z_loss_coef={config.router_z_loss_coef!r} weighs a sparse "
                             f"model's routers, and {config.model_type} has none; leave it 0")
        if experts != 0:
            raise ModelError(f"num_experts={experts!r}: sparse layers are a "
                             f"{' or '.join(MOE_TYPES)} model's, not {config.model_type}'s")
        _check_shared_expert(config)
        return
    if not _positive_int(experts):
        raise ModelError(f"num_experts must be a positive integer for {config.model_type}, got "
                         f"{experts!r}")
    for name in ("num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
        if not _positive_int(getattr(config, name)):
            raise ModelError(f"{name} must be a positive integer, got {getattr(config, name)!r}")
    if config.num_experts_per_tok > experts:
        raise ModelError(f"num_experts_per_tok={config.num_experts_per_tok} exceeds "
                         f"num_experts={experts}; route each token to at most every expert")
    bad = [i for i in layers if not 0 <= i < config.num_layers]
    if bad:
        raise ModelError(f"mlp_only_layers holds {bad[0]}, not a layer of "
                         f"0..{config.num_layers - 1}")
    _check_shared_expert(config)
    if config.model_type in SHARED_EXPERT_TYPES and (
            not config.norm_topk_prob or config.decoder_sparse_step != 1 or layers):
        raise ModelError(f"{config.model_type} renormalises its top-k weights and has every "
                         f"layer sparse: set norm_topk_prob=true, decoder_sparse_step=1 and no "
                         f"mlp_only_layers")
    if not isinstance(config.norm_topk_prob, bool):
        raise ModelError(f"norm_topk_prob must be true or false, got {config.norm_topk_prob!r}")
    for name in ("router_aux_loss_coef", "router_z_loss_coef"):
        coef = getattr(config, name)
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) \
                or not math.isfinite(coef) or coef < 0:
            raise ModelError(f"{name} must be a number >= 0, got {coef!r}")


def _check_shared_expert(config) -> None:
    width = config.shared_expert_intermediate_size
    if config.model_type in SHARED_EXPERT_TYPES:
        if not _positive_int(width):
            raise ModelError(f"shared_expert_intermediate_size must be a positive integer for "
                             f"{config.model_type}, got {width!r}")
    elif width != 0:
        raise ModelError(f"shared_expert_intermediate_size={width!r}: a shared expert is a "
                         f"{' or '.join(SHARED_EXPERT_TYPES)} model's, not "
                         f"{config.model_type}'s; leave it 0")


def fields(data: dict, source: str) -> dict[str, Any]:
    """The sparse fields of a config.json dict (transformers' defaults where a key is absent;
    transformers 5 writes num_experts as num_local_experts)."""
    if data.get("model_type") in SHARED_EXPERT_TYPES:
        return _shared_expert_fields(data, source)
    experts = data.get("num_experts", data.get("num_local_experts"))
    if experts is None:
        raise ModelError(f"{source} lacks 'num_experts'")
    if "moe_intermediate_size" not in data:
        raise ModelError(f"{source} lacks 'moe_intermediate_size'")
    defaults = dict(num_experts_per_tok=8, norm_topk_prob=False, decoder_sparse_step=1,
                    mlp_only_layers=[], router_aux_loss_coef=0.001)
    out = {name: data[name] if data.get(name) is not None else defaults.get(name)
           for name in MOE_FIELDS if name != "num_experts"}
    out["router_aux_loss_coef"] = _coef(out["router_aux_loss_coef"], source)
    return dict(out, num_experts=experts)


def _shared_expert_fields(data: dict, source: str) -> dict[str, Any]:
    """A Qwen3.5-MoE text config's sparse fields, with Qwen3_5MoeTextConfig's defaults; the ones
    its code fixes (every layer sparse, the top-k weights renormalised) are set so."""
    defaults = dict(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                    shared_expert_intermediate_size=512, router_aux_loss_coef=0.001)
    data = dict(data)
    if data.get("num_experts") is None:  # (transformers 5's name for it, as in fields)
        data["num_experts"] = data.get("num_local_experts")
    out = {name: data[name] if data.get(name) is not None else defaults[name]
           for name in SHARED_EXPERT_FIELDS}
    out["router_aux_loss_coef"] = _coef(out["router_aux_loss_coef"], source)
    return dict(out, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=())


def _coef(coef, source: str):
    """A number written as a string (as other float fields allow) read as one."""
    if not isinstance(coef, str):
        return coef
    try:
        return float(coef)
    except ValueError:
        raise ModelError(f"{source}: router_aux_loss_coef must be a number, got "
                         f"{coef!r}") from None


def hf_keys(config) -> dict[str, Any]:
    """The sparse fields' keys of the model type's config.json (num_experts, which both
    transformers 4 and 5 read)."""
    if config.model_type in SHARED_EXPERT_TYPES:
        out = {name: getattr(config, name) for name in SHARED_EXPERT_FIELDS}
    else:
        out = {name: getattr(config, name) for name in MOE_FIELDS}
        out["mlp_only_layers"] = list(config.mlp_only_layers)
    out["output_router_logits"] = False
    return out
