"""End to end: the real google-cloud-compute client against the fake Compute API, its VMs fresh
Debian machines.

Each address the fake hands out is a bare Debian 12 host of `gce_hosts` (python3 without venv or
pip, reaching nothing but the package index the test serves); a VM's machine runs the provider's
startup-script, which makes its host key and publishes it as a guest attribute. The whole path
(API, startup script, verified SSH, bootstrap, agents, teardown) runs for real except GCE itself.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

import skyward as sky
from skyward.cli import main as cli
from skyward.errors import ProvisionError
from tests.contract import PROBE, ProviderContract
from tests.gcp.conftest import PROJECT, GceHosts, gce_for
from tests.ssh.conftest import wait_until
from tests.support import bareroots, wheels
from tests.support.metadata import MetadataServer

pytestmark = [pytest.mark.ssh, pytest.mark.slow]


def nothing_left(sim: GceHosts) -> None:
    """Nothing of any pool exists in the fake, and no machine runs a process: every VM went,
    and with it everything its machine ran (sessions, agents, the watchdog)."""
    assert sim.fake is not None
    assert sim.fake.labelled() == []
    assert wait_until(lambda: not sim.processes(), 10), f"still running: {sim.processes()}"


def probe_image(sim: GceHosts, token: str) -> sky.Image:
    """The contract's probe image for VMs that cannot see this machine's files: the probe
    wheel is served by the index they reach."""
    wheels.make_wheel(
        sim.index.directory,
        PROBE,
        "1.0",
        {"skyward_contract_probe/__init__.py": f"TOKEN = {token!r}\n"},
    )
    return sky.Image(pip=[f"{PROBE}==1.0"], indexes=[sky.Index(sim.index.simple_url)])


class TestGCPContract(ProviderContract):
    @pytest.fixture
    def make_provider(self, gce_hosts: Callable[..., GceHosts]) -> Callable[[], object]:
        self.sim = gce_hosts()
        return lambda: gce_for(self.sim)

    @pytest.fixture
    def make_broken_provider(self, gce_hosts: Callable[..., GceHosts]) -> Callable[[], object]:
        """Both VMs launch; only the first ever boots, the second never answers SSH."""
        self.sim = gce_hosts(boot_at_most=1)
        return lambda: gce_for(self.sim, boot_timeout=3.0)

    @pytest.fixture
    def nodes_available(self) -> int:
        return 3

    def probe_image(self, directory: Path, token: str) -> sky.Image:
        return probe_image(self.sim, token)

    def discard_environment(self, prefix: str) -> None:
        """The environments live on the VMs' disks, which go with the test's hosts."""

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
        assert self.sim.booted == {}

    def assert_outputs_removed(self, where: str) -> None:
        """A VM's disk goes with the VM: deleted is removed. (The simulated VMs' disks stay
        until the test's hosts go.)"""
        nothing_left(self.sim)

    def assert_gone(self, provider: object, pids: list[int]) -> None:
        nothing_left(self.sim)  # every process of every machine, the agents with `pids` too


def test_a_host_key_other_than_ours_is_never_accepted(gce_hosts: Callable[..., GceHosts]) -> None:
    # The "VM" publishes the key it made, then its sshd serves another one.
    sim = gce_hosts(install_host_key=False)
    assert sim.fake is not None
    with pytest.raises(ProvisionError, match="did not accept the verified SSH login"):
        with sky.ComputePool(provider=gce_for(sim, boot_timeout=3.0), nodes=2, stream_output=False):
            pytest.fail("must not connect")
    nothing_left(sim)


def test_capacity_error_at_insert_leaves_nothing(gce_hosts: Callable[..., GceHosts]) -> None:
    sim = gce_hosts()
    assert sim.fake is not None
    sim.fake.capacity = False
    with pytest.raises(sky.NoCapacity, match="ZONE_RESOURCE_POOL_EXHAUSTED") as caught:
        with sky.ComputePool(provider=gce_for(sim), nodes=2, stream_output=False):
            pytest.fail("must not start")
    assert "Try more zones" in str(caught.value)
    assert sim.fake.calls["firewalls.insert"] == 2  # made, then removed
    nothing_left(sim)


def test_a_500_on_delete_is_retried(gce_hosts: Callable[..., GceHosts]) -> None:
    sim = gce_hosts()
    assert sim.fake is not None
    with sky.ComputePool(provider=gce_for(sim), nodes=2, stream_output=False) as pool:
        assert len(pool.nodes) == 2
        sim.fake.fail["instances.delete"] = 3
    assert sim.fake.calls["instances.delete"] >= 5  # 3 failures, then both VMs
    nothing_left(sim)


