"""A name -> function registry. Registering a name twice raises; a failed lookup lists the names."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    def __init__(self, kind: str, key: str):
        self.kind, self.key, self._items = kind, key, {}

    def register(self, *names: str) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            for name in names:
                if name in self._items:
                    raise ValueError(f"{self.kind} `{name}` is registered twice")
                self._items[name] = fn
            return fn

        return deco

    def get(self, name: str) -> F:
        if name not in self._items:
            raise KeyError(f"{self.key}={name}: unknown {self.kind}. Valid names: {', '.join(self.names())}.")
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items
