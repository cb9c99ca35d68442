"""Fixtures for hosts that look like fresh cloud VMs (see `tests.support.bareroots`).

Each host is a network namespace whose only route is its bridge's subnet, running sshd chrooted
into a fresh overlay copy of a debootstrapped Debian root: the distribution's python3 (3.11 on
bookworm, 3.13 on trixie) without venv or pip, and nothing else of this machine. The only thing
the hosts reach is a `PackageIndex` the test serves on the bridge address (`bare_index`).

Everything skips with a reason when not root, without network namespaces, or when the root or
the wheels cannot be fetched (no network). A cold root build takes about 40 s per suite, once
per machine (cached in /var/cache/skyward-tests); starting hosts then takes a fraction of a
second, so host fixtures are per test: every test starts from a clean root.

Subnets: bookworm hosts 10.213.12.0/24, trixie hosts 10.213.13.0/24. Only one live set of hosts
per subnet (two would answer for each other): `make_bare_hosts` raises when a test asks for a
second one on the same subnet while the first is alive (close it first, or pass `subnet=`).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import skyward as sky
from tests.support import bareroots, sshd

SUBNETS = {"bookworm": "10.213.12.0/24", "trixie": "10.213.13.0/24"}
WHEELS = ("numpy", "cloudpickle", "packaging", f"uv=={bareroots.client_uv_version()}")
"""What the hosts' environments need from the index (uv: the client's own version)."""


@pytest.fixture(scope="session")
def bare_ready() -> None:
    if not sshd.is_root():
        pytest.skip("bare hosts need root (namespaces, mounts, chroot)")
    reason = sshd.netns_unavailable_reason()
    if reason:
        pytest.skip(reason)
    for tool in ("ssh", "ssh-keygen", "unshare", "chroot", "mount"):
        if shutil.which(tool) is None:
            pytest.skip(f"`{tool}` is not installed")
    bareroots.remove_stale_bare_resources()  # only what crashed runs (dead owners) left


@pytest.fixture(autouse=True)
def _functions_by_value(request: pytest.FixtureRequest) -> None:
    # The hosts cannot import the test modules: ship their functions' code with them.
    if request.module is not None:
        cloudpickle.register_pickle_by_value(request.module)


@pytest.fixture(scope="session")
def bare_keys(bare_ready: None, tmp_path_factory: pytest.TempPathFactory) -> sshd.KeyPair:
    """The client's key; root on every bare host accepts it."""
    return sshd.KeyPair.generate(tmp_path_factory.mktemp("bare-keys"))


def _root(suite: str) -> Path:
    try:
        return bareroots.cached_root(suite)
    except Exception as exc:  # no network, no debootstrap: skip, do not fail
        pytest.skip(f"cannot build a Debian {suite} root: {exc}")


@pytest.fixture(scope="session")
def bookworm_root(bare_ready: None) -> Path:
    """Cached debootstrapped Debian 12 root (python3 3.11); never write into it."""
    return _root("bookworm")


@pytest.fixture(scope="session")
def trixie_root(bare_ready: None) -> Path:
    """Cached debootstrapped Debian 13 root (python3 3.13); never write into it."""
    return _root("trixie")


@pytest.fixture(scope="session")
def bare_wheels(bare_ready: None) -> Path:
    """Read-only dir of wheels for bookworm's Python 3.11: numpy, cloudpickle, packaging, uv."""
    try:
        return bareroots.download_wheels(None, WHEELS, python_version="3.11")
    except Exception as exc:  # no network: skip, do not fail
        pytest.skip(f"cannot download wheels: {exc}")


@dataclass
class Bare:
    """A live set of bare hosts with what a client needs to log in as root."""

    net: bareroots.BareHosts
    key: sshd.KeyPair
    known_hosts: Path

    @property
    def hosts(self) -> list[bareroots.BareHost]:
        return self.net.hosts

    @property
    def addresses(self) -> list[str]:
        return self.net.addresses

    def ssh_provider(self, count: int | None = None, **kwargs: Any) -> sky.SSH:
        """`sky.SSH` on the first `count` hosts (all by default), logging in as root."""
        hosts = self.net.addresses[: count or len(self.net)]
        # The hosts reach nothing but the test's index: a fetch that fails fails for good, and
        # uv's retries of it would only add seconds to the tests that expect it to.
        build_env = {"UV_HTTP_RETRIES": "0", **kwargs.pop("build_env", {})}
        return sky.SSH(
            hosts,
            user="root",
            key=str(self.key.private_path),
            known_hosts=str(self.known_hosts),
            build_env=build_env,
            **kwargs,
        )

    def ssh(
        self, index: int, command: str, *, check: bool = False, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run a shell command on host `index` over real ssh, as root."""
        argv = self.net[index].ssh_command(self.key, self.known_hosts, command)
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"ssh {self.net[index].name} {command!r} exited {proc.returncode}:\n"
                f"{proc.stdout}\n{proc.stderr}"
            )
        return proc


MakeBareHosts = Callable[..., Bare]


@pytest.fixture
def make_bare_hosts(
    request: pytest.FixtureRequest, bare_keys: sshd.KeyPair, tmp_path: Path
) -> Iterator[MakeBareHosts]:
    """Factory: `make_bare_hosts(count=1, suite="bookworm", subnet=None, **BareHosts kwargs)`.

    Each call starts a fresh set (clean overlay); all are closed at the end of the test, or
    earlier with `bare.net.close()`. The subnet defaults to the suite's (see `SUBNETS`).
    """
    made: list[bareroots.BareHosts] = []

    def make(
        count: int = 1, suite: str = "bookworm", subnet: str | None = None, **kwargs: Any
    ) -> Bare:
        root = request.getfixturevalue(f"{suite}_root") if suite in SUBNETS else None
        net = bareroots.BareHosts(
            count,
            suite=suite,
            subnet=subnet or SUBNETS.get(suite, SUBNETS["bookworm"]),
            authorized_keys=[bare_keys],
            root=root,
            **kwargs,
        )
        net.build()
        made.append(net)
        known_hosts = net.write_known_hosts(tmp_path / f"known_hosts-{net.run_id}")
        return Bare(net, bare_keys, known_hosts)

    yield make
    errors = []
    for net in reversed(made):
        try:
            net.close()
        except Exception as exc:
            errors.append(str(exc))
    assert not errors, errors


@pytest.fixture
def bookworm_hosts(make_bare_hosts: MakeBareHosts) -> Bare:
    """Two fresh Debian 12 hosts on 10.213.12.0/24 (python3 3.11, no venv, no pip)."""
    return make_bare_hosts(2, "bookworm")


@pytest.fixture
def trixie_host(make_bare_hosts: MakeBareHosts) -> Bare:
    """One fresh Debian 13 host on 10.213.13.0/24 (python3 3.13, no venv, no pip)."""
    return make_bare_hosts(1, "trixie")


@pytest.fixture
def bare_index(bookworm_hosts: Bare, bare_wheels: Path) -> Iterator[bareroots.PackageIndex]:
    """`bare_wheels` served on the bookworm hosts' bridge address (the hosts reach only this)."""
    with bareroots.PackageIndex(bare_wheels, host=bookworm_hosts.net.bridge_address) as index:
        yield index
