"""Metrics writers beside metrics.jsonl: TensorBoard event files in {run.dir}/tb and, when
metrics.wandb_project is set, Weights & Biases. Only process 0 writes.

    check(cfg, is_writer)                        # before compiling: the libraries import
    writers = Writers(cfg, run_dir, start_step=start, is_writer=is_writer, devices=devices)
    writers.write(record)                        # each metrics.jsonl record, after the logger
    writers.close()

A step writes every number of its metrics.jsonl record, as train/KEY (eval_KEY as eval/KEY), plus
the memory in use on this process's devices (device.memory_stats(); the CPU backend has none) and
percentiles of the last STEP_WINDOW step times. View with `tensorboard --logdir RUN_DIR/tb`.
"""

from __future__ import annotations

import collections
import glob
import numbers
import os
import secrets
import sys
import threading
import time
from typing import Any

import jax
import numpy as np

from ..config.schema import Config, ConfigError, to_dict

STEP_WINDOW = 100  # step times the percentiles cover
PERCENTILES = (50, 90, 99)
WANDB_ID_FILE = "wandb_id"  # in run.dir: a resumed run goes on logging to the same W&B run


def tag(key: str) -> str:
    """The TensorBoard / W&B name of a metrics.jsonl key."""
    return f"eval/{key[len('eval_'):]}" if key.startswith("eval_") else f"train/{key}"


def _import_tensorboardx():
    """tensorboardX, imported without torch: its writer imports torch when installed (3-4 s and
    much memory) only to accept torch tensors, and we pass floats."""
    if "torch" in sys.modules:
        import tensorboardX
        return tensorboardX
    sys.modules["torch"] = None  # `import torch` raises ImportError while this entry is None
    try:
        import tensorboardX
    finally:
        del sys.modules["torch"]
    return tensorboardX


def check(cfg: Config, is_writer: bool) -> None:
    """The writers (and the profiler) the config asks for can be made: one line each, before
    anything compiles or is written."""
    if not is_writer:
        return
    for name, wanted in (("tb", cfg.metrics.tensorboard), ("profile", cfg.profile.steps > 0)):
        path = os.path.join(os.path.abspath(cfg.run.dir), name)
        if wanted and os.path.lexists(path) and not os.path.isdir(path):
            raise ConfigError(f"{path} is not a directory (the trainer writes one there); move it "
                              "out of run.dir")
    if cfg.metrics.tensorboard:
        try:
            _import_tensorboardx()
        except ImportError as e:
            raise ConfigError(f"metrics.tensorboard=true needs tensorboardX ({e}); "
                              "pip install tensorboardX or set metrics.tensorboard=false") from None
    if cfg.metrics.wandb_project:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError(f"metrics.wandb_project={cfg.metrics.wandb_project} but wandb is not "
                              "installed; pip install wandb or set metrics.wandb_project=null"
                              ) from None


def memory_in_use(devices) -> dict[str, float]:
    """GiB in use and at peak on the busiest of these devices, where the backend reports it."""
    in_use, peak = [], []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 (a backend without the call)
            stats = None
        if stats:
            in_use.append(stats.get("bytes_in_use", 0))
            peak.append(stats.get("peak_bytes_in_use", 0))
    if not in_use:
        return {}
    return {"memory/in_use_gib": max(in_use) / 2**30, "memory/peak_gib": max(peak) / 2**30}


class TensorBoardFile:
    """tensorboardX's SummaryWriter on one event file, opened at the first write (a run that
    writes nothing leaves no file). Its events are written by a thread of its own; an OSError
    there (a full disk) is taken from that thread (threading.excepthook) and raised at the next
    write in the trainer's thread, with the file's name, as the trainer's one-line disk error;
    the queue is unbounded, so a writer thread that died never blocks the loop."""

    QUEUE = 1 << 20  # events held in memory at most (SummaryWriter's max_queue)

    def __init__(self, directory: str, start_step: int):
        _import_tensorboardx()  # (checked now, opened later)
        self.directory, self.start = directory, start_step
        # File names carry the second they were made in; the suffix (nanoseconds) keeps a file
        # made within the same second from overwriting the one before, and sorts after it, as
        # TensorBoard reads them.
        self.suffix = f".{time.time_ns()}.from-step-{start_step}"
        self.path = directory  # the event file's, once it is made (for error messages)
        self.writer = None
        self.threads: set = set()  # the writer's own threads, whose errors are ours
        self.before: set | None = None  # while the first write starts them: the threads before
        self.error: OSError | None = None

    def _open(self) -> None:
        tensorboardX = _import_tensorboardx()
        os.makedirs(self.directory, exist_ok=True)
        # purge_step: a session start at step start+1, so TensorBoard drops the events of
        # later steps that an earlier invocation wrote (a resumed run, or a fresh one in an old
        # run.dir), as metrics.jsonl drops their lines
        self.path = os.path.join(self.directory, "events.out.tfevents.*" + self.suffix)
        self.writer = tensorboardX.SummaryWriter(
            self.directory, purge_step=self.start + 1, max_queue=self.QUEUE, flush_secs=5,
            filename_suffix=self.suffix)

    def _guard(self, write) -> None:
        try:
            if self.error is not None:
                raise self.error
            write()
            if self.error is not None:
                raise self.error
        except OSError as e:  # name the file (a buffered write's error has no filename)
            self.error = self.error or e
            _reported.append(e.errno)
            raise OSError(e.errno, e.strerror, self.path) from e

    def write(self, step: int, scalars: dict[str, float]) -> None:
        first = self.writer is None
        if first:
            self.before = set(threading.enumerate())  # its threads start from here
            _watch(self)
            self._guard(self._open)

        def write():
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, global_step=step)
            self.writer.flush()  # (in this thread: a full disk raises here or in the writer's)

        try:
            self._guard(write)
        finally:
            if first:
                self.threads = set(threading.enumerate()) - self.before
                self.before = None
                found = glob.glob(glob.escape(self.directory) + self.path[len(self.directory):])
                self.path = found[0] if found else self.path  # (not made: the pattern names it)

    def close(self) -> None:
        if self.writer is not None and self.error is None:
            try:
                self.writer.close()
            except OSError:
                pass  # the error was raised at a step already, or nothing was left to write
        # (after a failed write the writer is left to its daemon threads, still watched:
        # closing its queue under them only prints their tracebacks)
        self.writer = None
        if self.error is None:
            _watched.discard(self)


