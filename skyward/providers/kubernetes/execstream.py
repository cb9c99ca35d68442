"""Commands in a pod over the API server's exec stream: no sshd in the image, no kubectl.

One websocket per command (``.../pods/NAME/exec``), subprotocol ``v5.channel.k8s.io`` (or
``v4`` from an API server older than Kubernetes 1.30): every binary frame starts with its
channel, 0 the command's stdin, 1 its stdout, 2 its stderr, 3 its end (a ``Status``: Success,
or the exit code); v5's frame ``[255, 0]`` closes stdin. An `Exec` is one such command:

- `ExecAgent` is the agent's stream (`AgentStream`): control bytes on stdout, output on stderr,
  written from any thread through the pool's loop;
- `ExecProcess` is a command the client streams through (a host check, an environment build,
  a data tree's push or pull), with the reader and writer shapes asyncssh and asyncio give.

A v4 stream cannot close stdin on its own: a command given all its input at once reads exactly
that many bytes (``head -c``), and a streamed one (`ExecProcess`) is refused with what to do.
Every command prints its pid first (``SKYWARD-PID``), so the client can signal it with
another exec (`pool.stacks()`, a kill).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlencode

import aiohttp

from skyward.errors import ProvisionError
from skyward.providers.kubernetes import waiting
from skyward.transport.base import AgentStream, Receiver
from skyward.transport.eventloop import lender
from skyward.transport.frames import Buffer
from skyward.transport.sshhost import PID_MARKER, find_pid

if TYPE_CHECKING:
    from skyward.providers.kubernetes.api import KubeApi

STDIN, STDOUT, STDERR, STATUS, CLOSE = 0, 1, 2, 3, 255
V5, V4 = "v5.channel.k8s.io", "v4.channel.k8s.io"
CONTAINER = "node"  # the one container of a skyward pod
FRAME = 1 << 18  # stdin bytes per websocket frame: large writes interleave with small ones
_HIGH_WATER = 4 << 20  # bytes queued for the socket before `drain` waits
_MAX_PREAMBLE = 1 << 16
INLINE_LIMIT = 4096  # bytes of a command sent in the exec's URL; a longer one goes on stdin


def wrap(command: str) -> str:
    """`command` behind the line that tells its pid first."""
    return f"echo {PID_MARKER.decode()}$$; {command}"


async def connect(api: KubeApi, pod: str, argv: Sequence[str]) -> aiohttp.ClientWebSocketResponse:
    """Open the exec websocket running `argv` in `pod`'s container."""
    query = [("command", a) for a in argv]
    query += [("container", CONTAINER), ("stdin", "true"), ("stdout", "true"), ("stderr", "true")]
    host = str(api.client.configuration.host).rstrip("/")
    url = f"{host}/api/v1/namespaces/{api.namespace}/pods/{pod}/exec?{urlencode(query)}"
    url = "wss" + url[5:] if url.startswith("https") else "ws" + url[4:]
    settings = await api.client.configuration.auth_settings()
    headers = {s["key"]: s["value"] for s in settings.values() if s["in"] == "header"}
    headers = {key: value for key, value in headers.items() if value}
    session = api.client.rest_client.pool_manager
    configuration = api.client.configuration
    try:
        return await session.ws_connect(
            url,
            protocols=(V5, V4),
            headers=headers,
            max_msg_size=0,
            autoping=True,
            compress=0,
            # The kubeconfig's proxy-url, as the client's other calls take it.
            proxy=configuration.proxy or None,
            proxy_headers=configuration.proxy_headers or None,
        )
    except aiohttp.WSServerHandshakeError as exc:
        ended = await waiting.why_ended(api, pod)
        raise ProvisionError(
            ended
            or f"exec in pod {pod} was refused by the API server (HTTP {exc.status}: {exc.message})"
        ) from None
    except (aiohttp.ClientError, OSError) as exc:
        raise ProvisionError(f"exec in pod {pod}: cannot reach {host} ({exc})") from None


