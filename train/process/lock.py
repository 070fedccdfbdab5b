"""One owner per run.dir: two runs writing one directory would interleave checkpoints and replace
each other's metrics.jsonl.

    with RunDirLock(run_dir):   # raises RunDirInUse naming the owner's pid and host
        ...train...

The owner holds an exclusive `flock` on `{run.dir}/.lock` for its lifetime, and writes its host,
pid and start time into the file for the message a second run prints. The kernel drops the lock
when the owner's process ends in any way (kill -9 included), so a lock left by a dead owner blocks
no one: the next run takes the file over. The file is removed when the owner finishes.

`check_free(run_dir)` probes without creating or writing anything, so the pre-flight checks can
refuse a busy run.dir before they read its checkpoints (which the owner may be pruning).
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket

LOCK_NAME = ".lock"


class RunDirInUse(RuntimeError):
    """Another live process owns run.dir; the message names it."""


def _owner_text(path: str) -> str:
    try:
        with open(path) as f:
            owner = json.load(f)
        return (f"pid {owner['pid']} on {owner['host']} (started {owner['started']})")
    except Exception:  # noqa: BLE001 (being written right now, or not ours)
        return "another process"


def _busy(run_dir: str, path: str) -> RunDirInUse:
    return RunDirInUse(
        f"{run_dir} is in use by {_owner_text(path)}: one run per run.dir at a time; wait for "
        "that run to end (or stop it) or choose another run.dir")


def check_free(run_dir: str) -> None:
    """Raise RunDirInUse when a live process holds run_dir's lock; creates and writes nothing."""
    path = os.path.join(run_dir, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # no lock file (or unreadable: acquire will say)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _busy(run_dir, path) from None
    except OSError:
        return
    finally:
        os.close(fd)  # closing drops a lock we may have taken


class RunDirLock:
    """Hold `{run_dir}/.lock` (creating run_dir if needed) from __enter__ to __exit__."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK_NAME)
        self.fd: int | None = None
        self.created_dir = False

    def __enter__(self) -> "RunDirLock":
        if not os.path.isdir(self.run_dir):
            os.makedirs(self.run_dir)
            self.created_dir = True
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                self._undo_dir()
                raise _busy(self.run_dir, self.path) from None
            # the previous owner may have removed the file between our open and our lock: then
            # we hold a lock on a file nobody else will see; open the current one again
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        owner = {"pid": os.getpid(), "host": socket.gethostname(),
                 "started": datetime.datetime.now().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(owner) + "\n").encode())
        self.fd = fd
        return self

    def _undo_dir(self) -> None:
        if self.created_dir:
            try:
                os.rmdir(self.run_dir)  # only when still empty
            except OSError:
                pass

    def __exit__(self, *exc) -> bool:
        if self.fd is not None:
            try:
                os.remove(self.path)  # while still locked: a waiting run then opens a new file
            except FileNotFoundError:
                pass
            os.close(self.fd)
            self.fd = None
        if exc[0] is not None:
            self._undo_dir()  # a run that failed before writing leaves no empty run.dir behind
        return False
