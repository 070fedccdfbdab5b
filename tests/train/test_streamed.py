"""optimizer.offload=true (train.program.streamed): master weights and optimizer state in pinned host
memory, the layers streamed through the device. Its loss and gradients equal a single-device
reference on BASP (2, 4), Ulysses (1, 8), a ring and under staged parameter sharding (each
layer gathered across the 2 emulated hosts as pieces, then inside the host); its step equals the ordinary step; a
non-finite step leaves the state as it was; it checkpoints and resumes; what it does not do is
refused in one line.

Tolerances (float32) as tests/train/test_long_context.py: the loss to 1e-6 relative, each gradient to
2e-6 of its largest entry. The device memory it saves shows in the GPU program
(tests/e2e/test_gpu_compile.py); on CPU the arrays carry the pinned_host memory kind.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from basp_jax.compiled import comm
from tests.helpers.trainer import ROOT, tiny_config, tiny_overrides
from train.program import state as prog
from train.program import streamed
from train.config.schema import ConfigError
from train.prepare import model_config
from train.program.step import build_model, init_opt_state

pytestmark = pytest.mark.usefixtures("compile_cache")  # programs compiled twice: read once

# (Ulysses's (1,8) is the ring's layout with ring=1: the ring case runs parallel.mode=ulysses.)
LAYOUTS = {"basp (2,4)": ["parallel.mode=basp"],
           "ring 2 x a2a 4": ["parallel.mode=ulysses", "parallel.ring=2",
                              "parallel.zigzag=false"],
           # each layer gathered across the 2 emulated hosts, then inside the host
           "basp (2,4) staged": ["parallel.mode=basp", "parallel.param_sharding=staged",
                                 "parallel.devices_per_host=4"]}


def _program(tmp_path, *extra, offload=True, **optimizer):
    cfg = tiny_config(tmp_path / "run", "model.dtype=float32", "model.remat=auto",
                      "optimizer.clip_norm=0.05", f"optimizer.offload={str(offload).lower()}",
                      *extra)
    for key, value in optimizer.items():  # set past the config's checks (tested there)
        setattr(cfg.optimizer, key, value)
    mcfg = model_config(cfg)
    plan = prog.plan_run(cfg, mcfg, jax.devices(), 4)
    parts = build_model(prog.model_factory(cfg, mcfg, plan), plan.rules)
    return cfg, mcfg, parts, prog.build_program(cfg, plan, parts)


def _batch(program, seed=1):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, program.batch_shape)
    targets = np.roll(tokens, -1, axis=-1)
    targets[..., -1] = -100
    return {k: jax.device_put(jnp.asarray(v, jnp.int32), program.batch_sharding)
            for k, v in (("tokens", tokens), ("targets", targets))}


def _reference(mcfg, params, tokens, targets):
    """Loss and gradients of the mean loss on one device, no mesh, no rematerialisation."""
    model = models.Transformer(mcfg, rngs=nnx.Rngs(0),
                               options=models.RunOptions(dtype=jnp.float32))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.device_get(params))
    nnx.update(model, state)

    def mean_loss(m):
        total, count = m.loss(tokens, targets)
        return total / count

    loss, grads = nnx.jit(nnx.value_and_grad(mean_loss))(model)
    return float(loss), nnx.to_pure_dict(grads)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_streamed_loss_and_gradients_equal_one_device(tmp_path, layout):
    _, mcfg, parts, program = _program(tmp_path, *LAYOUTS[layout])
    params = jax.device_put(parts.params, program.param_shardings)
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(params)} == {"pinned_host"}
    batch = _batch(program)

    def loss_and_grads(params, tokens, targets):
        (total, count), grads, sumsq = streamed.streamed_loss_and_grads(
            parts, params, tokens, targets, None, loss_fn=models.causal_lm_loss,
            grad_dtype=jnp.float32)
        return total / count, grads, sumsq

    with jax.set_mesh(program.plan.mesh):
        args = (params, batch["tokens"][0], batch["targets"][0])
        compiled = jax.jit(loss_and_grads).lower(*args).compile()
        loss, grads, sumsq = compiled(*args)
    if "staged" in layout:  # each layer (gathered in the layer loops) crosses hosts as pieces
        found = comm.parse_collectives(compiled.as_text(), 8)  # between the 2 hosts only
        layers = [c for c in found if c.kind == "all-gather" and c.executions == mcfg.num_layers
                  and comm.crosses_hosts(c, 4)]
        assert layers and all(len(g) == 2 for c in layers for g in c.groups), found
    ref_loss, ref_grads = _reference(mcfg, params, np.asarray(batch["tokens"][0]),
                                     np.asarray(batch["targets"][0]))
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-6)
    flat, ref_flat = (dict(jax.tree_util.tree_flatten_with_path(t)[0]) for t in (grads, ref_grads))
    assert flat.keys() == ref_flat.keys()
    for path, ref in ref_flat.items():
        ref = np.asarray(ref)
        np.testing.assert_allclose(np.asarray(flat[path]), ref, rtol=0,
                                   atol=2e-6 * np.abs(ref).max(), err_msg=str(path))
    total = sum(float(np.sum(np.square(np.asarray(g)))) for g in ref_flat.values())
    np.testing.assert_allclose(float(sumsq), total, rtol=1e-5)


@pytest.mark.slow
def test_streamed_step_equals_the_ordinary_step(tmp_path):
    """Three steps (warm-up, then clipped updates with weight decay) from the same parameters:
    the same metrics, parameters and optimizer state, which stay in host memory."""
    runs = {}
    for offload in (False, True):
        _, _, parts, program = _program(tmp_path, offload=offload)
        params = jax.device_put(parts.params, program.param_shardings)
        if offload:
            opt_state = streamed.init_opt_state(program.tx, params, program.opt_shardings)
        else:
            opt_state = init_opt_state(program.tx, params, program.opt_shardings)
        initial = jax.device_get(opt_state)
        metrics = []
        for step in range(3):
            params, opt_state, m = program.step_fn(params, opt_state, _batch(program, step),
                                                   program.step_index(step))
            metrics.append({k: float(v) for k, v in m.items()})
        runs[offload] = metrics, jax.device_get((params, opt_state)), initial, params
    (m0, state0, init0, _), (m1, state1, init1, params1) = runs[False], runs[True]
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(params1)} == {"pinned_host"}
    jax.tree.map(np.testing.assert_array_equal, init1, init0)  # init_opt_state is tx.init's
    assert [m["grad_norm"] > 0.05 for m in m1] == [True] * 3  # the clip acted
    for a, b in zip(m0, m1):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_allclose(b[key], a[key], rtol=2e-6, err_msg=key)
    # float32 sums in another order (the two programs reduce the staged tables' gradients in
    # their own order), through Adam's division: one embedding element in 16,384 moves 1e-4 of
    # its value after three steps, at 1.1e-5 of the largest
    for a, b in zip(jax.tree.leaves(state0), jax.tree.leaves(state1)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(b, a, rtol=0, atol=3e-5 * max(np.abs(a).max(), 1e-30))


def test_a_non_finite_streamed_step_keeps_the_state(tmp_path):
    """A NaN in one layer's weight: the loss is NaN, so no weight, moment or count is written
    (the state is written a layer at a time, so the check comes first)."""
    _, _, parts, program = _program(tmp_path)
    poisoned = jax.tree.map(np.array, jax.device_get(parts.params))
    poisoned["layers"]["mlp"]["down_proj"]["kernel"][1, 0, 0] = np.nan
    params = jax.device_put(poisoned, program.param_shardings)
    opt_state = streamed.init_opt_state(program.tx, params, program.opt_shardings)
    before = jax.device_get((params, opt_state))
    for step in range(2):
        params, opt_state, m = program.step_fn(params, opt_state, _batch(program),
                                               program.step_index(step))
        assert not bool(m["finite"])
    after = jax.device_get((params, opt_state))
    jax.tree.map(np.testing.assert_array_equal, after, before)


@pytest.mark.slow
def test_an_update_that_overflows_is_skipped_as_by_the_ordinary_step(tmp_path):
    """A learning rate of 1e38 with weight decay 1e3: loss, gradient norm and learning rate are
    finite but the updated weights overflow to inf. The streamed step checks the updated state
    as the ordinary step does: both report the step non-finite and keep every weight, moment
    and count (the streamed one kept the inf weights and reported the step as finite)."""
    for offload in (False, True):
        _, _, parts, program = _program(tmp_path, "optimizer.warmup_steps=0", offload=offload,
                                        lr=1e38, weight_decay=1e3)
        params = jax.device_put(parts.params, program.param_shardings)
        init = streamed.init_opt_state if offload else init_opt_state
        opt_state = init(program.tx, params, program.opt_shardings)
        before = jax.device_get((params, opt_state))
        params, opt_state, m = program.step_fn(params, opt_state, _batch(program),
                                               program.step_index(0))
        assert np.isfinite([float(m[k]) for k in ("loss", "grad_norm", "lr")]).all(), m
        assert not bool(m["finite"]), f"offload={offload}"
        jax.tree.map(np.testing.assert_array_equal, jax.device_get((params, opt_state)), before)


@pytest.mark.slow
def test_checkpoints_move_between_the_streamed_and_the_ordinary_step(tmp_path):
    """The trainer end to end, both ways: 2 steps streamed then resumed to 4 ordinary, and 2
    ordinary then resumed to 4 streamed (restored straight into host memory): the same losses
    (the state keeps the ordinary step's layout, so a checkpoint moves between the two). Each
    invocation evaluates after its last step: the streamed runs' evaluation (of parameters in
    host memory, which ended the run with a traceback before its checkpoint) gives the ordinary
    runs' eval losses."""
    from train.loop import run

    def column(run_dir, key):
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line).get(key) for line in lines]

    common = ("model.dtype=float32", "model.remat=auto", "checkpoint.every=2",
              "checkpoint.allow_changed=train.steps", "optimizer.min_lr_ratio=1.0",
              "eval.every=2")
    for first, then in (("true", "false"), ("false", "true")):
        run_dir = tmp_path / f"from_offload_{first}"
        for steps, offload in ((2, first), (4, then)):
            run(tiny_config(run_dir, *common, f"train.steps={steps}",
                            f"optimizer.offload={offload}"))
    a, b = (tmp_path / "from_offload_true"), (tmp_path / "from_offload_false")
    assert len(column(a, "loss")) == 4
    np.testing.assert_allclose(column(a, "loss"), column(b, "loss"), rtol=2e-6)
    # steps 2 and 4: streamed against ordinary, then ordinary against streamed
    evals = [column(run_dir, "eval_loss")[1::2] for run_dir in (a, b)]
    assert all(loss is not None for loss in evals[0] + evals[1]), evals
    np.testing.assert_allclose(evals[0], evals[1], rtol=2e-6)


