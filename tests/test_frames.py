"""The frame codec: any chunking of the byte stream decodes to the same frames."""

from __future__ import annotations

import pickle
import random
import time

import numpy as np
import pytest

from skyward.transport import frames, messages
from skyward.transport.agentwire import AgentWire


def _stream(count: int, rng: random.Random) -> tuple[bytes, list[dict[str, object]]]:
    values: list[dict[str, object]] = []
    blob = bytearray()
    for i in range(count):
        value = {
            "i": i,
            "bytes": bytes([i % 251]) * rng.choice([0, 10, 70_000, 200_000]),
            "array": np.arange(rng.choice([1, 100, 20_000])) * i,
        }
        for chunk in frames.encode(messages.Result(i), frames.fast_dumps(value)):
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
    segments = frames.cloud_dumps(((big,), {}))
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
    wire = AgentWire(read_fd, os.open(os.devnull, os.O_WRONLY))
    try:
        wire.read()
    except frames.FrameError as exc:
        assert "middle of a frame" in str(exc)
    else:
        raise AssertionError("a truncated frame was accepted")


def test_linger_keeps_frames_and_leaves_the_stream_blocking() -> None:
    import os
    import threading
    import time

    read_fd, write_fd = os.pipe()
    wire = AgentWire(read_fd, os.open(os.devnull, os.O_WRONLY))
    # Two frames in one write: after reading the first, the second waits in the read buffer,
    # where polling the pipe alone would not see it.
    first = b"".join(bytes(c) for c in frames.encode(messages.Call(1, 2, None), [b"a"]))
    second = b"".join(bytes(c) for c in frames.encode(messages.Call(3, 2, None), [b"b"]))
    os.write(write_fd, first + second)
    assert wire.read() == (messages.Call(1, 2, None), [b"a"])
    wire.linger(60.0)  # returns at once: a frame is already buffered
    assert wire.read() == (messages.Call(3, 2, None), [b"b"])

    # Nothing arrives: the window runs out and the stream is blocking again for read().
    wire.linger(0.001)
    assert os.get_blocking(read_fd)

    # A frame arriving during the window ends it and is read whole.
    writer = threading.Timer(0.05, os.write, (write_fd, first))
    writer.start()
    started = time.monotonic()
    wire.linger(60.0)
    assert time.monotonic() - started < 30
    assert wire.read() == (messages.Call(1, 2, None), [b"a"])
    writer.join()

    os.close(write_fd)
    wire.linger(0.001)  # the end of the stream: the window runs out, read() sees the end
    assert wire.read() is None


