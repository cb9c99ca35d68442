"""The frame codec of the client <-> agent wire.

A frame is an 8-byte header (``!II``: metadata length, segment count), one ``!Q`` length per
segment, a small pickled metadata tuple (a message of `messages`, as ``(kind, *fields)``), then
the segments as raw bytes. Large objects travel in segments, written and read as they are: call
arguments and results are pickled with protocol 5, their large buffers (numpy arrays, big
``bytes``) kept out of band as segments of their own, so a 100 MB argument is never copied into
a pickle stream, and a broadcast writes the same segment objects to every node.

Here too: the pickling of what travels (`cloud_dumps`, `fast_dumps`, `try_dumps`) and one
call's frames as the nodes get it (`CallFrames`, encoded once for every node).

This module is shared by the client and the worker agent, so it imports only the standard
library and cloudpickle.
"""

from __future__ import annotations

import functools
import os
import pickle
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import cloudpickle

from skyward.transport.messages import Call, Message, Result, from_wire, to_wire

HEADER = struct.Struct("!II")
LENGTH = struct.Struct("!Q")
# A header and the first segment length (or the metadata's first bytes when there is none).
ONE_SEGMENT = struct.Struct("!IIQ")
PROTOCOL = 5

# A frame's metadata is its message's wire tuple, pickled; except for the two messages every call
# sends, which are packed: a marker byte no pickle starts with (a pickle's first byte is its
# PROTO opcode, 0x80), the kind, then the fields as 64-bit integers. Unpacking a struct costs a
# fraction of unpickling, on every call's way out and back. This module is the format's one
# definition, on both sides: its structs, its writers `encode_call` and `encode_result` (which
# `encode` uses for those two messages) and its reader `read_meta`. The two fast paths read a
# small call's and a small result's in place, with these very structs (`RESULT_FRAME`).
PACKED = 0x01
PACKED_CALL = struct.Struct("!BBQQ")  # a Call without the function's bytes: call_id, fn_id
PACKED_RESULT = struct.Struct("!BBQ")  # a Result: call_id
CALL, RESULT = Call.KIND, Result.KIND
# A small Result's frame up to its one segment: the header, the segment's length, the packed
# metadata, as `encode_result` writes them. The agent's fast path packs it, the client's reads
# it (tests/test_frames.py and tests/test_fastpath.py check both against the plain path).
RESULT_FRAME = struct.Struct(ONE_SEGMENT.format + PACKED_RESULT.format.removeprefix("!"))

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


def encode(message: Message, segments: Segments = ()) -> list[Buffer]:
    """The byte strings to write, in order, for one frame (small segments coalesced)."""
    if type(message) is Result:
        return encode_result(message.call_id, segments)
    if type(message) is Call and message.fn_bytes is None:
        return encode_call(message.call_id, message.fn_id, segments)
    return _frame(pickle.dumps(to_wire(message), PROTOCOL), segments)


def encode_call(call_id: int, fn_id: int, segments: Segments) -> list[Buffer]:
    """`encode(Call(call_id, fn_id, None), segments)`: the one writer of a packed `Call` (every
    call's frame to a node that has its function; its message is never built)."""
    return _frame(PACKED_CALL.pack(PACKED, CALL, call_id, fn_id), segments)


def encode_result(call_id: int, segments: Segments) -> list[Buffer]:
    """`encode(Result(call_id), segments)`: the one writer of a packed `Result`."""
    return _frame(PACKED_RESULT.pack(PACKED, RESULT, call_id), segments)


def read_meta(data: Buffer, start: int, size: int) -> tuple[Any, ...]:
    """The wire tuple ``(kind, *fields)`` that the metadata at ``data[start:start + size]``
    holds (`messages.from_wire` checks its fields): the one reader of the packed format, and
    of pickled metadata."""
    if data[start] != PACKED:
        meta = pickle.loads(data[start : start + size])
        if type(meta) is not tuple or not meta:
            raise FrameError(f"a frame's metadata is {type(meta).__name__}, not a message")
        return meta
    if size == PACKED_RESULT.size:
        return PACKED_RESULT.unpack_from(data, start)[1:]
    if size == PACKED_CALL.size:
        return (*PACKED_CALL.unpack_from(data, start)[1:], None)
    raise FrameError(f"packed metadata of {size} bytes is no message")


