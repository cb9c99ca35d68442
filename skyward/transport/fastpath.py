"""THE CLIENT'S FAST PATH: what every call's bytes go through on the client, written for speed.

Everything else on the client calls these and is written plainly (see docs/architecture.md, "Why
the per-call path is written flat"). Each piece is here because `benchmarks/bench_local.py`
showed it pays (the figure it serves is named beside it); `tests/test_fastpath.py` checks each
against the plain behaviour it stands for.

- `all_held`: a broadcast's locks, taken in list order with one loop run in C and given back the
  same way, once per broadcast rather than a ``with`` block per node (`broadcast`).
- `settle_frames`: it settles small `Result`s straight from the chunk they came in, without
  building a message or copying the bytes into a buffer (`rtt`, `broadcast`: one reply per
  chunk; `gather`: many), reading their header and packed metadata with `frames.RESULT_FRAME`
  in place; other frames' metadata is read by `frames.read_meta`, the format's plain reader.
- `register_each` and `write_each`: a broadcast's call registered on every node's session, then
  written to every node's pipe, each in one Python call with all the locks taken at once
  (`broadcast`: a method call or two per node cost it about a third, in A/B runs of this
  module's commit against the per-node calls written plainly).
- `ReplyDecoder.feed`: a session's frame decoder, which hands every chunk that starts at a
  frame's start to `settle_frames`; a frame cut short at a chunk's end is finished by the plain
  `frames.FrameDecoder`, and the rest of that chunk goes back to `settle_frames` (`gather`: its
  replies come many to a chunk, and chunks rarely end where a frame does). Its plain twin is
  `frames.FrameDecoder` with `settle` for each `Result`.
- `PipeGroup.read_until`: a Local broadcast's replies, read from all its pipes in one poll loop
  in the caller's thread (`broadcast`: the floor it is measured against reads 8 raw pipes the
  same way); `KeptGroups`: each broadcast's group built once, kept by its list's identity.
- `ControlReader`: one Local agent's control pipe, read by a background thread or by the caller
  that waits for a reply (leader and follower), with reads that start small and grow (`rtt`).
  Its plain twin is a blocking `os.read` loop over the pipe.

The agent's fast path is the marked loop of `agentwire.AgentWire._serve_flat`.
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import os
import pickle
import select
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from skyward.transport import frames
from skyward.transport.base import Receiver
from skyward.transport.frames import (
    HEADER,
    LENGTH,
    PACKED,
    PACKED_RESULT,
    RESULT,
    RESULT_FRAME,
    Outcome,
    Patience,
    lengths_of,
    read_meta,
)
from skyward.transport.messages import Message, Result, from_wire

_ACQUIRE, _RELEASE = _thread.LockType.acquire, _thread.LockType.release
# Runs an iterator to its end in C.
_consume: Callable[[Iterable[object]], None] = collections.deque[object](maxlen=0).extend
_loads = pickle.loads
_PACKED_SIZE = PACKED_RESULT.size


class all_held:
    """``with all_held(locks):`` holds every lock of `locks`, taken in the list's order (so two
    holders of overlapping lists, each in one order, cannot deadlock) and given back on the way
    out, also when the taking was interrupted (only what was taken is given back).

    Why not a ``with`` per lock: a broadcast takes one lock per node, and `map` over the lock
    type's own methods costs no bytecode per lock (`bench_local.py --only broadcast`)."""

    __slots__ = ("_locks", "_taken")

    def __init__(self, locks: Sequence[threading.Lock]) -> None:
        self._locks = locks
        self._taken: list[bool] = []  # one entry per lock taken, in order

    def __enter__(self) -> None:
        try:
            self._taken.extend(map(_ACQUIRE, self._locks))  # `extend` keeps what it took
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *_: object) -> None:
        taken, self._taken = len(self._taken), []
        _consume(map(_RELEASE, self._locks[:taken]))


class Registry(Protocol):
    """What `register_each` reads and fills of one node's session (`client.session`'s)."""

    @property
    def dead(self) -> BaseException | None: ...
    @property
    def pending(self) -> dict[int, Any]: ...
    @property
    def sent_functions(self) -> set[int]: ...


