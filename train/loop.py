"""`run(config)`: plan the layout, build or restore the state, train, checkpoint, log, export."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import time
import typing
from typing import Any

import jax
import numpy as np
from flax import nnx

import models
from basp_jax import Layout, comm

from . import planning, runtime
from . import evaluate, profiling, writers
from .checkpoint import (Checkpointer, abstract_tree, checkpoint_dir, complete_steps,
                         inspect_latest, storage_error)
from .config import Config, ConfigError, _coerce, to_yaml, yaml_load
from .data import Pipeline
from .lock import RunDirLock, check_free
from .metrics import MetricsLogger, peak_flops
from .peers import PeerWatchdog
from .program import build_program, model_factory, plan_run
from .stop import StopRequest
from .step import DTYPES, build_model, from_module, init_opt_state, make_optimizer


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
            value = _coerce(f"model.shape.{key}", value, tp)
        elif isinstance(value, str):
            value = yaml_load(value)
        changes[key] = value
    return dataclasses.replace(base, **changes)


def select_devices(cfg: Config) -> list:
    """The devices to train on: all of them, or the first runtime.devices; on a single-process CPU
    run at most runtime.cpu_devices. runtime.platform=cpu takes the CPU even beside GPUs; gpu
    refuses a JAX without one."""
    platform = cfg.runtime.platform
    devices = jax.devices("cpu") if platform == "cpu" else jax.devices()
    if platform == "gpu" and devices[0].platform != "gpu":
        raise ConfigError(runtime.no_gpu_message(jax.__version__))
    want = cfg.runtime.cpu_devices
    if devices[0].platform == "cpu":
        local = jax.local_device_count()
        if local < want:
            raise ConfigError(
                f"runtime.cpu_devices={want} but JAX started with {local} CPU devices per process; "
                "set it before JAX initialises (python train.py does) or lower it"
            )
        if jax.process_count() == 1:
            devices = devices[:want]
    n = cfg.runtime.devices
    if n is not None:
        if n > len(devices):
            raise ConfigError(
                f"runtime.devices={n} but only {len(devices)} {devices[0].platform} device(s) are "
                f"visible; lower runtime.devices or leave it null (all devices)"
            )
        if jax.process_count() > 1 and n != len(devices):
            raise ConfigError(
                f"runtime.devices={n} would leave some of the {jax.process_count()} processes' "
                f"{len(devices)} devices idle; leave it null in multi-process runs"
            )
        devices = devices[:n]
    return devices


# files the trainer writes in run.dir, and what each must be when it exists already
RUN_DIR_FILES = ("config.yaml", "metrics.jsonl", "metrics.jsonl.tmp", "collectives.json")
EXPORT_MARKER = ".basp-export.json"  # in an export: which run.dir wrote it


def _check_creatable(key: str, path: str) -> None:
    """`path` is a writable directory, or can be created: every name fits the file system and the
    nearest existing ancestor is a writable directory."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key} {path!r} is a file, not a directory; choose another path")
    if os.path.isdir(path):
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{key} {path!r} is not writable; fix its permissions or "
                              "choose another path")
        return
    ancestor = os.path.dirname(path)
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ConfigError(f"{key} {path!r} cannot be created: {ancestor} is a file, not a "
                          "directory; choose another path")
    try:
        name_max = os.pathconf(ancestor, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    for part in os.path.relpath(path, ancestor).split(os.sep):
        if len(os.fsencode(part)) > name_max:
            raise ConfigError(f"{key}: the name {part[:40]!r}... is {len(os.fsencode(part))} bytes, "
                              f"more than the {name_max} this file system allows; choose a shorter "
                              "path")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"{key} {path!r} cannot be created: {ancestor} is not writable")


