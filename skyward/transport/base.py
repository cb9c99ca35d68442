"""What the pool needs from a running agent: its three byte streams, its exit, and a kill switch.

An asyncio subprocess and an asyncssh process both fit this shape, so the pool talks to a local
child and to a remote node the same way.
"""

from __future__ import annotations

from typing import Protocol

from skyward.transport.frames import AsyncReader


class Writer(Protocol):
    """The agent's control input."""

    def write(self, data: bytes | memoryview) -> None: ...
    async def drain(self) -> None: ...
    def close(self) -> None: ...


class ChunkReader(Protocol):
    """The node's output (what the user's code printed, fds 1 and 2), as it arrives."""

    async def read(self, n: int) -> bytes:
        """Up to `n` bytes; b"" at the end."""
        ...


class AgentStream(Protocol):
    """A started agent: control frames in on `stdin`, out on `stdout`; output on `stderr`."""

    @property
    def stdin(self) -> Writer: ...
    @property
    def stdout(self) -> AsyncReader: ...
    @property
    def stderr(self) -> ChunkReader: ...

    async def wait(self) -> int | None:
        """Wait for the agent to end; its exit status (negative: killed by that signal)."""
        ...

    def kill(self) -> None:
        """End the agent and every process it started, now."""
        ...
