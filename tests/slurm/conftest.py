"""Fixtures for Slurm tests: one real Slurm cluster on this machine for the whole session.

Built on `tests.support.slurmcluster`. Everything skips, saying why, when not root, when
network namespaces are unavailable or when Slurm cannot be installed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import slurmcluster, sshd
from tests.support.slurmcluster import Partition, SlurmCluster

GRES = "gpu:a100:4"
"""What every node of the session's cluster has."""

SUBNET = "10.213.31.0/24"
"""The session cluster's subnet (the self-tests' own clusters use 10.213.32.0/24)."""

ALLOWED_ACCOUNT = "research"
"""The only account partition ``restricted`` accepts."""


def unavailable_reason() -> str | None:
    """Why a Slurm cluster cannot run here, or None when it can."""
    reason = sshd.netns_unavailable_reason()  # checks root first
    if reason:
        return reason
    try:
        slurmcluster.ensure_slurm()
    except Exception as exc:  # no apt, no network: skip, do not fail
        return f"Slurm is not available: {exc}"
    return None


@pytest.fixture(scope="session")
def slurm_ready() -> None:
    """Skip unless a Slurm cluster can run here; remove what crashed runs left."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    slurmcluster.remove_stale_slurm_resources()  # only clusters whose owner is gone


@pytest.fixture(scope="session")
def slurm_cluster(slurm_ready: None) -> Iterator[SlurmCluster]:
    """Three nodes (``node0``-``node2``, 2 CPUs and ``gpu:a100:4`` each) on 10.213.31.0/24.

    Not the default 10.213.30.0/24: clusters on one subnet take turns (a machine-wide lock),
    and these self-tests should not wait for the provider's tests or an ad-hoc script.

    Partitions: ``debug`` (default, every node), ``restricted`` (every node, account
    ``research`` only: with no accounting database that refuses every job) and ``short``
    (``node0``, 10 minutes at most). Tests must leave it as they found it: every job they
    start, they cancel. Closing it fails the session if anything is left behind.
    """
    partitions = [
        Partition("debug", default=True),
        Partition("restricted", allow_accounts=(ALLOWED_ACCOUNT,)),
        Partition("short", nodes=("node0",), max_time="10"),
    ]
    with SlurmCluster(3, gres=GRES, partitions=partitions, subnet=SUBNET) as cluster:
        yield cluster


PROVIDER_SUBNET = "10.213.33.0/24"
"""The provider tests' cluster's subnet."""


@pytest.fixture(scope="session")
def provider_cluster(slurm_ready: None) -> Iterator[SlurmCluster]:
    """The cluster the provider's tests run pools on: three nodes (``gpu:a100:4`` each),
    partitions ``debug`` (default), ``restricted`` (refuses every account) and ``urgent``
    (same nodes, higher priority tier: its jobs preempt, by cancelling, those of ``debug``)."""
    partitions = [
        Partition("debug", default=True, options=("PriorityTier=1",)),
        Partition("restricted", allow_accounts=(ALLOWED_ACCOUNT,)),
        Partition("urgent", options=("PriorityTier=10",)),
    ]
    preemption = ["PreemptType=preempt/partition_prio", "PreemptMode=CANCEL"]
    with SlurmCluster(
        3,
        gres=GRES,
        partitions=partitions,
        subnet=PROVIDER_SUBNET,
        extra_config=preemption,
        slurmd_timeout=5,  # a killed node is noticed (down) within about 10 s
    ) as cluster:
        yield cluster


def as_login(cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    """This process as `cluster`'s login node: only SLURM_CONF names the cluster.

    The steps inherit this process's PATH, and the nodes share this machine's files: this
    interpreter's directory comes first on it, as in an activated venv, so a pool's default
    ``python3`` on the nodes is this one, which has the agent's requirements. Otherwise it is
    whatever python3 the PATH finds (the system's, run as ``.venv/bin/python -m pytest``), and
    node 0 builds with uv from an index the cluster's namespaces cannot reach."""
    for name in list(os.environ):
        if name.startswith("SLURM"):
            monkeypatch.delenv(name)
    for name, value in cluster.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(
        "PATH", os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    )
    return cluster


@pytest.fixture
def login(provider_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    """This process as the provider cluster's login node."""
    return as_login(provider_cluster, monkeypatch)


def queue(cluster: SlurmCluster) -> list[str]:
    """The jobs in the queue: ``id name state`` lines."""
    out = cluster.run(["squeue", "-h", "-o", "%i %j %T"], check=True).stdout
    return out.split("\n")[:-1] if out else []


def wait_for_empty_queue(cluster: SlurmCluster, seconds: float) -> list[str]:
    """The queue once it is empty, or as it still is after `seconds`."""
    deadline = time.monotonic() + seconds
    while (jobs := queue(cluster)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return jobs


CLIENT = textwrap.dedent(
    """
    import time
    import skyward as sky

    @sky.compute
    def nap():
        time.sleep(600)

    with sky.ComputePool(provider={provider}, nodes={nodes}) as pool:
        print("POOL", pool.pool_id, flush=True)
        nap() @ pool
    """
)


@contextlib.contextmanager
def client_running(
    tmp_path: Path, provider: str = "sky.Slurm()", nodes: int = 2
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A client in another process whose pool (of `provider`, Python source) runs a long call:
    the pool id and the process, killed at the end."""
    script = tmp_path / "client.py"
    script.write_text(CLIENT.format(provider=provider, nodes=nodes))
    client = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    try:
        assert client.stdout is not None
        line = client.stdout.readline()
        assert line.startswith("POOL "), line
        yield line.split()[1], client
    finally:
        client.kill()
        client.wait()


@pytest.fixture
def running_pool(
    login: SlurmCluster, tmp_path: Path
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A client in another process, its pool's call running: the pool id and the process."""
    with client_running(tmp_path) as running:
        yield running
