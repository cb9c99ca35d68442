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
import operator
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from itertools import count, repeat
from typing import IO

from skyward.transport.base import AgentStream, Receiver
from skyward.transport.frames import Buffer, spin_until, write_all
from skyward.transport.lockloops import ACQUIRE, RELEASE, consume

# A read allocates a bytes object of the size asked for, then shrinks it to what came: at 1 MiB
# that is an mmap, a page fault and an munmap, and past 512 bytes a malloc and a realloc, on
# every small reply (most replies are a few dozen bytes). A pipe's reads start small and grow a
# step each time one comes back full, back to small once one does not.
_SMALL_READ = 256
_NEXT_READ = {_SMALL_READ: 1 << 16, 1 << 16: 1 << 20, 1 << 20: 1 << 20}
_OUTPUT_READ = 1 << 16  # the agent's output: lines, read on the event loop
_ENDED = operator.attrgetter("_ended")
_SELECTING = operator.attrgetter("_selecting")
# What a group of pipes would otherwise ask each of its pipes on every broadcast: a token
# replaced by a new one whenever a pipe ends (under that pipe's lock, so a caller holding the
# locks sees it; a group keeps the token it last saw with all its pipes open), and the reader
# threads waiting in select (added once the flag is set: see `_background`).
_ENDING: list[object] = [object()]
_SELECTING_NOW: set[_ControlReader] = set()
_STDIN_FD = operator.attrgetter("_stdin_fd")
_LAST_CALLER = repeat("_last_caller")


class SubprocessStream:
    """A local agent process in its own session, so `kill` takes down what it started too."""

    remote = False  # a child of the client: its pipes close when the client dies

    def __init__(self, process: subprocess.Popen[bytes], linger: float = 0.0) -> None:
        assert process.stdin and process.stdout and process.stderr
        self._process = process
        self._linger = linger
        self.pid = process.pid
        self._write_lock = threading.Lock()
        self._stdin_fd = process.stdin.fileno()
        self._exit: asyncio.Future[int | None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._control: _ControlReader | None = None
        self._last_reply = 0.0  # seconds the last lone reply took to come
        self._groups: dict[int, _Group] = {}  # see `wait_replies`

    def start(self, on_control: Receiver, on_output: Receiver) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._exit = loop.create_future()
        assert self._process.stdout and self._process.stderr
        self._control = _ControlReader(self._process.stdout.fileno(), on_control)
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
            if self._control is not None:
                # Poll only while replies come quickly: when the last one took far longer (a
                # real step, not a small call), polling would only take a core from the node's
                # own threads (XLA's, on the CPU) for nothing.
                quick = self._last_reply < 4 * self._linger
                began = time.perf_counter()
                self._control.read_until(done, self._linger if quick else 0.0)
                self._last_reply = time.perf_counter() - began
            return
        kept = self._group(group)
        if len(kept.readers) <= 1:
            if kept.readers:
                kept.readers[0].read_until(done, self._linger)
            return
        _ControlReader.read_all_until(kept, done)

    def _group(self, streams: Sequence[AgentStream]) -> _Group:
        """The kept `_Group` of `streams`: a pool passes the same list for each broadcast, so
        its group is kept by the list's identity (the group holds the list, so the id stays
        its own)."""
        kept = self._groups.get(id(streams))
        if kept is None or kept.streams is not streams or kept.broken:
            if len(self._groups) >= 8:  # a pool's broadcasts use one group, its gathers others
                self._groups.clear()
            kept = self._groups[id(streams)] = _Group(streams)
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
        fd = self._stdin_fd
        with self._write_lock:
            for chunk in chunks:
                written = os.write(fd, chunk)  # one write is the common case (a small frame)
                if written < len(chunk):  # (chunks count bytes: see AgentStream.write)
                    write_all(fd, memoryview(chunk).cast("B")[written:])

    def write_each(
        self, streams: Sequence[AgentStream], chunks: Sequence[Sequence[Buffer]]
    ) -> list[tuple[int, OSError]]:
        # Every stream's write lock is taken at once, in C (see `lockloops`): a broadcast
        # pays for them once per node on every call. A write that blocks (an agent that has
        # stopped reading) holds up the other nodes' writers until it is done.
        locks = self._group(streams).write_locks
        failed: list[tuple[int, OSError]] = []
        held: list[bool] = []  # one entry per lock taken, in order (`extend` keeps what it took)
        try:
            held.extend(map(ACQUIRE, locks))
            for index, fd, node_chunks in zip(count(), map(_STDIN_FD, streams), chunks):
                try:  # `write`, written out
                    for chunk in node_chunks:
                        written = os.write(fd, chunk)
                        if written < len(chunk):  # (chunks count bytes: see AgentStream.write)
                            write_all(fd, memoryview(chunk).cast("B")[written:])
                except OSError as exc:
                    failed.append((index, exc))
        finally:
            consume(map(RELEASE, locks[: len(held)]))
        return failed

    def close_input(self) -> None:
        with self._write_lock, contextlib.suppress(OSError):
            assert self._process.stdin
            self._stdin_fd = -1  # a later write fails (EBADF), never reaches a reused number
            self._process.stdin.close()

    async def exit_status(self) -> int | None:
        assert self._exit is not None, "start() first"
        return await asyncio.shield(self._exit)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)


