"""The model a config describes, read the same way by the trainer, train.tools.aot and the sampler's
restore (train.tools.generate.restore_model): its architecture and how it runs.

    mcfg = model_config(cfg)              # models.ModelConfig: preset or HF config + model.shape
    options = model_options(cfg, plan)    # models.RunOptions: mesh, layout, kernel, remat, dtypes
"""

from __future__ import annotations

import dataclasses
import typing

import jax

import models

from ..config.schema import Config, ConfigError
from ..config.tree import coerce, yaml_value
from ..config import dtypes
from .step import compute_dtype


def model_config(cfg: Config) -> "models.ModelConfig":
    """The ModelConfig from a preset or an HF directory, with model.shape overrides applied."""
    m = cfg.model
    base = models.ModelConfig.preset(m.preset) if m.preset else models.ModelConfig.from_hf(m.hf_path)
    if not m.shape:
        return base
    fields = {f.name: f for f in dataclasses.fields(base)}
    hints = typing.get_type_hints(type(base))
    changes = {}
    for key, value in m.shape.items():
        if key not in fields:
            raise ConfigError(
                f"unknown config key 'model.shape.{key}'; model fields: {', '.join(fields)}"
            )
        tp = hints[key]
        if tp in (int, float, bool, str):
            value = coerce(f"model.shape.{key}", value, tp)
        elif isinstance(value, str):
            value = yaml_value(f"model.shape.{key}", value)
        changes[key] = value
    if "vocab_size" in changes:
        changes = {**_ids_in_vocabulary(base, changes["vocab_size"]), **changes}
    return dataclasses.replace(base, **changes)


def _ids_in_vocabulary(base, vocab_size) -> dict:
    """base's bos/eos ids that remain in a vocabulary of vocab_size (model.shape.vocab_size):
    a preset's ids name tokens of its own tokenizer, which a smaller vocabulary lacks, so those
    beyond it are dropped (None) rather than exported; ids model.shape gives are checked as
    given (models.ModelConfig)."""
    if not isinstance(vocab_size, int):
        return {}  # (ModelConfig refuses it)
    def keep(i):
        return i if isinstance(i, int) and 0 <= i < vocab_size else None

    eos = base.eos_token_id
    eos = ([i for i in eos if keep(i) is not None] or None) if isinstance(eos, list) else keep(eos)
    return {"bos_token_id": keep(base.bos_token_id), "eos_token_id": eos}


def fp8_enabled(cfg: Config, device) -> bool:
    """model.fp8 as `device` runs it ("auto": on sm90+ GPUs; models.fp8.enabled)."""
    from basp_jax import kernels
    from models import fp8

    return fp8.enabled(cfg.model.fp8, device.platform, kernels.device_capability(device))


def model_options(cfg: Config, plan=None, *,
                  dtype: str | None = None) -> "models.RunOptions":
    """How the configured model runs: on the plan's mesh and layout with its parameter sharding,
    or on one device without a plan; dtype replaces model.dtype."""
    m = cfg.model
    device = plan.mesh.devices.flat[0] if plan is not None else jax.devices()[0]
    # without a plan (one device, shapes only) model.remat=auto means no rematerialisation
    fields = dict(dtype=dtypes.jnp_dtype(compute_dtype(dtype or m.dtype, device)),
                  param_dtype=dtypes.jnp_dtype(m.param_dtype),
                  attn_impl=m.attn_impl, remat="none" if m.remat == "auto" else m.remat,
                  tile_tokens=m.tile_tokens, vocab_parallel=m.vocab_parallel,
                  scan_layers=m.scan_layers, fp8=fp8_enabled(cfg, device),
                  fp8_exchange=m.fp8_exchange, expert_parallel=m.expert_parallel,
                  grouped_matmul=m.grouped_matmul)
    if plan is not None:
        fields.update(mesh=plan.mesh, layout=plan.layout, param_sharding=plan.strategy,
                      rules=plan.rules,  # the run's one ShardingRules: the trainer's are the model's
                      remat=plan.remat, tile_tokens=plan.tile_tokens,
                      document_bound=plan.document_bound)
    return models.RunOptions(**fields)
