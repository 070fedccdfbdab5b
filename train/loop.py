"""`run(config)`: check the run (train.prepare), take run.dir's lock, build the state and compile
its step (train.program.state), then the step loop: metrics (train.observe.report), evaluation, profiling,
checkpoints, the stop protocol (train.process.stop), the export."""

from __future__ import annotations

import contextlib
import os
import re
import time
from typing import Any

import jax

from basp_jax.adaptive import relabel

from .observe import evaluate
from .observe import profiling
from .observe import writers
from .checkpoint import snapshot
from .checkpoint.store import checkpoint_dir, complete_steps, storage_error
from .config.schema import Config
from .data.batches import for_run
from .observe.metrics import MetricsLogger
from .prepare import Run, check, model_config, select_devices
from .process import agreement, runtime
from .process.lock import RunDirLock
from .process.outputs import export_hf, write_config
from .process.peers import PeerWatchdog
from .process.step_watch import StepWatchdog
from .process.stop import StopRequest
from .observe.report import NonFiniteError, StepReport, log_start
from .program import planning
from .program.state import TrainState, build_state, compile_steps

__all__ = ["run", "model_config", "select_devices", "NonFiniteError", "PeerFailure"]


def run(cfg: Config, *, stop_at: int | None = None) -> dict[str, Any]:
    """Train as configured; returns a summary with the per-step losses of this invocation.

    stop_at ends the invocation after that many completed steps (with a checkpoint), as a
    preemption would; running again resumes from it. In a multi-process run a peer that dies ends
    this process too (train.process.peers, exit status 3) instead of leaving it blocked in a
    collective.
    """
    runtime.configure(cfg)
    try:  # every process runs this config on this data, before anything compiles or is written
        agreement.check_same_config(cfg)
    except agreement.NoAnswer as e:
        raise PeerFailure(str(e)) from None
    directory = checkpoint_dir(cfg.run.dir)
    with PeerWatchdog(cfg.runtime.distributed.peer_timeout_s, lambda: resume_advice(cfg),
                      join_s=cfg.runtime.distributed.join_timeout_s):
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
                f"killed; see its log. {resume_advice(cfg)}") from None


def resume_advice(cfg: Config) -> str:
    """What to do after the run ended abnormally: rerun, from the newest checkpoint."""
    steps = complete_steps(checkpoint_dir(cfg.run.dir))
    where = f"the newest checkpoint is step {steps[-1]} in {checkpoint_dir(cfg.run.dir)}" \
        if steps else "no checkpoint was written yet"
    return f"Rerun the same command on every host to resume ({where})."


# How a collective reports a peer that went away (gloo on CPU, NCCL on GPU, the gRPC transport).
LOST_PEER = re.compile(r"connection (closed|reset|refused)|closed by peer|socket closed|"
                       r"broken pipe|remote process exited|UNAVAILABLE|heartbeat", re.IGNORECASE)


class PeerFailure(RuntimeError):
    """A multi-process run lost a peer (train.process.peers catches silent ones; this, failed
    collectives)."""


def _run(cfg: Config, stop_at: int | None) -> dict[str, Any]:
    """Check, then (process 0 owning run.dir from its first write to the end) build the state,
    compile and train."""
    run = check(cfg, is_writer=jax.process_index() == 0)  # nothing compiled or written before
    owner = RunDirLock(run.run_dir) if run.is_writer else contextlib.nullcontext()
    with owner:
        state = build_state(cfg, run.mcfg, run.plan, run_dir=run.run_dir, latest=run.latest,
                            saved_dtype=run.saved_dtype)
        try:
            return _train(run, state, stop_at)
        finally:
            state.ckpt.close()


