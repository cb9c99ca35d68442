"""Pods held while their pool has them: one quiet command in each pod, from the moment it runs.

A skyward pod ends itself once nothing has run in it for ``idle_timeout`` (the pod keeper,
`skyward.worker.podkeeper`): that is how a pod whose client died stops holding its GPUs. Yet a
pod that runs early waits for the pool with nothing in it: its siblings pending (an autoscaler
adding nodes), a slow image pull on another node, a long build elsewhere. A hold is a shell in
the pod reading its stdin through the exec stream until the stream ends: while the client is
there, the pod is held; a client that dies closes the stream, the shell ends, and the keeper
ends the pod ``idle_timeout`` later, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from skyward.providers.kubernetes import execstream

if TYPE_CHECKING:
    from skyward.providers.kubernetes.api import KubeApi

# A shell builtin loop: no binary the image may lack, no CPU while it waits.
HOLD = "while read -r _; do :; done"


class Holds:
    """The holds of one pool's pods, on the pool's event loop."""

    def __init__(self, api: KubeApi) -> None:
        self.api = api
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def hold(self, pod: str) -> None:
        """Hold `pod` from now until `release` or `close` (best effort: a pod that cannot be
        held is one whose start fails on its own)."""
        if pod not in self._tasks:
            task = asyncio.get_running_loop().create_task(self._hold(pod))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._tasks[pod] = task

    async def _hold(self, pod: str) -> None:
        execution = await execstream.start(self.api, pod, HOLD)
        try:
            await asyncio.shield(execution.done)  # until the pod or the stream ends
        finally:
            await execution.close()

    async def release(self, pod: str) -> None:
        task = self._tasks.pop(pod, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    async def close(self) -> None:
        for pod in list(self._tasks):
            await self.release(pod)
