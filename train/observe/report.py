"""What a run tells its user (train.loop): what it starts with, each finished step (metrics,
evaluation, the non-finite policy) and how it ended. `run` is the checked run
(train.prepare.Run), `state` what the loop advances (train.program.state.TrainState).

    log_start(run, state, logger)
    report = StepReport(run, state, logger, writer, evaluator)
    last_end = report.finish(step, metrics, False, last_end)   # step k, after k+1 dispatched
    last_end = report.finish(step, metrics, True, last_end)    # and evaluate, before k+1
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import jax

from basp_jax.compiled import comm

from ..program import planning
from ..config import resume
from ..checkpoint.store import complete_steps
from .metrics import MetricsLogger
from ..program.model_setup import fp8_enabled
from ..program.state import TrainState


class NonFiniteError(RuntimeError):
    """The loss or gradients became NaN/Inf and the config says to stop."""


def log_start(run, state: TrainState, logger: MetricsLogger) -> None:
    """The layout, the model, where the run resumes and what mfu is measured against."""
    cfg = run.cfg
    logger.message(f"layout: {run.layout.describe()}")
    note = planning.layout_note(cfg, run.layout)
    if note:
        logger.message(note)
    if run.plan.adaptive:
        logger.message("adaptive layouts (groups x sp): " + ", ".join(
            p.layout.short_name for p in run.plan.adaptive) + "; each step runs the one with "
            "the most groups whose rows hold its documents")
    logger.message(
        f"model: {run.mcfg.model_type} {run.mcfg.num_params() / 1e6:.2f}M params, "
        f"{run.plan.strategy} parameters"
        + (" and optimizer state in host memory (optimizer.offload)" if run.plan.offload_state
           else "")
        + ("; FP8 projections (model.fp8)" if fp8_enabled(cfg, run.devices[0]) else "")
        + ("; q, k, v exchanged in FP8 (model.fp8_exchange)" if cfg.model.fp8_exchange else "")
        + f"; data: {run.data.name}"
    )
    if run.latest is not None:
        logger.message(f"resumed from {state.ckpt.directory} at step {state.start}")
    if run.changes:
        logger.message(f"resumed with changes ({resume.ALLOW_KEY}): "
                       f"{resume.describe(run.changes)}")
    if cfg.optimizer.warmup_steps > cfg.train.steps:
        logger.message(f"note: optimizer.warmup_steps={cfg.optimizer.warmup_steps} is longer than "
                       f"the run; warming up over train.steps={cfg.train.steps} instead")
    logger.message(f"mfu: {run.flops_per_token / 1e9:.4g} GFLOP per token (6N + causal attention) "
                   f"against {run.peak_source}" if run.peak else f"mfu: {run.peak_source}")


def run_layout(run) -> str:
    """The layout an invocation runs, as its first metrics.jsonl line records it: "basp 2x4",
    "ulysses 1x8/ring2", "adaptive 2x4/4x2" (the static layout first)."""
    if run.plan.adaptive:
        return "adaptive " + "/".join(p.layout.short_name for p in run.plan.adaptive)
    return f"{run.layout.mode} {run.layout.short_name}"


class StepReport:
    """Reads a finished step's metrics, logs them (metrics.jsonl, the progress bar, the writers)
    and applies train.on_nonfinite; keeps the losses and step times for the summary."""

    def __init__(self, run, state: TrainState, logger: MetricsLogger, writer, evaluator):
        self.run, self.state, self.logger = run, state, logger
        self.writer, self.evaluator = writer, evaluator
        self.losses: list[float] = []
        self.step_times: list[float] = []
        self.layouts: list[dict] = []  # adaptive: what metrics.jsonl records of each layout
        self.layout_steps: dict[str, int] = {}  # adaptive: steps run on each layout (by name)

    def describe_layouts(self, programs, collectives) -> None:
        """Adaptive runs: each layout's name and its step's all-to-all bytes per device (total and
        between hosts, from its compiled program), recorded with every step run on it."""
        if len(programs) == 1:
            return
        per_host = self.run.layout.devices_per_host
        for program, found in zip(programs, collectives):
            a2a = comm.summarize(found, per_host).get("all-to-all", {})
            self.layouts.append({"layout": program.plan.layout.short_name,
                                 "a2a_bytes": int(a2a.get("bytes", 0)),
                                 "a2a_inter_host_bytes": int(a2a.get("inter_host_wire_bytes", 0))})

    def mfu(self, tokens_per_s: float) -> float | None:
        run = self.run
        if not run.peak:
            return None
        return run.flops_per_token * tokens_per_s / (run.peak * len(run.devices))

    def finish(self, step: int, metrics, evaluate: bool, last_end: float) -> float:
        """Read step `step`'s metrics (waiting for it to end), evaluate the parameters after it
        when `evaluate` (state.params: call it before the next step is dispatched), log them,
        apply the non-finite policy; returns when the step, or its evaluation, was seen to end.
        step_time_s runs from the previous step's end, so it includes any time the host kept the
        devices waiting; an evaluation's compile and run are its own eval_compile_s and
        eval_time_s, in no step's time."""
        metrics = jax.device_get(metrics)
        ended = time.perf_counter()
        dt = ended - last_end
        self.step_times.append(dt)
        loss = float(metrics["loss"])
        self.losses.append(loss)
        tps = self.run.tokens_per_step / dt
        record = {
            "step": step + 1,
            "loss": loss,
            "grad_norm": float(metrics["grad_norm"]),
            "lr": float(metrics["lr"]),
            "tokens_per_s": tps,
            "step_time_s": dt,
            "loss_tokens": int(metrics["tokens"]),  # targets that count (not masked)
            "mfu": self.mfu(tps),
        }
        if "layout" in metrics:  # adaptive: the layout this step ran and its all-to-all bytes
            record.update(self.layouts[int(metrics["layout"])])
            name = record["layout"]
            self.layout_steps[name] = self.layout_steps.get(name, 0) + 1
        if "aux_loss" in metrics:  # sparse layers: the routers' load-balancing loss (unscaled)
            record["aux_loss"] = float(metrics["aux_loss"])
        if "loss_scale" in metrics:  # float16: the scale this step's loss was multiplied by
            record["loss_scale"] = float(metrics["loss_scale"])
        finite = bool(metrics["finite"])
        record["skipped"] = not finite
        if evaluate:  # the next step's time starts after it (the return value)
            record.update(self.evaluator.run(self.state.params, log=self.logger.message,
                                             step=step + 1))
            ended = time.perf_counter()
        if len(self.losses) == 1:  # this invocation's first line: a resume may change them
            record["run_layout"] = run_layout(self.run)
            if self.run.changes:
                record["changed"] = resume.for_metrics(self.run.changes)
        self.logger.log(record)
        self.writer.write(record)
        if not finite:
            self.non_finite(step + 1, loss, record["grad_norm"], record.get("loss_scale"))
        return ended

    def non_finite(self, step: int, loss: float, grad_norm: float,
                   loss_scale: float | None = None) -> None:
        """train.on_nonfinite: the step left the parameters unchanged; go on, or stop the run.
        Under float16 an overflow also halves the loss scale (train.program.step.LossScale)."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            what = (f"the update (loss {loss}, grad norm {grad_norm}) "
                    "made the parameters or optimizer state non-finite")
        else:
            what = f"loss {loss} / grad norm {grad_norm} is not finite"
        message = f"step {step}: {what}; the parameters were left unchanged"
        if loss_scale is not None:
            message += f" and the float16 loss scale {loss_scale:g} is halved"
        if self.run.cfg.train.on_nonfinite == "stop":
            ckpt = self.state.ckpt
            ckpt.wait()  # an async save of an earlier step completes first
            saved = complete_steps(ckpt.directory)
            where = (f"the last checkpoint (step {saved[-1]}) holds finite state"
                     if saved else "no checkpoint was written")
            raise NonFiniteError(
                f"{message}; stopping (train.on_nonfinite=stop); {where}; lower "
                "optimizer.lr or set optimizer.clip_norm")
        self.logger.message(f"{message}; skipped (train.on_nonfinite=skip)")

    def summary(self, wall: float, collectives) -> dict[str, Any]:
        """run()'s result; process 0 prints the closing line."""
        run, losses = self.run, self.losses
        if run.is_writer:
            print(self.done_line(wall), flush=True)
        start = self.state.start
        return {"steps": start + len(losses), "start_step": start, "losses": losses,
                "wall_s": wall, "params": self.state.params, "layout": run.layout,
                "collectives": collectives}

    def done_line(self, wall: float) -> str:
        run, losses, steps = self.run, self.losses, self.run.cfg.train.steps
        start = self.state.start
        if not losses:
            return f"done: {run.run_dir} already holds step {start} of {steps}"
        # the typical step (median) and, where stalls (checkpoint saves, a slow batch) slow the
        # run by more than 5%, the rate over all steps after the first; evaluations apart
        steady = self.step_times[1:] or self.step_times
        median_tps = run.tokens_per_step / statistics.median(steady)
        mean_tps = run.tokens_per_step / (sum(steady) / len(steady))
        rate = f"{median_tps:,.0f} tokens/s"
        if run.peak:
            rate += f", mfu {self.mfu(median_tps):.1%}"
        if mean_tps < 0.95 * median_tps:
            rate += f" at the median step ({mean_tps:,.0f} tokens/s counting stalls)"
        shares = ""
        if self.layout_steps:
            shares = "; layouts " + ", ".join(f"{name} {n / len(losses):.0%}"
                                              for name, n in self.layout_steps.items())
        evaluator = self.evaluator
        if evaluator is not None and evaluator.count:
            shares += f"; {evaluator.count} evaluations in {evaluator.total_s:.1f}s"
        return (f"done: steps {start + 1}-{start + len(losses)} of {steps} in "
                f"{wall:.1f}s, loss {losses[0]:.4f} -> {losses[-1]:.4f}, {rate}{shares}; "
                f"outputs in {run.run_dir}")
