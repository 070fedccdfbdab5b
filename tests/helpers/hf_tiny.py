"""Tiny random Hugging Face models for the models/ tests, built locally with save_pretrained.

Shapes are chosen so every layout of 8 devices used in the tests works (8 query heads, seq a
multiple of 8) and so each family switch is exercised: llama with llama3 rope scaling (the head_dim
spans the high, medium and low frequency bands) and tied embeddings; qwen2 with q/k/v bias and an
untied head; qwen3 with q/k norm and an explicit head_dim that differs from hidden / heads.
"""

from __future__ import annotations

import numpy as np

FAMILIES = ("llama", "qwen2", "qwen3")
VOCAB = 256
# The Qwen3.5 hybrid (tests/models/test_qwen35.py): three Gated DeltaNet layers, then one gated
# full-attention layer with partial RoPE; 8 attention and 8 DeltaNet value heads (4 key heads).
QWEN3_5 = "qwen3_5"
# Qwen3-MoE (tests/models/test_qwen3_moe.py): 8 experts, 2 per token, every layer sparse; with
# mixed=True three layers, the middle one dense (mlp_only_layers), so the layers are a list.
QWEN3_MOE = "qwen3_moe"
# Qwen3.5-MoE (tests/models/test_qwen35_moe.py): QWEN3_5's hybrid layers, each MLP 8 experts of
# which 2 run per token, beside a shared expert gated by a sigmoid.
QWEN3_5_MOE = "qwen3_5_moe"
ROUTER_STD = 0.5  # the routers' spread: top-k choices far from ties (router_margin)


def hf_config(family: str, tied: bool = False, mixed: bool = False, repeats: int = 1):
    """(repeats: of a Qwen3.5 family's 4-layer pattern, so its layers scan by period when > 1)"""
    import transformers

    common = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=8,
                  max_position_embeddings=256, rms_norm_eps=1e-5)
    if family == "llama":
        return transformers.LlamaConfig(
            hidden_size=128, intermediate_size=192, num_key_value_heads=2, tie_word_embeddings=True,
            rope_theta=10000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            **common,
        )
    if family == "qwen2":
        return transformers.Qwen2Config(
            hidden_size=64, intermediate_size=160, num_key_value_heads=4, tie_word_embeddings=False,
            rope_theta=10000.0, **common,
        )
    if family == "qwen3":
        return transformers.Qwen3Config(
            hidden_size=64, intermediate_size=160, num_key_value_heads=2, head_dim=16,
            tie_word_embeddings=False, rope_theta=10000.0, **common,
        )
    if family == QWEN3_5:
        return transformers.Qwen3_5TextConfig(
            hidden_size=64, intermediate_size=96, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=4, linear_num_value_heads=8,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            tie_word_embeddings=tied, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.25},
            **{**common, "num_hidden_layers": 4 * repeats},
        )
    if family == QWEN3_MOE:
        return transformers.Qwen3MoeConfig(
            hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True, num_key_value_heads=2, head_dim=16,
            mlp_only_layers=[1] if mixed else [], router_aux_loss_coef=0.01,
            tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                        "rope_theta": 10000.0},
            **{**common, "num_hidden_layers": 3 if mixed else 2},
        )
    if family == QWEN3_5_MOE:
        return transformers.Qwen3_5MoeTextConfig(
            hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.01,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            tie_word_embeddings=tied, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.25},
            **{**common, "num_hidden_layers": 4 * repeats},
        )
    raise ValueError(family)


def _random_base(family: str, name: str) -> float | None:
    """The value a random parameter is centred on (None: keep transformers' init)."""
    if family in (QWEN3_5, QWEN3_5_MOE):
        if name.endswith(("A_log", "dt_bias")):
            return None  # the decay rates' spread, as trained models have
        # Qwen3.5's RMSNorms store (scale - 1); the DeltaNet's gated norm stores the scale
        return 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
    return 1.0 if "norm" in name else 0.0