class _ControlReader:
    """Leader/follower reading of one pipe: a background thread, or a caller that takes over.

    Only the holder of `_lock` reads and delivers, so bytes reach the receiver in order. A
    caller that wants to read kicks the background thread out of its wait if it is in one; the
    thread then stays out while callers come, and for `LINGER` seconds after the last one left,
    so back-to-back calls cost it no wake-ups. The price: a reply that nobody waits for in
    `read_until` (a `submit` future) can wait up to `BUSY_POLL` after a caller left.
    """

    LINGER = 0.001
    BUSY_POLL = 0.05

    def __init__(self, fd: int, receiver: Receiver) -> None:
        self.fd = fd  # the pipe (read by `_Group` to poll it)
        self._receiver = receiver
        self._read_size = _SMALL_READ
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)
        self._lock = threading.Lock()
        # One entry per caller reading or about to (list.append and pop are atomic: a caller
        # takes no lock to come and go, see `_enter`), and when the last one left.
        self._callers: list[None] = []
        self._last_caller = 0.0
        # Guards the fields below; a plain lock (not a Condition): nobody needs to be notified.
        self._state = threading.Lock()
        self._selecting = False
        self._kick_r, self._kick_w = os.pipe()
        os.set_blocking(self._kick_r, False)
        self._ended = False
        self._closed_kick = False
        threading.Thread(target=self._background, name="skyward-pipe-reader", daemon=True).start()

    def _read_once(self) -> None:
        """Read what is there and deliver it (the lock is held)."""
        size = self._read_size
        try:
            data = os.read(self.fd, size)
        except OSError:
            data = b""
        self._read_size = _NEXT_READ[size] if len(data) == size else _SMALL_READ
        if not data:
            self._ended = True
            self._finish()
        self._receiver(data)

    def _finish(self) -> None:
        _ENDING[0] = object()  # (the lock is held)
        with self._state:  # no caller kicks a closed pipe (its number may be reused)
            self._closed_kick = True
            for fd in (self._kick_r, self._kick_w):
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _background(self) -> None:
        while not self._ended:
            while True:
                with self._state:
                    callers, idle = len(self._callers), time.monotonic() - self._last_caller
                    if not callers and idle >= self.LINGER:
                        self._selecting = True
                        _SELECTING_NOW.add(self)
                        # A caller that came after the count above and before the flag was
                        # set saw no flag, so it will not kick: look again now it is set.
                        if not self._callers:
                            break
                        self._selecting = False
                        _SELECTING_NOW.discard(self)
                        callers = 1
                # Nobody wakes this thread when callers leave (that would cost a wake-up per
                # call): it looks again now and then.
                time.sleep(self.BUSY_POLL if callers else self.LINGER - idle)
            with self._lock:
                if self._ended:
                    return
                ready, _, _ = select.select([self.fd, self._kick_r], [], [])
                with self._state:
                    self._selecting = False
                    _SELECTING_NOW.discard(self)
                if self._kick_r in ready:
                    with contextlib.suppress(OSError):
                        os.read(self._kick_r, 4096)
                if self.fd in ready:
                    self._read_once()

    def _enter(self) -> None:
        # Counted first, then the flag read: the background thread sets the flag first, then
        # counts (see `_background`), so either it sees this caller or this caller kicks it.
        self._callers.append(None)
        if self._selecting:
            self._kick()

    def _kick(self) -> None:
        """Ask the background reader to step aside (it waits in select)."""
        with self._state:  # no caller kicks a closed pipe (its number may be reused)
            if not self._closed_kick:
                with contextlib.suppress(OSError):
                    os.write(self._kick_w, b"k")

    def _leave(self) -> None:
        self._last_caller = time.monotonic()  # before the count drops: see `_background`
        self._callers.pop()

    def read_until(self, done: Callable[[], bool], linger: float = 0.0) -> None:
        """Read and deliver until `done()`; poll up to `linger` seconds before each blocking
        read, so a quick reply finds this thread awake (see AgentWire.linger)."""
        self._enter()
        try:
            with self._lock:
                while not done() and not self._ended:
                    if linger > 0:
                        spin_until(lambda: bool(self._poller.poll(0)), linger)
                    self._read_once()  # the pipe blocks: this thread sleeps in read()
        finally:
            self._leave()

    @classmethod
    def read_all_until(cls, group: _Group, done: Callable[[], bool], poll: float = 0.05) -> None:
        """Read the pipes of `group` in this thread until `done()` (checked at least every
        `poll` s)."""
        # `_enter`, the locks and `_leave` for every pipe, each step as one loop in C (`map`,
        # run by `consume`: see `lockloops`): a broadcast pays them once per node on each call.
        readers = group.readers
        consume(map(list.append, group.callers, group.nones))
        if _SELECTING_NOW:  # a reader thread waits in select: rare
            for reader in filter(_SELECTING, readers):
                reader._kick()
        held: list[bool] = []  # one entry per lock taken, in order (`extend` keeps what it took)
        try:
            held.extend(map(ACQUIRE, group.locks))
            ending = _ENDING[0]
            if ending is group.ending or not any(map(_ENDED, readers)):  # every pipe is open
                group.ending = ending
                by_fd, poller = group.by_fd, group.poller
            else:
                group.broken = True  # the next caller builds a fresh poll set
                live = [r for r in readers if not r._ended]
                if len(live) == 1:
                    (only,) = live
                    while not done() and not only._ended:
                        only._read_once()  # one pipe: sleep in read() itself
                    return
                by_fd = {r.fd: r for r in live}
                poller = select.poll()
                for fd in by_fd:
                    poller.register(fd, select.POLLIN)
            timeout_ms = poll * 1000
            read = os.read
            while by_fd and not done():
                for fd, _ in poller.poll(timeout_ms):
                    reader = by_fd[fd]
                    size = reader._read_size
                    try:  # `_read_once`, written out: every reply of a broadcast comes here
                        data = read(fd, size)
                    except OSError:
                        data = b""
                    if data and len(data) < size:
                        reader._read_size = _SMALL_READ
                        reader._receiver(data)
                        continue
                    reader._read_size = _NEXT_READ[size] if data else _SMALL_READ
                    if not data:
                        reader._ended = True
                        reader._finish()
                    reader._receiver(data)
                    if reader._ended:
                        poller.unregister(fd)
                        del by_fd[fd]
                        group.broken = True
        finally:
            consume(map(RELEASE, group.locks[: len(held)]))
            consume(map(setattr, readers, _LAST_CALLER, repeat(time.monotonic())))
            consume(map(list.pop, group.callers))


