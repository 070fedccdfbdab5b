"""Qwen3.5-MoE (the Qwen3.5 hybrid with sparse MLPs and a shared expert) against transformers'
Qwen3_5MoeForCausalLM: logits and the load-balancing loss on one device, BASP (2, 4) and Ulysses
(1, 8); the training objective's gradients on both layouts against one device's; the export, the
text model of a vision-language directory, the config.

Tolerances: the routers are spread (hf_tiny.ROUTER_STD) so no top-k choice on the test tokens is
within MARGIN of a tie. Logits of magnitude ~3 agree with transformers' to ATOL (observed ~1.5e-5:
the Gated DeltaNet's recurrence, tests/models/test_qwen35.py); gradients as test_qwen35's.
"""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("torch")
pytest.importorskip("transformers")

import models  # noqa: E402
from models import moe  # noqa: E402

from tests.helpers import hf_tiny  # noqa: E402
from tests.helpers.errors import assert_one_line_model_error as _one_line_error  # noqa: E402
from tests.helpers.flags import WHOLE_MATRIX  # noqa: E402
from tests.helpers.one_device import objective_and_gradients  # noqa: E402

ATOL = 5e-5
MARGIN = 1e-3
BATCH, SEQ = 2, 64
SEED = 4  # the tiny model's: its routers' choices on `tokens` are far from ties


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, hf_tiny.VOCAB, (BATCH, SEQ)).astype(np.int32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokens):
    """(directory, the transformers model, its (logits, aux_loss) on `tokens`)."""
    directory = tmp_path_factory.mktemp("qwen3_5_moe")
    torch_model = hf_tiny.save(hf_tiny.QWEN3_5_MOE, directory, seed=SEED)
    assert hf_tiny.router_margin(torch_model, tokens) > MARGIN
    return str(directory), torch_model, hf_tiny.torch_logits_and_aux(torch_model, tokens)


def _sparse_layers(model):
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, moe.SparseMoE)]


def test_config_read_from_hf(checkpoint):
    directory, torch_model, _ = checkpoint
    config = models.ModelConfig.from_hf(directory)
    assert config.model_type == "qwen3_5_moe_text" and config.is_hybrid and config.is_moe
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.shared_expert_intermediate_size) == (8, 2, 32, 48)
    assert config.norm_topk_prob and config.sparse_layers == config.num_layers == 4
    assert config.router_aux_loss_coef == 0.01 and config.attention_output_gate
    assert config.num_params() == sum(p.numel() for p in torch_model.parameters())


def test_logits_and_aux_loss_match_transformers(checkpoint, tokens):
    """One device: every layer's MLP the routed experts plus the gated shared expert; the
    load-balancing loss is transformers' aux_loss."""
    directory, _, (want_logits, want_aux) = checkpoint
    model = models.from_pretrained(directory)
    assert len(_sparse_layers(model)) == 4
    assert all(hasattr(m, "shared_expert") for m in _sparse_layers(model))
    logits, aux = hf_tiny.logits_and_aux_program(model)(tokens)
    assert np.abs(want_logits).max() > 1
    np.testing.assert_allclose(np.asarray(logits), want_logits, atol=ATOL, rtol=0)
    np.testing.assert_allclose(float(aux), want_aux, rtol=1e-6)


def test_shared_expert_is_gated_per_token(checkpoint, tokens):
    """The shared expert's contribution is sigmoid(x @ shared_expert_gate) * shared_expert(x):
    without it (its down projection zeroed) the logits move; gated shut (a gate of -1e4) they
    equal those without it."""
    directory, _, (want_logits, _) = checkpoint

    def logits_with(change):
        model = models.from_pretrained(directory)
        for mlp in _sparse_layers(model):
            change(mlp)
        return np.asarray(hf_tiny.logits_and_aux_program(model)(tokens)[0])

    def no_shared(mlp):
        mlp.shared_expert.down_proj.kernel[...] = jnp.zeros_like(
            mlp.shared_expert.down_proj.kernel[...])

    def gate_shut(mlp):
        mlp.shared_expert_gate = _Constant(-1e4)  # sigmoid(-1e4) = 0 for every token

    without = logits_with(no_shared)
    assert np.abs(without - want_logits).max() > 1e-2
    # (two programs: their float32 sums differ in order, ~7e-6)
    np.testing.assert_allclose(logits_with(gate_shut), without, atol=2e-5, rtol=0)


