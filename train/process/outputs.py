"""The files the trainer writes outside its checkpoints: run.dir and checkpoint.export_hf are checked
before anything is written, and the Hugging Face export replaces an earlier one atomically."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile

import models
from models.safetensors_io import INDEX_FILE
from basp_jax import Layout
from basp_jax.compiled import comm

from ..checkpoint import hf_export
from ..config import paths
from ..config.schema import INPUT_PATHS, Config, ConfigError, from_dict, to_yaml
from ..config.tree import yaml_load
from .lock import LOCK_NAME

# files the trainer writes in run.dir, and what each must be when it exists already
RUN_DIR_FILES = ("config.yaml", "metrics.jsonl", "metrics.jsonl.tmp", "collectives.json")
# everything the trainer writes (or prunes) in run.dir: the files above, its lock, checkpoints,
# TensorBoard events, profiles, the W&B run id and wandb's own folder; nothing else there is touched
RUN_DIR_OWNED = RUN_DIR_FILES + (LOCK_NAME, "checkpoints", "tb", "profile", "wandb_id", "wandb")
EXPORT_MARKER = ".basp-export.json"  # in an export: which run.dir wrote it, and which files


def _check_creatable(key: str, path: str) -> None:
    """`path` is a writable directory, or can be created: every name fits the file system and the
    nearest existing ancestor is a writable directory."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key} {path!r} is a file, not a directory; choose another path")
    if os.path.isdir(path):
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{key} {path!r} is not writable; fix its permissions or "
                              "choose another path")
        return
    ancestor = os.path.dirname(path)
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ConfigError(f"{key} {path!r} cannot be created: {ancestor} is a file, not a "
                          "directory; choose another path")
    try:
        name_max = os.pathconf(ancestor, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    for part in os.path.relpath(path, ancestor).split(os.sep):
        if len(os.fsencode(part)) > name_max:
            raise ConfigError(f"{key}: the name {part[:40]!r}... is {len(os.fsencode(part))} bytes, "
                              f"more than the {name_max} this file system allows; choose a shorter "
                              "path")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"{key} {path!r} cannot be created: {ancestor} is not writable")


def _inputs(cfg: Config) -> list[tuple[str, str]]:
    """(key, absolute path) of everything the run reads: its config files and the INPUT_PATHS."""
    found = [("the config file" if i == 0 else "the included config file", os.path.abspath(p))
             for i, p in enumerate(cfg.sources)]
    for key in INPUT_PATHS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value:
            found.append((key, os.path.abspath(value)))
    found += [("data.mix", os.path.abspath(path)) for path in cfg.data.mix]  # its token files
    return found


def _is_resolved_config(path: str) -> bool:
    """Whether `path` holds a config exactly as write_config writes one (every key, no comment, no
    include): writing the new resolved config over it then loses nothing a person wrote."""
    try:
        with open(path) as f:
            text = f.read()
        return text == to_yaml(from_dict(yaml_load(text)))
    except Exception:  # noqa: BLE001 (not a config, or not one in that form)
        return False


def _check_run_dir_apart(run_dir: str, inputs: list[tuple[str, str]]) -> None:
    """run.dir is no input and lies in none; an input inside run.dir is kept clear of what the
    trainer writes there (RUN_DIR_OWNED). A resume with `--config {run.dir}/config.yaml`, the
    file an earlier run wrote, is allowed: it is replaced by the same values plus the overrides."""
    for key, path in inputs:
        how = paths.relation(run_dir, path)
        if how in ("same", "inside"):
            raise ConfigError(f"{paths.describe('run.dir', run_dir, how, key, path)}; the trainer "
                              "would write into that input; choose a run.dir outside it")
        if how != "contains":
            continue
        rel = os.path.relpath(paths.resolved(path), paths.resolved(run_dir))
        owned = rel.split(os.sep)[0]
        if owned not in RUN_DIR_OWNED:
            continue  # e.g. run.dir/data.bin: the trainer never writes there
        if rel == "config.yaml" and key.endswith("config file") and _is_resolved_config(path):
            continue
        what = ("the trainer writes the resolved config there, and this file is not one (it has "
                "comments, an include or keys left out, which would be lost); move it out of "
                "run.dir (e.g. beside it) or choose another run.dir"
                if rel == "config.yaml" else
                f"the trainer writes {os.path.join(run_dir, owned)} (and prunes checkpoints); "
                "move the input out of it or choose another run.dir")
        raise ConfigError(f"{key} {path!r} is {rel} in run.dir {run_dir!r}: {what}")


