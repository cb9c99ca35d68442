"""The providers skyward knows by name: the built-in ones and those registered from outside.

A provider is known by a `ProviderEntry`: its name (what a profile's ``provider =`` and
``skyward run --provider`` take), where its class is (imported only when used, so a provider
whose extra is not installed costs nothing until it is asked for) and the extra it needs.
A provider living outside skyward registers with `register`, or through the
``skyward.providers`` entry point group, whose entries load to a `ProviderEntry`::

    [project.entry-points."skyward.providers"]
    k8s = "mypackage.skyward_entry:ENTRY"

An unknown name is a `ConfigError` that lists the known ones.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass

from skyward.errors import ConfigError
from skyward.providers.base import Provider

ENTRY_POINT_GROUP = "skyward.providers"


@dataclass(frozen=True)
class ProviderEntry:
    """One provider as the command line and profiles know it.

    `module` and `attr` name its class (``skyward.providers.aws``, ``AWS``), imported when the
    provider is used; `extra` is the skyward extra its dependencies come with (None: none)."""

    name: str
    module: str
    attr: str
    extra: str | None = None

    def load(self) -> type[Provider]:
        """The provider class; a missing dependency is a `ConfigError` naming the extra."""
        try:
            cls: type[Provider] = getattr(importlib.import_module(self.module), self.attr)
        except ImportError as exc:
            install = f"pip install 'skyward[{self.extra}]'" if self.extra else "install it"
            raise ConfigError(
                f"provider {self.name!r} needs a package that is not installed: {install} ({exc})"
            ) from None
        return cls


# The built-in providers, in the order the command line lists them.
_BUILT_IN = (
    ProviderEntry("local", "skyward.providers.local", "Local"),
    ProviderEntry("ssh", "skyward.providers.ssh", "SSH", "ssh"),
    ProviderEntry("aws", "skyward.providers.aws", "AWS", "aws"),
    ProviderEntry("gcp", "skyward.providers.gcp", "GCP", "gcp"),
    ProviderEntry("slurm", "skyward.providers.slurm.provider", "Slurm", "slurm"),
)

_registered: dict[str, ProviderEntry] = {}


def register(entry: ProviderEntry) -> None:
    """Make `entry` known by its name (a later registration of the same name replaces it)."""
    _registered[entry.name] = entry


def unregister(name: str) -> None:
    """Forget a provider registered with `register` (a built-in one stays)."""
    _registered.pop(name, None)


def _from_entry_points() -> list[ProviderEntry]:
    found = []
    for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        entry = point.load()
        if not isinstance(entry, ProviderEntry):
            raise ConfigError(
                f"entry point {point.name!r} of group {ENTRY_POINT_GROUP!r} ({point.value}) "
                f"must be a skyward.providers.registry.ProviderEntry, got {entry!r}"
            )
        found.append(entry)
    return found


def entries() -> dict[str, ProviderEntry]:
    """Every known provider by name: built-in, then entry points, then `register`ed."""
    known = {entry.name: entry for entry in _BUILT_IN}
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
