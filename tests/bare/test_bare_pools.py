"""Pools on hosts that look like fresh cloud VMs: python3 and a shell, nothing else.

The hosts (`tests.support.bareroots`) are debootstrapped Debian roots behind sshd in network
namespaces: bookworm's python3 3.11 without the venv module or pip, trixie's 3.13; the only
thing they reach is the index the test serves on their bridge. Each test starts from a clean
copy of the root, so nothing an earlier test or run built is there.
"""

from __future__ import annotations

import contextlib
import platform
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import skyward as sky
from skyward.providers.remote import hoststeps
from tests.bare.conftest import WHEELS, Bare, MakeBareHosts
from tests.contract import PROBE, ProviderContract
from tests.support import bareroots, wheels

pytestmark = pytest.mark.ssh

UV_VERSION = bareroots.client_uv_version()
CACHE = "/root/.cache/skyward"  # the hosts' skyward cache: root's, as on a fresh image


@sky.compute
def numpy_node() -> tuple[int, str, str, int]:
    import numpy

    return (
        sky.instance_info().node,
        sys.executable,
        platform.python_version(),
        int(numpy.arange(10).sum()),
    )


def _numpy_image(index: bareroots.PackageIndex, flat: bool) -> sky.Image:
    url = index.flat_url if flat else index.simple_url
    return sky.Image(pip=["numpy"], indexes=[sky.Index(url, flat=flat)])


def _ready_mark(bare: Bare, python: str) -> str:
    env = str(Path(python).parent.parent)
    return bare.ssh(0, f"stat -c %i.%Y {env}/.skyward-ready", check=True).stdout.strip()


@pytest.mark.parametrize("flat", [False, True], ids=["pep503", "flat"])
def test_a_pool_on_bare_hosts_builds_from_the_local_index_then_starts_warm(
    bookworm_hosts: Bare, bare_index: bareroots.PackageIndex, flat: bool
) -> None:
    image = _numpy_image(bare_index, flat)
    provider = bookworm_hosts.ssh_provider()
    with sky.ComputePool(provider=provider, image=image, stream_output=False) as pool:
        everywhere = numpy_node() @ pool
        one = numpy_node() >> pool
    assert [row[0] for row in everywhere] == [0, 1] and one[0] in (0, 1)
    for _, python, version, total in everywhere:
        assert python.startswith(f"{CACHE}/envs/"), "an environment built on the host"
        assert version.split(".")[:2] == platform.python_version().split(".")[:2]
        assert total == 45
    asked = " ".join(bare_index.requests)
    assert "/files/numpy-" in asked and "/files/cloudpickle-" in asked
    assert "/files/uv-" not in asked, "uv is the client's own binary, sent over the connection"
    said = bookworm_hosts.ssh(0, f"{CACHE}/bootstrap/uv-{UV_VERSION}/bin/uv --version")
    assert said.stdout.split()[:2] == ["uv", UV_VERSION]
    # A warm start: the same environment, built once, and nothing fetched again.
    mark, fetched = _ready_mark(bookworm_hosts, everywhere[0][1]), len(bare_index.requests)
    with sky.ComputePool(provider=provider, image=image, stream_output=False) as pool:
        assert numpy_node() @ pool == everywhere
    assert _ready_mark(bookworm_hosts, everywhere[0][1]) == mark
    assert len(bare_index.requests) == fetched