class Frames(Protocol):
    """One call's frames (`frames.CallFrames`)."""

    @property
    def call_id(self) -> int: ...
    @property
    def fn_id(self) -> int: ...
    @property
    def without_fn(self) -> list[frames.Buffer]: ...
    @property
    def with_fn(self) -> list[frames.Buffer] | None: ...


def register_each(
    call: Frames,
    sessions: Sequence[Registry],
    replies: Sequence[Any],
    locks: Sequence[threading.Lock],
) -> list[list[frames.Buffer]]:
    """Register `call` on every session with its reply, every session's lock held (`locks`,
    theirs, in order); the bytes to write to each: none where the node is dead (its reply
    fails now). The replies are `client.dispatch.Reply`s, never cancelled.

    FAST PATH (`broadcast`): one Python call for every node; the plain version is
    `NodeSession.register`, which a `>>` and a gather use."""
    out: list[list[frames.Buffer]] = []
    call_id, fn_id = call.call_id, call.fn_id
    with_fn = call.with_fn
    with all_held(locks):
        for session, reply in zip(sessions, replies, strict=True):
            if session.dead is not None:
                reply.set_exception(session.dead)
                out.append([])
                continue
            session.pending[call_id] = reply
            if with_fn is None or fn_id in session.sent_functions:
                out.append(call.without_fn)
            else:
                out.append(with_fn)
    return out


class PipeWriter(Protocol):
    """A Local agent's control pipe as `write_each` writes it (`pipes.SubprocessStream`)."""

    @property
    def write_lock(self) -> threading.Lock: ...
    @property
    def stdin_fd(self) -> int: ...


def write_each(
    pipes: Sequence[PipeWriter],
    locks: Sequence[threading.Lock],
    chunks: Sequence[Sequence[frames.Buffer]],
) -> list[tuple[int, OSError]]:
    """Write each pipe its chunks, back to back, with every pipe's write lock (`locks`, in
    order) held; each failed write's index and error.

    FAST PATH (`broadcast`): one Python call for every node; the plain version is
    `SubprocessStream.write`. A write that blocks (an agent that stopped reading) holds up the
    other nodes' writes until it is done."""
    failed: list[tuple[int, OSError]] = []
    write_all = frames.write_all
    with all_held(locks):
        for index, (pipe, node_chunks) in enumerate(zip(pipes, chunks, strict=True)):
            try:
                for chunk in node_chunks:
                    write_all(pipe.stdin_fd, chunk)
            except OSError as exc:
                failed.append((index, exc))
    return failed


Unpicklable = Callable[[Any, Exception], None]
OnFrame = Callable[[Message, list[frames.Buffer]], None]


def settle(
    pending: dict[int, Any],
    call_id: int,
    segments: Sequence[frames.Buffer],
    unpicklable: Unpicklable,
) -> None:
    """Settle call `call_id` (taken out of `pending`) with the result `segments` hold; one that
    cannot be unpickled goes to `unpicklable` with why. A call no longer pending (failed
    meanwhile: its node was stopped) is left alone."""
    outcome = pending.pop(call_id, None)
    if outcome is None:
        return
    try:
        value = _loads(segments[0], buffers=segments[1:])
    except Exception as exc:
        unpicklable(outcome, exc)
        return
    outcome.set_result(value)


