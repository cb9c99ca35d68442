"""What the remote machinery needs of a host: a name, and a way to run a command on it.

An `SSHHost` is one (a connection to a machine). So is a Slurm compute node, whose commands
run as job steps started from the login node (`providers.slurm.steps.StepHost`). The bootstrap
(`bootstrap`, `hoststeps`) and the output upload run on any `Host`. Pushing a data tree to a
node, or pulling its outputs (`treepeer`), streams over a `StreamedProcess` the node starts: an
SSH exec channel, or a job step whose stdio is srun's pipes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from skyward.transport.sshhost import Completed


class Host(Protocol):
    """A machine that runs shell commands for the pool."""

    @property
    def address(self) -> str:
        """How the client, and by default the other nodes, reach the machine."""
        ...

    @property
    def closed(self) -> bool:
        """Whether the host was closed (it runs nothing more)."""
        ...

    async def run(
        self, command: str, input: bytes = b"", log: Callable[[str], None] | None = None
    ) -> Completed:
        """Run `command` (a shell command line) to completion with `input` on its stdin; its
        stderr lines go to `log`. Cancelled: what it started is killed."""
        ...

    async def close(self, last: str = "") -> None:
        """Kill what was started through this host, run `last` (a shell command line, best
        effort) on it, and let it go; idempotent."""
        ...


class ByteWriter(Protocol):
    """A process's stdin, as asyncssh and asyncio both give it."""

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def write_eof(self) -> None: ...


class ByteReader(Protocol):
    """A process's stdout or stderr, as asyncssh and asyncio both give it."""

    async def read(self, n: int = -1) -> bytes: ...

    async def readline(self) -> bytes: ...

    async def readexactly(self, n: int) -> bytes: ...


class Stdio(Protocol):
    @property
    def stdin(self) -> ByteWriter: ...

    @property
    def stdout(self) -> ByteReader: ...

    @property
    def stderr(self) -> ByteReader: ...


class Groups(Protocol):
    """What started the process, and kills its process group (an `SSHHost`, a Slurm login)."""

    @property
    def groups(self) -> set[int]: ...

    async def kill_groups(self, pids: list[int]) -> None: ...


class StreamedProcess(Protocol):
    """A process the client streams a tree over: `transport.sshhost.RemoteProcess`, or a
    Slurm step started on this machine (`providers.slurm.login.LocalProcess`)."""

    @property
    def host(self) -> Groups: ...

    @property
    def process(self) -> Stdio: ...

    @property
    def pid(self) -> int: ...

    async def exit_status(self) -> int | None: ...
