"""Agent streams over the pipes of a local child process.

The child's stdin is written directly by whichever thread sends (under a lock). Its control
output (stdout) is read by whoever waits for it: a caller blocked on replies reads the pipes
itself (`wait_replies`), so a reply reaches it with no thread in between, which on a small call
is most of the round trip; the rest of the time a reader thread per pipe does. Its other output
(stderr) is read on the event loop, and its exit is watched through a pidfd.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from skyward.transport.base import AgentStream, Receiver
from skyward.transport.fastpath import PipeGroup
from skyward.transport.frames import Buffer, Patience, write_all

# A read allocates a bytes object of the size asked for, then shrinks it to what came: at 1 MiB
# that is an mmap, a page fault and an munmap, and past 512 bytes a malloc and a realloc, on
# every small reply (most replies are a few dozen bytes). A pipe's reads start small and grow a
# step each time one comes back full, back to small once one does not.
_SMALL_READ = 256
_NEXT_READ = {_SMALL_READ: 1 << 16, 1 << 16: 1 << 20, 1 << 20: 1 << 20}
_OUTPUT_READ = 1 << 16  # the agent's output: lines, read on the event loop


class SubprocessStream:
    """A local agent process in its own session, so `kill` takes down what it started too."""

    remote = False  # a child of the client: its pipes close when the client dies

    def __init__(self, process: subprocess.Popen[bytes], linger: float = 0.0) -> None:
        assert process.stdin and process.stdout and process.stderr
        self._process = process
        self._linger = linger
        self.pid = process.pid
        self.write_lock = threading.Lock()
        self.stdin_fd = process.stdin.fileno()
        self._exit: asyncio.Future[int | None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.control: _ControlReader | None = None  # the agent's control output, once started
        self._last_reply = 0.0  # seconds the last lone reply took to come
        self._groups: dict[int, tuple[Sequence[AgentStream], PipeGroup]] = {}  # `wait_replies`

    def start(self, on_control: Receiver, on_output: Receiver) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._exit = loop.create_future()
        assert self._process.stdout and self._process.stderr
        self.control = _ControlReader(self._process.stdout.fileno(), on_control)
        os.set_blocking(self._process.stderr.fileno(), False)
        loop.add_reader(
            self._process.stderr.fileno(), self._readable, self._process.stderr, on_output
        )
        try:
            pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            # no pidfd (old kernel): a thread waits for the exit instead
            loop.run_in_executor(None, self._wait_blocking)
        else:
            loop.add_reader(pidfd, self._exited, pidfd)

    def wait_replies(self, group: Sequence[AgentStream], done: Callable[[], bool]) -> None:
        """Read the replies of `group`'s local agents in this thread until `done()`."""
        if len(group) == 1 and group[0] is self:  # one call's reply: the common case
            if self.control is not None:
                # Poll only while replies come quickly: when the last one took far longer (a
                # real step, not a small call), polling would only take a core from the node's
                # own threads (XLA's, on the CPU) for nothing.
                quick = self._last_reply < 4 * self._linger
                began = time.perf_counter()
                self.control.read_until(done, self._linger if quick else 0.0)
                self._last_reply = time.perf_counter() - began
            return
        kept = self._group(group)
        if len(kept.readers) > 1:
            kept.read_until(done)
        elif kept.readers:
            only = kept.readers[0]
            assert isinstance(only, _ControlReader)
            only.read_until(done, self._linger)

    def _group(self, streams: Sequence[AgentStream]) -> PipeGroup:
        """The kept `PipeGroup` of `streams`' pipes: a pool passes the same list for each
        broadcast, so its group is kept by the list's identity (held beside it, so the id stays
        its own) until one of its pipes ends."""
        streams_then, kept = self._groups.get(id(streams), (None, None))
        if kept is None or streams_then is not streams or kept.broken:
            if len(self._groups) >= 8:  # a pool's broadcasts use one group, its gathers others
                self._groups.clear()
            readers = [s.control for s in streams if isinstance(s, SubprocessStream)]
            kept = PipeGroup({reader for reader in readers if reader is not None})
            self._groups[id(streams)] = (streams, kept)
        return kept

    def _readable(self, pipe: IO[bytes], receiver: Receiver) -> None:
        try:
            data = os.read(pipe.fileno(), _OUTPUT_READ)
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
        with self.write_lock:
            for chunk in chunks:
                write_all(self.stdin_fd, chunk)

    def close_input(self) -> None:
        with self.write_lock, contextlib.suppress(OSError):
            assert self._process.stdin
            self.stdin_fd = -1  # a later write fails (EBADF), never reaches a reused number
            self._process.stdin.close()

    async def exit_status(self) -> int | None:
        assert self._exit is not None, "start() first"
        return await asyncio.shield(self._exit)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        if self.control is not None:
            self.control.wake()

    def kill_at_end(self) -> None:
        self.kill()  # a local signal: nothing to save

    def signal(self, signum: int) -> None:
        # The child itself: the agent, or the srun that forwards it to the agent's step.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, signum)