class _Group:
    """The pipes of the streams one caller writes and reads together (a broadcast's), kept
    from one call to the next with their locks and poll set, not gathered on every call."""

    def __init__(self, streams: Sequence[AgentStream]) -> None:
        self.streams = streams  # the caller's list, by which the group is kept
        mine = [stream for stream in streams if isinstance(stream, SubprocessStream)]
        self.write_locks = [stream._write_lock for stream in mine]  # in `streams` order
        readers = {stream._control for stream in mine if stream._control is not None}
        self.readers = sorted(readers, key=lambda r: r.fd)  # one lock order: no deadlock
        self.broken = False  # a pipe ended: the next caller builds a fresh group
        self.ending: object = None  # `_ENDING`'s token when its pipes were last all open
        self.by_fd = {r.fd: r for r in self.readers}  # a pipe that ends leaves it (and `broken`)
        # what `read_all_until` steps through for every pipe, in `readers` order
        self.callers = [r._callers for r in self.readers]
        self.nones = [None] * len(self.readers)
        self.locks = [r._lock for r in self.readers]
        self.poller = select.poll()
        for fd in self.by_fd:
            self.poller.register(fd, select.POLLIN)


async def spawn(
    argv: list[str], env: Mapping[str, str], cwd: str | None, linger: float = 0.0
) -> SubprocessStream:
    """Start `argv` with piped stdin/stdout/stderr in a new session; a caller waiting for a
    reply polls up to `linger` seconds before it sleeps."""
    process = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(env),
        cwd=cwd,
        start_new_session=True,
        bufsize=0,
    )
    return SubprocessStream(process, linger)