@pytest.mark.parametrize("extra,message", [
    (["train.grad_accum=2"], "optimizer.offload=true runs one microbatch per step"),
    (["model.scan_layers=false"], "streams the layers of a scanned stack"),
    (["model.remat=full"], "set model.remat=offload (or auto), not 'full'"),
    (["parallel.param_sharding=host", "parallel.devices_per_host=4"],
     "host parameter sharding (device copies of the weights per host) does not apply"),
    (["parallel.param_sharding=staged_keep", "parallel.devices_per_host=4"],
     "set parallel.param_sharding=staged"),
    (["model.dtype=float16"], "has no loss scaling for float16 compute"),
])
def test_offload_refuses_what_it_does_not_do(tmp_path, extra, message):
    cfg = tiny_config(tmp_path / "run", "optimizer.offload=true", "model.remat=auto", *extra)
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        prog.plan_run(cfg, model_config(cfg), jax.devices(), 4)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides,cluster,offload", [
    ([], (8, 4), False),  # the shipped 16K step on 2 x 4 A100-40GB: as it was
    (["data.seq_len=524288", "train.microbatch_size=1", "parallel.hardware=h100-80gb"], (1, 1),
     True),  # the 8B at 512K on one H100: only the streamed step fits
    (["data.seq_len=524288", "train.microbatch_size=1", "parallel.hardware=h100-80gb",
      "train.grad_accum=2"], (1, 1), False),  # it would fit streamed, but that runs 1 microbatch
])
def test_offload_auto_streams_only_where_nothing_else_fits(overrides, cluster, offload):
    """optimizer.offload=auto (the shipped GPU configs') from the planner's estimates alone."""
    from train.config.schema import load_config
    from train.program.planning import resolve_offload

    cfg = load_config(str(ROOT / "configs/gpu/llama-3.1-8b_basp.yaml"), overrides)
    assert cfg.optimizer.offload == "auto"
    resolved = resolve_offload(cfg, model_config(cfg), *cluster)
    assert resolved.optimizer.offload is offload