def check_output_paths(cfg: Config, run_dir: str) -> None:
    """run.dir (and checkpoint.export_hf) are directories or can be created, the files the trainer
    writes there are files it can write, and an export never replaces someone else's files."""
    _check_creatable("run.dir", run_dir)
    for name in RUN_DIR_FILES:
        path = os.path.join(run_dir, name)
        if os.path.lexists(path) and not os.path.isfile(path):
            raise ConfigError(f"{path} is not a regular file (the trainer writes it); move it "
                              "out of run.dir")
        if os.path.isfile(path) and not os.access(path, os.W_OK):
            raise ConfigError(f"{path} is not writable; fix its permissions")
    export = cfg.checkpoint.export_hf
    if not export:
        return
    _check_creatable("checkpoint.export_hf", export)
    export = os.path.realpath(export)
    if cfg.model.hf_path and export == os.path.realpath(cfg.model.hf_path):
        raise ConfigError(f"checkpoint.export_hf {export!r} is model.hf_path: the export would "
                          "replace the pretrained weights; choose another directory")
    if os.path.isdir(export) and os.listdir(export) and _export_owner(export) != run_dir:
        raise ConfigError(
            f"checkpoint.export_hf {export!r} holds other files and is not an earlier export of "
            "this run.dir; choose a new or empty directory (an export never replaces files it "
            "did not write)")


def _export_owner(export_dir: str) -> str | None:
    """The run.dir that wrote the export in export_dir, or None."""
    import json

    try:
        with open(os.path.join(export_dir, EXPORT_MARKER)) as f:
            return json.load(f)["run_dir"]
    except Exception:  # noqa: BLE001
        return None


