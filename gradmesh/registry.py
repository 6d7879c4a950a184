"""Registries by name: strategies, models, datasets and algorithms register, the CLI reads them.

An unknown name is a `GradmeshError` that lists the valid ones, so every choice in gradmesh fails
the same clear way. Names are matched without regard to case (`--model ResNet50` is `resnet50`):
entries register in lower case, and `canonical` gives the registered spelling of a user's name.
"""

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from gradmesh.errors import GradmeshError

T = TypeVar("T")


def canonical_name(value: str) -> str:
    """A user's name in the form gradmesh registers names: lower case. An import path
    (`pkg.module:factory`) keeps its case, since Python's module names have one."""
    return value if ":" in value else value.lower()


class Registry(Generic[T]):
    """A named table of entries of one kind (`kind` is used in error messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: `@REGISTRY.register("name")` adds the decorated object under `name`."""

        if name != name.lower():
            raise ValueError(f"{self.kind} {name!r}: register names in lower case")

        def add(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = entry
            return entry

        return add

    def get(self, name: str) -> T:
        """The entry called `name`, or a one-line error listing the valid names."""
        try:
            return self._entries[self.canonical(name)]
        except KeyError:
            valid = ", ".join(self.names())
            raise GradmeshError(f"unknown {self.kind} {name!r} (valid: {valid})") from None

    def canonical(self, name: str) -> str:
        """The registered spelling of `name` (matched without regard to case), or `name` itself
        when nothing matches (it may name something else, like an import path)."""
        return name.lower() if name.lower() in self._entries else name

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
