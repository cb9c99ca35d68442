"""Fixtures for Slurm tests: one real Slurm cluster on this machine for the whole session.

Built on `tests.support.slurmcluster`. Everything skips, saying why, when not root, when
network namespaces are unavailable or when Slurm cannot be installed.
"""

from __future__ import annotations

from collections.abc import Iterator

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