def test_every_message_travels_as_itself() -> None:
    from skyward.info import InstanceInfo

    info = InstanceInfo(0, 1, "127.0.0.1", 5000, ("127.0.0.1",), "p-1", ports={"jax": 5001})
    sent = [
        messages.Open(("head", "jax")),
        messages.Hello(info),
        messages.Call(1, 2, b"fn"),
        messages.Call(5, 2, None),  # packed, as the next calls of a function are
        messages.Shutdown(),
        messages.Started(10, "host", "3.11.7", "0.1.0", {"head": 5000}),
        messages.HookStarted("jax", "around_app"),
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
    kinds = [type(m).KIND for m in sent]
    assert len(set(kinds)) == len(kinds) - 1, "every message has its own kind (Call is twice)"


def test_a_frame_that_is_no_message_is_refused() -> None:
    with pytest.raises(messages.MessageError, match="not a skyward message"):
        messages.from_wire((99, "what"))
    with pytest.raises(messages.MessageError):
        messages.from_wire((messages.Result.KIND,))  # a field missing


def test_the_reply_decoder_settles_every_result_and_hands_on_the_rest() -> None:
    """A session's decoder settles each Result's call, small or large, whatever the chunking;
    every other message still reaches `on_frame` as itself."""
    from skyward.transport.fastpath import ReplyDecoder

    rng = random.Random(11)
    blob, values = _stream(60, rng)
    other = b"".join(bytes(c) for c in frames.encode(messages.Heartbeat()))
    for chunk_size in (7, 33, 1000, 4096, len(blob) + len(other)):
        outcomes = {i: _Settled() for i in range(len(values))}
        calls = _Calls(dict(outcomes))
        by_frame: list[messages.Message] = []
        decoder = ReplyDecoder(calls, lambda m, segs, into=by_frame: into.append(m), _unexpected)
        data = blob + other
        for position in range(0, len(data), chunk_size):
            decoder.feed(bytes(data[position : position + chunk_size]))
        assert by_frame == [messages.Heartbeat()]
        assert not calls.pending
        for i, expected in enumerate(values):
            got = outcomes[i].value
            assert isinstance(got, dict) and got["bytes"] == expected["bytes"]


class _Calls:
    def __init__(self, pending: dict[int, object]) -> None:
        self.pending = pending


class _Settled:
    value: object = None

    def set_result(self, result: object) -> None:
        self.value = result


def _unexpected(outcome: object, exc: Exception) -> None:
    raise AssertionError(f"could not unpickle a result: {exc!r}")


class _Reports:
    """No reports: nothing queued, nothing being sent."""

    def __init__(self) -> None:
        import threading

        self.queue: list[object] = []
        self.sending = threading.Lock()

    def flush(self) -> None:
        raise AssertionError("nothing was reported, so nothing is flushed")


class _Host:
    """A `CallHost` for the `AgentWire` alone: one function, errors and values kept."""

    def __init__(self) -> None:
        self.functions: dict[int, object] = {}
        self.loaded: list[int] = []
        self.failed: list[tuple[int, str]] = []

        self.reports = _Reports()

    def load_function(self, fn_id: int, fn_bytes: bytes | None) -> object:
        if fn_bytes is None:
            raise RuntimeError(f"function {fn_id} was never sent")
        self.loaded.append(fn_id)
        fn = self.functions[fn_id] = pickle.loads(fn_bytes)
        return fn

    def fail_call(self, call_id: int, exc: BaseException, tb: str | None = None) -> None:
        self.failed.append((call_id, f"{type(exc).__name__}: {exc}"))

    def dump_result(self, call_id: int, value: object) -> list[frames.Buffer] | None:
        return frames.fast_dumps(value)


def _halve(x: int) -> object:
    if x < 0:
        raise ValueError("negative")
    return {"half": x / 2} if x % 2 else x // 2


def _size(data: bytes) -> int:
    return len(data)


@pytest.mark.parametrize("shared", [False, True], ids=["alone", "with-read-ahead"])
def test_the_agent_wire_serves_calls_that_arrive_in_any_pieces(shared: bool) -> None:
    """Calls written a few bytes at a time, several to a write, with a large argument among
    them, are run in order and answered as the client's decoder expects; a call that raises
    goes to the host; any other message goes to `other`; Shutdown ends the loop. `shared`:
    another thread keeps taking frames ahead (as the agent's watcher does for a pinging
    client), and nothing changes."""
    import os
    import threading

    import cloudpickle

    fn_bytes = cloudpickle.dumps(_halve)
    big = bytes(range(256)) * 1000  # 256 kB: an out-of-band segment, read whole
    calls = [
        (1, 7, fn_bytes, (10,)),
        (2, 7, None, (7,)),
        (3, 7, None, (-1,)),
        (4, 8, None, (1,)),
        (5, 9, cloudpickle.dumps(_size), (big,)),
    ]
    blob = bytearray()
    for call_id, fn_id, fnb, args in calls:
        call = messages.Call(call_id, fn_id, fnb)
        for chunk in frames.encode(call, frames.cloud_dumps((args, {}))):
            blob += chunk
    hello = messages.Hello("info")  # one small segment, like a call's, but no call
    for chunk in frames.encode(hello, [b"plugins"]):
        blob += chunk
    for chunk in frames.encode(messages.Shutdown()):
        blob += chunk
    to_agent_r, to_agent_w = os.pipe()
    from_agent_r, from_agent_w = os.pipe()
    wire = AgentWire(to_agent_r, from_agent_w)

    def write_in_pieces() -> None:
        rng = random.Random(3)
        position = 0
        while position < len(blob):
            step = rng.choice([1, 5, 16, 17, 300, 70_000])
            os.write(to_agent_w, bytes(blob[position : position + step]))
            position += step

    writer = threading.Thread(target=write_in_pieces)
    writer.start()
    host = _Host()
    others: list[messages.Message] = []

    def other(message: messages.Message, segments: list[bytes]) -> bool:
        others.append(message)
        return not isinstance(message, messages.Shutdown)

    served = threading.Event()
    kept: list[messages.Message] = []

    def keep(message: messages.Message) -> bool:
        kept.append(message)
        return True

    def read_ahead() -> None:
        while not served.is_set():
            wire.read_ahead(keep)

    ahead = threading.Thread(target=read_ahead)
    if shared:
        ahead.start()
        # Frames taken ahead before the loop reads any: on a loaded machine the loop could
        # otherwise read them all before the other thread first runs.
        deadline = time.monotonic() + 10
        while not kept and time.monotonic() < deadline:
            time.sleep(0.001)
    wire.serve(host, other, shared=shared)  # type: ignore[arg-type]
    served.set()
    if shared:
        ahead.join()
        assert kept, "the other thread took frames ahead, which the loop then served"
    writer.join()
    os.close(from_agent_w)
    replies: dict[int, object] = {}
    decoder = frames.FrameDecoder(
        lambda m, segs: replies.__setitem__(m.call_id, frames.loads(segs))  # type: ignore[union-attr]
    )
    while data := os.read(from_agent_r, 1 << 16):
        decoder.feed(data)
    assert replies == {1: 5, 2: {"half": 3.5}, 5: len(big)}
    assert host.failed == [
        (3, "ValueError: negative"),
        (4, "RuntimeError: function 8 was never sent"),
    ]
    assert host.loaded == [7, 9]
    assert others == [hello, messages.Shutdown()]


def _metadata(message: messages.Message) -> bytes:
    """The metadata of `message`'s frame (with one segment)."""
    data = b"".join(bytes(c) for c in frames.encode(message, [b"segment"]))
    meta_len, count = frames.HEADER.unpack_from(data)
    start = frames.HEADER.size + frames.LENGTH.size * count
    return data[start : start + meta_len]


def test_calls_and_results_travel_packed_and_decode_as_themselves() -> None:
    """A call without its function's bytes and a result carry packed metadata (no pickle),
    written by `encode_call` and `encode_result` however they are asked for, and read back by
    `read_meta`, which reads pickled metadata too."""
    for segments in ([b"args"], [b"x" * 70_000], [b"a", b"b" * 100_000]):
        call = [bytes(c) for c in frames.encode(messages.Call(7, 3, None), segments)]
        assert call == [bytes(c) for c in frames.encode_call(7, 3, segments)]
        result = [bytes(c) for c in frames.encode(messages.Result(2**40), segments)]
        assert result == [bytes(c) for c in frames.encode_result(2**40, segments)]
    call_meta = _metadata(messages.Call(7, 3, None))
    result_meta = _metadata(messages.Result(2**40))
    assert call_meta[0] == result_meta[0] == frames.PACKED != pickle.dumps(())[0]
    assert (len(call_meta), len(result_meta)) == (
        frames.PACKED_CALL.size,
        frames.PACKED_RESULT.size,
    )
    for meta, wire in [
        (call_meta, (messages.Call.KIND, 7, 3, None)),
        (result_meta, (messages.Result.KIND, 2**40)),
        (_metadata(messages.Call(7, 3, b"fn")), (messages.Call.KIND, 7, 3, b"fn")),  # pickled
        (_metadata(messages.Heartbeat()), (messages.Heartbeat.KIND,)),
    ]:
        padded = b"before" + meta + b"after"  # read in place, from where it starts
        assert frames.read_meta(padded, len(b"before"), len(meta)) == wire
    with pytest.raises(frames.FrameError, match="packed metadata"):
        frames.read_meta(bytes([frames.PACKED]) + b"\0" * 5, 0, 6)
    not_a_tuple = pickle.dumps(5)
    with pytest.raises(frames.FrameError, match="int, not a message"):
        frames.read_meta(not_a_tuple, 0, len(not_a_tuple))


def test_the_agent_fast_path_writes_the_bytes_encode_result_writes() -> None:
    """The agent's loop packs a small scalar's `Result` in place (`frames.RESULT_FRAME`): its
    bytes are those of `encode_result`, the plain path's writer, call after call."""
    import os

    to_agent_r, to_agent_w = os.pipe()
    from_agent_r, from_agent_w = os.pipe()
    host = _Host()
    host.functions[7] = _halve
    sent = b"".join(
        bytes(chunk)
        for call_id, x in [(1, 10), (2**40, 4)]
        for chunk in frames.encode_call(call_id, 7, frames.cloud_dumps(((x,), {})))
    )
    os.write(to_agent_w, sent + b"".join(bytes(c) for c in frames.encode(messages.Shutdown())))
    os.close(to_agent_w)
    AgentWire(to_agent_r, from_agent_w).serve(host, lambda m, s: False)  # type: ignore[arg-type]
    os.close(from_agent_w)
    written = b""
    while data := os.read(from_agent_r, 1 << 16):
        written += data
    os.close(from_agent_r)
    expected = [
        frames.encode_result(c, [pickle.dumps(v, frames.PROTOCOL)]) for c, v in [(1, 5), (2**40, 2)]
    ]
    assert written == b"".join(bytes(chunk) for chunks in expected for chunk in chunks)


def test_threads_sending_at_once_never_interleave_their_frames() -> None:
    """Several threads send frames of every size at once (small ones in one write, large ones
    in several, as the agent's heartbeats, reports and results do): each frame arrives whole."""
    import os
    import threading

    to_agent_r, to_agent_w = os.pipe()  # nothing is sent to the agent: its input stays idle
    from_agent_r, from_agent_w = os.pipe()
    wire = AgentWire(to_agent_r, from_agent_w)
    sizes = [10, 3_000, 5_000, 70_000, 300_000]
    per_thread = 40
    received: list[tuple[int, bytes]] = []
    decoder = frames.FrameDecoder(
        lambda m, segs: received.append((m.call_id, bytes(segs[0])))  # type: ignore[union-attr]
    )

    broken: list[Exception] = []

    def read_all() -> None:  # drains the pipe to its end, even past a broken frame
        while data := os.read(from_agent_r, 1 << 16):
            if not broken:
                try:
                    decoder.feed(data)
                except Exception as exc:
                    broken.append(exc)

    def send(thread: int) -> None:
        for i in range(per_thread):
            size = sizes[(thread + i) % len(sizes)]
            wire.send(messages.Result(thread * 1000 + i), [bytes([thread]) * size])

    reader = threading.Thread(target=read_all)
    reader.start()
    senders = [threading.Thread(target=send, args=(t,)) for t in range(4)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    os.close(from_agent_w)
    reader.join()
    for fd in (to_agent_w, from_agent_r):  # (the wire owns and closes its input)
        os.close(fd)
    assert not broken, broken
    assert len(received) == 4 * per_thread
    for call_id, payload in received:
        thread, i = divmod(call_id, 1000)
        assert payload == bytes([thread]) * sizes[(thread + i) % len(sizes)]


def test_patience_polls_only_while_a_core_is_free_and_polling_pays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The waiting policy (`frames.Patience`): on a machine with no core free it never polls
    (the caller blocks at once); with one free it polls until ready; after `MISSES` waits the
    window did not cover it rests for `REST` waits, then polls again."""
    free = [False]
    monkeypatch.setattr(frames, "core_free", lambda: free[0])
    asked: list[int] = []

    def never() -> bool:
        asked.append(1)
        return False

    busy = frames.Patience(0.001)
    busy.SAMPLE = 0.0  # look at the machine at every wait, for the test
    busy.wait(never)
    assert asked == [], "it polled with no core free"

    free[0] = True
    countdown = iter([False, False, True])
    busy.wait(lambda: next(countdown))  # ready on the third look: polled until then
    assert next(countdown, "spent") == "spent"

    for _ in range(frames.Patience.MISSES):
        busy.wait(never)  # each a whole window, nothing came
    polled = len(asked)
    assert polled > frames.Patience.MISSES
    for _ in range(frames.Patience.REST):
        busy.wait(never)
    assert len(asked) == polled, "it polled while resting"
    busy.wait(never)
    assert len(asked) > polled, "it never tried again"

    idle = frames.Patience(0.0)  # no window: never polls
    idle.wait(never)
    assert len(asked) > polled


def test_no_core_is_free_with_a_busy_process_on_each() -> None:
    """`core_free` reads the machine's runnable tasks: with one busy process per core beside
    this one, none is free (an idle machine's answer depends on what else runs there)."""
    import multiprocessing
    import os
    import time

    cores = len(os.sched_getaffinity(0))
    spinners = [
        multiprocessing.get_context("fork").Process(target=_spin, daemon=True) for _ in range(cores)
    ]
    for process in spinners:
        process.start()
    try:
        time.sleep(0.2)
        looks = [frames.core_free() for _ in range(20)]
    finally:
        for process in spinners:
            process.kill()
            process.join(5)
    assert looks.count(False) >= 15, looks


def _spin() -> None:
    while True:
        pass
