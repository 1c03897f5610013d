"""A name -> function registry. Registering a name twice raises; a failed lookup lists the names.

Each entry may carry facts about itself (`register("gae", needs_values=True)`), read with `info(name)`, so
callers ask the registry instead of keeping their own lists of names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    def __init__(self, kind: str, key: str):
        self.kind, self.key, self._items, self._info = kind, key, {}, {}

    def register(self, *names: str, **info) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            for name in names:
                if name in self._items:
                    raise ValueError(f"{self.kind} `{name}` is registered twice")
                self._items[name] = fn
                self._info[name] = dict(info)
            return fn

        return deco

    def get(self, name: str) -> F:
        if name not in self._items:
            raise KeyError(f"{self.key}={name}: unknown {self.kind}. Valid names: {', '.join(self.names())}.")
        return self._items[name]

    def info(self, name: str) -> dict:
        """The facts registered with `name` (an empty dict when none); KeyError listing names if unknown."""
        self.get(name)
        return self._info[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items
