"""What outlives a client, on the stand-in cluster: a client SIGKILLed inside its block leaves
pods that end themselves (the pod keeper), and ``skyward ls/down --provider kubernetes`` find
and remove them, selecting skyward's labels only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import skyward as sky
from tests.conftest import sigint_default
from tests.kubernetes.conftest import IMAGE, environment_with, foreign_pod, ours
from tests.support import bareroots
from tests.support.fakek8s import FakeCluster

pytestmark = pytest.mark.slow

HOLDER = """\
import sys, time
import skyward as sky

provider = sky.Kubernetes(build_env={{"UV_INDEX": {index!r}, "UV_HTTP_RETRIES": "0"}})
with sky.ComputePool(provider=provider, nodes=2, stream_output=False) as pool:
    print("READY", pool.pool_id, flush=True)
    time.sleep(600)
"""


def _skyward(*args: str, kubeconfig: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skyward.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment_with(kubeconfig),
        stdin=subprocess.DEVNULL,
    )


def test_a_killed_clients_pods_end_and_skyward_down_removes_them(
    cluster: FakeCluster,
    kubeconfig: Path,
    pod_index: bareroots.PackageIndex,
    tmp_path: Path,
) -> None:
    bobs = foreign_pod(cluster, "bobs-trainer")
    script = tmp_path / "holder.py"
    script.write_text(HOLDER.format(index=pod_index.simple_url))
    holder = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=environment_with(kubeconfig),
        preexec_fn=sigint_default,
    )
    try:
        assert holder.stdout is not None
        line = ""
        deadline = time.monotonic() + 120
        while not line.startswith("READY") and time.monotonic() < deadline:
            line = holder.stdout.readline()
            assert line or holder.poll() is None, "the holder ended before its pool was up"
        pool_id = line.split()[1]
        # Another process's live pool is listed with its pods.
        listed = _skyward("ls", "--provider", "kubernetes", kubeconfig=kubeconfig)
        assert listed.returncode == 0, listed.stderr
        assert pool_id in listed.stdout and listed.stdout.count(" pod sky-") == 2, listed.stdout
        assert "bobs-trainer" not in listed.stdout

        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
        killed = time.monotonic()
        mine = f"skyward.dev/pool={pool_id}"
        while time.monotonic() - killed < 90:
            phases = [p["status"].get("phase") for p in cluster.pods(selector=mine)]
            if "Running" not in phases:
                break
            time.sleep(1)
        phases = [p["status"].get("phase") for p in cluster.pods(selector=mine)]
        assert len(phases) == 2 and "Running" not in phases, phases
        assert time.monotonic() - killed < 90

        # The ended pods are still objects of the cluster: found, and removed by name.
        listed = _skyward("ls", "--provider", "kubernetes", kubeconfig=kubeconfig)
        assert pool_id in listed.stdout, listed.stdout
        down = _skyward("down", "--provider", "kubernetes", pool_id, kubeconfig=kubeconfig)
        assert down.returncode == 0, down.stderr
        assert down.stdout.count("removed pod") == 2 and "removed service" in down.stdout
        deadline = time.monotonic() + 30
        while ours(cluster) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ours(cluster) == []
        listed = _skyward("ls", "--provider", "kubernetes", kubeconfig=kubeconfig)
        assert pool_id not in listed.stdout
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
        _skyward("down", "--provider", "kubernetes", "--all", kubeconfig=kubeconfig)
    # bob's pod was never selected.
    assert (
        cluster.wait_phase("bobs-trainer", ("Running",))["metadata"]["uid"]
        == (bobs["metadata"]["uid"])
    )
    status, _ = cluster.request(
        "DELETE", "/api/v1/namespaces/default/pods/bobs-trainer", user="bob"
    )
    assert status == 200


def test_down_all_leaves_other_users_pods(cluster: FakeCluster, kubeconfig: Path) -> None:
    foreign_pod(cluster, "bobs-shell")
    try:
        down = _skyward("down", "--provider", "kubernetes", "--all", kubeconfig=kubeconfig)
        assert down.returncode == 0, down.stderr
        assert "bobs-shell" not in down.stdout
        assert cluster.wait_phase("bobs-shell", ("Running",))
    finally:
        cluster.request("DELETE", "/api/v1/namespaces/default/pods/bobs-shell", user="bob")


def test_ls_names_a_namespace_that_does_not_exist(cluster: FakeCluster, kubeconfig: Path) -> None:
    listed = _skyward("ls", "--provider", "kubernetes", "--namespace", "nowhere",
                      kubeconfig=kubeconfig)  # fmt: skip
    assert listed.returncode != 0
    assert "nowhere" in listed.stderr, listed.stderr
    assert "Traceback" not in listed.stderr, textwrap.shorten(listed.stderr, 2000)


def test_a_pod_that_runs_first_is_held_while_its_sibling_is_pulled(
    instance_root: Path,
    instance_wheels: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Node 0's pod runs at once; node 1's lands on a cold node whose pull takes 8 s, longer
    than the pods' idle_timeout of 3 s: node 0's pod must not end itself meanwhile."""
    from tests.kubernetes.conftest import SECOND_SUBNET, cluster_for

    nodes = [{"name": "warm", "max_pods": 1}, {"name": "cold", "pull_seconds": 8.0}]
    slow = cluster_for(tmp_path / "slow", instance_root, SECOND_SUBNET, nodes=nodes)
    try:
        monkeypatch.setenv("KUBECONFIG", str(slow.kubeconfig))
        with bareroots.PackageIndex(instance_wheels, host=slow.bridge) as index:
            provider = sky.Kubernetes(idle_timeout=3, build_env={"UV_INDEX": index.simple_url})
            with sky.ComputePool(provider=provider, nodes=2, stream_output=False) as pool:
                assert where_am_i() @ pool == [0, 1]
                placed = sorted(p["spec"]["nodeName"] for p in slow.pods())
                assert placed == ["cold", "warm"]
    finally:
        slow.stop()


@sky.compute
def where_am_i() -> int:
    return sky.instance_info().node


def test_down_all_removes_this_users_pools_only(cluster: FakeCluster, kubeconfig: Path) -> None:
    # Another skyward user's pool in the same namespace (bob's labels, bob's own token).
    theirs = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "sky-bobs-pool-0",
            "labels": {"app.kubernetes.io/managed-by": "skyward", "skyward.dev/pool": "bobs-pool",
                       "skyward.dev/user": "bob", "skyward.dev/node": "0"},
        },
        "spec": {"restartPolicy": "Never",
                 "containers": [{"name": "node", "image": IMAGE, "command": ["sleep", "600"]}]},
    }  # fmt: skip
    cluster.create_pod(theirs, user="bob")
    try:
        down = _skyward("down", "--provider", "kubernetes", "--all", kubeconfig=kubeconfig)
        assert down.returncode == 0, down.stderr
        assert "sky-bobs-pool-0" not in down.stdout
        listed = _skyward("ls", "--provider", "kubernetes", kubeconfig=kubeconfig)
        assert "bobs-pool  created" in listed.stdout and "by bob" in listed.stdout, listed.stdout
    finally:
        cluster.request("DELETE", "/api/v1/namespaces/default/pods/sky-bobs-pool-0", user="bob")
