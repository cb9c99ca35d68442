"""Where the Slurm commands run: this machine (a login node), or a login node over SSH.

A `Login` runs a command to completion (`run`), starts the agent with its stdio as the pool's
stream (`open_agent`), holds a long-running command whose stdin the pool keeps open (`hold`: the
allocation), and starts a command whose stdio a data tree streams over (`start`). `LocalLogin`
runs them as child processes, each in its own session so that killing its process group ends
all of it; `SSHLogin` runs them on one verified SSH connection (`SSHHost`), whose process groups
it kills on close.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import asyncssh

from skyward.providers.remote.host import StreamedProcess
from skyward.transport.base import AgentStream
from skyward.transport.pipes import spawn
from skyward.transport.sshhost import OUTPUT_TAIL_LINES, Completed, RemoteProcess, SSHHost
from skyward.transport.sshstream import open_agent

Log = Callable[[str], None]


class Held(Protocol):
    """A running command the pool holds: its output lines, its stdin's end, its exit."""

    async def stdout_line(self) -> str:
        """The next line of stdout ("" at its end)."""
        ...

    async def stderr_line(self) -> str:
        """The next line of stderr ("" at its end)."""
        ...

    def release(self) -> None:
        """Close its stdin: a holding command then ends."""
        ...

    async def wait(self, timeout: float) -> int | None:
        """Its exit status, killing it if it has not ended within `timeout` seconds."""
        ...


