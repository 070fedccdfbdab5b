"""The generic config plumbing: YAML files (with `include:`) and `key.sub=value` overrides into
one tree of plain values, and that tree into typed dataclasses; train/config/schema.py is the schema.

Ours, not OmegaConf 2.4 (measured): it would replace only the typed values (~150 of
these ~360 lines; not include:, duplicate-key lines, depth, override parsing or the null-section
merge), a 70-line glue prototype gave our result in 26 of 28 override cases, and it adds ~45 ms of
import before JAX and ~40 ms per load (ours: 4 ms), with `${...}` in values to escape.

A config file may start from others: `include: base.yaml` (or a list of files, merged in order)
at its top level reads those first, relative paths from the including file's folder, and lays
the including file's values over theirs, section by section and key by key (a value that is not
a mapping replaces the included one whole; a section left empty adds nothing). Included files
may include others (configs/gpu/ holds an example: _base.yaml and the files on it); the resolved
config (what train.config.to_yaml writes to {run.dir}/config.yaml) holds the values, not the
include. Nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from typing import Any, Literal

import yaml

from .errors import ConfigError


# --------------------------------------------------------------------------- YAML text

class RefusedYAML(yaml.YAMLError):
    """YAML that parses but that no config may hold (a key twice, nesting too deep); its
    message is one line that says why, unlike the parser's own errors."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping with the same key twice (plain YAML keeps the last,
    so a config edited in two places would silently run with one of them), and merge keys
    (`<<: [*a, *a, ...]`, nested) that copy more than MAX_VALUES entries into one mapping."""

    def flatten_mapping(self, node):
        # (older PyYAML copies every merged entry, repeats too; called again for each merged
        # mapping, so a blow-up stops at the level that passes the bound)
        super().flatten_mapping(node)
        if len(node.value) > MAX_VALUES:
            raise _too_many_values()


def _construct_unique_mapping(loader, node, deep=False):
    seen = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *anchor`: construct_mapping merges it in; the explicit keys win
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            continue  # the default constructor reports unhashable keys itself
        if key in seen:  # (both lines: the parser's own error names only the mapping's first)
            raise RefusedYAML(f"key {key!r} appears twice (lines {seen[key].line + 1} and "
                              f"{key_node.start_mark.line + 1}); keep one")
        seen[key] = key_node.start_mark
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                 _construct_unique_mapping)


# No config value nests deeper than this (model.shape.rope_scaling is 2 levels deep): a value
# nested thousands deep would otherwise end in a RecursionError wherever it is first walked.
MAX_DEPTH = 16
# No config holds more values than this once YAML's aliases are expanded (`*name` repeats the
# whole value `&name` marks, so a few hundred bytes of aliases of aliases expand to billions of
# values, which every later walk of the tree, merge or copy would visit one by one).
MAX_VALUES = 100_000


def _measure(value: Any) -> tuple[int, int]:
    """(depth, values) of value as a tree: how deep lists and mappings nest (0: a scalar) and
    how many values it holds with every alias expanded. Each list or mapping is measured once
    (memoised by id: aliases share one object), so an expansion to billions is measured at once;
    nothing deeper than MAX_DEPTH is followed (that already refuses it, a value that holds
    itself too)."""
    memo: dict[int, tuple[int, int]] = {}

    def walk(node: Any, depth: int) -> tuple[int, int]:
        if not isinstance(node, (dict, list)):
            return 0, 1
        if depth > MAX_DEPTH:
            return 1, 1  # too deep already: the caller refuses it
        if id(node) not in memo:
            deepest, count = 0, 1
            for child in node.values() if isinstance(node, dict) else node:
                child_depth, child_count = walk(child, depth + 1)
                deepest, count = max(deepest, child_depth), count + child_count
            memo[id(node)] = (deepest + 1, count)
        return memo[id(node)]

    return walk(value, 0)


def _brackets_deeper_than(text: str, limit: int) -> bool:
    """Whether [ and { open more than `limit` deep in text (quotes ignored: a bound for flow
    style YAML, so a value nested thousands deep is refused before the parser recurses)."""
    depth = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth = max(depth - 1, 0)
    return False


def yaml_load(text: str):
    """yaml.safe_load that raises RefusedYAML (a yaml.YAMLError) on duplicate keys and on
    values nested more than MAX_DEPTH deep."""
    too_deep = _brackets_deeper_than(text, 8 * MAX_DEPTH)  # (a generous bound: quotes count)
    try:
        loaded = None if too_deep else yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506
    except RecursionError:  # the parser recurses once per level (block style, too)
        too_deep = True
    else:
        depth, values = _measure(loaded)
        too_deep = too_deep or depth > MAX_DEPTH
        if values > MAX_VALUES and not too_deep:
            raise _too_many_values()
    if too_deep:
        raise RefusedYAML(f"a value nests lists or mappings more than {MAX_DEPTH} levels deep; "
                          "no config key takes that")
    return loaded


def _too_many_values() -> RefusedYAML:
    return RefusedYAML(f"the YAML expands to more than {MAX_VALUES} values (aliases: *name repeats "
                       "the whole value &name marks); no config holds that many, write them out")


# --------------------------------------------------------------------------- files and includes

def read_yaml(path: str) -> dict:
    """One config file's top-level mapping."""
    try:
        with open(path) as f:
            loaded = yaml_load(f.read())
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or getattr(e, "reason", None) or str(e)
        raise ConfigError(f"cannot read config file {path!r}: {reason}") from None
    except RefusedYAML as e:
        raise ConfigError(f"config file {path!r}: {e}") from None
    except yaml.YAMLError as e:  # the parser's message runs over several lines
        line = str(e).replace("\n", " ")
        raise ConfigError(f"config file {path!r} is not valid YAML: {line}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of sections")
    return loaded or {}


def merge(base: dict, over: dict) -> dict:
    """base with over's values laid on top: mappings merge key by key, other values replace
    (null too, except over a mapping: a section left empty adds nothing)."""
    out = dict(base)
    for key, value in over.items():
        if value is None and isinstance(out.get(key), dict):
            continue
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


INCLUDE = "include"


def _include_names(path: str, names: Any) -> list[str]:
    """The files an `include:` value names: one path or a non-empty list of them."""
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n.strip()
                                                           for n in names):
        raise ConfigError(f"config file {path!r}: {INCLUDE} must be a file path or a list of "
                          f"them, got {names!r}")
    return names


def load_tree(path: str, chain: tuple[str, ...] = (), files: list | None = None) -> dict:
    """A config file's mapping with the files its `include:` names merged under it; chain: the
    files that include this one (an include of one of them is a cycle); files: every file read
    is appended to it."""
    tree = read_yaml(path)
    if files is not None:
        files.append(path)
    names = tree.pop(INCLUDE, None)
    if names is None:
        return tree
    chain = (*chain, path)
    base: dict = {}
    for name in _include_names(path, names):
        # relative to the including file
        target = os.path.join(os.path.dirname(path), os.path.expanduser(name))
        if not os.path.isfile(target):
            raise ConfigError(f"config file {path!r}: {INCLUDE} {name!r} does not exist "
                              f"(looked for {target!r})")
        if any(os.path.samefile(target, seen) for seen in chain):
            raise ConfigError(f"config file {path!r}: {INCLUDE} {name!r} makes a cycle "
                              f"({' -> '.join([*chain, target])})")
        base = merge(base, load_tree(target, chain, files))
    return merge(base, tree)


# --------------------------------------------------------------------------- overrides

def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if not all(parts):
        raise ConfigError(f"bad override key {dotted!r}; write section.key=value")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def _parse_override(item: str, mappings: frozenset[str] = frozenset()) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key.sub=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    try:
        value = yaml_load(raw) if raw.strip() else None
    except RefusedYAML as e:
        raise ConfigError(f"override {key}: {e}") from None
    except yaml.YAMLError:
        value = raw
    # Keep plain strings as typed on the command line (e.g. 1e-3, which YAML 1.1 leaves a string),
    # coercion by field type handles them; mappings and lists come from YAML. Inside a mapping
    # field no type is known: its scalars are YAML's, as in `model.shape={...}`.
    inside_mapping = any(key.startswith(f"{m}.") for m in mappings)
    if (isinstance(value, (str, int, float, bool)) or value is None) and not inside_mapping:
        value = raw.strip() if raw.strip() else None
    return key, value


def mapping_fields(cls, prefix: str = "") -> frozenset[str]:
    """The dotted names of cls's `dict` fields (model.shape, data.mix), nested sections too."""
    names: set[str] = set()
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        key, tp = f"{prefix}{field.name}", hints[field.name]
        if dataclasses.is_dataclass(tp):
            names |= mapping_fields(tp, f"{key}.")
        elif tp is dict:
            names.add(key)
    return frozenset(names)


def apply_overrides(tree: dict, overrides, schema=None) -> dict:
    """tree with each `key.sub=value` of overrides set in it, in order (in place); schema: the
    config dataclass, whose mapping fields take YAML's scalars (see _parse_override)."""
    mappings = mapping_fields(schema) if schema is not None else frozenset()
    for item in overrides:
        _set_dotted(tree, *_parse_override(item, mappings))
    return tree


def yaml_value(key: str, text: str) -> Any:
    """text (a string given for a list or mapping) read as YAML, or one line naming key."""
    try:
        return yaml_load(text)
    except RefusedYAML as e:
        raise ConfigError(f"{key}: {e}") from None
    except yaml.YAMLError as e:  # the parser's own message runs over several lines
        problem = getattr(e, "problem", None) or " ".join(str(e).split())
        raise ConfigError(f"{key}: {text!r} is not valid YAML ({problem}); write a YAML list or "
                          f"mapping, e.g. [a, b] or {{name: 1}}") from None


# --------------------------------------------------------------------------- typed values

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NULL = {"null", "none", "~", ""}


def type_name(tp) -> str:
    """A field type as the messages and configs/README.md spell it: `basp | ulysses`, `int or
    null`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def coerce(key: str, value: Any, tp) -> Any:
    """Convert a YAML value or a command-line string to the field type, or raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _to_union(key, value, tp)
    if origin is Literal:
        return _to_literal(key, value, typing.get_args(tp))
    if tp not in _SCALARS:
        raise ConfigError(f"{key}: unsupported field type {tp!r}")  # pragma: no cover
    return _SCALARS[tp](key, value)


def _to_union(key: str, value: Any, tp) -> Any:
    args = typing.get_args(tp)
    if value is None or (isinstance(value, str) and value.strip().lower() in _NULL):
        if type(None) in args:
            return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return coerce(key, value, arg)
        except ConfigError as e:
            errors.append(e)
    if len(errors) == 1:  # Optional[X]: X's own message says what was expected
        raise errors[0]
    raise ConfigError(f"{key}: expected {type_name(tp)}, got {value!r}")


def _to_literal(key: str, value: Any, choices: tuple) -> Any:
    if value in choices:
        return value
    if isinstance(value, str) and value.strip() in choices:
        return value.strip()
    raise ConfigError(f"{key}: expected one of {', '.join(map(str, choices))}, got {value!r}")


def _to_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def _to_int(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip().replace("_", ""))
        except ValueError:
            try:
                f = float(value)
                if f.is_integer():
                    return int(f)
            except ValueError:
                pass
    raise ConfigError(f"{key}: expected an integer, got {value!r}")


def _to_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    number = None
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            pass
    if number is None:
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if not math.isfinite(number):  # nan passes every `x <= 0` check, then poisons the run
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    return number


def _to_str(key: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{key}: expected a string, got {value!r}")


def _to_list(key: str, value: Any) -> list:
    """A list of names: a YAML list of strings, or one string of comma-separated names."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        value = value.split(",")
    if isinstance(value, list) and all(isinstance(v, str) and v.strip() for v in value):
        return [v.strip() for v in value]
    raise ConfigError(f"{key}: expected a list of names (a,b or [a, b]), got {value!r}")


def _to_dict(key: str, value: Any) -> dict:
    if isinstance(value, dict):
        return dict(value)
    raise ConfigError(f"{key}: expected a mapping, got {value!r}")


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str, dict: _to_dict,
            list: _to_list}


def build(cls, data: Any, prefix: str = ""):
    """A dataclass instance from a (possibly partial) nested dict; unknown keys are errors that
    list the keys the section has."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            where = f"{prefix}.{key}" if prefix else str(key)
            raise ConfigError(
                f"unknown config key {where!r}; {prefix or 'the top level'} has: {', '.join(names)}"
            )
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        tp = hints[name]
        key = f"{prefix}.{name}" if prefix else name
        if dataclasses.is_dataclass(tp):
            kwargs[name] = build(tp, data[name], key)
        else:
            kwargs[name] = coerce(key, data[name], tp)
    return cls(**kwargs)
