"""Orbax checkpoints of (params, optimizer state, step, data position, rng) in run.dir/checkpoints.

Saves are asynchronous and atomic (orbax writes to `N.orbax-checkpoint-tmp` and renames it to `N`
when complete), so a crash mid-save leaves only a temporary directory, which listing ignores and
the next save of that step replaces; the manager keeps the last n, and a step it prunes leaves in
one rename (into checkpoints/.pruned, emptied in the background), so a reader sees whole steps.
Steps are saved only where checkpoint.every and the loop say (Checkpointer.due), never by orbax's
own first-save rule; a failed save is one line (StorageError for space, else SaveFailed).
Restore takes abstract arrays that carry the *target* shardings, so a checkpoint written under one
layout or device count lands directly on another mesh.

An array held whole by several devices (a replicated parameter, Adam's step count) is written
from its first replica (save_replicas_whole), as orbax itself does when JAX_PLATFORMS names a GPU,
on every platform: orbax's default elsewhere, replica-parallel saving, cuts each such array into
one slice per replica with a compiled slicing program per shape, which on CPU devices (one host
memory) only adds work: 0.6 ms and often one compile per array and replica, 8% of a tiny trainer
test's time.

Before anything is built, `inspect_latest` reads (never writes) the newest complete checkpoint's
metadata and refuses one that cannot be read or holds another model's shapes.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import re
import shutil
import sys
import threading
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from ..config.schema import CheckpointConfig
from . import relayout

log = logging.getLogger(__name__)
ITEMS = ("params", "opt_state", "meta")


class CheckpointError(ValueError):
    """A checkpoint in run.dir that cannot be resumed; the message is one line and names the fix."""


class StorageError(RuntimeError):
    """A write to run.dir failed for lack of space; the one line names the path and the newest
    complete checkpoint, which the failed save never touches (orbax prunes only after a save)."""


_NO_SPACE = re.compile(r"No space left on device|Disk quota exceeded|os_error_code='(28|122)'")


def storage_error(err: BaseException, directory: str) -> StorageError | None:
    """A StorageError for `err` when it (or what it wraps) is a full disk or quota, else None."""
    seen = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            path = seen.filename or directory
            break
        if _NO_SPACE.search(str(seen)):
            match = re.search(r'"(/[^"]+)"', str(seen))  # the file, where the message names it
            path = match.group(1) if match else directory
            break
        seen = seen.__cause__ or seen.__context__
    else:
        return None
    return StorageError(f"no space left on the device writing {path}; {_newest(directory)}; free "
                        "space (or lower checkpoint.keep) and run the same command again to resume")


class SaveFailed(RuntimeError):
    """A checkpoint save failed for another reason than space (e.g. checkpoints/ removed while
    a save was being written): one line instead of orbax's tracebacks from every thread."""


def save_failed(err: BaseException, directory: str) -> SaveFailed:
    detail = " ".join(f"{type(err).__name__}: {err}".split())[:200]
    removed = (f"; {directory} was removed while the run was writing it"
               if not os.path.isdir(directory) else "")
    again = "resume from it" if complete_steps(directory) else "start afresh"
    return SaveFailed(f"saving a checkpoint to {directory} failed ({detail}){removed}; the run "
                      f"stopped; {_newest(directory)}; run the same command again to {again}")


def _newest(directory: str) -> str:
    steps = complete_steps(directory)
    return (f"the newest complete checkpoint is step {steps[-1]} in {directory}" if steps
            else f"no complete checkpoint is left in {directory}")


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(os.path.abspath(run_dir), "checkpoints")


