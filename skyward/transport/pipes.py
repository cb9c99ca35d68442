"""Agent streams over the pipes of a local child process.

The child's stdout and stderr are read with ``loop.add_reader`` straight into the pool's
callbacks, its exit is watched through a pidfd, and its stdin is written directly by whichever
thread sends (under a lock), which spares a small call two thread hand-offs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from typing import IO

from skyward.transport.base import Receiver
from skyward.transport.frames import Buffer, write_all

_READ_SIZE = 1 << 20


class SubprocessStream:
    """A local agent process in its own session, so `kill` takes down what it started too."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdin and process.stdout and process.stderr
        self._process = process
        self.pid = process.pid
        self._write_lock = threading.Lock()
        self._exit: asyncio.Future[int | None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, on_control: Receiver, on_output: Receiver) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._exit = loop.create_future()
        assert self._process.stdout and self._process.stderr
        for pipe, receiver in (
            (self._process.stdout, on_control),
            (self._process.stderr, on_output),
        ):
            os.set_blocking(pipe.fileno(), False)
            loop.add_reader(pipe.fileno(), self._readable, pipe, receiver)
        try:
            pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            # no pidfd (old kernel): a thread waits for the exit instead
            loop.run_in_executor(None, self._wait_blocking)
        else:
            loop.add_reader(pidfd, self._exited, pidfd)

    def _readable(self, pipe: IO[bytes], receiver: Receiver) -> None:
        try:
            data = os.read(pipe.fileno(), _READ_SIZE)
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
        assert self._process.stdin
        fd = self._process.stdin.fileno()
        with self._write_lock:
            for chunk in chunks:
                write_all(fd, chunk)

    def close_input(self) -> None:
        with self._write_lock, contextlib.suppress(OSError):
            assert self._process.stdin
            self._process.stdin.close()

    async def wait(self) -> int | None:
        assert self._exit is not None, "start() first"
        return await asyncio.shield(self._exit)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)


async def spawn(argv: list[str], env: Mapping[str, str], cwd: str | None) -> SubprocessStream:
    """Start `argv` with piped stdin/stdout/stderr in a new session."""
    process = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(env),
        cwd=cwd,
        start_new_session=True,
        bufsize=0,
    )
    return SubprocessStream(process)
