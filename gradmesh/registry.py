"""Registries by name: strategies, models, datasets and algorithms register, the CLI reads them.

An unknown name is a `GradmeshError` that lists the valid ones, so every choice in gradmesh fails
the same clear way. Names are matched without regard to case (`--model ResNet50` is `resnet50`):
entries register in lower case, and `canonical` gives the registered spelling of a user's name.
Where a registry takes the user's own code (a model, a dataset, a loss), `pkg.module:attr` is
imported instead (`import_path`).
"""

import importlib
import operator
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar, cast

from gradmesh.errors import GradmeshError

T = TypeVar("T")


def canonical_name(value: str) -> str:
    """A user's name in the form gradmesh registers names: lower case. An import path
    (`pkg.module:factory`) keeps its case, since Python's module names have one."""
    return value if ":" in value else value.lower()


class Registry(Generic[T]):
    """A named table of entries of one kind (`kind` is used in error messages)."""

    def __init__(self, kind: str, loader: Callable[[], object] | None = None) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._loader = loader
        """Imports the modules whose entries register themselves, on the first lookup (so that
        importing the registry alone stays cheap)."""
        self.schemes: dict[str, Callable[[str], T]] = {}
        """Entries named `scheme:rest` made by a function of `rest` (the models' `hf:llama`),
        where a name with a colon is otherwise an import path."""

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

    def _load(self) -> None:
        loader, self._loader = self._loader, None
        if loader is not None:
            loader()

    def get(self, name: str) -> T:
        """The entry called `name`, or the object an import path `pkg.module:attr` names (the
        user's own), or a one-line error listing the valid names."""
        self._load()
        scheme = name.partition(":")[0]
        if ":" in name and scheme in self.schemes:
            return self.schemes[scheme](name.partition(":")[2])
        if ":" in name:
            return cast(T, import_path(name, self.kind))
        try:
            return self._entries[self.canonical(name)]
        except KeyError:
            valid = ", ".join(self.names())
            raise GradmeshError(f"unknown {self.kind} {name!r} (valid: {valid})") from None

    def canonical(self, name: str) -> str:
        """The registered spelling of `name` (matched without regard to case), or `name` itself
        when nothing matches (it may name something else, like an import path)."""
        self._load()
        return name.lower() if name.lower() in self._entries else name

    def names(self) -> list[str]:
        self._load()
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        self._load()
        return isinstance(name, str) and name.lower() in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def import_path(path: str, kind: str) -> Any:
    """The object `pkg.module:attr` names (`attr` may be dotted), imported with the working
    directory on the path (as `python -m` has it: a user's `my_model.py` beside them); or one
    line naming what failed to import."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise GradmeshError(f"{kind} {path!r}: expected an import path like pkg.module:factory")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - the user's module may raise anything on import
        why = (str(exc).splitlines() or [""])[0]
        raise GradmeshError(
            f"{kind} {path!r}: cannot import {module_name}: {type(exc).__name__}: {why}"
        ) from None
    try:
        return operator.attrgetter(attr)(module)
    except AttributeError:
        raise GradmeshError(f"{kind} {path!r}: module {module_name} has no {attr}") from None


def parse_kwargs(text: str, flag: str) -> dict[str, Any]:
    """'dim=64,depth=4,tie=false,name=x' -> {'dim': 64, 'depth': 4, 'tie': False, 'name': 'x'}:
    ints, floats and booleans by their look, the rest as text; one line for a bad item."""
    out: dict[str, Any] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, raw = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise GradmeshError(f"{flag} {text!r}: expected key=value items, got {item!r}")
        value: Any = raw.strip()
        if value.lower() in ("true", "false"):
            value = value.lower() == "true"
        else:
            for kind in (int, float):
                try:
                    value = kind(value)
                    break
                except ValueError:
                    continue
        out[key.strip()] = value
    return out


def lazy_attributes(
    package: str, where: dict[str, str] | None = None, search: tuple[str, ...] = ()
) -> Callable[[str], Any]:
    """A package's `__getattr__` that imports the module holding a name on first use: `where`
    maps names to their modules; a name not in it is looked up in the `__all__` of each
    module of `search`, in order (or a submodule of that name is returned). Lets a package
    offer names whose modules import torch while importing none itself, so that
    `gradmesh --help` and the one-line errors before launch stay fast."""
    import importlib

    def find(name: str) -> Any:
        if where and name in where:
            return getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        if name in search:
            return importlib.import_module(f"{package}.{name}")
        for module_name in search:
            module = importlib.import_module(f"{package}.{module_name}")
            if name in getattr(module, "__all__", ()):
                return getattr(module, name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return find
