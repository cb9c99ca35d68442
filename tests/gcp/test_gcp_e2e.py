"""End to end: the real google-cloud-compute client against the fake Compute API, its VMs real
sshd hosts in network namespaces that take their host keys from the provider's startup script.
The whole path (API, verified SSH, bootstrap, agents, teardown) runs for real except GCE."""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import skyward as sky
from skyward import cli
from skyward.errors import ProvisionError
from tests.contract import ProviderContract
from tests.gcp.conftest import PROJECT, GceHosts, gcp_for
from tests.ssh.conftest import wait_until
from tests.support import wheels

pytestmark = [pytest.mark.ssh, pytest.mark.slow]


def nothing_left(sim: GceHosts) -> None:
    assert sim.fake is not None
    assert sim.fake.labelled() == []
    for host in sim.net.hosts:
        server = host.server
        assert server is None or wait_until(lambda s=server: not s.session_processes(), 10)


class TestGCPContract(ProviderContract):
    @pytest.fixture
    def make_provider(
        self, gce_hosts: Callable[..., GceHosts], offline_wheelhouse: Path
    ) -> Callable[[], object]:
        self.sim = gce_hosts()
        build_env = wheels.offline_build_env(offline_wheelhouse)
        assert self.sim.fake is not None
        fake = self.sim.fake
        return lambda: gcp_for(fake, build_env=build_env)

    @pytest.fixture
    def make_broken_provider(self, gce_hosts: Callable[..., GceHosts]) -> Callable[[], object]:
        """Both VMs launch; only the first ever boots, the second never answers SSH."""
        self.sim = gce_hosts(boot_at_most=1)
        assert self.sim.fake is not None
        fake = self.sim.fake
        return lambda: gcp_for(fake, boot_timeout=3.0)

    @pytest.fixture
    def nodes_available(self) -> int:
        return 3

    @pytest.fixture(autouse=True)
    def _nothing_left(self, make_provider: Callable[[], object]) -> Iterator[None]:
        yield
        nothing_left(self.sim)

    def assert_nothing_left(self, provider: object, pool: sky.ComputePool) -> None:
        nothing_left(self.sim)

    @contextlib.contextmanager
    def expect_nothing_launched(self, provider: object, pool: sky.ComputePool) -> Iterator[None]:
        """Not one API call that creates something."""
        assert self.sim.fake is not None
        before = dict(self.sim.fake.calls)
        yield
        after = self.sim.fake.calls
        for call in ("instances.bulkInsert", "firewalls.insert"):
            assert after[call] == before.get(call, 0), call
        assert self.sim.fake.labelled() == []

    def assert_outputs_removed(self, where: str) -> None:
        """A VM's disk goes with the VM (the namespaces share this machine's files)."""
        nothing_left(self.sim)
        shutil.rmtree(Path(where).parent, ignore_errors=True)

    def assert_gone(self, provider: object, pids: list[int]) -> None:
        nothing_left(self.sim)


def test_a_host_key_other_than_ours_is_never_accepted(gce_hosts: Callable[..., GceHosts]) -> None:
    sim = gce_hosts(install_host_key=False)  # the "VM" keeps its own host key
    assert sim.fake is not None
    with pytest.raises(ProvisionError, match="did not accept the verified SSH login"):
        with sky.ComputePool(
            provider=gcp_for(sim.fake, boot_timeout=3.0), nodes=2, stream_output=False
        ):
            pytest.fail("must not connect")
    nothing_left(sim)


def test_capacity_error_at_insert_leaves_nothing(gce_hosts: Callable[..., GceHosts]) -> None:
    sim = gce_hosts()
    assert sim.fake is not None
    sim.fake.capacity = False
    with pytest.raises(ProvisionError, match="ZONE_RESOURCE_POOL_EXHAUSTED") as caught:
        with sky.ComputePool(provider=gcp_for(sim.fake), nodes=2, stream_output=False):
            pytest.fail("must not start")
    assert "Try another zone" in str(caught.value)
    assert sim.fake.calls["firewalls.insert"] == 2  # made, then removed
    nothing_left(sim)


def test_a_500_on_delete_is_retried(gce_hosts: Callable[..., GceHosts]) -> None:
    sim = gce_hosts()
    assert sim.fake is not None
    with sky.ComputePool(provider=gcp_for(sim.fake), nodes=2, stream_output=False) as pool:
        assert len(pool.nodes) == 2
        sim.fake.fail["instances.delete"] = 3
    assert sim.fake.calls["instances.delete"] >= 5  # 3 failures, then both VMs
    nothing_left(sim)


def test_a_delete_that_keeps_failing_names_what_remains_and_skyward_down_removes_it(
    gce_hosts: Callable[..., GceHosts], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    sim = gce_hosts()
    assert sim.fake is not None
    gcp = gcp_for(sim.fake, teardown_timeout=2.0)
    with pytest.raises(ProvisionError) as caught:
        with sky.ComputePool(provider=gcp, nodes=1, stream_output=False) as pool:
            sim.fake.fail["instances.delete"] = -1
    message = str(caught.value)
    assert f"skyward down {pool.pool_id}" in message
    assert "instance skyward-" in message and "500" in message
    assert [line.split()[0] for line in sim.fake.labelled()] == ["instance"]
    sim.fake.fail.clear()
    # `skyward down` finds it again through the API alone (a fresh process would).
    import google.auth
    from google.auth.credentials import AnonymousCredentials

    monkeypatch.setattr(google.auth, "default", lambda **_: (AnonymousCredentials(), PROJECT))
    monkeypatch.setenv("CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE", sim.fake.url + "/compute/v1/")
    # `skyward ls/down` look for TPU nodes too: the fake answers the TPU API as well.
    monkeypatch.setenv("CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU", sim.fake.url + "/")
    monkeypatch.setenv("CLOUDSDK_COMPUTE_ZONE", "us-central1-a")
    assert cli.main(["ls", "--cloud", "gcp"]) == 0
    assert pool.pool_id in capsys.readouterr().out
    assert cli.main(["down", pool.pool_id, "--cloud", "gcp"]) == 0
    assert "removed" in capsys.readouterr().out
    nothing_left(sim)


@sky.compute
def slow_node() -> int:
    time.sleep(30)
    return sky.instance_info().node


@sky.compute
def node_index() -> int:
    return sky.instance_info().node


def test_a_preempted_node_is_named_and_replaced(gce_hosts: Callable[..., GceHosts]) -> None:
    sim = gce_hosts()
    fake = sim.fake
    assert fake is not None
    with sky.ComputePool(provider=gcp_for(fake, spot=True), nodes=2, stream_output=False) as pool:
        assert node_index() @ pool == [0, 1]
        victim = sorted(sim.booted)[1]
        timer = threading.Timer(1.0, fake.preempt, [victim])
        timer.start()
        with pytest.raises(sky.WorkerError) as caught:
            slow_node() @ pool
        timer.join()
        assert caught.value.preempted, str(caught.value)
        assert f"VM {victim} was preempted" in str(caught.value)
        pool.replace(caught.value.node)
        assert node_index() @ pool == [0, 1]
        names = {i["name"] for i in fake.instances.values() if i["status"] == "RUNNING"}
        assert victim not in names and len(names) == 2
    nothing_left(sim)
