"""What a resume may change: one table (RULES) of the config keys that change a run's meaning.

Every checkpoint's meta holds `record(cfg, ...)`: the values of these keys (the model's resolved
architecture as model.shape.*, the identity of the data files as data.file and
data.tokenizer_file). A resume compares the checkpoint's record with the new config's:

    fixed       cannot change on resume (the checkpoint's arrays or the data order depend on it):
                refused with one line
    on purpose  a deliberate change (a new schedule, longer rows, more data) is legitimate, so it
                is refused unless checkpoint.allow_changed names the key; then the change is
                logged and recorded in the first metrics.jsonl line of the resumed invocation

Keys that are not in the table (the layout, device counts, kernels, checkpointing, metrics,
evaluation, profiling, paths whose contents are recorded) change freely: a resume is exact across
them. Parameter and optimizer-state shapes are checked before this (train.checkpoint), so a
model.shape change that alters them is refused there.

Nothing here imports JAX or numpy at module level: train.config validates
checkpoint.allow_changed against RULES.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .errors import ConfigError
from .fingerprint import sample_sha256

FIXED, ON_PURPOSE = "fixed", "on purpose"

# key (a prefix ending in "." covers every key under it) -> (policy, what the key decides)
RULES: dict[str, tuple[str, str]] = {
    "run.seed": (FIXED, "the data order and the synthetic data"),
    "model.param_dtype": (FIXED, "the dtype of the checkpoint's parameters"),
    "optimizer.mu_dtype": (FIXED, "the dtype of the optimizer's first moment"),
    "model.shape.": (ON_PURPOSE, "the model's architecture"),
    "model.dtype": (ON_PURPOSE, "the compute dtype"),
    "data.source": (ON_PURPOSE, "where the tokens come from"),
    "data.file": (ON_PURPOSE, "the contents of data.path"),
    "data.dtype": (ON_PURPOSE, "how data.path is read"),
    "data.mix": (ON_PURPOSE, "the token files mixed and their weights"),
    "data.mix_files": (ON_PURPOSE, "the contents of data.mix's files"),
    "data.tokenizer_file": (ON_PURPOSE, "the contents of data.tokenizer"),
    "data.text_key": (ON_PURPOSE, "which field of the JSONL is read"),
    "data.eos_id": (ON_PURPOSE, "where documents end"),
    "data.seq_len": (ON_PURPOSE, "the tokens per row"),
    "data.pack": (ON_PURPOSE, "whether documents attend across boundaries"),
    "data.branching": (ON_PURPOSE, "the synthetic data"),
    "data.documents": (ON_PURPOSE, "the lengths of the synthetic documents"),
    "train.steps": (ON_PURPOSE, "the learning-rate schedule (it decays over train.steps)"),
    "train.microbatch_size": (ON_PURPOSE, "the batch"),
    "train.grad_accum": (ON_PURPOSE, "the batch"),
    "optimizer.lr": (ON_PURPOSE, "the learning-rate schedule"),
    "optimizer.warmup_steps": (ON_PURPOSE, "the learning-rate schedule"),
    "optimizer.min_lr_ratio": (ON_PURPOSE, "the learning-rate schedule"),
    "optimizer.weight_decay": (ON_PURPOSE, "the update"),
    "optimizer.b1": (ON_PURPOSE, "the update"),
    "optimizer.b2": (ON_PURPOSE, "the update"),
    "optimizer.eps": (ON_PURPOSE, "the update"),
    "optimizer.clip_norm": (ON_PURPOSE, "the update"),
}

ALLOW_KEY = "checkpoint.allow_changed"


def rule(key: str) -> tuple[str, str] | None:
    """(policy, what it decides) of a recorded key; None: it changes freely."""
    if key in RULES:
        return RULES[key]
    prefix = next((p for p in RULES if p.endswith(".") and key.startswith(p)), None)
    return RULES[prefix] if prefix else None


def check_allowed(names: list[str]) -> None:
    """checkpoint.allow_changed names only keys a resume may change on purpose (ConfigError)."""
    for name in names:
        found = rule(name)
        if found is None:
            keys = ", ".join(k + "*" if k.endswith(".") else k for k, (p, _) in RULES.items()
                             if p == ON_PURPOSE)
            raise ConfigError(f"{ALLOW_KEY}: {name!r} is not a key a resume checks; it may name "
                              f"{keys}")
        if found[0] == FIXED:
            raise ConfigError(f"{ALLOW_KEY}: {name} cannot change on resume (it decides "
                              f"{found[1]}); use a new run.dir to change it")


# ------------------------------------------------------------------ what a checkpoint records

def file_identity(path: str) -> dict[str, Any]:
    """Size, modification time and a sampled sha256 of a file: a file replaced under the same
    name is seen without reading all of it (train.config.fingerprint.sample_sha256)."""
    st = os.stat(path)
    return {"path": os.path.abspath(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
            "sample_sha256": sample_sha256(path)}


def record(cfg, model_fields: dict[str, Any]) -> dict[str, Any]:
    """The values of the table's keys for this config; model_fields: the resolved ModelConfig
    (preset or Hugging Face config with model.shape applied) as a dict."""
    values: dict[str, Any] = {
        "run.seed": cfg.run.seed,
        "model.param_dtype": cfg.model.param_dtype,
        # null follows param_dtype: what the state holds is the resolved dtype
        "optimizer.mu_dtype": cfg.optimizer.mu_dtype or cfg.model.param_dtype,
        "model.dtype": cfg.model.dtype,
        **{f"model.shape.{k}": v for k, v in model_fields.items()},
    }
    for section in ("data", "train", "optimizer"):
        for name, value in vars(getattr(cfg, section)).items():
            key = f"{section}.{name}"
            if key not in values and key in RULES:
                values[key] = value
    data = cfg.data
    values["data.file"] = file_identity(data.path) if data.source != "synthetic" and \
        data.path else None
    # data.mix records the paths and weights; this the files' contents, in data.mix's order
    values["data.mix_files"] = [file_identity(p) for p in data.mix] if data.mix else None
    values["data.tokenizer_file"] = file_identity(data.tokenizer) if data.source in (
        "text", "jsonl") else None
    return json.loads(json.dumps(values))  # as the checkpoint's JSON gives it back


def _same(old: Any, new: Any) -> bool:
    """Equal values; files by contents (size and sample), not by path or modification time."""
    if isinstance(old, list) and isinstance(new, list):
        return len(old) == len(new) and all(map(_same, old, new))
    if isinstance(old, dict) and isinstance(new, dict) and "sample_sha256" in old:
        return (old.get("bytes"), old.get("sample_sha256")) == (new.get("bytes"),
                                                                  new.get("sample_sha256"))
    return old == new


def _show(value: Any) -> str:
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return "[" + ", ".join(map(_show, value)) + "]"
    if isinstance(value, dict) and "sample_sha256" in value:
        import datetime

        mtime = value.get("mtime_ns")
        when = (datetime.datetime.fromtimestamp(mtime / 1e9).isoformat(timespec="seconds")
                if isinstance(mtime, int) and 0 <= mtime < 2**62 else "at an unknown time")
        return (f"{value.get('path')} ({value.get('bytes')} bytes, sampled sha256 "
                f"{str(value.get('sample_sha256'))[:12]}, modified {when})")
    return json.dumps(value) if isinstance(value, (dict, list)) or value is None else str(value)


def differences(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """key -> (checkpoint's value, this config's) for the keys that changed. A key the
    checkpoint did not record (written by an earlier version) is not compared."""
    return {k: (old[k], new.get(k)) for k in old if rule(k) and k in new
            and not _same(old[k], new[k])}


def check(old: dict[str, Any], new: dict[str, Any], allowed: list[str]) -> dict[str, tuple]:
    """The on-purpose changes a resume may go on with (key -> (old, new)); raises ConfigError
    for a fixed key that changed or an on-purpose one that allowed does not name."""
    changed = differences(old, new)
    fixed = {k: v for k, v in changed.items() if rule(k)[0] == FIXED}
    if fixed:
        key, (was, now) = next(iter(fixed.items()))
        raise ConfigError(f"{key}={_show(now)} differs from the checkpoint's "
                          f"{key.rsplit('.', 1)[-1]} {_show(was)}: it decides {rule(key)[1]}, so "
                          "it cannot change on resume; restore it, or use a new run.dir")
    refused = {k: v for k, v in changed.items() if not _allows(allowed, k)}
    if refused:
        parts = [f"{key}={_show(now)} differs from the checkpoint's {key.rsplit('.', 1)[-1]} "
                 f"{_show(was)} ({rule(key)[1]})" for key, (was, now) in refused.items()]
        them = "it" if len(refused) == 1 else "them"
        names = ",".join(dict.fromkeys([*allowed, *refused]))  # the keys allowed already, too
        raise ConfigError(f"{', '.join(parts)}; to change {them} on purpose add "
                          f"{ALLOW_KEY}={names} (the change is logged and recorded in "
                          f"metrics.jsonl), or undo {them}")
    return changed


def _allows(allowed: list[str], key: str) -> bool:
    """allowed names the key itself, or a prefix of it: model.shape.* (or model.shape.) covers
    every model.shape key."""
    return key in allowed or any(a.endswith((".", ".*")) and key.startswith(a.rstrip("*"))
                                 for a in allowed)


def describe(changes: dict[str, tuple]) -> str:
    """The log line's list: key old -> new, ..."""
    return ", ".join(f"{k} {_show(a)} -> {_show(b)}" for k, (a, b) in changes.items())


def for_metrics(changes: dict[str, tuple]) -> dict[str, dict]:
    """The changes as metrics.jsonl records them: key -> {"from": old, "to": new}."""
    return {k: {"from": a, "to": b} for k, (a, b) in changes.items()}
