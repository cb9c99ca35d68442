"""A detached run on pods (``skyward run --detach --provider kubernetes``, docs/detach.md).

The pods hold the run, with no sshd in them and no credentials for the API server: node i's
agent opens a door on the pod network that admits node 0's leader alone (the ``tcp`` kind of
`skyward.detached.launch`; the door is `skyward.worker.supervisor`'s). The client keeps the
pool's pods when its pool ends (`Kubernetes.release`); its record keeps where they are (the
kubeconfig files, context and namespace the run was started with, and each node's pod), and a
later process reaches them through the API server's exec stream alone, as the pool did
(`PodCommands`). Once a later command sees the run ended and has kept its logs and outputs,
it deletes the pods and the Service (`RunPods`); until then each pod ends itself, its keeper
(`skyward.worker.podkeeper`) ending the container ``idle_timeout`` after the run's last
process in it (``--keep-for`` keeps one up that long after the run's end), so a run whose
client never comes back holds no node's CPU or GPU past its end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

from skyward.errors import ProvisionError, SkywardError
from skyward.providers.base import DetachedReach, KeptPool, NodeGone, Sink
from skyward.providers.kubernetes import connection, execstream, podspec
from skyward.providers.kubernetes.api import KubeApi, pool_selector
from skyward.providers.kubernetes.connection import Target

# How long the deletion of a run's pool may take before the command that asked gives up.
REMOVE_SECONDS = 60.0


def reach_of(target: Target, pods: Sequence[str], pool_id: str) -> DetachedReach:
    """What a detached run's record keeps to reach pods `pods` (node order) of pool `pool_id`
    later, and to delete them once it has ended: where they are and as whom, no secret (the
    credentials stay in the kubeconfig)."""
    where = {
        "files": [str(Path(f).expanduser().resolve()) for f in target.files],
        "context": target.context,
        "namespace": target.namespace,
    }
    kept = KeptPool(f"{RunPods.__module__}:{RunPods.__qualname__}", where, pool_id)
    return DetachedReach({**where, "pods": list(pods)}, kept)


def target_of(where: Mapping[str, Any]) -> Target:
    """The cluster a record names: its kubeconfig files, context and namespace as the run was
    started with; where those files are gone, the same context in today's kubeconfig."""
    files = tuple(str(f) for f in where.get("files") or ())
    context = where.get("context")
    namespace = str(where["namespace"])
    if files and not any(Path(f).is_file() for f in files):
        return connection.resolve(None if context is None else str(context), namespace)
    return Target(files, None if context is None else str(context), namespace)


class PodCommands:
    """Commands in a detached run's pods (`skyward.providers.base.NodeCommands`), one exec
    websocket each, through one API client made on the caller's loop when first needed."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.target = target_of(data)
        self.pods = [str(pod) for pod in data["pods"]]
        self._api: KubeApi | None = None
        self._opening: asyncio.Lock | None = None

    async def _open(self) -> KubeApi:
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:  # every node's command at once: one client for them all
            if self._api is None:
                self._api = await KubeApi.open(self.target)
            return self._api

    async def run(self, node: int, command: str, sink: Sink) -> int:
        api = await self._open()
        pod = self.pods[node]
        # stdin from /dev/null in the pod: an exec of the v4 protocol cannot close its own.
        argv = ["sh", "-c", f"exec </dev/null; {command}"]
        try:
            ws = await execstream.connect(api, pod, argv)
        except ProvisionError as exc:
            raise await _why_not(api, pod, exc) from None
        status = bytearray()
        try:
            # Read here rather than through `execstream.Exec`, which hands every frame on at
            # once: awaiting the sink before the next frame leaves the rest in the socket, so
            # a large log or tar stream comes at the pace it is written here.
            async for message in ws:
                if (framed := execstream.channel_frame(message)) is None:
                    continue
                channel, payload = framed
                if channel == execstream.STDOUT and payload:
                    await sink(payload)
                elif channel == execstream.STATUS:
                    status += payload
        finally:
            await ws.close()
        code, said = execstream.exit_code(bytes(status))
        if code is None:
            raise ConnectionError(f"pod {pod}: {said}")
        return code

    async def drop(self, node: int) -> None:
        return None  # each command is its own websocket: nothing of a node's stays open

    async def close(self) -> None:
        if self._api is not None:
            api, self._api = self._api, None
            await api.close()


async def _why_not(api: KubeApi, pod: str, refused: ProvisionError) -> SkywardError:
    """Why an exec in `pod` was refused: `NodeGone` for a pod that is gone or has ended (no
    exec will reach it again), else the refusal itself."""
    try:
        found = await api.core.read_namespaced_pod(pod, api.namespace)
    except ApiException as exc:
        if exc.status == 404:
            return NodeGone(
                f"pod {pod} is gone from namespace {api.namespace} (deleted, or its node "
                "lost): what the run left in it went with it"
            )
        return refused
    except (aiohttp.ClientError, OSError, TimeoutError):
        return refused
    phase = found.status.phase if found.status else None
    if phase in ("Succeeded", "Failed"):
        return NodeGone(
            f"pod {pod} has ended ({phase}): its keeper ends it once nothing of the run has run "
            "in it for its idle_timeout (--keep-for keeps it that much longer after the run's "
            "end), and what the run left in it went with it"
        )
    return refused


class RunPods:
    """The pool a detached run held, as a later process finds it again (`KeptPool`) to delete
    its pods and Service once the run has ended and its logs and outputs are kept."""

    def __init__(self, files: Sequence[str], context: str | None, namespace: str) -> None:
        self.target = target_of({"files": files, "context": context, "namespace": namespace})

    def remove_pool(self, pool_id: str) -> list[str]:
        """Delete pool `pool_id`'s pods and Service (by skyward's labels); what was deleted.
        `TimeoutError` after `REMOVE_SECONDS` of an API server that does not answer: the
        caller says so, and `skyward down` removes them later."""
        return asyncio.run(asyncio.wait_for(self._remove(pool_id), REMOVE_SECONDS))

    async def _remove(self, pool_id: str) -> list[str]:
        api = await KubeApi.open(self.target)
        try:
            return await api.delete_pool(pool_selector(podspec.pool_label(pool_id)))
        finally:
            await api.close()
