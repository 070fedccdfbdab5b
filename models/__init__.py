"""Flax NNX Llama 3, Qwen 2/2.5/3, Qwen3-MoE and the Qwen3.5 hybrid on BASP attention, with
Hugging Face checkpoint interop.

    model = models.from_pretrained("path/to/hf_dir", mesh=mesh)       # or Transformer(config, ...)
    # how it runs (mesh, layout, dtypes, kernel, remat): one models.RunOptions, or its fields
    logits = model(tokens, segment_ids=None, positions=None)          # [B, S, vocab] float32
    loss_sum, count = models.causal_lm_loss(logits, targets)
    models.save_pretrained(model, "out_dir")                          # transformers can load it
    models.sampler.generate(model, prompt_ids, max_new_tokens=32)     # KV-cached, one device
"""

from .config import MODEL_SHAPES, MODEL_TYPES, PRESETS, ModelConfig, ModelError
from .hf import (
    check_pretrained,
    from_pretrained,
    hf_name,
    hf_state_dict,
    load_hf_params,
    save_pretrained,
)
from .loss import causal_lm_loss
from .options import REMAT_POLICIES, RunOptions
from . import sampler
from .transformer import Transformer, abstract_model, build_sharded, init_model

__all__ = [
    "MODEL_TYPES",
    "PRESETS",
    "MODEL_SHAPES",
    "REMAT_POLICIES",
    "ModelConfig",
    "ModelError",
    "RunOptions",
    "Transformer",
    "abstract_model",
    "build_sharded",
    "check_pretrained",
    "causal_lm_loss",
    "from_pretrained",
    "hf_name",
    "hf_state_dict",
    "init_model",
    "load_hf_params",
    "sampler",
    "save_pretrained",
]
