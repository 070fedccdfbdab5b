"""`python train.py ARGS`, except that the process SIGKILLs itself right after the asynchronous
save of step $CRASH_AT_SAVE_STEP has started: orbax is writing that checkpoint into its temporary
directory when the process dies. Used by test_train_crash.py (the timing of an external kill
could not hit that window reliably)."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.checkpoint import store as checkpoint  # noqa: E402
from train.cli import main  # noqa: E402

CRASH_STEP = int(os.environ["CRASH_AT_SAVE_STEP"])
_save = checkpoint.Checkpointer.save


def save_then_die(self, step, *args, **kwargs):
    started = _save(self, step, *args, **kwargs)
    if started and step == CRASH_STEP:
        self.wait_for_handover()  # a save of a state copy, handed to a thread: orbax writes now
        os.kill(os.getpid(), signal.SIGKILL)
    return started


checkpoint.Checkpointer.save = save_then_die

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
