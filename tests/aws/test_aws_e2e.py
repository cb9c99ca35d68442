"""End to end: moto as a real server on 127.0.0.1, its instances fresh Debian machines.

The moto VPC subnet is the hosts' subnet, so the instances moto reports are the bare Debian 12
hosts `ec2_hosts` runs (python3 without venv or pip, reaching nothing but the package index the
test serves); they run the user data the provider wrote, which makes their host keys and prints
them on the console output. The
whole path (EC2 API, user data, verified SSH, bootstrap, agents, JAX, teardown) runs for real
except EC2 itself.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

import skyward as sky
from skyward.errors import ProvisionError
from skyward.providers.aws import instances, resources, userdata
from skyward.providers.aws.provider import AWSCluster
from tests.aws.conftest import Ec2Hosts, Stubs, aws_for, leftovers, new_session
from tests.contract import PROBE, ProviderContract
from tests.ssh.conftest import wait_until
from tests.support import bareroots, sshd, wheels
from tests.support.metadata import MetadataServer
from tests.test_preemption import work_until_preempted

pytestmark = [pytest.mark.ssh, pytest.mark.slow]


class TestAWSContract(ProviderContract):
    @pytest.fixture
    def make_provider(
        self, ec2_hosts: Callable[..., Ec2Hosts], stubs: Stubs
    ) -> Callable[[], object]:
        self.sim = ec2_hosts()
        self.stubs = stubs
        return lambda: aws_for(self.sim, stubs)

    @pytest.fixture
    def make_broken_provider(
        self, ec2_hosts: Callable[..., Ec2Hosts], stubs: Stubs
    ) -> Callable[[], object]:
        """Both instances launch; only the first ever boots, the second never answers SSH."""
        self.sim = ec2_hosts(boot_at_most=1)
        self.stubs = stubs
        return lambda: aws_for(self.sim, stubs, boot_timeout=3.0)

    @pytest.fixture
    def nodes_available(self) -> int:
        return 3

    def probe_image(self, directory: Path, token: str) -> sky.Image:
        """The instances cannot see this machine's files: the probe wheel is served by the
        index they reach."""
        wheels.make_wheel(
            self.sim.index.directory,
            PROBE,
            "1.0",
            {"skyward_contract_probe/__init__.py": f"TOKEN = {token!r}\n"},
        )
        return sky.Image(pip=[f"{PROBE}==1.0"], indexes=[sky.Index(self.sim.index.simple_url)])

    def discard_environment(self, prefix: str) -> None:
        """The environments live on the instances' disks, which go with the test's hosts."""

    @pytest.fixture(autouse=True)
    def _nothing_left(self, make_provider: Callable[[], object]) -> Any:
        yield
        assert leftovers(new_session(self.stubs).client("ec2")) == []

    def assert_nothing_left(self, provider: object, pool: sky.ComputePool) -> None:
        """The pool's tagged instances are terminated; its security group, key pair and every
        other resource tagged with it are gone; no host holds a session of it."""
        ec2 = new_session(self.stubs).client("ec2")
        assert leftovers(ec2, pool.pool_id) == []
        tagged = ec2.describe_instances(
            Filters=[{"Name": f"tag:{resources.POOL_TAG}", "Values": [pool.pool_id]}]
        )
        states = {i["State"]["Name"] for r in tagged["Reservations"] for i in r["Instances"]}
        assert states == {"terminated"}, f"the pool's instances: {states or 'none were made'}"
        assert ec2.describe_key_pairs()["KeyPairs"] == []
        groups = ec2.describe_security_groups()["SecurityGroups"]
        assert [g["GroupName"] for g in groups if g["GroupName"] != "default"] == []
        for host in self.sim.net.hosts:
            assert wait_until(lambda h=host: not sessions(h), 10), f"sessions on {host.name}"

    @contextlib.contextmanager
    def expect_nothing_launched(self, provider: object, pool: sky.ComputePool) -> Iterator[None]:
        """Not one EC2 call that creates something: no instance, group or key pair exists."""
        yield
        ec2 = new_session(self.stubs).client("ec2")
        assert ec2.describe_instances()["Reservations"] == []
        assert ec2.describe_key_pairs()["KeyPairs"] == []
        groups = ec2.describe_security_groups()["SecurityGroups"]
        assert [g["GroupName"] for g in groups if g["GroupName"] != "default"] == []

    def assert_outputs_removed(self, where: str) -> None:
        """An instance's disk goes with the instance: terminated is removed. (The simulated
        instances' disks stay until the test's hosts go.)"""
        self.assert_gone(None, [])

    def assert_gone(self, provider: object, pids: list[int]) -> None:
        ec2 = new_session(self.stubs).client("ec2")
        assert leftovers(ec2) == []
        states = {
            i["State"]["Name"]
            for r in ec2.describe_instances()["Reservations"]
            for i in r["Instances"]
        }
        assert states == {"terminated"}


def sessions(host: bareroots.BareHost) -> dict[int, int]:
    """The processes below a host's listening sshd: its SSH sessions."""
    return sshd._descendants(host.sshd_pid) if host.sshd_pid is not None else {}


