"""The client's fast path (`skyward.transport.fastpath`) against the plain behaviour it stands
for: the broadcast's lock idiom, the reader of replies' packed metadata, a Local broadcast's
multi-pipe read, and a function's bytes reaching every node before its calls."""

from __future__ import annotations

import os
import pickle
import threading
import time
from typing import Any

import pytest

import skyward as sky
from skyward.transport import fastpath, frames, messages


def test_all_held_takes_the_locks_in_order_and_gives_them_back() -> None:
    locks = [threading.Lock() for _ in range(8)]
    with fastpath.all_held(locks):
        assert all(lock.locked() for lock in locks)
    assert not any(lock.locked() for lock in locks)
    with pytest.raises(RuntimeError), fastpath.all_held(locks):
        raise RuntimeError("the body fails")
    assert not any(lock.locked() for lock in locks)


def test_all_held_gives_back_what_it_took_when_taking_is_interrupted() -> None:
    locks = [threading.Lock() for _ in range(3)]
    broken: list[Any] = [*locks, "not a lock", threading.Lock()]
    with pytest.raises(TypeError), fastpath.all_held(broken):
        pytest.fail("the body must not run")
    assert not any(lock.locked() for lock in locks)
    assert not broken[-1].locked()  # never taken: the ones after the failure are left alone


class _Outcome:
    def __init__(self) -> None:
        self.value: Any = None

    def set_result(self, result: Any) -> None:
        self.value = ("value", result)


def _every_kind() -> list[tuple[messages.Message, list[bytes]]]:
    error = messages.ErrorReport("ValueError", "bad", "tb")
    big = {"blob": b"x" * (frames.COALESCE_LIMIT + 10)}
    return [
        (messages.Result(1), [pickle.dumps(7, 5)]),
        (messages.Heartbeat(), []),
        (messages.Result(2), frames.dumps(big)),  # a large one: several segments
        (messages.Raised(3, error), [pickle.dumps(ValueError("bad"), 5)]),
        (messages.Reported(((1.0, {"loss": 0.5}, None),)), []),
        (messages.HookStarted("jax", "around_app"), []),
        (messages.Ready(), []),
        (messages.Result(2**40), [pickle.dumps("last", 5)]),
    ]


@pytest.mark.parametrize("chunk", [1, 5, 64, 1 << 20])
def test_the_packed_reader_agrees_with_the_plain_decoder(chunk: int) -> None:
    """`settle_frames` (then `FrameDecoder` for what it leaves) settles and hands on exactly
    what the plain decoder alone decodes, whatever the chunking."""
    sent = _every_kind()
    stream = b"".join(bytes(c) for m, s in sent for c in frames.encode(m, s))
    plain: list[tuple[messages.Message, Any]] = []
    decoder = frames.FrameDecoder(
        lambda m, segs: plain.append((m, frames.loads(segs) if segs else None))
    )
    fast_other: list[tuple[messages.Message, Any]] = []
    pending = {call_id: _Outcome() for call_id in (1, 2, 2**40)}
    outcomes = dict(pending)

    def other(m: messages.Message, segs: list[frames.Buffer]) -> None:
        fast_other.append((m, frames.loads(segs) if segs else None))

    leftover = frames.FrameDecoder(
        lambda m, segs: (
            fastpath.settle(pending, m.call_id, segs, pytest.fail)
            if isinstance(m, messages.Result)
            else other(m, segs)
        )
    )
    for start in range(0, len(stream), chunk):
        piece = stream[start : start + chunk]
        decoder.feed(piece)
        if leftover.between_frames:
            taken = fastpath.settle_frames(piece, pending, pytest.fail, other)
            piece = piece[taken:]
        if piece:
            leftover.feed(piece)
    results = {m.call_id: v for m, v in plain if isinstance(m, messages.Result)}
    assert {k: o.value for k, o in outcomes.items()} == {
        k: ("value", v) for k, v in results.items()
    }
    assert not pending
    others = [(m, v) for m, v in plain if not isinstance(m, messages.Result)]
    assert [m for m, _ in fast_other] == [m for m, _ in others]
    assert isinstance(fast_other[1][1], ValueError)


def test_after_a_frame_cut_short_the_rest_of_its_chunk_takes_the_fast_path() -> None:
    """Small results many to a chunk, their frames cut at every chunk's end (a gather's
    replies): the decoder finishes each cut frame with the plain decoder and reads the rest of
    the chunk with `settle_frames`, so only the frames cut short take the plain path."""
    from skyward.transport.fastpath import ReplyDecoder

    stream = b"".join(
        bytes(c) for i in range(300) for c in frames.encode_result(i, [pickle.dumps(i, 5)])
    )
    outcomes = {i: _Outcome() for i in range(300)}
    plain: list[messages.Message] = []

    class Calls:
        def __init__(self) -> None:
            self.pending: dict[int, Any] = dict(outcomes)

    class Counting(ReplyDecoder):
        def _on_message(self, message: messages.Message, segments: list[frames.Buffer]) -> None:
            plain.append(message)
            super()._on_message(message, segments)

    calls = Calls()
    decoder = Counting(calls, pytest.fail, pytest.fail)
    chunk = 1000  # not a multiple of a frame's size
    for start in range(0, len(stream), chunk):
        decoder.feed(stream[start : start + chunk])
    assert not calls.pending
    assert all(outcome.value == ("value", i) for i, outcome in outcomes.items())
    assert 0 < len(plain) <= len(stream) // chunk


