"""`AgentConnection`: the client's side of one node's agent.

It decodes the frames the agent sends and resolves call futures, splits the node's output into
lines for the console and keeps them, and turns the agent's death into a `WorkerError` for every
call the node held. Bytes arrive through callbacks on the pool's event loop; calls are written
from the caller's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

from skyward.errors import PoolClosedError, RemoteError, WorkerError
from skyward.providers.base import NodeLoss
from skyward.transport import frames
from skyward.transport.base import AgentStream

TAIL_LINES = 20
KEPT_LINES = 100_000
OUTPUT_CHUNK = 1 << 16
# How long to wait for the rest of a dead node's output before reporting its death.
OUTPUT_DRAIN_SECONDS = 0.3
# How long the provider may take to say why a node went away before the error is raised.
EXPLAIN_SECONDS = 3.0


class CallFrames:
    """One call's frame, encoded at most twice (with and without the function's bytes) however
    many nodes it goes to: a broadcast writes the same bytes to every node."""

    __slots__ = ("_with_fn", "_without_fn", "call_id", "fn_bytes", "fn_id", "segments")

    def __init__(
        self, call_id: int, fn_id: int, fn_bytes: bytes, segments: list[frames.Buffer]
    ) -> None:
        self.call_id = call_id
        self.fn_id = fn_id
        self.fn_bytes = fn_bytes
        self.segments = segments
        self._with_fn: list[frames.Buffer] | None = None
        self._without_fn: list[frames.Buffer] | None = None

    def chunks(self, first_time: bool) -> list[frames.Buffer]:
        if first_time:
            if self._with_fn is None:
                with_fn = (frames.CALL, self.call_id, self.fn_id, self.fn_bytes)
                self._with_fn = frames.encode(with_fn, self.segments)
            return self._with_fn
        if self._without_fn is None:
            without_fn = (frames.CALL, self.call_id, self.fn_id, None)
            self._without_fn = frames.encode(without_fn, self.segments)
        return self._without_fn


class AgentConnection:
    """One node's agent as the pool sees it."""

    def __init__(
        self,
        node: int,
        stream: AgentStream,
        on_output: Callable[[int, str], None],
        on_death: Callable[[AgentConnection, WorkerError], None],
        explain: Callable[[], Awaitable[NodeLoss | None]] | None = None,
    ) -> None:
        self.node = node
        self._explain = explain
        self.stream = stream
        self.lines: deque[str] = deque(maxlen=KEPT_LINES)
        self.pending: dict[int, Future[Any]] = {}
        self.sent_functions: set[int] = set()
        self.control: asyncio.Queue[frames.Meta | None] = asyncio.Queue()
        self.dead: WorkerError | None = None
        self.last_seen = time.monotonic()
        self.exit_status: int | None = None
        self.stage = "starting the agent"  # where the node is during startup, for errors
        self._on_output = on_output
        self._on_death = on_death
        self._stopping = False
        self._lock = threading.Lock()
        self._decoder = frames.FrameDecoder(self._on_frame)
        self._partial_line = b""
        self._output_done = asyncio.Event()
        self._ended_task: asyncio.Task[None] | None = None
        self._control_closed = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        stream.start(self._on_control_bytes, self._on_output_bytes)

    # -- sending ---------------------------------------------------------------------------

    def send(self, meta: frames.Meta, segments: frames.Segments = ()) -> None:
        """Write one control frame."""
        self.stream.write(frames.encode(meta, segments))

    def submit(self, calls: list[tuple[CallFrames, Future[Any]]]) -> None:
        """Send calls from the caller's thread, in one write; their results resolve the futures."""
        chunks: list[frames.Buffer] = []
        with self._lock:
            for call, future in calls:
                if self.dead is not None:
                    future.set_exception(self.dead)
                    continue
                if not future.set_running_or_notify_cancel():
                    continue
                first_time = call.fn_id not in self.sent_functions
                self.sent_functions.add(call.fn_id)
                self.pending[call.call_id] = future
                chunks += call.chunks(first_time)
            if not chunks:
                return
            try:
                self.stream.write(_coalesce(chunks))
            except OSError as exc:
                error = self._error(f"could not send to node {self.node}: {exc}")
                for call, future in calls:
                    if self.pending.pop(call.call_id, None) is future:
                        future.set_exception(error)

    # -- receiving (on the event loop) ---------------------------------------------------

    def _on_control_bytes(self, data: bytes) -> None:
        # Called on the loop, or on whichever thread reads a local pipe (see transport.pipes):
        # results resolve thread-safe futures; everything else is handed to the loop.
        if not data:
            self._loop.call_soon_threadsafe(self._control_ended)
            return
        self.last_seen = time.monotonic()
        try:
            self._decoder.feed(data)
        except Exception as exc:
            self._output_line(
                f"[skyward] broken stream from the agent of node {self.node}: {exc!r}"
            )
            self.stream.kill()

    def _on_frame(self, meta: frames.Meta, segments: list[frames.Buffer]) -> None:
        kind = meta[0]
        if kind == frames.RESULT:
            self._resolve(meta[1], segments)
        elif kind == frames.RAISED:
            self._reject(meta, segments)
        elif kind != frames.HEARTBEAT:
            self._loop.call_soon_threadsafe(self.control.put_nowait, meta)

    def _resolve(self, call_id: int, segments: list[frames.Buffer]) -> None:
        future = self.pending.pop(call_id, None)
        if future is None:
            return
        try:
            future.set_result(frames.loads(segments))
        except Exception as exc:
            future.set_exception(
                RemoteError(
                    type(exc).__name__,
                    f"the result could not be unpickled on the client: {exc}",
                    "",
                    node=self.node,
                )
            )

    def _reject(self, meta: frames.Meta, segments: list[frames.Buffer]) -> None:
        _, call_id, type_name, message, remote_tb = meta
        future = self.pending.pop(call_id, None)
        if future is not None:
            future.set_exception(
                rebuild_exception(type_name, message, remote_tb, segments, self.node)
            )

    def _on_output_bytes(self, data: bytes) -> None:
        if not data:
            if self._partial_line:
                self._output_line(self._partial_line.decode(errors="replace"))
                self._partial_line = b""
            self._output_done.set()
            return
        *lines, self._partial_line = (self._partial_line + data).split(b"\n")
        if len(self._partial_line) > OUTPUT_CHUNK:  # a very long line without a newline: show it
            lines.append(self._partial_line)
            self._partial_line = b""
        for raw in lines:
            self._output_line(raw.decode(errors="replace").rstrip("\r"))

    def _output_line(self, line: str) -> None:
        self.lines.append(line)
        self._on_output(self.node, line)

    def _control_ended(self) -> None:
        self._control_closed.set()
        if self._ended_task is None:
            self._ended_task = self._loop.create_task(self._ended())

    async def _ended(self) -> None:
        """The control stream closed: collect the exit status and the last output."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._output_done.wait(), OUTPUT_DRAIN_SECONDS)
        try:
            self.exit_status = await asyncio.wait_for(self.stream.wait(), OUTPUT_DRAIN_SECONDS)
        except Exception:
            self.exit_status = None
        self.stream.kill()
        self.control.put_nowait(None)
        if self._stopping or self.dead is not None:
            return
        loss = await self._ask_provider()
        error = self._error(f"the agent of node {self.node} died")
        if loss is not None:
            error = WorkerError(
                f"{loss.reason}\n{error}",
                node=self.node,
                exit_status=error.exit_status,
                output_tail=error.output_tail,
                preempted=loss.preempted,
            )
        self.mark_dead(error)

    async def _ask_provider(self) -> NodeLoss | None:
        """The provider's account of the loss (a reclaimed spot instance), if it has one soon."""
        if self._explain is None:
            return None
        try:
            return await asyncio.wait_for(self._explain(), EXPLAIN_SECONDS)
        except Exception:
            return None

    # -- failure ---------------------------------------------------------------------------

    def _error(self, what: str) -> WorkerError:
        status = self.exit_status
        how = describe_status(status)
        tail = tuple(list(self.lines)[-TAIL_LINES:])
        shown = "\n".join(f"    {line}" for line in tail) or "    (it printed nothing)"
        return WorkerError(
            f"{what} ({how}) while {self.stage}.\nLast output of node {self.node}:\n{shown}",
            node=self.node,
            exit_status=status,
            output_tail=tail,
        )

    def mark_dead(self, error: WorkerError) -> None:
        """Fail every call this node holds with `error` and tell the pool."""
        with self._lock:
            if self.dead is not None:
                return
            self.dead = error
            pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)
        self._on_death(self, error)

    def fail(self, reason: str) -> None:
        """Declare this node dead for `reason` (it went silent) and cut it off."""
        self.mark_dead(self._error(reason))
        self.stream.kill()

    def abort(self, reason: str) -> None:
        """Stop this node now (another node failed, or the pool is going away)."""
        if self.dead is None:
            self.mark_dead(
                WorkerError(
                    f"node {self.node} was stopped: {reason}",
                    node=self.node,
                    output_tail=tuple(list(self.lines)[-TAIL_LINES:]),
                    stopped=True,
                )
            )
        self.stream.kill()

    async def close(self, timeout: float) -> None:
        """Ask the agent to finish (plugins unwind), then make sure it is gone."""
        self._stopping = True
        # Only an idle agent is asked to finish: a busy one may not be reading, and a write to
        # its full pipe would block this loop; it is killed after `timeout` like any laggard.
        if self.dead is None and not self.stream_closed() and not self.pending:
            with contextlib.suppress(Exception):
                self.send((frames.SHUTDOWN,))
        try:
            await asyncio.wait_for(self._control_closed.wait(), timeout)
        except TimeoutError:
            self._output_line(
                f"[skyward] node {self.node} did not stop within {timeout:g} s; killing it"
            )
        self.stream.kill()
        self.stream.close_input()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.stream.wait(), timeout=2)
        if self._ended_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._ended_task, timeout=2)
        with self._lock:
            pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(PoolClosedError("the pool closed before this call ended"))

    def stream_closed(self) -> bool:
        """Whether the agent's control stream has ended."""
        return self._ended_task is not None