def channel_frame(message: aiohttp.WSMessage) -> tuple[int, bytes] | None:
    """A websocket message of the exec stream as (channel, payload); None for one that is no
    frame (a ping, a close, an empty message)."""
    if message.type == aiohttp.WSMsgType.BINARY:
        data: bytes = message.data
    elif message.type == aiohttp.WSMsgType.TEXT:
        data = message.data.encode()
    else:
        return None
    return (data[0], data[1:]) if data else None


def exit_code(status: bytes) -> tuple[int | None, str]:
    """The command's exit code from channel 3's Status, and its message when it failed; None
    when the stream ended without one (the connection was lost)."""
    if not status:
        return None, "the exec stream ended without the command's status"
    try:
        body = json.loads(status)
    except ValueError:
        return None, status.decode(errors="replace")
    if body.get("status") == "Success":
        return 0, ""
    message = str(body.get("message", ""))
    for cause in (body.get("details") or {}).get("causes") or []:
        if cause.get("reason") == "ExitCode":
            return int(cause.get("message", 1)), message
    return 126, message  # the runtime could not start it (no such file, not executable)


class Exec:
    """One command in a pod: its websocket read on the loop into per-channel receivers, its
    stdin written in order by one writer task."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, pod: str) -> None:
        self.ws = ws
        self.pod = pod
        self.v5 = ws.protocol == V5
        self.loop = asyncio.get_running_loop()
        self.pid = 0
        self.pid_known: asyncio.Future[int] = self.loop.create_future()
        self.done: asyncio.Future[int | None] = self.loop.create_future()
        self.message = ""
        self._status = b""
        self._preamble = b""
        self._receivers: dict[int, Receiver] = {}
        self._early: list[tuple[int, bytes]] = []
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._queued = 0
        self._drained = asyncio.Event()
        self._drained.set()
        self.after_delivery: Callable[[], None] | None = None
        self.sized = False  # v4: the command reads an exact count of bytes, no end of input
        self._reader = self.loop.create_task(self._read())
        self._writer = self.loop.create_task(self._write())

    # -- reading -------------------------------------------------------------------------------

    def receive(self, channel: int, receiver: Receiver) -> None:
        """Hand `channel`'s bytes to `receiver` (``b""`` once at the end); what came first too."""
        self._receivers[channel] = receiver
        early, self._early = self._early, []
        for ch, data in early:
            self._deliver(ch, data)

    def _deliver(self, channel: int, data: bytes) -> None:
        receiver = self._receivers.get(channel)
        if receiver is None:
            self._early.append((channel, data))
        else:
            receiver(data)

    async def _read(self) -> None:
        try:
            async for msg in self.ws:
                if (framed := channel_frame(msg)) is None:
                    continue
                channel, payload = framed
                if channel == STATUS:
                    self._status += payload
                elif channel == STDOUT and not self.pid_known.done():
                    self._find_pid(payload)
                elif payload:
                    self._deliver(channel, payload)
                    if channel == STDOUT and self.after_delivery is not None:
                        self.after_delivery()
        except (aiohttp.ClientError, OSError, asyncio.CancelledError):
            pass
        finally:
            # The stream is over: nothing more can be written (a writer left waiting on its
            # queue would be a pending task when the loop ends).
            self._writer.cancel()
            self._drained.set()
            code, self.message = exit_code(self._status)
            if not self.pid_known.done():
                self.pid_known.set_exception(
                    ProvisionError(
                        f"the command in pod {self.pod} ended before it started"
                        + (f": {self.message}" if self.message else "")
                    )
                )
                self.pid_known.exception()  # read: not every caller waits for it
            for channel in (STDOUT, STDERR):
                self._deliver(channel, b"")
            if not self.done.done():
                self.done.set_result(code)

    def _find_pid(self, data: bytes) -> None:
        self._preamble += data
        found = find_pid(self._preamble)
        if found is None:
            if len(self._preamble) > _MAX_PREAMBLE:
                self.pid_known.set_exception(ProvisionError(f"no pid line from pod {self.pod}"))
            return
        (self.pid, rest), self._preamble = found, b""
        self.pid_known.set_result(self.pid)
        if rest:
            self._deliver(STDOUT, rest)

    # -- writing -------------------------------------------------------------------------------

    def send(self, data: Buffer) -> None:
        """Queue `data` for the command's stdin (on the loop)."""
        view = memoryview(data).cast("B")
        for start in range(0, len(view), FRAME):
            frame = bytes([STDIN]) + view[start : start + FRAME].tobytes()
            self._queued += len(frame)
            self._queue.put_nowait(frame)
        if self._queued > _HIGH_WATER:
            self._drained.clear()

    def send_eof(self) -> None:
        """Close the command's stdin (v5). A v4 stream cannot: a command whose input was sized
        (`start`'s `v4_input`) reads exactly that and needs nothing more; any other ends the
        whole stream (the kubelet then closes its stdin), and its output with it."""
        if not self.v5 and self.sized:
            return
        self._queue.put_nowait(None)

    async def drain(self) -> None:
        await self._drained.wait()

    async def _write(self) -> None:
        try:
            while True:
                frame = await self._queue.get()
                if frame is None:
                    if self.v5:
                        await self.ws.send_bytes(bytes([CLOSE, STDIN]))
                        continue
                    await self.ws.close()
                    return
                await self.ws.send_bytes(frame)
                self._queued -= len(frame)
                if self._queued <= _HIGH_WATER // 2:
                    self._drained.set()
        except (aiohttp.ClientError, OSError, ConnectionError):
            self._drained.set()  # nothing more will be taken: writers must not wait forever
        except asyncio.CancelledError:
            self._drained.set()

    async def wait_pid(self, timeout: float = 30.0) -> int:
        try:
            return await asyncio.wait_for(asyncio.shield(self.pid_known), timeout)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        self._writer.cancel()
        with contextlib.suppress(Exception):
            await self.ws.close()
        with contextlib.suppress(BaseException):
            await self._reader


