"""Staged parameter sharding (basp_jax.sharding 'staged', 'staged_keep') on an emulated 2-host x
4-device cluster: parameters stored over all 8 devices like fsdp, each layer gathered across
hosts as 1/8 pieces and then inside the host; the loss and every gradient equal one device's on
every layout family, with and without rematerialisation (staged_keep reuses the forward's
host-local copy in the recomputed backward, staged gathers it again), and with 2 microbatches a
step (staged_keep gathers the layers across hosts once for both)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util

import basp_jax
import models
from basp_jax.compiled import comm
from train.tools.collectives import step_collectives

from tests.helpers.flags import WHOLE_MATRIX
from tests.helpers.one_device import assert_equal_to_one_device, mean_loss_and_grads
from tests.helpers.trees import flat_state

pytestmark = pytest.mark.usefixtures("compile_cache")  # this run's (tests/conftest.py)

HOST = 4  # devices per emulated host
SEQ = 32


def _config(tied: bool) -> models.ModelConfig:
    return dataclasses.replace(models.ModelConfig.preset("tiny"), vocab_size=256,
                               tie_word_embeddings=tied)


def _batch(batch: int, seed: int):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (batch, SEQ)).astype(np.int32)
    targets = np.roll(tokens, -1, axis=1)
    targets[:, -1] = -100
    segments = np.repeat(np.arange(1, 3, dtype=np.int32), SEQ // 2)[None].repeat(batch, 0)
    return jnp.asarray(tokens), jnp.asarray(targets), jnp.asarray(segments)


# (batch, groups): BASP (2,4), Ulysses (1,8), one device per sequence (8,1); each strategy, with
# and without rematerialisation (staged_keep's kept copy feeds the recomputed backward), tied and
# untied tables, used split inside each host or (vocab "never", as where a device holds too
# many tokens for that) gathered whole in two stages. The first is the fast tier's; each
# strategy runs under every jaxlib, the other cases under the older one (WHOLE_MATRIX).
CASES = [(2, 2, "staged_keep", "full", False, "auto"),
         pytest.param(2, 1, "staged", "full", True, "auto", marks=pytest.mark.slow),
         pytest.param(8, 8, "staged_keep", "none", True, "auto",
                      marks=[pytest.mark.slow, WHOLE_MATRIX]),
         pytest.param(2, 1, "staged_keep", "full", True, "auto",
                      marks=[pytest.mark.slow, WHOLE_MATRIX]),
         pytest.param(2, 2, "staged_keep", "full", False, "never",
                      marks=[pytest.mark.slow, WHOLE_MATRIX]),
         # the host-local copy in host memory, without a remat policy of its own (with one: the
         # accumulation test below)
         pytest.param(8, 8, "staged_offload", "none", True, "auto", marks=pytest.mark.slow)]


@pytest.mark.parametrize("batch,groups,strategy,remat,tied,vocab", CASES)
def test_loss_and_gradients_equal_one_device(batch, groups, strategy, remat, tied, vocab):
    config = _config(tied)
    tokens, targets, segments = _batch(batch, seed=batch + groups)
    want = mean_loss_and_grads(models.init_model(config, seed=3), tokens, targets, segments)

    layout = basp_jax.Layout.plan(8, batch, SEQ, config.num_heads, config.num_kv_heads,
                                  groups=groups, devices_per_host=HOST)
    model = models.init_model(config, seed=3, mesh=basp_jax.make_mesh(layout), layout=layout,
                              param_sharding=strategy, remat=remat, vocab_parallel=vocab)
    # the kept copies' tables are staged (split inside each host unless "never"); staged's follow fsdp
    split_inside = strategy in ("staged_keep", "staged_offload") and vocab != "never"
    assert (model.head_table.host_active_axes(tokens.size) is not None) == split_inside
    stored = {k: v.sharding for k, v in _flat_arrays(model).items()}
    assert all(s.num_devices == 8 and not s.is_fully_replicated for k, s in stored.items()
               if "norm" not in k[-2]), stored  # stored split over all 8 devices
    assert_equal_to_one_device(mean_loss_and_grads(model, tokens, targets, segments), want)


def _flat_arrays(model):
    return {k: v[...] for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _inter_host(found, kinds):
    return sum(comm.inter_host_wire_bytes(c, HOST) * c.executions for c in found
               if c.kind in kinds)


@pytest.mark.slow
def test_layers_cross_hosts_as_eighths_between_the_hosts_only():
    """In the compiled step every gather of a layer's weights that crosses hosts runs between
    the 2 hosts only (each device fetches the 1/8 pieces its host lacks), and the cross-host
    bytes of the gathers and of the gradient reductions are well under fsdp's, whose groups of
    8 send half of every layer across. (The CPU program all-reduces the gradients' 1/4 shards
    across hosts; the GPU program reduce-scatters them: tests/e2e/test_gpu_compile.py.)"""
    mcfg = dataclasses.replace(_config(True), num_layers=2)
    found = {s: step_collectives(mcfg, mode="basp", strategy=s, batch=2, seq_len=256,
                                 devices_per_host=HOST, remat="full")[1]
             for s in ("staged", "fsdp")}
    table = 4 * mcfg.vocab_size * mcfg.hidden_size  # the embedding's f32 bytes
    norm = 4 * mcfg.hidden_size  # the final norm's weight is no layer's: gathered whole
    layers = [c for c in found["staged"] if c.kind == "all-gather" and norm < c.bytes < table
              and comm.crosses_hosts(c, HOST)]
    assert len(layers) >= 7 * mcfg.num_layers, layers  # every matrix of every layer
    assert all(len(g) == 2 for c in layers for g in c.groups), layers
    for kinds in (("all-gather",), ("reduce-scatter", "all-reduce")):
        assert _inter_host(found["staged"], kinds) < 0.4 * _inter_host(found["fsdp"], kinds), kinds


@pytest.mark.slow
def test_tables_used_whole_send_only_their_hosts_shards_across():
    """Where a device holds too many tokens to use staged_keep's tables split inside the host
    (vocab_parallel=never stands for that here), each device uses the host's copy whole,
    gathered inside the host: the tables' gradient is summed inside the host first, so the
    bytes across hosts are those of the split use (the host's shard, between the 2 hosts), not
    a reduction of whole tables over all 8 devices."""
    mcfg = dataclasses.replace(_config(False), num_layers=1)
    sent = {}
    for vocab in ("auto", "never"):
        _, found = step_collectives(mcfg, mode="basp", strategy="staged_keep", batch=2,
                                    seq_len=256, devices_per_host=HOST, remat="full",
                                    vocab_parallel=vocab)
        sent[vocab] = np.array([_inter_host(found, ("all-gather",)),
                                _inter_host(found, ("reduce-scatter", "all-reduce"))])
    tables = 2 * mcfg.vocab_size * mcfg.hidden_size * 4  # untied, float32
    # each device fetches the half of its host's quarter of each table the other host holds
    assert sent["auto"][0] > tables / HOST / 2
    np.testing.assert_allclose(sent["never"], sent["auto"], rtol=0.02)


@pytest.mark.slow
def test_checkpoints_move_between_fsdp_and_staged_and_accumulation_matches(tmp_path):
    """With grad_accum=2: a run that starts under fsdp, resumes under staged_keep and then under
    fsdp again (a checkpoint after every step; the stored shards differ in order: the restore
    places them) trains the straight fsdp run's losses exactly. (staged_keep's accumulated
    gradients against one device: test_accumulated_gradients_equal_one_device.)"""
    from train.loop import run

    from tests.helpers.trainer import tiny_config

    common = ("train.steps=3", "checkpoint.every=1", "train.microbatch_size=2",
              "train.grad_accum=2", "parallel.devices_per_host=4")

    def config(name, sharding):
        return tiny_config(tmp_path / name, f"parallel.param_sharding={sharding}", *common)

    straight = run(config("straight", "fsdp"))
    losses = []
    for sharding, stop_at in (("fsdp", 1), ("staged_keep", 2), ("fsdp", None)):
        part = run(config("moved", sharding), stop_at=stop_at)
        assert part["start_step"] == len(losses), sharding
        losses += part["losses"]
    np.testing.assert_allclose(losses, straight["losses"], rtol=1e-5)


def _accumulated(tmp_path, strategy: str, accum: int, *extra: str, loss_scale: float | None = None):
    """(model config, parameters, a batch of `accum` microbatches of 2 rows, jit(step_gradients)
    compiled for them) of the trainer's step on the emulated 2 hosts x 4, float32; with
    loss_scale, the step scales its loss by that much (train.program.step.LossScale)."""
    from tests.helpers.trainer import tiny_config
    from train.program import state as prog
    from train.prepare import model_config
    from train.program.step import LossScale, build_model, make_step_gradients

    cfg = tiny_config(tmp_path / f"{strategy}_{accum}", "model.dtype=float32",
                      "model.remat=full", "train.microbatch_size=2", f"train.grad_accum={accum}",
                      f"parallel.param_sharding={strategy}", f"parallel.devices_per_host={HOST}",
                      *extra)
    mcfg = model_config(cfg)
    plan = prog.plan_run(cfg, mcfg, jax.devices(), HOST)
    assert (plan.layout.groups, plan.layout.sp) == (2, 4)
    parts = build_model(prog.model_factory(cfg, mcfg, plan), plan.rules)
    program = prog.build_program(cfg, plan, parts)
    params = jax.device_put(parts.params, program.param_shardings)
    rng = np.random.default_rng(accum)
    tokens = rng.integers(0, mcfg.vocab_size, program.batch_shape).astype(np.int32)
    targets = np.roll(tokens, -1, axis=-1)
    targets[..., -1] = -100
    batch = {k: jax.device_put(v, program.batch_sharding)
             for k, v in (("tokens", tokens), ("targets", targets))}
    gradients = make_step_gradients(parts, program.param_shardings,
                                    loss_fn=models.causal_lm_loss, packed=False,
                                    loss_scale=None if loss_scale is None else LossScale())
    scale = None if loss_scale is None else jnp.float32(loss_scale)
    with jax.set_mesh(plan.mesh):
        compiled = jax.jit(lambda p, b: gradients(p, b, scale)).lower(params, batch).compile()
    return mcfg, params, batch, compiled


@pytest.mark.slow
@pytest.mark.parametrize("strategy,extra", [  # staged once a step and once a microbatch
    ("staged_keep", ()), ("staged", ()),       # under every jaxlib, the others under the older
    pytest.param("staged_offload", (), marks=WHOLE_MATRIX),
    pytest.param("staged_keep", ("model.scan_layers=false",), marks=WHOLE_MATRIX)])
def test_accumulated_gradients_equal_one_device(tmp_path, strategy, extra):
    """train.grad_accum=2: the step's loss and every gradient (the mean over both microbatches)
    equal one device's on all 4 rows. staged_keep gathers the layers across hosts once for both
    microbatches (train.program.step; a stack of layers or a list), staged once per microbatch."""
    _check_one_device(*_accumulated(tmp_path, strategy, 2, *extra),
                      scan_layers="model.scan_layers=false" not in extra)


@pytest.mark.parametrize("strategy,loss_scale,extra", [
    ("host", 1024.0, ()), ("staged_keep", None, ()),
    # the tables gathered whole on each device and the layers run in tiles
    ("staged_keep", None, ("model.vocab_parallel=never", "model.tile_tokens=8"))])
def test_hosts_keep_their_gradient_sums_apart_until_the_step_ends(tmp_path, strategy, loss_scale,
                                                                  extra):
    """train.grad_accum=2 under the strategies that hold a host-local copy for the step (each
    host is one BASP group here): each host sums its microbatches' gradients and the sums
    cross hosts once a step (train.program.per_group), so the compiled step's gradient
    reduction sends as many bytes across hosts as with one microbatch (staged_keep's step on 2
    hosts keeps them with one too); loss and every gradient equal one device's on all rows,
    with one microbatch and with two (there with a scaled loss too)."""
    one = _accumulated(tmp_path, strategy, 1, *extra)
    two = _accumulated(tmp_path, strategy, 2, *extra, loss_scale=loss_scale)
    _check_one_device(*one)
    _check_one_device(*two)
    kinds = ("reduce-scatter", "all-reduce")
    once, twice = (_inter_host(comm.parse_collectives(step.as_text(), 8), kinds)
                   for step in (one[3], two[3]))
    assert once > 0
    np.testing.assert_allclose(twice, once, rtol=0.05)
    if strategy == "staged_keep":  # written out as a reduce-scatter (with one microbatch too, on
        # 2 hosts), where XLA's CPU partitioner would all-reduce and slice: half the bytes
        for step in (one[3], two[3]):
            found = comm.parse_collectives(step.as_text(), 8)
            assert _inter_host(found, ("all-reduce",)) < 0.01 * _inter_host(
                found, ("reduce-scatter",))


def _check_one_device(mcfg, params, batch, compiled, scan_layers: bool = True):
    """The compiled step's loss and mean gradients on `batch` equal one device's on all its
    rows."""
    grads, loss_sum, count = compiled(params, batch)
    options = models.RunOptions(dtype=jnp.float32, scan_layers=scan_layers)
    model = models.Transformer(mcfg, rngs=nnx.Rngs(0), options=options)
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.device_get(params))
    nnx.update(model, state)
    rows = lambda x: np.asarray(x).reshape(-1, x.shape[-1])  # noqa: E731
    loss_1, grads_1 = mean_loss_and_grads(model, rows(batch["tokens"]), rows(batch["targets"]))
    np.testing.assert_allclose(float(loss_sum / count), float(loss_1), rtol=1e-6)
    reference = flat_state(grads_1)
    flat = {k: np.asarray(v) for k, v in traverse_util.flatten_dict(jax.device_get(grads)).items()}
    assert flat.keys() == reference.keys()
    for key, g in reference.items():
        np.testing.assert_allclose(flat[key], g, rtol=0, atol=2e-6 * np.abs(g).max(),
                                   err_msg=str(key))


def _layer_gathers(found):
    """Inter-host bytes of the all-gathers that cross hosts between pairs of devices: the
    pieces of the layers and of the vocabulary tables that a host lacks."""
    return sum(comm.inter_host_wire_bytes(c, HOST) * c.executions for c in found
               if c.kind == "all-gather" and comm.crosses_hosts(c, HOST)
               and all(len(g) == 2 for g in c.groups))


@pytest.mark.slow
def test_staged_keep_gathers_the_layers_across_hosts_once_per_step(tmp_path):
    """In the compiled step, staged_keep's layers cross hosts as many bytes with 2 microbatches
    as with 1 (gathered once a step); staged's twice as many (its tables follow fsdp), and each
    microbatch twice as many as staged_keep's (forward and recomputed backward); staged_offload's
    once per microbatch, as staged_keep's with one (its copy waits in host memory in the GPU
    program, tests/e2e/test_gpu_compile.py; XLA's CPU program has one memory). The
    vocabulary tables' copies under staged_keep cross once a step in this CPU program (XLA's CPU pipeline hoists their gather,
    which depends on the parameters only, out of the microbatch loop; the GPU program gathers
    them per microbatch, as the planner counts: BENCHMARKS.md section 10). The gradients cross
    hosts once a step under staged_keep (train.program.per_group: each host's sum kept apart
    over the microbatches) and once per microbatch under staged and staged_offload, as
    basp_jax.planner.cost counts them."""
    sent = {}
    for strategy in ("staged_keep", "staged", "staged_offload"):
        for accum in (1, 2):
            mcfg, _, _, step = _accumulated(tmp_path, strategy, accum)
            found = comm.parse_collectives(step.as_text(), 8)
            sent[strategy, accum] = (_layer_gathers(found),
                                     _inter_host(found, ("reduce-scatter", "all-reduce")))
    # the tables' host-local copies (float32 here): each device fetches the half the other
    # host holds of its 1/4 of each table
    tables = (1 if mcfg.tie_word_embeddings else 2) * mcfg.vocab_size * mcfg.hidden_size * 4
    copies = tables / HOST / 2
    assert sent["staged_keep", 1][0] > copies
    np.testing.assert_allclose(sent["staged_keep", 2][0], sent["staged_keep", 1][0], rtol=0.01)
    np.testing.assert_allclose(sent["staged", 2][0], 2 * sent["staged", 1][0], rtol=0.01)
    assert sent["staged", 1][0] > 1.5 * (sent["staged_keep", 1][0] - copies), sent
    np.testing.assert_allclose(sent["staged_offload", 1][0], sent["staged_keep", 1][0], rtol=0.01)
    # its layers again for the second microbatch (the tables' copies: once, as staged_keep's)
    np.testing.assert_allclose(sent["staged_offload", 2][0],
                               2 * sent["staged_offload", 1][0] - copies, rtol=0.01)
    np.testing.assert_allclose(sent["staged_keep", 2][1], sent["staged_keep", 1][1], rtol=0.05)
    for strategy in ("staged", "staged_offload"):
        np.testing.assert_allclose(sent[strategy, 2][1], 2 * sent[strategy, 1][1], rtol=0.05)


@pytest.mark.slow
def test_a_loss_other_than_plain_cross_entropy_uses_the_hosts_copies():
    """A loss_fn the vocabulary-split loss cannot compute runs on gathered chunks of logits, with
    each host's devices looping over their host's staged copy of the head: one device's loss
    and gradients."""
    def loss_fn(logits, targets):  # the same cross-entropy, but not models.causal_lm_loss itself
        return models.causal_lm_loss(logits, targets)

    config = _config(False)
    tokens, targets, _ = _batch(2, seed=5)
    want = mean_loss_and_grads(models.init_model(config, seed=3), tokens, targets,
                               loss_fn=loss_fn)
    layout = basp_jax.Layout.plan(8, 2, SEQ, config.num_heads, config.num_kv_heads, groups=2,
                                  devices_per_host=HOST)
    model = models.init_model(config, seed=3, mesh=basp_jax.make_mesh(layout), layout=layout,
                              param_sharding="staged_keep", remat="full")
    assert model.head_table.host_active_axes(tokens.size) is not None
    assert_equal_to_one_device(
        mean_loss_and_grads(model, tokens, targets, loss_fn=loss_fn), want)
