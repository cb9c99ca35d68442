"""Profiles for the ``skyward`` command: where a pool comes from, from a file and from flags.

A profile is a table in ``skyward.toml`` (``[profile.NAME]``) or in ``pyproject.toml``
(``[tool.skyward.profile.NAME]``), looked up in the current directory; ``skyward.toml`` wins.
Its keys are the pool's (`POOL_KEYS`) and the provider's constructor arguments::

    [profile.default]
    provider = "ssh"                  # local (the default), ssh, aws
    hosts = ["10.0.0.1", "10.0.0.2"]  # sky.SSH(hosts=..., user=..., key=...)
    user = "ubuntu"
    nodes = 2
    processes_per_node = 2            # ranks a node (skyward run --nproc-per-node)
    plugins = ["jax"]
    env = { WANDB_MODE = "offline" }
    pip = ["optax", "datasets>=2"]    # the nodes' packages (see skyward.cli.packages)
    requirements = ["requirements.txt"]
    indexes = ["https://mirror.example/simple/"]

Flags override the file's keys; a flag naming another provider drops the file's provider
arguments.
"""

from __future__ import annotations

import inspect
import os
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skyward import checks
from skyward.errors import ConfigError
from skyward.providers import registry
from skyward.providers.base import Provider

POOL_KEYS = (
    "provider",
    "nodes",
    "processes_per_node",
    "accelerator",
    "plugins",
    "env",
    "workdir",
    "max_cost",
)
PACKAGE_KEYS = ("pip", "requirements", "indexes", "find_links")
PLUGINS = ("jax", "torch")


@dataclass
class Profile:
    """What ``skyward run`` launches: the provider and its arguments, and the pool's settings."""

    name: str = "default"
    provider: str = registry.DEFAULT
    options: dict[str, Any] = field(default_factory=dict)  # the provider's constructor arguments
    nodes: int | None = None
    # The ranks on each node (``--nproc-per-node``); None: one, or one per GPU with torch.
    processes_per_node: int | None = None
    accelerator: str | None = None
    plugins: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    max_cost: float | None = None  # the pool's budget in US dollars (`ComputePool(max_cost=)`)
    # The nodes' packages (`skyward.cli.packages.from_flags`): specs, requirements files, PEP
    # 503 indexes and find-links pages.
    pip: tuple[str, ...] = ()
    requirements: tuple[str, ...] = ()
    indexes: tuple[str, ...] = ()
    find_links: tuple[str, ...] = ()
    source: str = "flags"  # where it was read: a file's name, or "flags"

    def build_provider(self) -> Provider:
        """The provider object, e.g. ``sky.SSH(hosts=[...])``; a bad argument is a ConfigError."""
        cls = provider_class(self.provider)
        accepted = _arguments(cls)
        unknown = sorted(set(self.options) - set(accepted))
        if unknown:
            raise ConfigError(
                f"profile {self.name!r} ({self.source}): {', '.join(unknown)} is not an option of "
                f"provider {self.provider!r}; it takes {', '.join(accepted)}"
            )
        try:
            provider: Provider = cls(**self.options)
        except TypeError as exc:
            missing = [
                name
                for name, param in inspect.signature(cls.__init__).parameters.items()
                if param.default is inspect.Parameter.empty
                and param.kind is param.POSITIONAL_OR_KEYWORD
                and name not in ("self", *self.options)
            ]
            if missing:
                raise ConfigError(
                    f"provider {self.provider!r} needs {', '.join(missing)}: pass "
                    f"--{missing[0].replace('_', '-')} or set {missing[0]} in a profile "
                    "(see docs/cli.md)"
                ) from None
            raise ConfigError(f"provider {self.provider!r} ({self.source}): {exc}") from None
        return provider


def provider_class(name: str) -> type[Provider]:
    """The provider class for a known name (see `skyward.providers.registry`)."""
    return registry.provider_class(name)


def _arguments(cls: type[Provider]) -> list[str]:
    skip = {"self", "session"}
    return [p for p in inspect.signature(cls.__init__).parameters if p not in skip]


def profile_files(directory: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The profile tables found in `directory`: ``skyward.toml`` first, then pyproject's."""
    found = []
    for name, keys in (("skyward.toml", ()), ("pyproject.toml", ("tool", "skyward"))):
        path = directory / name
        if not path.is_file():
            continue
        try:
            table: Any = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path} cannot be read: {exc}") from None
        for key in keys:
            table = table.get(key, {}) if isinstance(table, dict) else {}
        profiles = table.get("profile", {}) if isinstance(table, dict) else {}
        if not isinstance(profiles, dict):
            raise ConfigError(f"{path}: 'profile' must be a table of [profile.NAME] tables")
        if profiles:
            found.append((path, profiles))
    return found


def load_profile(name: str | None, directory: Path | None = None) -> Profile:
    """Profile `name` (default: ``default``, or nothing when there is none) from the files in
    `directory` (the current one)."""
    files = profile_files(directory or Path.cwd())
    wanted = name or "default"
    for path, profiles in files:
        if wanted in profiles:
            # Said every time: a file in the current directory chooses the hosts skyward logs
            # into and what it sends them, and may not be the user's own (a cloned repository).
            print(f"skyward: profile {wanted!r} from {path.resolve()}", file=sys.stderr)
            return parse_profile(wanted, profiles[wanted], path.name)
    if name is not None:
        where = ", ".join(f"{p.name}: {', '.join(sorted(t)) or 'none'}" for p, t in files)
        raise ConfigError(
            f"no profile {name!r} in skyward.toml or pyproject.toml here"
            + (f" (found {where})" if where else "")
            + "; add a [profile.NAME] table or drop --profile"
        )
    return Profile()


