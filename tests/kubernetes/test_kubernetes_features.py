"""Everything else a pool does, on pods of the stand-in cluster: a lost pod replaced and the
call resumed from its checkpoint (``restarts=``), a list of contexts as failover, a budget kept
with the price the user gives, an API server that speaks only the older exec protocol (v4),
the scheduler's reason on the console while a pod waits, and ``skyward run``."""

from __future__ import annotations

import shutil
import sys
import time
import zipfile
from pathlib import Path

import pytest

import skyward as sky
from skyward.cli import runner
from skyward.cli.profiles import Profile
from tests.contract import PROBE
from tests.kubernetes.conftest import (
    SECOND_SUBNET,
    MakeProvider,
    cluster_for,
    ours,
    wait_none_left,
)
from tests.support import bareroots, wheels
from tests.support.fakek8s import V4, FakeCluster

pytestmark = pytest.mark.slow


@sky.compute
def pod_name() -> str:
    import socket

    return socket.gethostname()


def test_a_lost_pod_is_replaced_and_the_call_resumes_from_its_checkpoint(
    cluster: FakeCluster, kube: MakeProvider, tmp_path: Path
) -> None:
    from tests.test_restarts import checkpoint_then_lose_node_1

    with sky.ComputePool(
        provider=kube(), nodes=2, restarts=1, output_dir=tmp_path / "runs", stream_output=False
    ) as pool:
        before = pod_name() @ pool
        after = checkpoint_then_lose_node_1() @ pool
        now = pod_name() @ pool
    assert [state for state, _ in after] == ["step 5", "step 5"]
    # node 0 kept its pod; node 1 is a new pod of the same pool
    assert now[0] == before[0] and now[1] != before[1], (before, now)
    assert now[1].startswith(before[1]) and now[1].endswith("-r1")
    assert wait_none_left(cluster) == []