def _check_owned_links_apart(run_dir: str, inputs: list[tuple[str, str]]) -> None:
    """What the trainer writes in run.dir (RUN_DIR_OWNED) is followed through symlinks: a
    run.dir/config.yaml linked to the hand-written --config file, or a checkpoints/ linked to the
    data's folder, would have the trainer write over (or prune) an input."""
    for name in RUN_DIR_OWNED:
        written = os.path.join(run_dir, name)
        if not os.path.islink(written):
            continue  # (a plain file or folder there is _check_run_dir_apart's)
        for key, path in inputs:
            how = paths.relation(written, path)
            if how is None:
                continue
            if how == "same" and name == "config.yaml" and key.endswith("config file") \
                    and _is_resolved_config(path):
                continue  # an earlier run's resolved config: rewritten with the same values
            raise ConfigError(
                f"{written} is a symlink to {paths.resolved(written)!r}, which "
                f"{'is' if how == 'same' else 'lies in' if how == 'inside' else 'contains'} "
                f"{key} {path!r}; the trainer writes {name} in run.dir and would change that "
                "input; remove the link or choose another run.dir")


def check_overlaps(cfg: Config, run_dir: str) -> None:
    """No output over, into or around an input or another output (train.config.paths, symlinks
    resolved): an export replaces its whole directory, so it stays apart from run.dir and from
    every input; run.dir stays off the inputs (_check_run_dir_apart)."""
    inputs = _inputs(cfg)
    if cfg.checkpoint.export_hf:
        export = os.path.abspath(cfg.checkpoint.export_hf)
        try:
            paths.check_apart([("checkpoint.export_hf", export)], [("run.dir", run_dir), *inputs],
                              why={"checkpoint.export_hf": "an export replaces its whole "
                                                           "directory"})
        except paths.PathError as e:
            raise ConfigError(str(e)) from None
    _check_run_dir_apart(run_dir, inputs)
    _check_owned_links_apart(run_dir, inputs)


def check_output_paths(cfg: Config, run_dir: str) -> None:
    """run.dir (and checkpoint.export_hf) are directories or can be created, apart from the inputs
    and each other (check_overlaps), the files the trainer writes there are files it can write,
    and an export never replaces someone else's files."""
    check_overlaps(cfg, run_dir)
    _check_creatable("run.dir", run_dir)
    for name in RUN_DIR_FILES + (LOCK_NAME,):
        path = os.path.join(run_dir, name)
        if os.path.lexists(path) and not os.path.isfile(path):
            raise ConfigError(f"{path} is not a regular file (the trainer writes it); move it "
                              "out of run.dir")
        if os.path.isfile(path) and not os.access(path, os.W_OK):
            raise ConfigError(f"{path} is not writable; fix its permissions")
    export = cfg.checkpoint.export_hf
    if not export:
        return
    _check_creatable("checkpoint.export_hf", export)
    export = os.path.realpath(export)
    if os.path.isdir(export) and os.listdir(export) and not is_own_export(export, run_dir):
        raise ConfigError(
            f"checkpoint.export_hf {export!r} holds other files and is not an earlier export of "
            "this run.dir; choose a new or empty directory (an export never replaces files it "
            "did not write)")


class ExportError(RuntimeError):
    """The export at the end of a run could not be written (its directory took files the run
    did not write, or a weight the export dtype cannot hold); one line; nothing was exported and
    the run's checkpoints are kept."""


def _marker(export_dir: str) -> dict | None:
    try:
        with open(os.path.join(export_dir, EXPORT_MARKER)) as f:
            marker = json.load(f)
        return marker if isinstance(marker, dict) else None
    except Exception:  # noqa: BLE001 (missing, unreadable, not JSON)
        return None


