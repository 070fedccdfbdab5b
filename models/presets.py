"""The named presets' fields: the published shapes of the models basp-jax is shown on, and tiny
ones for tests and CPU demos. models.config makes each a ModelConfig (PRESETS there, read by
ModelConfig.preset); this module knows no ModelConfig, so the two do not import each other."""

from __future__ import annotations

import dataclasses

from basp_jax.planner.shape import ModelShape

FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"  # (models.config's)

# Shapes of the paper's models (as in their Hugging Face config.json): what the planner
# (basp_jax.planner.shape) is given for them; PRESET_FIELDS adds the model-only fields (RoPE,
# norms' epsilon, token ids) to these, so each shape is written once.
MODEL_SHAPES = {
    "llama-3.2-1b": ModelShape(16, 2048, 8192, 32, 8, 64, 128256, tie_word_embeddings=True),
    "llama-3.2-3b": ModelShape(28, 3072, 8192, 24, 8, 128, 128256, tie_word_embeddings=True),
    "llama-3.1-8b": ModelShape(32, 4096, 14336, 32, 8, 128, 128256),
    "qwen2.5-3b": ModelShape(36, 2048, 11008, 16, 2, 128, 151936, tie_word_embeddings=True,
                             attention_bias=True),
    "qwen3-8b": ModelShape(36, 4096, 12288, 32, 8, 128, 151936, qk_norm=True),
}


def _llama3_rope(factor: float) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _preset(shape: ModelShape, **model_only) -> dict:
    """The fields of a preset of one of MODEL_SHAPES: its shape and the model-only fields."""
    fields = dataclasses.asdict(shape)
    fields.pop("linear_layers")  # the config counts its own from layer_types
    fields.pop("sparse_layers")  # and its sparse ones from its MoE fields
    return dict(fields, **model_only)


_LLAMA3 = dict(rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
               model_type="llama", bos_token_id=128000, eos_token_id=128001)

# The Qwen3.5 text models' own fields (their hybrid's norms, gates and partial RoPE), and the
# published models' Gated DeltaNet shapes
_QWEN3_5 = dict(rms_norm_eps=1e-6, qk_norm=True, partial_rotary_factor=0.25,
                attention_output_gate=True, rms_norm_zero_centered=True, linear_conv_kernel_dim=4)
_QWEN3_5_LINEAR = dict(linear_num_key_heads=16, linear_num_value_heads=32,
                       linear_key_head_dim=128, linear_value_head_dim=128)


def _hybrid_layer_types(repeats: int) -> tuple[str, ...]:
    """Qwen3.5's pattern, repeated: 3 Gated DeltaNet layers, then one attention layer."""
    return ((LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)) * repeats


# The Qwen3.5 hybrid at tiny's size, for tests and trying the hybrid on a CPU: 4 layers (3 Gated
# DeltaNet + 1 gated attention), 8 value heads so sp in {1, 2, 4, 8} all work.
_TINY_QWEN3_5 = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=8,
    num_kv_heads=2, head_dim=32, rope_theta=10000.0, tie_word_embeddings=True,
    max_position_embeddings=4096, model_type="qwen3_5_text", layer_types=_hybrid_layer_types(1),
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16,
    linear_value_head_dim=16, **_QWEN3_5,
)

# From the models' published config.json files: the paper's five models take their shapes from
# MODEL_SHAPES (which the planner reads), the others state theirs here.
PRESET_FIELDS: dict[str, dict] = {
    "llama-3.2-1b": _preset(MODEL_SHAPES["llama-3.2-1b"], rope_scaling=_llama3_rope(32.0),
                            **_LLAMA3),
    "llama-3.2-3b": _preset(MODEL_SHAPES["llama-3.2-3b"], rope_scaling=_llama3_rope(32.0),
                            **_LLAMA3),
    "llama-3.1-8b": _preset(MODEL_SHAPES["llama-3.1-8b"], rope_scaling=_llama3_rope(8.0),
                            **_LLAMA3),
    "qwen2.5-3b": _preset(
        MODEL_SHAPES["qwen2.5-3b"], rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=32768, model_type="qwen2", bos_token_id=151643,
        eos_token_id=151643,
    ),
    "qwen3-8b": _preset(
        MODEL_SHAPES["qwen3-8b"], rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=40960, model_type="qwen3", bos_token_id=151643,
        eos_token_id=151645,
    ),
    "qwen1.5-1.8b": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5504, num_layers=24, num_heads=16,
        num_kv_heads=16, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attention_bias=True, max_position_embeddings=32768,
        model_type="qwen2", bos_token_id=151643, eos_token_id=151643,
    ),
    # The shape of transformers' Qwen3_5TextConfig defaults (its docstring: "Qwen3.5-9B style"),
    # 8.95B parameters: 24 Gated DeltaNet layers and 8 gated attention layers (every 4th), with
    # that class's RoPE theta and context; a real checkpoint's config.json says its own
    # (model.hf_path reads it).
    "qwen3.5-9b": dict(
        vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_layers=32,
        num_heads=16, num_kv_heads=4, head_dim=256, rope_theta=10000.0,
        max_position_embeddings=32768, model_type="qwen3_5_text",
        layer_types=_hybrid_layer_types(8), **_QWEN3_5_LINEAR, **_QWEN3_5,
    ),
    # Qwen3-30B-A3B (its config.json): 48 layers, each MLP 128 experts of which 8 run per token
    # (30.5B parameters, 3.3B active); intermediate_size is a dense layer's, which it has none of.
    "qwen3-30b-a3b": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
        num_heads=32, num_kv_heads=4, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, max_position_embeddings=40960, model_type="qwen3_moe",
        qk_norm=True, bos_token_id=151643, eos_token_id=151645, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=(), router_aux_loss_coef=0.001,
    ),
    # Qwen3.5-35B-A3B's text model (its published shape): the 3:1 hybrid of 40 layers, each MLP
    # 256 experts of which 8 run per token beside a shared expert (35B parameters, 3B active).
    # intermediate_size stands in for a dense MLP it has none of.
    "qwen3.5-35b-a3b": dict(
        vocab_size=248320, hidden_size=2048, intermediate_size=512, num_layers=40,
        num_heads=16, num_kv_heads=2, head_dim=256, rope_theta=10000000.0,
        max_position_embeddings=262144, model_type="qwen3_5_moe_text",
        layer_types=_hybrid_layer_types(10), **_QWEN3_5_LINEAR, **_QWEN3_5, num_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=512, norm_topk_prob=True,
        shared_expert_intermediate_size=512, router_aux_loss_coef=0.001,
    ),
    # Small enough for tests and CPU demos; 8 query heads so sp in {1, 2, 4, 8} all work.
    "tiny": dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=8,
        num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, max_position_embeddings=4096, model_type="llama",
    ),
    "tiny-qwen3.5": _TINY_QWEN3_5,
    # Qwen3.5-MoE at tiny-qwen3.5's size: its 4 hybrid layers, each MLP 8 experts of which 2
    # run per token beside a shared expert.
    "tiny-qwen3.5-moe": dict(
        _TINY_QWEN3_5, intermediate_size=64, tie_word_embeddings=False,
        model_type="qwen3_5_moe_text", num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, norm_topk_prob=True, shared_expert_intermediate_size=64),
    # Qwen3-MoE at tiny's size, for tests and trying the experts on a CPU: 4 layers, 8 experts
    # of which 2 run per token.
    "tiny-qwen3-moe": dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=8,
        num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, max_position_embeddings=4096, model_type="qwen3_moe",
        qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        norm_topk_prob=True,
    ),
}
