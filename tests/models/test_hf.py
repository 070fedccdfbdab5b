"""Our Llama / Qwen2 / Qwen3 against transformers on tiny random checkpoints, and the HF round trip.

Tolerance: float32 logits agree with transformers' (eager attention, float32) to atol 1e-4; the
observed difference is ~4e-6 on logits of magnitude ~4.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

pytest.importorskip("torch")
pytest.importorskip("transformers")

import basp_jax  # noqa: E402
import models  # noqa: E402

from tests.helpers import hf_tiny  # noqa: E402
from tests.helpers.errors import assert_one_line_model_error as _one_line_error  # noqa: E402

ATOL = 1e-4
BATCH, SEQ = 4, 32
LAYOUTS = [(1, 8), (2, 4), (4, 2)]  # (groups, sp)


@nnx.jit
def forward(model, tokens):
    return model(tokens)


def mesh_for(groups, sp, num_heads=8, num_kv_heads=2):
    layout = basp_jax.Layout.plan(8, BATCH, SEQ, num_heads, num_kv_heads, groups=groups)
    assert (layout.groups, layout.sp) == (groups, sp)
    return basp_jax.make_mesh(layout)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, hf_tiny.VOCAB, (BATCH, SEQ)).astype(np.int32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokens):
    """family -> (directory, transformers logits for `tokens`)."""
    out = {}
    for family in hf_tiny.FAMILIES:
        directory = tmp_path_factory.mktemp(family)
        torch_model = hf_tiny.save(family, directory)
        out[family] = (str(directory), hf_tiny.torch_logits(torch_model, tokens))
    return out


@pytest.mark.parametrize("family", hf_tiny.FAMILIES)
def test_config_read_from_hf(checkpoints, family):
    config = models.ModelConfig.from_hf(checkpoints[family][0])
    assert config.model_type == family
    assert config.attention_bias == (family == "qwen2")
    assert config.qk_norm == (family == "qwen3")
    assert config.tie_word_embeddings == (family == "llama")
    if family == "llama":
        assert config.rope_type == "llama3" and config.rope_scaling["factor"] == 8.0
    if family == "qwen3":
        assert config.head_dim == 16 != config.hidden_size // config.num_heads


@pytest.mark.parametrize("family", hf_tiny.FAMILIES)
def test_logits_match_transformers_single_device(checkpoints, tokens, family):
    directory, expected = checkpoints[family]
    model = models.from_pretrained(directory)
    logits = forward(model, jnp.asarray(tokens))
    assert logits.shape == (BATCH, SEQ, hf_tiny.VOCAB) and logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits), expected, atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("family", hf_tiny.FAMILIES)
def test_logits_match_transformers_on_8_devices(checkpoints, tokens, family):
    directory, expected = checkpoints[family]
    for groups, sp in LAYOUTS:
        mesh = mesh_for(groups, sp)
        strategy = "hsdp" if groups == 2 else "fsdp"
        model = models.from_pretrained(directory, mesh=mesh, param_sharding=strategy)
        kernel = model.layers.mlp.up_proj.kernel[...]
        assert len(kernel.sharding.device_set) == 8 and not kernel.sharding.is_fully_replicated
        logits = forward(model, jnp.asarray(tokens))
        want = NamedSharding(mesh, P("group", "seq", None))
        assert logits.sharding.is_equivalent_to(want, 3), (groups, sp, logits.sharding)
        np.testing.assert_allclose(np.asarray(logits), expected, atol=ATOL, rtol=0,
                                   err_msg=f"layout groups={groups} sp={sp}")


def test_host_sharded_load_keeps_every_parameter_inside_a_host(checkpoints, tokens):
    """from_pretrained under host sharding: each parameter split over the devices of one host by
    its logical axis names (basp_jax.sharding.RULES), the embedding's per-host lookup on, and
    the logits still transformers'."""
    directory, expected = checkpoints["qwen3"]
    layout = basp_jax.Layout.plan(8, BATCH, SEQ, 8, 2, devices_per_host=4)
    model = models.from_pretrained(directory, mesh=basp_jax.make_mesh(layout), layout=layout,
                                   param_sharding="host")
    assert model.embed_tokens.table.per_host
    for param in (model.embed_tokens.weight, model.layers.mlp.down_proj.kernel):
        sharding = param[...].sharding
        assert sharding.mesh.axis_names == ("host", "local")
        assert "local" in sharding.spec and "host" not in sharding.spec
    # called eagerly: one program whose token and logit shardings are stated (jit could not
    # name a sharding it inferred on the host mesh)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", hf_tiny.FAMILIES)
