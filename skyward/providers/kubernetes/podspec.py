"""What skyward asks a cluster for: one bare Pod per node and a headless Service, as manifests.

Every node's pod has the same spec but for its name and node label (a gang scheduler such as
Kueue admits them together): ``restartPolicy: Never``, the pod keeper as its one container's
process (`skyward.worker.podkeeper`), a memory ``emptyDir`` at ``/dev/shm`` (NCCL's shared
memory; a container's default is 64 MiB), no service links or token it does not need, and
``hostname``/``subdomain`` under the Service, so node i is ``<pod>.<service>.<namespace>.svc``
to the others before it is even ready (``publishNotReadyAddresses``).

GPUs: ``accelerator="H100:8"`` asks ``nvidia.com/gpu: 8`` of each pod and requires a node whose
GPU-type label names an H100, by the labels the cluster's nodes carry: NVIDIA's GPU feature
discovery (``nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3``), GKE
(``cloud.google.com/gke-accelerator: nvidia-h100-80gb``) or Karpenter on EKS
(``karpenter.k8s.aws/instance-gpu-name: h100``). The values are those the nodes listed carry
that name the GPU, and the usual ones besides (nodes an autoscaler has not made yet carry none).
``"GPU:8"`` asks 8 of any type. A GPU pod tolerates the ``nvidia.com/gpu`` taint.

With a Kueue LocalQueue (``queue=``) the pods carry Kueue's plain-pod group labels, so the
queue admits the whole pool at once or none of it.
"""

from __future__ import annotations

import getpass
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from skyward import checks
from skyward.errors import ConfigError
from skyward.hardware import Accelerator
from skyward.providers.kubernetes.api import MANAGED_BY, NODE, POOL, POOL_ID, USER
from skyward.providers.kubernetes.execstream import CONTAINER
from skyward.worker import podkeeper

GPU_RESOURCE = "nvidia.com/gpu"
GPU_LABELS = (
    "nvidia.com/gpu.product",
    "cloud.google.com/gke-accelerator",
    "karpenter.k8s.aws/instance-gpu-name",
)
ANY_GPU = "GPU"
KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP = "kueue.x-k8s.io/pod-group-name"
KUEUE_GROUP_COUNT = "kueue.x-k8s.io/pod-group-total-count"

# The values each label key takes for common GPUs where no node can be listed (a namespaced
# Role) or none carries them yet (an autoscaled node pool): NVIDIA GPU feature discovery's
# product names, GKE's accelerator names and Karpenter's GPU names.
_KNOWN: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "H100": (
        ("NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe", "NVIDIA-H100-NVL"),
        ("nvidia-h100-80gb", "nvidia-h100-mega-80gb"),
        ("h100",),
    ),
    "H200": (("NVIDIA-H200", "NVIDIA-H200-NVL"), ("nvidia-h200-141gb",), ("h200",)),
    "B200": (("NVIDIA-B200",), ("nvidia-b200",), ("b200",)),
    "A100": (
        (
            "NVIDIA-A100-SXM4-80GB",
            "NVIDIA-A100-SXM4-40GB",
            "NVIDIA-A100-PCIE-40GB",
            "NVIDIA-A100-80GB-PCIe",
        ),
        ("nvidia-tesla-a100", "nvidia-a100-80gb"),
        ("a100",),
    ),
    "L4": (("NVIDIA-L4",), ("nvidia-l4",), ("l4",)),
    "L40S": (("NVIDIA-L40S",), (), ("l40s",)),
    "T4": (("Tesla-T4",), ("nvidia-tesla-t4",), ("t4",)),
    "V100": (("Tesla-V100-SXM2-16GB", "Tesla-V100-SXM2-32GB"), ("nvidia-tesla-v100",), ("v100",)),
    "A10G": (("NVIDIA-A10G",), (), ("a10g",)),
}


def default_image() -> str:
    """An official Python image of the client's minor version."""
    return f"python:{sys.version_info.major}.{sys.version_info.minor}-slim"


def dns_label(text: str, limit: int = 63) -> str:
    """`text` as a DNS-1123 label (lower case, digits, ``-``; at most `limit`)."""
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:limit].strip("-")
    return label or "x"


