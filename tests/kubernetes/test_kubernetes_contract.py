"""The Kubernetes provider passes the provider contract on the stand-in cluster
(`tests.support.fakek8s`): its pods are the nodes, reached through the API server alone."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import skyward as sky
from tests.contract import PROBE, ProviderContract
from tests.kubernetes.conftest import MakeProvider, cluster_for, ours
from tests.support import wheels
from tests.support.fakek8s import FakeCluster

pytestmark = pytest.mark.slow

OURS = "app.kubernetes.io/managed-by=skyward"


@pytest.fixture(scope="module")
def cluster(instance_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeCluster]:
    """Namespace ``small`` has a ResourceQuota of one pod: a 2-node pool there gets one."""
    made = cluster_for(
        tmp_path_factory.mktemp("k8s-contract"),
        instance_root,
        namespaces=("default", "small"),
        pod_quotas={"small": 1},
    )
    try:
        yield made
    finally:
        made.stop()


def _wait_no_pods(cluster: FakeCluster, timeout: float = 30) -> list[str]:
    """Wait until skyward has no pod or Service left in the cluster's namespaces; what is left."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for namespace in ("default", "small"):
            left += [p["metadata"]["name"] for p in ours(cluster, namespace)]
            left += [s["metadata"]["name"] for s in cluster.services(namespace, OURS)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


class TestKubernetesContract(ProviderContract):
    @pytest.fixture
    def make_provider(
        self, kube: MakeProvider, cluster: FakeCluster, pod_index: object
    ) -> Callable[[], object]:
        self.cluster = cluster
        self.index = pod_index
        return kube

    @pytest.fixture
    def make_broken_provider(
        self, kube: MakeProvider, cluster: FakeCluster
    ) -> Callable[[], object]:
        """A namespace whose quota admits one pod: the second pod is refused."""
        self.cluster = cluster
        return lambda: kube(namespace="small")

    @pytest.fixture
    def nodes_available(self) -> int:
        return 2

    def probe_image(self, directory: Path, token: str) -> sky.Image:
        """The pods cannot see this machine's files: the probe wheel is served by their index."""
        folder = Path(self.index.directory)  # type: ignore[attr-defined]
        wheels.make_wheel(
            folder, PROBE, "1.0", {"skyward_contract_probe/__init__.py": f"TOKEN = {token!r}\n"}
        )
        return sky.Image(pip=[f"{PROBE}==1.0"])

    def discard_environment(self, prefix: str) -> None:
        """The environments live in the pods' filesystems, which go with the pods."""

    @pytest.fixture(autouse=True)
    def _nothing_left(self, cluster: FakeCluster) -> Iterator[None]:
        yield
        assert _wait_no_pods(cluster) == []

    def assert_nothing_left(self, provider: object, pool: sky.ComputePool) -> None:
        assert _wait_no_pods(self.cluster) == []

    @contextlib.contextmanager
    def expect_nothing_launched(self, provider: object, pool: sky.ComputePool) -> Iterator[None]:
        before = self.cluster.request("GET", "/api/v1/namespaces/default/events")[1]["items"]
        yield
        assert _wait_no_pods(self.cluster, 0) == []
        after = self.cluster.request("GET", "/api/v1/namespaces/default/events")[1]["items"]
        made = [e for e in after[len(before) :] if e["involvedObject"]["name"].startswith("sky-")]
        assert made == [], "the pool made pods"

    def assert_outputs_removed(self, where: str) -> None:
        """A pod's filesystem goes with the pod."""
        assert _wait_no_pods(self.cluster) == []

    def assert_gone(self, provider: object, pids: list[int]) -> None:
        assert _wait_no_pods(self.cluster) == []

    def test_image_is_built_once_and_reused(
        self, make_provider: Callable[[], object], nodes_available: int, tmp_path: Path
    ) -> None:
        """A pool's pods are new pods: each builds the image once, in its own filesystem, and
        a second pool's pods build it again (nothing of a pod outlives it)."""
        from tests.contract import probe_environment

        token = "k8s-" + str(time.monotonic_ns())
        image = self.probe_image(tmp_path / "wheels", token)
        with sky.ComputePool(provider=make_provider(), nodes=2, image=image,  # type: ignore[arg-type]
                             stream_output=False) as pool:  # fmt: skip
            rows = probe_environment() @ pool
        assert [row[0] for row in rows] == [0, 1]
        assert all(row[3] == token for row in rows), "the pods do not see the built package"