def export_hf(module, export_dir: str, run_dir: str, is_writer: bool) -> None:
    """Write the Hugging Face export into a fresh directory beside export_dir, then move it into
    place: an interrupted export leaves the previous one (or nothing) rather than a mixture.
    check_output_paths has made sure export_dir is new, empty or an earlier export of this run."""
    import json
    import shutil
    import tempfile

    parent = os.path.dirname(export_dir)
    tmp = None
    if is_writer:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=parent, prefix=".export-")
    try:
        # every process takes part (shards are gathered one at a time); process 0 writes
        models.save_pretrained(module, tmp or export_dir)
        if not is_writer:
            return
        with open(os.path.join(tmp, EXPORT_MARKER), "w") as f:
            json.dump({"run_dir": run_dir}, f)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the export is for others to read
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
        old = None
        if os.path.isdir(export_dir) and os.listdir(export_dir):  # an earlier export of this run
            old = tempfile.mkdtemp(dir=parent, prefix=".export-old-")
            os.rename(export_dir, os.path.join(old, "export"))
        os.replace(tmp, export_dir)  # also over an empty directory
        tmp = None
        if old is not None:
            shutil.rmtree(old)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def check_finite_weights(params, source: str) -> None:
    """Every loaded weight is finite (a NaN in the pretrained weights would make every step
    non-finite and skipped). Checked on the host, shard by shard: nothing compiles."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        for shard in leaf.addressable_shards:
            data = np.asarray(shard.data)
            if jax.numpy.issubdtype(data.dtype, jax.numpy.inexact) and not np.isfinite(data).all():
                name = ".".join(str(getattr(k, "key", k)) for k in path)
                raise models.ModelError(
                    f"{source}: weight {name} holds NaN or Inf values; the checkpoint is damaged "
                    "(re-download or re-export it)")


class NonFiniteError(RuntimeError):
    """The loss or gradients became NaN/Inf and the config says to stop."""


def describe_collectives(collectives, devices_per_host: int) -> str:
    """One line: per kind, the count and MiB per device (inter-host MiB where any)."""
    parts = []
    for kind, row in comm.summarize(collectives, devices_per_host).items():
        text = f"{kind} {row['count']} ({row['bytes'] / 2**20:.2f} MiB"
        if row["inter_host_wire_bytes"]:
            text += f", {row['inter_host_wire_bytes'] / 2**20:.2f} MiB inter-host"
        parts.append(text + ")")
    return ", ".join(parts) or "none"


def _write_collectives(run_dir: str, collectives, layout: Layout) -> None:
    """{run.dir}/collectives.json: per kind, count and bytes per device (total, on the wire,
    between hosts) of one compiled train step, for benchmarks."""
    import json

    table = comm.summarize(collectives, layout.devices_per_host)
    with open(os.path.join(run_dir, "collectives.json"), "w") as f:
        json.dump({"layout": layout.describe(), "devices_per_host": layout.devices_per_host,
                   "per_kind": table}, f, indent=1)


def run(cfg: Config, *, stop_at: int | None = None) -> dict[str, Any]:
    """Train as configured; returns a summary with the per-step losses of this invocation.

    stop_at ends the invocation after that many completed steps (with a checkpoint), as a
    preemption would; running again resumes from it. In a multi-process run a peer that dies ends
    this process too (train.peers, exit status 3) instead of leaving it blocked in a collective.
    """
    runtime.configure(cfg)
    directory = checkpoint_dir(cfg.run.dir)

    def resume_advice() -> str:
        steps = complete_steps(directory)
        where = f"the newest checkpoint is step {steps[-1]} in {directory}" if steps else \
            "no checkpoint was written yet"
        return f"Rerun the same command on every host to resume ({where})."

    with PeerWatchdog(cfg.runtime.distributed.peer_timeout_s, resume_advice):
        try:
            return _run(cfg, stop_at)
        except OSError as e:  # metrics.jsonl, config.yaml, the export: a full disk is one line
            full = storage_error(e, directory)
            if full is None:
                raise
            raise full from None
        except jax.errors.JaxRuntimeError as e:
            first = " ".join(str(e).split())[:300]
            if jax.process_count() == 1 or not LOST_PEER.search(first):
                raise  # e.g. out of memory: not a peer's fault
            raise PeerFailure(
                f"a collective failed ({first}): another process has probably crashed or was "
                f"killed; see its log. {resume_advice()}") from None


# How a collective reports a peer that went away (gloo on CPU, NCCL on GPU, the gRPC transport).
LOST_PEER = re.compile(r"connection (closed|reset|refused)|closed by peer|socket closed|"
                       r"broken pipe|remote process exited|UNAVAILABLE|heartbeat", re.IGNORECASE)


class PeerFailure(RuntimeError):
    """A multi-process run lost a peer (train.peers catches silent ones; this, failed collectives)."""


def _run(cfg: Config, stop_at: int | None) -> dict[str, Any]:
    # process 0 owns run.dir (the lock is taken once the checks have passed)
    owner = RunDirLock(os.path.abspath(cfg.run.dir)) if jax.process_index() == 0 else None
    try:
        return _run_owned(cfg, stop_at, owner)
    finally:
        if owner is not None:
            owner.__exit__(*sys.exc_info())


def check_kernel(cfg: Config, platform: str) -> None:
    """model.attn_impl names a kernel this platform has."""
    if cfg.model.attn_impl == "cudnn" and platform != "gpu":
        raise ConfigError(f"model.attn_impl=cudnn needs a GPU but the devices are {platform}; use "
                          "auto (cuDNN where it applies), xla or blockwise")


def _run_owned(cfg: Config, stop_at: int | None, owner: "RunDirLock | None") -> dict[str, Any]:
    is_writer = owner is not None
    run_dir = os.path.abspath(cfg.run.dir)

    # ---- everything that can be wrong is checked here, before anything compiles or is written
    if is_writer:
        check_free(run_dir)  # another run owns it: say so before reading what it is writing
    check_output_paths(cfg, run_dir)
    mcfg = model_config(cfg)
    if cfg.model.hf_path and cfg.model.load_weights:
        models.check_pretrained(cfg.model.hf_path, mcfg)  # tensor names and shapes, headers only
    devices = select_devices(cfg)
    check_kernel(cfg, devices[0].platform)
    writers.check(cfg, is_writer)
    peak, peak_source = peak_flops(cfg.metrics, getattr(devices[0], "device_kind", None))
    per_host = cfg.parallel.devices_per_host or len(devices) // jax.process_count()
    run_plan = plan_run(cfg, mcfg, devices, per_host)
    layout, strategy, mesh, seq_order = (run_plan.layout, run_plan.strategy, run_plan.mesh,
                                         run_plan.seq_order)
    planning.check_memory(cfg, mcfg, layout, strategy, devices)  # before any row is generated
    data = Pipeline(
        cfg.data,
        vocab_size=mcfg.vocab_size,
        grad_accum=cfg.train.grad_accum,
        microbatch=cfg.train.microbatch_size,
        seed=cfg.run.seed,
        pad_rows=layout.batch - cfg.train.microbatch_size,
        seq_order=seq_order,
    )
    eval_data = evaluate.eval_data(cfg, mcfg.vocab_size, seq_order=seq_order,  # None: no eval
                                   pad_rows=layout.batch - cfg.train.microbatch_size)
    dtype, param_dtype = DTYPES[cfg.model.dtype], DTYPES[cfg.model.param_dtype]
    tx, _ = make_optimizer(cfg.optimizer, cfg.train.steps)  # its state's structure, for inspection
    latest = None
    if cfg.checkpoint.resume:
        expected = nnx.to_pure_dict(
            nnx.state(models.abstract_model(mcfg, param_dtype=param_dtype,
                                            scan_layers=cfg.model.scan_layers), nnx.Param))
        latest, meta = inspect_latest(run_dir, expected, jax.eval_shape(tx.init, expected))
        if latest is not None and latest > cfg.train.steps:
            raise ConfigError(
                f"run.dir holds a checkpoint of step {latest}, beyond train.steps={cfg.train.steps}; "
                "raise train.steps or use a new run.dir"
            )
        if latest is not None and int(meta.get("seed", cfg.run.seed)) != cfg.run.seed:
            raise ConfigError(
                f"run.seed={cfg.run.seed} differs from the checkpoint's seed {meta['seed']}; "
                "a resumed run must keep its seed (or use a new run.dir)"
            )
    else:
        existing = complete_steps(checkpoint_dir(run_dir))
        if existing:
            raise ConfigError(
                f"checkpoint.resume=false but {checkpoint_dir(run_dir)} holds steps "
                f"{existing}, which a fresh run would overwrite or prune; use a new run.dir, "
                "or resume (checkpoint.resume=true)"
            )

    # ---- build or load the state; a checkpoint that fails to restore (damaged array data, which
    # no metadata shows) still stops here, before the train step compiles and before any write
    ckpt = None
    try:
        if latest is None and cfg.model.hf_path and cfg.model.load_weights:
            module = models.from_pretrained(
                cfg.model.hf_path, mesh=mesh, dtype=dtype, param_dtype=param_dtype,
                attn_impl=cfg.model.attn_impl, remat=cfg.model.remat,
                # loaded over the whole mesh; from_module places it by the run's strategy
                param_sharding="fsdp" if strategy == "host" else strategy,
                ring=layout.ring, zigzag=run_plan.zigzag, scan_layers=cfg.model.scan_layers,
            )
            parts = from_module(module, mesh, strategy, layout.devices_per_host)
            del module
            check_finite_weights(parts.params, cfg.model.hf_path)
        else:
            parts = build_model(model_factory(cfg, mcfg, run_plan), mesh, strategy,
                                init_params=latest is None,
                                devices_per_host=layout.devices_per_host)
        program = build_program(cfg, run_plan, parts)
        param_sh, abs_opt, opt_sh = (program.param_shardings, program.abstract_opt_state,
                                     program.opt_shardings)
        if owner is not None:
            owner.__enter__()  # the first write: run.dir (if new) and its lock
        ckpt = Checkpointer(run_dir, cfg.checkpoint, cfg.train.steps)  # creates run.dir/checkpoints

        start = 0
        if latest is not None:
            params, opt_state, meta = ckpt.restore(
                latest, abstract_tree(parts.params, param_sh), abstract_tree(abs_opt, opt_sh)
            )
            parts.params = params
            start = int(meta["data_step"])
        else:
            opt_state = init_opt_state(program.tx, parts.params, opt_sh)
        params = parts.params
    except BaseException:
        if ckpt is not None:
            ckpt.close()  # its threads
        raise

    # ---- the checks passed and the state is in place: only now is run.dir written
    if is_writer:
        print(to_yaml(cfg), end="", flush=True)
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            f.write(to_yaml(cfg))

    batch_sharding = program.batch_sharding
    logger = MetricsLogger(run_dir, cfg.metrics, total_steps=cfg.train.steps, start_step=start,
                           is_writer=is_writer)
    logger.message(f"layout: {layout.describe()}")
    logger.message(
        f"model: {mcfg.model_type} {mcfg.num_params() / 1e6:.2f}M params, {strategy} parameters; "
        f"data: {data.name}"
    )
    if latest is not None:
        logger.message(f"resumed from {ckpt.directory} at step {start}")
    if cfg.optimizer.warmup_steps > cfg.train.steps:
        logger.message(f"note: optimizer.warmup_steps={cfg.optimizer.warmup_steps} is longer than "
                       f"the run; warming up over train.steps={cfg.train.steps} instead")

    losses: list[float] = []
    tokens_per_step = cfg.train.grad_accum * cfg.train.microbatch_size * cfg.data.seq_len
    # MaxText's and Megatron's count: a causal kernel computes half of the S x S scores
    flops_per_token = mcfg.flops_per_token(cfg.data.seq_len, causal=True)
    logger.message(f"mfu: {flops_per_token / 1e9:.4g} GFLOP per token (6N + causal attention) "
                   f"against {peak_source}" if peak else f"mfu: {peak_source}")
    compiled = None
    collectives = []
    wall0 = time.perf_counter()
    step_times = []
    stop = StopRequest()
    writer = None
    profiler = profiling.Profiler(cfg, run_dir, is_writer=is_writer, log=logger.message)
    evaluator = evaluate.Evaluator(cfg, program, parts, eval_data)

    def finish(step: int, metrics, evaluation, last_end: float) -> float:
        """Read step `step`'s metrics (waiting for it to end) and its evaluation's (None: none
        started), log them, apply the non-finite policy; returns when it was seen to end.
        step_time_s runs from the previous step's end, so it includes any time the host kept the
        devices waiting."""
        metrics = jax.device_get(metrics)
        ended = time.perf_counter()
        dt = ended - last_end
        step_times.append(dt)
        loss = float(metrics["loss"])
        losses.append(loss)
        tps = tokens_per_step / dt
        record = {
            "step": step + 1,
            "loss": loss,
            "grad_norm": float(metrics["grad_norm"]),
            "lr": float(metrics["lr"]),
            "tokens_per_s": tps,
            "step_time_s": dt,
            "loss_tokens": int(metrics["tokens"]),  # targets that count (not masked)
            "mfu": (flops_per_token * tps / (peak * len(devices))) if peak else None,
        }
        finite = bool(metrics["finite"])
        record["skipped"] = not finite
        if evaluation is not None:
            record.update(evaluator.finish(evaluation, log=logger.message, step=step + 1))
        logger.log(record)
        writer.write(record)
        if not finite:
            if math.isfinite(loss) and math.isfinite(record["grad_norm"]):
                what = (f"the update (loss {loss}, grad norm {record['grad_norm']}) "
                        "made the parameters or optimizer state non-finite")
            else:
                what = f"loss {loss} / grad norm {record['grad_norm']} is not finite"
            message = f"step {step + 1}: {what}; the parameters were left unchanged"
            if cfg.train.on_nonfinite == "stop":
                ckpt.wait()  # an async save of an earlier step completes first
                saved = complete_steps(ckpt.directory)
                where = (f"the last checkpoint (step {saved[-1]}) holds finite state"
                         if saved else "no checkpoint was written")
                raise NonFiniteError(
                    f"{message}; stopping (train.on_nonfinite=stop); {where}; lower "
                    "optimizer.lr or set optimizer.clip_norm")
            logger.message(f"{message}; skipped (train.on_nonfinite=skip)")
        return ended

    try:
        writer = writers.Writers(cfg, run_dir, start_step=start, is_writer=is_writer,
                                 devices=devices)
        with stop:  # to the end: a signal while saving or exporting waits for them
            with jax.set_mesh(mesh):
                end = cfg.train.steps if stop_at is None else min(stop_at, cfg.train.steps)
                batch = data.global_batch(start, batch_sharding) if start < end else None
                step_arr = None
                pending = None  # (step, metrics, evaluation) read after the next dispatch
                last_end = None  # when the previous step was seen to end
                for step in range(start, end):
                    if compiled is None:
                        t = time.perf_counter()
                        compiled = program.lower(params, opt_state).compile()
                        planning.check_compiled_memory(cfg, compiled, devices)
                        try:  # a diagnostic: an HLO printing the parser does not know never stops a run
                            collectives = comm.parse_collectives(compiled.as_text(), len(devices))
                            described = describe_collectives(collectives, layout.devices_per_host)
                        except Exception as e:  # noqa: BLE001
                            collectives, described = [], f"(not parsed: {type(e).__name__}: {e})"
                        if is_writer:
                            _write_collectives(run_dir, collectives, layout)
                        logger.message(
                            f"compiled the train step in {time.perf_counter() - t:.1f}s; per step: "
                            + described
                        )
                        # placed once, then the step returns the next one: a device_put per step
                        # would be a cross-process check (assert_equal) in multi-process runs
                        step_arr = program.step_index(step)
                        last_end = time.perf_counter()
                    profiler.before_step(step + 1)
                    params, opt_state, metrics = compiled(params, opt_state, batch, step_arr)
                    step_arr = metrics.pop("next_step")
                    profiler.after_step(step + 1, (params, opt_state))
                    # dispatched before the next step, which takes (donates) these parameters
                    evaluation = evaluator.start(params) if evaluator.due(step + 1) else None
                    if pending is not None:  # read step k's metrics while step k+1 runs
                        last_end = finish(*pending, last_end)
                        pending = None
                    done = step + 1
                    last = done == end
                    if not last:  # build the next batch while the device runs this step
                        batch = data.global_batch(done, batch_sharding)
                    stopping = stop.agree_at_end() if last else stop.should_stop(done)
                    force = stopping or (last and (cfg.checkpoint.save_final
                                                   or done < cfg.train.steps))
                    if not (last or force or ckpt.due(done)):
                        pending = (step, metrics, evaluation)
                        continue
                    # the last step, a checkpoint or a stop: this step's metrics first (a
                    # non-finite step under on_nonfinite=stop is never saved), then its state,
                    # before the next dispatch takes (donates) it
                    last_end = finish(step, metrics, evaluation, last_end)
                    meta = {"step": done, "data_step": done, "seed": cfg.run.seed,
                            "layout": layout.describe()}
                    ckpt.save(done, params, opt_state, meta, force=force)
                    if stopping and not last:
                        logger.message(
                            f"received {stop.requested or 'a stop signal on another process'}: "
                            f"finished step {done} and saved a checkpoint; run the same command "
                            "again to resume")
                        break
            ckpt.wait()
            if cfg.checkpoint.export_hf and not stop.stopped:
                export_dir = os.path.realpath(cfg.checkpoint.export_hf)
                export_hf(parts.module(params), export_dir, run_dir, is_writer)
                logger.message(f"exported Hugging Face weights to {export_dir}")
    finally:
        profiler.close()
        if writer is not None:
            writer.close()
        ckpt.close()
        logger.close()

    wall = time.perf_counter() - wall0
    summary = {
        "steps": start + len(losses),
        "start_step": start,
        "losses": losses,
        "wall_s": wall,
        "params": params,
        "layout": layout,
        "collectives": collectives,
    }
    if is_writer:
        if losses:
            steady = step_times[1:] or step_times
            mean_tps = tokens_per_step / (sum(steady) / len(steady))
            mfu = f", mfu {flops_per_token * mean_tps / (peak * len(devices)):.1%}" if peak else ""
            print(
                f"done: steps {start + 1}-{start + len(losses)} of {cfg.train.steps} in "
                f"{wall:.1f}s, loss {losses[0]:.4f} -> "
                f"{losses[-1]:.4f}, {mean_tps:,.0f} tokens/s{mfu}; outputs in {run_dir}",
                flush=True,
            )
        else:
            print(f"done: {run_dir} already holds step {start} of {cfg.train.steps}", flush=True)
    return summary
