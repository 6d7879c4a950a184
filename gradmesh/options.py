"""Typed options: each component owns a dataclass of its options, one field per option with its
default and its help text; a command's config composes the components it uses. The CLI's flags,
a TOML file and the JSON a launcher hands its workers all fill those dataclasses through this
module, so an option's default lives in one place and two commands cannot disagree on it.

Written here rather than taken from jsonargparse or tyro: both derive flag names from the nesting
(`--sync.ps.servers`), and gradmesh's flags (`--servers`, `-np`) are documented and scripted
by users; a field names its flag here when the flag is not the field's own name.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tomllib
import types
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from gradmesh.errors import GradmeshError
from gradmesh.registry import canonical_name

T = TypeVar("T")


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    name: bool = False,
    choices: Sequence[str] = (),
    deprecated: Sequence[str] = (),
    positional: bool = False,
    at_least: float | None = None,
) -> Any:
    """A field holding one option: its default and help text. `flag`: its command-line flag when
    that is not `--field-name`; `name`: a name (of a registry's entries, say), matched without
    regard to case; `choices`: the names it may be (checked here; a registry checks its own);
    `deprecated`: former flags that still work, with a warning; `at_least`: the smallest value
    a number may be given (a count's 1, a warm-up's 0), checked where every value is converted."""
    metadata = {
        "help": help,
        "flag": flag,
        "name": name or bool(choices),
        "choices": tuple(choices),
        "deprecated": tuple(deprecated),
        "positional": positional,
        "at_least": at_least,
    }
    return field(default=default, metadata=metadata)


def component(
    cls: type, only: Sequence[str] | None = None, former: Mapping[str, str] | None = None
) -> Any:
    """A field holding a component's own options (a dataclass); `only`: the options of it this
    command offers (the others keep their defaults); `former`: an option's flag in this command
    before it came from the component (`{"algorithm": "--algorithm"}`), still accepted with a
    warning."""
    metadata = {"component": True, "only": only, "former": dict(former or {})}
    return field(default_factory=cls, metadata=metadata)


@dataclass(frozen=True)
class Option:
    """One option of a command: where it sits in the config, and its flag."""

    path: tuple[str, ...]
    owner: type
    field: dataclasses.Field[Any]
    former: tuple[str, ...] = ()
    """Flags this option had in this command before, still accepted with a warning."""

    @property
    def flag(self) -> str:
        given: str | None = self.field.metadata.get("flag")
        return given or "--" + self.field.name.replace("_", "-")

    @property
    def key(self) -> str:
        """The option's name in a flat TOML table: its flag without dashes."""
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def dest(self) -> str:
        return ".".join(self.path)


def options_of(
    cls: type,
    path: tuple[str, ...] = (),
    only: Sequence[str] | None = None,
    former: Mapping[str, str] | None = None,
) -> list[Option]:
    """Every option of `cls`, its components' included (as far as they offer them)."""
    found = []
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        meta = f.metadata
        if meta.get("component"):
            inner = field_type(cls, f.name)[0]
            found += options_of(inner, (*path, f.name), meta["only"], meta["former"])
        elif "help" in meta:
            old = (former or {}).get(f.name)
            found.append(Option((*path, f.name), cls, f, (old,) if old else ()))
    return found


def field_type(cls: type, name: str) -> tuple[type, bool]:
    """(the field's type, whether None is allowed), from its annotation: `str | None` -> str."""
    hint = typing.get_type_hints(cls)[name]
    if isinstance(hint, types.UnionType):
        args = typing.get_args(hint)
        return next(a for a in args if a is not type(None)), type(None) in args
    return typing.cast(type, hint), False


KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def of_kind(value: Any, kind: type) -> bool:
    """Whether a parsed value (a TOML or JSON one, a `--model-args` item) is of `kind`: a bool
    is no integer, and an integer is a number."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return True
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def convert(opt: Option, value: Any, source: str | None) -> Any:
    """`value` checked against the option's type: the one conversion every flag, TOML key and
    JSON key goes through. `source` names the file; None means a flag, whose value is text."""
    kind, optional = field_type(opt.owner, opt.field.name)
    if value is None and optional:
        return None
    where = opt.flag if source is None else f"{source}: {opt.key}"
    least = opt.field.metadata.get("at_least")
    if source is None and isinstance(value, str) and kind in (int, float):
        try:
            return _in_range(kind(value), where, least)
        except ValueError:
            pass
    elif of_kind(value, kind):
        if isinstance(value, str) and opt.field.metadata.get("name"):
            return check_choice(opt, canonical_name(value))
        return _in_range(kind(value), where, least) if kind in (int, float) else value
    shown = json.dumps(value) if not isinstance(value, str) else repr(value)
    raise GradmeshError(f"{where} must be {KIND_NAMES[kind]}, got {shown}")


def _in_range(value: Any, where: str, least: float | None) -> Any:
    """`value`, refused when it is a float NaN or infinity (no option means anything by them,
    and every range check, `lr <= 0`, lets a NaN through) or under the option's `at_least`."""
    if isinstance(value, float) and not math.isfinite(value):
        raise GradmeshError(f"{where} must be a finite number, got {value}")
    if least is not None and value < least:
        shown = int(least) if float(least).is_integer() else least
        raise GradmeshError(f"{where} must be >= {shown}, got {value}")
    return value


def check_choice(opt: Option, value: str) -> str:
    """`value`, or one line listing the valid ones when the option has a fixed set."""
    valid = opt.field.metadata.get("choices")
    if valid and value not in valid:
        raise GradmeshError(f"unknown {opt.flag} {value!r} (valid: {', '.join(valid)})")
    return value


def check_choices(config: Any) -> None:
    """Every option of `config` with a fixed set of names holds one of them (for configs built
    in code, which no flag or file checked)."""
    for opt in options_of(type(config)):
        value = values_by_key(config)[opt.key]
        if isinstance(value, str) and opt.field.metadata.get("choices"):
            check_choice(opt, value)


def with_value(config: T, path: Sequence[str], value: Any) -> T:
    """`config` with the option at `path` set to `value` (components copied, never shared)."""
    head, *rest = path
    inner = with_value(getattr(config, head), rest, value) if rest else value
    return dataclasses.replace(config, **{head: inner})  # type: ignore[type-var]


class _Deprecated(argparse.Action):
    """Stores the value like the flag it stands for, and says once that the flag is old."""

    def __call__(self, parser: Any, ns: Any, values: Any, option_string: str | None = None) -> None:
        new = self.metadata_flag  # type: ignore[attr-defined]
        print(f"gradmesh: {option_string} is deprecated, use {new}", file=sys.stderr)
        setattr(ns, self.dest, True if self.nargs == 0 else values)


def add_flags(parser: argparse.ArgumentParser, cls: type, title: str | None = None) -> None:
    """One flag per option of `cls`, grouped in the help by the component that owns it; a flag's
    help shows its default. Values are None unless given (`from_flags` applies them)."""
    groups: dict[type, Any] = {}
    for opt in options_of(cls):
        if opt.owner not in groups:
            doc = (opt.owner.__doc__ or "").strip().split("\n")[0]
            groups[opt.owner] = parser.add_argument_group(title if opt.owner is cls else None, doc)
        _add_flag(groups[opt.owner], opt)


def _add_flag(group: Any, opt: Option) -> None:
    meta, default = opt.field.metadata, opt.field.default
    boolean = field_type(opt.owner, opt.field.name)[0] is bool
    shown = "" if default in ("", None, False) else f" (default: {default})"
    if meta["positional"]:
        group.add_argument(opt.dest, metavar=opt.field.name, help=meta["help"])
        return
    kwargs: dict[str, Any] = {"dest": opt.dest, "default": None, "help": meta["help"] + shown}
    if not boolean:
        kwargs["metavar"] = opt.field.name.upper()
    if boolean:
        kwargs["action"] = "store_true"
    group.add_argument(opt.flag, **kwargs)
    for old in (*meta["deprecated"], *opt.former):
        action = group.add_argument(
            old,
            dest=opt.dest,
            default=None,
            action=_Deprecated,
            nargs=0 if boolean else None,
            help=argparse.SUPPRESS,
        )
        action.metadata_flag = opt.flag


def from_flags(cls: type[T], namespace: argparse.Namespace, base: T | None = None) -> T:
    """`base` (the defaults when None) with every flag that was given."""
    config = base if base is not None else cls()
    for opt in options_of(cls):
        raw = getattr(namespace, opt.dest, None)
        if raw is not None:
            config = with_value(config, opt.path, convert(opt, raw, None))
    return config


def from_mapping(cls: type[T], values: Mapping[str, Any], source: str, base: T | None = None) -> T:
    """`base` (the defaults when None) with `values`: nested tables by component, or flat keys
    named as the flags are (`servers = 2`); each checked against its type. An unknown key is one
    line naming it."""
    config = base if base is not None else cls()
    by_key = {opt.key: opt for opt in options_of(cls)}
    by_path = {opt.path: opt for opt in options_of(cls)}
    unknown = []
    for path, value in _leaves(values):
        opt = by_path.get(path) or (by_key.get(path[0]) if len(path) == 1 else None)
        if opt is None:
            unknown.append(".".join(path))
        else:
            config = with_value(config, opt.path, convert(opt, value, source))
    if unknown:
        raise GradmeshError(f"{source}: unknown option(s) {', '.join(sorted(unknown))}")
    return config


def _leaves(
    values: Mapping[str, Any], path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], Any]]:
    for key, value in values.items():
        if isinstance(value, Mapping):
            yield from _leaves(value, (*path, key))
        else:
            yield (*path, key), value


