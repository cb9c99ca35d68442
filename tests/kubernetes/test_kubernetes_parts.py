"""The Kubernetes provider's parts that need no cluster: the kubeconfig's context and namespace,
the pod's manifest for GPUs, the exec stream's status, and the pod keeper in a PID namespace of
its own (as in a container)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import skyward as sky
from skyward.hardware import Accelerator
from skyward.providers.kubernetes import connection, execstream, podspec
from skyward.worker import podkeeper


def _kubeconfig(path: Path, contexts: dict[str, str | None], current: str | None) -> Path:
    body = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [
            {
                "name": name,
                "context": {"cluster": "c", "user": "u", **({"namespace": ns} if ns else {})},
            }
            for name, ns in contexts.items()
        ],
        "current-context": current,
    }
    path.write_text(json.dumps(body))
    return path


def test_the_context_and_namespace_come_from_the_kubeconfig(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _kubeconfig(tmp_path / "config", {"a": "team-a", "b": None}, "a")
    monkeypatch.setenv("KUBECONFIG", str(config))
    assert connection.resolve(None, None) == connection.Target((str(config),), "a", "team-a")
    assert connection.resolve("b", None).namespace == "default"
    assert connection.resolve("a", "mine").namespace == "mine"
    with pytest.raises(sky.ConfigError, match=r"context .nope. is not in the kubeconfig.*a, b"):
        sky.Kubernetes(context="nope")


def test_no_kubeconfig_says_where_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(sky.ConfigError, match="no kubeconfig found: set KUBECONFIG"):
        sky.Kubernetes()


def test_an_h100_is_matched_by_the_labels_the_nodes_carry() -> None:
    nodes = [
        {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        {"nvidia.com/gpu.product": "NVIDIA-H1000-Fake"},
        {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
        {"karpenter.k8s.aws/instance-gpu-name": "h100"},
    ]
    values = podspec.gpu_values("H100", nodes)
    products = values["nvidia.com/gpu.product"]
    assert "NVIDIA-H100-80GB-HBM3" in products and "NVIDIA-H1000-Fake" not in products
    assert not any("A100" in v for v in products)
    assert values["karpenter.k8s.aws/instance-gpu-name"] == ["h100"]
    assert "nvidia-h100-80gb" in values["cloud.google.com/gke-accelerator"]


def test_a_gpu_is_matched_by_its_words_even_where_no_node_can_be_listed() -> None:
    # A namespaced Role cannot list nodes: GPU feature discovery's usual names are asked.
    h100 = podspec.gpu_values("H100", None)
    assert "NVIDIA-H100-80GB-HBM3" in h100["nvidia.com/gpu.product"]
    a100 = podspec.gpu_values("A100-80GB", [{"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}])
    assert a100["nvidia.com/gpu.product"] == ["NVIDIA-A100-80GB-PCIe", "NVIDIA-A100-SXM4-80GB"]
    assert a100["cloud.google.com/gke-accelerator"] == ["nvidia-a100-80gb"]  # not the 40 GB
    assert a100["karpenter.k8s.aws/instance-gpu-name"] == ["a100"]
    assert not podspec.names_gpu("NVIDIA-H1000-Fake", "H100")


def test_a_gpu_pod_asks_for_its_gpus_tolerates_their_taint_and_has_shared_memory() -> None:
    labels = podspec.gpu_values("H100", [{"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}])
    manifest = podspec.pod(
        name="sky-p-0", pool="p", index=0, nodes=2, service="sky-p",
        settings=podspec.PodSettings("img", 30),
        accelerator=Accelerator.parse("H100:8"), gpu_labels=labels, env={},
    )  # fmt: skip
    spec = manifest["spec"]
    (container,) = spec["containers"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "8"}}
    assert spec["restartPolicy"] == "Never"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    expressions = [t["matchExpressions"][0] for t in terms]
    (products,) = [e for e in expressions if e["key"] == "nvidia.com/gpu.product"]
    assert products["operator"] == "In" and "NVIDIA-H100-80GB-HBM3" in products["values"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in spec["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert manifest["metadata"]["labels"]["skyward.dev/pool"] == "p"
    any_gpu = podspec.pod(
        name="sky-p-0", pool="p", index=0, nodes=2, service="sky-p",
        settings=podspec.PodSettings("img", 30),
        accelerator=Accelerator.parse("GPU:2"), gpu_labels=None, env={},
    )  # fmt: skip
    assert "affinity" not in any_gpu["spec"]
    assert any_gpu["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"


def test_cpus_memory_and_a_kueue_queue_reach_every_pod() -> None:
    settings = podspec.PodSettings("img", 30, cpus=7.5, memory="60Gi", queue="team-a-queue")
    manifests = [
        podspec.pod(
            name=f"sky-p-{i}", pool="p", index=i, nodes=3, service="sky-p", settings=settings,
            accelerator=Accelerator.parse("GPU:1"), gpu_labels=None, env={},
        )
        for i in range(3)
    ]  # fmt: skip
    for manifest in manifests:
        (container,) = manifest["spec"]["containers"]
        assert container["resources"] == {
            "requests": {"cpu": "7.5", "memory": "60Gi"},
            "limits": {"memory": "60Gi", "nvidia.com/gpu": "1"},
        }
        meta = manifest["metadata"]
        assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "team-a-queue"
        assert meta["labels"]["kueue.x-k8s.io/pod-group-name"] == "p"
        assert meta["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "3"
    # The pods' specs are the same but for their names: a gang scheduler sees one shape.
    specs = [dict(m["spec"], hostname=None) for m in manifests]
    assert specs[0] == specs[1] == specs[2]


@pytest.mark.parametrize(
    ("setting", "value"),
    [("cpus", 0), ("cpus", "2"), ("cpus", float("nan")), ("memory", "lots"), ("memory", 64),
     ("queue", "no spaces"), ("image_pull_policy", "Sometimes")],
)  # fmt: skip
def test_bad_pod_settings_are_config_errors_naming_them(
    setting: str, value: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path / "config", {"a": None}, "a")))
    with pytest.raises(sky.ConfigError, match=setting):
        sky.Kubernetes(**{setting: value})


def test_names_are_what_kubernetes_accepts() -> None:
    name = podspec.pod_name("My_Pool.Name-" + "x" * 80 + "-1234abcd", 3, 2)
    assert len(name) <= 63 and name.endswith("-3-r2")
    assert all(c.isalnum() or c == "-" for c in name) and name == name.lower()
    assert podspec.label_value("a b/c" + "d" * 90)[-1].isalnum()


def test_the_exit_code_is_read_from_the_status_channel() -> None:
    assert execstream.exit_code(b'{"metadata":{},"status":"Success"}') == (0, "")
    failure = {
        "status": "Failure",
        "message": "command terminated with non-zero exit code",
        "reason": "NonZeroExitCode",
        "details": {"causes": [{"reason": "ExitCode", "message": "3"}]},
    }
    assert execstream.exit_code(json.dumps(failure).encode())[0] == 3
    assert execstream.exit_code(b"")[0] is None


_UNSHARE = shutil.which("unshare")


@pytest.mark.skipif(
    os.geteuid() != 0 or _UNSHARE is None, reason="needs root and unshare (a PID namespace)"
)
def test_the_pod_keeper_ends_after_its_last_process(tmp_path: Path) -> None:
    # The keeper as a container's init: a PID namespace with its own /proc, where a second
    # process (an exec's) holds it until that process ends.
    script = tmp_path / "keeper.py"
    script.write_text(podkeeper.program())
    started = time.monotonic()
    keeper = subprocess.Popen(
        [_UNSHARE, "--pid", "--fork", "--mount-proc", "sh", "-c",
         f"{sys.executable} {script} 1 & sleep 3; wait"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    out, _ = keeper.communicate(timeout=30)
    took = time.monotonic() - started
    assert keeper.returncode == 0, out
    assert "nothing ran in the pod for 1 s" in out
    # Held while `sleep 3` ran (and its shell): it cannot have ended before.
    assert took >= 3.0, (took, out)


_DASH = shutil.which("dash")


@pytest.mark.skipif(_DASH is None, reason="needs dash (the sh of Debian-based images)")
def test_the_kill_command_ends_a_whole_group_under_dash() -> None:
    # A command started in a session of its own with a child of its own, as an exec's is.
    group = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60"], start_new_session=True)
    time.sleep(0.3)
    children = Path(f"/proc/{group.pid}/task/{group.pid}/children").read_text().split()
    assert children, "the command has no child yet"
    assert _DASH is not None
    subprocess.run([_DASH, "-c", execstream.kill_command([group.pid])], check=True)
    group.wait(10)
    deadline = time.monotonic() + 5
    while any(_alive(int(c)) for c in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(int(c)) for c in children), "a child outlived its group's kill"


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its new parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