def is_own_export(export_dir: str, run_dir: str) -> bool:
    """Whether export_dir is an export this run.dir wrote and holds nothing else: its marker
    names run_dir and lists every other file there (an export replaces only what it wrote)."""
    return not _not_written(export_dir, run_dir)


def _not_written(export_dir: str, run_dir: str) -> list[str]:
    """The entries of export_dir that no export of this run.dir wrote (every one when its
    marker is missing or names another run.dir), sorted."""
    marker = _marker(export_dir)
    own = marker is not None and marker.get("run_dir") == run_dir
    return sorted(name for name in os.listdir(export_dir)
                  if not (own and _written(marker, name)
                          and os.path.isfile(os.path.join(export_dir, name))))


def _written(marker: dict, name: str) -> bool:
    """Whether the export whose marker this is wrote `name` (a marker of an earlier version
    lists no files: then the names an export writes)."""
    if name == EXPORT_MARKER:
        return True
    files = marker.get("files")
    if isinstance(files, list):
        return name in files
    return name in (INDEX_FILE, "config.json", "generation_config.json",
                    *hf_export.TOKENIZER_FILES) or \
        re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors", name) is not None


def _foreign(export_dir: str, run_dir: str) -> ExportError:
    names = _not_written(export_dir, run_dir)
    listed = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return ExportError(
        f"checkpoint.export_hf {export_dir!r} holds files this run's export did not write "
        f"({listed}); they were left as they are and nothing was exported; move them (or choose "
        f"another checkpoint.export_hf) and run the same command again to export; "
        f"{_checkpoints(run_dir)}")


def _checkpoints(run_dir: str) -> str:
    from ..checkpoint.store import checkpoint_dir, complete_steps

    steps = complete_steps(checkpoint_dir(run_dir))
    return (f"the run's checkpoints are kept (newest: step {steps[-1]} in "
            f"{checkpoint_dir(run_dir)})" if steps else "no checkpoint was written")