def test_a_result_that_cannot_be_unpickled_goes_to_unpicklable() -> None:
    pending: dict[int, Any] = {5: _Outcome()}
    failed: list[tuple[Any, Exception]] = []
    data = b"".join(bytes(c) for c in frames.encode(messages.Result(5), [b"not a pickle"]))
    taken = fastpath.settle_frames(data, pending, lambda o, e: failed.append((o, e)), pytest.fail)
    assert taken == len(data) and not pending and len(failed) == 1


def test_a_local_broadcast_reads_every_pipe_and_notices_one_that_ended() -> None:
    got: dict[int, list[bytes]] = {}
    pipes = [os.pipe() for _ in range(8)]
    readers = []
    for index, (r, _) in enumerate(pipes):
        got[index] = []
        readers.append(fastpath.ControlReader(r, got[index].append))
    group = fastpath.PipeGroup(readers)
    try:
        for _, w in pipes:
            os.write(w, b"reply")
        group.read_until(lambda: all(b"".join(chunks) == b"reply" for chunks in got.values()))
        assert not group.broken
        os.close(pipes[3][1])
        os.write(pipes[0][1], b"more")
        group.read_until(lambda: readers[3].ended and b"more" in b"".join(got[0]))
        assert group.broken and readers[3].ended and got[3][-1] == b""
        assert not any(reader.lock.locked() for reader in readers)
    finally:
        for index, (_, w) in enumerate(pipes):
            if index != 3:
                os.close(w)


class _Session:
    def __init__(self, dead: BaseException | None = None, has: set[int] | None = None) -> None:
        self.dead = dead
        self.pending: dict[int, Any] = {}
        self.sent_functions = has or set()
        self.lock = threading.Lock()


class _Reply:
    error: BaseException | None = None

    def set_exception(self, error: BaseException | None) -> None:
        self.error = error


class _Pipe:
    def __init__(self, fd: int) -> None:
        self.stdin_fd = fd
        self.write_lock = threading.Lock()


def test_register_each_registers_live_nodes_and_fails_dead_ones_at_once() -> None:
    call = _FakeFrames(call_id=7, fn_id=3)
    lost = RuntimeError("node 1 died")
    sessions = [_Session(has={3}), _Session(dead=lost), _Session()]
    replies = [_Reply() for _ in sessions]
    chunks = fastpath.register_each(call, sessions, replies, [s.lock for s in sessions])
    assert chunks == [call.without_fn, [], call.with_fn]  # node 2 lacks the function
    assert sessions[0].pending == {7: replies[0]} and sessions[2].pending == {7: replies[2]}
    assert not sessions[1].pending and replies[1].error is lost
    assert not any(s.lock.locked() for s in sessions)


def test_a_tally_counts_each_reply_once_whatever_thread_settles_it() -> None:
    """The replies the fast path settles (`settle`, `register_each`) are `Reply`s: each is
    counted once, under its tally's lock, however many threads settle it at once, and a waiter
    asleep on the tally is woken."""
    from skyward.client.dispatch import Reply, Tally

    for _ in range(20):
        tally = Tally(64)
        replies = [Reply(tally) for _ in range(64)]
        woken = threading.Event()

        def wait(tally: Tally = tally, woken: threading.Event = woken) -> None:
            if tally.wait(tally.all_done, 10):
                woken.set()

        waiter = threading.Thread(target=wait)
        waiter.start()
        barrier = threading.Barrier(4)

        def settle_all(thread: int, wait: Any = barrier, replies: list[Reply] = replies) -> None:
            wait.wait()
            for index, reply in enumerate(replies):
                if index % 8 == 0:
                    reply.set_exception(RuntimeError(f"failed {index}"))
                reply.set_result((thread, index))

        settlers = [threading.Thread(target=settle_all, args=(t,)) for t in range(4)]
        for thread in settlers:
            thread.start()
        for thread in settlers:
            thread.join()
        waiter.join(10)
        assert woken.is_set() and tally.all_done() and tally.settled == 64
        assert len(tally.failures) == len({id(r) for r in tally.failures}) <= 8
        for index, reply in enumerate(replies):
            assert reply.done() and (reply.error is None) == (reply not in tally.failures)
            assert reply.error is not None or reply.value[1] == index


