"""The providers skyward knows by name: its own and those registered from outside.

A provider is known by a `ProviderEntry`: its name (what ``sky.ComputePool``'s profiles, a
profile's ``provider =`` and ``skyward run/ls/down --provider`` take), where its class is
(imported only when used, so a provider whose extra is not installed costs nothing until it is
asked for), the extra it needs and the command-line options it takes (`Option`).

Each of skyward's providers is a folder under ``skyward/providers/`` with an ``entry`` module
holding its ``ENTRY``: the registry finds them by folder, so adding one edits no shared file.
A provider living outside skyward registers with `register`, or through the
``skyward.providers`` entry point group, whose entries load to a `ProviderEntry`::

    [project.entry-points."skyward.providers"]
    k8s = "mypackage.skyward_entry:ENTRY"

An entry point that cannot be loaded (its module fails to import, or names something other
than a `ProviderEntry`) is left out with one warning per process naming its distribution and
the error, so one broken package never stops ``skyward`` or another provider; an entry point
claiming one of skyward's own names is left out the same way (skyward's own always wins).

What a provider can do beyond running a pool (list and clean up what pools left, say which of
this user's pools are alive) are methods of its class, asked for by its `Capability`
(`skyward.providers.base`). An unknown name is a `ConfigError` that lists the known ones.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import pkgutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from skyward.errors import ConfigError
from skyward.providers.base import Provider

ENTRY_POINT_GROUP = "skyward.providers"

DEFAULT = "local"
"""The provider a profile or ``skyward run`` uses when none is named: the embedded one."""

# How a flag's text becomes the provider's argument: as it is, a comma-separated list, or
# True when the flag is given (a switch).
OptionKind = Literal["text", "list", "switch"]


@dataclass(frozen=True)
class Option:
    """One command-line flag of a provider: ``--region`` giving ``region=`` to its class.

    `run`: ``skyward run`` takes it (and a profile's key of the same name sets it); `listing`:
    ``skyward ls`` and ``down`` take it too, to say where to look (a region, a project). Two
    providers may declare one flag (``--zone``): the command line shows it once."""

    flag: str
    key: str
    help: str
    kind: OptionKind = "text"
    run: bool = True
    listing: bool = False

    def value(self, given: Any) -> Any:
        """The provider's argument for what the command line parsed (None: not given)."""
        if given is None or given is False:
            return None
        if self.kind == "switch":
            return True
        if self.kind == "list":
            return [part.strip() for part in str(given).split(",") if part.strip()]
        return given


@dataclass(frozen=True)
class ProviderEntry:
    """One provider as the command line and profiles know it.

    `module` and `attr` name its class (``skyward.providers.aws.provider``, ``AWS``), imported
    when the provider is used; `extra` is the skyward extra its dependencies come with (None:
    none); `options` are its command-line flags; `position` orders the command line's list of
    providers (skyward's own are 0-40, so the embedded default comes first)."""

    name: str
    module: str
    attr: str
    extra: str | None = None
    options: tuple[Option, ...] = ()
    position: int = 100

    def load(self) -> type[Provider]:
        """The provider class; a missing dependency is a `ConfigError` naming the extra."""
        try:
            cls: type[Provider] = getattr(importlib.import_module(self.module), self.attr)
        except ImportError as exc:
            raise ConfigError(f"provider {self.name!r} {self.missing(exc)}") from None
        return cls

    def missing(self, exc: ImportError) -> str:
        """Words for a dependency of this provider that is not installed."""
        install = f"pip install 'skyward[{self.extra}]'" if self.extra else "install it"
        return f"needs a package that is not installed: {install} ({exc})"

    def arguments(self, parsed: Mapping[str, Any], listing: bool = False) -> dict[str, Any]:
        """The class's keyword arguments from parsed flags (by `Option.key`): those of
        ``skyward run``, or with `listing` those of ``skyward ls``/``down``; flags not given are
        left out, so the class's (or the profile's) own defaults hold."""
        chosen = [o for o in self.options if (o.listing if listing else o.run)]
        found = {o.key: o.value(parsed.get(o.key)) for o in chosen}
        return {key: value for key, value in found.items() if value is not None}


_registered: dict[str, ProviderEntry] = {}


def register(entry: ProviderEntry) -> None:
    """Make `entry` known by its name (a later registration of the same name replaces it)."""
    _registered[entry.name] = entry


def unregister(name: str) -> None:
    """Forget a provider registered with `register` (one of skyward's own stays)."""
    _registered.pop(name, None)


@functools.cache
def _own() -> tuple[ProviderEntry, ...]:
    """skyward's own providers: every folder under ``skyward/providers`` with an ``entry``
    module (in name order)."""
    package = importlib.import_module("skyward.providers")
    found = []
    for module in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        name = f"skyward.providers.{module.name}.entry"
        if module.ispkg and importlib.util.find_spec(name) is not None:
            found.append(_checked(importlib.import_module(name).ENTRY, name))
    return tuple(found)


def own_entries() -> tuple[ProviderEntry, ...]:
    """skyward's own providers (the root exports their classes: ``sky.AWS``)."""
    return _own()


def _from_entry_points() -> list[ProviderEntry]:
    """The entries other packages declare, less those that cannot be loaded and those that
    claim one of skyward's own names (each warned about, once)."""
    own = {entry.name for entry in _own()}
    found = []
    for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = point.dist.name if point.dist is not None else "an unknown distribution"
        where = f"entry point {point.name!r} ({point.value}) of {dist!r}"
        loaded = _load(point.name, point.value, point.group)
        if isinstance(loaded, str):
            _warn_once(f"skyward: {where} is left out: {loaded}")
        elif loaded.name in own:
            _warn_once(
                f"skyward: {where} names its provider {loaded.name!r}, the name of one of "
                f"skyward's own: skyward's own {loaded.name!r} is used and this one is left "
                "out (rename it in that package's entry point)"
            )
        else:
            found.append(loaded)
    return found


@functools.cache
def _load(name: str, value: str, group: str) -> ProviderEntry | str:
    """The entry an entry point names, or why it cannot be had. Kept for the process: a
    module that failed to import is not run again on every lookup."""
    try:
        loaded = importlib.metadata.EntryPoint(name, value, group).load()
    except Exception as exc:  # any error of a third party's module: see the module docstring
        return f"{type(exc).__name__}: {exc}"
    if not isinstance(loaded, ProviderEntry):
        return f"it names {loaded!r}, not a skyward.providers.registry.ProviderEntry"
    return loaded


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)


def _checked(entry: Any, where: str) -> ProviderEntry:
    if not isinstance(entry, ProviderEntry):
        raise ConfigError(
            f"{where} of group {ENTRY_POINT_GROUP!r} must be a "
            f"skyward.providers.registry.ProviderEntry, got {entry!r}"
        )
    return entry


def entries() -> dict[str, ProviderEntry]:
    """Every known provider by name: skyward's own, then entry points (never in place of one
    of skyward's own), then `register`ed (a later one of the same name replaces an earlier
    one)."""
    known = {entry.name: entry for entry in sorted(_own(), key=lambda e: e.position)}
    for entry in [*_from_entry_points(), *_registered.values()]:
        known[entry.name] = entry
    return known


def names() -> list[str]:
    """The known providers' names."""
    return list(entries())


def entry(name: str) -> ProviderEntry:
    """The provider called `name`, or a `ConfigError` listing the known ones."""
    known = entries()
    if name not in known:
        raise ConfigError(f"unknown provider {name!r}; use one of {', '.join(known)}")
    return known[name]


def provider_class(name: str) -> type[Provider]:
    """The class of the provider called `name` (see `entry`)."""
    return entry(name).load()
