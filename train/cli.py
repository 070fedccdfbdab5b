"""Command line: python train.py --config configs/NAME.yaml [key.sub=value ...]

Exit status 0 on success (also after SIGINT/SIGTERM while training: the current step finishes and
is checkpointed); 2 with one line on stderr for a config, layout, model, data, checkpoint or
resource error, or a run.dir another run owns (no traceback), detected before anything compiles or
is written to run.dir; 1 when training stops on a non-finite loss (train.on_nonfinite=stop), a
full disk, a checkpoint save that failed or an export that could not be written (the
checkpoints are kept); 3 when a peer process of a multi-process run fails
(train.process.peers; when the coordinator process dies, JAX aborts the others itself: SIGABRT); 4
when a step runs past runtime.step_timeout_s (train.process.step_watch; the checkpoints are kept);
128 + the signal (130 for SIGINT) with one line when SIGINT/SIGTERM arrives outside the training
loop (start-up, compilation: at once, also in the middle of XLA's compile; train.process.stop), or
a second time while a step runs (at once, the step unfinished).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

from .config.schema import ConfigError, load_config

USAGE = "python train.py --config configs/NAME.yaml [key.sub=value ...]"
NO_CONFIG = "no config given: pass --config FILE (e.g. --config configs/demo_cpu.yaml)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train.py", usage=USAGE,
        description="Train a Llama/Qwen model with BASP or Ulysses sequence parallelism.",
    )
    p.add_argument("--config", help="YAML config file (see configs/)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. train.steps=100")
    return p


def _fail(kind: str, err: Exception) -> int:
    """Print the one line for `err`; returns 2, the status of bad input."""
    msg = " ".join(str(err).split()) or type(err).__name__
    print(f"error: {kind}: {msg}", file=sys.stderr)
    return 2


def install_signal_handlers() -> None:
    """From the first instruction of `python train.py`: SIGINT/SIGTERM end the process at once
    with one line, also in the middle of a compile, until the training loop takes them over
    (train.process.stop)."""
    from .process.stop import exit_at_once_outside_the_loop

    exit_at_once_outside_the_loop()


class _HeldUnraisable:
    """Holds 'Exception ignored in ...' reports while training. After a failed checkpoint read,
    orbax's asyncio callbacks report 'Event loop is closed' from background threads; on an error
    with a one-line message those would bury it, so they are dropped then, and replayed after
    success or an unexpected exception. With `exiting` (python train.py, which ends right after)
    reports stay silenced after a one-line error until the process is gone."""

    def __init__(self, expected: tuple[type, ...], exiting: bool):
        self.expected = expected
        self.exiting = exiting
        self.reports: list[str] = []

    def _hold(self, report) -> None:
        # kept as text: the report's traceback would keep its frames (and their arrays) alive
        text = "".join(traceback.format_exception(report.exc_type, report.exc_value,
                                                  report.exc_traceback))
        self.reports.append(f"Exception ignored in: {report.object!r}\n{text}")

    # absl (orbax) and asyncio errors are held too: a failed save logs its traceback from each
    # thread, and orbax's background writes as 'Task exception was never retrieved'.
    LOGGERS = ("absl", "asyncio")

    def filter(self, record: logging.LogRecord) -> bool:
        """Holds ERROR records of LOGGERS (see above)."""
        if record.levelno >= logging.ERROR:
            self.records.append(record)
            return False
        return True

    def __enter__(self):
        self._previous = sys.unraisablehook
        sys.unraisablehook = self._hold
        self.records: list[logging.LogRecord] = []
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)
        return self

    def __exit__(self, exc_type, exc, tb):
        one_line_error = exc_type is not None and issubclass(exc_type, self.expected)
        sys.unraisablehook = (lambda report: None) if one_line_error and self.exiting \
            else self._previous
        if not (one_line_error and self.exiting):
            for name in self.LOGGERS:
                logging.getLogger(name).removeFilter(self)
        if not one_line_error:
            for text in self.reports:
                sys.stderr.write(text)
            for record in self.records:
                logging.getLogger(record.name).handle(record)
        return False


def main(argv: list[str] | None = None, *, exiting: bool = False) -> int:
    """Run the command line; returns the exit status. exiting: the process ends right after (the
    script entry), so library threads are kept quiet after an error line."""
    if exiting:
        install_signal_handlers()  # train.py installs them before its first import as well
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.config is None and not args.overrides:  # a bare `python train.py`: ask for a file,
        return _fail("config", ConfigError(NO_CONFIG))  # not for the first key it lacks
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        return _fail("config", e)

    # CPU device count and distributed init must precede every JAX backend use.
    from .process import runtime

    try:
        runtime.configure(cfg)
    except ConfigError as e:
        return _fail("config", e)

    from basp_jax import LayoutError
    from models import ModelError

    from .checkpoint.store import CheckpointError, SaveFailed, StorageError
    from .data import DataError
    from .process.lock import RunDirInUse
    from .process.outputs import ExportError
    from .loop import NonFiniteError, PeerFailure, run
    from .process.peers import PEER_FAILURE_STATUS
    from .program.planning import ResourceError

    # each error that ends the run with one line: its label and the exit status
    one_line = ((ConfigError, "config", 2), (LayoutError, "layout", 2), (ModelError, "model", 2),
                (DataError, "data", 2), (CheckpointError, "checkpoint", 2),
                (ResourceError, "resources", 2), (RunDirInUse, "run.dir", 2),
                (PeerFailure, "peer", PEER_FAILURE_STATUS), (NonFiniteError, "training", 1),
                (StorageError, "disk", 1), (SaveFailed, "checkpoint", 1),
                (ExportError, "export", 1))
    kinds = tuple(cls for cls, _, _ in one_line)
    try:
        with _HeldUnraisable(kinds, exiting):
            run(cfg)
    except kinds as e:
        kind, status = next((k, st) for cls, k, st in one_line if isinstance(e, cls))
        _fail(kind, e)
        return status  # with status >= 2, exit_with leaves through os._exit (no shutdown waits)
    return 0


def exit_with(status: int) -> None:
    """Leave the process with `status`. After an error (status 2 or more) nothing remains to be
    saved, so skip the interpreter's shutdown: library threads (orbax's asyncio loop after a failed
    read, a distributed client whose peer died) can print tracebacks or hang there, which would
    break the one-line promise or the exit itself."""
    if status >= 2:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


def script() -> None:
    """The `basp-train` console script: the same as `python train.py`."""
    exit_with(main(exiting=True))


if __name__ == "__main__":
    script()
