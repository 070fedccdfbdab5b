"""One registry per choice: a name -> entry table that config validation, docs, the planner and
the benchmarks read, so a choice (a kernel, a parameter sharding, ...) is defined once.

    KERNELS = Registry("attention impl")
    KERNELS.register("xla", XLA)          # an entry: whatever the choice's users need of it
    KERNELS.get("xla"); KERNELS.names()   # ("xla", ...) in registration order
    KERNELS.get("nope")                   # ValueError: unknown attention impl 'nope'; use one of xla

A plain dict with one-line errors, nothing cleverer: the entries carry their own behaviour.
"""

from __future__ import annotations

from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Named entries of one choice, in registration order. `what` names the choice in errors."""

    def __init__(self, what: str):
        self.what = what
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        """Add `entry` under `name` (a second entry of one name is a mistake, not an override)."""
        if name in self._entries:
            raise ValueError(f"{self.what} {name!r} is registered twice")
        self._entries[name] = entry
        return entry

    def remove(self, name: str) -> T:
        """Take `name`'s entry out (a test's or a plugin's own entry, when it is done with it)."""
        if name not in self._entries:
            raise ValueError(self.unknown(name))
        return self._entries.pop(name)

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise ValueError(self.unknown(name))
        return self._entries[name]

    def unknown(self, name) -> str:
        """The one-line error for a name that is not registered (callers raise their own type)."""
        return f"unknown {self.what} {name!r}; use one of {', '.join(self._entries)}"

    def describe(self, *first: tuple[str, str]) -> str:
        """The choices as the config reference lists them: 'name (doc), name, ...', the (name,
        doc) pairs of `first` (e.g. "auto") before the entries (their `doc`, "" for none)."""
        docs = [*first, *((name, getattr(e, "doc", "")) for name, e in self._entries.items())]
        return ", ".join(f"{name} ({doc})" if doc else name for name, doc in docs)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def items(self):
        return self._entries.items()

    def __contains__(self, name) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)
