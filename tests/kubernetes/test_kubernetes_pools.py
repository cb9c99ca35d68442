"""Pools of pods on the stand-in cluster (`tests.support.fakek8s`): nodes as pods reached through
the API server's exec stream alone, their names and addresses, the JAX plugin across pods, why
a pool cannot start (the scheduler's and the kubelet's words), and nothing left behind."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import skyward as sky
from tests.kubernetes.conftest import MakeProvider, dump, foreign_pod, ours, wait_none_left
from tests.support.fakek8s import FakeCluster

pytestmark = pytest.mark.slow

POOL_LABEL = "skyward.dev/pool"


@sky.compute
def where() -> tuple[int, str, str, str, str]:
    info = sky.instance_info()
    own = socket.gethostbyname(socket.gethostname())
    return info.node, own, socket.gethostname(), info.head_addr, info.pool_id


def test_three_pods_are_three_nodes_in_order_and_go_with_the_block(
    cluster: FakeCluster, kube: MakeProvider
) -> None:
    bobs = foreign_pod(cluster)
    with sky.ComputePool(provider=kube(), nodes=3) as pool:
        results = where() @ pool
        pods = {p["metadata"]["name"]: p for p in ours(cluster)}
        services = cluster.services(selector="app.kubernetes.io/managed-by=skyward")
    ended = time.monotonic()
    assert [r[0] for r in results] == [0, 1, 2]
    ips = [r[1] for r in results]
    assert len(set(ips)) == 3, results
    pool_id = results[0][4]
    labelled = {
        p["status"]["podIP"]: p for p in pods.values()
        if p["metadata"]["labels"][POOL_LABEL] == pool_id.lower()
    }  # fmt: skip
    assert set(ips) == set(labelled), dump(pods)
    for node, ip, hostname, _, _ in results:
        pod = labelled[ip]
        assert pod["metadata"]["labels"]["skyward.dev/node"] == str(node)
        assert pod["spec"]["hostname"] == hostname
        assert pod["spec"]["restartPolicy"] == "Never"
    # Node 0 by its stable name under the headless Service, which every pod resolves.
    head = results[0][3]
    assert head.startswith(f"{labelled[ips[0]]['metadata']['name']}.") and head.endswith(".svc")
    assert len(services) == 1 and services[0]["spec"]["clusterIP"] == "None"
    assert wait_none_left(cluster, 30) == []
    assert time.monotonic() - ended < 30
    assert cluster.services(selector="app.kubernetes.io/managed-by=skyward") == []
    # The other user's pod was never touched.
    now = cluster.wait_phase(bobs["metadata"]["name"], ("Running",))
    assert now["metadata"]["uid"] == bobs["metadata"]["uid"]
    assert "deletionTimestamp" not in now["metadata"]
    status, _ = cluster.request("DELETE", "/api/v1/namespaces/default/pods/bobs-notebook",
                                user="bob")  # fmt: skip
    assert status == 200


@sky.compute
def psum_everywhere() -> tuple[int, int, float, int]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(jax.devices(), ("d",))
    local = np.full((jax.local_device_count(),), jax.process_index() + 1.0, np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), local)
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
    return jax.process_index(), jax.process_count(), float(total), jax.device_count()


def test_jax_spans_two_pods_with_wheels_from_the_images_index(
    cluster: FakeCluster, kube: MakeProvider, pod_index: object
) -> None:
    index = getattr(pod_index, "simple_url")  # noqa: B009 - the served index's address
    image = sky.Image(pip=["jax", "jaxlib"], indexes=[sky.Index(index, default=True)])
    with sky.ComputePool(
        provider=kube(), nodes=2, image=image, plugins=[sky.plugins.jax()]
    ) as pool:
        results = psum_everywhere() @ pool
    assert [(r[0], r[1]) for r in results] == [(0, 2), (1, 2)]
    devices = results[0][3]
    # Each process holds one CPU device, filled with its index + 1: the sum crosses both pods.
    assert results[0][2] == results[1][2] == float(sum(range(1, 3))) * devices / 2
    asked = [path for path in pod_index.requests if "jax" in path]  # type: ignore[attr-defined]
    assert asked, "the pods did not install jax from the image's index"
    assert wait_none_left(cluster, 30) == []


def test_gpus_no_node_has_fail_with_the_schedulers_words_in_time(
    cluster: FakeCluster, kube: MakeProvider
) -> None:
    started = time.monotonic()
    with pytest.raises(sky.ProvisionError, match=r"Insufficient nvidia\.com/gpu") as caught:
        with sky.ComputePool(provider=kube(), nodes=2, accelerator="GPU:8"):
            pytest.fail("no node has 8 GPUs")
    took = time.monotonic() - started
    assert took < 60, (took, str(caught.value))
    assert "pending_timeout" in str(caught.value)
    assert wait_none_left(cluster, 10) == []


def test_an_image_that_does_not_exist_fails_at_once_naming_it(
    cluster: FakeCluster, kube: MakeProvider
) -> None:
    started = time.monotonic()
    with pytest.raises(sky.ProvisionError) as caught:
        with sky.ComputePool(provider=kube(image="example.invalid/no-such:1"), nodes=2):
            pytest.fail("the image cannot be pulled")
    took = time.monotonic() - started
    message = str(caught.value)
    assert "example.invalid/no-such:1" in message and "ErrImagePull" in message, message
    assert took < 60
    assert wait_none_left(cluster, 10) == []


def test_a_namespace_that_does_not_exist_is_a_config_error_with_nothing_made(
    cluster: FakeCluster, kube: MakeProvider
) -> None:
    with pytest.raises(sky.ConfigError, match="no-such-ns"):
        with sky.ComputePool(provider=kube(namespace="no-such-ns"), nodes=1):
            pytest.fail("there is no such namespace")
    for namespace in ("default", "team-a"):
        assert ours(cluster, namespace) == []


def test_a_verb_rbac_forbids_is_named_before_any_pod(
    tmp_path: Path, instance_root: Path, pod_index: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.kubernetes.conftest import SECOND_SUBNET, cluster_for
    from tests.support.fakek8s import User

    users = {"alice": User("alice", deny=["create pods/exec"])}
    strict = cluster_for(tmp_path / "strict", instance_root, SECOND_SUBNET, users=users)
    try:
        monkeypatch.setenv("KUBECONFIG", str(strict.kubeconfig))
        with pytest.raises(sky.ConfigError, match=r"RBAC forbids.*create pods/exec"):
            with sky.ComputePool(provider=sky.Kubernetes(), nodes=1):
                pytest.fail("exec is forbidden")
        assert strict.pods() == [] and strict.services() == []
    finally:
        strict.stop()


def test_a_context_not_in_the_kubeconfig_is_named(kubeconfig: Path) -> None:
    with pytest.raises(sky.ConfigError, match=r"context 'elsewhere' is not in the kubeconfig"):
        sky.Kubernetes(context="elsewhere")


def test_an_image_without_python3_fails_at_once_naming_it(
    instance_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.kubernetes.conftest import SECOND_SUBNET

    # An image whose root has a shell but no python3 (a distroless or a busybox image).
    bare = tmp_path / "no-python"
    for folder in ("bin", "etc", "proc", "sys", "dev", "tmp"):
        (bare / folder).mkdir(parents=True)
    images = {"tools:1": [str(bare)]}
    cluster = FakeCluster(tmp_path / "k8s", subnet=SECOND_SUBNET, images=images).start()
    try:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
        started = time.monotonic()
        with pytest.raises(sky.ProvisionError) as caught:
            with sky.ComputePool(provider=sky.Kubernetes(image="tools:1"), nodes=1):
                pytest.fail("the container cannot start")
        message = str(caught.value)
        assert "'tools:1'" in message and "python3" in message, message
        assert time.monotonic() - started < 30
        assert cluster.pods() == []
    finally:
        cluster.stop()


@pytest.fixture
def broken_cluster(instance_root: Path, tmp_path: Path) -> Iterator[FakeCluster]:
    """A cluster of its own whose image ``broken:1`` has a python3 that crashes at start (a
    broken interpreter, a wrong architecture)."""
    from tests.kubernetes.conftest import SECOND_SUBNET

    layer = tmp_path / "broken"
    (layer / "usr/local/bin").mkdir(parents=True)
    crash = layer / "usr/local/bin/python3"
    crash.write_text("#!/bin/sh\necho 'Fatal Python error: init_fs_encoding' >&2\nexit 1\n")
    crash.chmod(0o755)
    images = {"broken:1": [str(layer), str(instance_root)]}
    cluster = FakeCluster(tmp_path / "k8s", subnet=SECOND_SUBNET, images=images).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def test_a_container_that_crashes_fails_at_once_with_its_last_lines(
    broken_cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(broken_cluster.kubeconfig))
    with pytest.raises(sky.ProvisionError) as caught:
        with sky.ComputePool(provider=sky.Kubernetes(image="broken:1"), nodes=2):
            pytest.fail("the container crashes")
    message = str(caught.value)
    assert "'broken:1'" in message and "exit code 1" in message, message
    assert "Fatal Python error: init_fs_encoding" in message, message
    assert wait_none_left(broken_cluster) == []


def test_an_exec_into_a_container_that_ended_says_why_it_ended(
    broken_cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API server refuses an exec into a container that ended with a bare HTTP 400; the
    pool's start may reach that exec when the crash comes between the pod's Running and its
    first command. The error is then the crash's, as when the watch sees it first."""
    from skyward.providers.kubernetes import connection, execstream
    from skyward.providers.kubernetes.api import KubeApi

    monkeypatch.setenv("KUBECONFIG", str(broken_cluster.kubeconfig))
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "crashed"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {"name": execstream.CONTAINER, "image": "broken:1", "command": ["python3"]}
            ],
        },
    }
    broken_cluster.create_pod(manifest)
    broken_cluster.wait_phase("crashed", ("Failed",))

    async def exec_into_it() -> str:
        api = await KubeApi.open(connection.resolve(None, None))
        try:
            with pytest.raises(sky.ProvisionError) as caught:
                await execstream.connect(api, "crashed", ["true"])
            return str(caught.value)
        finally:
            await api.close()

    message = asyncio.run(exec_into_it())
    assert message.startswith("pod crashed cannot start:"), message
    assert "'broken:1'" in message and "exit code 1" in message, message
    assert "Fatal Python error: init_fs_encoding" in message, message
