"""GPU pools on a real Slurm cluster: the GRES asked for, and the GPUs each node then has.

The clusters are `tests.support.slurmcluster.SlurmCluster`s of this module's own (subnet
10.213.34.0/24, one at a time), two nodes with eight GPUs each as GRES. Their device files are
character device nodes (``gpu_devices=True``), so Slurm 22.05 grants GPUs by index and sets
``CUDA_VISIBLE_DEVICES`` in a step as it does on a GPU node without ``ConstrainDevices``. There
is no GPU behind them: a fake ``nvidia-smi`` replaying a recorded 8 x A100-SXM4-80GB machine
(``tests/data/gpus``) is first on this process's PATH, which the job steps inherit (``srun``
passes the client's environment on), so every node lists those eight.

Another job holds GPUs 0 and 1 of every node first, so the pool is granted 2 and 3: what a
node then reports, and what its agent may use, must be those two of the eight nvidia-smi lists.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import skyward as sky
from skyward.providers.remote.bootstrap import RemoteNode
from tests.slurm.conftest import wait_for_empty_queue
from tests.support.gpus import fake_nvidia_smi, recorded
from tests.support.slurmcluster import SlurmCluster

SUBNET = "10.213.34.0/24"
"""This module's clusters' subnet (the other Slurm tests use .31, .33 and .35)."""

MACHINE = "a100x8-driver550"
UUIDS = [line.split(", ")[3] for line in recorded(MACHINE, "query.txt").splitlines()]


@sky.compute
def gpus_seen() -> tuple[str, str | None, int, tuple[int, ...], str | None]:
    """The node's job, accelerator, count and devices (`instance_info`) and the agent's own
    CUDA_VISIBLE_DEVICES."""
    info = sky.instance_info()
    return (
        os.environ["SKYWARD_SLURM_JOB_ID"],
        info.accelerator,
        info.accelerator_count,
        info.devices,
        os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


def gpu_cluster(gres: str) -> SlurmCluster:
    return SlurmCluster(2, cpus_per_node=4, gres=gres, gpu_devices=True, subnet=SUBNET)


@pytest.fixture(scope="class")
def typed_site(slurm_ready: None) -> Iterator[SlurmCluster]:
    """Nodes with ``gpu:a100:8``: a site whose GPUs have a type."""
    with gpu_cluster("gpu:a100:8") as cluster:
        yield cluster


@pytest.fixture(scope="class")
def untyped_site(slurm_ready: None) -> Iterator[SlurmCluster]:
    """Nodes with ``gpu:8``: a site whose GPUs have no type."""
    with gpu_cluster("gpu:8") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def fake_gpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The recorded machine's nvidia-smi, and a ``pynvml`` that cannot be imported (on a
    machine with a real GPU, NVML would answer the host check before the fake nvidia-smi)."""
    root = tmp_path_factory.mktemp("gpus")
    hidden = root / "no-nvml"
    hidden.mkdir()
    (hidden / "pynvml.py").write_text('raise ImportError("hidden: nvidia-smi is recorded")\n')
    return fake_nvidia_smi(MACHINE, root / "bin"), hidden


def on_gpu_nodes(
    cluster: SlurmCluster, fake_gpus: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> SlurmCluster:
    """This process as `cluster`'s login node, whose steps find the fake GPUs."""
    smi, hidden = fake_gpus
    monkeypatch.setenv("PATH", f"{smi}:{os.environ['PATH']}")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(hidden), os.environ.get("PYTHONPATH")]))
    )
    # The client is the login node: SLURM_CONF names the cluster, no SLURM_* of ours leaks.
    for name in [name for name in os.environ if name.startswith("SLURM")]:
        monkeypatch.delenv(name)
    for name, value in cluster.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return cluster


