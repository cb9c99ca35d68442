"""`AgentWire`: the agent's side of the client <-> agent stream, in blocking frame I/O.

The agent spends its life in `AgentWire.serve`. With many agents sharing cores (an 8-node
broadcast on a laptop), what a call costs on a node is mostly the memory its path touches,
fetched again each time the agent wakes with cold caches: each Python function call on the path
costs several microseconds there (measured: one more call per node made an 8-node broadcast
20% slower on 2 cores), so the common case, a small call that returns, is read, run and
answered within the one loop of `serve`, with the agent's functions (`CallHost`).

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
from typing import Any, Protocol

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
    FrameError,
    Segments,
    encode,
    lengths_of,
    meta_tuple,
    spin_until,
    write_all,
)
from skyward.transport.messages import Call, Message, Result, from_wire

# How long the agent polls for the next call after answering one (see AgentWire.linger). The
# provider sets it, and only where the agent has a core to itself: polling agents that share
# cores would slow each other down.
LINGER_ENV = "SKYWARD_AGENT_LINGER_US"


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


_monotonic = time.monotonic


class AgentWire:
    """Blocking frame I/O over two file descriptors.

    One thread reads (`read`, `serve`); while it is busy elsewhere (running a call), another
    may take the frames that have arrived meanwhile (`read_ahead`) and keep them for it, so that
    the client's pings are seen and its input never piles up. `last_input` is when a frame last
    arrived, by either way. Writes (`send`) are safe from any thread: each writes whole frames
    in its turn (`_take_turn`).
    """

    def __init__(self, fd_in: int, fd_out: int) -> None:
        self.fileno_in = fd_in
        # Reads take exactly what they ask for, so nothing is ever buffered here: small parts
        # with os.read (a BufferedReader's own refill costs several microseconds a call), a
        # large segment with an unbuffered reader, which fills one bytes object of the
        # segment's size in place.
        self._whole = io.BufferedReader(io.FileIO(fd_in, "rb"), buffer_size=1)
        # One poll object per thread that polls (a poll object refuses concurrent use): the
        # reader's `linger` and the other thread's `read_ahead`.
        self._input, self._input_ahead = select.poll(), select.poll()
        self._input.register(fd_in, select.POLLIN)
        self._input_ahead.register(fd_in, select.POLLIN)
        self._out_fd = fd_out
        self._lock = threading.Lock()  # held by whoever reads the input
        # Whose turn it is to write: the writing thread's ident under key 0, none between
        # writes. Taken with one dict.setdefault, given back with one pop: an 8-node broadcast
        # on 2 cores measured 2-3 us of CPU per call less than with a lock's acquire and
        # release. A thread that finds its own ident there may go on (it was interrupted
        # between taking its turn and giving it back), so no turn is ever lost for good.
        self._writer: dict[int, int] = {}
        self._early: collections.deque[tuple[Message, list[bytes]]] = collections.deque()
        self._ended = False
        self.last_input = time.monotonic()

    def send(self, message: Message, segments: Segments = ()) -> None:
        """Write one frame."""
        chunks = encode(message, segments)
        self._take_turn(threading.get_ident())
        try:
            for chunk in chunks:
                write_all(self._out_fd, chunk)
        finally:
            self._writer.pop(0, None)

    def _take_turn(self, me: int) -> None:
        """Wait until thread `me` may write (another thread is writing a frame: rare, and
        as short as a write, unless the client stops reading)."""
        pause = 0.0
        while self._writer.setdefault(0, me) != me:
            time.sleep(pause)
            pause = min(max(pause * 2, 1e-5), 1e-3)

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
        seconds. `shared`: another thread may take frames meanwhile (`read_ahead`), so reads
        take the lock and mark `last_input`; without it, a call's path touches neither.
        """
        fd_in, fd_out, lock = self.fileno_in, self._out_fd, self._lock
        me, take_turn, give_turn = threading.get_ident(), self._writer.setdefault, self._writer.pop
        loads, dumps, read, write = pickle.loads, pickle.dumps, os.read, os.write
        head_size, unpack_head = ONE_SEGMENT.size, ONE_SEGMENT.unpack
        call_size, unpack_call = PACKED_CALL.size, PACKED_CALL.unpack_from
        pack_reply, reply_meta = RESULT_FRAME.pack, PACKED_RESULT.size
        functions, reports = host.functions, host.reports
        unsent, sending = reports.queue, reports.sending.locked
        while True:
            frame: tuple[Message, list[bytes]] | None = None
            if shared:
                lock.acquire()
                if self._early or self._ended:
                    lock.release()
                    frame = self.read()
                    if frame is None:
                        return
            if frame is None:
                # The common frame, a small call, is read and decoded here: its first 16 bytes
                # (header and segment length), then the metadata and the pickled arguments.
                try:
                    head = read(fd_in, head_size)
                    try:
                        meta_len, count, first = unpack_head(head)
                    except struct.error:  # a header cut short, or the end: the slow path
                        count = 0
                    if count == 1 and meta_len == call_size and first < COALESCE_LIMIT:
                        size = call_size + first
                        body = read(fd_in, size)
                        if len(body) != size:
                            body = self._read_exactly(size, body)
                    else:
                        frame = self._rest_of_frame(head)
                        if frame is None:
                            return
                    if shared:
                        self.last_input = _monotonic()
                finally:
                    if shared:
                        lock.release()
            segments: list[bytes] | None = None  # the call's, when it came by the slow path
            if frame is None:
                marker, kind, call_id, fn_id = unpack_call(body)
                fn_bytes = None
                if marker != PACKED or kind != CALL:  # pickled metadata of that very size
                    frame = from_wire(meta_tuple(body[:call_size])), [body[call_size:]]
            if frame is not None:
                message, segments = frame
                if type(message) is not Call:
                    if not other(message, segments):
                        return
                    continue
                call_id, fn_id, fn_bytes = message.call_id, message.fn_id, message.fn_bytes
            try:
                try:
                    fn = functions[fn_id]
                except KeyError:
                    fn = host.load_function(fn_id, fn_bytes)
                if segments is None:
                    args, kwargs = loads(body[call_size:])
                elif len(segments) == 1:
                    args, kwargs = loads(segments.pop())
                else:
                    args, kwargs = loads(segments[0], buffers=segments[1:])
                    segments.clear()  # a large argument is freed once the function lets go
                value = fn(*args, **kwargs)
                del args, kwargs
            except BaseException as exc:
                # sys.exit() or KeyboardInterrupt in the user's code fails that call only; the
                # agent keeps serving.
                host.fail_call(call_id, exc)
                continue
            reply: bytes | None = None  # the whole frame, when the result is a small scalar
            if type(value) in SCALARS:
                blob = dumps(value, PROTOCOL)
                if len(blob) < COALESCE_LIMIT:
                    reply = pack_reply(reply_meta, 1, len(blob), PACKED, RESULT, call_id) + blob
                else:
                    result: Segments = [blob]
            else:
                dumped = host.dump_result(call_id, value)
                if dumped is None:
                    continue
                result = dumped
            del value
            if unsent or sending():
                reports.flush()  # the client sees a call's reports before its result
            if reply is not None:
                if take_turn(0, me) != me:  # `send`, written out
                    self._take_turn(me)
                try:
                    written = write(fd_out, reply)
                    if written != len(reply):  # a signal or a full pipe cut it short
                        write_all(fd_out, memoryview(reply)[written:])
                finally:
                    give_turn(0, None)
            else:
                self.send(Result(call_id), result)
            if linger:
                self.linger(linger)

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
        self.last_input = _monotonic()
        if count == 1:  # `first` is the one segment's length
            meta = self._read_exactly(meta_len)
            # a large segment is its own bytes object: an out-of-band ``bytes`` argument is then
            # rebuilt as that very object, with no copy
            return from_wire(meta_tuple(meta)), [self._read_exactly(first)]
        if count == 0:  # `first` is the metadata's first 8 bytes
            if meta_len < LENGTH.size:
                raise FrameError(f"a frame's metadata cannot be {meta_len} bytes long")
            meta = self._read_exactly(meta_len, head[HEADER.size :])
            return from_wire(meta_tuple(meta)), []
        rest = self._read_exactly(LENGTH.size * (count - 1) + meta_len)
        lengths = (first, *lengths_of(count - 1).unpack_from(rest))
        message = from_wire(meta_tuple(memoryview(rest)[LENGTH.size * (count - 1) :]))
        return message, [self._read_exactly(n) for n in lengths]

    def read_ahead(self, keep: Callable[[Message], bool]) -> None:
        """From another thread: take the frames that have arrived while the reader is busy
        (a frame that has begun to arrive is read whole), keeping those `keep` accepts for
        `read`. Does nothing while the reader is reading."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            while not self._ended and self._input_ahead.poll(0):
                frame = self._rest_of_frame(os.read(self.fileno_in, ONE_SEGMENT.size))
                if frame is not None and keep(frame[0]):
                    self._early.append(frame)
        finally:
            self._lock.release()

    def linger(self, seconds: float) -> None:
        """Poll for up to `seconds` for the next frame instead of letting the next read sleep.

        A process asleep in read() costs a wake-up when data arrives, and on a virtual machine
        that is often the largest part of a small call's round trip. Polling briefly after a
        reply catches back-to-back calls awake, at the price of `seconds` of CPU when none come.
        """
        if seconds <= 0 or self._early:
            return
        poll = self._input.poll
        spin_until(lambda: bool(poll(0)), seconds)
