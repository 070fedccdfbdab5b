"""The state a config describes, built one way for training (train.loop) and for compiling
without running it (train.tools.aot): the run plan (layout, mesh, strategy, memory policy), the
model, the optimizer, the shardings, the train step, the parameters and optimizer state
(restored, loaded, initialised, or abstract), and the compiled step of each layout.

    plan = plan_run(cfg, mcfg, devices, devices_per_host)    # cfg: train.prepare.check's
    state = build_state(cfg, mcfg, plan, run_dir=..., latest=None)   # or abstract=True
    compiled, collectives = compile_steps(cfg, state, devices, log)
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import models
from basp_jax import Layout, cudnn, kernels, make_mesh
from basp_jax.compiled import comm
from basp_jax.sharding import ShardingRules, abstract_arrays

from ..config import dtypes
from . import planning
from . import streamed
from ..checkpoint.store import Checkpointer, first_non_finite
from .model_setup import model_config, model_options
from . import compile_fallback, compile_progress
from ..process.outputs import write_collectives
from ..config.schema import Config, ConfigError
from .step import (build_model, compute_dtype, from_module, init_opt_state, initial_loss_scale, loss_scaling, make_optimizer, make_train_step, opt_state_shardings)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """How a run splits its work: the layout (with its pad rows and token order), the parameter
    sharding, the mesh."""

    layout: Layout
    strategy: str  # fsdp | hsdp | host | replicated
    mesh: Mesh
    remat: str = "none"  # the rematerialisation policy (model.remat, auto resolved)
    tile_tokens: int | None = None  # model.tile_tokens (auto resolved)
    offload_state: bool = False  # optimizer.offload (auto resolved): the streamed step
    # parallel.mode=adaptive: one plan per layout of the set (train.program.planning.adaptive_set), the
    # first this plan's own layout; each on its mesh over the same devices. () when static
    adaptive: tuple["RunPlan", ...] = ()
    # the most documents a packed row of the run's data holds (train.data.Pipeline's
    # documents_per_row; cuDNN's packed layout is sized by it); None: unknown
    document_bound: int | None = None

    @functools.cached_property
    def rules(self) -> ShardingRules:
        """Where the run's parameters and activations live (basp_jax.sharding.RULES)."""
        return ShardingRules(self.strategy, self.mesh, self.layout.devices_per_host)


def plan_run(cfg: Config, mcfg, devices, devices_per_host: int) -> RunPlan:
    """The layout and mesh for `devices`; raises LayoutError/ConfigError before anything compiles.
    optimizer.offload=auto must be decided first (train.program.planning.resolve_offload)."""
    if cfg.optimizer.offload == "auto":
        raise ValueError("plan_run needs optimizer.offload decided: "
                         "cfg = train.program.planning.resolve_offload(cfg, ...) first")
    # the configured strategy: under optimizer.offload the planner offers only streamed ones
    streamed.check_offload(cfg, cfg.parallel.param_sharding,
                           compute_dtype(cfg.model.dtype, devices[0]), mcfg)
    if cfg.optimizer.offload is True and mcfg.is_moe:
        raise ConfigError(f"optimizer.offload=true streams the layers without their routers' "
                          f"load-balancing loss, which {mcfg.model_type}'s sparse layers need; "
                          f"set optimizer.offload=false")
    layout, strategy = planning.plan(cfg, mcfg, len(devices), devices_per_host)
    remat, tile = planning.memory_policy(cfg, mcfg, layout, strategy, devices_per_host)
    plan = RunPlan(layout, strategy, make_mesh(layout, devices), remat, tile,
                   cfg.optimizer.offload)
    layouts = planning.adaptive_set(cfg, layout, strategy)
    if not layouts:
        return plan
    plans = (plan,) + tuple(dataclasses.replace(plan, layout=other, mesh=make_mesh(other, devices))
                            for other in layouts[1:])
    return dataclasses.replace(plan, adaptive=plans)


def model_factory(cfg: Config, mcfg, plan: RunPlan) -> Callable[[], nnx.Module]:
    """A function that builds the configured model on the plan's mesh (for nnx.eval_shape or jit)."""
    options = model_options(cfg, plan)

    def make():
        return models.Transformer(mcfg, rngs=nnx.Rngs(cfg.run.seed), options=options)

    return make