def _train(run: Run, state: TrainState, stop_at: int | None) -> dict[str, Any]:
    """The steps of this invocation with their metrics, evaluations, profile, checkpoints and the
    export, from a built state."""
    cfg = run.cfg
    end = cfg.train.steps if stop_at is None else min(stop_at, cfg.train.steps)
    idle = state.start >= end  # nothing to train: run.dir is left as it is
    # ---- the checks passed and the state is in place: only now is run.dir written
    if run.is_writer and not idle:
        write_config(cfg, run.run_dir)
    logger = MetricsLogger(run.run_dir, cfg.metrics, total_steps=cfg.train.steps,
                           start_step=state.start, is_writer=run.is_writer, files=not idle)
    log_start(run, state, logger)
    wall0 = time.perf_counter()
    stop = StopRequest()
    writer = None
    profiler = profiling.Profiler(cfg, run.run_dir, is_writer=run.is_writer, log=logger.message)
    evaluator = evaluate.Evaluator(cfg, state.program, state.parts, run.eval_data)
    try:
        writer = writers.Writers(cfg, run.run_dir, start_step=state.start,
                                 is_writer=run.is_writer and not idle, devices=run.devices)
        report = StepReport(run, state, logger, writer, evaluator)
        with stop:  # to the end: a signal while saving or exporting waits for them
            with jax.set_mesh(run.plan.mesh), StepWatchdog(cfg.runtime.step_timeout_s,
                                                           lambda: resume_advice(cfg)) as watch:
                collectives = train_steps(run, state, end, report, profiler, stop, watch)
            stop.take_over()  # (done after the compile; here when no step ran)
            state.ckpt.wait()
            if cfg.checkpoint.export_hf and not stop.stopped:
                export(run, state, logger.message)
    finally:
        run.data.close()
        profiler.close()
        if writer is not None:
            writer.close()
        logger.close()
    return report.summary(time.perf_counter() - wall0, collectives)


def save_checkpoint(run: Run, state: TrainState, step: int, force: bool, copy=None) -> None:
    """The state after `step` (1-based), or `copy`, its (params, opt_state) copied on the
    devices, with what a resume checks and reads."""
    meta = {"step": step, "data_step": step, "seed": run.cfg.run.seed,
            "layout": run.layout.describe(), "resume": run.record}
    params, opt_state = copy if copy is not None else (state.params, state.opt_state)
    # a copy no step donates: its copy to host memory overlaps the next step (in a thread
    # beside the next steps where one process runs)
    state.ckpt.save(step, params, opt_state, meta, force=force, background=copy is not None)


def copies_before_saving(run: Run, state: TrainState, compiled: list, log) -> bool:
    """checkpoint.copy_on_device: whether periodic saves write a copy of the state made on the
    devices, while the next step runs (train.checkpoint.snapshot)."""
    setting = run.cfg.checkpoint.copy_on_device
    if setting is False or run.cfg.checkpoint.every == 0:
        return False
    if jax.process_count() > 1:
        # orbax's barriers between processes are collective programs: one after the next
        # dispatch waits for that step, so a save there stalls the loop for a whole step
        if setting is True:
            log("checkpoint.copy_on_device=true applies to one process only; with "
                f"{jax.process_count()} the state is saved itself before the next step")
        return False
    fits, why = snapshot.copy_fits(compiled, planning.device_memory(run.devices[0]),
                                   (state.params, state.opt_state),
                                   run.devices[0].platform == "cpu")
    if setting == "auto" and not fits:
        log(f"checkpoints copy the state to host memory before the next step ({why}); "
            "checkpoint.copy_on_device=true copies it on the device anyway")
    return setting is True or fits


def export(run: Run, state: TrainState, log) -> None:
    """checkpoint.export_hf: the final weights as a Hugging Face directory."""
    export_dir = os.path.realpath(run.cfg.checkpoint.export_hf)
    export_hf(state.parts.module(state.params), export_dir, run.run_dir, run.is_writer, run.cfg)
    log(f"exported Hugging Face weights to {export_dir}")


def train_steps(run: Run, state: TrainState, end: int, report: StepReport, profiler,
                stop: StopRequest, watch: StepWatchdog) -> list:
    """Steps state.start .. end - 1, advancing its params and opt_state; returns the compiled
    (static layout's) step's collectives (none when no step ran). Step k's metrics are read after
    step k + 1 is dispatched, so the host's work overlaps the devices' (except before a save, an
    evaluation or a stop). Under parallel.mode=adaptive each step runs the program of the layout
    its batch was packed for (train.data.batches); between steps the parameters and optimizer
    state are placed as the static layout's program takes them, so evaluation, checkpoints and
    the export see one placement, and a switch only relabels them (basp_jax.adaptive.relabel:
    nothing is copied)."""
    if state.start >= end:
        return []
    batches = for_run(run.data, state.programs)
    try:
        return _steps(run, state, end, report, profiler, stop, watch, batches)
    finally:
        batches.close()


