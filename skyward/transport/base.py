"""`AgentStream`: what a session needs from a running agent, however its bytes travel.

A way to write to the agent, its bytes as they arrive, its exit, a kill switch, and a way for a
caller to wait for replies. The stream pushes what it reads into callbacks (no reader task
between the bytes and the frame decoder: that hop was most of a small call's round trip), so a
local pipe and an SSH channel look the same to the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from skyward.transport.frames import Buffer

Receiver = Callable[[bytes], None]


class AgentStream(Protocol):
    """A started agent: control frames in through `write`, out through `start`'s callbacks."""

    # True when the agent runs on another machine: a network can cut it off from the client
    # without closing its stream, so the client pings it (`session.ping_agents`).
    remote: bool

    def start(self, on_control: Receiver, on_output: Receiver) -> None:
        """Deliver what the agent sends: its control bytes to `on_control`, its output (fds 1
        and 2) to `on_output`, each as it arrives and ``b""`` once at its end. Called once,
        from the event loop; bytes are delivered on the loop or in `wait_replies`."""
        ...

    def wait_replies(self, group: Sequence[AgentStream], done: Callable[[], bool]) -> None:
        """Help a caller that waits for replies from `group` (this stream among them).

        A local pipe is read and its replies delivered here until `done()`; an SSH channel's
        caller runs the pool's event loop, which reads every channel, until `done()`. Either
        saves the hand-offs between threads that are most of a small call's round trip. It
        may also return before `done()` (another caller runs the loop, or this thread cannot):
        the caller then waits on its futures, which whoever runs the loop resolves.
        """
        ...

    def write(self, chunks: Sequence[Buffer]) -> None:
        """Send `chunks` to the agent's control input, in order; callable from any thread.
        Each chunk's ``len`` is its size in bytes (bytes, bytearray, or a memoryview of format
        ``B``, as `frames` makes them)."""
        ...

    def close_input(self) -> None:
        """End the agent's control input (it then exits); the output keeps flowing."""
        ...

    async def exit_status(self) -> int | None:
        """Wait for the agent to end; its exit status (negative: killed by that signal)."""
        ...

    def kill(self) -> None:
        """End the agent and every process it started, now."""
        ...

    def kill_at_end(self) -> None:
        """The pool is ending, and its nodes or their connections go next: end the agent and
        every process it started with them, where that saves a command on the node (an SSH
        host's close kills all its groups in one), and now otherwise."""
        ...

    def signal(self, signum: int) -> None:
        """Send the agent signal `signum` (best effort; callable from any thread)."""
        ...
