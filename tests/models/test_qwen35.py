"""The Qwen3.5 hybrid (Gated DeltaNet + gated full attention) against transformers' on one device.

Tolerance: float32 logits agree with transformers' (eager attention, its torch fallbacks of the
conv and the chunked delta rule, float32) to atol 2e-4 on logits of magnitude ~4; the observed
difference is ~6e-5, about what transformers' own float32 forward differs from its float64 one
(~1e-4): the long-memory recurrence of random weights is ill-conditioned.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("torch")
pytest.importorskip("transformers")

import models  # noqa: E402
from models import linear_attention as la  # noqa: E402

from tests.helpers import hf_tiny  # noqa: E402
from tests.helpers.errors import assert_one_line_model_error as _one_line_error  # noqa: E402

ATOL = 2e-4
BATCH, SEQ = 2, 96  # SEQ not a multiple of the delta rule's chunk: its padding runs too


@nnx.jit
def forward(model, tokens, segment_ids=None, positions=None):
    return model(tokens, segment_ids, positions)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, hf_tiny.VOCAB, (BATCH, SEQ)).astype(np.int32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokens):
    """tied -> (directory, the transformers model)."""
    out = {}
    for tied in (False, True):
        directory = tmp_path_factory.mktemp(f"qwen3_5_tied{int(tied)}")
        out[tied] = (str(directory), hf_tiny.save(hf_tiny.QWEN3_5, directory, tied=tied))
    return out


def test_config_read_from_hf(checkpoints):
    config = models.ModelConfig.from_hf(checkpoints[False][0])
    assert config.model_type == "qwen3_5_text" and config.is_hybrid
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert config.rotary_dim == 4 and config.partial_rotary_factor == 0.25
    assert config.attention_output_gate and config.qk_norm and config.rms_norm_zero_centered
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (4, 8)
    assert config.rope_scaling is None  # the partial factor is not a scaling
    assert not config.tie_word_embeddings and models.ModelConfig.from_hf(
        checkpoints[True][0]).tie_word_embeddings


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers(checkpoints, tokens, tied):
    """Untied, and tied with tile_tokens (both mixers' output projections and the MLP over
    token chunks)."""
    directory, torch_model = checkpoints[tied]
    model = models.from_pretrained(directory, tile_tokens=64 if tied else None)
    assert [type(b.mixer).__name__ for b in model.layers] == ["GatedDeltaNet"] * 3 + ["Attention"]
    logits = np.asarray(forward(model, jnp.asarray(tokens)))
    expected = hf_tiny.torch_logits(torch_model, tokens)
    assert np.abs(expected).max() > 1  # not vanishing: a real comparison
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_gradients_match_torch_autograd(checkpoints, tokens):
    """d(sum(logits * w))/d(every parameter), ours (by Hugging Face name) against torch's."""
    import torch

    directory, torch_model = checkpoints[False]
    weights = np.random.default_rng(1).normal(size=(BATCH, SEQ, hf_tiny.VOCAB)).astype(np.float32)
    torch_model.zero_grad()
    logits = torch_model(input_ids=torch.from_numpy(tokens).long()).logits
    (logits * torch.from_numpy(weights)).sum().backward()
    expected = {name: p.grad.numpy() for name, p in torch_model.named_parameters()}

    model = models.from_pretrained(directory)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def grads(params):
        def objective(params):
            return jnp.sum(nnx.merge(graphdef, params, rest)(jnp.asarray(tokens)) * weights)
        return jax.grad(objective)(params)

    ours = models.hf_state_dict(grads(params))
    assert ours.keys() == expected.keys()
    worst = 0.0
    for name, grad in ours.items():
        scale = max(np.abs(expected[name]).max(), 1.0)
        error = np.abs(grad - expected[name]).max() / scale
        worst = max(worst, error)
        assert error < 2e-4, (name, error)
    assert worst > 0  # compared something


# -- Hugging Face checkpoints ---------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_round_trip_through_transformers(checkpoints, tokens, tmp_path, tied):
    """save_pretrained writes a Qwen3_5ForCausalLM directory transformers loads with the same
    tensors and logits; ours loads it back equal."""
    directory, torch_model = checkpoints[tied]
    model = models.from_pretrained(directory)
    models.save_pretrained(model, tmp_path)
    reloaded = hf_tiny.load_torch(tmp_path)
    assert type(reloaded).__name__ == "Qwen3_5ForCausalLM"
    assert reloaded.config.layer_types == list(model.config.layer_types)
    state = models.hf_state_dict(model)
    torch_state = {k: v.numpy() for k, v in reloaded.state_dict().items()}
    if tied:  # transformers lists the shared matrix under both names
        torch_state.pop("lm_head.weight")
    assert state.keys() == torch_state.keys()
    for name, value in state.items():
        np.testing.assert_array_equal(value, torch_state[name], err_msg=name)
    expected = hf_tiny.torch_logits(torch_model, tokens)
    np.testing.assert_allclose(hf_tiny.torch_logits(reloaded, tokens), expected, atol=ATOL, rtol=0)
    assert models.ModelConfig.from_hf(str(tmp_path)) == model.config