class _Constant(nnx.Module):
    """A stand-in gate projection: `value` for every token."""

    def __init__(self, value):
        self.value = value

    def __call__(self, x):
        return jnp.full((*x.shape[:-1], 1), self.value, x.dtype)


@pytest.mark.slow
@pytest.mark.parametrize("groups,sp", [(2, 4), (1, 8)])
def test_layouts_match_transformers(checkpoint, tokens, groups, sp):
    """BASP (2 groups of 4) and Ulysses (8): the DeltaNet's and attention's all-to-alls inside
    each group, the experts split over it (expert_parallel auto), the shared expert on each
    device's own tokens; logits and the load-balancing loss are transformers'."""
    import basp_jax

    directory, _, (want_logits, want_aux) = checkpoint
    layout = basp_jax.Layout.plan(8, BATCH, SEQ, 8, 2, groups=groups, devices_per_host=sp)
    assert (layout.groups, layout.sp) == (groups, sp)
    model = models.from_pretrained(directory, mesh=basp_jax.make_mesh(layout), layout=layout)
    assert {m.split_experts for m in _sparse_layers(model)} == {sp}
    logits, aux = hf_tiny.logits_and_aux_program(model)(tokens)
    np.testing.assert_allclose(np.asarray(logits), want_logits, atol=ATOL, rtol=0)
    np.testing.assert_allclose(float(aux), want_aux, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("groups", [2, pytest.param(1, marks=WHOLE_MATRIX)])
def test_objective_and_gradients_on_basp_and_ulysses_equal_one_device(checkpoint, tokens,
                                                                     groups):
    """The training objective (the loss plus router_aux_loss_coef x the load-balancing loss) and
    every parameter's gradient on BASP (2, 4) and Ulysses (1, 8) equal one device's."""
    import basp_jax

    directory = checkpoint[0]
    layout = basp_jax.Layout.plan(8, BATCH, SEQ, 8, 2, groups=groups)
    results = [objective_and_gradients(models.from_pretrained(directory, **options), tokens)
               for options in ({}, dict(mesh=basp_jax.make_mesh(layout), layout=layout))]
    (v1, a1, g1), (v8, a8, g8) = results
    np.testing.assert_allclose(v8, v1, rtol=1e-5)
    np.testing.assert_allclose(a8, a1, rtol=1e-5)
    for part in ("gate", "shared_expert_gate"):  # the routers and the shared gates learn
        assert np.abs(g1[("layers", 3, "mlp", part, "kernel")]).max() > 0
    assert g8.keys() == g1.keys()
    for name, grad in g1.items():
        scale = max(np.abs(grad).max(), 1.0)
        # relative to the largest, as test_qwen35's layouts (the decay's gradients are the
        # worst conditioned)
        assert np.abs(g8[name] - grad).max() / scale < 3e-4, name


@pytest.mark.slow
def test_layers_scanned_by_period_match_transformers(tmp_path, tokens):
    """8 layers, the pattern twice: they run as 2 repeats of a Period, each repeat's experts and
    shared experts read from transformers' layer r * 4 + j; the logits and load-balancing loss
    are transformers' (to 1e-4: twice the layers' recurrence, observed 4.3e-5) and the export
    writes its tensors back bit for bit."""
    from safetensors.numpy import load_file

    torch_model = hf_tiny.save(hf_tiny.QWEN3_5_MOE, tmp_path / "hf", seed=SEED, repeats=2)
    assert hf_tiny.router_margin(torch_model, tokens) > MARGIN
    model = models.from_pretrained(str(tmp_path / "hf"))
    assert model.scanned and model.period == 4
    logits, aux = hf_tiny.logits_and_aux_program(model)(tokens)
    want_logits, want_aux = hf_tiny.torch_logits_and_aux(torch_model, tokens)
    np.testing.assert_allclose(np.asarray(logits), want_logits, atol=1e-4, rtol=0)
    np.testing.assert_allclose(float(aux), want_aux, rtol=1e-6)
    models.save_pretrained(model, tmp_path / "out")
    original, written = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "out"))
    assert written.keys() == original.keys()
    for name, value in original.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)