def _wide_shape(layers: int) -> str:
    return (f"model.shape={{vocab_size: 256, hidden_size: 1024, intermediate_size: 4096, "
            f"num_layers: {layers}, num_heads: 8, num_kv_heads: 8, head_dim: 128}}")


def test_offloaded_state_beyond_the_machine_memory_is_refused_before_run_dir(tmp_path, capsys,
                                                                            monkeypatch):
    """optimizer.offload=true on a model whose master weights and Adam moments (12 bytes per
    parameter in host memory) are 1.5 times the memory this machine has available (its device
    memory, the layers' float32 gradients sharded over the 8 CPU devices, fits): one line with
    both sizes, exit status 2, before run.dir is made or anything compiles (was: every check
    passed, run.dir was written and the run died allocating). Nothing of the model is ever
    allocated: the checks come first."""
    import math

    from train.program.planning import host_memory_available
    from train import cli

    available = host_memory_available()
    one, two = (model_config(tiny_config(tmp_path / "run", _wide_shape(n))).num_params()
                for n in (1, 2))
    layers = math.ceil((1.5 * available / 12 - one) / (two - one))
    run_dir = tmp_path / "run"

    def allocate(*args, **kwargs):  # should the check fail, fail here rather than allocate
        raise AssertionError("the checks passed a state larger than the machine's memory")

    monkeypatch.setattr("train.loop.build_state", allocate)
    capsys.readouterr()
    status = cli.main(tiny_overrides(run_dir, _wide_shape(layers), "optimizer.offload=true",
                                     "model.remat=auto", "parallel.param_sharding=fsdp"))
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1, err
    found = re.search(r"about ([\d.e+]+) GB of host memory .* but ([\d.e+]+) GB is available",
                      lines[0])
    assert lines[0].startswith("error: resources: ") and found, lines[0]
    need, have = (float(x) for x in found.groups())
    assert need > 1.2 * have, lines[0]
    assert "compiled" not in out + err
    assert not run_dir.exists()


def test_host_memory_without_proc_meminfo_is_the_physical_memory(monkeypatch):
    """macOS has neither /proc/meminfo nor sysconf's SC_AVPHYS_PAGES: the host memory check
    then compares with the machine's physical memory."""
    import builtins
    import os

    from train.program.planning import host_memory_available

    real_open, real_sysconf = builtins.open, os.sysconf

    def no_meminfo(path, *args, **kwargs):
        if str(path) == "/proc/meminfo":
            raise FileNotFoundError(2, "No such file or directory", path)
        return real_open(path, *args, **kwargs)

    def sysconf(name):
        if name == "SC_AVPHYS_PAGES":
            raise ValueError("unrecognized configuration name")
        return real_sysconf(name)

    monkeypatch.setattr(builtins, "open", no_meminfo)
    monkeypatch.setattr(os, "sysconf", sysconf)
    assert host_memory_available() == real_sysconf("SC_PHYS_PAGES") * real_sysconf("SC_PAGE_SIZE")
