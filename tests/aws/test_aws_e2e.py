"""End to end: moto as a real server on 127.0.0.1, its instances real sshd hosts.

The moto VPC subnet is the namespace test subnet, so the instances moto reports are the sshd hosts
`ec2_hosts` runs; those take their host keys from the user data the provider wrote. The whole path
(EC2 API, verified SSH, bootstrap, agents, JAX, teardown) runs for real except EC2 itself.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import skyward as sky
from skyward.errors import ProvisionError
from skyward.providers.aws import resources, userdata
from tests.aws.conftest import (
    Ec2Hosts,
    Stubs,
    aws_for,
    leftovers,
    new_session,
)
from tests.contract import ProviderContract
from tests.ssh.conftest import wait_until
from tests.support import wheels

pytestmark = [pytest.mark.ssh, pytest.mark.slow]


class TestAWSContract(ProviderContract):
    @pytest.fixture
    def make_provider(
        self, ec2_hosts: Callable[..., Ec2Hosts], stubs: Stubs, offline_wheelhouse: Path
    ) -> Callable[[], object]:
        self.sim = ec2_hosts()
        self.stubs = stubs
        build_env = wheels.offline_build_env(offline_wheelhouse)
        return lambda: aws_for(self.sim, stubs, build_env=build_env)

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
            server = host.server
            assert server is None or wait_until(lambda s=server: not s.session_processes(), 10)

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
        instances are namespaces on this machine, whose files stay: they go here.)"""
        self.assert_gone(None, [])
        shutil.rmtree(Path(where).parent, ignore_errors=True)

    def assert_gone(self, provider: object, pids: list[int]) -> None:
        ec2 = new_session(self.stubs).client("ec2")
        assert leftovers(ec2) == []
        states = {
            i["State"]["Name"]
            for r in ec2.describe_instances()["Reservations"]
            for i in r["Instances"]
        }
        assert states == {"terminated"}


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
    aws = aws_for(sim, stubs)
    with sky.ComputePool(
        provider=aws, nodes=3, plugins=[sky.plugins.jax()], stream_output=False
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
    sim = ec2_hosts(install_host_key=False)  # the "instance" keeps its own host key
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


def test_watchdog_powers_off_only_once_no_client_is_connected(
    ec2_hosts: Callable[..., Ec2Hosts], tmp_path: Path
) -> None:
    host = ec2_hosts().net.hosts[0]
    script = tmp_path / "skyward-watchdog"
    script.write_text(userdata.watchdog_script())
    (tmp_path / "bin").mkdir()
    off = tmp_path / "powered-off"
    fake = tmp_path / "bin" / "poweroff"  # first on PATH: the real one is never reached
    fake.write_text(f"#!/bin/sh\ntouch {off}\n")
    fake.chmod(0o755)
    client = socket.create_connection((host.address, 22), timeout=5)  # a connected client
    watchdog = subprocess.Popen(
        ["ip", "netns", "exec", host.netns, "env", f"PATH={tmp_path / 'bin'}:{os.environ['PATH']}",
         "bash", str(script), "2", "0.2"],
    )  # fmt: skip
    try:
        time.sleep(3.5)  # longer than idle_timeout=2 s, but a client is connected all along
        assert not off.exists()
        client.close()
        assert wait_until(off.exists, 10), "no client any more: the watchdog must power off"
        assert watchdog.wait(5) == 0
    finally:
        client.close()
        if watchdog.poll() is None:
            watchdog.kill()
            watchdog.wait()