# -- Hugging Face checkpoints and config ----------------------------------------------------------


def test_export_round_trip_is_exact(checkpoint, tokens, tmp_path):
    """save_pretrained writes the tensors transformers wrote (per-expert names, the shared
    expert and its gate), bit for bit, and a config.json transformers loads as
    Qwen3_5MoeForCausalLM with the same logits."""
    from safetensors.numpy import load_file

    directory, _, (want_logits, _) = checkpoint
    model = models.from_pretrained(directory)
    models.save_pretrained(model, tmp_path)
    original = load_file(f"{directory}/model.safetensors")
    written = load_file(f"{tmp_path}/model.safetensors")
    assert {"model.layers.0.mlp.experts.7.down_proj.weight",
            "model.layers.3.mlp.shared_expert_gate.weight"} <= written.keys()
    assert written.keys() == original.keys()
    for name, value in original.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    assert models.ModelConfig.from_hf(str(tmp_path)) == model.config
    reloaded = hf_tiny.load_torch(tmp_path)
    assert type(reloaded).__name__ == "Qwen3_5MoeForCausalLM"
    np.testing.assert_array_equal(hf_tiny.torch_logits_and_aux(reloaded, tokens)[0],
                                  want_logits)


@pytest.mark.slow
def test_text_model_of_a_multimodal_checkpoint(tmp_path, tokens, caplog):
    """A qwen3_5_moe (vision-language) directory loads as its text model (the text_config, the
    tensors under model.language_model., the vision tower left with one log line); its logits
    equal the whole transformers model's on text."""
    torch_model = hf_tiny.save_qwen3_5_multimodal(tmp_path, seed=SEED,
                                                  family=hf_tiny.QWEN3_5_MOE)
    assert hf_tiny.router_margin(torch_model, tokens) > MARGIN
    with caplog.at_level("WARNING", logger="models.config"):
        model = models.from_pretrained(str(tmp_path))
    assert len([r for r in caplog.records if "vision" in r.getMessage()]) == 1
    assert model.config.model_type == "qwen3_5_moe_text"
    np.testing.assert_allclose(np.asarray(hf_tiny.logits_and_aux_program(model)(tokens)[0]),
                               hf_tiny.torch_logits(torch_model, tokens), atol=ATOL, rtol=0)


def test_bad_configs_are_one_line(checkpoint):
    with open(f"{checkpoint[0]}/config.json") as f:
        good = json.load(f)
    config = models.ModelConfig.from_hf(good)
    bad = {"shared_expert_intermediate_size": 0, "num_experts": 0,
           "num_experts_per_tok": 9}
    for key, value in bad.items():
        _one_line_error(lambda: models.ModelConfig.from_hf({**good, key: value}), key)
    _one_line_error(lambda: dataclasses.replace(config, norm_topk_prob=False), "norm_topk_prob")
    _one_line_error(lambda: dataclasses.replace(config, mlp_only_layers=(1,)), "mlp_only_layers")
    qwen3_moe = models.ModelConfig.preset("tiny-qwen3-moe")
    _one_line_error(lambda: dataclasses.replace(qwen3_moe, shared_expert_intermediate_size=8),
                    "shared_expert_intermediate_size")


def test_preset_has_the_published_shape():
    """qwen3.5-35b-a3b: 35B parameters, about 3B of them active per token."""
    config = models.ModelConfig.preset("qwen3.5-35b-a3b")
    shape = config.shape
    assert config.model_type == "qwen3_5_moe_text" and config.sparse_layers == 40
    assert 34.5e9 < config.num_params() < 36.5e9
    assert 2.5e9 < config.num_params() - shape.inactive_expert_params < 3.5e9
