"""Notice a step that never ends: one line and exit status 4, the checkpoints kept.

A step that hangs (a collective whose peer froze without dying, a kernel that never returns, a
driver fault) blocks the main thread inside XLA, where no Python code runs: without a watchdog
the run sits at 0% forever. A daemon thread compares the time since the training loop last made
progress (`progress()`: a step's metrics read, a checkpoint saved, an evaluation read) with a
limit:

    runtime.step_timeout_s > 0     that many seconds
    runtime.step_timeout_s null    max(AUTO_FACTOR x the median step so far, AUTO_FLOOR_S), from
                                   the AUTO_AFTER_STEPS-th measured step on (the first steps
                                   include autotuning and warm-up)
    runtime.step_timeout_s 0       off

Past it the thread writes one line and leaves through os._exit (the main thread cannot be
unblocked). Checkpoint saves are atomic (orbax writes a temporary folder and renames it), so the
newest complete checkpoint is intact and the same command resumes from it.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Callable

STEP_TIMEOUT_STATUS = 4
AUTO_FACTOR = 20.0  # an evaluation, a checkpoint's synchronous copy or a compile stay below it
AUTO_FLOOR_S = 300.0  # never less: a first evaluation compiles, a save may wait on a slow disk
AUTO_AFTER_STEPS = 3


def step_limit_s(configured: float | None, step_times: list[float]) -> float | None:
    """The limit in seconds, or None while there is none (off, or too few steps measured)."""
    if configured is not None:
        return configured if configured > 0 else None
    if len(step_times) < AUTO_AFTER_STEPS:
        return None
    return max(AUTO_FACTOR * statistics.median(step_times), AUTO_FLOOR_S)


def _exit(line: str) -> None:
    os.write(2, (line + "\n").encode())
    os._exit(STEP_TIMEOUT_STATUS)


class StepWatchdog:
    """Context manager around the step loop: call `progress()` after each piece of progress, with
    `step` when a training step was seen to end (the time between two of those is a step's time).
    `describe_resume()` gives the advice printed with the error (the newest checkpoint)."""

    def __init__(self, configured_s: float | None, describe_resume: Callable[[], str], *,
                 interval_s: float = 1.0, on_timeout: Callable[[str], None] = _exit):
        self.configured_s = configured_s
        self.describe_resume = describe_resume
        self.interval_s = interval_s
        self.on_timeout = on_timeout
        self.step_times: list[float] = []
        self.steps_done: int | None = None
        self._last: float | None = None  # armed by the first progress() (the step has compiled)
        self._last_step = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def progress(self, step: int | None = None) -> None:
        now = time.monotonic()
        if step is not None:
            if self.steps_done is not None and self._last_step:
                self.step_times.append((now - self._last_step) / max(step - self.steps_done, 1))
            self.steps_done, self._last_step = step, now
        self._last = now

    def __enter__(self):
        if self.configured_s is None or self.configured_s > 0:
            self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return False

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            limit = step_limit_s(self.configured_s, self.step_times)
            if self._last is None or limit is None:
                continue
            waited = time.monotonic() - self._last
            if waited > limit:
                how = "runtime.step_timeout_s" if self.configured_s is not None else \
                    f"{AUTO_FACTOR:g}x the median step, at least {AUTO_FLOOR_S:g} s"
                self.on_timeout(
                    f"error: step: step {(self.steps_done or 0) + 1} has not finished after "
                    f"{waited:.0f} s (limit {limit:.0f} s: {how}); a device or a peer is stuck. "
                    f"{self.describe_resume()} Set runtime.step_timeout_s to change the limit "
                    f"(0: off).")
                return
