"""The frame codec of the client <-> agent wire.

A frame is an 8-byte header (``!II``: metadata length, segment count), one ``!Q`` length per
segment, a small pickled metadata tuple (a message of `messages`, as ``(kind, *fields)``), then
the segments as raw bytes. Large objects travel in segments, written and read as they are: call
arguments and results are pickled with protocol 5, their large buffers (numpy arrays, big
``bytes``) kept out of band as segments of their own, so a 100 MB argument is never copied into
a pickle stream, and a broadcast writes the same segment objects to every node.

This module is shared by the client and the worker agent, so it imports only the standard library.
"""

from __future__ import annotations

import collections
import functools
import io
import os
import pickle
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from skyward.transport.messages import Message, from_wire, to_wire

HEADER = struct.Struct("!II")
LENGTH = struct.Struct("!Q")
# A header and the first segment length (or the metadata's first bytes when there is none).
_ONE_SEGMENT = struct.Struct("!IIQ")
PROTOCOL = 5

Buffer = bytes | bytearray | memoryview
Segments = Sequence[Buffer]

# Below this size a segment is copied into the frame's first write: a syscall costs more.
_COALESCE_LIMIT = 1 << 16
# Objects this large travel out of band (their own segment) instead of inside the pickle.
OUT_OF_BAND_MIN = 1 << 16


class FrameError(Exception):
    """The byte stream does not hold a valid frame (truncated, or not a skyward agent)."""


def encode(message: Message, segments: Segments = ()) -> list[Buffer]:
    """The byte strings to write, in order, for one frame (small segments coalesced)."""
    blob = pickle.dumps(to_wire(message), PROTOCOL)
    if len(segments) == 1 and type(segments[0]) is bytes and len(segments[0]) < _COALESCE_LIMIT:
        # a small result or call: one struct and one bytes object (each small call's path)
        only = segments[0]
        return [_ONE_SEGMENT.pack(len(blob), 1, len(only)) + blob + only]
    head = bytearray(HEADER.pack(len(blob), len(segments)))
    for segment in segments:
        head += LENGTH.pack(memoryview(segment).nbytes)
    head += blob
    chunks: list[Buffer] = [head]
    for segment in segments:
        if memoryview(segment).nbytes < _COALESCE_LIMIT and isinstance(chunks[-1], bytearray):
            chunks[-1] += segment
        else:
            chunks.append(segment)
    return chunks


def coalesce(chunks: list[Buffer]) -> list[Buffer]:
    """Join runs of small chunks (several frames to one node), so they cost one write."""
    out: list[Buffer] = []
    small = bytearray()
    for chunk in chunks:
        if memoryview(chunk).nbytes < _COALESCE_LIMIT:
            small += chunk
            continue
        if small:
            out.append(small)
            small = bytearray()
        out.append(chunk)
    if small:
        out.append(small)
    return out


class _Lifted:
    """A large ``bytes`` that pickles out of band and unpickles as plain ``bytes`` again.

    The pickler never consults hooks for built-in types, so such an object is wrapped before
    pickling (see `lift`) rather than recognised during it.
    """

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return bytes, (pickle.PickleBuffer(self.data),)


def lift(value: Any, depth: int = 2) -> Any:
    """`value` with large ``bytes`` near its top (arguments, a returned tuple or dict) wrapped
    to travel out of band; numpy arrays travel out of band by themselves, at any depth."""
    kind = type(value)
    if kind is bytes:
        return _Lifted(value) if len(value) >= OUT_OF_BAND_MIN else value
    if depth == 0:
        return value
    if kind is tuple or kind is list:
        return kind(lift(item, depth - 1) for item in value)
    if kind is dict:
        return {key: lift(item, depth - 1) for key, item in value.items()}
    return value


def dumps(value: Any, dump: Callable[..., bytes] = pickle.dumps) -> list[Buffer]:
    """Pickle `value` as segments: the pickle stream, then its out-of-band buffers.

    `dump` is ``pickle.dumps`` or ``cloudpickle.dumps`` (both take a buffer callback)."""
    buffers: list[pickle.PickleBuffer] = []
    stream = dump(lift(value), PROTOCOL, buffer_callback=buffers.append)
    if not buffers:
        return [stream]
    return [stream, *(b.raw() for b in buffers)]