def _path_name(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def first_non_finite(tree) -> str | None:
    """The name of the first floating-point leaf of `tree` (jax or numpy arrays) holding NaN or
    Inf, or None. Read on the host a shard at a time (no program compiles, no whole array is
    gathered); in a multi-process run every process checks its own shards and all take the
    verdict of all (every process must call it), so all refuse alike."""
    leaves = [(path, leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
              if jax.numpy.issubdtype(leaf.dtype, jax.numpy.inexact)]  # (bfloat16 too)
    bad = np.zeros(len(leaves), bool)
    for i, (_, leaf) in enumerate(leaves):
        shards = ([s.data for s in leaf.addressable_shards if s.replica_id == 0]
                  if isinstance(leaf, jax.Array) else [leaf])
        bad[i] = not all(np.isfinite(np.asarray(shard)).all() for shard in shards)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        bad = np.any(multihost_utils.process_allgather(bad), axis=0)
    return next((_path_name(path) for (path, _), b in zip(leaves, bad) if b), None)


def _param_shapes(tree) -> dict[str, tuple]:
    return {_path_name(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def complete_steps(directory: str) -> list[int]:
    """Steps with a finished checkpoint: orbax renames `N.orbax-checkpoint-tmp` to `N` only once
    every file is written, so a partial save never has a plain integer name."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory)
                  if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def inspect_latest(run_dir: str, expected_params, expected_opt_state) -> tuple[int | None, dict]:
    """(step, meta) of the newest complete checkpoint in run_dir ((None, {}): none), after checking
    that its metadata can be read and that its parameters and optimizer state have the shapes of
    `expected_params` / `expected_opt_state` (trees of arrays or ShapeDtypeStructs;
    expected_opt_state may be a function of the checkpoint's meta giving that tree). Raises
    CheckpointError naming the checkpoint and what to do.

    Reads files only: no CheckpointManager (its constructor synchronises the processes of a
    multi-process run, which must not depend on what each process happens to see here)."""
    directory = checkpoint_dir(run_dir)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(f"{directory} is a file, not a checkpoint directory; move it away")
    steps = complete_steps(directory)
    if not steps:
        return None, {}
    step = steps[-1]
    path = os.path.join(directory, str(step))
    earlier = (f"move {path} out of the way to resume from step {steps[-2]}"
               if len(steps) > 1 else "use a new run.dir to start afresh")
    found, found_opt, meta = _read_newest(directory, steps, earlier)
    if callable(expected_opt_state):  # (what the state holds depends on what wrote it)
        expected_opt_state = expected_opt_state(meta)
    _check_shapes(path, found, found_opt, expected_params, expected_opt_state)
    return step, meta


def _read_newest(directory: str, steps: list[int], earlier: str) -> tuple[dict, dict, dict]:
    """The parameter and optimizer-state shapes and the meta of the newest of `steps`, after
    checking that every step's metadata reads; `earlier` says what to do when one does not."""
    step = steps[-1]
    path = os.path.join(directory, str(step))
    missing = [name for name in ITEMS if not os.path.isdir(os.path.join(path, name))]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} lacks {', '.join(missing)}: it is corrupt or half-written; {earlier}")
    for older in steps[:-1]:  # CheckpointManager reads every step's _CHECKPOINT_METADATA
        older_path = os.path.join(directory, str(older))
        try:
            _step_metadata(older_path)
        except Exception as e:  # noqa: BLE001
            detail = " ".join(f"{type(e).__name__}: {e}".split())[:200]
            raise CheckpointError(
                f"checkpoint {older_path} cannot be read ({detail}): it is corrupt; move it out of "
                f"{directory} (the newest, step {step}, is unaffected)") from None
    try:
        _step_metadata(path)
        handler = ocp.StandardCheckpointHandler()
        found = _param_shapes(handler.metadata(epath.Path(path) / "params"))
        found_opt = _param_shapes(handler.metadata(epath.Path(path) / "opt_state"))
        with open(os.path.join(path, "meta", "metadata")) as f:
            meta = json.load(f)
        _check_meta(meta, step)  # the fields a resume reads
    except Exception as e:  # noqa: BLE001 (orbax/tensorstore/json raise many kinds)
        detail = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({detail}): it is corrupt or half-written; {earlier}"
        ) from None
    return found, found_opt, meta


def _check_shapes(path: str, found: dict, found_opt: dict, expected_params,
                  expected_opt_state) -> None:
    """The checkpoint at `path` holds this model's parameters and this optimizer's state."""
    wanted = _param_shapes(expected_params)
    wanted_opt = _param_shapes(expected_opt_state)
    layout = relayout.layout_of(wanted)
    if relayout.layout_of(found) != layout:  # restored into this run's (Checkpointer.restore)
        found = relayout.shapes_in_layout(found, layout)
        found_opt = relayout.shapes_in_layout(found_opt, layout)
    mismatch = _first_difference(found, wanted)
    if mismatch:
        raise CheckpointError(
            f"checkpoint {path} holds another model: parameter {mismatch}; use the model it was "
            "trained with, or a new run.dir")
    mismatch = _first_difference(found_opt, wanted_opt)
    if mismatch:
        raise CheckpointError(
            f"checkpoint {path} holds another optimizer state: {mismatch}; the optimizer settings "
            "changed since it was written (e.g. optimizer.clip_norm); restore them or use a new "
            "run.dir")


def _step_metadata(path: str) -> None:
    """orbax's per-step _CHECKPOINT_METADATA (when present) must be a JSON object."""
    file = os.path.join(path, "_CHECKPOINT_METADATA")
    if not os.path.exists(file):
        return
    with open(file) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"_CHECKPOINT_METADATA holds {type(data).__name__}, not an object")


def _check_meta(meta, step: int) -> None:
    """The values a resume uses: data_step in [0, step], seed a valid run.seed."""
    from ..config.schema import MAX_SEED

    if not isinstance(meta, dict):
        raise ValueError(f"meta holds {type(meta).__name__}, not an object")
    data_step, seed = meta.get("data_step"), meta.get("seed", 0)
    if isinstance(data_step, bool) or not isinstance(data_step, int) or not 0 <= data_step <= step:
        raise ValueError(f"meta data_step={data_step!r}, expected an integer in [0, {step}]")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"meta seed={seed!r}, expected an integer in [0, {MAX_SEED}]")
    if not isinstance(meta.get("resume", {}), dict):  # train.config.resume.record's values
        raise ValueError(f"meta resume holds {type(meta['resume']).__name__}, not an object")


def _first_difference(found: dict, wanted: dict) -> str | None:
    for name in sorted(set(found) | set(wanted)):
        if found.get(name) != wanted.get(name):
            return (f"{name} has shape {found.get(name, 'absent')} there and "
                    f"{wanted.get(name, 'absent')} in this config")
    return None


# Pruned steps are first renamed into this folder of checkpoints/ (one atomic rename: a reader
# such as train.tools.generate sees a whole step or none, never one half deleted) and removed from there
# in the background. Not a step number, so no listing counts it.
PRUNED = ".pruned"


def _purge(directory: str) -> None:
    """Remove what checkpoints/.pruned holds (steps orbax renamed there)."""
    pruned = os.path.join(directory, PRUNED)
    try:
        names = os.listdir(pruned)
    except OSError:
        return
    for name in names:
        shutil.rmtree(os.path.join(pruned, name), ignore_errors=True)


@functools.cache
def save_replicas_whole() -> None:
    """jax.Array checkpoints written by each array's first replica (orbax's ArrayHandler with
    use_replica_parallel=False; restoring reads either layout). Once per process, without the
    warning orbax logs when a handler replaces its default one."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
    finally:
        absl.setLevel(level)


class Checkpointer:
    def __init__(self, run_dir: str, cfg: CheckpointConfig, total_steps: int):
        save_replicas_whole()
        self.cfg = cfg
        self.directory = checkpoint_dir(run_dir)
        self.total_steps = total_steps
        self.failed = False
        self.saved = False  # a save was started
        self._purger: threading.Thread | None = None
        # a save handed to a thread (save(..., background=True)): joined before the manager is
        # used again, its failure raised there
        self._background: threading.Thread | None = None
        self._background_error: BaseException | None = None
        options = ocp.CheckpointManagerOptions(
            # due() decides when to save; orbax's own rule would also save the first step of every
            # invocation, even with checkpoint.every=0 ("only at the end")
            save_interval_steps=1,
            max_to_keep=cfg.keep,
            enable_async_checkpointing=cfg.async_save,
            create=True,
            todelete_subdir=PRUNED,
        )
        # written uncompressed: zstd took 3.5x the host CPU time of the whole save of float
        # weights (which barely compress), competing with the steps; reads take either
        tree = lambda: ocp.PyTreeCheckpointHandler(use_compression=False)  # noqa: E731
        self.manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"params": tree(), "opt_state": tree(),
                           "meta": ocp.JsonCheckpointHandler()})
        self._start_purge()  # what a crashed earlier run left there

    def _start_purge(self) -> None:
        """Empty checkpoints/.pruned in a thread (process 0: orbax prunes from there only), so a
        large pruned step is not deleted on the step loop's time."""
        if jax.process_index() != 0 or (self._purger is not None and self._purger.is_alive()):
            return
        self._purger = threading.Thread(target=_purge, args=(self.directory,),
                                        name="checkpoint-purge", daemon=True)
        self._purger.start()

    def due(self, step: int) -> bool:
        """Whether `step` lies on the checkpoint.every interval (0: never; the loop forces the
        final save) and has no checkpoint yet."""
        every = self.cfg.every
        if every <= 0 or step % every:
            return False
        self.wait_for_handover()
        return step not in self.manager.all_steps()

    def save(self, step: int, params, opt_state, meta: dict[str, Any], *, force: bool = False,
             background: bool = False) -> bool:
        """Save after `step` completed steps when the interval says so (or `force`). With
        `background`, orbax's blocking part (the copy to host memory) runs in a thread while the
        caller goes on: `params` and `opt_state` must then be buffers no later step donates (a
        copy: train.checkpoint.snapshot). Only where one process runs: orbax's barriers between
        processes are collective programs, which must not run beside the steps' own."""
        self.wait_for_handover()
        if step in self.manager.all_steps() or not (force or self.due(step)):
            return False
        self._start_purge()  # the steps the previous save pruned
        if self.saved and jax.process_index() == 0 and not os.path.isdir(self.directory):
            # orbax would make it anew and go on: the run's checkpoints would be gone unsaid
            # (process 0 looks: the others may see another file system; train.process.peers stops them)
            self.failed = True
            raise save_failed(FileNotFoundError(f"{self.directory} does not exist"), self.directory)
        self.saved = True
        if not background or jax.process_count() > 1:
            return self._save(step, params, opt_state, meta)

        def save_and_keep_error():
            try:
                self._save(step, params, opt_state, meta)
            except BaseException as e:  # noqa: BLE001 (raised by wait_for_handover)
                self._background_error = e

        self._background = threading.Thread(target=save_and_keep_error, daemon=True,
                                            name=f"checkpoint-save-{step}")
        self._background.start()
        return True

    def _save(self, step: int, params, opt_state, meta: dict[str, Any]) -> bool:
        with self._failures():
            return self.manager.save(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.PyTreeSave(params),
                    opt_state=ocp.args.PyTreeSave(opt_state),
                    meta=ocp.args.JsonSave(meta),
                ),
                force=True,
            )

    def wait_for_handover(self) -> None:
        """Wait until a save handed to a thread has passed the state to orbax (whose write goes
        on in the background); raise its failure here."""
        if self._background is not None:
            self._background.join()
            self._background = None
        if self._background_error is not None:
            error, self._background_error = self._background_error, None
            raise error

    @contextlib.contextmanager
    def _failures(self):
        """A save that failed becomes one StorageError (lack of space) or SaveFailed; after any
        failure, close() no longer waits on (and raises again from) the failed save."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 (orbax/tensorstore raise many kinds)
            self.failed = True
            if isinstance(e, jax.errors.JaxRuntimeError) and jax.process_count() > 1:
                raise  # the saves' barriers: train.loop tells a lost peer (exit 3) from the rest
            raise (storage_error(e, self.directory) or save_failed(e, self.directory)) from None

    def restore(self, step: int, abstract_params, abstract_opt_state):
        """(params, opt_state, meta) of `step`, placed as the abstract trees' shardings say; a
        checkpoint whose layers are laid out otherwise (a list against a stack) is read in its
        layout and restacked into the trees' (train.checkpoint.relayout)."""
        stored = self._stored_layout(step)
        wanted = relayout.layout_of(_param_shapes(abstract_params))
        targets = (abstract_params, abstract_opt_state)
        if stored != wanted:
            log.info("checkpoint %s/%d holds its layers %s; restacking them %s as this run "
                     "runs them", self.directory, step, _layout_words(stored),
                     _layout_words(wanted))
            targets = tuple(relayout.abstract_in_layout(t, stored) for t in targets)
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    params=_restore_args(targets[0]),
                    opt_state=_restore_args(targets[1]),
                    meta=ocp.args.JsonRestore(),
                ),
            )
        except Exception as e:  # noqa: BLE001 (orbax/tensorstore raise many kinds)
            detail = " ".join(str(e).split())[:300]
            raise CheckpointError(
                f"checkpoint {self.directory}/{step} cannot be restored ({type(e).__name__}: "
                f"{detail}); if it is damaged, move it out of {self.directory} to resume from an "
                "earlier one") from None
        params, opt_state = restored["params"], restored["opt_state"]
        if stored != wanted:
            params, opt_state = (relayout.restack_on_devices(tree, wanted, abstract) for
                                 tree, abstract in ((params, abstract_params),
                                                    (opt_state, abstract_opt_state)))
        self._check_finite(step, params, opt_state)
        return params, opt_state, dict(restored["meta"])

    def _stored_layout(self, step: int):
        """The layers' layout (train.checkpoint.relayout.layout_of) of `step`'s parameters."""
        path = epath.Path(self.directory) / str(step) / "params"
        try:
            return relayout.layout_of(_param_shapes(ocp.StandardCheckpointHandler().metadata(path)))
        except Exception as e:  # noqa: BLE001 (orbax/tensorstore raise many kinds)
            detail = " ".join(str(e).split())[:300]
            raise CheckpointError(
                f"checkpoint {path} cannot be read ({type(e).__name__}: {detail}); if it is "
                f"damaged, move it out of {self.directory} to resume from an earlier one"
            ) from None

    def _check_finite(self, step: int, params, opt_state) -> None:
        """A restored state holds no NaN or Inf: the steps would all be skipped and the final
        checkpoint would save the damage again (the train step never makes a non-finite state,
        so it came from the disk)."""
        for what, tree in (("parameter", params), ("optimizer state", opt_state)):
            name = first_non_finite(tree)
            if name is None:
                continue
            path = os.path.join(self.directory, str(step))
            earlier = [s for s in complete_steps(self.directory) if s < step]
            fix = (f"move it out of {self.directory} (or delete it) to resume from step "
                   f"{earlier[-1]}" if earlier else
                   "delete it (or use a new run.dir) to start afresh")
            raise CheckpointError(f"checkpoint {path} (step {step}) holds NaN or Inf values in "
                                  f"{what} {name}: it is damaged; {fix}")

    def wait(self) -> None:
        self.wait_for_handover()
        with self._failures():
            self.manager.wait_until_finished()

    def close(self) -> None:
        if self._background is not None:
            self._background.join()
        if self._background_error is not None:  # (a normal end raised it from wait() first)
            logging.getLogger(__name__).warning("a checkpoint save failed: %s",
                                                self._background_error)
            self._background_error = None
        if self.failed:
            try:
                self.manager.close()
            except Exception:  # noqa: BLE001 (the failure itself was raised already)
                pass
            return
        self.wait()
        self.manager.close()
        if self._purger is not None:
            self._purger.join()
        if jax.process_index() == 0:
            _purge(self.directory)  # what the last save pruned
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(self.directory, PRUNED))


