"""The processes of a multi-process run train one config on one data set: checked at start-up.

Each process was given its own command line; one given another optimizer.lr (or another data file
under the same name) would train its share of the work differently while every process exits 0.
So before anything is compiled or written, each process publishes what it will run in the
jax.distributed key-value store (train.process.peers.distributed_client):

    its resolved config as JSON, less the keys that differ per process on purpose
    (runtime.distributed.process_id), with each input file (data.path, data.mix, data.tokenizer,
    eval.path) as its size and sampled sha256 (train.config.fingerprint) instead of its path, and
    model.hf_path as such a fingerprint of the config.json and weights in it: a copy on another
    host's disk is the same data, another file (or a stale model) under the same name is not

and reads every other process's. All see the same set, so all reach the same verdict: a mismatch
ends every process with one line naming the keys that differ (ConfigError, exit status 2); a
process that publishes nothing within join_timeout_s (it may have joined that late) ends the
others with one line (NoAnswer: train.loop turns it into a PeerFailure, exit status 3).
"""

from __future__ import annotations

import json
import os
import time

from ..config.schema import Config, ConfigError, to_dict
from ..config.fingerprint import hf_fingerprint, sample_sha256
from . import peers

PER_PROCESS_KEYS = (("runtime", "distributed", "process_id"),)
INPUT_FILES = (("data", "path"), ("data", "tokenizer"), ("eval", "path"))
_PREFIX = "basp_jax/agreement"
_generation = 0  # checks made by this process: keys of an earlier run() in it stay apart
SHOWN_KEYS = 3  # differing keys named in the message
LAST_TO_LEAVE_S = 1.0  # process 0 (the store's host) outlasts the others' exit by this much
VERDICT_WAIT_S = 30.0  # the others, all there, read the verdict at once: no join-long wait


class NoAnswer(RuntimeError):
    """A peer published nothing in time; the one-line message names it."""


UNREADABLE = "(unreadable here)"  # matches any identity: the checks after this one say why


def file_identity(path: str) -> dict | str:
    """Size and sampled sha256 of an input file, or UNREADABLE: a file missing on one host is
    that process's own error, which train.process.peers passes on to the others."""
    try:
        return {"bytes": os.path.getsize(path), "sample_sha256": sample_sha256(path)}
    except OSError:
        return UNREADABLE


def hf_identity(path: str, weights: bool) -> dict | str:
    """hf_fingerprint of a Hugging Face directory, or UNREADABLE (as file_identity)."""
    try:
        return hf_fingerprint(path, weights)
    except OSError:
        return UNREADABLE


def description(cfg: Config) -> dict:
    """What this process will run, comparable across processes and hosts (see the docstring)."""
    tree = json.loads(json.dumps(to_dict(cfg)))  # plain values, as every process reads them back
    for *parents, name in PER_PROCESS_KEYS:
        node = tree
        for part in parents:
            node = node.get(part, {})
        node.pop(name, None)
    for section, name in INPUT_FILES:
        path = tree.get(section, {}).get(name)
        if path:
            tree[section][name] = file_identity(path)
    model = tree.get("model", {})
    if model.get("hf_path"):
        model["hf_path"] = hf_identity(model["hf_path"], bool(model.get("load_weights")))
    mix = tree.get("data", {}).get("mix")
    if mix:
        tree["data"]["mix"] = [[file_identity(path), weight] for path, weight in mix.items()]
    return tree


def _flat(tree, prefix: str = "") -> dict[str, object]:
    """{'optimizer.lr': 0.001, ...}: the leaves of a config tree by dotted key."""
    if not isinstance(tree, dict) or "sample_sha256" in tree:  # (a file's identity: one leaf)
        return {prefix: tree}
    out: dict[str, object] = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else key))
    return out


def differences(first: dict, second: dict, names: tuple[str, str] = ("here", "there")
                ) -> list[str]:
    """'key: A here, B there' (names) for each leaf that differs, in key order."""
    a, b = _flat(first), _flat(second)
    missing = object()
    return [f"{key}: {_short(a.get(key, missing))} {names[0]}, "
            f"{_short(b.get(key, missing))} {names[1]}"
            for key in sorted(set(a) | set(b))
            if not _same_leaf(a.get(key, missing), b.get(key, missing))]


