"""Verified SSH connections to a pool's hosts, all at once; shared by every SSH-reached provider.

- `ConnectOptions`: how to log in (trusted host keys, login key, ssh_config, timeouts);
- `connect_all`: one verified connection per host, concurrently; a host that fails closes the
  others and fails the whole launch. With a `BootWait`, each host is retried until a deadline
  (an instance that is still booting: sshd down, or still offering the image's own host key).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import asyncssh

from skyward import checks
from skyward.errors import ConfigError, ProvisionError
from skyward.transport.sshhost import (
    Endpoint,
    KnownHosts,
    SSHConnectError,
    SSHHost,
    connect,
    load_known_hosts,
)


@dataclass(frozen=True)
class ConnectOptions:
    """How to log into a pool's hosts: trusted host keys, login key, ssh_config, timeouts."""

    known_hosts: asyncssh.SSHKnownHosts | tuple[()]
    key: str | None = None
    config: Sequence[str] = ()  # () reads ~/.ssh/config; [] reads no config at all
    timeout: float = 10.0
    keepalive: float = 15.0

    async def connect(self, endpoint: Endpoint, timeout: float | None = None) -> SSHHost:
        return await connect(
            endpoint,
            known_hosts=self.known_hosts,
            key=self.key,
            config=self.config,
            timeout=self.timeout if timeout is None else timeout,
            keepalive=self.keepalive,
        )


def login_options(
    key: str | os.PathLike[str] | None,
    known_hosts: KnownHosts,
    config: Sequence[str] | None,
    timeout: float,
    keepalive: float = 15.0,
) -> ConnectOptions:
    """`ConnectOptions` from a provider's arguments: the key file checked to exist, the known
    hosts loaded, ``config=None`` for ~/.ssh/config."""
    timeout = checks.seconds(timeout, "connect_timeout")
    keepalive = checks.seconds(keepalive, "keepalive")
    if config is not None:
        checks.texts(config, "config")
    key_file: str | None = None
    if key is not None:
        if not isinstance(key, str | os.PathLike) or not os.fspath(key):
            raise ConfigError(f"key must be the path of a private key file, got {key!r}")
        path = Path(key).expanduser()
        if not path.is_file():
            raise ConfigError(f"SSH key file {str(path)!r} does not exist")
        key_file = str(path)
    return ConnectOptions(
        known_hosts=load_known_hosts(known_hosts),
        key=key_file,
        config=tuple(config) if config is not None else (),
        timeout=timeout,
        keepalive=keepalive,
    )


@dataclass(frozen=True)
class BootWait:
    """Retry a host that refuses the verified login until `deadline` (the loop's clock): a
    machine that is still booting. `budget` names the deadline in the error."""

    deadline: float
    poll: float
    budget: str


async def connect_host(
    endpoint: Endpoint, options: ConnectOptions, wait: BootWait | None = None, label: str = ""
) -> SSHHost:
    """One verified connection; with `wait`, retried until its deadline, never trusting more."""
    if wait is None:
        return await options.connect(endpoint)
    loop = asyncio.get_running_loop()
    while True:
        timeout = max(1.0, min(options.timeout, wait.deadline - loop.time()))
        try:
            return await options.connect(endpoint, timeout)
        except SSHConnectError as exc:
            # While the machine boots, sshd is down, still offers the image's own host key
            # (rejected: only ours is trusted) or has no authorized key yet. Wait, never trust.
            if loop.time() + wait.poll > wait.deadline:
                raise ProvisionError(
                    f"{label or endpoint} did not accept the verified SSH login within "
                    f"{wait.budget}; last error: {exc}"
                ) from None
            await asyncio.sleep(wait.poll)


async def connect_all(
    endpoints: Sequence[Endpoint],
    options: ConnectOptions,
    wait: BootWait | None = None,
    labels: Sequence[str] = (),
) -> list[SSHHost]:
    """Connect to every host at once; all of them, or close those that connected and raise."""
    names = list(labels) or [""] * len(endpoints)
    results = await asyncio.gather(
        *(connect_host(e, options, wait, n) for e, n in zip(endpoints, names, strict=True)),
        return_exceptions=True,
    )
    hosts = [r for r in results if isinstance(r, SSHHost)]
    failures = [r for r in results if isinstance(r, BaseException)]
    if not failures:
        return hosts
    await asyncio.gather(*(h.close() for h in hosts), return_exceptions=True)
    for failure in failures:
        if not isinstance(failure, Exception):
            raise failure  # cancellation, KeyboardInterrupt: not ours to reword
    first = failures[0]
    if len(failures) == 1 and isinstance(first, ProvisionError):
        raise first
    raise ProvisionError(
        f"{len(failures)} of {len(endpoints)} SSH host(s) could not be reached:\n"
        + "\n".join(f"  {f}" for f in failures)
    ) from first
