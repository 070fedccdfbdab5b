"""The files the trainer writes outside its checkpoints: run.dir and checkpoint.export_hf are checked
before anything is written, and the Hugging Face export replaces an earlier one atomically."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import models
from basp_jax import Layout, comm

from .config import Config, ConfigError, to_yaml

# files the trainer writes in run.dir, and what each must be when it exists already
RUN_DIR_FILES = ("config.yaml", "metrics.jsonl", "metrics.jsonl.tmp", "collectives.json")
EXPORT_MARKER = ".basp-export.json"  # in an export: which run.dir wrote it


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


def check_output_paths(cfg: Config, run_dir: str) -> None:
    """run.dir (and checkpoint.export_hf) are directories or can be created, the files the trainer
    writes there are files it can write, and an export never replaces someone else's files."""
    _check_creatable("run.dir", run_dir)
    for name in RUN_DIR_FILES:
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
    if cfg.model.hf_path and export == os.path.realpath(cfg.model.hf_path):
        raise ConfigError(f"checkpoint.export_hf {export!r} is model.hf_path: the export would "
                          "replace the pretrained weights; choose another directory")
    if os.path.isdir(export) and os.listdir(export) and _export_owner(export) != run_dir:
        raise ConfigError(
            f"checkpoint.export_hf {export!r} holds other files and is not an earlier export of "
            "this run.dir; choose a new or empty directory (an export never replaces files it "
            "did not write)")


def _export_owner(export_dir: str) -> str | None:
    """The run.dir that wrote the export in export_dir, or None."""
    try:
        with open(os.path.join(export_dir, EXPORT_MARKER)) as f:
            return json.load(f)["run_dir"]
    except Exception:  # noqa: BLE001
        return None


def export_hf(module, export_dir: str, run_dir: str, is_writer: bool) -> None:
    """Write the Hugging Face export into a fresh directory beside export_dir, then move it into
    place: an interrupted export leaves the previous one (or nothing) rather than a mixture.
    check_output_paths has made sure export_dir is new, empty or an earlier export of this run."""
    parent = os.path.dirname(export_dir)
    tmp = None
    if is_writer:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=parent, prefix=".export-")
    try:
        # every process takes part (shards are gathered one at a time); process 0 writes
        models.save_pretrained(module, tmp or export_dir)
        if not is_writer:
            return
        with open(os.path.join(tmp, EXPORT_MARKER), "w") as f:
            json.dump({"run_dir": run_dir}, f)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the export is for others to read
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
        old = None
        if os.path.isdir(export_dir) and os.listdir(export_dir):  # an earlier export of this run
            old = tempfile.mkdtemp(dir=parent, prefix=".export-old-")
            os.rename(export_dir, os.path.join(old, "export"))
        os.replace(tmp, export_dir)  # also over an empty directory
        tmp = None
        if old is not None:
            shutil.rmtree(old)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def write_config(cfg: Config, run_dir: str) -> None:
    """The config on the console and in {run.dir}/config.yaml: the first file a run writes."""
    print(to_yaml(cfg), end="", flush=True)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg))


def write_collectives(run_dir: str, collectives, layout: Layout) -> None:
    """{run.dir}/collectives.json: per kind, count and bytes per device (total, on the wire,
    between hosts) of one compiled train step, for benchmarks."""
    table = comm.summarize(collectives, layout.devices_per_host)
    with open(os.path.join(run_dir, "collectives.json"), "w") as f:
        json.dump({"layout": layout.describe(), "devices_per_host": layout.devices_per_host,
                   "per_kind": table}, f, indent=1)