def test_round_trip_through_transformers(checkpoints, tokens, tmp_path, family):
    directory, expected = checkpoints[family]
    model = models.from_pretrained(directory)
    models.save_pretrained(model, tmp_path)
    assert os.path.isfile(tmp_path / "model.safetensors")
    reloaded = hf_tiny.load_torch(tmp_path)
    state = models.hf_state_dict(model)
    torch_state = {k: v.numpy() for k, v in reloaded.state_dict().items()}
    if family == "llama":  # tied: transformers lists the shared matrix under both names
        assert "lm_head.weight" not in state
        torch_state.pop("lm_head.weight")
    assert state.keys() == torch_state.keys()
    for name, value in state.items():
        np.testing.assert_array_equal(value, torch_state[name], err_msg=name)
    assert type(reloaded).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                       "qwen3": "Qwen3ForCausalLM"}[family]
    np.testing.assert_allclose(hf_tiny.torch_logits(reloaded, tokens), expected, atol=ATOL, rtol=0)
    ours = forward(models.from_pretrained(str(tmp_path)), jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(ours), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_attention_bias_variant_matches_transformers(tmp_path, tokens, family):
    """attention_bias=True in llama/qwen3 puts a bias on q/k/v *and* o_proj (unlike qwen2)."""
    import torch
    import transformers

    config = hf_tiny.hf_config(family)
    config.attention_bias = True
    config.tie_word_embeddings = False
    config._attn_implementation = "eager"
    torch.manual_seed(1)
    cls = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[family]
    torch_model = cls(config).float().eval()
    with torch.no_grad():
        for name, p in torch_model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.08 * torch.randn_like(p))
    torch_model.save_pretrained(tmp_path)
    model = models.from_pretrained(str(tmp_path))
    assert model.config.attention_bias and model.config.attention_out_bias
    assert model.layers.self_attn.o_proj.bias is not None
    np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(tokens))),
                               hf_tiny.torch_logits(torch_model, tokens), atol=ATOL, rtol=0)


@pytest.mark.slow
def test_sharded_checkpoint_both_ways(checkpoints, tokens, tmp_path):
    """transformers' sharded files + index load onto a mesh; ours shard too and transformers reads
    them."""
    _, expected = checkpoints["qwen3"]
    hf_dir = tmp_path / "hf"
    hf_tiny.save("qwen3", hf_dir, max_shard_size="50KB")
    assert os.path.isfile(hf_dir / "model.safetensors.index.json")
    mesh = mesh_for(2, 4)
    model = models.from_pretrained(str(hf_dir), mesh=mesh)
    np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(tokens))), expected,
                               atol=ATOL, rtol=0)

    # The trainer's path: a sharded random model, then the checkpoint's parameters on top.
    config = models.ModelConfig.from_hf(hf_dir)
    fresh = models.init_model(config, mesh=mesh, seed=5)
    nnx.update(fresh, models.load_hf_params(str(hf_dir), config, mesh=mesh))
    np.testing.assert_allclose(np.asarray(forward(fresh, jnp.asarray(tokens))), expected,
                               atol=ATOL, rtol=0)

    out_dir = tmp_path / "ours"
    models.save_pretrained(model, out_dir, max_shard_size=50_000)
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not os.path.exists(out_dir / "model.safetensors")
    np.testing.assert_allclose(hf_tiny.torch_logits(hf_tiny.load_torch(out_dir), tokens), expected,
                               atol=ATOL, rtol=0)