def from_toml(cls: type[T], path: str, table: str, base: T | None = None) -> T:
    """The `[table]` of a TOML file (or the whole file when it has no such table) on `base`."""
    try:
        values = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise GradmeshError(f"cannot read config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise GradmeshError(f"cannot read config {path}: {exc}") from None
    for part in table.split("."):
        values = values.get(part, values) if isinstance(values, dict) else values
    if not isinstance(values, dict):
        raise GradmeshError(f"{path}: [{table}] must be a table")
    return from_mapping(cls, values, path, base)


def values_by_key(config: Any) -> dict[str, Any]:
    """Every option of `config` by its flat key (its flag's name): `{"servers": 1, ...}`."""
    out = {}
    for opt in options_of(type(config)):
        value: Any = config
        for part in opt.path:
            value = getattr(value, part)
        out[opt.key] = value
    return out


def given(config: Any, dests: Iterable[str]) -> list[Option]:
    """The options among `dests` (dotted paths in `config`) whose value is not their default."""
    wanted, default = set(dests), type(config)()
    now, then = values_by_key(config), values_by_key(default)
    return [o for o in options_of(type(config)) if o.dest in wanted and now[o.key] != then[o.key]]


def refuse_unread(config: Any, dests: Iterable[str], why: str) -> None:
    """One line naming the options among `dests` given a value other than their default, and
    `why` this run does not read them: an option is refused, never silently dropped."""
    flags = [o.flag for o in given(config, dests)]
    if flags:
        raise GradmeshError(f"{', '.join(flags)}: {why}")


def refuse_others(
    config: Any,
    owners: Mapping[str, Sequence[str]],
    chosen: Sequence[str],
    reads: Iterable[str],
    how: str,
) -> None:
    """The options of `owners` (a strategy's name -> the options only it reads) that this run,
    `how`, does not read (all but `reads`): one line naming them and, where they are not the
    `chosen` strategies' own, the strategies whose they are."""
    unread = {d for ds in owners.values() for d in ds} - set(reads)
    names = sorted({k for o in given(config, unread) for k, ds in owners.items() if o.dest in ds})
    whose = f" (options of --strategy {' or '.join(names)})" if set(names) - set(chosen) else ""
    refuse_unread(config, unread, f"not read by {how}{whose}")


def option_named(cls: type, key: str) -> Option:
    """The option of `cls` whose flat key (its flag's name) is `key`."""
    for opt in options_of(cls):
        if opt.key == key:
            return opt
    raise KeyError(key)


def to_mapping(config: Any) -> dict[str, Any]:
    """A config as nested plain values (for JSON), `from_mapping`'s inverse."""
    return dataclasses.asdict(config)
