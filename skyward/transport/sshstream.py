"""Agent streams over SSH exec channels (SSH, AWS and any provider reached over SSH).

An `ChannelStream` is the asyncssh session of the channel the agent runs in: the bytes asyncssh
decodes are handed to the node's session straight from `data_received`, with no reader task
between them (a task and a future per read were a tenth of a small call's round trip). Its
control bytes are the channel's stdout, its output the channel's stderr. Everything here runs
on whichever thread runs the pool's event loop (its own, or a caller waiting for replies:
`eventloop.LoopThread.drive`); `write` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Sequence

import asyncssh
from asyncssh.channel import SSHChannel

from skyward.errors import ProvisionError
from skyward.transport.base import AgentStream, Receiver
from skyward.transport.eventloop import lender
from skyward.transport.frames import Buffer
from skyward.transport.sshhost import SSHHost, find_pid

# The pid line comes first, after whatever a login shell's rc files print; a stream that sends
# this much without it is not our wrapper.
_MAX_PREAMBLE = 1 << 16


async def open_agent(host: SSHHost, command: str, timeout: float = 30.0) -> ChannelStream:
    """Start `command` (the agent) in its own process group on `host`; its stream."""
    loop = asyncio.get_running_loop()
    channel, session = await host.conn.create_session(
        lambda: ChannelStream(host, loop), host.wrap(command), encoding=None
    )
    assert isinstance(session, ChannelStream)
    try:
        pid = await asyncio.wait_for(asyncio.shield(session.pid_known), timeout)
    except BaseException:
        channel.close()
        raise
    host.adopt(pid)
    return session


class ChannelStream(asyncssh.SSHClientSession[bytes]):
    """The agent's channel: an `AgentStream` fed by asyncssh's session callbacks."""

    remote = True

    def __init__(self, host: SSHHost, loop: asyncio.AbstractEventLoop) -> None:
        self.host = host
        self.pid = 0
        self.pid_known: asyncio.Future[int] = loop.create_future()
        self._loop = loop
        self._lender = lender(loop)
        self._write_lock = threading.Lock()
        self._queued = 0  # writes handed to the loop and not yet done there
        self._channel: asyncssh.SSHClientChannel[bytes] | None = None
        self._preamble = b""
        # What arrives before `start` gives the receivers (the agent's first message may).
        self._early: list[tuple[bool, bytes]] = []
        self._control: Receiver | None = None
        self._output: Receiver | None = None
        self._ended = False
        self._closed: asyncio.Future[None] = loop.create_future()

    # -- asyncssh's callbacks (on the loop) ----------------------------------------------------

    def connection_made(self, chan: SSHChannel[bytes]) -> None:
        assert isinstance(chan, asyncssh.SSHClientChannel)
        self._channel = chan

    def data_received(self, data: bytes, datatype: int | None) -> None:
        if datatype == asyncssh.EXTENDED_DATA_STDERR:
            self._deliver(False, data)
        elif self.pid_known.done():
            self._deliver(True, data)
            if self._lender is not None:
                self._lender.settled()
        else:
            self._find_pid(data)

    def eof_received(self) -> bool:
        self._end()
        return True  # stay half open: the exit status comes after the end of the output

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.pid_known.done():
            self.pid_known.set_exception(
                ProvisionError("the remote command ended before reporting its pid")
            )
        self._end()  # a lost connection reads as the end, as a pipe's
        if not self._closed.done():
            self._closed.set_result(None)

    def _find_pid(self, data: bytes) -> None:
        # A login shell's rc files may print first; skip anything before the marker line.
        self._preamble += data
        found = find_pid(self._preamble)
        if found is None:
            if len(self._preamble) > _MAX_PREAMBLE:
                self.pid_known.set_exception(ProvisionError("no pid line from the agent's shell"))
            return
        (self.pid, rest), self._preamble = found, b""
        self.pid_known.set_result(self.pid)
        if rest:
            self._deliver(True, rest)

    def _deliver(self, control: bool, data: bytes) -> None:
        receiver = self._control if control else self._output
        if receiver is None:
            self._early.append((control, data))
        else:
            receiver(data)

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self._deliver(True, b"")
            self._deliver(False, b"")

    # -- AgentStream ---------------------------------------------------------------------------

    def start(self, on_control: Receiver, on_output: Receiver) -> None:
        self._control, self._output = on_control, on_output
        early, self._early = self._early, []
        for control, data in early:
            (on_control if control else on_output)(data)

    def wait_replies(self, group: Sequence[AgentStream], done: Callable[[], bool]) -> None:
        """Run the pool's loop, which reads every channel, in this thread until `done()`."""
        if self._lender is not None:
            self._lender.drive(done)

    def write(self, chunks: Sequence[Buffer]) -> None:
        lender = self._lender
        with self._write_lock:
            # asyncssh's channels belong to whoever runs the loop. When nobody does (a caller
            # between calls), this thread writes itself; otherwise the loop does, and so do the
            # writes after one that waits there, to keep each thread's writes in order.
            if not self._queued and lender is not None:
                if lender.holds():
                    self._write_now(chunks)
                    return
                if lender.borrow():
                    try:
                        self._write_now(chunks)
                    finally:
                        lender.give_back()
                    return
            self._queued += 1
        # A write done now is copied by asyncssh at once; a queued one is copied here, since
        # the caller may change its buffers (a numpy argument) before the loop writes them.
        data = [bytes(chunk) for chunk in chunks]
        self._loop.call_soon_threadsafe(self._write_queued, data)

    def _write_queued(self, data: list[bytes] | None) -> None:
        if data is None:
            self._eof()
        else:
            self._write_now(data)
        with self._write_lock:
            self._queued -= 1

    def _write_now(self, data: Sequence[Buffer]) -> None:
        if self._channel is None:
            return
        with contextlib.suppress(OSError, asyncssh.Error):
            for chunk in data:
                self._channel.write(chunk)

    def close_input(self) -> None:
        """Send EOF (the agent then exits) but keep the channel, so its output still arrives."""
        with self._write_lock:
            self._queued += 1
        self._loop.call_soon_threadsafe(self._write_queued, None)

    def _eof(self) -> None:
        if self._channel is not None:
            with contextlib.suppress(OSError, asyncssh.Error):
                self._channel.write_eof()

    async def exit_status(self) -> int | None:
        await asyncio.shield(self._closed)
        return None if self._channel is None else self._channel.get_returncode()

    def kill(self) -> None:
        """Kill the agent's whole process group on the host (scheduled on the running loop)."""
        if self.pid:
            self.host.schedule_kill(self.pid)

    def kill_at_end(self) -> None:
        """Leave the agent's group to its connection's close (`SSHHost.kill_at_close`; on the
        running loop, as `kill`)."""
        if self.pid:
            self.host.kill_at_close(self.pid)

    def signal(self, signum: int) -> None:
        """Send the agent `signum` on its host (a command on the connection, from the loop)."""
        if self.pid:
            self._loop.call_soon_threadsafe(self.host.schedule_signal, self.pid, signum)
