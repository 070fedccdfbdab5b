"""A jax.profiler trace of profile.steps steps from profile.start_step, in {run.dir}/profile.

    profiler = Profiler(cfg, run_dir, is_writer=is_writer, log=logger.message)
    profiler.before_step(step)            # step: the 1-based number of the step about to run
    profiler.after_step(step, outputs)    # waits for the step's outputs when the window ends
    profiler.close()                      # stops a trace still running (a run that ended early)

Process 0 traces its devices. The XLA ops carry the model's named scopes (attention, seq_to_heads
and heads_to_seq: the all-to-alls, attention_kernel, mlp, loss), so the trace shows where a step's
time goes. View it with `tensorboard --logdir RUN_DIR/profile` (the profile plugin:
`pip install tensorboard-plugin-profile`), or open plugins/profile/*/perfetto_trace.json.gz at
ui.perfetto.dev.
"""

from __future__ import annotations

import os
from typing import Callable

import jax

from ..config.schema import Config


class Profiler:
    def __init__(self, cfg: Config, run_dir: str, *, is_writer: bool,
                 log: Callable[[str], None] = print):
        self.first = cfg.profile.start_step
        self.last = cfg.profile.start_step + cfg.profile.steps - 1
        self.enabled = is_writer and cfg.profile.steps > 0
        self.directory = os.path.join(run_dir, "profile")
        self.log = log
        self.active = False
        self.first_traced = self.seen = 0

    def before_step(self, step: int) -> None:
        if self.enabled and not self.active and self.first <= step <= self.last:
            # the Perfetto JSON too: it opens in a browser without TensorBoard's profile plugin
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.active = True
            self.first_traced = step

    def after_step(self, step: int, outputs=None) -> None:
        self.seen = step
        if self.active and step >= self.last:
            self._stop(step, outputs)

    def _stop(self, step: int, outputs=None) -> None:
        jax.block_until_ready(outputs)  # the trace must hold the whole of the last step
        jax.profiler.stop_trace()
        self.active = False
        self.enabled = False  # one window per run
        self.log(f"profiled steps {self.first_traced}-{step} into {self.directory}")

    def close(self) -> None:
        if self.active:  # the run stopped inside the window (a signal, stop_at, an error)
            self._stop(self.seen)