@dataclasses.dataclass
class TrainProgram:
    """The jitted train step with everything needed to call or lower it."""

    plan: RunPlan
    step_fn: Any  # jit(train_step)(params, opt_state, batch, step)
    tx: Any
    schedule: Any
    param_shardings: Any
    abstract_opt_state: Any
    opt_shardings: Any
    batch_sharding: NamedSharding
    batch_shape: tuple[int, int, int]  # [accum, rows (pad rows included), seq_len]
    packed: bool
    # the same program built afresh (a new jit, traced again on its next lower): after XLA
    # refused its cuDNN attention (train.program.compile_fallback)
    rebuild: Callable[[], "TrainProgram"] | None = dataclasses.field(default=None, repr=False)

    def abstract_batch(self) -> dict:
        """ShapeDtypeStructs of one step's batch, as the data pipeline delivers it."""
        names = ("tokens", "targets") + (("segment_ids",) if self.packed else ())
        return {n: jax.ShapeDtypeStruct(self.batch_shape, jnp.int32, sharding=self.batch_sharding)
                for n in names}

    def step_index(self, step: int):
        """The step counter as the compiled step takes it (replicated int32)."""
        return jax.device_put(np.int32(step), NamedSharding(self.plan.mesh, P()))

    def abstract_step_index(self):
        return jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(self.plan.mesh, P()))

    def abstract_state(self, params, opt_state):
        """ShapeDtypeStructs of parameters and optimizer state shaped like these (arrays or
        ShapeDtypeStructs), placed as this program takes them."""
        return (abstract_arrays(params, self.param_shardings),
                abstract_arrays(opt_state, self.opt_shardings))

    def lower(self, params, opt_state):
        """Lower the step for these parameters and optimizer state (arrays or ShapeDtypeStructs
        with shardings) and an abstract batch: compile() it to run or to inspect."""
        # a compile for GPUs from a host without one: JAX's trace-time cuDNN checks see them
        capability = kernels.device_capability(self.plan.mesh.devices.flat[0])
        with jax.set_mesh(self.plan.mesh), cudnn.capability_seen_as(capability):
            return self.step_fn.lower(params, opt_state, self.abstract_batch(),
                                      self.abstract_step_index())


def build_program(cfg: Config, plan: RunPlan, parts) -> TrainProgram:
    """The optimizer, the shardings and the jitted train step for the model `parts`
    (train.program.step.ModelParts, with real or abstract parameters)."""
    loss_scale = loss_scaling(compute_dtype(cfg.model.dtype, plan.mesh.devices.flat[0]))
    tx, schedule = make_optimizer(cfg.optimizer, cfg.train.steps, loss_scale)
    rules = plan.rules
    param_sh = parts.shardings(rules)
    abs_opt, opt_sh = opt_state_shardings(tx, parts.params, param_sh, rules.replicated)
    if plan.offload_state:  # master weights and moments in host memory (train.program.streamed)
        param_sh = streamed.in_host_memory(param_sh)
        opt_sh = jax.tree.map(lambda s, a: streamed.in_host_memory(s) if a.ndim else s,
                              opt_sh, abs_opt)
        step_fn, batch_sharding = streamed.make_streamed_train_step(
            parts, tx, schedule, plan.mesh, param_sh, opt_sh, loss_fn=models.causal_lm_loss,
            packed=cfg.data.pack, clip_norm=cfg.optimizer.clip_norm,
            grad_dtype=dtypes.jnp_dtype(
                compute_dtype(cfg.model.dtype, plan.mesh.devices.flat[0])))
    else:
        step_fn, batch_sharding = make_train_step(
            parts, tx, schedule, plan.mesh, param_sh, opt_sh,
            loss_fn=models.causal_lm_loss, packed=cfg.data.pack, loss_scale=loss_scale,
        )
    shape = (cfg.train.grad_accum, plan.layout.batch, plan.layout.seq_len)
    return TrainProgram(plan, step_fn, tx, schedule, param_sh, abs_opt, opt_sh, batch_sharding,
                        shape, cfg.data.pack,
                        rebuild=functools.partial(build_program, cfg, plan, parts))


def layout_programs(cfg: Config, mcfg, plan: RunPlan, program: TrainProgram
                    ) -> tuple[TrainProgram, ...]:
    """The train step of every layout the run may take: (program,) for a static run; under
    parallel.mode=adaptive one per plan.adaptive, program first. Each has its own model (the
    layout is part of it) on its own mesh, built from shapes: the parameters are program's,
    relabelled (basp_jax.adaptive.relabel) at each switch, never copied."""
    others = tuple(
        build_program(cfg, sub, build_model(model_factory(cfg, mcfg, sub), sub.rules,
                                            init_params=False))
        for sub in plan.adaptive[1:])
    return (program,) + others


