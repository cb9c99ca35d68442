"""What the pool needs from a running agent: a way to write to it, its bytes as they arrive, its
exit, and a kill switch.

The stream pushes what it reads into callbacks (no reader task between the bytes and the frame
decoder: that hop was most of a small call's round trip), so a local pipe and an SSH channel look
the same to the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from skyward.transport.frames import Buffer

Receiver = Callable[[bytes], None]


class AgentStream(Protocol):
    """A started agent: control frames in through `write`, out through `start`'s callbacks."""

    def start(self, on_control: Receiver, on_output: Receiver) -> None:
        """Deliver what the agent sends, on the event loop: its control bytes to `on_control`,
        its output (fds 1 and 2) to `on_output`, each as it arrives and ``b""`` once at its end.
        Called once, from the event loop."""
        ...

    def write(self, chunks: Sequence[Buffer]) -> None:
        """Send `chunks` to the agent's control input, in order; callable from any thread."""
        ...

    def close_input(self) -> None:
        """End the agent's control input (it then exits); the output keeps flowing."""
        ...

    async def wait(self) -> int | None:
        """Wait for the agent to end; its exit status (negative: killed by that signal)."""
        ...

    def kill(self) -> None:
        """End the agent and every process it started, now."""
        ...