def nbytes(data: Buffer) -> int:
    """`data`'s size in bytes (a memoryview's ``len`` counts its items, which may be wider)."""
    return data.nbytes if type(data) is memoryview else len(data)


def _frame(blob: bytes, segments: Segments) -> list[Buffer]:
    """The byte strings of a frame with metadata `blob`: its header, lengths and metadata, with
    each small segment after them copied into one first write, and each large one on its own."""
    head = bytearray(HEADER.pack(len(blob), len(segments)))
    for segment in segments:
        head += LENGTH.pack(nbytes(segment))
    head += blob
    chunks: list[Buffer] = [head]
    for segment in segments:
        if chunks[-1] is head and nbytes(segment) < COALESCE_LIMIT:
            head += segment
        else:
            chunks.append(segment)
    return chunks


def coalesce(chunks: list[Buffer]) -> list[Buffer]:
    """Join runs of small chunks (several frames to one node), so they cost one write."""
    out: list[Buffer] = []
    small = bytearray()
    for chunk in chunks:
        if nbytes(chunk) < COALESCE_LIMIT:
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


def cloud_dumps(value: Any) -> list[Buffer]:
    """Segments for `value` with cloudpickle (functions, lambdas, classes of ``__main__``)."""
    return dumps(value, cloudpickle.dumps)


def fast_dumps(value: Any) -> list[Buffer]:
    """Segments for `value`: the standard pickler first (several times faster on plain data),
    cloudpickle for what only it can carry (lambdas, classes defined inside a function)."""
    try:
        return dumps(value)
    except Exception:
        return cloud_dumps(value)


def try_dumps(value: Any) -> list[Buffer]:
    """Segments for `value`, or none when it cannot be pickled (an exception to describe)."""
    try:
        return cloud_dumps(value)
    except Exception:
        return []


@functools.cache
def lengths_of(count: int) -> struct.Struct:
    """The struct of `count` segment lengths."""
    return struct.Struct(f"!{count}Q")


def loads(segments: Sequence[Buffer]) -> Any:
    """Inverse of `dumps`."""
    return pickle.loads(segments[0], buffers=segments[1:])


class Outcome(Protocol):
    """Where a call's result or exception goes: a `concurrent.futures.Future`, or the lighter
    `client.dispatch.Reply`. The session sets each outcome it holds exactly once."""

    def set_running_or_notify_cancel(self) -> bool: ...
    def set_result(self, result: Any) -> None: ...
    def set_exception(self, exception: BaseException | None) -> None: ...
    def done(self) -> bool: ...


class CallFrames:
    """One call's frame, encoded once however many nodes it goes to (a broadcast writes the same
    bytes to every node), and once more with the function's bytes when some node lacks them:
    both are made here, by whoever makes the call, so no node's writer comes back to encode."""

    __slots__ = ("call_id", "fn_id", "with_fn", "without_fn")

    def __init__(
        self,
        call_id: int,
        fn_id: int,
        segments: list[Buffer],
        fn_bytes: bytes | None = None,
    ) -> None:
        """`fn_bytes`: the function's, when some node the call goes to may lack it."""
        self.call_id = call_id
        self.fn_id = fn_id
        self.without_fn = encode_call(call_id, fn_id, segments)
        self.with_fn: list[Buffer] | None = None
        if fn_bytes is not None:
            self.with_fn = encode(Call(call_id, fn_id, fn_bytes), segments)

    def chunks(self, node_has_function: bool) -> list[Buffer]:
        """The bytes for a node that has the function (or not)."""
        if node_has_function:
            return self.without_fn
        if self.with_fn is None:
            raise ValueError(f"call {self.call_id} was made without its function's bytes")
        return self.with_fn


# Calls bound for one node, each with where its outcome goes.
Calls = list[tuple[CallFrames, Outcome]]