def test_uv_is_fetched_from_the_index_when_the_clients_binary_cannot_run_there(
    make_bare_hosts: MakeBareHosts, bare_wheels: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As for a client on macOS: its uv is no use on a Linux host, which fetches the wheel
    from the image's index with its own python3."""
    bare = make_bare_hosts(1)
    monkeypatch.setattr(hoststeps, "client_uv", lambda version: None)
    with bareroots.PackageIndex(bare_wheels, host=bare.net.bridge_address) as index:
        image = _numpy_image(index, flat=False)
        with sky.ComputePool(provider=bare.ssh_provider(), image=image, stream_output=False) as p:
            assert (numpy_node() >> p)[3] == 45
        assert (
            [r for r in index.requests if r.startswith("/files/uv-")]
            == [r for r in index.requests if r.startswith("/files/uv-") and "manylinux" in r]
            != []
        )


def test_a_host_with_no_index_for_what_it_needs_fails_at_start_and_keeps_nothing_running(
    make_bare_hosts: MakeBareHosts,
) -> None:
    bare = make_bare_hosts(1)
    image = sky.Image(pip=["numpy"])  # no index: the host cannot reach PyPI
    with pytest.raises(sky.BootstrapError) as caught:
        with sky.ComputePool(provider=bare.ssh_provider(), image=image, stream_output=False):
            raise AssertionError("the pool must not start")
    message = str(caught.value)
    assert bare.addresses[0] in message and "uv pip install failed" in message
    assert "pypi.org" in caught.value.output
    _wait_only_sshd(bare)


def test_a_host_on_another_python_fails_at_start_naming_both_versions(
    make_bare_hosts: MakeBareHosts, bare_wheels: Path
) -> None:
    """trixie's python3 is 3.13; this client runs 3.11. The node must run 3.11, which uv can
    neither find there nor download (no route): the pool fails before any call, saying so."""
    bare = make_bare_hosts(1, "trixie")
    client = platform.python_version()
    minor = ".".join(client.split(".")[:2])
    with bareroots.PackageIndex(bare_wheels, host=bare.net.bridge_address) as index:
        image = sky.Image(indexes=[sky.Index(index.simple_url)])
        with pytest.raises(sky.BootstrapError) as caught:
            with sky.ComputePool(provider=bare.ssh_provider(), image=image, stream_output=False):
                raise AssertionError("the pool must not start")
    message = str(caught.value)
    assert bare.addresses[0] in message
    assert f"must run Python {minor}, the client's" in message
    assert "/usr/bin/python3 is 3.13." in message
    assert f"Install python{minor} on the host" in message and "Python 3.13" in message
    _wait_only_sshd(bare)


def _wait_only_sshd(bare: Bare, timeout: float = 10.0) -> None:
    """Nothing but each host's sshd runs on the hosts (no agent, no build left behind)."""
    deadline = time.monotonic() + timeout
    for host in bare.hosts:
        while True:
            left = [pid for pid in host.pids() if pid != host.sshd_pid]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not left, f"processes left on {host.name}: {left}"


class TestBareHostContract(ProviderContract):
    """The provider contract on two bare bookworm hosts whose only index is the test's, named
    in the provider's build environment as a host's package mirror would be."""

    @pytest.fixture
    def contract_index(
        self, bookworm_hosts: Bare, tmp_path: Path
    ) -> Iterator[bareroots.PackageIndex]:
        folder = bareroots.download_wheels(tmp_path / "index", WHEELS, python_version="3.11")
        with bareroots.PackageIndex(folder, host=bookworm_hosts.net.bridge_address) as index:
            self.index = index
            yield index

    @pytest.fixture
    def make_provider(
        self, bookworm_hosts: Bare, contract_index: bareroots.PackageIndex
    ) -> Callable[[], object]:
        self.bare = bookworm_hosts
        mirror = {"UV_INDEX": contract_index.simple_url}
        return lambda: bookworm_hosts.ssh_provider(build_env=mirror)

    @pytest.fixture
    def make_broken_provider(
        self, bookworm_hosts: Bare, contract_index: bareroots.PackageIndex
    ) -> Callable[[], object]:
        """The first host, then an address on the subnet where nothing answers."""
        self.bare = bookworm_hosts
        return lambda: sky.SSH(
            [bookworm_hosts.addresses[0], bookworm_hosts.net.unreachable_address],
            user="root",
            key=str(bookworm_hosts.key.private_path),
            known_hosts=str(bookworm_hosts.known_hosts),
            connect_timeout=5,
            build_env={"UV_INDEX": contract_index.simple_url},
        )

    def probe_image(self, directory: Path, token: str) -> sky.Image:
        """The probe wheel, served by the hosts' index (they cannot see this machine's files)."""
        files = {"skyward_contract_probe/__init__.py": f"TOKEN = {token!r}\n"}
        wheels.make_wheel(self.index.directory, PROBE, "1.0", files)
        return sky.Image(pip=[f"{PROBE}==1.0"])

    def discard_environment(self, prefix: str) -> None:
        """Nothing to do: the next test starts from a clean root."""

    def assert_gone(self, provider: object, pids: list[int]) -> None:
        probe = " ".join(str(pid) for pid in pids)
        command = f"for p in {probe}; do test -e /proc/$p && echo $p; done; true"
        deadline = time.monotonic() + 10
        while True:
            left = self.bare.ssh(0, command, check=True).stdout.split()
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not left, f"agents still running on the host: {left}"

    def assert_nothing_left(self, provider: object, pool: sky.ComputePool) -> None:
        _wait_only_sshd(self.bare)

    @contextlib.contextmanager
    def expect_nothing_launched(self, provider: object, pool: sky.ComputePool) -> Iterator[None]:
        before = self._logins()
        yield
        assert self._logins() == before, "the pool logged in before its plugin failed"
        _wait_only_sshd(self.bare)

    def _logins(self) -> int:
        return sum(
            host.log_path.read_text(errors="replace").count("Accepted publickey")
            for host in self.bare.hosts
        )


def test_a_uv_the_host_has_on_its_path_is_used_when_its_minor_version_fits(
    make_bare_hosts: MakeBareHosts, bare_wheels: Path
) -> None:
    bare = make_bare_hosts(1)
    client_uv = hoststeps.client_uv(UV_VERSION)
    assert client_uv is not None
    on_path = bare.hosts[0].root / "usr/local/bin/uv"
    shutil.copy2(client_uv[1], on_path)
    with bareroots.PackageIndex(bare_wheels, host=bare.net.bridge_address) as index:
        image = _numpy_image(index, flat=False)
        with sky.ComputePool(provider=bare.ssh_provider(), image=image, stream_output=False) as p:
            assert (numpy_node() >> p)[3] == 45
    assert bare.ssh(0, f"test -e {CACHE}/bootstrap/uv-{UV_VERSION}").returncode == 1, (
        "the host's own uv was used: none was sent"
    )
    # A uv of another minor version is not: the client's is sent as on a bare host.
    on_path.write_text("#!/bin/sh\necho uv 0.1.0\n")
    with bareroots.PackageIndex(bare_wheels, host=bare.net.bridge_address) as index:
        image = sky.Image(pip=["numpy", "packaging>=20"], indexes=[sky.Index(index.simple_url)])
        with sky.ComputePool(provider=bare.ssh_provider(), image=image, stream_output=False) as p:
            assert (numpy_node() >> p)[3] == 45
    assert bare.ssh(0, f"test -x {CACHE}/bootstrap/uv-{UV_VERSION}/bin/uv").returncode == 0
