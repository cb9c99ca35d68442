"""Fixtures for the GCP provider: the fake Compute API (tests/support/fakegcp.py) driven by the
real google-cloud-compute client, and "VMs" that are network-namespace sshd hosts.

Safety: the fake listens on 127.0.0.1 only; every address it hands out is a namespace host on
10.213.20.0/24, inside the /16 that `tests.support.sshd.NetnsHosts` routes as unreachable, and
the provider runs with ``use_private_ips=True``: no test can reach a real machine or Google.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from google.auth.credentials import AnonymousCredentials

import skyward as sky
from tests.support import sshd, wheels
from tests.support.fakegcp import FakeGCP

PROJECT = "skyward-test"
ZONE = "us-central1-a"
SUBNET = "10.213.20.0/24"  # the namespace hosts of `gce_hosts`
TPU_SUBNET = "10.213.22.0/24"  # those of `tpu_hosts` (4: one v5litepod-16 slice)
API_ADDRESSES = [f"10.213.20.{200 + i}" for i in range(20)]  # no host: unreachable


@pytest.fixture(autouse=True)
def gcp_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No gcloud config, no real credentials or endpoint from this machine."""
    for name in list(os.environ):
        if name.startswith(("CLOUDSDK_", "GOOGLE_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/nonexistent/skyward-test")


@pytest.fixture
def api_fake() -> Iterator[FakeGCP]:
    """The fake API alone, its addresses unreachable: for tests that never connect."""
    with FakeGCP(PROJECT, API_ADDRESSES, boot_delay=0.05, delete_delay=0.05) as fake:
        yield fake
        assert fake.errors == []


@dataclass
class GceHosts:
    """Plays GCE's boot for the fake's VMs: each address is a namespace host.

    When the fake reports a VM RUNNING, the VM's real startup-script runs inside the matching
    namespace (against a scratch root, a fake ``poweroff`` first on PATH), that host's sshd
    restarts with the host key the script installed and authorizes the ``ssh-keys`` metadata,
    as the guest agent would. A VM that goes (deleted, preempted) loses its sshd. With
    `boot_at_most`, VMs past that many never boot: sshd stays down.
    """

    net: sshd.NetnsHosts
    workdir: Path
    fake: FakeGCP | None = None
    boot_at_most: int | None = None
    install_host_key: bool = True
    booted: dict[str, str] = field(default_factory=dict)  # VM name -> address
    lock: threading.Lock = field(default_factory=threading.Lock)

    def host(self, address: str) -> sshd.NetnsHost:
        for host in self.net.hosts:
            if host.address == address:
                return host
        raise AssertionError(f"the fake handed out {address}, which is not a namespace host")

    def on_running(self, instance: dict[str, Any]) -> None:
        name = instance["name"]
        address = instance["networkInterfaces"][0]["networkIP"]
        server = self.host(address).server
        assert server is not None
        with self.lock:
            late = self.boot_at_most is not None and len(self.booted) >= self.boot_at_most
            self.booted[name] = address
        if late:
            server.stop()
            return
        items = {i["key"]: i["value"] for i in instance["metadata"]["items"]}
        root = self.workdir / name
        (root / "bin").mkdir(parents=True, exist_ok=True)
        poweroff = root / "bin" / "poweroff"
        poweroff.write_text(f"#!/bin/sh\ntouch {root}/powered-off\n")
        poweroff.chmod(0o755)
        (root / "startup-script.sh").write_text(items["startup-script"])
        self.host(address).run(
            "env",
            f"SKYWARD_ROOT={root}",
            f"PATH={root / 'bin'}:{os.environ['PATH']}",
            "bash",
            str(root / "startup-script.sh"),
        )
        server.set_authorized_keys(
            [line.split(":", 1)[1] for line in items["ssh-keys"].splitlines() if ":" in line]
        )
        if self.install_host_key:
            private = root / "etc/ssh/ssh_host_ed25519_key"
            public = private.with_suffix(".pub")
            server.restart(sshd.KeyPair(private, public, public.read_text().strip()))
        else:
            server.restart()

    def on_gone(self, instance: dict[str, Any]) -> None:
        address = instance["networkInterfaces"][0]["networkIP"]
        server = self.host(address).server
        if server is not None:
            server.stop()
        with self.lock:
            self.booted.pop(instance["name"], None)


@pytest.fixture
def gce_hosts(tmp_path: Path) -> Iterator[Callable[..., GceHosts]]:
    """Three namespace "VMs" behind a fake Compute API; call with boot_at_most=...,
    install_host_key=..."""
    yield from _simulated(tmp_path, 3, SUBNET)


@pytest.fixture
def tpu_hosts(tmp_path: Path) -> Iterator[Callable[..., GceHosts]]:
    """Four namespace hosts behind the fake (TPU and Compute) API: the hosts of one simulated
    v5litepod-16 slice, or of smaller ones; called as `gce_hosts`."""
    yield from _simulated(tmp_path, 4, TPU_SUBNET)


def _simulated(tmp_path: Path, count: int, subnet: str) -> Iterator[Callable[..., GceHosts]]:
    if not sshd.is_root():
        pytest.skip("needs root (network namespaces and sshd)")
    reason = sshd.netns_unavailable_reason()
    if reason:
        pytest.skip(reason)
    sshd.ensure_openssh_server()
    made: list[GceHosts] = []
    with contextlib.ExitStack() as stack:
        net = sshd.NetnsHosts(count, subnet=subnet)
        # The namespaces share this machine's hostname, which /etc/hosts maps to 127.0.0.1, and
        # gloo (JAX's CPU collectives) binds to what it resolves to: each host gets its own
        # address in /etc/netns/<name>/hosts (`ip netns exec` mounts it), as real hosts have.
        for host in net.hosts:
            folder = Path("/etc/netns") / host.netns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(
                f"127.0.0.1 localhost\n{host.address} {socket.gethostname()}\n"
            )
            stack.callback(shutil.rmtree, folder, True)
        stack.enter_context(net)

        def make(boot_at_most: int | None = None, install_host_key: bool = True) -> GceHosts:
            sim = GceHosts(
                net, tmp_path, boot_at_most=boot_at_most, install_host_key=install_host_key
            )
            sim.fake = stack.enter_context(
                FakeGCP(PROJECT, net.addresses, on_running=sim.on_running, on_gone=sim.on_gone)
            )
            made.append(sim)
            return sim

        yield make
        for sim in made:
            assert sim.fake is not None
            assert sim.fake.errors == []


@pytest.fixture(scope="session")
def offline_wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wheels for hosts with no route to an index (`wheels.offline_build_env`)."""
    return wheels.wheelhouse(tmp_path_factory.mktemp("wheelhouse"))


def gcp_for(fake: FakeGCP, **kwargs: Any) -> sky.GCP:
    """The provider as the tests use it: the fake's endpoint, private addresses, root login."""
    options: dict[str, Any] = {
        "project": PROJECT,
        "zone": ZONE,
        "use_private_ips": True,
        "ssh_cidr": SUBNET,
        "user": "root",
        "python": sys.executable,  # already has everything; no package downloads
        "poll_interval": 0.1,
        "boot_timeout": 30.0,
        "connect_timeout": 3.0,
        "teardown_timeout": 20.0,
        "credentials": AnonymousCredentials(),
        "api_endpoint": fake.url,
    }
    options.update(kwargs)
    return sky.GCP(**options)