def label_value(text: str) -> str:
    """`text` as a label value (63 characters of ``[A-Za-z0-9._-]``, alphanumeric ends)."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:63]
    return value.strip("-._")


def user_label() -> str:
    try:
        return label_value(getpass.getuser()) or "unknown"
    except (KeyError, OSError):
        return "unknown"


def service_name(pool: str) -> str:
    return dns_label(f"sky-{pool}", 63)


def pod_name(pool: str, index: int, generation: int = 0) -> str:
    suffix = f"-{index}" if generation == 0 else f"-{index}-r{generation}"
    return f"{dns_label(f'sky-{pool}', 63 - len(suffix))}{suffix}"


def pool_label(pool: str) -> str:
    return label_value(pool.lower())


def labels(pool: str, index: int | None = None) -> dict[str, str]:
    found = {MANAGED_BY: "skyward", POOL: pool_label(pool), USER: user_label()}
    if index is not None:
        found[NODE] = str(index)
    return found


def _words(text: str) -> list[str]:
    return [word for word in re.split(r"[^a-z0-9]+", text.lower()) if word]


def names_gpu(value: str, name: str) -> bool:
    """Whether a GPU-type label's value names GPU `name`: every word of the name is a word of
    the value (``H100`` is in ``NVIDIA-H100-80GB-HBM3``, ``A100-80GB`` in
    ``NVIDIA-A100-SXM4-80GB``; ``H100`` is not in ``NVIDIA-H1000``)."""
    have = set(_words(value))
    return all(word in have for word in _words(name))


def gpu_values(name: str, nodes: Sequence[Mapping[str, str]] | None) -> dict[str, list[str]]:
    """For each GPU-type label key, the values that name GPU `name`: those the listed nodes
    carry, and the usual ones of that GPU (`_KNOWN`, by the name's first word: an
    ``A100-80GB`` keeps only those that name it whole, ``nvidia-a100-80gb`` and not
    ``nvidia-tesla-a100``, the 40 GB one)."""
    found: dict[str, set[str]] = {key: set() for key in GPU_LABELS}
    for node in nodes or ():
        for key in GPU_LABELS:
            value = node.get(key)
            if value and names_gpu(value, name):
                found[key].add(value)
    words = _words(name)
    usual = _KNOWN.get(words[0].upper(), ((), (), ())) if words else ((), (), ())
    for key, values in zip(GPU_LABELS, usual, strict=True):
        # Karpenter's names are the GPU's alone (``a100``; its memory is another label): only
        # the first word must match them. GFD's and GKE's name the model whole.
        whole = key != GPU_LABELS[2]
        found[key].update(v for v in values if not whole or names_gpu(v, name))
    return {key: sorted(values) for key, values in found.items() if values}


def gpu_affinity(values: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    """A required node affinity: any of the label keys with one of its values (terms are ORed)."""
    terms = [
        {"matchExpressions": [{"key": key, "operator": "In", "values": list(vals)}]}
        for key, vals in values.items()
    ]
    required = {"nodeSelectorTerms": terms}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}


_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_PULL_POLICIES = ("Always", "IfNotPresent", "Never")


@dataclass(frozen=True)
class PodSettings:
    """What every pod of a pool is given beside its node's GPUs: the image and its pull policy,
    the seconds a pod outlives its last process (`podkeeper`), the CPUs and memory it requests
    (its limit too, for memory: the scheduler places it by them, and a pod without requests is
    the first evicted), and the Kueue LocalQueue that admits the pool's pods as one group."""

    image: str
    idle: float
    pull_policy: str | None = None
    cpus: float | None = None
    memory: str | None = None
    queue: str | None = None

    def __post_init__(self) -> None:
        if self.pull_policy not in (None, *_PULL_POLICIES):
            raise ConfigError(
                f"image_pull_policy must be {', '.join(_PULL_POLICIES)}, got {self.pull_policy!r}"
            )
        if self.cpus is not None:
            checks.seconds(self.cpus, "cpus")  # a positive, finite number (of CPUs here)
        if self.memory is not None and (
            not isinstance(self.memory, str) or not _QUANTITY.match(self.memory)
        ):
            raise ConfigError(
                f"memory must be a Kubernetes quantity such as '32Gi' or '500M', got "
                f"{self.memory!r}"
            )
        if self.queue is not None and label_value(str(self.queue)) != self.queue:
            raise ConfigError(f"queue must be a LocalQueue's name, got {self.queue!r}")


def pod(
    *,
    name: str,
    pool: str,
    index: int,
    nodes: int,
    service: str,
    settings: PodSettings,
    accelerator: Accelerator | None,
    python: str = "python3",
    gpu_labels: Mapping[str, Sequence[str]] | None,
    env: Mapping[str, str],
) -> dict[str, Any]:
    """The manifest of node `index`'s pod (of `nodes`), its keeper run by the image's
    `python`."""
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": settings.image,
        "command": [python, "-c", podkeeper.program(), f"{settings.idle:g}"],
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if settings.pull_policy:
        container["imagePullPolicy"] = settings.pull_policy
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "hostname": name,
        "subdomain": service,
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        # The keeper ends on SIGTERM at once; the agents are the pool's to stop before.
        "terminationGracePeriodSeconds": 5,
    }
    _place_resources(container, spec, settings, accelerator, gpu_labels)
    metadata = _metadata(name, pool, index, nodes, settings)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def _place_resources(
    container: dict[str, Any],
    spec: dict[str, Any],
    settings: PodSettings,
    accelerator: Accelerator | None,
    gpu_labels: Mapping[str, Sequence[str]] | None,
) -> None:
    """The container's requests and limits (CPUs, memory, GPUs), and for GPUs the pod's
    toleration and node affinity."""
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if settings.cpus is not None:
        requests["cpu"] = f"{settings.cpus:g}"
    if settings.memory is not None:
        requests["memory"] = limits["memory"] = settings.memory
    if accelerator is not None and not accelerator.is_tpu:
        limits[GPU_RESOURCE] = str(accelerator.count)
        spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
        if accelerator.name != ANY_GPU and gpu_labels:
            spec["affinity"] = gpu_affinity(gpu_labels)
    if requests or limits:
        container["resources"] = {
            key: value for key, value in (("requests", requests), ("limits", limits)) if value
        }


def _metadata(
    name: str, pool: str, index: int, nodes: int, settings: PodSettings
) -> dict[str, Any]:
    """The pod's name, labels and annotations (Kueue's group with a queue)."""
    metadata: dict[str, Any] = {
        "name": name,
        "labels": labels(pool, index),
        "annotations": {POOL_ID: pool},
    }
    if settings.queue is not None:
        # Kueue's plain-pod groups: the pool's pods are admitted together or not at all.
        metadata["labels"][KUEUE_QUEUE] = settings.queue
        metadata["labels"][KUEUE_GROUP] = pool_label(pool)
        metadata["annotations"][KUEUE_GROUP_COUNT] = str(nodes)
    return metadata


def service(pool: str, name: str) -> dict[str, Any]:
    """The pool's headless Service: DNS names for its pods, ready or not."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels(pool), "annotations": {POOL_ID: pool}},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {POOL: pool_label(pool)},
        },
    }