@pytest.mark.slow
def test_text_model_of_a_multimodal_checkpoint(tmp_path, tokens, caplog):
    """A qwen3_5 (vision-language) directory: its text model loads (the text_config, the
    tensors under model.language_model., the head tied as the outer config says), the vision
    tower is left with one log line, and the logits equal the whole transformers model's on
    text."""
    tied = True
    torch_model = hf_tiny.save_qwen3_5_multimodal(tmp_path, tied=tied)
    with caplog.at_level("WARNING", logger="models.config"):
        model = models.from_pretrained(str(tmp_path))
    assert len([r for r in caplog.records if "vision" in r.getMessage()]) == 1
    assert model.config.model_type == "qwen3_5_text"
    assert model.config.tie_word_embeddings == tied
    np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(tokens))),
                               hf_tiny.torch_logits(torch_model, tokens), atol=ATOL, rtol=0)


# -- the delta rule and the conv ----------------------------------------------------------------


def _rule_inputs(seed, batch=2, seq=150, k_heads=2, v_heads=4, dk=8, dv=8):
    rng = np.random.default_rng(seed)
    q, k = (rng.normal(size=(batch, seq, k_heads, dk)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(batch, seq, v_heads, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 2.0, size=(batch, seq, v_heads)).astype(np.float32)
    beta = rng.uniform(0, 1, size=(batch, seq, v_heads)).astype(np.float32)
    return q, k, v, g, beta


def test_chunked_and_recurrent_delta_rule_equal_transformers_float64():
    """Both our forms of the gated delta rule against transformers' recurrent one in float64
    (150 tokens: two whole chunks and a padded third; 2 key heads serving 4 value heads)."""
    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    inputs = _rule_inputs(0)
    exact, _ = hf.torch_recurrent_gated_delta_rule(
        *(torch.from_numpy(x).double() for x in inputs), use_qk_l2norm_in_kernel=True)
    exact = exact.numpy()
    starts = la.document_starts(None, *inputs[0].shape[:2])
    chunked = np.asarray(jax.jit(la.gated_delta_rule_chunked)(*inputs, starts))
    recurrent = np.asarray(jax.jit(la.gated_delta_rule_recurrent)(*inputs, starts))
    assert np.abs(exact).max() > 0.3
    np.testing.assert_allclose(recurrent, exact, atol=1e-6, rtol=0)
    np.testing.assert_allclose(chunked, exact, atol=5e-6, rtol=0)


@pytest.mark.slow
def test_delta_rule_and_conv_restart_at_document_starts():
    """Packed rows (documents of 5, 59 and 36 tokens: a start mid-chunk and one on a chunk
    edge) equal each document run alone, for both forms and the conv; gradients too."""
    q, k, v, g, beta = _rule_inputs(1, batch=1, seq=100)
    lengths = [5, 59, 36]  # starts at 5 and 64 (a chunk boundary)
    segment_ids = np.repeat(np.arange(3), lengths)[None].astype(np.int32)
    starts = la.document_starts(jnp.asarray(segment_ids), 1, sum(lengths))
    bounds = np.cumsum([0] + lengths)

    def alone(fn, *xs):
        parts = [fn(*(x[:, a:b] for x in xs), la.document_starts(None, 1, b - a))
                 for a, b in zip(bounds[:-1], bounds[1:])]
        return jnp.concatenate(parts, axis=1)

    for rule in (la.gated_delta_rule_chunked, la.gated_delta_rule_recurrent):
        @jax.jit
        def both(q):  # (packed, alone) and their gradients, one program
            def packed(q):
                return rule(q, k, v, g, beta, starts)

            def apart(q):
                return alone(rule, q, k, v, g, beta)
            grads = [jax.grad(lambda q: jnp.sum(f(q) ** 2))(q) for f in (packed, apart)]
            return packed(q), apart(q), *grads

        packed, apart, d_packed, d_apart = both(q)
        np.testing.assert_allclose(packed, apart, atol=2e-6, rtol=0, err_msg=rule.__name__)
        np.testing.assert_allclose(d_packed, d_apart, atol=1e-5, rtol=0, err_msg=rule.__name__)

    x = np.random.default_rng(2).normal(size=(1, sum(lengths), 6)).astype(np.float32)
    weight = np.random.default_rng(3).normal(size=(6, 4)).astype(np.float32)
    packed = la.causal_conv(x, weight, starts)
    np.testing.assert_allclose(packed, alone(lambda x, s: la.causal_conv(x, weight, s), x),
                               atol=1e-6, rtol=0)
    assert not np.allclose(packed, la.causal_conv(x, weight, la.document_starts(None, 1, 100)))


def test_chunked_gradients_equal_recurrent():
    """Over 40 tokens in chunks of 16 (the last padded), every input's gradient."""
    inputs = _rule_inputs(4, seq=40)
    starts = la.document_starts(None, 2, 40)

    def loss(rule):
        return lambda *xs: jnp.sum(jnp.sin(rule(*xs, starts)))

    def chunked_16(*xs):
        return la.gated_delta_rule_chunked(*xs, chunk=16)

    argnums = tuple(range(5))
    chunked = jax.jit(jax.grad(loss(chunked_16), argnums))(*inputs)
    recurrent = jax.jit(jax.grad(loss(la.gated_delta_rule_recurrent), argnums))(*inputs)
    for name, a, b in zip("q k v g beta".split(), chunked, recurrent):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=0, err_msg=name)


@pytest.mark.slow
def test_packed_documents_equal_separate_sequences(checkpoints):
    """The whole model on one row holding two documents equals each document alone (the
    DeltaNet's state and conv restart, attention stays inside its segment, positions restart)."""
    model = models.from_pretrained(checkpoints[False][0])
    rng = np.random.default_rng(5)
    first, second = (rng.integers(0, hf_tiny.VOCAB, (1, n)).astype(np.int32) for n in (40, 56))
    packed = jnp.asarray(np.concatenate([first, second], axis=1))
    segment_ids = jnp.asarray(np.repeat([[1, 2]], [40, 56], axis=1).astype(np.int32))
    together = np.asarray(forward(model, packed, segment_ids))
    apart = np.concatenate([np.asarray(forward(model, jnp.asarray(t))) for t in (first, second)],
                           axis=1)
    np.testing.assert_allclose(together, apart, atol=2e-5, rtol=0)


# -- sequence parallel ---------------------------------------------------------------------------


def _logits_and_grads(model, tokens, segment_ids, weights):
    """(logits, {Hugging Face name: d(sum(logits * weights))/d(parameter)}), one program."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def run(params, tokens, segment_ids):
        def objective(params):
            logits = nnx.merge(graphdef, params, rest)(tokens, segment_ids)
            return jnp.sum(logits * weights), logits
        return jax.grad(objective, has_aux=True)(params)[::-1]

    logits, grads = run(params, jnp.asarray(tokens), jnp.asarray(segment_ids))
    return np.asarray(logits), models.hf_state_dict(grads)


def _packed_batch(seed):
    """Fresh random tokens, two rows of packed documents (one start mid-chunk, one at a
    device's shard edge) and the objective's weights."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, hf_tiny.VOCAB, (BATCH, SEQ)).astype(np.int32)
    segment_ids = np.stack([np.repeat([0, 1, 2], [30, 42, 24]), np.repeat([0, 1], [48, 48])])
    weights = rng.normal(size=(BATCH, SEQ, hf_tiny.VOCAB)).astype(np.float32)
    return tokens, segment_ids.astype(np.int32), weights


@pytest.fixture(scope="module")
def one_device(checkpoints):
    """A fresh packed batch and one device's logits and gradients for it (both layouts' reference)."""
    directory = checkpoints[False][0]
    batch = _packed_batch(14)
    return batch, _logits_and_grads(models.from_pretrained(directory), *batch)


@pytest.mark.slow
@pytest.mark.parametrize("groups,sp", [(2, 4), (1, 8)])
def test_layouts_equal_one_device(checkpoints, one_device, groups, sp):
    """BASP (2 groups of 4) and Ulysses (8): the DeltaNet's all-to-all gives each device whole
    sequences for 1/sp of the heads (sp=8 > 4 key heads: q and k repeated to the 8 value
    heads); logits and every parameter's gradient equal one device's, packed documents too."""
    import basp_jax

    directory = checkpoints[False][0]
    (tokens, segment_ids, weights), (want_logits, want_grads) = one_device
    layout = basp_jax.Layout.plan(8, BATCH, SEQ, 8, 2, groups=groups)
    assert (layout.groups, layout.sp) == (groups, sp)
    model = models.from_pretrained(directory, mesh=basp_jax.make_mesh(layout), layout=layout)
    assert model.layers[0].linear_attn.expand_keys == (sp == 8)
    logits, grads = _logits_and_grads(model, tokens, segment_ids, weights)
    np.testing.assert_allclose(logits, want_logits, atol=2e-5, rtol=0)
    for name, grad in grads.items():
        scale = max(np.abs(want_grads[name]).max(), 1.0)
        # relative to the largest. The decay's gradients (A_log, dt_bias, in_proj_a), sums over
        # every token with cancellation, are the worst conditioned: one device's and the
        # mesh's each differ from a float64 run by up to ~9e-5, so from each other by up to
        # twice that; the other parameters' agree to < 1e-5.
        assert np.abs(grad - want_grads[name]).max() / scale < 3e-4, name


def _step_gradients(checkpoint: str, run_dir, strategy: str, params=None):
    """(params, (mean gradients, loss sum, tokens)) of the trainer's step of 2 microbatches of
    2 rows on the emulated 2 hosts x 4 (BASP, one group per host), float32, under
    parallel.param_sharding=strategy; params: the parameters to start from (else its own)."""
    from flax import traverse_util

    from tests.helpers.trainer import tiny_overrides
    from train.config.schema import load_config
    from train.prepare import model_config
    from train.program import state as prog
    from train.program.step import build_model, make_step_gradients

    overrides = [o for o in tiny_overrides(
        run_dir, "model.dtype=float32", "model.remat=full", "train.microbatch_size=2",
        "train.grad_accum=2", f"parallel.param_sharding={strategy}", "parallel.devices_per_host=4")
        if not o.startswith(("model.preset", "model.shape"))]
    cfg = load_config(None, [*overrides, f"model.hf_path={checkpoint}"])
    mcfg = model_config(cfg)
    plan = prog.plan_run(cfg, mcfg, jax.devices(), 4)
    assert (plan.layout.groups, plan.layout.sp) == (2, 4)
    parts = build_model(prog.model_factory(cfg, mcfg, plan), plan.rules)
    program = prog.build_program(cfg, plan, parts)
    params = jax.device_put(parts.params if params is None else params, program.param_shardings)
    tokens = np.random.default_rng(2).integers(0, mcfg.vocab_size, program.batch_shape)
    targets = np.roll(tokens, -1, axis=-1)
    targets[..., -1] = -100
    batch = {k: jax.device_put(v.astype(np.int32), program.batch_sharding)
             for k, v in (("tokens", tokens), ("targets", targets))}
    gradients = make_step_gradients(parts, program.param_shardings,
                                    loss_fn=models.causal_lm_loss, packed=False)
    with jax.set_mesh(plan.mesh):
        grads, loss, count = jax.jit(lambda p, b: gradients(p, b, None))(params, batch)
    flat = traverse_util.flatten_dict(jax.device_get(grads))
    return jax.device_get(params), (flat, float(loss), float(count))


@pytest.mark.slow
def test_hosts_gradient_sums_equal_fsdps_step(checkpoints, tmp_path):
    """staged_keep with 2 microbatches, each host keeping its own gradient sum
    (train.program.per_group: the model mapped over the groups, the Gated DeltaNet's
    exchanges and tables inside it): the step's loss and mean gradients equal fsdp's step on
    the same parameters and rows, to the decay gradients' conditioning (as above)."""
    directory = checkpoints[False][0]
    params, (want, want_loss, want_count) = _step_gradients(directory, tmp_path / "fsdp", "fsdp")
    _, (got, loss, count) = _step_gradients(directory, tmp_path / "keep", "staged_keep", params)
    assert count == want_count
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        scale = max(np.abs(grad).max(), 1.0)
        assert np.abs(got[name] - grad).max() / scale < 3e-4, name


def test_layouts_the_linear_layers_cannot_use_are_refused(checkpoints):
    """Refused when the model is built, in one line: a ring, and an sp that divides neither
    the DeltaNet's key nor value heads."""
    import basp_jax

    directory = checkpoints[False][0]
    ring = basp_jax.Layout.plan(8, BATCH, SEQ, 8, 2, groups=1, ring=2)
    _one_line_error(lambda: models.from_pretrained(directory, mesh=basp_jax.make_mesh(ring),
                                                   layout=ring), "ring", "linear_attention")
    with open(f"{directory}/config.json") as f:
        config = models.ModelConfig.from_hf({**json.load(f), "linear_num_key_heads": 3,
                                             "linear_num_value_heads": 6})
    layout = basp_jax.Layout.plan(8, BATCH, SEQ, 8, 2, groups=2)
    _one_line_error(lambda: models.abstract_model(config, mesh=basp_jax.make_mesh(layout),
                                                  layout=layout), "linear_num_value_heads=6",
                    "sp=4")


@pytest.mark.slow
@pytest.mark.usefixtures("compile_cache")
def test_trainer_from_a_hf_directory_trains_under_basp(checkpoints, tmp_path):
    """train.py's run from a tiny Qwen3.5 directory under BASP (4 groups of 2): the loss falls.
    (That BASP and Ulysses equal one device, logits and gradients, is
    test_layouts_equal_one_device's.)"""
    from train.config.schema import load_config
    from train.loop import run

    from tests.helpers.trainer import tiny_overrides

    overrides = [o for o in tiny_overrides(tmp_path / "basp", "parallel.mode=basp", "train.steps=3")
                 if not o.startswith(("model.preset", "model.shape"))]
    basp = run(load_config(None, [*overrides, f"model.hf_path={checkpoints[False][0]}"]))
    assert basp["layout"].groups == 4
    assert len(basp["losses"]) == 3 and basp["losses"][-1] < basp["losses"][0]


@pytest.mark.parametrize("extra,word", [(("parallel.ring=2",), "ring"),
                                        (("optimizer.offload=true", "model.remat=auto"),
                                         "offload")])
def test_trainer_refuses_what_the_hybrid_cannot_run_in_one_line(checkpoints, tmp_path, extra,
                                                                word):
    """train.py on a Qwen3.5 directory with a ring (parallel.ring=2) or the streamed step
    (optimizer.offload=true, which streams a scanned stack): exit status 2, one line naming it,
    before anything compiles, and no run directory."""
    from tests.helpers.trainer import tiny_overrides, train_cmd

    overrides = [o for o in tiny_overrides(tmp_path / "run", "train.microbatch_size=1", *extra)
                 if not o.startswith(("model.preset", "model.shape"))]
    result = train_cmd(*overrides, f"model.hf_path={checkpoints[False][0]}")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and word in lines[0] and "linear_attention" in lines[0], lines
    assert not (tmp_path / "run").exists()


# -- config -------------------------------------------------------------------------------------


def test_bad_hybrid_configs_are_one_line(checkpoints):
    with open(f"{checkpoints[False][0]}/config.json") as f:
        good = json.load(f)
    _one_line_error(lambda: models.ModelConfig.from_hf(
        {**good, "layer_types": ["linear_attention"] * 3}), "layer_types", "3")
    _one_line_error(lambda: models.ModelConfig.from_hf(
        {**good, "layer_types": ["mamba"] * 4}), "mamba")
    _one_line_error(lambda: models.ModelConfig.from_hf(
        {**good, "linear_num_value_heads": 6}), "linear_num_value_heads")
    no_heads = {k: v for k, v in good.items() if k != "linear_key_head_dim"}
    _one_line_error(lambda: models.ModelConfig.from_hf(no_heads), "linear_key_head_dim")
    _one_line_error(lambda: models.ModelConfig.from_hf(
        {**good, "rope_parameters": {**good["rope_parameters"], "partial_rotary_factor": 0.1}}),
        "partial_rotary_factor")
    _one_line_error(lambda: models.ModelConfig.from_hf({"model_type": "qwen3_5"}), "text_config")
    model = models.from_pretrained(checkpoints[False][0])
    _one_line_error(lambda: model.init_cache(1, 8), "linear_attention")


def test_parameter_count_and_flops_count_the_hybrid(checkpoints):
    """num_params (the cost model's, which the planner and MFU use) equals transformers' count,
    tied or not (the 9B preset's: tests/models/test_presets.py); attention FLOPs count only the
    attention layers."""
    for tied in (False, True):
        directory, torch_model = checkpoints[tied]
        expected = sum(p.numel() for p in torch_model.parameters())  # shared tensors once
        assert models.ModelConfig.from_hf(directory).num_params() == expected
    shape = models.ModelConfig.preset("qwen3.5-9b").shape
    assert shape.attention_flops_per_token(4096) == 12 * 8 * 16 * 256 * 4096 / 2
    assert shape.linear_attention_flops_per_token() == 24 * 24 * 32 * 128 * 128


def test_layer_types_default_from_full_attention_interval(checkpoints):
    with open(f"{checkpoints[False][0]}/config.json") as f:
        data = {k: v for k, v in json.load(f).items() if k != "layer_types"}
    config = models.ModelConfig.from_hf({**data, "full_attention_interval": 2})
    assert config.layer_types == ("linear_attention", "full_attention") * 2