def _same_leaf(a, b) -> bool:
    return a == b or UNREADABLE in (a, b)


def same(a: dict, b: dict) -> bool:
    """Whether two descriptions agree (an UNREADABLE file agrees with any)."""
    return not differences(a, b)


def _short(value) -> str:
    if not isinstance(value, (str, int, float, bool, type(None), list, dict)):
        return "(unset)"
    if isinstance(value, dict) and "files" in value:
        return (f"a Hugging Face directory of {value['files']} files, {value['bytes']} bytes "
                f"(sampled sha256 {value['sample_sha256'][:12]})")
    if isinstance(value, dict) and "sample_sha256" in value:
        return f"a file of {value['bytes']} bytes (sampled sha256 {value['sample_sha256'][:12]})"
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:50] + "..."


def check_same_config(cfg: Config) -> None:
    """In a multi-process run: every process runs this config on this data, or each stops with
    one line (see the module docstring). Nothing to check in one process."""
    import jax

    if jax.process_count() == 1:
        return
    global _generation
    _generation += 1
    agree(peers.distributed_client(), f"{_PREFIX}/{_generation}", jax.process_index(),
          jax.process_count(), description(cfg), cfg.runtime.distributed.join_timeout_s)


def agree(client, prefix: str, me: int, count: int, mine: dict, timeout: float) -> None:
    """Process `me` of `count`: publish `mine` under prefix in the key-value store, read the
    others', return when all agree, else raise ConfigError (NoAnswer after `timeout` s)."""
    client.key_value_set(f"{prefix}/config/{me}", json.dumps(mine, sort_keys=True),
                         allow_overwrite=True)
    published = _wait_for_all(client, f"{prefix}/config/", count, timeout, "its config")
    descriptions = {p: json.loads(text) for p, text in published.items()}
    if all(same(a, b) for a in descriptions.values() for b in descriptions.values()):
        return  # (every pair: each process then reaches the same verdict)
    # every process sees the same set, so every one stops; process 0, which hosts the store,
    # waits until the others have read it before it goes
    client.key_value_set(f"{prefix}/read/{me}", "1", allow_overwrite=True)
    if me == 0:
        try:
            _wait_for_all(client, f"{prefix}/read/", count, min(timeout, VERDICT_WAIT_S),
                          "its verdict")
        except NoAnswer:
            pass  # it stops either way
        time.sleep(LAST_TO_LEAVE_S)  # the others leave at once: go after them, not before
    raise ConfigError(_mismatch_message(me, count, descriptions))


def _mismatch_message(me: int, count: int, descriptions: dict[int, dict]) -> str:
    """This process and the first whose config differs from its own (or, when this one agrees
    with all, the first two that disagree), and the keys that differ."""
    order = sorted(descriptions)
    pairs = [(me, p) for p in order] + [(a, b) for a in order for b in order]
    a, b = next((a, b) for a, b in pairs if not same(descriptions[a], descriptions[b]))
    diff = differences(descriptions[a], descriptions[b],
                       (f"in process {a}", f"in process {b}"))
    shown = "; ".join(diff[:SHOWN_KEYS]) + (f"; and {len(diff) - SHOWN_KEYS} more"
                                             if len(diff) > SHOWN_KEYS else "")
    return (f"the {count} processes of this run were given different configs or data "
            f"({shown}); give every process the same config file, overrides and input files "
            "(only runtime.distributed.process_id differs)")


def _wait_for_all(client, directory: str, count: int, timeout: float,
                  what: str) -> dict[int, str]:
    """{process: value} of the `count` keys under `directory`, once all are there; NoAnswer
    after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        found = {int(key.rstrip("/").rsplit("/", 1)[-1]): value
                 for key, value in client.key_value_dir_get(directory)}
        if len(found) >= count:
            return found
        if time.monotonic() > deadline:
            missing = ", ".join(str(p) for p in range(count) if p not in found)
            raise NoAnswer(f"process {missing} of {count} has not published {what} within "
                           f"{timeout:g} s (runtime.distributed.join_timeout_s) of joining the "
                           "run; it has probably crashed or frozen; see its log")
        time.sleep(0.05)