def all_profiles(directory: Path | None = None) -> list[Profile]:
    """Every profile of the files in `directory` (the current one); ``skyward.toml`` first."""
    found: dict[str, Profile] = {}
    for path, profiles in profile_files(directory or Path.cwd()):
        for name, table in profiles.items():
            found.setdefault(name, parse_profile(name, table, path.name))
    return list(found.values())


def parse_profile(name: str, table: Any, source: str) -> Profile:
    """A `Profile` from one ``[profile.NAME]`` table."""
    where = f"profile {name!r} ({source})"
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table of keys")
    options = {k: v for k, v in table.items() if k not in (*POOL_KEYS, *PACKAGE_KEYS)}
    provider = table.get("provider", registry.DEFAULT)
    if not isinstance(provider, str):
        raise ConfigError(
            f'{where}: provider must be one name, e.g. provider = "NAME", got {provider!r}'
        )
    if provider not in registry.names():
        raise ConfigError(
            f"{where}: unknown provider {provider!r}; use {', '.join(registry.names())}"
        )
    nodes = table.get("nodes")
    if nodes is not None:
        checks.whole(nodes, f"{where}: nodes", minimum=1)
    ranks = table.get("processes_per_node")
    if ranks is not None:
        checks.whole(ranks, f"{where}: processes_per_node", minimum=1)
    accelerator = table.get("accelerator")
    if accelerator is not None:
        checks.text(accelerator, f"{where}: accelerator (e.g. 'A100:8')")
    plugins = table.get("plugins", [])
    if isinstance(plugins, str):
        plugins = [plugins]
    env = table.get("env", {})
    if not isinstance(env, dict):
        raise ConfigError(f'{where}: env must be a table, e.g. env = {{ KEY = "value" }}')
    workdir = table.get("workdir")
    if workdir is not None:
        checks.text(workdir, f"{where}: workdir")
    max_cost = table.get("max_cost")
    if max_cost is not None:
        max_cost = checks.dollars(max_cost, f"{where}: max_cost", zero=False)
    return Profile(
        name=name,
        provider=provider,
        options=options,
        nodes=nodes,
        processes_per_node=ranks,
        accelerator=accelerator,
        plugins=check_plugins(plugins, where),
        env={str(k): str(v) for k, v in env.items()},
        workdir=str(workdir) if workdir is not None else None,
        max_cost=float(max_cost) if max_cost is not None else None,
        source=source,
        pip=_strings(table, "pip", where),
        requirements=_strings(table, "requirements", where),
        indexes=_strings(table, "indexes", where),
        find_links=_strings(table, "find_links", where),
    )


def _strings(table: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    """The profile's list of strings under `key` (one string is a list of one)."""
    value = table.get(key, [])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: {key} must be a list of strings")
    return tuple(value)


def check_plugins(names: Any, where: str) -> tuple[str, ...]:
    """`names` as a tuple of known plugin names, or a ConfigError."""
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{where}: plugins must be a list of names such as ['jax']")
    unknown = [n for n in names if n not in PLUGINS]
    if unknown:
        raise ConfigError(f"{where}: unknown plugin {unknown[0]!r}; use {', '.join(PLUGINS)}")
    return tuple(dict.fromkeys(names))


def parse_env(pairs: list[str]) -> dict[str, str]:
    """``["K=V", "NAME", ...]`` as a dict. A bare ``NAME`` takes this process's value (as
    ``docker run -e NAME`` does): a secret then never sits on the command line, where any user
    of this machine reads it with ``ps``. A bare name that is not set is a ConfigError."""
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not key:
            raise ConfigError(f"--env takes KEY=VALUE or KEY, got {pair!r}")
        if not sep:
            if key not in os.environ:
                raise ConfigError(
                    f"--env {key}: {key} is not set in this shell; export it first, or give "
                    f"--env {key}=VALUE"
                )
            value = os.environ[key]
        env[key] = value
    return env


def with_flags(profile: Profile, flags: Mapping[str, Any]) -> Profile:
    """`profile` with the flags that were given (not None) on top; a flag naming another
    provider than the profile's drops the profile's provider arguments."""
    options = dict(profile.options)
    provider = flags.get("provider") or profile.provider
    if provider != profile.provider:
        options = {}
    for key, value in flags.get("options", {}).items():
        if value is not None:
            options[key] = value
    return Profile(
        name=profile.name,
        provider=provider,
        options=options,
        nodes=flags.get("nodes") or profile.nodes,
        processes_per_node=flags.get("processes_per_node") or profile.processes_per_node,
        accelerator=flags.get("accelerator") or profile.accelerator,
        plugins=tuple(dict.fromkeys([*profile.plugins, *flags.get("plugins", ())])),
        env={**profile.env, **flags.get("env", {})},
        workdir=flags.get("workdir") or profile.workdir,
        max_cost=profile.max_cost if flags.get("max_cost") is None else flags["max_cost"],
        source=profile.source,
        pip=_joined(profile.pip, flags.get("pip", ())),
        requirements=_joined(profile.requirements, flags.get("requirements", ())),
        indexes=_joined(profile.indexes, flags.get("indexes", ())),
        find_links=_joined(profile.find_links, flags.get("find_links", ())),
    )


def _joined(mine: tuple[str, ...], flags: Any) -> tuple[str, ...]:
    """A profile's list with the flags' after it, each once."""
    return tuple(dict.fromkeys([*mine, *flags]))
