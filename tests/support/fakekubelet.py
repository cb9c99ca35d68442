"""The scheduler and the kubelet of the Kubernetes stand-in (`tests.support.fakek8s`).

The scheduler places a pending pod on a node of the stand-in's list that tolerates-free taints,
matching node affinity and ``nodeSelector``, and enough free ``nvidia.com/gpu`` allow; where
none does, the pod's ``PodScheduled`` condition says ``Unschedulable`` with the message the
real scheduler writes (``0/2 nodes are available: 2 Insufficient nvidia.com/gpu. ...``) and a
``FailedScheduling`` event, retried every second as the real one does on a change.

The kubelet runs a placed pod's one container as real processes (`tests.support.podruntime`): a
network namespace of its own on the stand-in's bridge with the pod's IP, an overlay of the
image's layers (a cached Debian root, and folders above it; an image the stand-in does not know
fails its pull with ``ErrImagePull`` then ``ImagePullBackOff``), the container's command as PID
1, the pod's ``/etc/hosts`` holding the names of every pod under the same headless Service (the
cluster's DNS, which the stand-in has not: its resolver is an address with no route). A
container that ends makes the pod ``Succeeded`` or ``Failed`` with its exit code; a deleted pod
gets SIGTERM, then SIGKILL after its grace period.

What it cannot imitate: a CNI (pods reach each other and the bridge's address only, no Service
IPs, no NetworkPolicy), image pulls (an image is a name for folders on this machine), resource
limits (no cgroups: ``nvidia.com/gpu`` is only counted, no device is given), probes, restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import shutil
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support import podruntime

__all__ = ["GPU", "Kubelet", "Node", "condition", "gpu_request", "now", "schedule"]

GPU = "nvidia.com/gpu"
PAUSE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class Node:
    """A node of the stand-in: its name, labels, GPUs and taints (``{"key", "effect"}``)."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)
    gpus: int = 0
    taints: list[dict[str, str]] = field(default_factory=list)
    max_pods: int = 110  # the kubelet's default
    pull_seconds: float = 0.0  # how long an image takes to be pulled there (a cold node)

    def manifest(self) -> dict[str, Any]:
        capacity = {"cpu": "2", "memory": "24Gi", "pods": str(self.max_pods)}
        if self.gpus:
            capacity[GPU] = str(self.gpus)
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": {**self.labels, "kubernetes.io/hostname":
                                                       self.name}},
            "spec": {"taints": self.taints} if self.taints else {},
            "status": {"capacity": capacity, "allocatable": capacity},
        }  # fmt: skip


def gpu_request(pod: Mapping[str, Any]) -> int:
    total = 0
    for container in pod["spec"].get("containers", []):
        resources = container.get("resources") or {}
        asked = (resources.get("limits") or {}).get(GPU) or (resources.get("requests") or {}).get(
            GPU
        )
        total += int(asked or 0)
    return total


def _expression(labels: Mapping[str, str], expr: Mapping[str, Any]) -> bool:
    key, op, values = expr["key"], expr["operator"], expr.get("values") or []
    if op == "In":
        return labels.get(key) in values
    if op == "NotIn":
        return labels.get(key) not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    return False


def _affinity(pod: Mapping[str, Any], node: Node) -> bool:
    spec = pod["spec"]
    labels = {**node.labels, "kubernetes.io/hostname": node.name}
    for key, value in (spec.get("nodeSelector") or {}).items():
        if labels.get(key) != value:
            return False
    required = (
        ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        )
        or {}
    ).get("nodeSelectorTerms")
    if not required:
        return True
    return any(
        all(_expression(labels, e) for e in term.get("matchExpressions") or []) for term in required
    )


def _tolerated(pod: Mapping[str, Any], node: Node) -> bool:
    tolerations = pod["spec"].get("tolerations") or []
    for taint in node.taints:
        if taint.get("effect") not in ("NoSchedule", "NoExecute"):
            continue
        if not any(
            t.get("key") in (None, taint["key"])
            and (t.get("operator") == "Exists" or t.get("value") == taint.get("value"))
            and t.get("effect") in (None, "", taint["effect"])
            for t in tolerations
        ):
            return False
    return True