class _ControlReader:
    """Leader/follower reading of one pipe: a background thread, or a caller that takes over.

    Only the holder of `lock` reads and delivers, so bytes reach the receiver in order. A caller
    that wants to read (`enter`) kicks the background thread out of its wait if it is in one;
    the thread then stays out while callers come, and for `LINGER` seconds after the last one
    left, so back-to-back calls cost it no wake-ups. The price: a reply that nobody waits for
    in `read_until` (a `submit` future) can wait up to `BUSY_POLL` after a caller left.
    """

    LINGER = 0.001
    BUSY_POLL = 0.05

    def __init__(self, fd: int, receiver: Receiver) -> None:
        self.fd = fd
        self.lock = threading.Lock()  # held by whoever reads the pipe
        self.ended = False  # the pipe has ended (set with `lock` held)
        self._receiver = receiver
        self._read_size = _SMALL_READ
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)
        self._patience = Patience(0.0)  # the callers' wait (`read_until`'s linger)
        # Guards the fields below; a plain lock (not a Condition): nobody needs to be notified.
        self._state = threading.Lock()
        self._callers = 0  # callers reading or about to
        self._last_caller = 0.0  # when the last one left
        self._selecting = False  # the background thread waits in select
        # Set to end the background thread's wait between its looks (`wake`): a pipe about to
        # end (its agent killed) is read at once, not at the next look.
        self._woken = threading.Event()
        self._kick_r, self._kick_w = os.pipe()
        os.set_blocking(self._kick_r, False)
        self._closed_kick = False
        threading.Thread(target=self._background, name="skyward-pipe-reader", daemon=True).start()

    def read_once(self) -> bool:
        """Read what is there and deliver it (`lock` held); False once the pipe has ended."""
        size = self._read_size
        try:
            data = os.read(self.fd, size)
        except OSError:
            data = b""
        self._read_size = _NEXT_READ[size] if len(data) == size else _SMALL_READ
        if not data:
            self.ended = True
            self._close_kick()
        self._receiver(data)
        return not self.ended

    def _close_kick(self) -> None:
        with self._state:  # no caller kicks a closed pipe (its number may be reused)
            self._closed_kick = True
            for fd in (self._kick_r, self._kick_w):
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _background(self) -> None:
        while not self.ended:
            while True:
                with self._state:
                    callers, idle = self._callers, time.monotonic() - self._last_caller
                    if not callers and idle >= self.LINGER:
                        self._selecting = True  # a caller that comes now kicks (`enter`)
                        break
                # Nobody wakes this thread when callers leave (that would cost a wake-up per
                # call): it looks again now and then, or when woken (`wake`).
                self._woken.wait(self.BUSY_POLL if callers else self.LINGER - idle)
                self._woken.clear()
            with self.lock:
                if self.ended:
                    return
                ready, _, _ = select.select([self.fd, self._kick_r], [], [])
                with self._state:
                    self._selecting = False
                if self._kick_r in ready:
                    with contextlib.suppress(OSError):
                        os.read(self._kick_r, 4096)
                if self.fd in ready:
                    self.read_once()

    def wake(self) -> None:
        """Look at the pipe now (its agent was just killed: its end is to be read)."""
        self._woken.set()

    def enter(self) -> None:
        """A caller is about to read: the background thread steps aside (it is kicked out of
        its select if it waits there) and stays out until `LINGER` after the last `leave`."""
        with self._state:
            self._callers += 1
            if self._selecting and not self._closed_kick:
                with contextlib.suppress(OSError):
                    os.write(self._kick_w, b"k")

    def leave(self) -> None:
        with self._state:
            self._callers -= 1
            self._last_caller = time.monotonic()

    def read_until(self, done: Callable[[], bool], linger: float = 0.0) -> None:
        """Read and deliver until `done()`; poll up to `linger` seconds before each blocking
        read while polling pays (`Patience`), so a quick reply finds this thread awake."""
        self.enter()
        try:
            with self.lock:
                patience, poll = self._patience, self._poller.poll
                patience.window = linger
                while not done() and not self.ended:
                    patience.wait(lambda: bool(poll(0)))
                    self.read_once()  # the pipe blocks: this thread sleeps in read()
        finally:
            self.leave()


async def spawn(
    argv: list[str],
    env: Mapping[str, str],
    cwd: str | None,
    linger: float = 0.0,
    umask: int = -1,
) -> SubprocessStream:
    """Start `argv` with piped stdin/stdout/stderr in a new session (with `umask`, when one is
    given); a caller waiting for a reply polls up to `linger` seconds before it sleeps."""
    process = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(env),
        cwd=cwd,
        start_new_session=True,
        bufsize=0,
        umask=umask,
    )
    return SubprocessStream(process, linger)
