"""What the remote machinery needs of a host: a name, and a way to run a command on it.

An `SSHHost` is one (a connection to a machine). So is a Slurm compute node, whose commands
run as job steps started from the login node (`providers.slurm.steps.StepHost`). The bootstrap
(`bootstrap`, `hoststeps`) and the output upload run on any `Host`; pushing a data tree to a
node (`treepeer`) streams over an SSH channel, so it takes an `SSHHost`.
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

    async def close(self) -> None:
        """Kill what was started through this host and let it go; idempotent."""
        ...
