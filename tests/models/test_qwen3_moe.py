"""Qwen3-MoE (sparse mixture-of-experts MLPs, models.moe) against transformers'
Qwen3MoeForCausalLM: logits and the load-balancing loss on one device and on 8 emulated
devices (BASP and Ulysses), the trainer's step gradients, the export, the config.

The tiny checkpoints' routers are spread (hf_tiny.ROUTER_STD) so that on the test tokens every
top-k choice wins by more than MARGIN in the router logits: float rounding (~1e-6 here) cannot
flip a choice between transformers, one device and the mesh, so the outputs compare to float32
rounding. Two checkpoints: every layer sparse (one scanned stack) and, mixed, three layers with
a dense middle one (mlp_only_layers: a list of layers).
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util

pytest.importorskip("torch")
pytest.importorskip("transformers")

import models  # noqa: E402
from models import moe  # noqa: E402

from tests.helpers import hf_tiny  # noqa: E402
from tests.helpers.errors import assert_one_line_model_error as _one_line_error  # noqa: E402
from tests.helpers.flags import WHOLE_MATRIX  # noqa: E402
from tests.helpers.one_device import objective_and_gradients  # noqa: E402

ATOL = 1e-5  # logits of magnitude ~3; observed differences ~2e-6
MARGIN = 1e-3
BATCH, SEQ = 2, 96


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, hf_tiny.VOCAB, (BATCH, SEQ)).astype(np.int32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokens):
    """mixed -> (directory, the transformers model, its (logits, aux_loss) on `tokens`)."""
    out = {}
    for mixed in (False, True):
        directory = tmp_path_factory.mktemp(f"qwen3_moe_mixed{int(mixed)}")
        torch_model = hf_tiny.save(hf_tiny.QWEN3_MOE, directory, mixed=mixed)
        assert hf_tiny.router_margin(torch_model, tokens) > MARGIN
        out[mixed] = (str(directory), torch_model,
                      hf_tiny.torch_logits_and_aux(torch_model, tokens))
    return out


def test_config_read_from_hf(checkpoints):
    config = models.ModelConfig.from_hf(checkpoints[True][0])
    assert config.model_type == "qwen3_moe" and config.qk_norm and config.is_moe
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == \
        (8, 2, 32)
    assert config.norm_topk_prob and config.router_aux_loss_coef == 0.01
    assert config.mlp_only_layers == (1,) and config.sparse_layers == 2
    assert not config.layers_alike and models.ModelConfig.from_hf(
        checkpoints[False][0]).layers_alike
    for mixed in (False, True):  # the parameter count is transformers'
        directory, torch_model, _ = checkpoints[mixed]
        expected = sum(p.numel() for p in torch_model.parameters())
        assert models.ModelConfig.from_hf(directory).num_params() == expected


@pytest.mark.parametrize("mixed", [False, True])
def test_logits_and_aux_loss_match_transformers(checkpoints, tokens, mixed):
    """One device: the scanned stack (every layer sparse) and the list (a dense layer between
    sparse ones); the load-balancing loss is transformers' aux_loss."""
    directory, _, (want_logits, want_aux) = checkpoints[mixed]
    model = models.from_pretrained(directory)
    assert model.scanned != mixed
    logits, aux = hf_tiny.logits_and_aux_program(model)(tokens)
    assert np.abs(want_logits).max() > 1
    np.testing.assert_allclose(np.asarray(logits), want_logits, atol=ATOL, rtol=0)
    np.testing.assert_allclose(float(aux), want_aux, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("groups,sp,per_host,mixed,experts,matmul,split", [
    (2, 4, 4, False, "auto", "pallas", 4), (1, 8, 4, True, "auto", "xla", 8),
    (2, 4, 8, True, "auto", "xla", 8),
    pytest.param(2, 4, 4, True, "none", "xla", 1, marks=WHOLE_MATRIX)])
def test_layouts_match_transformers(checkpoints, tokens, groups, sp, per_host, mixed, experts,
                                    matmul, split):
    """BASP (2 groups of 4) and Ulysses (8): each device routes its own tokens; the experts split
    over each seq group (expert_parallel auto: 2 or 1 of the 8 per device, the group's tokens
    gathered and the outputs scattered back inside it), over a host of 8 holding both groups,
    or whole on every device (none); logits and the load-balancing loss (its
    statistics summed over every device's tokens) are transformers'. The experts' grouped
    matmuls are XLA's ragged_dot or our Pallas kernels (basp_jax.grouped_matmul, interpreted)."""
    import basp_jax

    directory, _, (want_logits, want_aux) = checkpoints[mixed]
    layout = basp_jax.Layout.plan(8, BATCH, SEQ, 8, 2, groups=groups, devices_per_host=per_host)
    assert (layout.groups, layout.sp) == (groups, sp)
    model = models.from_pretrained(directory, mesh=basp_jax.make_mesh(layout), layout=layout,
                                   expert_parallel=experts, grouped_matmul=matmul)
    sparse = [layer.mlp for layer in ([model.layers] if model.scanned else model.layers)
              if isinstance(layer.mlp, moe.SparseMoE)]
    assert sparse and all(m.split_experts == split for m in sparse)
    assert all(m.grouped_matmul == matmul for m in sparse)
    if split > 1:  # each device's grouped matmuls hold experts / split of them
        hlo = jax.jit(lambda t: model.forward_with_aux(t)).lower(jnp.asarray(tokens)).as_text()
        assert f"{8 // split}x{hf_tiny.hf_config(hf_tiny.QWEN3_MOE).hidden_size}x32" in hlo
    logits, aux = hf_tiny.logits_and_aux_program(model)(tokens)
    np.testing.assert_allclose(np.asarray(logits), want_logits, atol=ATOL, rtol=0)
    np.testing.assert_allclose(float(aux), want_aux, rtol=1e-6)


def test_cached_sampling_equals_transformers_greedy(checkpoints):
    """models.sampler's KV-cached decoding runs the sparse layers a token at a time."""
    import torch

    directory, torch_model, _ = checkpoints[True]
    prompt = np.random.default_rng(0).integers(0, hf_tiny.VOCAB, 12)
    ours = models.sampler.generate(models.from_pretrained(directory), prompt, max_new_tokens=10)
    with torch.no_grad():
        theirs = torch_model.generate(torch.from_numpy(prompt)[None].long(), max_new_tokens=10,
                                      do_sample=False)[0, len(prompt):].tolist()
    assert ours == theirs


def test_dispatch_equals_each_token_through_its_experts():
    """models.moe's sorted ragged_dot dispatch against a per-token dense loop, uneven expert
    loads (one expert unused), and its gradients."""
    rng = np.random.default_rng(3)
    tokens, hidden, inner, experts, k = 24, 8, 6, 5, 2
    x = jnp.asarray(rng.normal(size=(2, tokens // 2, hidden)), jnp.float32)
    choice = rng.choice([0, 1, 1, 2, 4, 4, 4], size=(tokens, k))  # expert 3 gets no token
    choice[:, 1] = np.where(choice[:, 1] == choice[:, 0], (choice[:, 0] + 1) % 4, choice[:, 1])
    chosen = jnp.asarray(choice.reshape(2, tokens // 2, k), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(2, tokens // 2, k)), jnp.float32)
    kernels = tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in (
        (experts, hidden, inner), (experts, hidden, inner), (experts, inner, hidden)))

    def dense(x, kernels):
        gate, up, down = (k_[chosen] for k_ in kernels)  # [B, S, k, in, out]
        h = jax.nn.silu(jnp.einsum("bsd,bskdf->bskf", x, gate)) * jnp.einsum(
            "bsd,bskdf->bskf", x, up)
        return jnp.einsum("bskf,bskfd,bsk->bsd", h, down, weights)

    def sparse(x, kernels):
        return moe._dispatch(x, weights, chosen, kernels)

    np.testing.assert_allclose(sparse(x, kernels), dense(x, kernels), atol=1e-5, rtol=1e-5)
    grads = [jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), (0, 1))(x, kernels)
             for f in (sparse, dense)]
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-5)


# -- the trainer ----------------------------------------------------------------------------------


def _overrides(run_dir, *extra):
    from tests.helpers.trainer import tiny_overrides

    return [o for o in tiny_overrides(run_dir, *extra)
            if not o.startswith(("model.preset", "model.shape"))]


def _basp_step_gradients(directory, run_dir, tokens):
    """(mean gradients by parameter path, loss sum, count, weighted aux sum, the targets) of
    the trainer's step (make_step_gradients) on one microbatch of `tokens` under BASP (2, 4),
    from the checkpoint's parameters."""
    from train.config.schema import load_config
    from train.prepare import model_config
    from train.program import state as prog
    from train.program.step import build_model, make_step_gradients

    cfg = load_config(None, [*_overrides(run_dir, "model.dtype=float32", f"data.seq_len={SEQ}",
                                         f"train.microbatch_size={BATCH}", "parallel.mode=basp",
                                         "parallel.devices_per_host=4",
                                         # the experts' backward through our kernels (interpreted)
                                         "model.grouped_matmul=pallas"),
                             f"model.hf_path={directory}"])
    mcfg = model_config(cfg)
    plan = prog.plan_run(cfg, mcfg, jax.devices(), 4)
    assert (plan.layout.groups, plan.layout.sp) == (2, 4)
    parts = build_model(prog.model_factory(cfg, mcfg, plan), plan.rules)
    program = prog.build_program(cfg, plan, parts)
    params = jax.device_put(nnx.to_pure_dict(models.load_hf_params(directory, mcfg)),
                            program.param_shardings)
    targets = np.roll(tokens, -1, axis=-1)
    targets[:, -1] = -100
    batch = {k: jax.device_put(v[None].astype(np.int32), program.batch_sharding)
             for k, v in (("tokens", tokens), ("targets", targets))}
    gradients = make_step_gradients(parts, program.param_shardings,
                                    loss_fn=models.causal_lm_loss, packed=False, with_aux=True)
    with jax.set_mesh(plan.mesh):
        grads, loss, count, aux = jax.jit(lambda p, b: gradients(p, b, None))(params, batch)
    flat = traverse_util.flatten_dict(jax.device_get(grads))
    return flat, float(loss), float(count), float(aux), targets


@pytest.mark.slow
def test_step_gradients_on_basp_equal_one_device(checkpoints, tokens, tmp_path):
    """The trainer's step on BASP (2 groups of 4): its loss, weighted aux loss and the gradient
    of loss + router_aux_loss_coef x aux_loss equal one device's, which differentiates
    transformers' objective (the mean cross-entropy plus coef x its aux_loss) directly."""
    directory, _, (_, want_aux) = checkpoints[False]
    grads, loss, count, aux_sum, targets = _basp_step_gradients(directory, tmp_path, tokens)
    model = models.from_pretrained(directory)
    coef = model.config.router_aux_loss_coef
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def one_device(params):
        def objective(params):
            s, n, aux = nnx.merge(graphdef, params, rest).loss_and_aux(tokens, targets)
            return s / n + coef * aux, (s, n, aux)
        return jax.grad(objective, has_aux=True)(params)

    want_grads, (want_loss, want_count, aux) = one_device(params)
    np.testing.assert_allclose(float(aux), want_aux, rtol=1e-6)
    assert count == float(want_count) == BATCH * SEQ - BATCH
    np.testing.assert_allclose(loss, float(want_loss), rtol=1e-6)
    np.testing.assert_allclose(aux_sum / count, want_aux, rtol=1e-6)
    want = traverse_util.flatten_dict(nnx.to_pure_dict(want_grads))
    assert grads.keys() == want.keys()
    for name, grad in want.items():
        scale = max(np.abs(grad).max(), 1e-3)
        assert np.abs(grads[name] - grad).max() / scale < 2e-5, name  # observed 2e-6
    assert np.abs(want[("layers", "mlp", "gate", "kernel")]).max() > 0  # the routers learn


@pytest.mark.slow
@pytest.mark.usefixtures("compile_cache")
def test_tiny_moe_config_trains(tmp_path):
    """configs/qwen3_moe_tiny_cpu.yaml for 4 steps (BASP, 2 groups x sp=4): the loss falls and
    metrics.jsonl logs aux_loss beside it (about k=2 for balanced routers)."""
    from tests.helpers.trainer import train_shipped_steps

    rows = train_shipped_steps("qwen3_moe_tiny_cpu.yaml", tmp_path / "run", timeout=200)
    assert len(rows) == 4 and rows[-1]["loss"] < rows[0]["loss"], rows
    assert all(1.5 < row["aux_loss"] < 4 for row in rows), rows


@pytest.mark.slow
@pytest.mark.usefixtures("compile_cache")
def test_a_stopped_moe_run_resumes_to_the_losses_of_an_uninterrupted_one(tmp_path):
    """configs/qwen3_moe_tiny_cpu.yaml (BASP, experts split over each group) stopped after step
    2 of 4 with a checkpoint and resumed: the losses and the routers' aux losses of the steps
    are those of a run that was never stopped."""
    from train.config.schema import load_config
    from train.loop import run
    from tests.helpers.trainer import ROOT

    def config(run_dir):
        return load_config(str(ROOT / "configs/qwen3_moe_tiny_cpu.yaml"),
                           [f"run.dir={run_dir}", "train.steps=4", "optimizer.warmup_steps=1",
                            "checkpoint.every=0", "metrics.progress=false"])

    first = run(config(tmp_path / "cut"), stop_at=2)
    second = run(config(tmp_path / "cut"))
    straight = run(config(tmp_path / "straight"))
    assert second["start_step"] == 2 and len(straight["losses"]) == 4
    assert first["losses"] + second["losses"] == straight["losses"]

    def aux(run_dir):
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {row["step"]: row["aux_loss"] for row in rows if "aux_loss" in row}

    assert aux(tmp_path / "cut") == aux(tmp_path / "straight") and len(aux(tmp_path / "cut")) == 4


def test_streaming_the_layers_is_refused_in_one_line(tmp_path):
    """optimizer.offload=true's streamed step has no load-balancing loss: refused at planning."""
    from train.config.schema import ConfigError, load_config
    from train.prepare import model_config
    from train.program import state as prog
    from tests.helpers.trainer import tiny_overrides

    overrides = [o for o in tiny_overrides(tmp_path, "optimizer.offload=true", "model.remat=auto")
                 if not o.startswith("model.shape")]
    cfg = load_config(None, [o if not o.startswith("model.preset") else
                             "model.preset=tiny-qwen3-moe" for o in overrides])
    with pytest.raises(ConfigError) as info:
        prog.plan_run(cfg, model_config(cfg), jax.devices(), 8)
    assert "\n" not in str(info.value) and "optimizer.offload" in str(info.value)


# -- Hugging Face checkpoints and config ----------------------------------------------------------


@pytest.mark.parametrize("mixed", [False, True])
def test_export_round_trip_is_exact(checkpoints, tokens, tmp_path, mixed):
    """save_pretrained writes the tensors transformers wrote (per-expert names), bit for bit,
    and a config.json transformers loads as Qwen3MoeForCausalLM with the same logits."""
    from safetensors.numpy import load_file

    directory, _, (want_logits, _) = checkpoints[mixed]
    model = models.from_pretrained(directory)
    models.save_pretrained(model, tmp_path)
    original = load_file(f"{directory}/model.safetensors")
    written = load_file(f"{tmp_path}/model.safetensors")
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in written
    assert written.keys() == original.keys()
    for name, value in original.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    assert models.ModelConfig.from_hf(str(tmp_path)) == model.config
    reloaded = hf_tiny.load_torch(tmp_path)
    assert type(reloaded).__name__ == "Qwen3MoeForCausalLM"
    np.testing.assert_array_equal(hf_tiny.torch_logits_and_aux(reloaded, tokens)[0],
                                  want_logits)


def test_bad_moe_configs_are_one_line(checkpoints):
    with open(f"{checkpoints[True][0]}/config.json") as f:
        good = json.load(f)

    def read(**changes):
        return lambda: models.ModelConfig.from_hf({**good, **changes})

    _one_line_error(read(num_experts_per_tok=9), "num_experts_per_tok=9", "num_experts=8")
    _one_line_error(read(num_local_experts=0), "num_experts", "positive")
    _one_line_error(read(moe_intermediate_size=-4), "moe_intermediate_size")
    _one_line_error(read(decoder_sparse_step=0), "decoder_sparse_step")
    _one_line_error(read(mlp_only_layers=[3]), "mlp_only_layers", "0..2")
    _one_line_error(read(router_aux_loss_coef=-1.0), "router_aux_loss_coef")
    no_width = {k: v for k, v in good.items() if k != "moe_intermediate_size"}
    _one_line_error(lambda: models.ModelConfig.from_hf(no_width), "moe_intermediate_size")
    import basp_jax

    config = models.ModelConfig.from_hf(good)
    # experts over a seq group of one device (seq; auto places them over the host instead), or
    # over 4 devices and a host of 8 that 6 experts do not fill: refused, never whole on every
    # device unasked
    def sparse_splits(model):
        return {layer.mlp.split_experts for layer in model.layers if layer.sparse}

    for batch, experts, refused in ((8, 8, ("seq",)), (2, 6, ("seq", "auto"))):
        layout = basp_jax.Layout.plan(8, batch, SEQ, 8, 2, groups=batch)
        for mode in ("seq", "auto"):
            options = models.RunOptions(mesh=basp_jax.make_mesh(layout), layout=layout,
                                        expert_parallel=mode)
            build = functools.partial(models.abstract_model,
                                      dataclasses.replace(config, num_experts=experts),
                                      options=options)
            if mode in refused:
                _one_line_error(build, f"expert_parallel={mode}", f"num_experts={experts}",
                                "expert_parallel=none")
            else:  # one device per sequence: the experts split over the host's 8
                assert sparse_splits(build()) == {8}
        whole = models.abstract_model(dataclasses.replace(config, num_experts=experts),
                                      options=dataclasses.replace(options, expert_parallel="none"))
        assert sparse_splits(whole) == {1}
    _one_line_error(lambda: models.RunOptions(expert_parallel="all"), "expert_parallel", "seq")
    tiny = models.ModelConfig.preset("tiny")
    _one_line_error(lambda: models.ModelConfig(**{**tiny.__dict__, "num_experts": 4}),
                    "num_experts", "llama")
    _one_line_error(lambda: models.ModelConfig(**{**tiny.__dict__, "router_z_loss_coef": 0.1}),
                    "router_z_loss_coef", "leave it 0")
    _one_line_error(lambda: dataclasses.replace(config, router_z_loss_coef=-1.0),
                    "router_z_loss_coef must be a number >= 0")


def test_presets():
    """Qwen3-30B-A3B's published shape: 30.5B parameters, counted alike by num_params, the
    module (abstract: no memory) and transformers (on the meta device); the tiny preset's
    layers stack."""
    import torch
    import transformers

    big = models.ModelConfig.preset("qwen3-30b-a3b")
    assert (big.num_layers, big.num_experts, big.num_experts_per_tok) == (48, 128, 8)
    assert models.ModelConfig.from_hf(big.to_hf()) == big
    params = jax.tree.leaves(nnx.state(models.abstract_model(big), nnx.Param))
    assert big.num_params() == sum(int(np.prod(x.shape)) for x in params) == 30_532_122_624
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**big.to_hf()))
    assert sum(p.numel() for p in hf_model.parameters()) == big.num_params()
    tiny = models.ModelConfig.preset("tiny-qwen3-moe")
    assert tiny.layers_alike and tiny.sparse_layers == tiny.num_layers


