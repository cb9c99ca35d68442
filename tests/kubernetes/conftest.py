"""Fixtures for the Kubernetes provider: a stand-in API server whose pods are bare Debian roots
(`tests.support.fakek8s`), a kubeconfig for it in ``KUBECONFIG``, and a package index on its
bridge (the only thing the pods reach).

The cluster is made once per module (a fresh one costs about a second, a pod less than one);
each test's pools are its own. Pods are on 10.213.40.0/24, a second cluster (failover, a strict
one) on 10.213.41.0/24 (`SKYWARD_TEST_K8S_SUBNETS` moves both). Everything skips, saying why,
without root or network namespaces, or where the root or the wheels cannot be fetched.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import skyward as sky
from tests.support import bareroots
from tests.support.fakek8s import FakeCluster, User

# Two runs of these tests at once (two checkouts on one machine) each need subnets of their own:
# SKYWARD_TEST_K8S_SUBNETS="10.213.42.0/24,10.213.43.0/24" gives the second its pair.
SUBNET, SECOND_SUBNET = os.environ.get(
    "SKYWARD_TEST_K8S_SUBNETS", "10.213.40.0/24,10.213.41.0/24"
).split(",")
IMAGE = f"python:{bareroots.SUITE_PYTHON[bareroots.MACHINE_SUITE]}-slim"


@pytest.fixture(autouse=True)
def _functions_by_value(request: pytest.FixtureRequest) -> None:
    # The pods cannot import the test modules: their functions travel with their code.
    if request.module is not None:
        cloudpickle.register_pickle_by_value(request.module)


def cluster_for(workdir: Path, root: Path, subnet: str = SUBNET, **kwargs: Any) -> FakeCluster:
    """A started stand-in whose one image (`IMAGE`, the provider's default for this Python) is
    `root`; two users: alice (everything) and bob (the other user of the namespace)."""
    kwargs.setdefault("users", {"alice": User("alice"), "bob": User("bob")})
    kwargs.setdefault("namespaces", ("default", "team-a"))
    return FakeCluster(workdir, subnet=subnet, images={IMAGE: str(root)}, **kwargs).start()


@pytest.fixture(scope="module")
def cluster(instance_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeCluster]:
    if shutil.which("nsenter") is None or shutil.which("unshare") is None:
        pytest.skip("the pods need nsenter and unshare (util-linux)")
    made = cluster_for(tmp_path_factory.mktemp("k8s"), instance_root)
    try:
        yield made
    finally:
        made.stop()


@pytest.fixture
def kubeconfig(cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    return cluster.kubeconfig


@pytest.fixture(scope="module")
def pod_index(
    cluster: FakeCluster, instance_wheels: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[bareroots.PackageIndex]:
    """The machines' wheels served on the cluster's bridge; its folder is the module's own
    (links to the cache), so a test may add a wheel to it."""
    folder = tmp_path_factory.mktemp("pod-index")
    for wheel in instance_wheels.iterdir():
        try:
            os.link(wheel, folder / wheel.name)
        except OSError:  # another filesystem
            shutil.copy2(wheel, folder / wheel.name)
    with bareroots.PackageIndex(folder, host=cluster.bridge) as index:
        yield index


MakeProvider = Callable[..., sky.Kubernetes]


@pytest.fixture
def kube(kubeconfig: Path, pod_index: bareroots.PackageIndex) -> MakeProvider:
    """`kube(**kwargs)`: `sky.Kubernetes` on the stand-in, building from the served index."""

    def make(**kwargs: Any) -> sky.Kubernetes:
        build_env = {"UV_INDEX": pod_index.simple_url, "UV_HTTP_RETRIES": "0"}
        build_env.update(kwargs.pop("build_env", {}))
        return sky.Kubernetes(build_env=build_env, **kwargs)

    return make


def ours(cluster: FakeCluster, namespace: str = "default") -> list[dict[str, Any]]:
    """Every pod skyward made in `namespace` that is still there."""
    return cluster.pods(namespace, "app.kubernetes.io/managed-by=skyward")


def wait_none_left(
    cluster: FakeCluster, timeout: float = 30, namespace: str = "default"
) -> list[str]:
    """Wait until skyward has no pod left in `namespace`; the names still there at `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p["metadata"]["name"] for p in ours(cluster, namespace)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def foreign_pod(cluster: FakeCluster, name: str = "bobs-notebook") -> dict[str, Any]:
    """A pod of another user (bob) beside the pools: never to be touched."""
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "notebook"}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": IMAGE, "command": ["sleep", "3600"]}],
        },
    }
    cluster.create_pod(manifest, user="bob")
    return cluster.wait_phase(name, ("Running",))


def environment_with(kubeconfig: Path) -> dict[str, str]:
    return {**os.environ, "KUBECONFIG": str(kubeconfig)}


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1)[:4000]
