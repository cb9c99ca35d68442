"""Agent streams over the pipes of a local child process.

The child's stdin is written directly by whichever thread sends (under a lock). Its control
output (stdout) is read by whoever waits for it: a caller blocked on replies reads the pipes
itself (`wait_replies`), so a reply reaches it with no thread in between, which on a small call
is most of the round trip; the rest of the time a reader thread per pipe does. Its other output
(stderr) is read on the event loop, and its exit is watched through a pidfd.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from skyward.transport.base import AgentStream, Receiver
from skyward.transport.fastpath import ControlReader, KeptGroups
from skyward.transport.frames import Buffer, write_all

_OUTPUT_READ = 1 << 16  # the agent's output: lines, read on the event loop


class SubprocessStream:
    """A local agent process in its own session, so `kill` takes down what it started too."""

    remote = False  # a child of the client: its pipes close when the client dies

    def __init__(self, process: subprocess.Popen[bytes], linger: float = 0.0) -> None:
        assert process.stdin and process.stdout and process.stderr
        self._process = process
        self._linger = linger
        self.pid = process.pid
        self.write_lock = threading.Lock()
        self.stdin_fd = process.stdin.fileno()
        self._exit: asyncio.Future[int | None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.control: ControlReader | None = None  # the agent's control output, once started
        self._last_reply = 0.0  # seconds the last lone reply took to come
        self._groups = KeptGroups(_control_readers)  # `wait_replies`

    def start(self, on_control: Receiver, on_output: Receiver) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._exit = loop.create_future()
        assert self._process.stdout and self._process.stderr
        self.control = ControlReader(self._process.stdout.fileno(), on_control)
        os.set_blocking(self._process.stderr.fileno(), False)
        loop.add_reader(
            self._process.stderr.fileno(), self._readable, self._process.stderr, on_output
        )
        try:
            pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            # no pidfd (old kernel): a thread waits for the exit instead
            loop.run_in_executor(None, self._wait_blocking)
        else:
            loop.add_reader(pidfd, self._exited, pidfd)

    def wait_replies(self, group: Sequence[AgentStream], done: Callable[[], bool]) -> None:
        """Read the replies of `group`'s local agents in this thread until `done()`."""
        if len(group) == 1 and group[0] is self:  # one call's reply: the common case
            if self.control is not None:
                # Poll only while replies come quickly: when the last one took far longer (a
                # real step, not a small call), polling would only take a core from the node's
                # own threads (XLA's, on the CPU) for nothing.
                quick = self._last_reply < 4 * self._linger
                began = time.perf_counter()
                self.control.read_until(done, self._linger if quick else 0.0)
                self._last_reply = time.perf_counter() - began
            return
        kept = self._groups.of(group)
        if len(kept.readers) > 1:
            kept.read_until(done)
        elif kept.readers:
            only = kept.readers[0]
            assert isinstance(only, ControlReader)
            only.read_until(done, self._linger)

    def _readable(self, pipe: IO[bytes], receiver: Receiver) -> None:
        try:
            data = os.read(pipe.fileno(), _OUTPUT_READ)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            assert self._loop is not None
            self._loop.remove_reader(pipe.fileno())
            pipe.close()
        receiver(data)

    def _exited(self, pidfd: int) -> None:
        assert self._loop is not None
        self._loop.remove_reader(pidfd)
        os.close(pidfd)
        self._settle(self._process.wait())

    def _wait_blocking(self) -> None:
        status = self._process.wait()
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop may be closed by then
            self._loop.call_soon_threadsafe(self._settle, status)

    def _settle(self, status: int | None) -> None:
        if self._exit is not None and not self._exit.done():
            self._exit.set_result(status)

    def write(self, chunks: Sequence[Buffer]) -> None:
        with self.write_lock:
            for chunk in chunks:
                write_all(self.stdin_fd, chunk)

    def close_input(self) -> None:
        with self.write_lock, contextlib.suppress(OSError):
            assert self._process.stdin
            self.stdin_fd = -1  # a later write fails (EBADF), never reaches a reused number
            self._process.stdin.close()

    async def exit_status(self) -> int | None:
        assert self._exit is not None, "start() first"
        return await asyncio.shield(self._exit)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        if self.control is not None:
            self.control.wake()

    def kill_at_end(self) -> None:
        self.kill()  # a local signal: nothing to save

    def signal(self, signum: int) -> None:
        # The child itself: the agent, or the srun that forwards it to the agent's step.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, signum)


def _control_readers(streams: Sequence[AgentStream]) -> list[ControlReader]:
    """The control pipes' readers of `streams`' local agents (a group's, `KeptGroups`)."""
    readers = [s.control for s in streams if isinstance(s, SubprocessStream)]
    return [reader for reader in readers if reader is not None]


async def spawn(
    argv: list[str],
    env: Mapping[str, str],
    cwd: str | None,
    linger: float = 0.0,
    umask: int = -1,
) -> SubprocessStream:
    """Start `argv` with piped stdin/stdout/stderr in a new session (with `umask`, when one is
    given); a caller waiting for a reply polls up to `linger` seconds before it sleeps."""
    process = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(env),
        cwd=cwd,
        start_new_session=True,
        bufsize=0,
        umask=umask,
    )
    return SubprocessStream(process, linger)
