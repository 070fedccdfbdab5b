"""SIGINT/SIGTERM while training: finish the step, checkpoint, leave; all processes after one step.

A scheduler's signals reach the processes of a multi-process run at different moments (or reach one
of them only), yet all must stop after the same step: the checkpoint save is collective, and a
process that left early would strand the others in the next step's collectives. Exchanging flags
every step (process_allgather) is a host collective that idles the devices, so instead:

- a signalled process proposes, in the jax.distributed key-value store, to stop after step k + LEAD,
  where k is the step it is deciding about (the first proposal stored wins; later ones adopt it);
- every process reads the store (one small request to the coordinator, no waiting on the peers)
  when it decides about each step.

Why LEAD = 2 is safe: the trainer decides about step n only after step n - 1 has finished on its
devices (it has read that step's metrics), and step n - 1's collectives finish only after every
process has dispatched it. A proposer deciding about step k writes before dispatching step k + 1,
so any process deciding about step k + 2 has waited for that dispatch, and reads the proposal.

Why not JAX's own agreement (multihost_utils.reached_preemption_sync_point, which orbax's
CheckpointManager.reached_preemption calls): its notifier is a C-level SIGTERM handler that
jax.distributed.initialize installs over Python's (so no Python handler, and no exit during a
compile), it knows no SIGINT, and it needs jax.distributed, i.e. not in one process. It does agree
on a step on CPU as on GPU (measured, 2 processes, jax 0.10.2), so once JAX lets a Python handler
raise the notice, `should_stop` can ask it instead of the store. Until then train.process.runtime turns
its service off (jax_enable_preemption_service), which would otherwise swallow SIGTERM from
start-up until the step compiled (tests/e2e/test_multiprocess.py).

Outside the step loop (start-up, restoring, compiling the step) there is nothing to finish: with
`exit_at_once_outside_the_loop()` (python train.py) a signal ends the process at once, with one
line and status 128 + the signal. A StopRequest takes the signals over only once the step has
compiled (`take_over`), until it exits. A second signal while it holds them leaves at once
(status 128 + the signal, one line): a step that hangs would never finish, and the wakeup fd's
thread sees the signal even while the main thread is blocked inside XLA.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from . import peers

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_graceful = False  # a StopRequest has taken the signals over: finish the step, then stop
_graceful_signals = 0  # signals received since then: a second one leaves at once
_watching = False  # a thread reads the wakeup fd (python train.py): it counts the signals
_exiting = threading.Lock()  # held by the thread that writes the line and exits

LEAD = 2  # steps between a proposal and the step all processes stop after (see above)
_PREFIX = "basp_jax/stop"
_generation = 0  # StopRequests made by this process: keys of an earlier run() in it stay apart


class StopRequest:
    """Context manager: once `take_over()` is called, remembers SIGINT/SIGTERM (handlers are
    installed only in the main thread and restored on exit). Call should_stop(n) once per step,
    in order, after step n - 1 has finished on the devices; it says whether to stop after step
    n."""

    def __init__(self, client=None):
        """client: the key-value store (default: jax.distributed's in a multi-process run)."""
        import jax

        global _generation
        _generation += 1  # every process makes its StopRequests in the same order
        self.dir = f"{_PREFIX}/{_generation}/"
        self.key = self.dir + "after"  # the agreed step, once a process proposed one
        self.requested: str | None = None  # the signal this process received
        self.stopped = False  # all processes agreed to stop
        if client is None and jax.process_count() > 1:
            client = peers.distributed_client()
        self.client = client
        self.agreed_step: int | None = None  # the step all processes stop after, once known
        self._proposed = False
        self._previous = {}

    def should_stop(self, step: int) -> bool:
        """Whether to stop after `step` (the count of completed steps)."""
        if self.client is None:  # one process: stop after the step the signal arrived in
            self.stopped = self.requested is not None
            return self.stopped
        if self.agreed_step is None:
            if self.requested is not None and not self._proposed:
                self._proposed = True
                try:  # the first proposal stored wins: a second one fails and reads it below
                    self.client.key_value_set(self.key, str(step + LEAD))
                except Exception:  # noqa: BLE001 (ALREADY_EXISTS)
                    pass
            found = dict(self.client.key_value_dir_get(self.dir))  # no exception when absent
            if self.key in found:
                self.agreed_step = int(found[self.key])
        if self.agreed_step is not None and self.agreed_step < step:
            raise RuntimeError(f"processes were asked to stop after step {self.agreed_step} but "
                               f"this one learned of it at step {step}; train.process.stop's ordering "
                               "assumption failed")
        self.stopped = self.agreed_step == step
        return self.stopped

    def agree_at_end(self) -> bool:
        """After the last step: whether any process was signalled (one exchange for the run, so
        all processes decide alike about what follows, e.g. the export)."""
        if not self.stopped:
            flag = self.requested is not None
            if self.client is not None:
                import numpy as np
                from jax.experimental import multihost_utils

                flag = bool(np.any(multihost_utils.process_allgather(np.array(flag))))
            self.stopped = flag
        return self.stopped

    def _handle(self, signum, frame):
        self.requested = signal.Signals(signum).name
        if not _watching:  # else the watcher thread has counted this signal already
            _count_graceful(signum)

    def __enter__(self):
        return self

    def take_over(self) -> None:
        """From now until exit, SIGINT/SIGTERM are remembered (the step finishes, a checkpoint is
        written): call it once the step has compiled. Handlers can be set in the main thread only;
        a second call changes nothing."""
        global _graceful, _graceful_signals
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        _graceful_signals = 0
        _graceful = True

    def __exit__(self, *exc):
        global _graceful
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        _graceful = False
        return False


# ---- outside the step loop: a signal ends the process at once -------------------------------------

def exit_now(signum: int) -> None:
    """One line and os._exit(128 + signum), once, whichever thread (the watcher or the main
    thread's handler) gets here first. Raising KeyboardInterrupt in the middle of JAX's start-up
    gives a traceback and then a crash in the interpreter's shutdown."""
    if not _exiting.acquire(blocking=False):
        while True:  # the other thread is writing the line and ending the process
            time.sleep(1)
    name = signal.Signals(signum).name
    os.write(2, f"error: interrupted: {name} outside the training loop (nothing half-written); run "
                f"the same command again to start or resume\n".encode())
    os._exit(128 + signum)


def _count_graceful(signum: int) -> None:
    """A signal while a StopRequest holds the signals: the first asks the step to finish; a second
    one leaves at once (a step that hangs would never finish), without writing anything."""
    global _graceful_signals
    _graceful_signals += 1
    if _graceful_signals < 2:
        return
    if not _exiting.acquire(blocking=False):
        while True:  # the other thread is writing the line and ending the process
            time.sleep(1)
    name = signal.Signals(signum).name
    os.write(2, f"error: interrupted: a second {name} while a step ran: left at once without "
                f"finishing it (the newest complete checkpoint is kept); run the same command "
                f"again to resume\n".encode())
    os._exit(128 + signum)


def _handler(signum, frame) -> None:
    if not _graceful:
        exit_now(signum)


def exit_at_once_outside_the_loop() -> None:
    """From now on SIGINT/SIGTERM end the process at once (exit_now) unless a StopRequest has
    taken them over. Python runs a signal's handler only between bytecodes of the main thread, so
    during one long call into XLA (a compile takes minutes on a GPU, longer than a scheduler's
    grace period) the handler alone would wait for it to return. The interpreter's C-level handler
    writes the signal's number to the wakeup fd at once, though, and a thread reading it exits
    (XLA's compile releases the GIL)."""
    global _watching
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for sig in SIGNALS:
        signal.signal(sig, _handler)  # the wakeup fd is written for signals with a Python handler
    threading.Thread(target=_watch, args=(read_fd,), name="signal-watch", daemon=True).start()
    _watching = True


def _watch(read_fd: int) -> None:
    while True:
        for signum in os.read(read_fd, 64):
            if signum in SIGNALS:
                _count_graceful(signum) if _graceful else exit_now(signum)
