"""Say that a compile has started, how long the last one of this run took, and that it goes on.

A large step compiles for minutes on a GPU host (the 9B hybrid: about 4) with nothing printed;
the run looks hung. One line before, one every EVERY_S seconds while it lasts, and the time kept
in {run.dir}/compile_time.json for the next start's first line."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Callable

RECORD = "compile_time.json"
EVERY_S = 60.0


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest:02d}s" if minutes else f"{seconds:.1f}s"


def last_seconds(record_dir: str | None) -> float | None:
    """The last compile's seconds recorded in record_dir, or None (none, or unreadable)."""
    if record_dir is None:
        return None
    try:
        with open(os.path.join(record_dir, RECORD)) as f:
            return float(json.load(f)["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextlib.contextmanager
def announced(what: str, log: Callable[[str], None], record_dir: str | None = None,
              every_s: float = EVERY_S):
    """Log that `what` compiles (with the last time's duration), then every every_s seconds that it
    still does; on success record how long it took in record_dir (None: nowhere)."""
    last = last_seconds(record_dir)
    log(f"compiling {what}" + (f" (the last compile of this run took {_duration(last)})"
                               if last is not None else "") + " ...")
    started, done = time.perf_counter(), threading.Event()

    def remind():
        while not done.wait(every_s):
            log(f"still compiling {what}: {_duration(time.perf_counter() - started)} so far")

    thread = threading.Thread(target=remind, name="compile-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=1)
    if record_dir is not None:
        with contextlib.suppress(OSError):  # a diagnostic: never stops the run
            with open(os.path.join(record_dir, RECORD), "w") as f:
                json.dump({"seconds": time.perf_counter() - started}, f)