def build(family: str, seed: int = 0, tied: bool = False, mixed: bool = False,
          repeats: int = 1):
    """A float32 eager-attention model with every parameter random (biases and norms included).
    (tied: Qwen3.5's choice; the other families' configs fix it. mixed: Qwen3-MoE's dense
    middle layer.)"""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = hf_config(family, tied=tied, mixed=mixed, repeats=repeats)
    config._attn_implementation = "eager"
    model = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
             "qwen3": transformers.Qwen3ForCausalLM, QWEN3_MOE: transformers.Qwen3MoeForCausalLM,
             QWEN3_5: transformers.Qwen3_5ForCausalLM,
             QWEN3_5_MOE: transformers.Qwen3_5MoeForCausalLM}[family](config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = _random_base(family, name)
            if base is not None:
                std = ROUTER_STD if name.endswith("mlp.gate.weight") else 0.08
                p.copy_(base + std * torch.randn_like(p))
    return model


def router_margin(model, tokens: np.ndarray) -> float:
    """The smallest gap, over tokens and sparse layers, between the k-th and (k+1)-th router
    logit of a transformers MoE model: a top-k choice that float rounding cannot flip."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(np.asarray(tokens)).long(),
                    output_router_logits=True)
    k = getattr(model.config, "text_config", model.config).num_experts_per_tok
    gaps = [np.diff(-np.sort(-logits.numpy(), axis=-1)[:, k - 1:k + 1], axis=-1)
            for logits in out.router_logits]
    return float(-np.max(np.concatenate(gaps)))


def save(family: str, directory, seed: int = 0, tied: bool = False, mixed: bool = False,
         repeats: int = 1, **kwargs):
    model = build(family, seed, tied=tied, mixed=mixed, repeats=repeats)
    model.save_pretrained(directory, **kwargs)
    return model


def torch_logits(model, tokens: np.ndarray, positions: np.ndarray | None = None) -> np.ndarray:
    import torch

    with torch.no_grad():
        kwargs = {}
        if positions is not None:
            kwargs["position_ids"] = torch.from_numpy(np.array(positions)).long()
        out = model(input_ids=torch.from_numpy(np.asarray(tokens)).long(), **kwargs)
    return out.logits.float().numpy()


def torch_logits_and_aux(torch_model, tokens: np.ndarray) -> tuple[np.ndarray, float]:
    """(logits, aux_loss) of a transformers MoE model, router logits on."""
    import torch

    with torch.no_grad():
        out = torch_model(input_ids=torch.from_numpy(tokens).long(), output_router_logits=True)
    return out.logits.numpy(), float(out.aux_loss)


def logits_and_aux_program(model):
    """Our model's (logits, aux loss) of tokens, one jit with the parameters passed in (on a
    mesh too)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    run = jax.jit(lambda p, t: nnx.merge(graphdef, p, rest).forward_with_aux(t))
    return lambda tokens: run(params, jnp.asarray(tokens))


def load_torch(directory):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager", dtype="float32").eval()


def save_qwen3_5_multimodal(directory, seed: int = 0, tied: bool = False,
                            family: str = QWEN3_5):
    """A tiny Qwen3.5 (or, family=QWEN3_5_MOE, Qwen3.5-MoE) vision-language checkpoint (one
    vision block) whose text model is hf_config(family)'s, random as `build` makes it; returns
    the transformers model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    text = hf_config(family).to_dict()  # untied: the outer config's tie_word_embeddings decides
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=text["hidden_size"], num_position_embeddings=16)
    config_class, model_class = {
        QWEN3_5: (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration),
        QWEN3_5_MOE: (transformers.Qwen3_5MoeConfig,
                      transformers.Qwen3_5MoeForConditionalGeneration)}[family]
    config = config_class(text_config=text, vision_config=vision, tie_word_embeddings=tied)
    config._attn_implementation = "eager"
    model = model_class(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = _random_base(family, name)
            if base is not None and "visual" not in name:
                std = ROUTER_STD if name.endswith("mlp.gate.weight") else 0.08
                p.copy_(base + std * torch.randn_like(p))
    model.save_pretrained(directory)
    return model