_watched: set = set()  # open TensorBoardFiles whose writer threads' errors are taken
_reported: list = []  # errnos raised to the trainer already (its one-line error)


def _watch(tb: TensorBoardFile) -> None:
    """Route an OSError of tb's writer thread to tb (raised at its next write) instead of a
    traceback on stderr from a thread that then silently stops writing; and keep the writer's
    exit-time flush (an atexit callback of tensorboardX) from printing the same error again."""
    if threading.excepthook is not _excepthook:
        _excepthook.previous = threading.excepthook
        threading.excepthook = _excepthook
    if sys.unraisablehook is not _unraisablehook:
        _unraisablehook.previous = sys.unraisablehook
        sys.unraisablehook = _unraisablehook
    _watched.add(tb)


def _unraisablehook(args) -> None:
    if isinstance(args.exc_value, OSError) and args.exc_value.errno in _reported:
        return  # the trainer has reported this disk error in one line already
    _unraisablehook.previous(args)


_unraisablehook.previous = sys.unraisablehook


def _excepthook(args) -> None:
    for tb in list(_watched):
        ours = args.thread in tb.threads or (tb.before is not None and
                                             args.thread not in tb.before)
        # After a disk error the writer is abandoned to its daemon threads; whatever they raise
        # next (at exit its queue is closed under them) follows from that error, which the
        # trainer has reported in one line: no traceback (CI once printed a half one at exit).
        if ours and (isinstance(args.exc_value, OSError) or tb.error is not None):
            tb.error = tb.error or args.exc_value
            return
    _excepthook.previous(args)


_excepthook.previous = threading.excepthook


class Writers:
    """TensorBoard and W&B writers of the per-step records (no-ops on other processes)."""

    def __init__(self, cfg: Config, run_dir: str, *, start_step: int, is_writer: bool,
                 devices=()):
        self.tb = None
        self.wandb = None
        self.devices = [d for d in devices if d.process_index == jax.process_index()]
        self.step_times = collections.deque(maxlen=STEP_WINDOW)
        if not is_writer:
            return
        if cfg.metrics.tensorboard:
            self.tb = TensorBoardFile(os.path.join(run_dir, "tb"), start_step)
        if cfg.metrics.wandb_project:
            import wandb

            id_path = os.path.join(run_dir, WANDB_ID_FILE)
            if start_step and os.path.isfile(id_path):  # resumed: the same W&B run goes on
                with open(id_path) as f:
                    run_id = f.read().strip()
            else:  # a fresh run (even in an old run.dir) is a new W&B run
                run_id = secrets.token_hex(4)
                with open(id_path, "w") as f:
                    f.write(run_id + "\n")
            self.wandb = wandb.init(project=cfg.metrics.wandb_project,
                                    name=os.path.basename(run_dir), id=run_id, resume="allow",
                                    dir=run_dir, config=to_dict(cfg))

    def scalars(self, record: dict[str, Any]) -> dict[str, float]:
        """The tagged numbers of one record, with memory and step-time percentiles."""
        out = {}
        for key, value in record.items():
            if key != "step" and isinstance(value, numbers.Real):  # (None: e.g. mfu on CPU)
                out[tag(key)] = float(value)
        if isinstance(record.get("step_time_s"), numbers.Real):
            self.step_times.append(record["step_time_s"])
            for q, v in zip(PERCENTILES, np.percentile(self.step_times, PERCENTILES)):
                out[f"perf/step_time_p{q}_s"] = float(v)
        out.update(memory_in_use(self.devices))
        return out

    def write(self, record: dict[str, Any]) -> None:
        if self.tb is None and self.wandb is None:
            return
        step = int(record["step"])
        scalars = self.scalars(record)
        if self.tb is not None:
            self.tb.write(step, scalars)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
