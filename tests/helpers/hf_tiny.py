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


def hf_config(family: str):
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
    raise ValueError(family)


def build(family: str, seed: int = 0):
    """A float32 eager-attention model with every parameter random (biases and norms included)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = hf_config(family)
    config._attn_implementation = "eager"
    model = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
             "qwen3": transformers.Qwen3ForCausalLM}[family](config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + 0.08 * torch.randn_like(p))
    return model


def save(family: str, directory, seed: int = 0, **kwargs):
    model = build(family, seed)
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


def load_torch(directory):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager", dtype="float32").eval()
