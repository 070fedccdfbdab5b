"""Notice a dead peer in a multi-process run instead of hanging in a collective.

When one process of a multi-process run dies, the others block in their next collective and wait
forever (gloo on CPU, and NCCL on GPU without a timeout); JAX's own heartbeat kills them only after
minutes, with a C++ stack trace. Here every process bumps its own counter in the JAX distributed
key-value store from a daemon thread and watches the others' counters. A peer whose counter has not
moved for `timeout_s`, or a coordinator (process 0, which hosts the store) that stops answering
for that long, ends this process with one line on stderr and exit status 3. It leaves through
os._exit because the main thread may be stuck in a collective that can never complete; checkpoint
saves are atomic, so the newest complete checkpoint is intact and a rerun resumes from it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

PEER_FAILURE_STATUS = 3
_PREFIX = "basp_jax/peers"


def _client():
    from jax._src import distributed  # the client of jax.distributed.initialize

    return distributed.global_state.client


class PeerWatchdog:
    """Context manager: watches the peers while the block runs (no-op in a single process).

    describe_resume() returns the advice printed with the error (e.g. the newest checkpoint).
    """

    def __init__(self, timeout_s: float, describe_resume: Callable[[], str], interval_s: float = 1.0):
        import jax

        self.timeout_s = timeout_s
        self.interval_s = min(interval_s, timeout_s / 4)
        self.describe_resume = describe_resume
        self.process = jax.process_index()
        self.count = jax.process_count()
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        if self.count > 1 and self.timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="peer-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            try:  # tell the others this process ended on purpose (it stops beating now)
                _client().key_value_set(f"{_PREFIX}/done/{self.process}", "1", allow_overwrite=True)
            except Exception:  # noqa: BLE001 (the run is over either way)
                pass
        return False

    def _fail(self, what: str) -> None:
        print(f"error: peer: {what}; this process stops too (exit status {PEER_FAILURE_STATUS}). "
              f"{self.describe_resume()}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(PEER_FAILURE_STATUS)

    def _watch(self) -> None:
        client = _client()
        beat = 0
        now = time.monotonic()
        last_value = {p: None for p in range(self.count) if p != self.process}
        last_change = {p: now for p in last_value}
        store_ok = now
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                beat += 1
                client.key_value_set(f"{_PREFIX}/beat/{self.process}", str(beat), allow_overwrite=True)
                for peer in last_value:
                    try:
                        if client.key_value_try_get(f"{_PREFIX}/done/{peer}"):
                            last_change[peer] = now  # it finished normally
                            continue
                    except Exception:  # noqa: BLE001 (not done: the key does not exist)
                        pass
                    try:
                        value = client.key_value_try_get(f"{_PREFIX}/beat/{peer}")
                    except Exception:  # noqa: BLE001 (no beat yet)
                        value = None
                    if value != last_value[peer]:
                        last_value[peer], last_change[peer] = value, now
                store_ok = now
            except Exception as e:  # noqa: BLE001 (the store itself is unreachable)
                if now - store_ok > self.timeout_s:
                    self._fail(f"the coordinator (process 0 of {self.count}) has not answered for "
                               f"{self.timeout_s:.0f} s ({type(e).__name__}); it has probably "
                               "crashed or was killed")
                continue
            dead = [p for p in last_value if now - last_change[p] > self.timeout_s]
            if dead:
                names = ", ".join(str(p) for p in dead)
                self._fail(f"process {names} of {self.count} has sent no heartbeat for "
                           f"{self.timeout_s:.0f} s; it has probably crashed or was killed")