@sky.compute
def jax_sum() -> tuple[int, int, float]:
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    local = jnp.ones(2) * (jax.process_index() + 1)
    total = multihost_utils.process_allgather(local).sum()
    return jax.process_index(), jax.process_count(), float(total)


def test_jax_across_three_instances(ec2_hosts: Callable[..., Ec2Hosts], stubs: Stubs) -> None:
    sim = ec2_hosts()
    # As on a private network: the image names the one index the nodes reach (a mirror with
    # JAX's CPU wheels); the provider adds none.
    aws = aws_for(sim, stubs, build_env={})
    image = sky.Image(indexes=[sky.Index(sim.index.simple_url)])
    with sky.ComputePool(
        provider=aws, nodes=3, image=image, plugins=[sky.plugins.jax()], stream_output=False
    ) as pool:
        results = jax_sum() @ pool
    assert [r[:2] for r in results] == [(0, 3), (1, 3), (2, 3)]
    assert {r[2] for r in results} == {12.0}  # 2*(1+2+3)
    # The simulator sees the terminations on its next poll and stops those hosts' sshd.
    assert wait_until(lambda: not sim.booted, 10), "every instance was terminated"
    assert leftovers(new_session(stubs).client("ec2")) == []


def test_endpoint_url_for_ec2_alone_is_honoured(
    ec2_hosts: Callable[..., Ec2Hosts], stubs: Stubs, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = ec2_hosts()
    url = os.environ.pop("AWS_ENDPOINT_URL")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL_EC2", url)
    with sky.ComputePool(provider=aws_for(sim, stubs), nodes=1, stream_output=False) as pool:
        assert pool.nodes[0].private_addr == sim.net.addresses[0]


def test_a_host_key_other_than_ours_is_never_accepted(
    ec2_hosts: Callable[..., Ec2Hosts], stubs: Stubs
) -> None:
    # The "instance" prints the key it made, then its sshd serves another one.
    sim = ec2_hosts(install_host_key=False)
    aws = aws_for(sim, stubs, boot_timeout=3.0)
    with pytest.raises(ProvisionError, match="host key") as caught:
        with sky.ComputePool(provider=aws, nodes=2, stream_output=False):
            pytest.fail("must not connect")
    assert "did not accept the verified SSH login" in str(caught.value)
    assert leftovers(new_session(stubs).client("ec2")) == []


def test_failed_bootstrap_leaves_nothing(ec2_hosts: Callable[..., Ec2Hosts], stubs: Stubs) -> None:
    sim = ec2_hosts()
    with pytest.raises(sky.BootstrapError):
        with sky.ComputePool(
            provider=aws_for(sim, stubs),
            nodes=2,
            image=sky.Image(setup=["echo failing on purpose; exit 3"]),
            stream_output=False,
        ):
            pytest.fail("must not start")
    assert leftovers(new_session(stubs).client("ec2")) == []


def test_user_data_boots_a_bare_debian_image(
    ec2_hosts: Callable[..., Ec2Hosts], stubs: Stubs
) -> None:
    """The user data runs on a minimal Debian with no systemd (its sshd restart goes through
    ``service``): it makes the host key and prints it (the pool connects, verified) and starts
    the idle watchdog, which leaves the instance up while the pool is connected."""
    sim = ec2_hosts()
    with sky.ComputePool(provider=aws_for(sim, stubs), nodes=1, stream_output=False) as pool:
        host = sim.host(pool.nodes[0].private_addr)
        pid = int((host.root / "var/log/skyward-watchdog.pid").read_text())
        assert pid in host.pids(), "the user data started the watchdog"
        assert "skyward-watchdog" in Path(f"/proc/{pid}/cmdline").read_text()
        assert not (host.root / bareroots.POWEROFF_MARKER.lstrip("/")).exists()
        # The instance made its own key: user data (DescribeInstanceAttribute, which read-only
        # roles have) holds no private key, and the console shows the key sshd serves, the only
        # one the pool's connection trusted.
        ec2 = new_session(stubs).client("ec2")
        (iid,) = sim.booted
        data = ec2.describe_instance_attribute(InstanceId=iid, Attribute="userData")
        assert "PRIVATE KEY" not in base64.b64decode(data["UserData"]["Value"]).decode()
        served = (host.root / "etc/ssh/ssh_host_ed25519_key.pub").read_text().split()[:2]
        assert instances.published_key(sim.attach(new_session(stubs)).client("ec2"), iid) == (
            " ".join(served)
        )
    (log,) = sim.boot_logs.values()
    assert "sshd_not_to_be_run" in log, f"sshd was restarted through the image's init: {log}"


def test_watchdog_powers_off_only_once_no_client_is_connected(
    ec2_hosts: Callable[..., Ec2Hosts],
) -> None:
    host = ec2_hosts().net.hosts[0]
    (host.root / "usr/local/sbin/skyward-watchdog").write_text(userdata.watchdog_script())
    off = bareroots.install_fake_poweroff(host)  # first on PATH: the real one is never reached
    client = socket.create_connection((host.address, 22), timeout=5)  # a connected client
    # Inside the host, detached as the user data starts it; its exit status lands in a file.
    status = host.root / "var/log/watchdog.status"
    host.run(
        "bash",
        "-c",
        "setsid bash -c 'bash /usr/local/sbin/skyward-watchdog 2 0.2; echo $? >"
        " /var/log/watchdog.status' </dev/null >/dev/null 2>&1 &",
    )
    try:
        time.sleep(3.5)  # longer than idle_timeout=2 s, but a client is connected all along
        assert not off.exists()
        client.close()
        assert wait_until(off.exists, 10), "no client any more: the watchdog must power off"
        assert wait_until(lambda: status.is_file() and status.read_text().endswith("\n"), 5)
        assert status.read_text().strip() == "0", "the watchdog exits 0 once it powered off"
        assert len(off.read_text().splitlines()) == 1, "powered off once"
    finally:
        client.close()


def test_restarts_replace_the_lost_instance_and_resume_from_the_checkpoint(
    ec2_hosts: Callable[..., Ec2Hosts], stubs: Stubs, tmp_path: Path
) -> None:
    """restarts=1 on EC2 (moto, bare Debian hosts): node 1 dies, a new instance takes its
    place, node 0 keeps its instance, and both resume from node 0's checkpoint, which was
    copied off its host when it was reported."""
    from tests.test_restarts import checkpoint_then_lose_node_1

    sim = ec2_hosts()
    with sky.ComputePool(
        provider=aws_for(sim, stubs), nodes=2, restarts=1, output_dir=tmp_path / "runs"
    ) as pool:
        cluster = pool.cluster
        assert isinstance(cluster, AWSCluster)
        before = dict(cluster.node_instances)
        after = checkpoint_then_lose_node_1() @ pool
        now = dict(cluster.node_instances)
    assert [state for state, _ in after] == ["step 5", "step 5"]
    assert now[0] == before[0] and now[1] != before[1], (before, now)
    assert leftovers(new_session(stubs).client("ec2"), pool.pool_id) == []


class _Imds:
    """A stand-in for the instance metadata service, on the hosts' bridge: IMDSv2's token, and
    ``spot/instance-action`` (404 until `interrupt` schedules one, then its JSON)."""

    def __init__(self, host: str) -> None:
        self.action: dict[str, str] | None = None
        self.server = MetadataServer(host, self._answer)
        self.url = f"http://{self.server.address}"

    def _answer(self, method: str, path: str, headers: Mapping[str, str]) -> tuple[int, bytes]:
        if method == "PUT":
            return (200, b"token-1") if path == "/latest/api/token" else (404, b"")
        if headers.get("x-aws-ec2-metadata-token") != "token-1":
            return 401, b""
        if path == "/latest/meta-data/spot/instance-action" and self.action is not None:
            return 200, json.dumps(self.action).encode()
        return 404, b""

    def interrupt(self, in_seconds: float) -> None:
        when = time.gmtime(time.time() + in_seconds)
        self.action = {"action": "terminate", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", when)}

    def close(self) -> None:
        self.server.close()


def test_a_spot_interruption_notice_reaches_the_node_and_its_checkpoint_the_client(
    ec2_hosts: Callable[..., Ec2Hosts], stubs: Stubs, tmp_path: Path
) -> None:
    """The node's agent watches spot/instance-action (IMDSv2) itself: once the stand-in
    schedules a termination two minutes out, sky.preempting() on the node says so with the
    time left, the on_preemption callback runs, and its checkpoint reaches the client."""
    sim = ec2_hosts()
    imds = _Imds(sim.net.bridge_address)
    try:
        env = {"AWS_EC2_METADATA_SERVICE_ENDPOINT": imds.url, "SKYWARD_NOTICE_POLL": "0.2"}
        with sky.ComputePool(
            provider=aws_for(sim, stubs), nodes=1, env=env, output_dir=tmp_path / "runs"
        ) as pool:
            future = pool.submit(work_until_preempted(False), node=0)
            time.sleep(1)
            imds.interrupt(120)
            sent = time.time()
            source, noticed_at = future.result(timeout=60)
            assert source == "AWS spot interruption: terminate"
            assert noticed_at - sent < 2  # within a poll or two
            assert any(r.checkpoint for r in pool.reports), pool.reports
            assert "got a preemption notice (AWS spot interruption: terminate, 1" in "\n".join(
                pool.logs(0)
            )
    finally:
        imds.close()


def test_with_restarts_a_spot_notice_starts_the_replacement_before_the_node_is_gone(
    ec2_hosts: Callable[..., Ec2Hosts],
    stubs: Stubs,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """restarts=1 and a spot interruption notice: the client launches the replacement as the
    notice arrives (it boots before the noticed instance is terminated), and the call resumes
    on it from the checkpoint the notice's callback reported."""
    sim = ec2_hosts()
    imds = _Imds(sim.net.bridge_address)

    def on_report(report: sky.Report) -> None:
        if report.checkpoint is not None:
            imds.action = None  # the next instance gets no notice

    try:
        env = {"AWS_EC2_METADATA_SERVICE_ENDPOINT": imds.url, "SKYWARD_NOTICE_POLL": "0.2"}
        with sky.ComputePool(
            provider=aws_for(sim, stubs),
            nodes=1,
            env=env,
            output_dir=tmp_path / "runs",
            restarts=1,
            on_report=on_report,
        ) as pool:
            cluster = pool.cluster
            assert isinstance(cluster, AWSCluster)
            first = cluster.node_instances[0]
            threading.Timer(1.0, imds.interrupt, (120,)).start()
            ((resumed, _),) = work_until_preempted(True) @ pool
            second = cluster.node_instances[0]
            logs = "\n".join(pool.logs(0))
    finally:
        imds.close()
    assert resumed == "saved after AWS spot interruption: terminate"
    assert second != first
    booted = sim.events.index(("boot", second))
    powered_off = sim.events.index(("power off", first))
    assert booted < powered_off, sim.events
    assert "got a preemption notice" in logs, logs
    err = capfd.readouterr().err
    assert "node 0 is being preempted: its replacement is starting" in err, err


@sky.compute
def node_index() -> int:
    return sky.instance_info().node


def test_a_pool_starts_in_the_first_zone_with_room_of_the_first_region_that_fits(
    ec2_hosts: Callable[..., Ec2Hosts], stubs: Stubs, capfd: pytest.CaptureFixture[str]
) -> None:
    """Failover: the first region's vCPU quota cannot fit the pool (skipped without a launch
    call); in the second, the first two zones have no capacity and the pool starts, whole, in
    the third (the hosts' subnet). The console names every location tried and why."""
    sim = ec2_hosts()
    found = sim.ec2.describe_subnets(SubnetIds=[sim.subnet_id])["Subnets"][0]
    others = ("us-east-1a", "us-east-1b", "us-east-1c")
    zones = [z for z in others if z != found["AvailabilityZone"]][:2]  # then the hosts' zone
    full = [
        sim.ec2.create_subnet(
            VpcId=found["VpcId"], CidrBlock=f"10.213.{6 + i}.0/24", AvailabilityZone=zone
        )["Subnet"]["SubnetId"]
        for i, zone in enumerate(zones)
    ]
    stubs.fail_in_zone = dict.fromkeys(
        zones, ("InsufficientInstanceCapacity", "We currently do not have sufficient capacity")
    )
    stubs.quotas[("us-west-2", "L-1216C47A")] = 1.0  # standard on-demand vCPUs: too few
    provider = aws_for(
        sim,
        stubs,
        region=["us-west-2", "us-east-1"],
        subnet_id={"us-east-1": [*full, sim.subnet_id]},
        ami=None,
    )
    with sky.ComputePool(provider=provider, nodes=2) as pool:
        assert node_index() @ pool == [0, 1]
    assert stubs.launches == [("us-east-1", z) for z in [*zones, found["AvailabilityZone"]]]
    err = capfd.readouterr().err
    tried = [
        line.split(": ", 1)[1] for line in err.splitlines() if "trying the next location" in line
    ]
    assert tried[0].startswith("region us-west-2: its quota L-1216C47A quota is 1 vCPUs"), tried
    assert [t.split(":")[0] for t in tried[1:]] == [f"{z} (on-demand)" for z in zones], tried
    assert leftovers(new_session(stubs).client("ec2")) == []
