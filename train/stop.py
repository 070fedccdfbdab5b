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
"""

from __future__ import annotations

import signal
import threading

from . import peers

LEAD = 2  # steps between a proposal and the step all processes stop after (see above)
_PREFIX = "basp_jax/stop"
_generation = 0  # StopRequests made by this process: keys of an earlier run() in it stay apart


class StopRequest:
    """Context manager: remembers SIGINT/SIGTERM (handlers are installed only in the main thread
    and restored on exit). Call should_stop(n) once per step, in order, after step n - 1 has
    finished on the devices; it says whether to stop after step n."""

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
                               f"this one learned of it at step {step}; train.stop's ordering "
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

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False