def _layout_words(layout) -> str:
    return "as a list" if layout is None else (
        "stacked" if layout == 1 else f"stacked by a period of {layout}")


def _restore_args(abstract):
    """Arrays of `abstract`'s shapes, dtypes and shardings."""
    return ocp.args.PyTreeRestore(
        item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))


PRUNE_RETRIES = 5  # a trainer prunes at most once per save: this many in one read is no race


def restore_newest_params(directory: str, target):
    """The parameters of the newest complete checkpoint in `directory`, read while a trainer may
    be saving and pruning there: a step pruned while it was read (renamed away at once, see
    PRUNED) is no error; the read starts again from the newest step then complete."""
    for _ in range(PRUNE_RETRIES):
        steps = complete_steps(directory)
        if not steps:
            break
        step_dir = os.path.join(directory, str(steps[-1]))
        path = os.path.join(step_dir, "params")
        try:
            return ocp.StandardCheckpointer().restore(path, target)
        except Exception as e:  # noqa: BLE001 (orbax/tensorstore raise many kinds)
            if not os.path.isdir(step_dir):
                _quiet_abandoned_reads()
                continue  # pruned under us: a newer step is complete by now
            detail = " ".join(str(e).split())[:300]
            raise CheckpointError(f"checkpoint {path} cannot be restored for this model "
                                  f"({type(e).__name__}: {detail})") from None
    raise CheckpointError(f"the checkpoints in {directory} were pruned {PRUNE_RETRIES} times while "
                          "being read (or all removed); wait for the run to save less often "
                          "(checkpoint.every) or to end, then try again")


def _from_abandoned_read(report) -> bool:
    """An unraisable report left by orbax's in-flight array reads of a read given up."""
    if isinstance(report.exc_value, RuntimeError) and "Event loop is closed" in str(
            report.exc_value):
        return True
    code = getattr(report.object, "cr_code", None)  # a coroutine of orbax's
    return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


def _quiet_abandoned_reads() -> None:
    """A read given up because its step was pruned leaves orbax's other array reads in flight; as
    they end they find the read's event loop closed and say so through sys.unraisablehook, dozens
    of tracebacks after a good result. From the first such read on, those reports are dropped;
    every other one goes to the hook that was in place."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_abandoned_reads", False):
        return

    def hook(report):
        if not _from_abandoned_read(report):
            previous(report)

    hook.drops_abandoned_reads = True
    sys.unraisablehook = hook