@pytest.mark.slow
def test_bfloat16_checkpoint_and_compute(tmp_path, checkpoints, tokens):
    """A bfloat16 checkpoint loads (safetensors >= 0.8 reads BF16); bf16 compute stays near f32."""
    import torch

    torch_model = hf_tiny.build("llama").to(torch.bfloat16)
    torch_model.save_pretrained(tmp_path)
    f32 = models.from_pretrained(str(tmp_path), dtype=jnp.float32)
    bf16 = models.from_pretrained(str(tmp_path), dtype=jnp.bfloat16)
    assert bf16.layers.self_attn.q_proj.kernel[...].dtype == jnp.bfloat16
    # The bf16 weights upcast exactly, so the float32 model equals transformers in float32. (Load it
    # afresh: torch_model.float() would keep the rope inv_freq buffer rounded to bf16.)
    expected = hf_tiny.torch_logits(hf_tiny.load_torch(tmp_path), tokens)
    np.testing.assert_allclose(np.asarray(forward(f32, jnp.asarray(tokens))), expected,
                               atol=ATOL, rtol=0)
    low = np.asarray(forward(bf16, jnp.asarray(tokens)))
    assert low.dtype == np.float32
    np.testing.assert_allclose(low, expected, atol=0.15, rtol=0)
    models.save_pretrained(bf16, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    from models.safetensors_io import SafetensorsFile

    written = SafetensorsFile(str(tmp_path / "out" / "model.safetensors"))
    assert written.get("model.layers.0.mlp.down_proj.weight").dtype == jnp.bfloat16


# -- errors: one line each ----------------------------------------------------------------------


def test_errors_are_one_line(checkpoints, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    _one_line_error(lambda: models.from_pretrained(str(tmp_path / "nowhere")), "config.json")
    good = checkpoints["qwen2"][0]

    unknown = tmp_path / "unknown"
    shutil.copytree(good, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    _one_line_error(lambda: models.from_pretrained(str(unknown)), "gpt2", "model_type")

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(os.path.join(good, "config.json"), no_weights)
    _one_line_error(lambda: models.from_pretrained(str(no_weights)), "model.safetensors")

    tensors = load_file(os.path.join(good, "model.safetensors"))
    missing = tmp_path / "missing"
    missing.mkdir()
    shutil.copy(os.path.join(good, "config.json"), missing)
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.bias"},
              str(missing / "model.safetensors"), metadata={"format": "pt"})
    _one_line_error(lambda: models.from_pretrained(str(missing)),
                    "model.layers.1.self_attn.k_proj.bias")

    bad_shape = tmp_path / "bad_shape"
    bad_shape.mkdir()
    shutil.copy(os.path.join(good, "config.json"), bad_shape)
    name = "model.layers.0.mlp.up_proj.weight"
    save_file({**tensors, name: tensors[name][:-1]}, str(bad_shape / "model.safetensors"),
              metadata={"format": "pt"})
    message = _one_line_error(lambda: models.from_pretrained(str(bad_shape)), name)
    assert "(159, 64)" in message and "(160, 64)" in message

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    shutil.copy(os.path.join(good, "config.json"), corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\xff" * 16)
    _one_line_error(lambda: models.from_pretrained(str(corrupt)), "safetensors")

    index_dir = tmp_path / "bad_index"
    index_dir.mkdir()
    shutil.copy(os.path.join(good, "config.json"), index_dir)
    (index_dir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    _one_line_error(lambda: models.from_pretrained(str(index_dir)), "model-00001-of-00002")


def test_an_export_that_would_not_be_finite_is_refused_before_writing(checkpoints, tmp_path):
    """save_pretrained never writes inf or NaN: a weight of 1e6 in float16 (largest 65504), or a
    NaN, is one line naming the tensor (a layer stack's with *) and its largest |value|, and
    nothing is written; the same weights export in float32."""
    model = models.from_pretrained(checkpoints["qwen2"][0])
    state = nnx.state(model, nnx.Param)
    params = jax.tree.map(np.array, nnx.to_pure_dict(state))
    params["layers"]["mlp"]["down_proj"]["kernel"][1, 0, 0] = 1e6
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    _one_line_error(lambda: models.save_pretrained(model, tmp_path / "f16", dtype="float16"),
                    "model.layers.*.mlp.down_proj.weight", "1e+06", "float16")
    assert not (tmp_path / "f16").exists()
    models.save_pretrained(model, tmp_path / "f32", dtype="float32")
    params["norm"]["weight"][0] = np.nan
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    _one_line_error(lambda: models.save_pretrained(model, tmp_path / "nan"), "model.norm.weight",
                    "NaN")
    assert not (tmp_path / "nan").exists()


def test_loading_onto_a_mesh_hands_each_device_only_its_slice(checkpoints, monkeypatch):
    """Under FSDP every device's callback returns 1/8 of a large tensor, never the whole of it."""
    blocks = {}
    original = jax.make_array_from_callback

    def spy(shape, sharding, callback, *args, **kwargs):
        def recording(index):
            block = callback(index)
            blocks.setdefault(tuple(shape), []).append(block.shape)
            return block
        return original(shape, sharding, recording, *args, **kwargs)

    monkeypatch.setattr(jax, "make_array_from_callback", spy)
    models.from_pretrained(checkpoints["qwen2"][0], mesh=mesh_for(2, 4), param_sharding="fsdp")
    embed_shape = (hf_tiny.VOCAB, 64)
    assert blocks[embed_shape] == [(hf_tiny.VOCAB // 8, 64)] * 8
    # gate/up stacked over 2 layers; ours [layers, in, out], read from [out, in] and transposed,
    # split on `in`, the major axis (basp_jax.sharding.RULES)
    up_proj = (2, 64, 160)
    assert blocks[up_proj] == [(2, 8, 160)] * 8 * 2
