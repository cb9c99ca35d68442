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

import functools
import os
import pickle
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from skyward.transport.messages import Call, Message, Result, from_wire, to_wire

HEADER = struct.Struct("!II")
LENGTH = struct.Struct("!Q")
# A header and the first segment length (or the metadata's first bytes when there is none).
ONE_SEGMENT = struct.Struct("!IIQ")
PROTOCOL = 5

# A frame's metadata is its message's wire tuple, pickled; except for the two messages every call
# sends, which are packed: a marker byte no pickle starts with (a pickle's first byte is its
# PROTO opcode, 0x80), the kind, then the fields as 64-bit integers. Unpacking a struct costs a
# fraction of unpickling, on every call's way out and back.
PACKED = 0x01
PACKED_CALL = struct.Struct("!BBQQ")  # a Call without the function's bytes: call_id, fn_id
PACKED_RESULT = struct.Struct("!BBQ")  # a Result: call_id
CALL, RESULT = Call.KIND, Result.KIND
# A one-segment frame's header and packed Result metadata, written at once (a small reply).
RESULT_FRAME = struct.Struct("!IIQBBQ")

Buffer = bytes | bytearray | memoryview
Segments = Sequence[Buffer]

# Below this size a segment is copied into the frame's first write: a syscall costs more.
COALESCE_LIMIT = 1 << 16
# Objects this large travel out of band (their own segment) instead of inside the pickle.
OUT_OF_BAND_MIN = 1 << 16


# Types the standard pickler always takes, in band (a large str too: only bytes are lifted).
SCALARS = frozenset({type(None), bool, int, float, complex, str})


class FrameError(Exception):
    """The byte stream does not hold a valid frame (truncated, or not a skyward agent)."""


def meta_bytes(message: Message) -> bytes:
    """A frame's metadata for `message`: packed for a result and a call without its function's
    bytes, else its wire tuple pickled."""
    if isinstance(message, Result):
        return PACKED_RESULT.pack(PACKED, RESULT, message.call_id)
    if isinstance(message, Call) and message.fn_bytes is None:
        return PACKED_CALL.pack(PACKED, CALL, message.call_id, message.fn_id)
    return pickle.dumps(to_wire(message), PROTOCOL)


def meta_tuple(blob: Buffer) -> Any:
    """The wire tuple a frame's metadata holds (see `meta_bytes`)."""
    if blob[0] != PACKED:
        return pickle.loads(blob)
    size = memoryview(blob).nbytes
    if size == PACKED_RESULT.size:
        return PACKED_RESULT.unpack(blob)[1:]
    if size == PACKED_CALL.size:
        return (*PACKED_CALL.unpack(blob)[1:], None)
    raise FrameError(f"packed metadata of {size} bytes is no message")


def encode_call(call_id: int, fn_id: int, segments: Segments) -> list[Buffer]:
    """`encode(Call(call_id, fn_id, None), segments)` without building the message (every
    call's frame to a node that has its function)."""
    return _frame(PACKED_CALL.pack(PACKED, CALL, call_id, fn_id), segments)


def encode(message: Message, segments: Segments = ()) -> list[Buffer]:
    """The byte strings to write, in order, for one frame (small segments coalesced)."""
    return _frame(meta_bytes(message), segments)


def _frame(blob: bytes, segments: Segments) -> list[Buffer]:
    """The byte strings of a frame with metadata `blob`."""
    if len(segments) == 1 and type(segments[0]) is bytes and len(segments[0]) < COALESCE_LIMIT:
        # a small result or call: one struct and one bytes object (each small call's path)
        only = segments[0]
        return [ONE_SEGMENT.pack(len(blob), 1, len(only)) + blob + only]
    head = bytearray(HEADER.pack(len(blob), len(segments)))
    for segment in segments:
        head += LENGTH.pack(memoryview(segment).nbytes)
    head += blob
    chunks: list[Buffer] = [head]
    for segment in segments:
        if memoryview(segment).nbytes < COALESCE_LIMIT and isinstance(chunks[-1], bytearray):
            chunks[-1] += segment
        else:
            chunks.append(segment)
    return chunks


def coalesce(chunks: list[Buffer]) -> list[Buffer]:
    """Join runs of small chunks (several frames to one node), so they cost one write."""
    out: list[Buffer] = []
    small = bytearray()
    for chunk in chunks:
        if memoryview(chunk).nbytes < COALESCE_LIMIT:
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
    if type(value) in SCALARS:  # most small results: nothing to lift or keep out of band
        return [pickle.dumps(value, PROTOCOL)]
    buffers: list[pickle.PickleBuffer] = []
    stream = dump(lift(value), PROTOCOL, buffer_callback=buffers.append)
    if not buffers:
        return [stream]
    return [stream, *(b.raw() for b in buffers)]


@functools.cache
def lengths_of(count: int) -> struct.Struct:
    """The struct of `count` segment lengths."""
    return struct.Struct(f"!{count}Q")


def loads(segments: Sequence[Buffer]) -> Any:
    """Inverse of `dumps`."""
    return pickle.loads(segments[0], buffers=segments[1:])


def spin_until(ready: Callable[[], bool], seconds: float) -> None:
    """Busy-wait until `ready()` or for `seconds`, whichever comes first: a process that polls
    sees data as it arrives, one asleep in read() has to be woken (see `AgentWire.linger`)."""
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
    copied once, whatever the chunking. (A session's decoder, `reply_decoder.ReplyDecoder`,
    first takes the whole frames of a chunk itself: `fastpath.settle_frames`.)
    """

    def __init__(
        self,
        on_frame: Callable[[Message, list[Buffer]], None],
        on_end: Callable[[], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        """`on_frame` gets each message and its segments; `on_end` is called when the stream
        ends (an empty chunk); `on_error`, if given, gets what a broken stream raised."""
        self._on_frame = on_frame
        self._on_end = on_end
        self._on_error = on_error
        self.last_fed = time.monotonic()  # when bytes last came
        self._buf = bytearray()
        self._meta: Message | None = None
        self._lengths: list[int] = []
        self._segments: list[Buffer] = []
        self._partial: bytearray | None = None  # the segment being filled
        self._filled = 0

    @property
    def between_frames(self) -> bool:
        """Whether the next byte fed starts a frame (nothing is held back)."""
        return self._meta is None and not self._buf

    def feed(self, data: Buffer) -> None:
        """Decode a chunk of the stream (an empty one: the stream has ended)."""
        if not data:
            if self._on_end is not None:
                self._on_end()
            return
        self.last_fed = time.monotonic()
        try:
            self._buffer(data)
        except Exception as exc:
            if self._on_error is None:
                raise
            self._on_error(exc)

    def _buffer(self, data: Buffer) -> None:
        """Take `data` through the buffer: frames split across chunks, large segments."""
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
                self._lengths = list(lengths_of(count).unpack_from(self._buf, HEADER.size))
                self._meta = from_wire(meta_tuple(self._buf[HEADER.size + 8 * count : need]))
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