def schedule(
    pod: Mapping[str, Any], nodes: list[Node], used: Mapping[str, int], held: Mapping[str, int]
) -> str:
    """The node to place `pod` on, given the GPUs `used` and the pods `held` on each node, or
    raise `ValueError` with the scheduler's message."""
    want = gpu_request(pod)
    reasons: dict[str, int] = {}
    for node in nodes:
        if not _tolerated(pod, node):
            taint = node.taints[0]
            reason = f"node(s) had untolerated taint {{{taint['key']}: {taint.get('value', '')}}}"
        elif not _affinity(pod, node):
            reason = "node(s) didn't match Pod's node affinity/selector"
        elif want and node.gpus - used.get(node.name, 0) < want:
            reason = f"Insufficient {GPU}"
        elif held.get(node.name, 0) >= node.max_pods:
            reason = "Too many pods"
        else:
            return node.name
        reasons[reason] = reasons.get(reason, 0) + 1
    parts = ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items()))
    total = len(nodes)
    raise ValueError(
        f"0/{total} nodes are available: {parts}. preemption: 0/{total} nodes are available: "
        f"{total} No preemption victims found for incoming pod."
    )


@dataclass
class Sandbox:
    """A placed pod's sandbox: its network namespace, folder and container."""

    host: Any  # sshd.NetnsHost
    folder: Path
    container: podruntime.Container | None = None