def test_a_delete_that_keeps_failing_names_what_remains_and_skyward_down_removes_it(
    gce_hosts: Callable[..., GceHosts], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    sim = gce_hosts()
    assert sim.fake is not None
    gcp = gce_for(sim, teardown_timeout=2.0)
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
    assert cli.main(["ls", "--provider", "gcp"]) == 0
    assert pool.pool_id in capsys.readouterr().out
    assert cli.main(["down", pool.pool_id, "--provider", "gcp"]) == 0
    assert "removed" in capsys.readouterr().out
    nothing_left(sim)


@sky.compute
def slow_node() -> int:
    time.sleep(30)
    return sky.instance_info().node


@sky.compute
def node_index() -> int:
    return sky.instance_info().node


def preempt_mid_call(sim: GceHosts, pool: sky.ComputePool) -> tuple[str, sky.WorkerError]:
    """The fake preempts the VM of node 1 while a call runs: the VM's name, and the call's
    error, which must say the VM was preempted."""
    fake = sim.fake
    assert fake is not None
    victim = sorted(sim.booted)[1]
    timer = threading.Timer(1.0, fake.preempt, [victim])
    timer.start()
    with pytest.raises(sky.WorkerError) as caught:
        slow_node() @ pool
    timer.join()
    assert caught.value.preempted, str(caught.value)
    assert f"VM {victim} was preempted" in str(caught.value)
    return victim, caught.value


def test_a_preempted_node_is_named_and_replaced(gce_hosts: Callable[..., GceHosts]) -> None:
    sim = gce_hosts()
    fake = sim.fake
    assert fake is not None
    with sky.ComputePool(provider=gce_for(sim, spot=True), nodes=2, stream_output=False) as pool:
        assert node_index() @ pool == [0, 1]
        victim, lost = preempt_mid_call(sim, pool)
        pool.replace(lost.node)
        assert node_index() @ pool == [0, 1]
        names = {i["name"] for i in fake.instances.values() if i["status"] == "RUNNING"}
        assert victim not in names and len(names) == 2
    nothing_left(sim)


def test_the_startup_script_boots_a_bare_debian_image(gce_hosts: Callable[..., GceHosts]) -> None:
    """The startup-script runs on a minimal Debian with no systemd (its sshd restart goes
    through ``service``): it makes the host key and publishes it (the pool connects, verified)
    and starts the idle watchdog, which leaves the VM up while the pool is connected."""
    sim = gce_hosts()
    with sky.ComputePool(provider=gce_for(sim), nodes=1, stream_output=False) as pool:
        host = sim.host(pool.nodes[0].private_addr)
        pid = int((host.root / "var/log/skyward-watchdog.pid").read_text())
        assert pid in host.pids(), "the startup-script started the watchdog"
        assert "skyward-watchdog" in Path(f"/proc/{pid}/cmdline").read_text()
        assert not (host.root / bareroots.POWEROFF_MARKER.lstrip("/")).exists()
        # The VM made its own key: metadata (compute.instances.get, which Viewer has) holds no
        # private key, and the guest attribute holds the key sshd serves, the only one the
        # pool's connection trusted.
        assert sim.fake is not None
        (vm,) = [i for i in sim.fake.instances.values() if i["status"] == "RUNNING"]
        assert "PRIVATE KEY" not in json.dumps(vm["metadata"])
        served = (host.root / "etc/ssh/ssh_host_ed25519_key.pub").read_text().split()[:2]
        assert sim.fake.guest_attributes[vm["name"]]["skyward/ssh-ed25519"] == " ".join(served)
    (log,) = sim.boot_logs.values()
    assert "sshd_not_to_be_run" in log, f"sshd was restarted through the image's init: {log}"
    nothing_left(sim)


@sky.compute
def who() -> tuple[str, int, str, str]:
    import getpass
    import os
    import sys

    return getpass.getuser(), os.getuid(), os.environ["HOME"], sys.prefix


def test_the_default_login_user_is_the_one_the_guest_agent_creates(
    gce_hosts: Callable[..., GceHosts],
) -> None:
    """Not root: the provider's default user, which the guest agent creates from ``ssh-keys``
    (here with ``useradd``, as it does), builds and runs in its own home."""
    assert inspect.signature(sky.GCP).parameters["user"].default == "skyward"
    sim = gce_hosts()
    with sky.ComputePool(
        provider=gce_for(sim, user="skyward"), nodes=2, stream_output=False
    ) as pool:
        seen = who() @ pool
    assert [row[:3] for row in seen] == [("skyward", seen[0][1], "/home/skyward")] * 2
    assert seen[0][1] != 0
    assert all(row[3].startswith("/home/skyward/") for row in seen), seen
    nothing_left(sim)


class _GceMetadata:
    """A stand-in for the GCE metadata server on the VMs' bridge: ``instance/preempted``
    (``FALSE`` until `preempted` is set, then ``TRUE``), only with ``Metadata-Flavor: Google``."""

    def __init__(self, host: str) -> None:
        self.preempted = False
        self.server = MetadataServer(host, self._answer)
        self.address = self.server.address

    def _answer(self, method: str, path: str, headers: Mapping[str, str]) -> tuple[int, bytes]:
        if headers.get("metadata-flavor") != "Google":
            return 403, b""
        if method == "GET" and path == "/computeMetadata/v1/instance/preempted":
            return 200, b"TRUE" if self.preempted else b"FALSE"
        return 404, b""

    def close(self) -> None:
        self.server.close()


def test_a_preemption_notice_reaches_the_node_and_its_checkpoint_the_client(
    gce_hosts: Callable[..., GceHosts], tmp_path: Path
) -> None:
    """The node's agent watches instance/preempted itself: once the stand-in metadata server
    says TRUE, sky.preempting() on the node says so (30 s left, as Compute Engine gives), the
    on_preemption callback runs, and its checkpoint reaches the client."""
    from tests.test_preemption import work_until_preempted

    sim = gce_hosts()
    metadata = _GceMetadata(sim.net.bridge_address)
    try:
        env = {"GCE_METADATA_HOST": metadata.address, "SKYWARD_NOTICE_POLL": "0.2"}
        with sky.ComputePool(
            provider=gce_for(sim), nodes=1, env=env, output_dir=tmp_path / "runs"
        ) as pool:
            future = pool.submit(work_until_preempted(False), node=0)
            time.sleep(1)
            metadata.preempted = True
            sent = time.time()
            source, noticed_at = future.result(timeout=60)
            assert source == "GCP preemption"
            assert noticed_at - sent < 2  # within a poll or two
            assert any(r.checkpoint for r in pool.reports), pool.reports
            logs = "\n".join(pool.logs(0))
            assert "got a preemption notice (GCP preemption, 30 s left)" in logs, logs
    finally:
        metadata.close()


@sky.compute
def resume_or_checkpoint_and_wait() -> tuple[str | None, str]:
    """First run: node 0 reports a checkpoint, then every node works on (until its VM is
    preempted). After the restart: what the node resumed from, and its VM's hostname."""
    import socket

    resume = sky.resume_from()
    if resume is not None:
        return (Path(resume) / "state").read_text(), socket.gethostname()
    if sky.instance_info().node == 0:
        ckpt = Path(sky.output_dir()) / "ckpt"
        ckpt.mkdir(parents=True, exist_ok=True)
        (ckpt / "state").write_text("step 5")
        sky.report({"step": 5.0}, checkpoint=str(ckpt))
    time.sleep(120)  # stopped when node 1's VM is preempted
    return None, socket.gethostname()


def test_restarts_replace_a_preempted_vm_and_resume_from_the_checkpoint(
    gce_hosts: Callable[..., GceHosts], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """restarts=1 on GCP (the fake's preemption, bare Debian VMs): node 1's spot VM is
    reclaimed once node 0's checkpoint reached the client; a new VM takes its place, node 0
    keeps its VM, and both resume from the checkpoint, copied off node 0's VM when reported."""
    sim = gce_hosts()
    fake = sim.fake
    assert fake is not None
    victims: list[str] = []

    def on_report(report: sky.Report) -> None:
        if report.checkpoint is not None and not victims:
            victims.append(sorted(sim.booted)[1])
            threading.Thread(target=fake.preempt, args=(victims[0],)).start()

    with sky.ComputePool(
        provider=gce_for(sim, spot=True),
        nodes=2,
        restarts=1,
        output_dir=tmp_path / "runs",
        on_report=on_report,
        stream_output=False,
    ) as pool:
        cluster = pool.cluster
        assert cluster is not None
        before = dict(cluster.node_instances)  # type: ignore[attr-defined]
        after = resume_or_checkpoint_and_wait() @ pool
        now = dict(cluster.node_instances)  # type: ignore[attr-defined]
    assert victims == [before[1]], (victims, before)
    assert [state for state, _ in after] == ["step 5", "step 5"]
    assert now[0] == before[0] and now[1] != before[1], (before, now)
    err = capfd.readouterr().err
    assert "restart 1 of 1 after WorkerError" in err and f"VM {before[1]} was preempted" in err, err
    nothing_left(sim)