def test_a_context_whose_pods_cannot_be_placed_is_left_for_the_next(
    cluster: FakeCluster,
    instance_root: Path,
    pod_index: bareroots.PackageIndex,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    # The first context's only node is reserved (a taint its pods do not tolerate).
    reserved = [{"name": "infra-1", "taints": [{"key": "dedicated", "value": "infra",
                                                 "effect": "NoSchedule"}]}]  # fmt: skip
    full = cluster_for(tmp_path / "full", instance_root, SECOND_SUBNET, nodes=reserved,
                       context="full")  # fmt: skip
    try:
        monkeypatch.setenv("KUBECONFIG", f"{full.kubeconfig}:{cluster.kubeconfig}")
        provider = sky.Kubernetes(
            context=["full", "fake"],
            pending_timeout=3,
            build_env={"UV_INDEX": pod_index.simple_url, "UV_HTTP_RETRIES": "0"},
        )
        with sky.ComputePool(provider=provider, nodes=2) as pool:
            names = pod_name() @ pool
            assert len(ours(cluster)) == 2
        err = capfd.readouterr().err
        assert "untolerated taint {dedicated: infra}" in err, err
        assert "trying context fake" in err, err
        assert [n.startswith(f"sky-{pool.pool_id}") for n in names] == [True, True]
        assert full.pods() == [] and full.services() == []
    finally:
        full.stop()


@sky.compute
def work(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


def test_a_budget_is_kept_with_the_price_the_user_gives(kube: MakeProvider) -> None:
    # $1 a second a pod, billed by the second: 2 pods spend $12 in about 6 s.
    provider = kube(price_per_hour=3600)
    with pytest.raises(sky.BudgetExceeded) as caught:
        with sky.ComputePool(provider=provider, nodes=2, max_cost=60.0, stream_output=False) as p:
            work(120) @ p
    assert caught.value.max_cost == 60.0 and 60.0 <= caught.value.spent < 70.0


def test_an_api_server_that_speaks_only_v4_runs_a_pool(
    instance_root: Path,
    pod_index: bareroots.PackageIndex,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    older = cluster_for(tmp_path / "v4", instance_root, SECOND_SUBNET, protocols=(V4,))
    try:
        monkeypatch.setenv("KUBECONFIG", str(older.kubeconfig))
        with bareroots.PackageIndex(Path(pod_index.directory), host=older.bridge) as index:
            provider = sky.Kubernetes(build_env={"UV_INDEX": index.simple_url})
            with sky.ComputePool(provider=provider, nodes=2, stream_output=False) as pool:
                assert pod_name() @ pool == [f"sky-{pool.pool_id}-0", f"sky-{pool.pool_id}-1"]
    finally:
        older.stop()


def test_the_console_says_why_a_pod_waits(
    instance_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    small = cluster_for(
        tmp_path / "small", instance_root, SECOND_SUBNET,
        nodes=[{"name": "gpu-1", "gpus": 2,
                "labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}],
    )  # fmt: skip
    try:
        monkeypatch.setenv("KUBECONFIG", str(small.kubeconfig))
        # An L4 asked where only H100s are: the affinity on the GPU labels rules the node out.
        with pytest.raises(sky.ProvisionError, match="didn't match Pod's node affinity"):
            with sky.ComputePool(provider=sky.Kubernetes(pending_timeout=3), nodes=1,
                                 accelerator="L4:1"):  # fmt: skip
                pytest.fail("no L4 in the cluster")
        err = capfd.readouterr().err
        assert "pending: 0/1 nodes are available" in err, err
        assert small.pods() == []
    finally:
        small.stop()


RANKS = """\
import os, socket, sys
coordinator = os.environ["JAX_COORDINATOR_ADDRESS"].rsplit(":", 1)[0]
print("rank", os.environ["JAX_PROCESS_ID"], "of", os.environ["JAX_NUM_PROCESSES"],
      "on", socket.gethostname(), "reaches", socket.gethostbyname(coordinator), flush=True)
sys.exit(int(os.environ["JAX_PROCESS_ID"]) * int(sys.argv[1]))
"""


def test_skyward_run_on_pods(
    cluster: FakeCluster,
    kubeconfig: Path,
    pod_index: bareroots.PackageIndex,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    profile = Profile(
        provider="kubernetes",
        options={"build_env": {"UV_INDEX": pod_index.simple_url}},
        nodes=2,
    )
    assert runner.run(profile, str(script), ["0"]) == runner.RunEnd(0)
    out = capsys.readouterr().out
    heads = set()
    for node in (0, 1):
        line = next(x for x in out.splitlines() if f"(node {node}) rank {node} of 2" in x)
        heads.add(line.rsplit(" ", 1)[1])
    assert len(heads) == 1 and heads.pop().startswith("10.213."), out
    outcome = runner.run(profile, str(script), ["3"])
    assert outcome == runner.RunEnd(3, "rank 1 exited with status 3")
    assert wait_none_left(cluster) == []


def test_a_client_in_a_pod_uses_its_service_account(
    cluster: FakeCluster,
    pod_index: bareroots.PackageIndex,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from skyward.providers.kubernetes import connection

    # What the kubelet mounts in a pod with a service account, and the variables it sets.
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(cluster.token())
    (account / "ca.crt").write_bytes(cluster.ca)
    (account / "namespace").write_text("team-a")
    monkeypatch.setattr(connection, "SERVICE_ACCOUNT", account)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(cluster.port))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    provider = sky.Kubernetes(build_env={"UV_INDEX": pod_index.simple_url})
    assert provider.targets[0].in_cluster and provider.targets[0].namespace == "team-a"
    with sky.ComputePool(provider=provider, nodes=1, stream_output=False) as pool:
        assert pod_name() >> pool == f"sky-{pool.pool_id}-0"
        assert len(ours(cluster, "team-a")) == 1 and ours(cluster) == []
    assert wait_none_left(cluster, namespace="team-a") == []


@sky.compute
def interpreter() -> tuple[str, str]:
    import skyward_contract_probe  # type: ignore[import-not-found]  # only in the image

    return sys.prefix, skyward_contract_probe.TOKEN


def test_an_image_that_has_what_the_pool_asks_is_used_as_it_is(
    instance_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An image with the agent's packages and the pool's own in its python3 (as a CUDA image
    with jax or torch has them): the pods run that python3, and build nothing."""
    import importlib.util

    layer = tmp_path / "layer"
    site = layer / "usr/local/lib/python3.11/dist-packages"
    for name in ("cloudpickle", "packaging"):
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None
        shutil.copytree(Path(spec.origin).parent, site / name)
        for info in Path(spec.origin).parent.parent.glob(f"{name}-*.dist-info"):
            shutil.copytree(info, site / info.name)
    wheels.make_wheel(tmp_path / "probe", PROBE, "1.0",
                      {"skyward_contract_probe/__init__.py": "TOKEN = 'baked in'\n"})  # fmt: skip
    (wheel,) = (tmp_path / "probe").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    images = {"ml-image:1": [str(layer), str(instance_root)]}
    baked = FakeCluster(tmp_path / "baked", subnet=SECOND_SUBNET, images=images).start()
    try:
        monkeypatch.setenv("KUBECONFIG", str(baked.kubeconfig))
        # No index at all: any build would fail, since the pods reach nothing.
        provider = sky.Kubernetes(image="ml-image:1", build_env={"UV_OFFLINE": "1"})
        with sky.ComputePool(
            provider=provider, nodes=2, image=sky.Image(pip=[PROBE]), stream_output=False
        ) as pool:
            assert interpreter() @ pool == [("/usr", "baked in")] * 2
    finally:
        baked.stop()
