"""Pools on a real Slurm cluster (Debian's slurm-wlm): one allocation, one agent step per node.

The cluster is `tests.support.slurmcluster.SlurmCluster`: slurmctld and three slurmd in network
namespaces on this machine. The client is the login node (`sky.Slurm()` with no `login`): the
Slurm commands find the cluster through ``SLURM_CONF``, as on a login node. The compute nodes
share this machine's filesystem (a shared home), so one environment build serves them all.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import skyward as sky
from tests.support.slurmcluster import Partition, SlurmCluster

SUBNET = "10.213.33.0/24"  # the cluster self-tests use .31 and .32


@pytest.fixture(scope="module")
def cluster(slurm_ready: None) -> Iterator[SlurmCluster]:
    partitions = [
        Partition("debug", default=True),
        Partition("restricted", allow_accounts=("research",)),
    ]
    with SlurmCluster(3, gres="gpu:a100:4", partitions=partitions, subnet=SUBNET) as cluster:
        yield cluster


@pytest.fixture
def login(cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    """This process as the cluster's login node: SLURM_CONF names the cluster."""
    for name in list(os.environ):
        if name.startswith("SLURM"):
            monkeypatch.delenv(name)
    for name, value in cluster.env().items():
        monkeypatch.setenv(name, value)
    return cluster


def queue(cluster: SlurmCluster) -> list[str]:
    """The jobs in the queue: ``id name state`` lines."""
    out = cluster.run(["squeue", "-h", "-o", "%i %j %T"], check=True).stdout
    return out.split("\n")[:-1] if out else []


def wait_for_empty_queue(cluster: SlurmCluster, seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while (jobs := queue(cluster)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return jobs


@sky.compute
def whereabouts() -> tuple[str, str, int, str, list[str]]:
    info = sky.instance_info()
    step_world = sorted(name for name in os.environ if name.startswith(("SLURM_", "SLURMD_")))
    return (
        socket.gethostname(),
        os.environ["SKYWARD_SLURM_JOB_ID"],
        info.node,
        info.head_addr,
        step_world,
    )


def test_a_pool_is_one_allocation_with_an_agent_on_each_node(login: SlurmCluster) -> None:
    with sky.ComputePool(provider=sky.Slurm(), nodes=3) as pool:
        found = whereabouts() @ pool
        assert len(queue(login)) == 1  # one job: the allocation
    names = [name for name, *_ in found]
    assert sorted(names) == ["node0", "node1", "node2"]
    assert len({job for _, job, *_ in found}) == 1  # every node in one job
    assert [node for _, _, node, *_ in found] == [0, 1, 2]
    assert {head for *_, head, _ in found} == {login.node(names[0]).address}
    assert all(world == [] for *_, world in found), "the step's SLURM_* world leaked in"
    assert wait_for_empty_queue(login, 5) == []


def test_a_partition_that_does_not_exist_is_a_config_error_with_nothing_queued(
    login: SlurmCluster,
) -> None:
    began = time.monotonic()
    with pytest.raises(sky.ConfigError, match=r"(?i)invalid partition.*nosuch"):
        with sky.ComputePool(provider=sky.Slurm(partition="nosuch"), nodes=2):
            pass
    assert time.monotonic() - began < 30
    assert queue(login) == []


def test_an_account_the_partition_refuses_is_a_config_error(login: SlurmCluster) -> None:
    with pytest.raises(sky.ConfigError, match=r"(?i)account.*other"):
        with sky.ComputePool(provider=sky.Slurm(partition="restricted", account="other"), nodes=1):
            pass
    assert queue(login) == []


def test_a_pending_allocation_shows_slurms_reason_and_gives_up_when_asked(
    login: SlurmCluster, capfd: pytest.CaptureFixture[str]
) -> None:
    blocker = login.submit(["--exclusive", "-N3", "-J", "blocker", "--wrap", "sleep 300"])
    try:
        with pytest.raises(sky.ProvisionError, match="still pending after 4 s"):
            with sky.ComputePool(provider=sky.Slurm(pending_timeout=4), nodes=3):
                pass
        assert "pending: Resources" in capfd.readouterr().err
        assert [line.split()[1] for line in queue(login)] == ["blocker"]
    finally:
        login.run(["scancel", str(blocker)], check=True)
    assert wait_for_empty_queue(login, 10) == []


@sky.compute
def sleep_on(node: int, seconds: float) -> str:
    if sky.instance_info().node == node:
        print("sleeping", flush=True)
        time.sleep(seconds)
    return socket.gethostname()


def test_a_node_lost_mid_call_is_a_worker_error_naming_it(login: SlurmCluster) -> None:
    try:
        with sky.ComputePool(provider=sky.Slurm(), nodes=2, broadcast_grace=1) as pool:
            names = [name for name, *_ in whereabouts() @ pool]
            future = pool.submit(sleep_on(1, 120), node=1)
            time.sleep(1)
            login.kill_node(names[1])  # slurmd and everything it started on that node
            with pytest.raises(sky.WorkerError) as caught:
                future.result(timeout=60)
        assert caught.value.node == 1 and names[1] in str(caught.value)
    finally:
        login.start_node(names[1])
    assert wait_for_empty_queue(login, 10) == []


CLIENT = textwrap.dedent(
    """
    import sys, time
    import skyward as sky

    @sky.compute
    def nap():
        time.sleep(600)

    with sky.ComputePool(provider=sky.Slurm(), nodes=2) as pool:
        print("RUNNING", flush=True)
        nap() @ pool
    """
)


def test_a_client_killed_with_sigkill_leaves_no_job(login: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    client = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    try:
        assert client.stdout is not None
        deadline = time.monotonic() + 120
        while (line := client.stdout.readline()) and "RUNNING" not in line:
            assert time.monotonic() < deadline, "the pool did not start"
        assert "RUNNING" in line
        time.sleep(1)
        assert len(queue(login)) == 1
        client.send_signal(signal.SIGKILL)
        client.wait(10)
        assert wait_for_empty_queue(login, 60) == []
    finally:
        client.kill()
        client.wait()