class Login(Protocol):
    """The login node, as the pool uses it."""

    @property
    def address(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    async def run(self, command: str, input: bytes = b"", log: Log | None = None) -> Completed: ...

    async def hold(self, command: str) -> Held: ...

    async def start(self, command: str) -> StreamedProcess:
        """`command` with its stdio the client's to stream over, in a process group that
        `close` kills."""
        ...

    async def open_agent(self, command: str) -> AgentStream: ...

    async def close(self) -> None: ...


class LocalLogin:
    """This machine is the login node: the commands run here, with this process's environment
    (``SLURM_CONF`` and the PATH as the user has them)."""

    address = "localhost"

    def __init__(self) -> None:
        self.closed = False
        self.groups: set[int] = set()  # the process groups of what runs, killed on close

    def __str__(self) -> str:
        return "this machine"

    async def _start(self, command: str) -> asyncio.subprocess.Process:
        if self.closed:
            raise OSError("the Slurm login was closed")
        process = await asyncio.create_subprocess_exec(
            "/bin/sh",
            "-c",
            command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self.groups.add(process.pid)
        return process

    async def run(self, command: str, input: bytes = b"", log: Log | None = None) -> Completed:
        process = await self._start(command)
        assert process.stdin and process.stdout and process.stderr
        tail: list[str] = []
        stderr = process.stderr

        async def pump() -> None:
            while line := await stderr.readline():
                text = line.decode(errors="replace").rstrip("\r\n")
                tail[:] = [*tail[-(OUTPUT_TAIL_LINES - 1) :], text]
                if log is not None:
                    log(text)

        try:
            with contextlib.suppress(OSError):  # it may exit without reading its input
                process.stdin.write(input)
                await process.stdin.drain()
                process.stdin.close()
            out, _ = await asyncio.gather(process.stdout.read(), pump())
            status = await process.wait()
        except BaseException:
            _kill_group(process.pid)
            raise
        finally:
            self.groups.discard(process.pid)
        return Completed(status, out, "\n".join(tail))

    async def hold(self, command: str) -> Held:
        return _LocalHeld(await self._start(command), self.groups)

    async def start(self, command: str) -> LocalProcess:
        """A command whose stdio the client streams over (a data tree's push or pull)."""
        return LocalProcess(self, await self._start(command))

    async def kill_groups(self, pids: list[int]) -> None:
        for pid in pids:
            _kill_group(pid)
            self.groups.discard(pid)

    async def open_agent(self, command: str) -> AgentStream:
        stream = await spawn(["/bin/sh", "-c", command], os.environ, None)
        # On another machine, behind srun: the client pings it, and it stops when the pings stop.
        stream.remote = True
        return stream

    async def close(self) -> None:
        self.closed = True
        for pid in list(self.groups):
            _kill_group(pid)
        self.groups.clear()


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class LocalProcess:
    """A command started by `LocalLogin.start`: its stdio pipes and its process group."""

    def __init__(self, login: LocalLogin, process: asyncio.subprocess.Process) -> None:
        assert process.stdin and process.stdout and process.stderr
        self.host = login
        self.process = _Pipes(process.stdin, process.stdout, process.stderr)
        self.pid = process.pid
        self._child = process

    async def exit_status(self) -> int | None:
        status = await self._child.wait()
        self.host.groups.discard(self.pid)
        return status


@dataclass(frozen=True)
class _Pipes:
    stdin: asyncio.StreamWriter
    stdout: asyncio.StreamReader
    stderr: asyncio.StreamReader


class _LocalHeld:
    def __init__(self, process: asyncio.subprocess.Process, groups: set[int]) -> None:
        assert process.stdin and process.stdout and process.stderr
        self._process = process
        self._groups = groups

    async def stdout_line(self) -> str:
        assert self._process.stdout
        return (await self._process.stdout.readline()).decode(errors="replace")

    async def stderr_line(self) -> str:
        assert self._process.stderr
        return (await self._process.stderr.readline()).decode(errors="replace")

    def release(self) -> None:
        assert self._process.stdin
        with contextlib.suppress(OSError, RuntimeError):
            self._process.stdin.close()

    async def wait(self, timeout: float) -> int | None:
        try:
            return await asyncio.wait_for(self._process.wait(), timeout)
        except TimeoutError:
            _kill_group(self._process.pid)
            return await self._process.wait()
        finally:
            self._groups.discard(self._process.pid)


class SSHLogin:
    """A login node reached over SSH: the commands run there, on one verified connection.

    A held command is written a line every `keepalive` seconds, and is told to end once
    `idle_seconds` (four missed lines) pass without one (`commands.holder`): a client that
    went silent with its connection left open still lets the allocation go."""

    def __init__(self, host: SSHHost, keepalive: float = 15.0) -> None:
        self.host = host
        self.keepalive = keepalive

    @property
    def idle_seconds(self) -> int:
        return math.ceil(4 * self.keepalive)

    def __str__(self) -> str:
        return str(self.host)

    @property
    def address(self) -> str:
        return self.host.address

    @property
    def closed(self) -> bool:
        return self.host.closed

    async def run(self, command: str, input: bytes = b"", log: Log | None = None) -> Completed:
        return await self.host.run(command, input, log)

    async def hold(self, command: str) -> Held:
        return _SSHHeld(await self.host.start(command), self.keepalive)

    async def start(self, command: str) -> StreamedProcess:
        return await self.host.start(command)

    async def open_agent(self, command: str) -> AgentStream:
        return await open_agent(self.host, command)

    async def close(self) -> None:
        await self.host.close()


class _SSHHeld:
    def __init__(self, process: RemoteProcess, keepalive: float) -> None:
        self._process = process
        self._beats = asyncio.ensure_future(self._beat(keepalive))

    async def _beat(self, keepalive: float) -> None:
        with contextlib.suppress(OSError, asyncssh.Error):
            while True:
                await asyncio.sleep(keepalive)
                self._process.process.stdin.write(b"\n")

    async def stdout_line(self) -> str:
        return (await self._process.process.stdout.readline()).decode(errors="replace")

    async def stderr_line(self) -> str:
        return (await self._process.process.stderr.readline()).decode(errors="replace")

    def release(self) -> None:
        self._beats.cancel()
        with contextlib.suppress(OSError, asyncssh.Error):
            self._process.process.stdin.write_eof()

    async def wait(self, timeout: float) -> int | None:
        try:
            return await asyncio.wait_for(self._process.exit_status(), timeout)
        except TimeoutError:
            await self._process.host.kill_groups([self._process.pid])
            return None
        finally:
            self._process.host.groups.discard(self._process.pid)
