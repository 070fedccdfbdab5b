"""Presets carry the published shapes; configs read from and write to Hugging Face's config.json."""

import dataclasses
import json
import re

import jax
import numpy as np
import pytest
from flax import nnx

import models

PUBLISHED = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "qwen2.5-3b": 3_085_938_688,
    "qwen3-8b": 8_190_735_360,
    "qwen1.5-1.8b": 1_836_828_672,
    "qwen3.5-9b": 8_953_803_264,  # transformers' Qwen3_5TextConfig() defaults, counted on meta
    # transformers' Qwen3_5MoeTextConfig() defaults (Qwen3.5-35B-A3B's text model), on meta
    "qwen3.5-35b-a3b": 34_660_610_688,
}


def _count(model_or_abstract) -> int:
    leaves = jax.tree.leaves(nnx.state(model_or_abstract, nnx.Param))
    return sum(int(np.prod(x.shape)) for x in leaves)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_match_published(name):
    config = models.ModelConfig.preset(name)
    assert config.num_params() == PUBLISHED[name]
    # The formula agrees with the parameters the module actually creates (no memory used).
    assert _count(models.abstract_model(config)) == PUBLISHED[name]


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen2.5-3b", "qwen3-8b", "qwen3.5-9b",
                                  "qwen3.5-35b-a3b"])
def test_preset_configs_build_the_same_model_in_transformers(name):
    """Our config.json, read by transformers, gives a model with the published parameter count."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = models.ModelConfig.preset(name)
    hf_config = transformers.AutoConfig.for_model(**config.to_hf())
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert sum(p.numel() for p in hf_model.parameters()) == PUBLISHED[name]


def test_config_round_trips_through_hf_dict_and_file(tmp_path):
    for name in PUBLISHED:
        config = models.ModelConfig.preset(name)
        assert models.ModelConfig.from_hf(config.to_hf()) == config
    config = models.ModelConfig.preset("llama-3.1-8b")
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf()))
    assert models.ModelConfig.from_hf(tmp_path) == config
    assert models.ModelConfig.from_hf(tmp_path / "config.json") == config


def test_rope_parameters_and_rope_scaling_both_read():
    base = models.ModelConfig.preset("llama-3.2-1b").to_hf()
    v4 = dict(base)  # transformers 4.x: rope_scaling + top-level rope_theta
    v5 = {k: v for k, v in base.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {**base["rope_scaling"], "rope_theta": base["rope_theta"]}
    legacy = dict(base, rope_scaling={**{k: v for k, v in base["rope_scaling"].items()
                                         if k != "rope_type"}, "type": "llama3"})
    configs = [models.ModelConfig.from_hf(d) for d in (v4, v5, legacy)]
    assert configs[0] == configs[1] == configs[2]
    assert configs[0].rope_theta == 500000.0 and configs[0].rope_type == "llama3"
    plain = dict(base, rope_scaling=None)
    plain.pop("rope_theta")
    plain["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    config = models.ModelConfig.from_hf(plain)
    assert config.rope_scaling is None and config.rope_theta == 1e6


def test_overrides_and_tiny_preset():
    tiny = models.ModelConfig.preset("tiny")
    assert tiny.num_heads % 8 == 0 and tiny.num_params() < 1_000_000
    deeper = dataclasses.replace(tiny, num_layers=4)
    assert deeper.num_layers == 4 and hash(deeper) != hash(tiny)
    with pytest.raises(models.ModelError, match="num_kv_heads"):
        dataclasses.replace(tiny, num_kv_heads=3)
    with pytest.raises(models.ModelError, match="unknown preset"):
        models.ModelConfig.preset("gpt-5")


def test_flops_per_token():
    config = models.ModelConfig.preset("llama-3.1-8b")
    n = config.num_params() - config.vocab_size * config.hidden_size  # input table: a lookup
    attention = 12 * 32 * 32 * 128 * 8192
    assert config.shape.train_flops_per_token(8192, causal=False) == 6 * n + attention
    assert config.shape.train_flops_per_token(8192) == 6 * n + attention / 2  # causal
    tied = models.ModelConfig.preset("llama-3.2-1b")
    assert tied.shape.train_flops_per_token(0) == 6 * tied.num_params()


def test_the_shape_is_the_configs_sizes():
    """ModelConfig.shape carries every field the cost model shares with the config, so a
    model.shape override reaches the planner and the FLOP count."""
    from basp_jax.planner.shape import ModelShape

    config = dataclasses.replace(models.ModelConfig.preset("qwen2.5-3b"), num_layers=3,
                                 attention_out_bias=True)
    shape = config.shape
    for field in dataclasses.fields(ModelShape):
        assert getattr(shape, field.name) == getattr(config, field.name), field.name
    assert (shape.num_layers, shape.attention_bias, shape.attention_out_bias) == (3, True, True)


@pytest.mark.parametrize("bad, match", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
])
def test_bad_configs_are_one_line_errors(bad, match):
    data = {**models.ModelConfig.preset("tiny").to_hf(), **bad}
    with pytest.raises(models.ModelError, match=match) as info:
        models.ModelConfig.from_hf(data)
    assert "\n" not in str(info.value)


from models import ModelConfig, ModelError  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("change, fragment", [
    ({"rope_scaling": 5}, "rope_scaling must be a mapping"),
    ({"rope_scaling": {**LLAMA3, "factor": "x"}}, "rope_scaling.factor must be a positive number, "
                                                  "got 'x'"),
    ({"rope_theta": float("nan")}, "rope_theta must be a positive number, got nan"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps must be a positive number"),
])
def test_bad_model_values_are_one_line_model_errors(change, fragment):
    """Values a model.shape override or a config.json can carry: a ModelError, not a TypeError
    or a ZeroDivisionError from deep inside."""
    import dataclasses

    with pytest.raises(ModelError, match=re.escape(fragment)) as info:
        dataclasses.replace(ModelConfig.preset("tiny"), **change)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("change, fragment", [
    ({"num_attention_heads": 0, "head_dim": None}, "num_attention_heads must be a positive integer"),
    ({"rope_theta": "abc"}, "rope_theta must be a number, got 'abc'"),
    ({"rms_norm_eps": "abc"}, "config dict: rms_norm_eps must be a number, got 'abc'"),
    ({"rope_scaling": {**LLAMA3, "factor": "x"}}, "rope_scaling.factor must be a positive number"),
])
def test_bad_hf_config_values_are_one_line_model_errors(change, fragment):
    data = {**ModelConfig.preset("tiny").to_hf(), **change}
    with pytest.raises(ModelError, match=re.escape(fragment)):
        ModelConfig.from_hf(data)