@pytest.fixture
def typed(
    typed_site: SlurmCluster, fake_gpus: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> SlurmCluster:
    return on_gpu_nodes(typed_site, fake_gpus, monkeypatch)


@pytest.fixture
def untyped(
    untyped_site: SlurmCluster, fake_gpus: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> SlurmCluster:
    return on_gpu_nodes(untyped_site, fake_gpus, monkeypatch)


@pytest.fixture
def gpus_0_and_1_taken(request: pytest.FixtureRequest) -> Iterator[int]:
    """Another job that holds GPUs 0 and 1 of both nodes while the test runs."""
    cluster: SlurmCluster = request.getfixturevalue(request.param)
    job = cluster.allocate(["-N2", "--ntasks-per-node=1", "--gres=gpu:2"])
    try:
        yield job
    finally:
        cluster.run(["scancel", str(job)], check=True)
        assert wait_for_empty_queue(cluster, 10) == []


def job_fields(cluster: SlurmCluster, job: str) -> str:
    return cluster.run(["scontrol", "-d", "show", "job", job], check=True).stdout


def slurm_pool(**kwargs: object) -> sky.ComputePool:
    return sky.ComputePool(provider=sky.Slurm(python=sys.executable), nodes=2, **kwargs)  # type: ignore[arg-type]


def owned(pool: sky.ComputePool) -> list[tuple[list[int], int, list[int]]]:
    """Each node's inventory as its host check reported it (indexes, and how many GPUs its
    CUDA_VISIBLE_DEVICES hid), and the GPUs the node owns."""
    assert pool.cluster is not None
    found = []
    for node in pool.cluster.nodes:
        assert isinstance(node, RemoteNode) and node.inventory is not None
        inventory = node.inventory
        found.append(
            ([g.index for g in inventory.gpus], inventory.hidden, [g.index for g in node.gpus])
        )
    return found


class TestASiteWithGpuTypes:
    @pytest.mark.parametrize("gpus_0_and_1_taken", ["typed"], indirect=True)
    def test_a_pool_asks_for_the_type_and_runs_on_the_gpus_slurm_granted(
        self, typed: SlurmCluster, gpus_0_and_1_taken: int
    ) -> None:
        """``accelerator="A100:2"``: one allocation with ``--gres=gpu:a100:2``; Slurm grants
        GPUs 2 and 3 of each node (0 and 1 are taken), each node's inventory holds those two
        of the eight nvidia-smi lists, and the agent sees exactly them (by UUID)."""
        with slurm_pool(accelerator="A100:2") as pool:
            seen = gpus_seen() @ pool
            inventories = owned(pool)
            (job,) = {job for job, *_ in seen}
            fields = job_fields(typed, job)  # while it runs: the GPUs each node was given
        assert "TresPerNode=gres:gpu:a100:2" in fields
        # Both nodes (listed as one group) were given GPUs 2 and 3.
        assert re.search(r"Nodes=node\[0-1\] .*GRES=gpu:a100:2\(IDX:2-3\)", fields), fields
        assert inventories == [([2, 3], 6, [2, 3])] * 2
        granted = ",".join(UUIDS[2:4])
        assert [rest for _, *rest in seen] == [["A100-80GB", 2, (2, 3), granted]] * 2

    @pytest.mark.parametrize("gpus_0_and_1_taken", ["typed"], indirect=True)
    def test_gres_given_verbatim_is_asked_for_and_the_agent_keeps_slurms_devices(
        self, typed: SlurmCluster, gpus_0_and_1_taken: int, capfd: pytest.CaptureFixture[str]
    ) -> None:
        """``gres="gpu:a100:2"`` and no accelerator: asked for as written; the pool reports
        the two GPUs every node was given, and the agent's CUDA_VISIBLE_DEVICES is Slurm's."""
        provider = sky.Slurm(python=sys.executable, gres="gpu:a100:2")
        with sky.ComputePool(provider=provider, nodes=2) as pool:
            seen = gpus_seen() @ pool
            inventories = owned(pool)
        assert "every node has 2 x A100-80GB (CUDA 12.4)" in capfd.readouterr().err
        assert "TresPerNode=gres:gpu:a100:2" in job_fields(typed, seen[0][0])
        assert inventories == [([2, 3], 6, [2, 3])] * 2
        assert [rest for _, *rest in seen] == [["A100-80GB", 2, (2, 3), "2,3"]] * 2

    def test_a_type_the_site_lacks_is_a_config_error_with_nothing_queued(
        self, typed: SlurmCluster
    ) -> None:
        before = set(typed.run(["squeue", "-h", "-t", "all", "-o", "%i"]).stdout.split())
        began = time.monotonic()
        with pytest.raises(
            sky.ConfigError, match=r"'H100:2'.*the default partition has gpu:a100:8: no H100"
        ):
            with slurm_pool(accelerator="H100:2"):
                pass
        assert time.monotonic() - began < 15
        after = set(typed.run(["squeue", "-h", "-t", "all", "-o", "%i"]).stdout.split())
        assert after <= before, "a job was submitted"


class TestASiteWithoutGpuTypes:
    @pytest.mark.parametrize("gpus_0_and_1_taken", ["untyped"], indirect=True)
    def test_a_pool_asks_for_gpus_without_a_type(
        self, untyped: SlurmCluster, gpus_0_and_1_taken: int
    ) -> None:
        """``accelerator="A100:2"`` where the GPUs have no type: ``--gres=gpu:2``, and the host
        check finds that the two GPUs granted are A100s."""
        with slurm_pool(accelerator="A100:2") as pool:
            seen = gpus_seen() @ pool
            inventories = owned(pool)
        assert "TresPerNode=gres:gpu:2" in job_fields(untyped, seen[0][0])
        assert inventories == [([2, 3], 6, [2, 3])] * 2
        granted = ",".join(UUIDS[2:4])
        assert [rest for _, *rest in seen] == [["A100-80GB", 2, (2, 3), granted]] * 2