def settle_frames(
    data: bytes, pending: dict[int, Any], unpicklable: Unpicklable, on_frame: OnFrame
) -> int:
    """Decode the whole frames at the start of `data` (a chunk read at a frame's start): each
    `Result` settles its call in `pending` (`settle`), any other frame goes to `on_frame`.
    Returns where the whole frames end: the rest (a frame cut short) is for `FrameDecoder`.

    FAST PATH (every reply of `rtt`, `broadcast` and `gather` comes here): each frame is sliced
    straight from `data`, with no copy into the decoder's buffer, and a small `Result` settles
    its call without a message being built. A small `Result`'s header and packed metadata are
    read in place with one struct, `frames.RESULT_FRAME` (the agent's loop writes them with it),
    and its call settled here, `settle` written out; every other frame's metadata is read by
    `frames.read_meta`, as on the plain path. Reading a small `Result` with `read_meta` and
    `settle` made the client run 4% more instructions per no-op `>>` (callgrind), which put the
    `>>` at 1.19x of the nested call path's figure, against 1.14x: too near its 1.2x target
    (benchmarks/README.md, "The flat call path: before and after")."""
    offset, end = 0, len(data)
    while end - offset >= HEADER.size:
        if end - offset >= RESULT_FRAME.size:
            meta_len, count, first, marker, kind, call_id = RESULT_FRAME.unpack_from(data, offset)
            if marker == PACKED and kind == RESULT and count == 1 and meta_len == _PACKED_SIZE:
                start = offset + RESULT_FRAME.size
                stop = start + first
                if stop > end:
                    break
                offset = stop
                # `settle(pending, call_id, (data[start:stop],), unpicklable)`, written out
                outcome = pending.pop(call_id, None)
                if outcome is None:
                    continue
                try:
                    value = _loads(data[start:stop])
                except Exception as exc:
                    unpicklable(outcome, exc)
                    continue
                outcome.set_result(value)
                continue
        meta_len, count = HEADER.unpack_from(data, offset)
        start = offset + HEADER.size + LENGTH.size * count
        if start > end:
            break
        lengths = lengths_of(count).unpack_from(data, offset + HEADER.size)
        stop = start + meta_len + sum(lengths)
        if stop > end:
            break
        message = from_wire(read_meta(data, start, meta_len))
        segments: list[frames.Buffer] = []
        position = start + meta_len
        for size in lengths:
            segments.append(data[position : position + size])
            position += size
        offset = stop
        if type(message) is Result:  # a large result, or one whose segments are several
            settle(pending, message.call_id, segments, unpicklable)
        else:
            on_frame(message, segments)
    return offset


class Reader(Protocol):
    """One pipe's reader, as a `PipeGroup` uses it (`pipes.SubprocessStream`'s)."""

    @property
    def fd(self) -> int: ...

    @property
    def lock(self) -> threading.Lock:
        """Held by whoever reads the pipe."""
        ...

    @property
    def ended(self) -> bool: ...

    def enter(self) -> None:
        """A caller is about to read (the reader's own thread steps aside)."""
        ...

    def leave(self) -> None: ...

    def read_once(self) -> bool:
        """Read what is there and deliver it (`lock` held); False once the pipe has ended."""
        ...


class PipeGroup:
    """The pipes one caller reads together (a Local broadcast's), kept from one call to the
    next with their locks and poll set; `broken` once one of them has ended (the owner then
    makes a fresh group, without it)."""

    def __init__(self, readers: Iterable[Reader]) -> None:
        self.readers = sorted(readers, key=lambda r: r.fd)  # one lock order: no deadlock
        self.locks = [reader.lock for reader in self.readers]
        self.broken = False
        self._by_fd = {reader.fd: reader for reader in self.readers}
        self._poller = select.poll()
        for fd in self._by_fd:
            self._poller.register(fd, select.POLLIN)

    def read_until(self, done: Callable[[], bool], poll: float = 0.05) -> None:
        """Read every pipe of the group in this thread until `done()` (checked at least every
        `poll` s) or every pipe has ended.

        FAST PATH (`broadcast`): the pipes' locks are held throughout (`all_held`), and one
        poll over all of them wakes this thread for whichever replies came."""
        for reader in self.readers:
            reader.enter()
        try:
            with all_held(self.locks):
                if any(reader.ended for reader in self.readers):
                    self.broken = True
                    for reader in [r for r in self.readers if r.ended]:
                        self._drop(reader)
                by_fd, wait = self._by_fd, self._poller.poll
                timeout_ms = poll * 1000
                while by_fd and not done():
                    for fd, _ in wait(timeout_ms):
                        reader = by_fd[fd]
                        if not reader.read_once():
                            self._drop(reader)
                            self.broken = True
                            # Its node's end is settled on the loop in a few ms, which ends
                            # `done()` without a byte on the other pipes: look often till then.
                            timeout_ms = 1
        finally:
            for reader in self.readers:
                reader.leave()

    def _drop(self, reader: Reader) -> None:
        if self._by_fd.pop(reader.fd, None) is not None:
            self._poller.unregister(reader.fd)