def compile_program(cfg: Config, devices, devices_per_host: int, mcfg=None, *,
                    layout_index: int = 0, log: Callable[[str], None] = print):
    """Compile the train step of `cfg` for `devices` from shapes alone (nothing is initialised,
    read or run): (compiled, run plan, model config, compile seconds). `mcfg` replaces the
    config's model (e.g. a preset with fewer layers); under parallel.mode=adaptive,
    `layout_index` picks the layout of the set (the plan returned is that layout's). log: where
    the note goes if XLA refuses cuDNN attention and the step is compiled again without it."""

    mcfg = model_config(cfg) if mcfg is None else mcfg
    cfg = planning.resolve_offload(cfg, mcfg, len(devices), devices_per_host)
    run_plan = plan_run(cfg, mcfg, devices, devices_per_host)
    state = build_state(cfg, mcfg, run_plan, abstract=True)
    program = state.programs[layout_index]
    t0 = time.perf_counter()
    _, compiled = compile_fallback.compile_step(
        program, *program.abstract_state(state.params, state.opt_state), log)
    return compiled, program.plan, mcfg, time.perf_counter() - t0


@dataclasses.dataclass
class TrainState:
    """What the loop advances: the model, its compiled-to-be step, the checkpointer, and the
    parameters and optimizer state at step `start` (the step donates them; the loop replaces
    them after each step)."""

    parts: Any  # train.program.step.ModelParts
    program: TrainProgram
    ckpt: Checkpointer | None  # None for an abstract state (nothing is written)
    start: int  # the first step this invocation runs (0-based)
    params: Any
    opt_state: Any
    # the step of each layout the run may take (layout_programs): (program,) unless adaptive
    programs: tuple[TrainProgram, ...] = ()


def build_state(cfg: Config, mcfg, plan: RunPlan, *, run_dir: str | None = None,
                latest: int | None = None, abstract: bool = False,
                saved_dtype: str | None = None) -> TrainState:
    """The one state builder, for training and for compiling without running (train.tools.aot,
    compile_program): the model and train step (not yet compiled), then (unless `abstract`) the
    checkpointer (it makes run.dir/checkpoints: the caller holds run.dir's lock) and the
    parameters and optimizer state: restored from checkpoint step `latest`, else loaded
    (model.hf_path) or initialised. abstract: ShapeDtypeStructs with shardings, nothing read,
    initialised or written. saved_dtype: the compute dtype checkpoint `latest` was written in,
    where it differs from model.dtype (checkpoint.allow_changed=model.dtype)."""
    if abstract:
        parts = build_model(model_factory(cfg, mcfg, plan), plan.rules, init_params=False)
        program = build_program(cfg, plan, parts)
        return TrainState(parts, program, None, 0,
                          *program.abstract_state(parts.params, program.abstract_opt_state),
                          layout_programs(cfg, mcfg, plan, program))
    ckpt = None
    try:
        if latest is None and cfg.model.hf_path and cfg.model.load_weights:
            parts = _pretrained_parts(cfg, plan)
        else:
            parts = build_model(model_factory(cfg, mcfg, plan), plan.rules,
                                init_params=latest is None)
        program = build_program(cfg, plan, parts)
        ckpt = Checkpointer(run_dir, cfg.checkpoint, cfg.train.steps)  # makes checkpoints/
        start = 0
        if latest is not None:
            params, opt_state, meta = _restore(cfg, ckpt, latest, program, parts, saved_dtype)
            parts.params = params
            start = int(meta["data_step"])
        elif plan.offload_state:  # straight into host memory, a leaf at a time
            parts.params = jax.device_put(parts.params, program.param_shardings)
            opt_state = streamed.init_opt_state(program.tx, parts.params, program.opt_shardings)
        else:
            opt_state = init_opt_state(program.tx, parts.params, program.opt_shardings)
        return TrainState(parts, program, ckpt, start, parts.params, opt_state,
                          layout_programs(cfg, mcfg, plan, program))
    except BaseException:
        if ckpt is not None:
            ckpt.close()  # its threads
        raise


