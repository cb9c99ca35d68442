"""A pod as the remote machinery sees it: a `Host` whose commands run through the exec stream.

The bootstrap (`remote.bootstrap`: the host check, skyward's source, uv, the environment), the
data trees and the outputs run on a pod exactly as on an SSH host; only the transport differs
(`execstream`). A command cancelled half-way is killed in the pod by another exec; the pod's
deletion removes whatever is left.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from skyward.errors import ProvisionError
from skyward.providers.kubernetes import execstream
from skyward.providers.kubernetes.api import KubeApi
from skyward.providers.remote.bootstrap import RemoteNode
from skyward.providers.remote.host import StreamedProcess
from skyward.transport.base import AgentStream
from skyward.transport.sshhost import OUTPUT_TAIL_LINES, Completed


class PodHost:
    """One pod of the pool: its name, its address, and commands in it."""

    def __init__(self, api: KubeApi, pod: str, address: str) -> None:
        self.api = api
        self.pod = pod
        self.address = address
        self.closed = False
        self.groups = execstream.PodGroups(self.kill_groups)
        self._open: set[execstream.Exec] = set()

    def __str__(self) -> str:
        return f"pod {self.pod}"

    async def start_exec(self, command: str, v4_input: int | None = None) -> execstream.Exec:
        if self.closed:
            raise ProvisionError(f"{self} was let go")
        execution = await execstream.start(self.api, self.pod, command, v4_input)
        self._open.add(execution)
        execution.done.add_done_callback(lambda _: self._open.discard(execution))
        return execution

    async def run(
        self, command: str, input: bytes = b"", log: Callable[[str], None] | None = None
    ) -> Completed:
        execution = await self.start_exec(command, len(input))
        out = bytearray()
        tail: list[str] = []
        pending = b""

        def stdout(data: bytes) -> None:
            out.extend(data)

        def stderr(data: bytes) -> None:
            nonlocal pending
            if data:
                *lines, pending = (pending + data).split(b"\n")
            else:  # the end: a last line without its newline
                lines, pending = ([pending] if pending else []), b""
            for line in lines:
                text = line.decode(errors="replace").rstrip("\r")
                tail[:] = [*tail[-(OUTPUT_TAIL_LINES - 1) :], text]
                if log is not None:
                    log(text)

        execution.receive(execstream.STDOUT, stdout)
        execution.receive(execstream.STDERR, stderr)
        try:
            if input:
                execution.send(input)
            execution.send_eof()
            status = await asyncio.shield(execution.done)
        except BaseException:
            await self.kill_groups([execution.pid])
            await execution.close()
            raise
        if execution.message and (status is None or not tail):
            tail.append(execution.message)
        return Completed(status, bytes(out), "\n".join(tail))

    async def start(self, command: str) -> StreamedProcess:
        execution = await self.start_exec(command)
        if not execution.v5:
            await execution.close()
            raise ProvisionError(
                f"{self}: streaming files needs the exec protocol v5.channel.k8s.io (Kubernetes "
                "1.30 or later); this API server speaks only v4"
            )
        self.groups.groups.add(execution.pid)
        return execstream.ExecProcess(self.groups, execution)

    async def open_agent(self, command: str) -> AgentStream:
        execution = await self.start_exec(command)
        return execstream.ExecAgent(execution, self.schedule_signal)

    def schedule_signal(self, pid: int, signum: int) -> None:
        """Send `signum` to `pid` (and its group) in the pod, from the loop, best effort."""
        task = asyncio.get_running_loop().create_task(self._signal([pid], signum))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def kill_groups(self, pids: list[int]) -> None:
        await self._signal(pids, 9)

    async def _signal(self, pids: list[int], signum: int) -> None:
        live = [p for p in pids if p]
        if not live or self.closed:
            return
        with contextlib.suppress(ProvisionError, OSError, TimeoutError):
            execution = await asyncio.wait_for(
                execstream.start(self.api, self.pod, execstream.kill_command(live, signum)), 30
            )
            execution.send_eof()
            await asyncio.wait_for(asyncio.shield(execution.done), 30)

    async def close(self, last: str = "") -> None:
        """Run `last` in the pod (best effort) and close every stream; the pod itself is the
        provider's to delete."""
        if self.closed:
            return
        if last:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.run(last), 30)
        self.closed = True
        await asyncio.gather(*(e.close() for e in list(self._open)), return_exceptions=True)


class PodNode(RemoteNode):
    """A node of the pool: one pod, its commands through the exec stream."""

    def __init__(self, index: int, host: PodHost, private_addr: str) -> None:
        super().__init__(index, host, private_addr)
        self.pod_host = host
        self.public_addr = host.address

    async def open_agent(self, command: str) -> AgentStream:
        return await self.pod_host.open_agent(command)

    async def start_process(self, command: str) -> StreamedProcess:
        return await self.pod_host.start(command)
