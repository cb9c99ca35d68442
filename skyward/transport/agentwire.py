"""`AgentWire`: the agent's side of the client <-> agent stream, in blocking frame I/O.

The agent spends its life in `AgentWire.serve` (its flat loop, `_serve_flat`). With many
agents sharing cores (an 8-node broadcast on a laptop), what a call costs on a node is mostly
the memory its path touches, fetched again each time the agent wakes with cold caches, so each
Python function call on the path costs several times what it does in a warm loop (one Python
call less per call on a node made the 8-node broadcast of `benchmarks/bench_local.py` about
20% faster on 2 cores). So the common case, a small call that returns, is read, run and
answered within the one loop of `_serve_flat`, with the agent's functions (`CallHost`).

Run by the worker agent (and the tests): standard library only.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import select
import struct
import threading
import time
from collections.abc import Callable, Sized
from typing import TYPE_CHECKING, Any, Protocol

from skyward.transport.frames import (
    CALL,
    COALESCE_LIMIT,
    HEADER,
    LENGTH,
    ONE_SEGMENT,
    PACKED,
    PACKED_CALL,
    PACKED_RESULT,
    PROTOCOL,
    RESULT,
    RESULT_FRAME,
    SCALARS,
    Buffer,
    FrameError,
    Patience,
    Segments,
    encode,
    encode_result,
    lengths_of,
    read_meta,
    write_all,
)
from skyward.transport.messages import Call, Heartbeat, Message, from_wire

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

# How long the agent polls for the next call after answering one (see AgentWire.linger). The
# provider sets it, and only where the agent has a core to itself: polling agents that share
# cores would slow each other down. It lives here, beside `linger`, because both its users
# (providers/local.py, worker/agent.py) import this module, and providers/local must not import
# worker/agent (an import circle).
LINGER_ENV = "SKYWARD_AGENT_LINGER_US"

_HEARTBEAT = b"".join(encode(Heartbeat()))


class _Held(Protocol):
    def locked(self) -> bool: ...


class Reports(Protocol):
    """The agent's queue of `sky.report` entries (`reports.Outbox`), as `serve` sees it."""

    @property
    def queue(self) -> Sized:
        """The entries not yet sent."""
        ...

    @property
    def sending(self) -> _Held:
        """Held while a batch is being written."""
        ...

    def flush(self) -> None: ...


class CallHost(Protocol):
    """What `AgentWire.serve` needs of the agent to run calls."""

    @property
    def functions(self) -> dict[int, Callable[..., Any]]:
        """The functions already loaded, by id."""
        ...

    @property
    def reports(self) -> Reports:
        """The reports queue, sent before each call's result."""
        ...

    def load_function(self, fn_id: int, fn_bytes: bytes | None) -> Callable[..., Any]:
        """Unpickle function `fn_id` (into `functions`); raises if it never came."""
        ...

    def fail_call(self, call_id: int, exc: BaseException, tb: str | None = None) -> None:
        """Answer call `call_id` with `exc`."""
        ...

    def dump_result(self, call_id: int, value: Any) -> Segments | None:
        """`value` as segments; None once the call is answered with why it cannot travel."""
        ...