def _argv(command: str) -> tuple[list[str], bytes]:
    """The exec's argv for shell `command`, and what must come first on its stdin: a long
    command (the host check, a build) travels on stdin, read exactly by ``head -c``, since the
    argv is the URL's query and proxies in front of API servers cap a URL at 8-16 KiB."""
    script = wrap(command)
    if len(script) <= INLINE_LIMIT:
        return ["sh", "-c", script], b""
    data = script.encode()
    return ["sh", "-c", f'eval "$(head -c {len(data)})"'], data


async def start(api: KubeApi, pod: str, command: str, v4_input: int | None = None) -> Exec:
    """Run shell `command` in `pod`, its pid known. `v4_input`: the bytes of input the caller
    will send, read exactly on a v4 stream (which cannot close stdin)."""
    argv, preface = _argv(command)
    ws = await connect(api, pod, argv)
    if ws.protocol != V5:
        await ws.close()
        limited = command if v4_input is None else f"head -c {v4_input} | {{ {command}\n}}"
        argv, preface = _argv(limited)
        ws = await connect(api, pod, argv)
    execution = Exec(ws, pod)
    execution.sized = v4_input is not None
    if preface:
        execution.send(preface)  # first in the writer's queue: before any caller's input
    try:
        await execution.wait_pid()
    except ProvisionError:
        # A command that ended before it started, in a container that has ended meanwhile
        # (a crash between the pod's Running and this exec): the crash's words, not the bare
        # exit status the stream carried.
        # The pod's status may say so a moment after the stream ended: look for up to 2 s.
        for _ in range(10):
            ended = await waiting.why_ended(api, pod)
            if ended:
                raise ProvisionError(ended) from None
            await asyncio.sleep(0.2)
        raise
    return execution


class _Reader:
    """A channel as an asyncio reader (read, readline, readexactly), fed by the stream."""

    def __init__(self) -> None:
        self.stream = asyncio.StreamReader(limit=1 << 20)

    def __call__(self, data: bytes) -> None:
        if data:
            self.stream.feed_data(data)
        else:
            self.stream.feed_eof()

    async def read(self, n: int = -1) -> bytes:
        return await self.stream.read(n)

    async def readline(self) -> bytes:
        return await self.stream.readline()

    async def readexactly(self, n: int) -> bytes:
        return await self.stream.readexactly(n)