def compile_steps(cfg: Config, state: TrainState, devices, log: Callable[[str], None],
                  record_dir: str | None = None) -> tuple[list, list]:
    """The compiled train step of each layout the run may take (state.programs: one unless
    parallel.mode=adaptive), each checked against device memory, and each one's collectives
    (logged, and written to record_dir/collectives.json: the static layout's, with the others'
    under "layouts"; None: not written)."""
    per_host = state.program.plan.layout.devices_per_host
    compiled, collectives, lines, t0 = [], [], [], time.perf_counter()
    what = "the train step" if len(state.programs) == 1 else \
        f"the train steps of {len(state.programs)} layouts"
    with compile_progress.announced(what, log, record_dir):
        programs = list(state.programs)
        for i, program in enumerate(programs):
            t = time.perf_counter()
            # the static layout's from its state; the others placed like it: shapes on their mesh
            args = (state.params, state.opt_state) if i == 0 else \
                program.abstract_state(state.params, state.opt_state)
            programs[i], step = compile_fallback.compile_step(program, *args, log)
            compiled.append(step)
            planning.check_compiled_memory(cfg, compiled[-1], devices)
            try:  # a diagnostic: an HLO printing the parser does not know never stops a run
                found = comm.parse_collectives(compiled[-1].as_text(), len(devices))
                described = describe_collectives(found, per_host)
            except Exception as e:  # noqa: BLE001
                found, described = [], f"(not parsed: {type(e).__name__}: {e})"
            collectives.append(found)
            seconds = time.perf_counter() - t
            if len(state.programs) == 1:
                lines.append(f"compiled the train step in {seconds:.1f}s; per step: " + described)
            else:
                lines.append(f"compiled the step of layout {program.plan.layout.short_name} in "
                             f"{seconds:.1f}s; per step: " + described)
    state.programs, state.program = tuple(programs), programs[0]  # rebuilt where cuDNN was refused
    if len(state.programs) > 1:
        lines.insert(0, f"adaptive layouts: compiled {len(compiled)} steps in "
                        f"{time.perf_counter() - t0:.1f}s")
    if record_dir is not None:
        write_collectives(record_dir, collectives[0], state.program.plan.layout,
                          others=[(p.plan.layout, c) for p, c in
                                  zip(state.programs[1:], collectives[1:])])
    for line in lines:
        log(line)
    return compiled, collectives


def describe_collectives(collectives, devices_per_host: int) -> str:
    """One line: per kind, the count and MiB per device (inter-host MiB where any)."""
    parts = []
    for kind, row in comm.summarize(collectives, devices_per_host).items():
        text = f"{kind} {row['count']} ({row['bytes'] / 2**20:.2f} MiB"
        if row["inter_host_wire_bytes"]:
            text += f", {row['inter_host_wire_bytes'] / 2**20:.2f} MiB inter-host"
        parts.append(text + ")")
    return ", ".join(parts) or "none"


def _restore(cfg: Config, ckpt: Checkpointer, step: int, program: TrainProgram, parts,
             saved_dtype: str | None):
    """(params, opt_state, meta) of checkpoint `step`. float16 keeps its loss scale as the first
    state of the optimizer chain (train.program.step.make_optimizer): a checkpoint written in another
    compute dtype (saved_dtype) has it where this run keeps none, or lacks the one this run
    keeps, so it is restored as written and the scale dropped, or started afresh."""
    target_params, target_opt = program.abstract_state(parts.params, program.abstract_opt_state)
    now = loss_scaling(compute_dtype(cfg.model.dtype, program.plan.mesh.devices.flat[0]))
    then = now if saved_dtype is None else loss_scaling(saved_dtype)
    if (now is None) == (then is None):
        return ckpt.restore(step, target_params, target_opt)
    replicated = program.plan.rules.replicated
    if then is not None:  # float16 -> another dtype: drop the checkpoint's scale
        scale = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                             initial_loss_scale(then))
        params, opt_state, meta = ckpt.restore(step, target_params, (scale, *target_opt))
        return params, tuple(opt_state[1:]), meta
    params, opt_state, meta = ckpt.restore(step, target_params, tuple(target_opt[1:]))
    return params, (jax.device_put(initial_loss_scale(now), replicated), *opt_state), meta


def _pretrained_parts(cfg: Config, plan: RunPlan):
    """model.hf_path's weights, placed by the run's strategy and checked to be finite."""
    module = models.from_pretrained(cfg.model.hf_path, options=model_options(cfg, plan))
    parts = from_module(module, plan.rules)
    del module
    check_finite_weights(parts.params, cfg.model.hf_path)
    return parts


def check_finite_weights(params, source: str) -> None:
    """Every loaded weight is finite (a NaN in the pretrained weights would make every step
    non-finite and skipped). Checked on the host, shard by shard: nothing compiles."""
    name = first_non_finite(params)
    if name is not None:
        raise models.ModelError(
            f"{source}: weight {name} holds NaN or Inf values; the checkpoint is damaged "
            "(re-download or re-export it)")
