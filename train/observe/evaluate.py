"""Held-out evaluation: loss and perplexity of the current parameters on the same batches each time.

    source = held_out_data(cfg)                               # None when eval.every == 0
    data = Pipeline(source, ..., held_out=True)               # train.prepare.check builds it
    evaluator = Evaluator(cfg, program, parts, data)          # program: train.program.state.TrainProgram
    if evaluator.due(step):
        record.update(evaluator.run(params))                  # eval_loss, eval_perplexity, ...
    # the trainer (train.observe.report) runs it after step k's end is seen and before step k+1
    # is dispatched (which donates params), so its compile and run are no train step's time

The eval step is built like the train step, from the same micro-loss (train.program.step.make_micro_loss:
layout, shardings, token order, chunked loss; under optimizer.offload train.program.streamed's, which
streams the layers from host memory), without gradients: jit(eval_step)(params, batch)
sums the loss and the token count over eval.batches microbatches under lax.scan. It is compiled
once, at the first evaluation, and its batch is built once and kept on the devices.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import models

from ..program import streamed
from ..config.schema import Config, DataConfig
from ..data import Pipeline
from ..program.step import make_micro_loss


def held_out_data(cfg: Config) -> DataConfig | None:
    """What the held-out rows are read from: eval.path as data.source says, else held-out
    synthetic rows (data itself); None when evaluation is off. The caller builds the Pipeline
    (held_out=True) once the layout's pad rows and token order are known."""
    if cfg.eval.every == 0:
        return None
    return cfg.data if cfg.eval.path is None else dataclasses.replace(cfg.data, path=cfg.eval.path)


def make_eval_step(parts, program, *, loss_fn=models.causal_lm_loss):
    """jit(eval_step)(params, batch) -> {"loss_sum", "tokens"} (replicated float32 scalars), with
    the train step's parameter and batch shardings."""
    mesh = program.plan.mesh
    # optimizer.offload: the parameters are in host memory, the layers are streamed through
    make = streamed.make_streamed_micro_loss if program.plan.offload_state else make_micro_loss
    micro_loss = make(parts, loss_fn)
    packed = program.packed

    def eval_step(params, batch):
        def body(carry, micro):
            loss, n = micro_loss(params, micro["tokens"], micro["targets"],
                                 micro["segment_ids"] if packed else None)
            return (carry[0] + loss, carry[1] + n), None

        zero = jnp.zeros((), jnp.float32)
        (total, count), _ = jax.lax.scan(body, (zero, zero), batch)
        return {"loss_sum": total, "tokens": count}

    names = ("tokens", "targets") + (("segment_ids",) if packed else ())
    return jax.jit(eval_step,
                   in_shardings=(program.param_shardings,
                                 {n: program.batch_sharding for n in names}),
                   out_shardings=NamedSharding(mesh, P()))


def perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


class Evaluator:
    """Runs the eval step when eval.every says; compiles it once."""

    def __init__(self, cfg: Config, program, parts, data: Pipeline | None):
        self.every = cfg.eval.every
        self.last = cfg.train.steps
        self.data = data
        self.program = program
        self.step_fn = make_eval_step(parts, program) if data is not None else None
        self.compiled = None
        self.batch = None
        self.compile_s = None  # the first evaluation's compile time, reported once
        self.total_s = 0.0  # every evaluation's compile and run, for the run's summary
        self.count = 0

    def due(self, step: int) -> bool:
        """Whether to evaluate after `step` (1-based): every eval.every steps and after the last."""
        return self.data is not None and (step % self.every == 0 or step == self.last)

    def start(self, params):
        """Dispatch an evaluation of `params` (asynchronous; the first one compiles the eval step
        first). Call it before the next train step, which donates them."""
        mesh = self.program.plan.mesh
        if self.batch is None:
            self.batch = self.data.global_batch(0, self.program.batch_sharding)
        if self.compiled is None:
            t = time.perf_counter()
            with jax.set_mesh(mesh):
                self.compiled = self.step_fn.lower(params, self.batch).compile()
            self.compile_s = time.perf_counter() - t
        return time.perf_counter(), self.compiled(params, self.batch)

    def finish(self, pending, *, log=None, step: int | None = None) -> dict:
        """The metrics of a started evaluation (waits for it); `log` gets one console line.
        eval_time_s runs from its dispatch to here (the devices' work that was queued before it
        included); the evaluation that compiled the eval step adds eval_compile_s."""
        t0, out = pending
        out = jax.device_get(out)
        count = float(out["tokens"])
        loss = float(out["loss_sum"]) / max(count, 1.0)
        result = {"eval_loss": loss, "eval_perplexity": perplexity(loss),
                  "eval_tokens": int(count), "eval_time_s": time.perf_counter() - t0}
        compiled = ""
        if self.compile_s is not None:
            result["eval_compile_s"] = self.compile_s
            compiled = f"; compiled in {self.compile_s:.1f}s"
            self.compile_s = None
        self.total_s += result["eval_time_s"] + result.get("eval_compile_s", 0.0)
        self.count += 1
        if log is not None:
            log(f"step {step}: eval loss {result['eval_loss']:.4f}, perplexity "
                f"{result['eval_perplexity']:.2f} ({result['eval_tokens']:,} tokens, "
                f"{result['eval_time_s']:.2f}s{compiled})")
        return result

    def run(self, params, *, log=None, step: int | None = None) -> dict:
        """Evaluate `params` now; `log` gets one line for the console."""
        return self.finish(self.start(params), log=log, step=step)