@functools.cache
def _lengths(count: int) -> struct.Struct:
    return struct.Struct(f"!{count}Q")


def loads(segments: Sequence[Buffer]) -> Any:
    """Inverse of `dumps`."""
    return pickle.loads(segments[0], buffers=segments[1:])


class SyncChannel:
    """Blocking frame I/O over two file descriptors (the agent's side of the stream).

    One thread reads (`read`); while it is busy elsewhere (running a call), another may take
    the frames that have arrived meanwhile (`read_ahead`) and keep them for it, so that the
    client's pings are seen and its input never piles up. `last_input` is when a frame last
    arrived, by either way.
    """

    def __init__(self, fd_in: int, fd_out: int) -> None:
        self._in = io.BufferedReader(io.FileIO(fd_in, "rb"), buffer_size=1 << 16)
        self._out_fd = fd_out
        self.fileno_in = fd_in
        self._lock = threading.Lock()  # held by whoever reads the input
        self._early: collections.deque[tuple[Message, list[bytes]]] = collections.deque()
        self._ended = False
        self.last_input = time.monotonic()

    def _read_exactly(self, n: int) -> bytes:
        if not n:
            return b""
        data = self._in.read(n)
        if len(data) < n:
            raise FrameError("stream closed in the middle of a frame")
        return data

    def read(self) -> tuple[Message, list[bytes]] | None:
        """Read one frame; None when the stream has closed between frames."""
        with self._lock:
            if self._early:
                return self._early.popleft()
            if self._ended:
                return None
            return self._read_frame()

    def _read_frame(self) -> tuple[Message, list[bytes]] | None:
        # Written for speed: a node may run thousands of small calls a second, and each one's
        # frame is read here (the header, then the lengths and metadata together, then the
        # segments).
        read = self._in.read
        header = read(HEADER.size)
        if len(header) < HEADER.size:
            if header:
                raise FrameError("stream closed in the middle of a frame header")
            self._ended = True
            return None
        meta_len, count = HEADER.unpack(header)
        size = 8 * count + meta_len
        body = read(size)
        if len(body) < size:
            raise FrameError("stream closed in the middle of a frame")
        self.last_input = time.monotonic()
        if count == 1:  # a call: its pickled arguments
            (length,) = LENGTH.unpack_from(body)
            # each segment its own bytes object: an out-of-band ``bytes`` argument is then
            # rebuilt as that very object, with no copy
            return from_wire(pickle.loads(memoryview(body)[8:])), [self._read_exactly(length)]
        lengths = _lengths(count).unpack_from(body) if count else ()
        message = from_wire(pickle.loads(memoryview(body)[8 * count :]))
        return message, [self._read_exactly(n) for n in lengths]

    def read_ahead(self, keep: Callable[[Message], bool]) -> None:
        """From another thread: take the frames that have arrived while the reader is busy
        (a frame that has begun to arrive is read whole), keeping those `keep` accepts for
        `read`. Does nothing while the reader is reading."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            while not self._ended and self._has_input():
                frame = self._read_frame()
                if frame is not None and keep(frame[0]):
                    self._early.append(frame)
        finally:
            self._lock.release()

    def _has_input(self) -> bool:
        fd = self.fileno_in
        os.set_blocking(fd, False)  # so peek() reports an empty pipe instead of waiting on it
        try:
            return bool(self._in.peek(1))
        except BlockingIOError:
            return False
        finally:
            os.set_blocking(fd, True)

    def linger(self, seconds: float) -> None:
        """Poll for up to `seconds` for the next frame instead of letting the next `read` sleep.

        A process asleep in read() costs a wake-up when data arrives, and on a virtual machine
        that is often the largest part of a small call's round trip. Polling briefly after a
        reply catches back-to-back calls awake, at the price of `seconds` of CPU when none come.
        """
        if seconds <= 0:
            return
        with self._lock:
            if self._early:
                return
            fd = self.fileno_in
            os.set_blocking(fd, False)  # so peek() reports an empty pipe instead of waiting
            try:
                spin_until(lambda: bool(self._in.peek(1)), seconds)
            finally:
                os.set_blocking(fd, True)

    def write(self, message: Message, segments: Segments = ()) -> None:
        """Write one frame. Not thread-safe: callers serialize writes."""
        for chunk in encode(message, segments):
            write_all(self._out_fd, chunk)


def spin_until(ready: Callable[[], bool], seconds: float) -> None:
    """Busy-wait until `ready()` or for `seconds`, whichever comes first: a process that polls
    sees data as it arrives, one asleep in read() has to be woken (see `SyncChannel.linger`)."""
    deadline = time.perf_counter() + seconds
    while not ready() and time.perf_counter() < deadline:
        pass


def write_all(fd: int, data: Buffer) -> None:
    """Write all of `data` to a blocking file descriptor."""
    # One write is the common case (a small frame); a signal or a large frame cuts it short.
    written = os.write(fd, data)
    if written == (data.nbytes if type(data) is memoryview else len(data)):
        return
    view = memoryview(data).cast("B")[written:]
    while view:
        view = view[os.write(fd, view) :]


class FrameDecoder:
    """Turns a byte stream, fed in chunks of any size, into frames (the client's side).

    A large segment is gathered into a buffer of its final size as its bytes arrive, so it is
    copied once, whatever the chunking.
    """

    def __init__(self, on_frame: Callable[[Message, list[Buffer]], None]) -> None:
        self._on_frame = on_frame
        self._buf = bytearray()
        self._meta: Message | None = None
        self._lengths: list[int] = []
        self._segments: list[Buffer] = []
        self._partial: bytearray | None = None  # the segment being filled
        self._filled = 0

    def feed(self, data: Buffer) -> None:
        if type(data) is bytes and self._meta is None and not self._buf:
            data = self._whole_frames(data)
            if not data:
                return
        view = memoryview(data).cast("B")
        while view:
            if self._partial is not None:
                take = min(len(view), len(self._partial) - self._filled)
                self._partial[self._filled : self._filled + take] = view[:take]
                self._filled += take
                view = view[take:]
                if self._filled == len(self._partial):
                    self._segments.append(self._partial)
                    self._partial = None
                    self._advance()
                continue
            self._buf += view
            view = view[len(view) :]
            self._advance()

    def _whole_frames(self, data: bytes) -> bytes:
        """Deliver the complete frames at the start of `data` without copying it into the
        buffer (the common case: one small reply per read); return what is left."""
        offset, end = 0, len(data)
        on_frame, loads = self._on_frame, pickle.loads
        while end - offset >= _ONE_SEGMENT.size:
            meta_len, count, first = _ONE_SEGMENT.unpack_from(data, offset)
            start = offset + HEADER.size + 8 * count
            if count == 1:  # a result or an exception: one pickled segment
                stop = start + meta_len + first
                if stop > end:
                    break
                middle = start + meta_len
                on_frame(from_wire(loads(data[start:middle])), [data[middle:stop]])
                offset = stop
                continue
            if start > end:
                break
            lengths = _lengths(count).unpack_from(data, offset + HEADER.size)
            stop = start + meta_len + sum(lengths)
            if stop > end:
                break
            message = from_wire(loads(data[start : start + meta_len]))
            segments: list[Buffer] = []
            position = start + meta_len
            for size in lengths:
                segments.append(data[position : position + size])
                position += size
            offset = stop
            on_frame(message, segments)
        return data[offset:] if offset else data

    def _advance(self) -> None:
        """Consume what the buffer holds: a header, metadata, whole segments."""
        while True:
            if self._meta is None:
                if len(self._buf) < HEADER.size:
                    return
                meta_len, count = HEADER.unpack_from(self._buf)
                need = HEADER.size + 8 * count + meta_len
                if len(self._buf) < need:
                    return
                self._lengths = list(struct.unpack_from(f"!{count}Q", self._buf, HEADER.size))
                self._meta = from_wire(pickle.loads(self._buf[HEADER.size + 8 * count : need]))
                del self._buf[:need]
                self._segments = []
            if len(self._segments) < len(self._lengths):
                size = self._lengths[len(self._segments)]
                if len(self._buf) >= size:
                    self._segments.append(bytes(self._buf[:size]))
                    del self._buf[:size]
                    continue
                self._partial = bytearray(size)
                self._partial[: len(self._buf)] = self._buf
                self._filled = len(self._buf)
                self._buf.clear()
                return
            message, segments = self._meta, self._segments
            self._meta, self._segments, self._lengths = None, [], []
            self._on_frame(message, segments)