def export_hf(module, export_dir: str, run_dir: str, is_writer: bool,
              cfg: Config | None = None) -> None:
    """Write the Hugging Face export into a fresh directory beside export_dir, then move it into
    place: an interrupted export leaves the previous one (or nothing) rather than a mixture.
    export_dir is replaced only when it is empty or an earlier export of this run holding nothing
    else (is_own_export: checked before the run and again as it is replaced, since files may
    have been put there meanwhile); else ExportError, as for a weight the export dtype cannot
    hold (checked before anything is written)."""
    tmp = _export_folder(export_dir, run_dir) if is_writer else None
    try:
        # every process takes part (shards are gathered one at a time); process 0 writes
        try:
            models.save_pretrained(module, tmp or export_dir,
                                   dtype=cfg.checkpoint.export_dtype if cfg else None)
        except models.ModelError as e:  # a value the export cannot hold: nothing was written
            dtype = cfg.checkpoint.export_dtype if cfg else None
            raise ExportError(f"checkpoint.export_hf with checkpoint.export_dtype={dtype}: {e} "
                              f"(checkpoint.export_dtype); nothing was exported; "
                              f"{_checkpoints(run_dir)}: the same command exports them again"
                              ) from None
        if not is_writer:
            return
        if cfg is not None:  # tokenizer, bos/eos ids, generation_config.json
            hf_export.write(cfg, tmp)
        written = sorted(os.listdir(tmp))
        with open(os.path.join(tmp, EXPORT_MARKER), "w") as f:
            json.dump({"run_dir": run_dir, "files": written}, f)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the export is for others to read
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
        _replace(tmp, export_dir, run_dir)
        tmp = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _export_folder(export_dir: str, run_dir: str) -> str:
    """A fresh folder beside export_dir to write the export into. Its parent was checked before
    the run, but may have become a file or lost its permissions since: one line, not a
    traceback (a full disk stays an OSError, which train.loop reports as one)."""
    parent = os.path.dirname(export_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        return tempfile.mkdtemp(dir=parent, prefix=".export-")
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise ExportError(f"checkpoint.export_hf {export_dir!r}: its folder {parent!r} cannot "
                          f"be written ({e.strerror or e}); nothing was exported; make it a "
                          f"writable folder (or choose another checkpoint.export_hf) and run the "
                          f"same command again to export; {_checkpoints(run_dir)}") from None


def _replace(new: str, export_dir: str, run_dir: str) -> None:
    """Move the finished export `new` to export_dir: over nothing, an empty directory, or an
    earlier export of this run holding nothing else (moved aside, checked again there, where no
    file can arrive by its path any more, and only then deleted)."""
    old = None
    if os.path.isdir(export_dir) and os.listdir(export_dir):
        if not is_own_export(export_dir, run_dir):
            raise _foreign(export_dir, run_dir)
        old = tempfile.mkdtemp(dir=os.path.dirname(export_dir), prefix=".export-old-")
        aside = os.path.join(old, "export")
        os.rename(export_dir, aside)
        if not is_own_export(aside, run_dir):  # a file arrived after the check: put it back
            os.rename(aside, export_dir)
            os.rmdir(old)
            raise _foreign(export_dir, run_dir)
    try:
        os.replace(new, export_dir)  # also over an empty directory
    except OSError as e:
        if old is not None and not _put_back(old, export_dir):
            raise ExportError(f"checkpoint.export_hf {export_dir!r} could not be replaced "
                              f"({e.strerror or e}) and something took its place meanwhile; the "
                              f"earlier export is kept in {os.path.join(old, 'export')}; "
                              f"{_checkpoints(run_dir)}") from None
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise  # train.loop reports a full disk
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise ExportError(f"checkpoint.export_hf {export_dir!r} could not be written "
                              f"({e.strerror or e}); nothing was exported"
                              f"{'' if old is None else ' (the earlier export is kept)'}; make "
                              f"it writable (or choose another checkpoint.export_hf) and run the "
                              f"same command again to export; {_checkpoints(run_dir)}") from None
        if os.path.isdir(export_dir):  # files arrived in the empty directory meanwhile
            raise _foreign(export_dir, run_dir) from None
        raise ExportError(f"checkpoint.export_hf {export_dir!r} became a file during the run; "
                          "nothing was exported; move it and run the same command again to "
                          f"export; {_checkpoints(run_dir)}") from None
    if old is not None:
        shutil.rmtree(old)


def _put_back(old: str, export_dir: str) -> bool:
    """After a failed replace: the earlier export moved aside into `old` goes back to
    export_dir, when nothing has taken that path (else it stays where it is: False)."""
    if os.path.lexists(export_dir):
        return False
    os.rename(os.path.join(old, "export"), export_dir)
    os.rmdir(old)
    return True


def write_config(cfg: Config, run_dir: str) -> None:
    """The resolved config in {run.dir}/config.yaml (the first file a run writes), and one line
    on stdout that names it."""
    path = os.path.join(run_dir, "config.yaml")
    with open(path, "w") as f:
        f.write(to_yaml(cfg))
    model = cfg.model.hf_path or f"preset {cfg.model.preset}"
    print(f"config: {path} (model {model}, data.source={cfg.data.source} "
          f"seq_len={cfg.data.seq_len}, train.steps={cfg.train.steps}, "
          f"parallel.mode={cfg.parallel.mode})", flush=True)


def write_collectives(run_dir: str, collectives, layout: Layout, others=()) -> None:
    """{run.dir}/collectives.json: per kind, count and bytes per device (total, on the wire,
    between hosts) of one compiled train step, for benchmarks; `others`, (layout, collectives)
    of the other layouts of an adaptive run, under "layouts"."""
    def entry(layout, collectives):
        return {"layout": layout.describe(), "groups": layout.groups, "sp": layout.sp,
                "ring": layout.ring,
                "per_kind": comm.summarize(collectives, layout.devices_per_host)}

    record = {**entry(layout, collectives), "devices_per_host": layout.devices_per_host}
    if others:
        record["layouts"] = [entry(layout, collectives)] + [entry(*o) for o in others]
    with open(os.path.join(run_dir, "collectives.json"), "w") as f:
        json.dump(record, f, indent=1)
