"""Fixtures for the SSH provider: real OpenSSH servers on 127.0.0.1 and in network namespaces.

Built on `tests.support.sshd`. Everything skips with a reason when not root or when sshd cannot
be installed. Nodes log in as root with the client's own interpreter (``python=sys.executable``,
used directly because it already satisfies the image), so tests need no package downloads;
root's interpreter lives under /root, which other users cannot read. Tests of uv-built
environments log in as the unprivileged ``skyward-test`` user with the system ``python3``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import skyward as sky
from tests.support import sshd

CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
# This machine reaches package indexes through a TLS-inspecting proxy; uv needs its CA bundle.
BUILD_ENV = {"SSL_CERT_FILE": CA_BUNDLE} if Path(CA_BUNDLE).exists() else {}


def _unavailable() -> str | None:
    if not sshd.is_root():
        return "SSH tests need root (they start sshd and create users)"
    try:
        sshd.ensure_openssh_server()
    except Exception as exc:  # no apt, no network: skip, do not fail
        return f"openssh-server is not available: {exc}"
    return None


@pytest.fixture(scope="session")
def ssh_ready() -> None:
    reason = _unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def _functions_by_value(request: pytest.FixtureRequest) -> None:
    # Remote nodes cannot import the test modules: ship their functions' code with them.
    import tests.contract

    cloudpickle.register_pickle_by_value(tests.contract)
    if request.module is not None:
        cloudpickle.register_pickle_by_value(request.module)


@dataclass
class Server:
    """One running sshd with everything a client needs to log in."""

    sshd: sshd.SshdServer
    key: sshd.KeyPair
    known_hosts: Path

    @property
    def port(self) -> int:
        return self.sshd.port

    def host(self, user: str = "root") -> str:
        return f"{user}@{self.sshd.host}:{self.sshd.port}"

    def provider(self, *, user: str = "root", count: int = 1, **kwargs: Any) -> sky.SSH:
        options: dict[str, Any] = {
            "key": str(self.key.private_path),
            "known_hosts": str(self.known_hosts),
            "python": sys.executable if user == "root" else None,
            "build_env": BUILD_ENV,
        }
        options.update(kwargs)
        return sky.SSH([self.host(user)] * count, **options)


@pytest.fixture(scope="session")
def keys(ssh_ready: None, tmp_path_factory: pytest.TempPathFactory) -> sshd.KeyPair:
    key = sshd.KeyPair.generate(tmp_path_factory.mktemp("ssh-keys"))
    user = sshd.SshUser.ensure()
    user.authorize(key)
    # The test user's skyward cache holds only what this run builds there.
    shutil.rmtree(Path(user.home) / ".cache" / "skyward", ignore_errors=True)
    return key


def _server(key: sshd.KeyPair, directory: Path) -> Iterator[Server]:
    server = sshd.SshdServer(authorized_keys=[key])
    with server:
        yield Server(server, key, server.write_known_hosts(directory / "known_hosts"))


@pytest.fixture(scope="session")
def local_sshd(keys: sshd.KeyPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One sshd on 127.0.0.1 for the whole session."""
    yield from _server(keys, tmp_path_factory.mktemp("sshd"))


@pytest.fixture
def own_sshd(keys: sshd.KeyPair, tmp_path: Path) -> Iterator[Server]:
    """A fresh sshd for one test (which may stop or restart it)."""
    yield from _server(keys, tmp_path)


@dataclass
class Hosts:
    """Network-namespace hosts, each with its own sshd on port 22."""

    net: sshd.NetnsHosts
    key: sshd.KeyPair
    known_hosts: Path

    def provider(self, count: int, **kwargs: Any) -> sky.SSH:
        options: dict[str, Any] = {
            "user": "root",
            "key": str(self.key.private_path),
            "known_hosts": str(self.known_hosts),
            "python": sys.executable,
        }
        options.update(kwargs)
        return sky.SSH(self.net.addresses[:count], **options)


@pytest.fixture(scope="session")
def netns_hosts(keys: sshd.KeyPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    """Three hosts on 10.213.2.0/24, each a network namespace running sshd.

    Each suite has its own subnet (the sshd support tests use 10.213.0.0/24, the AWS tests
    10.213.8.0/24, the slow links' 10.213.16.0/24): two live sets of hosts on one subnet would
    answer for each other.
    """
    yield from hosts_on("10.213.2.0/24", 3, keys, tmp_path_factory)


def hosts_on(
    subnet: str, count: int, keys: sshd.KeyPair, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Hosts]:
    """`count` network-namespace hosts on `subnet`, each running sshd, while the generator is
    open (a session fixture's body)."""
    reason = sshd.netns_unavailable_reason()
    if reason:
        pytest.skip(reason)
    net = sshd.NetnsHosts(count, subnet=subnet, authorized_keys=[keys])
    # All namespaces share this machine's hostname, which /etc/hosts maps to 127.0.0.1; gloo
    # (JAX's CPU collectives) binds to what the hostname resolves to. `ip netns exec` (which
    # starts each sshd) bind-mounts /etc/netns/<name>/hosts over /etc/hosts: give every host
    # its own address there, as separate machines would have.
    made = []
    for host in net.hosts:
        folder = Path("/etc/netns") / host.netns
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text(
            f"127.0.0.1 localhost\n{host.address} {socket.gethostname()}\n"
        )
        made.append(folder)
    try:
        with net:
            path = net.write_known_hosts(tmp_path_factory.mktemp("netns") / "known_hosts")
            yield Hosts(net, keys, path)
    finally:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


def processes_with(token: str) -> list[int]:
    """Pids (not zombies) whose command line contains `token`; namespaces share our pids."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if token.encode() in cmdline and sshd.pid_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def wait_until(check: Callable[[], bool], timeout: float) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


@contextlib.contextmanager
def detached_project(hosts: Hosts, directory: Path, job: str) -> Iterator[Path]:
    """`directory` as the working directory, holding `job` as job.py and a default profile for
    two of `hosts` (what ``skyward run --detach job.py`` reads); on the way out, the working
    directory as it was and no run's key line left in root's authorized_keys (a test that
    failed half-way may leave one)."""
    (directory / "job.py").write_text(job)
    (directory / "skyward.toml").write_text(
        textwrap.dedent(
            f"""
            [profile.default]
            provider = "ssh"
            hosts = {hosts.net.addresses[:2]!r}
            user = "root"
            key = "{hosts.key.private_path}"
            known_hosts = "{hosts.known_hosts}"
            python = "{sys.executable}"
            nodes = 2
            """
        )
    )
    cwd = os.getcwd()
    os.chdir(directory)
    try:
        yield directory
    finally:
        os.chdir(cwd)
        keys = Path("/root/.ssh/authorized_keys")
        if keys.exists():
            lines = keys.read_text().splitlines(keepends=True)
            keys.write_text("".join(line for line in lines if " skyward-run:" not in line))
