"""The frame codec: any chunking of the byte stream decodes to the same frames."""

from __future__ import annotations

import random

import numpy as np
import pytest

from skyward.transport import frames, messages, pickling
from skyward.transport.agentchannel import AgentChannel


def _stream(count: int, rng: random.Random) -> tuple[bytes, list[dict[str, object]]]:
    values: list[dict[str, object]] = []
    blob = bytearray()
    for i in range(count):
        value = {
            "i": i,
            "bytes": bytes([i % 251]) * rng.choice([0, 10, 70_000, 200_000]),
            "array": np.arange(rng.choice([1, 100, 20_000])) * i,
        }
        for chunk in frames.encode(messages.Result(i), pickling.fast_dumps(value)):
            blob += chunk
        values.append(value)
    return bytes(blob), values


def test_any_chunking_decodes_the_same_frames() -> None:
    rng = random.Random(7)
    blob, values = _stream(120, rng)
    for _ in range(10):
        got: list[tuple[messages.Message, dict[str, object]]] = []

        def keep(meta: messages.Message, segs: list[frames.Buffer], got: list = got) -> None:  # type: ignore[type-arg]
            got.append((meta, frames.loads(segs)))

        decoder = frames.FrameDecoder(keep)
        position = 0
        while position < len(blob):
            size = rng.choice([1, 7, 100, 4096, 65_536, 1 << 20])
            decoder.feed(blob[position : position + size])
            position += size
        assert [meta for meta, _ in got] == [messages.Result(i) for i in range(len(values))]
        for (_, value), expected in zip(got, values, strict=True):
            assert value["bytes"] == expected["bytes"]
            assert np.array_equal(value["array"], expected["array"])  # type: ignore[arg-type]


def test_large_bytes_travel_out_of_band_and_come_back_as_the_same_object() -> None:
    big = b"z" * 1_000_000
    segments = pickling.cloud_dumps(((big,), {}))
    assert len(segments) == 2 and memoryview(segments[1]).nbytes == len(big)
    assert memoryview(segments[0]).nbytes < 200  # the pickle stream holds no copy of it
    received = bytes(segments[1])  # what the agent reads off the pipe
    (args, _) = frames.loads([bytes(segments[0]), received])
    assert args[0] is received  # rebuilt without a copy


def test_truncated_stream_is_a_frame_error() -> None:
    import os

    read_fd, write_fd = os.pipe()
    head, *_ = frames.encode(messages.Call(1, 2, None), [b"abc" * 10])
    os.write(write_fd, bytes(head)[:5])
    os.close(write_fd)
    channel = AgentChannel(read_fd, os.open(os.devnull, os.O_WRONLY))
    try:
        channel.read()
    except frames.FrameError as exc:
        assert "middle of a frame" in str(exc)
    else:
        raise AssertionError("a truncated frame was accepted")


def test_linger_keeps_frames_and_leaves_the_stream_blocking() -> None:
    import os
    import threading
    import time

    read_fd, write_fd = os.pipe()
    channel = AgentChannel(read_fd, os.open(os.devnull, os.O_WRONLY))
    # Two frames in one write: after reading the first, the second waits in the read buffer,
    # where polling the pipe alone would not see it.
    first = b"".join(bytes(c) for c in frames.encode(messages.Call(1, 2, None), [b"a"]))
    second = b"".join(bytes(c) for c in frames.encode(messages.Call(3, 2, None), [b"b"]))
    os.write(write_fd, first + second)
    assert channel.read() == (messages.Call(1, 2, None), [b"a"])
    channel.linger(60.0)  # returns at once: a frame is already buffered
    assert channel.read() == (messages.Call(3, 2, None), [b"b"])

    # Nothing arrives: the window runs out and the stream is blocking again for read().
    channel.linger(0.001)
    assert os.get_blocking(read_fd)

    # A frame arriving during the window ends it and is read whole.
    writer = threading.Timer(0.05, os.write, (write_fd, first))
    writer.start()
    started = time.monotonic()
    channel.linger(60.0)
    assert time.monotonic() - started < 30
    assert channel.read() == (messages.Call(1, 2, None), [b"a"])
    writer.join()

    os.close(write_fd)
    channel.linger(0.001)  # the end of the stream: the window runs out, read() sees the end
    assert channel.read() is None


def test_every_message_travels_as_itself() -> None:
    from skyward.info import InstanceInfo

    info = InstanceInfo(0, 1, "127.0.0.1", 5000, ("127.0.0.1",), "p-1", ports={"jax": 5001})
    sent = [
        messages.Open(("head", "jax")),
        messages.Hello(info),
        messages.Call(1, 2, b"fn"),
        messages.Shutdown(),
        messages.Started(10, "host", "3.11.7", "0.1.0", {"head": 5000}),
        messages.Progress("jax", "around_app"),
        messages.Ready(),
        messages.HookFailed("jax", "around_app", messages.ErrorReport("ValueError", "no", "Tb")),
        messages.Result(3),
        messages.Raised(4, messages.ErrorReport("KeyError", "'k'", "Traceback...")),
        messages.Heartbeat(),
        messages.Reported([(1.5, {"loss": 0.25, "tag": "a"}, None), (2.0, {}, "/ckpt/1")]),
    ]
    blob = b"".join(bytes(c) for m in sent for c in frames.encode(m, [b"x"]))
    got: list[messages.Message] = []
    frames.FrameDecoder(lambda m, segs: got.append(m)).feed(blob)
    assert got == sent
    assert len({type(m).KIND for m in sent}) == len(sent), "every message has its own kind"


def test_a_frame_that_is_no_message_is_refused() -> None:
    with pytest.raises(messages.MessageError, match="not a skyward message"):
        messages.from_wire((99, "what"))
    with pytest.raises(messages.MessageError):
        messages.from_wire((messages.Result.KIND,))  # a field missing