def _coalesce(chunks: list[frames.Buffer]) -> list[frames.Buffer]:
    """Join runs of small chunks, so several calls to one node cost one write."""
    out: list[frames.Buffer] = []
    small = bytearray()
    for chunk in chunks:
        if memoryview(chunk).nbytes < OUTPUT_CHUNK:
            small += chunk
            continue
        if small:
            out.append(small)
            small = bytearray()
        out.append(chunk)
    if small:
        out.append(small)
    return out


def describe_status(status: int | None) -> str:
    """Human words for an exit status (negative: the signal that killed it)."""
    if status is None:
        return "exit status unknown"
    if status < 0:
        import signal

        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"killed by {name}"
    return f"exit status {status}"


class RemoteTraceback(Exception):
    """Carries a node's traceback text as the `__cause__` of a re-raised exception."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def rebuild_exception(
    type_name: str, message: str, remote_tb: str, segments: list[frames.Buffer], node: int
) -> BaseException:
    """The node's exception as itself, with the remote traceback as its cause."""
    exc: BaseException
    try:
        if not segments:
            raise ValueError("no pickled exception")
        exc = frames.loads(segments)
        if not isinstance(exc, Exception):
            # SystemExit or KeyboardInterrupt from a node must not end the client's program
            raise TypeError("not an ordinary exception")
    except Exception:
        exc = RemoteError(type_name, message, remote_tb, node=node)
    exc.__cause__ = RemoteTraceback(f'\n"""\nTraceback on node {node}:\n{remote_tb.rstrip()}\n"""')
    with contextlib.suppress(Exception):
        exc.add_note(f"(raised on node {node})")
    return exc
