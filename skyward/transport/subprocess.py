"""Agent streams over the pipes of a local child process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import threading
from collections.abc import Mapping

from skyward.transport.frames import AsyncReader

_STREAM_LIMIT = 1 << 20


class SubprocessStream:
    """A local agent process in its own session, so `kill` takes down what it started too."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process
        assert process.stdin and process.stdout and process.stderr
        self.stdin = process.stdin
        self.stdout: AsyncReader = process.stdout
        self.stderr = process.stderr
        self.pid = process.pid
        pipe = process.stdin.transport.get_extra_info("pipe")
        self._stdin_fd: int = pipe.fileno()
        self._write_lock = threading.Lock()

    def threadsafe_write(self, *chunks: bytes | memoryview) -> None:
        """Write to the agent's stdin from any thread (blocks while the pipe is full)."""
        with self._write_lock:
            for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    try:
                        view = view[os.write(self._stdin_fd, view) :]
                    except BlockingIOError:
                        # asyncio made the pipe non-blocking; wait until it drains
                        select.select([], [self._stdin_fd], [], 1.0)

    async def wait(self) -> int | None:
        return await self._process.wait()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._process.pid, signal.SIGKILL)


async def spawn(argv: list[str], env: Mapping[str, str], cwd: str | None) -> SubprocessStream:
    """Start `argv` with piped stdin/stdout/stderr in a new session."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=dict(env),
        cwd=cwd,
        start_new_session=True,
        limit=_STREAM_LIMIT,
    )
    return SubprocessStream(process)