class _Writer:
    def __init__(self, execution: Exec) -> None:
        self.execution = execution

    def write(self, data: bytes) -> None:
        self.execution.send(data)

    async def drain(self) -> None:
        await self.execution.drain()

    def write_eof(self) -> None:
        self.execution.send_eof()


class _Stdio:
    def __init__(self, execution: Exec) -> None:
        self.stdin = _Writer(execution)
        self.stdout = _Reader()
        self.stderr = _Reader()
        execution.receive(STDOUT, self.stdout)
        execution.receive(STDERR, self.stderr)


class ExecProcess:
    """A command in a pod whose stdio the client streams over (`remote.host.StreamedProcess`)."""

    def __init__(self, host: PodGroups, execution: Exec) -> None:
        self.host = host
        self.execution = execution
        self.process = _Stdio(execution)
        self.pid = execution.pid

    async def exit_status(self) -> int | None:
        return await asyncio.shield(self.execution.done)


class PodGroups:
    """What a pod's host keeps of the commands it started: their pids, and the kill."""

    def __init__(self, kill: Callable[[list[int]], object]) -> None:
        self.groups: set[int] = set()
        self._kill = kill

    async def kill_groups(self, pids: list[int]) -> None:
        await self._kill(pids)  # type: ignore[misc]
        self.groups.difference_update(pids)


class ExecAgent:
    """The agent's stream over an exec websocket: an `AgentStream`."""

    remote = True

    def __init__(self, execution: Exec, signal: Callable[[int, int], None]) -> None:
        self.execution = execution
        self._signal = signal  # (pid, signal number): run on the loop
        self._loop = execution.loop
        self._lender = lender(self._loop)
        self._lock = threading.Lock()
        self._pending = 0  # writes handed to the loop, not yet queued there
        if self._lender is not None:
            execution.after_delivery = self._lender.settled

    def start(self, on_control: Receiver, on_output: Receiver) -> None:
        self.execution.receive(STDOUT, on_control)
        self.execution.receive(STDERR, on_output)

    def wait_replies(self, group: Sequence[AgentStream], done: Callable[[], bool]) -> None:
        """Run the pool's loop, which reads every websocket, in this thread until `done()`."""
        if self._lender is not None:
            self._lender.drive(done)

    def write(self, chunks: Sequence[Buffer]) -> None:
        # Copied now: the caller may change its buffers (a numpy argument) once this returns.
        data = b"".join(bytes(c) for c in chunks)
        with self._lock:
            # The thread running the loop writes itself unless earlier writes still wait for
            # the loop: each thread's writes stay in order.
            if not self._pending and self._lender is not None and self._lender.holds():
                self.execution.send(data)
                return
            self._pending += 1
        self._loop.call_soon_threadsafe(self._send_queued, data)

    def _send_queued(self, data: bytes) -> None:
        self.execution.send(data)
        with self._lock:
            self._pending -= 1

    def close_input(self) -> None:
        self._loop.call_soon_threadsafe(self.execution.send_eof)

    async def exit_status(self) -> int | None:
        return await asyncio.shield(self.execution.done)

    def kill(self) -> None:
        self.signal(9)

    def kill_at_end(self) -> None:
        """The pod is deleted next, with everything in it: only the stream goes now."""
        self._loop.call_soon_threadsafe(self._close_soon)

    def _close_soon(self) -> None:
        self._loop.create_task(self.execution.close())

    def signal(self, signum: int) -> None:
        if self.execution.pid:
            self._loop.call_soon_threadsafe(self._signal, self.execution.pid, signum)


def kill_command(pids: Sequence[int], signum: int = 9) -> str:
    """The shell command that sends `signum` to `pids` and their process groups."""
    groups = " ".join(f"-{p}" for p in pids)
    alone = " ".join(str(p) for p in pids)
    # A command that is no group's leader is signalled alone (the first kill then fails). No
    # `--` before the groups: dash, the `sh` of Debian-based images, takes it for a pid.
    return f"kill -{signum} {groups} 2>/dev/null; kill -{signum} {alone} 2>/dev/null; true"
