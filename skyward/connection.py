"""`AgentConnection`: the client's side of one node's agent, living on the pool's event loop.

It reads frames and resolves call futures, forwards the node's output to the console and keeps
it, and turns the agent's death into a `WorkerError` for every call the node held.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from skyward.errors import RemoteError, WorkerError
from skyward.transport import frames
from skyward.transport.base import AgentStream

TAIL_LINES = 20
OUTPUT_CHUNK = 1 << 16
KEPT_LINES = 100_000
# How long to wait for the rest of a dead node's output before reporting its death.
OUTPUT_DRAIN_SECONDS = 0.3


class AgentConnection:
    """One node's agent as the pool sees it. All methods run on the pool's event loop."""

    def __init__(
        self,
        node: int,
        stream: AgentStream,
        on_output: Callable[[int, str], None],
        on_death: Callable[[AgentConnection, WorkerError], None],
    ) -> None:
        self.node = node
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
        # A stream that can be written from any thread saves the trip through the event loop,
        # which is most of a small call's round trip.
        self._direct: Callable[[bytes, bytes | memoryview], None] | None = getattr(
            stream, "threadsafe_write", None
        )
        self._output_task = asyncio.create_task(self._read_output())
        self._frame_task = asyncio.create_task(self._read_frames())

    # -- sending ---------------------------------------------------------------------------

    def _write(self, head: bytes, body: bytes | memoryview) -> None:
        if self._direct is not None:
            self._direct(head, body)
        else:
            self.stream.stdin.write(head)
            if body:
                self.stream.stdin.write(body)

    def send(self, meta: frames.Meta, payload: bytes | memoryview = b"") -> None:
        """Write one frame (on the loop thread)."""
        self._write(*frames.encode(meta, payload))

    def submit_call(
        self,
        loop: asyncio.AbstractEventLoop,
        call_id: int,
        fn_id: int,
        fn_bytes: bytes,
        payload: bytes,
        future: Future[Any],
    ) -> None:
        """Send a call from the caller's thread; its result will resolve `future`."""
        with self._lock:
            if self.dead is not None:
                future.set_exception(self.dead)
                return
            if not future.set_running_or_notify_cancel():
                return
            first_time = fn_id not in self.sent_functions
            self.sent_functions.add(fn_id)
            self.pending[call_id] = future
            head, body = frames.encode(
                (frames.CALL, call_id, fn_id, fn_bytes if first_time else None), payload
            )
            if self._direct is None:
                loop.call_soon_threadsafe(self._write_call, call_id, head, body)
                return
            try:
                self._direct(head, body)
            except OSError as exc:
                self.pending.pop(call_id, None)
                future.set_exception(self._error(f"could not send the call: {exc}"))

    def _write_call(self, call_id: int, head: bytes, body: bytes | memoryview) -> None:
        try:
            self._write(head, body)
        except (ConnectionError, RuntimeError) as exc:
            future = self.pending.pop(call_id, None)
            if future is not None and not future.done():
                future.set_exception(self._error(f"could not send the call: {exc}"))

    # -- receiving -------------------------------------------------------------------------

    async def _read_frames(self) -> None:
        try:
            while True:
                meta, payload = await frames.read_frame(self.stream.stdout)
                self.last_seen = time.monotonic()
                kind = meta[0]
                if kind == frames.RESULT:
                    self._resolve(meta[1], payload)
                elif kind == frames.RAISED:
                    self._reject(meta, payload)
                elif kind != frames.HEARTBEAT:
                    self.control.put_nowait(meta)
        except Exception as exc:
            if not _is_eof(exc):
                self._output_line(f"[skyward] broken stream from the agent: {exc!r}")
        await self._ended()

    def _resolve(self, call_id: int, payload: bytes) -> None:
        future = self.pending.pop(call_id, None)
        if future is None:
            return
        try:
            future.set_result(pickle.loads(payload))
        except Exception as exc:
            future.set_exception(
                RemoteError(
                    type(exc).__name__,
                    f"the result could not be unpickled: {exc}",
                    "",
                    node=self.node,
                )
            )

    def _reject(self, meta: frames.Meta, payload: bytes) -> None:
        _, call_id, type_name, message, remote_tb = meta
        future = self.pending.pop(call_id, None)
        if future is not None:
            future.set_exception(
                rebuild_exception(type_name, message, remote_tb, payload, self.node)
            )

    async def _read_output(self) -> None:
        reader = self.stream.stderr
        partial = b""
        while True:
            try:
                chunk = await reader.read(OUTPUT_CHUNK)
            except (ConnectionError, OSError):
                chunk = b""
            if not chunk:
                if partial:
                    self._output_line(partial.decode(errors="replace"))
                return
            *lines, partial = (partial + chunk).split(b"\n")
            if len(partial) > OUTPUT_CHUNK:  # a very long line without a newline: show it now
                lines.append(partial)
                partial = b""
            for raw in lines:
                self._output_line(raw.decode(errors="replace").rstrip("\r"))

    def _output_line(self, line: str) -> None:
        self.lines.append(line)
        self._on_output(self.node, line)

    async def _ended(self) -> None:
        """The control stream closed: collect the exit status and the last output."""
        # A transport may end the output stream with its own error (a lost SSH connection);
        # whatever it was, the node is gone and must be reported.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._output_task), OUTPUT_DRAIN_SECONDS)
        try:
            self.exit_status = await asyncio.wait_for(self.stream.wait(), OUTPUT_DRAIN_SECONDS)
        except (TimeoutError, Exception):
            self.exit_status = None
        self.stream.kill()
        self.control.put_nowait(None)
        if self._stopping or self.dead is not None:
            return
        self.mark_dead(self._error(f"the agent of node {self.node} died"))

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
        if self.dead is None and not self.stream_closed():
            with contextlib.suppress(Exception):
                for call_id in list(self.pending):
                    self.send((frames.CANCEL, call_id))
                self.send((frames.SHUTDOWN,))
        try:
            await asyncio.wait_for(asyncio.shield(self._frame_task), timeout)
        except TimeoutError:
            self._output_line(
                f"[skyward] node {self.node} did not stop within {timeout:g} s; killing it"
            )
        self.stream.kill()
        with contextlib.suppress(Exception):
            self.stream.stdin.close()
            await asyncio.wait_for(self.stream.wait(), timeout=2)
        for task in (self._frame_task, self._output_task):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def stream_closed(self) -> bool:
        return self._frame_task.done()


def _is_eof(exc: BaseException) -> bool:
    """True for the exceptions a stream raises when its other end has gone away."""
    return isinstance(exc, asyncio.IncompleteReadError | ConnectionError | BrokenPipeError)


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
    type_name: str, message: str, remote_tb: str, payload: bytes, node: int
) -> BaseException:
    """The node's exception as itself, with the remote traceback as its cause."""
    exc: BaseException
    try:
        if not payload:
            raise ValueError("no pickled exception")
        exc = pickle.loads(payload)
        if not isinstance(exc, Exception):
            # SystemExit or KeyboardInterrupt from a node must not end the client's program
            raise TypeError("not an ordinary exception")
    except Exception:
        exc = RemoteError(type_name, message, remote_tb, node=node)
    exc.__cause__ = RemoteTraceback(f'\n"""\nTraceback on node {node}:\n{remote_tb.rstrip()}\n"""')
    with contextlib.suppress(Exception):
        exc.add_note(f"(raised on node {node})")
    return exc