def test_write_each_writes_every_pipe_and_names_the_ones_that_failed() -> None:
    pipes = [os.pipe() for _ in range(3)]
    os.close(pipes[1][0])  # nobody reads node 1: its write fails (EPIPE)
    writers = [_Pipe(w) for _, w in pipes]
    try:
        failed = fastpath.write_each(
            writers, [w.write_lock for w in writers], [[b"a", b"b"], [b"x"], [b"c"]]
        )
        assert [index for index, _ in failed] == [1] and isinstance(failed[0][1], OSError)
        assert os.read(pipes[0][0], 10) == b"ab" and os.read(pipes[2][0], 10) == b"c"
        assert not any(w.write_lock.locked() for w in writers)
    finally:
        for index, (r, w) in enumerate(pipes):
            os.close(w)
            if index != 1:
                os.close(r)


class _FakeFrames:
    def __init__(self, call_id: int, fn_id: int) -> None:
        self.call_id, self.fn_id = call_id, fn_id
        self.without_fn: list[frames.Buffer] = [b"call"]
        self.with_fn: list[frames.Buffer] | None = [b"call+fn"]


def test_calls_with_and_without_the_function_from_two_threads_never_outrun_it() -> None:
    """A function's first calls, a broadcast and a `>>` made at once from two threads: one is
    written with the function's bytes, and the other, written first or not, carries them too
    until that write has returned (a node given a call before its function fails it)."""
    with sky.ComputePool(nodes=2, stream_output=False) as pool:
        for round_ in range(30):
            exec(f"def fresh(x):\n    return x + {round_}", namespace := {})  # a new function
            fresh = sky.compute(namespace["fresh"])
            barrier = threading.Barrier(2)
            errors: list[BaseException] = []
            results: list[Any] = []

            def call(
                broadcast: bool,
                fn: Any = fresh,
                wait: Any = barrier,
                results: list[Any] = results,
                errors: list[BaseException] = errors,
            ) -> None:
                wait.wait()
                try:
                    results.append(fn(1) @ pool if broadcast else fn(1) >> pool)
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=call, args=(b,)) for b in (True, False)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert not errors, errors[0]
            assert sorted(results, key=str) == sorted([[1 + round_] * 2, 1 + round_], key=str)


def _plain_read(fd: int) -> bytes:
    """The control reader's plain twin: a blocking read loop to the pipe's end."""
    got = []
    while data := os.read(fd, 1 << 16):
        got.append(data)
    return b"".join(got)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_control_reader_delivers_what_a_plain_read_loop_reads(seed: int) -> None:
    """Whoever reads (the background thread, or callers taking over now and then) and however
    the reads grow, the receiver gets the bytes a plain loop reads, in order, then b""."""
    import random

    rng = random.Random(seed)
    chunks = [
        rng.randbytes(rng.choice([1, 40, 255, 256, 257, 70_000, 1 << 20, 3 << 20]))
        for _ in range(60)
    ]
    sent = b"".join(chunks)
    plain_r, plain_w = os.pipe()
    fast_r, fast_w = os.pipe()
    got: list[bytes] = []
    reader = fastpath.ControlReader(fast_r, got.append)

    def write(fd: int) -> None:
        for chunk in chunks:
            frames.write_all(fd, chunk)
        os.close(fd)

    writers = [threading.Thread(target=write, args=(fd,)) for fd in (plain_w, fast_w)]
    for thread in writers:
        thread.start()
    plain = _plain_read(plain_r)
    received = 0
    while not reader.ended:  # callers take over for a while, then leave it to the thread
        target = min(len(sent), received + rng.randrange(1, 4 << 20))
        reader.read_until(lambda t=target: sum(map(len, got)) >= t or reader.ended, 0.0002)
        received = sum(map(len, got))
        if rng.random() < 0.3:
            time.sleep(0.002)  # the background thread reads meanwhile
    for thread in writers:
        thread.join()
    os.close(plain_r)
    assert plain == sent
    assert b"".join(got) == plain and got[-1] == b""


def test_kept_groups_build_a_lists_group_once_and_again_once_it_broke() -> None:
    pipes = [os.pipe() for _ in range(3)]
    readers = [fastpath.ControlReader(r, lambda data: None) for r, _ in pipes]
    kept = fastpath.KeptGroups(lambda streams: [readers[i] for i in streams])
    try:
        streams = [0, 1, 2]
        first = kept.of(streams)
        assert kept.of(streams) is first  # the same list: the same group
        assert kept.of([0, 1, 2]) is not first  # an equal list of its own: its own group
        assert {r.fd for r in first.readers} == {r.fd for r in fastpath.PipeGroup(readers).readers}
        first.broken = True
        again = kept.of(streams)
        assert again is not first and not again.broken
    finally:
        for _, w in pipes:
            os.close(w)