def _steps(run: Run, state: TrainState, end: int, report: StepReport, profiler,
           stop: StopRequest, watch: StepWatchdog, batches) -> list:
    cfg, ckpt = run.cfg, state.ckpt
    evaluator, log = report.evaluator, report.logger.message
    # each call hands over a batch built in the background and starts the next one's
    index, batch = batches.get(state.start, prefetch=state.start + 1 < end)
    compiled, collectives = compile_steps(cfg, state, run.devices, log,
                                          record_dir=run.run_dir if run.is_writer else None)
    report.describe_layouts(state.programs, collectives)
    watch.progress()  # compiled: from here on a step that never ends is noticed
    stop.take_over()  # until now a signal ended the process at once (train.process.stop)
    # placed once, then the step returns the next one: a device_put per step would be a
    # cross-process check (assert_equal) in multi-process runs
    step_arr = state.program.step_index(state.start)
    pending = None  # (step, metrics, evaluation) read after the next dispatch
    copy_saves = copies_before_saving(run, state, compiled, log)
    deferred = None  # a periodic save's (step, state copy): written once its metrics are read
    last_end = time.perf_counter()  # when the previous step was seen to end
    for step in range(state.start, end):
        done = step + 1
        profiler.before_step(done)
        if index:  # another layout of the adaptive set: its mesh's names for the same placement
            program = state.programs[index]
            params, opt_state, metrics = compiled[index](
                relabel(state.params, program.param_shardings),
                relabel(state.opt_state, program.opt_shardings), batch,
                relabel(step_arr, program.abstract_step_index()))
            base = state.program
            state.params = relabel(params, base.param_shardings)
            state.opt_state = relabel(opt_state, base.opt_shardings)
            metrics["next_step"] = relabel(metrics["next_step"], base.abstract_step_index())
        else:
            state.params, state.opt_state, metrics = compiled[0](state.params, state.opt_state,
                                                                 batch, step_arr)
        if len(state.programs) > 1:
            metrics["layout"] = index  # (a host int: report.finish names the layout)
        step_arr = metrics.pop("next_step")
        profiler.after_step(done, (state.params, state.opt_state))
        # run by report.finish once this step's end is seen, before the next step takes
        # (donates) these parameters: its compile and run are in no step's time
        evaluation = evaluator.due(done)
        if pending is not None:  # read step k's metrics while step k+1 runs
            last_end = report.finish(*pending, last_end)
            watch.progress(step=pending[0] + 1)
            pending = None
            if deferred is not None:  # its host copy overlaps the step just dispatched
                save_checkpoint(run, state, deferred[0], False, copy=deferred[1])
                deferred = None
                watch.progress()
        last = done == end
        if not last:  # build the next batch while the device runs this step
            index, batch = batches.get(done, prefetch=done + 1 < end)
        stopping = stop.agree_at_end() if last else stop.should_stop(done)
        force = stopping or (last and (cfg.checkpoint.save_final or done < cfg.train.steps))
        if not (last or force or evaluation or ckpt.due(done)):
            pending = (step, metrics, evaluation)
            continue
        if copy_saves and not (last or force or evaluation):  # a periodic save: after the next
            # dispatch, from a copy the next step does not donate (unsaved if that step's
            # dispatch raises; a non-finite step under on_nonfinite=stop is never saved)
            ckpt.wait()  # the previous save's write holds its copy: one copy at a time
            deferred = (done, snapshot.copy_state(state.params, state.opt_state))
            pending = (step, metrics, evaluation)
            continue
        # the last step, an evaluation, a checkpoint or a stop: this step's metrics first (a
        # non-finite step under on_nonfinite=stop is never saved), then its state, before the
        # next dispatch takes (donates) it
        last_end = report.finish(step, metrics, evaluation, last_end)
        watch.progress(step=done)
        save_checkpoint(run, state, done, force)
        watch.progress()
        if stopping and not last:
            log(f"received {stop.requested or 'a stop signal on another process'}: finished step "
                f"{done} and saved a checkpoint; run the same command again to resume")
            break
    return collectives[0]