# A read allocates a bytes object of the size asked for, then shrinks it to what came: at 1 MiB
# that is an mmap, a page fault and an munmap, and past 512 bytes a malloc and a realloc, on
# every small reply (most replies are a few dozen bytes). A pipe's reads start small and grow a
# step each time one comes back full, back to small once one does not.
_SMALL_READ = 256
_NEXT_READ = {_SMALL_READ: 1 << 16, 1 << 16: 1 << 20, 1 << 20: 1 << 20}


class ControlReader:
    """Leader/follower reading of one pipe: a background thread, or a caller that takes over
    (`rtt`: the caller reads its own reply, no thread hands it over; `gather`, `broadcast`).

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


class KeptGroups:
    """The `PipeGroup` of each list of streams a caller waits on, kept by the list's identity
    (held beside it, so the id stays its own) until one of its pipes ends (`broadcast`: a pool
    passes the same list to every broadcast, whose group is then built once). Its plain twin is
    a fresh `PipeGroup` of the list's readers for every wait."""

    KEPT = 8  # a pool's broadcasts use one group, its gathers others

    def __init__(self, readers_of: Callable[[Sequence[Any]], Iterable[Reader]]) -> None:
        self._readers_of = readers_of
        self._groups: dict[int, tuple[Sequence[Any], PipeGroup]] = {}

    def of(self, streams: Sequence[Any]) -> PipeGroup:
        then, kept = self._groups.get(id(streams), (None, None))
        if kept is None or then is not streams or kept.broken:
            if len(self._groups) >= self.KEPT:
                self._groups.clear()
            kept = PipeGroup(set(self._readers_of(streams)))
            self._groups[id(streams)] = (streams, kept)
        return kept


class HoldsCalls(Protocol):
    """Whose calls the replies answer: a node session."""

    @property
    def pending(self) -> dict[int, Outcome]:
        """The calls sent and not yet answered, by call id."""
        ...


class ReplyDecoder(frames.FrameDecoder):
    """Decodes one node's control stream; a `Result` settles its call in `calls.pending`."""

    def __init__(
        self,
        calls: HoldsCalls,
        on_frame: Callable[[Message, list[frames.Buffer]], None],
        on_unpicklable: Callable[[Outcome, Exception], None],
        on_end: Callable[[], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        """`on_frame` gets every message but a `Result`; `on_unpicklable` an outcome whose
        result could not be unpickled, and why."""
        super().__init__(self._on_message, on_end, on_error)
        self._calls = calls
        self._on_other = on_frame
        self._on_unpicklable = on_unpicklable

    def feed(self, data: frames.Buffer) -> None:
        """`FrameDecoder.feed`, with the whole frames of a chunk read by `settle_frames`.

        FAST PATH (`rtt`, `broadcast`, `gather`: every reply)."""
        if type(data) is bytes and data and not self.between_frames:
            # A frame cut short by the last chunk: its rest goes to the plain decoder, so that
            # the frames after it are read by the fast path too (a gather's replies come many
            # to a chunk, and chunks rarely end where a frame does).
            view, taken = memoryview(data), 0
            while 0 < (wanted := self.bytes_wanted()) < len(data) - taken:
                super().feed(view[taken : taken + wanted])
                taken += wanted
            if taken:
                data = data[taken:]
        if type(data) is bytes and data and self.between_frames:
            self.last_fed = time.monotonic()
            try:
                taken = settle_frames(
                    data, self._calls.pending, self._on_unpicklable, self._on_other
                )
            except Exception as exc:
                if self._on_error is None:
                    raise
                self._on_error(exc)
                return
            if taken == len(data):
                return
            data = data[taken:]
        super().feed(data)

    def _on_message(self, message: Message, segments: list[frames.Buffer]) -> None:
        if type(message) is Result:  # a large one, or one split across chunks
            settle(self._calls.pending, message.call_id, segments, self._on_unpicklable)
        else:
            self._on_other(message, segments)
