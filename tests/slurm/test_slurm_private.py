"""Pools on a Slurm cluster whose nodes share no cache directory: no shared home.

The cluster (two nodes) mounts an empty tmpfs of each node's own over the suite's skyward cache
(`SlurmCluster(private_dirs=...)`), so what a node writes there no other node, and not the
client, sees: each node must get skyward and uv and build its environment itself, and a
`sky.Data` tree and the outputs must travel through the pool's own streams (job steps started
from this machine, the login node). What it hides: the nodes still share every other path of
this machine, its Python and the wheel files the image names (on a real cluster those would come
from an index the nodes reach, or from `python=` on the nodes' image).
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import skyward as sky
from tests.contract import offline_image
from tests.slurm.conftest import as_login, wait_for_empty_queue
from tests.slurm.test_slurm_pools import read_data, write_output
from tests.support.slurmcluster import SlurmCluster

SUBNET = "10.213.35.0/24"
"""This module's cluster's subnet (apart from the session clusters of conftest.py)."""

SHARED = "the nodes share one cache directory"
BUILD = "building the environment for image"


def builders(console: str) -> list[str]:
    """The nodes that built an environment, as the console's build lines name them."""
    return [line.split(":")[0].split()[-1] for line in console.splitlines() if BUILD in line]


@pytest.fixture(scope="module")
def private_cluster(slurm_ready: None) -> Iterator[SlurmCluster]:
    with SlurmCluster(2, subnet=SUBNET, private_dirs=(os.environ["SKYWARD_CACHE_DIR"],)) as cluster:
        yield cluster


@sky.compute
def environment_disk() -> tuple[str, int, str]:
    """The node's name, the device its environment lives on, and the built package's token."""
    import skyward_contract_probe  # type: ignore[import-not-found]  # only in the built env

    return socket.gethostname(), os.stat(sys.prefix).st_dev, skyward_contract_probe.TOKEN


def test_each_node_builds_its_own_environment_and_data_travels_through_steps(
    private_cluster: SlurmCluster,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    as_login(private_cluster, monkeypatch)
    token = uuid.uuid4().hex
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("alpha")
    runs = tmp_path / "runs"
    with sky.ComputePool(
        provider=sky.Slurm(python=sys.executable),
        nodes=2,
        image=offline_image(tmp_path / "wheels", token),
        output_dir=runs,
    ) as pool:
        found = environment_disk() @ pool
        assert read_data(sky.Data(data)) @ pool == ["alpha", "alpha"]
        write_output() @ pool
    assert sorted(name for name, _, _ in found) == ["node0", "node1"]
    assert [seen for _, _, seen in found] == [token, token]
    disks = {disk for _, disk, _ in found}
    # Each node's environment is on its own disk: neither one's nor the client's.
    assert len(disks) == 2, found
    assert os.stat(os.environ["SKYWARD_CACHE_DIR"]).st_dev not in disks
    for node in (0, 1):  # pulled from a step on each node, through srun's pipes
        assert (runs / f"node-{node}" / "out.txt").read_text() == f"from node {node}"
    console = capfd.readouterr().err
    assert SHARED not in console
    assert sorted(builders(console)) == ["0", "1"]
    assert wait_for_empty_queue(private_cluster, 5) == []


def test_on_a_shared_home_node_0_builds_for_every_node(
    login: SlurmCluster, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The other cluster (conftest's), whose nodes share this machine's cache: one build."""
    token = uuid.uuid4().hex
    with sky.ComputePool(
        provider=sky.Slurm(python=sys.executable),
        nodes=3,
        image=offline_image(tmp_path / "wheels", token),
    ) as pool:
        found = environment_disk() @ pool
    assert [seen for _, _, seen in found] == [token] * 3
    console = capfd.readouterr().err
    assert SHARED in console
    assert builders(console) == ["0"]