def test_router_z_loss_and_its_gradients_on_basp_equal_one_device(checkpoints, tokens):
    """router_z_loss_coef: the mean over token-layer rows of logsumexp(router logits)^2 (from
    transformers' router logits), added to the objective; its gradients on BASP (2, 4), experts
    split over each group, equal one device's."""
    import torch

    import basp_jax
    from train.program.objective import objective

    directory, torch_model, _ = checkpoints[False]
    with torch.no_grad():
        out = torch_model(input_ids=torch.from_numpy(tokens).long(), output_router_logits=True)
    want_z = float((torch.logsumexp(torch.cat(out.router_logits), -1) ** 2).mean())
    targets = np.roll(tokens, -1, axis=-1)
    targets[:, -1] = -100

    @nnx.jit
    def run(model):
        def total(model):
            value, terms = objective(model, jnp.asarray(tokens), jnp.asarray(targets), None,
                                     models.causal_lm_loss)
            return value, terms
        (value, (loss, count, weighted)), grads = nnx.value_and_grad(total, has_aux=True)(model)
        z = model.loss_and_router_losses(jnp.asarray(tokens), jnp.asarray(targets))[3]
        # the objective holds the z-loss: what is left beside the loss and the balancing term
        z_term = (value - loss - model.config.router_aux_loss_coef * weighted) / count
        return value, z, z_term, grads

    layout = basp_jax.Layout.plan(8, BATCH, SEQ, 8, 2, groups=2)
    results = []
    for mesh in (None, basp_jax.make_mesh(layout)):
        model = models.from_pretrained(directory, **({} if mesh is None else
                                                     dict(mesh=mesh, layout=layout)))
        model.config = dataclasses.replace(model.config, router_z_loss_coef=0.5)
        value, z, z_term, grads = run(model)
        np.testing.assert_allclose(float(z_term), 0.5 * float(z), rtol=1e-4)
        results.append((float(value), float(z), traverse_util.flatten_dict(
            nnx.to_pure_dict(nnx.state(grads, nnx.Param)))))
    (v1, z1, g1), (v8, z8, g8) = results
    np.testing.assert_allclose(z1, want_z, rtol=1e-5)
    np.testing.assert_allclose(z8, z1, rtol=1e-5)
    np.testing.assert_allclose(v8, v1, rtol=1e-5)
    router = ("layers", "mlp", "gate", "kernel")
    assert np.abs(g1[router]).max() > 0
    for name, grad in g1.items():
        scale = max(np.abs(grad).max(), 1e-3)
        assert np.abs(g8[name] - grad).max() / scale < 2e-5, name