class Patience:
    """How a side waits for its next frame: poll for up to `window` seconds before it sleeps in
    read(), but only while polling pays.

    A process that polls sees data as it arrives; one asleep in read() has to be woken, and on
    a virtual machine the wake-up is often most of a small call's round trip. But a poll takes
    a core: on a busy machine (data-loader workers, XLA's threads, a notebook beside the pool)
    it is the very core the other side needs to answer, and each wait costs a scheduler's slice
    instead of a wake-up. So it polls only when both hold:

    - a core is free now (`core_free`: fewer runnable tasks than this process's cores, not
      counting itself; looked at every `SAMPLE` seconds, not at every wait);
    - polling paid lately: after `MISSES` waits in a row that the window did not cover (the
      reply or the next call came later, or never), it sleeps at once for the next `REST`
      waits, then tries again.

    Otherwise it returns at once and the caller blocks: a loaded machine pays a plain pipe's
    wake-up and no more."""

    SAMPLE = 0.05
    MISSES = 4
    REST = 64

    def __init__(self, window: float) -> None:
        self.window = window
        self._misses = 0
        self._resting = 0
        self._sampled = -1.0
        self._free = True

    def wait(self, ready: Callable[[], bool]) -> None:
        """Poll `ready()` for up to the window when that pays; return when it is ready, the
        window is over, or polling does not pay (the caller then blocks in its read)."""
        if self.window <= 0:
            return
        if self._resting:
            self._resting -= 1
            return
        now = time.perf_counter()
        if now - self._sampled >= self.SAMPLE:
            self._sampled = now
            self._free = core_free()
        if not self._free:
            return
        deadline = now + self.window
        while not ready():
            if time.perf_counter() >= deadline:
                self._misses += 1
                if self._misses >= self.MISSES:
                    self._misses, self._resting = 0, self.REST
                return
        self._misses = 0


def core_free() -> bool:
    """Whether a core of this process's would be idle while it polls: fewer runnable tasks on
    the machine, this one left out, than cores it may run on (``/proc/loadavg``'s running
    count; True where there is none to read)."""
    try:
        with open("/proc/loadavg", "rb") as handle:
            running = int(handle.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return True
    return running - 1 < _cores()


@functools.cache
def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def write_all(fd: int, data: Buffer) -> None:
    """Write all of `data` to a blocking file descriptor."""
    # One write is the common case (a small frame); a signal or a large frame cuts it short.
    # `nbytes(data)` written out: the agent's FAST PATH (`AgentWire._serve_flat`) writes every small
    # call's answer through here, and one Python call less per call on a node made the 8-node
    # broadcast of bench_local.py about 20% faster.
    written = os.write(fd, data)
    if written == (data.nbytes if type(data) is memoryview else len(data)):
        return
    view = memoryview(data).cast("B")[written:]
    while view:
        view = view[os.write(fd, view) :]


class FrameDecoder:
    """Turns a byte stream, fed in chunks of any size, into frames (the client's side).

    A large segment is gathered into a buffer of its final size as its bytes arrive, so it is
    copied once, whatever the chunking. (A session's decoder, `fastpath.ReplyDecoder`, first
    takes the whole frames of a chunk itself: `fastpath.settle_frames`.)
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

    def bytes_wanted(self) -> int:
        """How many bytes the frame held back (begun, not whole) wants before more of it is
        known: up to the end of its header, then of its segment lengths, then of the frame.
        0 between frames."""
        buf = self._buf
        if self._meta is not None:  # its segments are coming
            left: int = sum(self._lengths[len(self._segments) :]) - len(buf)
            return left if self._partial is None else left - self._filled
        if not buf:
            return 0
        if len(buf) < HEADER.size:
            return HEADER.size - len(buf)
        meta_len: int
        count: int
        meta_len, count = HEADER.unpack_from(buf)
        lengths_end = HEADER.size + LENGTH.size * count
        if len(buf) < lengths_end:
            return lengths_end - len(buf)
        size: int = lengths_end + meta_len + sum(lengths_of(count).unpack_from(buf, HEADER.size))
        return size - len(buf)

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
                need = HEADER.size + LENGTH.size * count + meta_len
                if len(self._buf) < need:
                    return
                self._lengths = list(lengths_of(count).unpack_from(self._buf, HEADER.size))
                start = HEADER.size + LENGTH.size * count
                self._meta = from_wire(read_meta(self._buf, start, meta_len))
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
