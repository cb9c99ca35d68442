"""Agent streams over the pipes of a local child process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
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