class AgentWire:
    """Blocking frame I/O over two file descriptors.

    One thread reads (`read`, `serve`); while it is busy elsewhere (running a call), another
    may take the frames that have arrived meanwhile (`read_ahead`) and keep them for it, so that
    the client's pings are seen and its input never piles up. `last_input` is when bytes last
    arrived, by either way: every chunk read counts, a frame's header as much as the middle of
    a large segment, so a frame that takes minutes to cross a slow link is word from the client
    all along, and only silence is silence. Writes (`send`) are safe from any thread: each
    writes whole frames under the write lock.
    """

    def __init__(self, fd_in: int, fd_out: int) -> None:
        self.fileno_in = fd_in
        # Reads take exactly what they ask for, so nothing is ever buffered here: small parts
        # with os.read (a BufferedReader's refill, copying each part through its own buffer,
        # added to every call's cost on a node: `bench_local.py` measured the agent's CPU
        # per call without it), a large segment with an unbuffered reader, which fills one bytes
        # object of the segment's size in place, noting each chunk as it comes (`_Chunks`).
        self._whole = io.BufferedReader(_Chunks(self, fd_in), buffer_size=1)
        # One poll object per thread that polls (a poll object refuses concurrent use): the
        # reader's `linger` and the other thread's `read_ahead`.
        self._input, self._input_ahead = select.poll(), select.poll()
        self._patience = Patience(0.0)  # `linger`'s wait for the next call
        self._input.register(fd_in, select.POLLIN)
        self._input_ahead.register(fd_in, select.POLLIN)
        self._out_fd = fd_out
        self._lock = threading.Lock()  # held by whoever reads the input
        # Held while a frame is written. Re-entrant: a thread interrupted while it holds it (a
        # signal's handler that reports) may still write.
        self._write_lock = threading.RLock()
        self._early: collections.deque[tuple[Message, list[bytes]]] = collections.deque()
        self._ended = False
        self.last_input = time.monotonic()
        self._beat_every = 0.0  # while `read_ahead` reads: how often it sends a heartbeat
        self._last_beat = 0.0  # when `heartbeat` last sent one

    def send(self, message: Message, segments: Segments = ()) -> None:
        """Write one frame (from any thread: whole frames, one at a time)."""
        self._write(encode(message, segments))

    def _write(self, chunks: list[Buffer]) -> None:
        """Write one frame's chunks, under the write lock."""
        with self._write_lock:
            for chunk in chunks:
                write_all(self._out_fd, chunk)

    def heartbeat(self) -> None:
        """Send a `Heartbeat`, unless another frame is being written: a heartbeat could not
        overtake it, and its bytes are word from the node already. Never waits for that
        frame's end, which takes as long as the link needs (a large result over a slow one):
        the thread that sends heartbeats also judges the client's silence meanwhile."""
        if not self._write_lock.acquire(blocking=False):
            return
        try:
            write_all(self._out_fd, _HEARTBEAT)
        finally:
            self._write_lock.release()
        self._last_beat = time.monotonic()

    def heard(self) -> None:
        """Bytes came from the client (once per chunk read, whole frame or not): note when.
        While `read_ahead` reads a frame that is slow to come, send heartbeats meanwhile."""
        now = self.last_input = time.monotonic()
        if self._beat_every and now - self._last_beat >= self._beat_every:
            self.heartbeat()

    def serve(
        self,
        host: CallHost,
        other: Callable[[Message, list[bytes]], bool],
        linger: float = 0.0,
        shared: bool = False,
    ) -> None:
        """Run calls until the stream ends or `other` says to stop.

        Each `Call` runs here, with `host`'s functions, and its result is sent as its `Result`
        (an exception goes to `host.fail_call`). Any other message goes to `other`, which
        returns False to stop. After each call the wire polls for the next one for `linger`
        seconds. `shared`: another thread may take frames meanwhile (`read_ahead`), so every
        frame is read by `read`, under the lock; without it, a small call takes the fast path.
        """
        if shared:
            while (frame := self.read()) is not None and self._serve_frame(host, other, *frame):
                if linger:
                    self.linger(linger)
            return
        self._serve_flat(host, other, linger)

    def _serve_flat(
        self, host: CallHost, other: Callable[[Message, list[bytes]], bool], linger: float
    ) -> None:
        """`serve` where this thread alone reads the stream.

        FAST PATH (the agent's only one; `bench_local.py` rtt and broadcast): a small call's
        frame is read with two exact reads, run, and answered with one write, the packed format
        read and written in place with `frames`' structs, all in this loop (calling
        `frames.read_meta` and `frames.encode_result` here made the 8-node broadcast 1.76x its
        floor against 1.20x: docs/architecture.md, "Why the per-call path is written flat").
        Anything else takes the plain steps (`_rest_of_frame`, `_serve_frame`, `_answer`).
        """
        fd_in, fd_out, lock = self.fileno_in, self._out_fd, self._write_lock
        functions, reports = host.functions, host.reports
        while True:
            head = os.read(fd_in, ONE_SEGMENT.size)
            try:
                meta_len, count, first = ONE_SEGMENT.unpack(head)
            except struct.error:  # a header cut short, or the end: the plain path
                count = 0
            if count != 1 or meta_len != PACKED_CALL.size or first >= COALESCE_LIMIT:
                frame = self._rest_of_frame(head)
                if frame is None or not self._serve_frame(host, other, *frame):
                    return
            else:
                size = meta_len + first
                body = os.read(fd_in, size)
                if len(body) != size:  # a frame that arrives in pieces
                    body = self._read_exactly(size, body)
                marker, kind, call_id, fn_id = PACKED_CALL.unpack_from(body)
                if marker != PACKED or kind != CALL:  # pickled metadata of that very size
                    message = from_wire(read_meta(body, 0, meta_len))
                    if not self._serve_frame(host, other, message, [body[meta_len:]]):
                        return
                else:
                    try:
                        try:
                            fn = functions[fn_id]
                        except KeyError:
                            fn = host.load_function(fn_id, None)
                        args, kwargs = pickle.loads(body[meta_len:])
                        value = fn(*args, **kwargs)
                        del args, kwargs
                    except BaseException as exc:  # (sys.exit() in the user's code fails the
                        host.fail_call(call_id, exc)  # call only: the agent keeps serving)
                        continue
                    # `_answer`, written out for its common case: a small scalar, no reports
                    blob = None
                    if type(value) in SCALARS and not (reports.queue or reports.sending.locked()):
                        blob = pickle.dumps(value, PROTOCOL)
                    if blob is None or len(blob) >= COALESCE_LIMIT:
                        self._answer(host, call_id, value)
                    else:  # `encode_result(call_id, [blob])`, in place
                        meta = (PACKED_RESULT.size, 1, len(blob), PACKED, RESULT, call_id)
                        with lock:
                            write_all(fd_out, RESULT_FRAME.pack(*meta) + blob)
                    del value
            if linger:
                self.linger(linger)

    def _serve_frame(
        self,
        host: CallHost,
        other: Callable[[Message, list[bytes]], bool],
        message: Message,
        segments: list[bytes],
    ) -> bool:
        """Run one frame's call, or hand its message to `other`; False to stop serving."""
        if type(message) is not Call:
            return other(message, segments)
        try:
            fn = host.functions.get(message.fn_id) or host.load_function(
                message.fn_id, message.fn_bytes
            )
            args, kwargs = pickle.loads(segments[0], buffers=segments[1:])
            segments.clear()  # a large argument is freed once the function lets go
            value = fn(*args, **kwargs)
            del args, kwargs
        except BaseException as exc:
            host.fail_call(message.call_id, exc)
            return True
        self._answer(host, message.call_id, value)
        return True

    def _answer(self, host: CallHost, call_id: int, value: Any) -> None:
        """Send call `call_id`'s `Result`, after the reports queued before it."""
        result = host.dump_result(call_id, value)
        if result is None:  # answered already, with why it cannot travel
            return
        del value
        reports = host.reports
        if reports.queue or reports.sending.locked():
            reports.flush()  # the client sees a call's reports before its result
        self._write(encode_result(call_id, result))

    def read(self) -> tuple[Message, list[bytes]] | None:
        """Read one frame; None when the stream has closed between frames."""
        with self._lock:
            if self._early:
                return self._early.popleft()
            if self._ended:
                return None
            return self._rest_of_frame(os.read(self.fileno_in, ONE_SEGMENT.size))

    def _read_exactly(self, n: int, have: bytes = b"") -> bytes:
        """`n` bytes of input (after `have`, the part already read)."""
        if n >= COALESCE_LIMIT and not have:
            data = self._whole.read(n)
        else:
            data = have
            while len(data) < n:  # a frame may arrive in pieces
                more = os.read(self.fileno_in, n - len(data))
                if not more:
                    break
                data += more
                self.heard()
        if len(data) < n:
            raise FrameError("stream closed in the middle of a frame")
        return data

    def _rest_of_frame(self, head: bytes) -> tuple[Message, list[bytes]] | None:
        """The frame whose first bytes, up to 16 (every frame is longer: a header and a pickle
        of at least 12 bytes), are `head`; None if the stream ended before it."""
        if not head:
            self._ended = True
            return None
        if len(head) < ONE_SEGMENT.size:
            head = self._read_exactly(ONE_SEGMENT.size, head)
        meta_len, count, first = ONE_SEGMENT.unpack(head)
        self.heard()
        if count == 1:  # `first` is the one segment's length
            meta = self._read_exactly(meta_len)
            # a large segment is its own bytes object: an out-of-band ``bytes`` argument is then
            # rebuilt as that very object, with no copy
            return from_wire(read_meta(meta, 0, meta_len)), [self._read_exactly(first)]
        if count == 0:  # `first` is the metadata's first 8 bytes
            if meta_len < LENGTH.size:
                raise FrameError(f"a frame's metadata cannot be {meta_len} bytes long")
            meta = self._read_exactly(meta_len, head[HEADER.size :])
            return from_wire(read_meta(meta, 0, meta_len)), []
        rest = self._read_exactly(LENGTH.size * (count - 1) + meta_len)
        lengths = (first, *lengths_of(count - 1).unpack_from(rest))
        message = from_wire(read_meta(rest, LENGTH.size * (count - 1), meta_len))
        return message, [self._read_exactly(n) for n in lengths]

    def read_ahead(self, keep: Callable[[Message], bool], beat_every: float = 0.0) -> None:
        """From another thread: take the frames that have arrived while the reader is busy
        (a frame that has begun to arrive is read whole), keeping those `keep` accepts for
        `read`. Does nothing while the reader is reading.

        A frame that is slow to come (the next call's large argument over a slow link) keeps
        this thread here for as long as it takes: it sends a heartbeat every `beat_every`
        seconds meanwhile (0: none), or the client, which hears nothing else from a node
        running a call, would take the node for dead."""
        if not self._lock.acquire(blocking=False):
            return
        self._beat_every = beat_every
        try:
            while not self._ended and self._input_ahead.poll(0):
                frame = self._rest_of_frame(os.read(self.fileno_in, ONE_SEGMENT.size))
                if frame is not None and keep(frame[0]):
                    self._early.append(frame)
        finally:
            self._beat_every = 0.0
            self._lock.release()

    def linger(self, seconds: float) -> None:
        """Poll for up to `seconds` for the next frame instead of letting the next read sleep.

        A process asleep in read() costs a wake-up when data arrives, and on a virtual machine
        that is often the largest part of a small call's round trip. Polling briefly after a
        reply catches back-to-back calls awake, at the price of `seconds` of CPU when none come;
        it polls only while that pays (`Patience`: a core free, calls coming within the window).
        """
        if seconds <= 0 or self._early:
            return
        poll = self._input.poll
        self._patience.window = seconds
        self._patience.wait(lambda: bool(poll(0)))


class _Chunks(io.RawIOBase):
    """The control input as `AgentWire` reads a large segment from it: each chunk read tells
    the wire (`AgentWire.heard`). A segment of 2 GiB takes minutes over a slow link; read in
    one call, it was silence from the client all that time, and the agent stopped itself
    after `heartbeat_timeout` while the client was still sending it. One clock read per chunk
    (a pipe's or a socket's worth, 64 KiB and up), not per byte."""

    def __init__(self, wire: AgentWire, fd: int) -> None:
        super().__init__()
        self._wire = wire
        self._fd = fd

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        n = os.readv(self._fd, [buffer])
        self._wire.heard()
        return n
