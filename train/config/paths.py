"""Paths a user gives: local ones only, `~` expanded, and no output over, into or around an input.

    local("run.dir", "~/runs/x")      # -> "/home/me/runs/x"; "gs://b/x" raises PathError
    relation(a, b)                    # "same", "inside" (a lies in b), "contains", or None
    check_apart(outputs, inputs)      # raises PathError for the first overlap

Every comparison is of resolved paths (os.path.realpath: symlinks followed, `..` removed), so a
symlink or another spelling of a directory is seen for what it is. Nothing here imports JAX or
the trainer: the config loader and train.tools.tokenize use it before anything starts.
"""

from __future__ import annotations

import os
import re


class PathError(ValueError):
    """A path that cannot be used as given; the message is one line and names the fix."""


# scheme://..., e.g. gs://, s3://, hf://, http:// (a Windows drive letter has no //)
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def local(key: str, path: str) -> str:
    """`path` with a leading `~` expanded (a shell leaves `key=~/x` as typed); a URL is refused:
    the trainer reads and writes local files only (os.makedirs would make a local `gs:` tree)."""
    if _URL.match(path):
        raise PathError(f"{key} {path!r} is a remote URL; only local paths are supported (mount "
                        "the bucket, e.g. with gcsfuse, and give its local path, or copy the files)")
    expanded = os.path.expanduser(path)
    if expanded.startswith("~"):
        raise PathError(f"{key} {path!r}: no such user's home directory to expand; write the "
                        "path out in full")
    return expanded


def resolved(path: str) -> str:
    return os.path.realpath(os.path.expanduser(path))


def relation(a: str, b: str) -> str | None:
    """How path a lies to path b once both are resolved: "same", "inside" (a in b), "contains"
    (b in a) or None. Existing files are also compared by inode, which catches hard links."""
    ra, rb = resolved(a), resolved(b)
    if ra == rb:
        return "same"
    try:
        if os.path.samefile(ra, rb):
            return "same"
    except OSError:
        pass
    if ra.startswith(rb.rstrip(os.sep) + os.sep):
        return "inside"
    if rb.startswith(ra.rstrip(os.sep) + os.sep):
        return "contains"
    return None


def describe(key_a: str, a: str, how: str, key_b: str, b: str) -> str:
    """'run.dir '/w/r' is checkpoint.export_hf '/w/r'' and the like, for the messages."""
    words = {"same": "is the same path as", "inside": "lies inside", "contains": "contains"}[how]
    return f"{key_a} {a!r} {words} {key_b} {b!r}"


def check_apart(outputs: list[tuple[str, str]], inputs: list[tuple[str, str]],
                why: dict[str, str] | None = None) -> None:
    """No output (key, path) is the same as, inside or around another output or any input (key,
    path). why: per output key, what that output does to its path (for the message)."""
    why = why or {}
    for i, (key, path) in enumerate(outputs):
        for other_key, other in outputs[i + 1:] + inputs:
            how = relation(path, other)
            if how is not None:
                reason = why.get(key, "it is written there")
                raise PathError(f"{describe(key, path, how, other_key, other)}; {reason}; choose "
                                f"a {key} that is neither {other_key} nor inside or around it")
