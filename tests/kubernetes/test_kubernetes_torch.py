"""The PyTorch plugin on two pods of the stand-in cluster: torch installed in the pods from the
index they reach, one gloo process group across the pods (node 0 by its Service name as
MASTER_ADDR), and DDP steps ending bit-identical."""

from __future__ import annotations

import glob
import importlib.metadata
import os
import shutil
from pathlib import Path

import cloudpickle
import pytest

import skyward as sky
import tests.test_torch
from tests.kubernetes.conftest import MakeProvider, wait_none_left
from tests.support import bareroots
from tests.support.fakek8s import FakeCluster
from tests.test_torch import group_and_env, train_ddp

pytestmark = pytest.mark.slow

TORCH = importlib.metadata.version("torch").split("+")[0]


@pytest.fixture(autouse=True)
def _torch_calls_by_value() -> None:
    cloudpickle.register_pickle_by_value(tests.test_torch)  # the pods cannot import the tests


def _cpu_wheel() -> Path:
    """The CPU build of this client's torch for Python 3.11, where pip finds local wheels (a
    CUDA build from PyPI would be gigabytes)."""
    places = [*os.environ.get("PIP_FIND_LINKS", "").split(), "/opt/wheels"]
    for place in places:
        for found in glob.glob(os.path.join(place, f"torch-{TORCH}+cpu-cp311-*.whl")):
            return Path(found)
    pytest.skip(f"no CPU wheel of torch {TORCH} for Python 3.11 on this machine")


def test_ddp_across_two_pods_ends_with_bit_identical_parameters(
    cluster: FakeCluster, kube: MakeProvider, pod_index: bareroots.PackageIndex
) -> None:
    folder = Path(pod_index.directory)
    wheel = _cpu_wheel()
    if not (folder / wheel.name).exists():
        shutil.copy2(wheel, folder / wheel.name)
    needs = [
        r.split(";")[0] for r in importlib.metadata.requires("torch") or [] if "extra" not in r
    ]
    try:
        bareroots.download_wheels(folder, needs, python_version="3.11")
    except Exception as exc:  # no network: skip, do not fail
        pytest.skip(f"cannot download torch's dependencies: {exc}")
    image = sky.Image(
        pip=[f"torch=={TORCH}", "numpy"], indexes=[sky.Index(pod_index.simple_url, default=True)]
    )
    with sky.ComputePool(
        provider=kube(), nodes=2, image=image, plugins=[sky.plugins.torch()], stream_output=False
    ) as pool:
        seen = group_and_env() @ pool
        first, second = train_ddp(30) @ pool
        head = pool.nodes[0].private_addr
    for node, found in enumerate(seen):
        assert (found["backend"], found["rank"], found["world"]) == ("gloo", node, 2)
        assert found["env"]["MASTER_ADDR"] == head and head.endswith(".svc")
    assert first == second
    assert wait_none_left(cluster) == []
