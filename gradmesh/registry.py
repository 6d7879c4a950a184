"""Registries by name: strategies, models, datasets and algorithms register, the CLI reads them.

An unknown name is a `GradmeshError` that lists the valid ones, so every choice in gradmesh fails
the same clear way.
"""

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from gradmesh.errors import GradmeshError

T = TypeVar("T")


class Registry(Generic[T]):
    """A named table of entries of one kind (`kind` is used in error messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: `@REGISTRY.register("name")` adds the decorated object under `name`."""

        def add(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = entry
            return entry

        return add

    def get(self, name: str) -> T:
        """The entry called `name`, or a one-line error listing the valid names."""
        try:
            return self._entries[name]
        except KeyError:
            valid = ", ".join(self.names())
            raise GradmeshError(f"unknown {self.kind} {name!r} (valid: {valid})") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