class Kubelet:
    """Runs the pods of the stand-in (`Cluster` calls it); `report(pod)` publishes a change."""

    def __init__(
        self,
        *,
        net: Any,  # sshd.NetnsHosts, built with no host
        workdir: Path,
        images: Mapping[str, str | list[str]],
        report: Callable[[dict[str, Any]], None],
        event: Callable[[dict[str, Any], str, str, str], None],
        owner: Callable[[], None],
        pull_seconds: Mapping[str, float] | None = None,
    ) -> None:
        self.net = net
        self.workdir = workdir
        self.images = dict(images)
        self.report = report
        self.event = event
        self.owner = owner
        self.pull_seconds = dict(pull_seconds or {})  # node -> seconds an image pull takes
        self.sandboxes: dict[str, Sandbox] = {}  # pod uid -> sandbox
        self.subnet = ipaddress.IPv4Network(str(net.subnet))
        self._offsets: set[int] = set()

    # -- addresses -----------------------------------------------------------------------------

    def _claim_offset(self) -> int:
        offset = 11
        while offset in self._offsets:
            offset += 1
        if offset >= 250:
            raise RuntimeError("the stand-in's subnet has no free pod address")
        self._offsets.add(offset)
        return offset

    # -- a pod's life --------------------------------------------------------------------------

    async def run(self, pod: dict[str, Any], hosts_text: Callable[[], str]) -> None:
        """Pull, create and start `pod`'s container, and follow it until it ends."""
        uid = pod["metadata"]["uid"]
        container = pod["spec"]["containers"][0]
        image = container["image"]
        root = self._image_root(image)
        if root is None:
            await self._pull_fails(pod, image)
            return
        slow = self.pull_seconds.get(pod["spec"].get("nodeName", ""), 0.0)
        if slow:
            self.event(pod, "Normal", "Pulling", f'Pulling image "{image}"')
            await asyncio.sleep(slow)
            if pod["metadata"].get("deletionTimestamp"):
                return
        self.event(pod, "Normal", "Pulled", f'Container image "{image}" already present on machine')
        offset = self._claim_offset()
        address = str(self.subnet.network_address + offset)
        folder = self.workdir / "pods" / uid
        try:
            host = await asyncio.to_thread(self.net.add_namespace, offset, address)
        except BaseException:
            self._offsets.discard(offset)
            raise
        sandbox = Sandbox(host, folder)
        self.sandboxes[uid] = sandbox
        self.owner()
        hostname = pod["spec"].get("hostname") or pod["metadata"]["name"]
        namespace = pod["metadata"]["namespace"]
        pod["status"]["podIP"] = address
        pod["status"]["podIPs"] = [{"ip": address}]
        pod["status"]["hostIP"] = str(self.subnet.network_address + 1)
        files = {
            "hosts": hosts_text(),
            "hostname": hostname + "\n",
            "resolv.conf": (
                f"search {namespace}.svc.cluster.local svc.cluster.local cluster.local\n"
                f"nameserver {self.net.unreachable_address}\noptions ndots:5\n"
            ),
        }
        podruntime.prepare_folder(folder, files)
        env = {"PATH": PAUSE_PATH, "HOSTNAME": hostname, "HOME": "/root"}
        env.update({e["name"]: str(e.get("value", "")) for e in container.get("env") or []})
        argv = [*(container.get("command") or []), *(container.get("args") or [])]
        volumes = self._volumes(pod, container, folder)
        self.event(pod, "Normal", "Created", f"Created container {container['name']}")
        try:
            self._find(root, argv[0] if argv else "", env["PATH"])
            started = await podruntime.start(
                netns=host.netns,
                layers=root,
                folder=folder,
                hostname=hostname,
                argv=argv,
                env=env,
                cwd=container.get("workingDir") or "/",
                volumes=volumes,
            )
        except (OSError, podruntime.LaunchError) as exc:
            message = f"failed to create containerd task: failed to create shim task: {exc}"
            self._terminated(pod, 128, "StartError", message)
            self.event(pod, "Warning", "Failed", f"Error: {message}")
            self.report(pod)
            return
        sandbox.container = started
        started_at = now()
        pod["status"]["phase"] = "Running"
        pod["status"]["startTime"] = started_at
        pod["status"]["containerStatuses"] = [
            _status(container, {"running": {"startedAt": started_at}}, ready=True)
        ]
        condition(pod, "Initialized", "True")
        condition(pod, "ContainersReady", "True")
        condition(pod, "Ready", "True")
        self.event(pod, "Normal", "Started", f"Started container {container['name']}")
        self.report(pod)
        code = await started.wait()
        if pod["metadata"].get("deletionTimestamp"):
            return  # the deletion reports the end
        self._terminated(pod, code, "Completed" if code == 0 else "Error", None)
        self.report(pod)

    def _image_root(self, image: str) -> list[Path] | None:
        """The image's layers, top first (the config names a root, or a list of folders)."""
        for name in (image, image.removeprefix("docker.io/library/")):
            if name in self.images:
                found = self.images[name]
                return [Path(p) for p in ([found] if isinstance(found, str) else found)]
        return None

    @staticmethod
    def _find(layers: list[Path], command: str, path: str) -> None:
        """What execve would say of `command` in the image (its first layer that has it)."""
        error: OSError | None = None
        for layer in layers:
            try:
                podruntime.find_executable(layer, command, path)
                return
            except OSError as exc:
                error = error or exc
        assert error is not None
        raise error

    async def _pull_fails(self, pod: dict[str, Any], image: str) -> None:
        ref = image if "/" in image else f"docker.io/library/{image}"
        reference = ref if ":" in ref.rsplit("/", 1)[-1] else f"{ref}:latest"
        message = (
            f'rpc error: code = NotFound desc = failed to pull and unpack image "{reference}": '
            f'failed to resolve reference "{reference}": {reference}: not found'
        )
        container = pod["spec"]["containers"][0]
        self.event(pod, "Normal", "Pulling", f'Pulling image "{image}"')
        await asyncio.sleep(0.3)
        self.event(pod, "Warning", "Failed", f'Failed to pull image "{image}": {message}')
        self.event(pod, "Warning", "Failed", "Error: ErrImagePull")
        pod["status"]["containerStatuses"] = [
            _status(container, {"waiting": {"reason": "ErrImagePull", "message": message}})
        ]
        self.report(pod)
        await asyncio.sleep(1.0)
        if pod["metadata"].get("deletionTimestamp"):
            return
        back_off = f'Back-off pulling image "{image}"'
        self.event(pod, "Normal", "BackOff", back_off)
        pod["status"]["containerStatuses"] = [
            _status(container, {"waiting": {"reason": "ImagePullBackOff", "message": back_off}})
        ]
        self.report(pod)

    def _volumes(
        self, pod: Mapping[str, Any], container: Mapping[str, Any], folder: Path
    ) -> list[podruntime.Volume]:
        declared = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        volumes: list[podruntime.Volume] = []
        for mount in container.get("volumeMounts") or []:
            volume = declared.get(mount["name"], {})
            empty = volume.get("emptyDir")
            if empty is None:
                continue  # only emptyDir volumes are imitated
            if empty.get("medium") == "Memory":
                volumes.append(podruntime.Volume(mount["mountPath"], True))
            else:
                source = folder / "volumes" / mount["name"]
                source.mkdir(parents=True, exist_ok=True)
                volumes.append(podruntime.Volume(mount["mountPath"], False, source=source))
        return volumes

    def _terminated(self, pod: dict[str, Any], code: int, reason: str, message: str | None) -> None:
        container = pod["spec"]["containers"][0]
        state: dict[str, Any] = {
            "exitCode": code,
            "reason": reason,
            "startedAt": pod["status"].get("startTime"),
            "finishedAt": now(),
        }
        if message:
            state["message"] = message
        pod["status"]["containerStatuses"] = [_status(container, {"terminated": state})]
        pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
        condition(pod, "Ready", "False", "PodCompleted")
        condition(pod, "ContainersReady", "False", "PodCompleted")

    async def stop(self, pod: dict[str, Any], grace: float) -> None:
        """End `pod`'s container (SIGTERM, SIGKILL after `grace` seconds) and free its sandbox."""
        sandbox = self.sandboxes.pop(pod["metadata"]["uid"], None)
        if sandbox is None:
            return
        container = sandbox.container
        if container is not None and container.running:
            if grace > 0:
                container.signal(signal.SIGTERM)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(container.wait(), grace)
            container.signal(signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(container.wait(), 10)
        await asyncio.to_thread(self.net.remove_namespace, sandbox.host)
        self._offsets.discard(int(ipaddress.IPv4Address(sandbox.host.address)) -
                              int(self.subnet.network_address))  # fmt: skip
        self.owner()
        with contextlib.suppress(OSError):
            shutil.rmtree(sandbox.folder)

    def rewrite_hosts(self, uid: str, text: str) -> None:
        sandbox = self.sandboxes.get(uid)
        if sandbox is not None:
            with contextlib.suppress(OSError):
                podruntime.write_in_place(sandbox.folder / "etc" / "hosts", text)

    def container(self, uid: str) -> podruntime.Container | None:
        sandbox = self.sandboxes.get(uid)
        return None if sandbox is None else sandbox.container

    def log(self, uid: str) -> bytes:
        sandbox = self.sandboxes.get(uid)
        if sandbox is None:
            return b""
        with contextlib.suppress(OSError):
            return (sandbox.folder / "container.log").read_bytes()
        return b""

    async def close(self) -> None:
        for uid in list(self.sandboxes):
            sandbox = self.sandboxes[uid]
            if sandbox.container is not None:
                sandbox.container.signal(signal.SIGKILL)
        for uid in list(self.sandboxes):
            sandbox = self.sandboxes.pop(uid)
            if sandbox.container is not None:
                with contextlib.suppress(TimeoutError, ProcessLookupError):
                    await asyncio.wait_for(sandbox.container.wait(), 10)
            with contextlib.suppress(Exception):
                self.net.remove_namespace(sandbox.host)
            with contextlib.suppress(OSError):
                shutil.rmtree(sandbox.folder)


def now() -> str:
    import datetime

    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(
    container: Mapping[str, Any], state: dict[str, Any], ready: bool = False
) -> dict[str, Any]:
    return {
        "name": container["name"],
        "image": container["image"],
        "imageID": "",
        "ready": ready,
        "restartCount": 0,
        "started": "running" in state,
        "state": state,
    }


def condition(pod: dict[str, Any], kind: str, status: str, reason: str | None = None,
               message: str | None = None) -> None:  # fmt: skip
    conditions = pod["status"].setdefault("conditions", [])
    conditions[:] = [c for c in conditions if c["type"] != kind]
    entry: dict[str, Any] = {"type": kind, "status": status, "lastTransitionTime": now()}
    if reason:
        entry["reason"] = reason
    if message:
        entry["message"] = message
    conditions.append(entry)