@pytest.mark.slow
# (rows, length, seed): random tokens whose routers' top-k choices are far from ties
@pytest.mark.parametrize("groups,rows,length,seed,mixed", [(1, BATCH, SEQ, 2, True),
                                                           (8, 8, 32, 0, False)])
def test_objective_and_gradients_on_ulysses_and_one_device_per_sequence_equal_one_device(
        checkpoints, groups, rows, length, seed, mixed):
    """The training objective (the loss plus router_aux_loss_coef x the load-balancing loss) and
    every gradient on Ulysses (1, 8: the experts split over its 8 devices) and on one device per
    sequence (8, 1: the experts split over the host's 8, the 8 sequences' tokens gathered
    inside it) equal one device's. (BASP (2, 4): the trainer's step, above.)"""
    import basp_jax

    directory, torch_model, _ = checkpoints[mixed]
    tokens = np.random.default_rng(seed).integers(0, hf_tiny.VOCAB, (rows, length)).astype(
        np.int32)
    assert hf_tiny.router_margin(torch_model, tokens) > MARGIN  # no top-k near-tie
    layout = basp_jax.Layout.plan(8, rows, length, 8, 2, groups=groups)
    assert (layout.groups, layout.sp) == (groups, 8 // groups)
    results = []
    for mesh in (None, basp_jax.make_mesh(layout)):
        model = models.from_pretrained(directory, **({} if mesh is None else
                                                     dict(mesh=mesh, layout=layout)))
        if mesh is not None:
            assert {layer.mlp.split_experts for layer in (
                [model.layers] if model.scanned else model.layers) if layer.sparse} == {8}
        results.append(objective_and_gradients(model, tokens))
    (v1, a1, g1), (v8, a8, g8) = results
    np.testing.assert_allclose(v8, v1, rtol=1e-5)
    np.testing.assert_allclose(a8, a1, rtol=1e-5)
    assert np.abs(g1[("layers", "mlp", "gate", "kernel")] if not mixed else
                  g1[("layers", 0, "mlp", "gate", "kernel")]).max() > 0
    for name, grad in g1.items():
        scale = max(np.abs(grad).max(), 1e-3)
        assert np.abs(g8[name] - grad).max() / scale < 2e-5, name
