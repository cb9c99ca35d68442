"""The pool's event loop lent to the callers that wait on it (`loop.LoopThread.drive`)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from skyward.transport.eventloop import LoopThread, sigterm_unwinds


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    """A loop as a pool has it: signals wait for the main thread's run of it to end."""
    with sigterm_unwinds():
        thread = LoopThread("skyward-test-loop")
        try:
            yield thread
        finally:
            thread.stop()


def settle_later(loop: LoopThread, delay: float) -> tuple[list[int], threading.Event]:
    """An event set by a loop callback `delay` seconds from now, and the thread that ran it."""
    ran: list[int] = []
    done = threading.Event()

    def fire() -> None:
        ran.append(threading.get_ident())
        done.set()

    loop.call_soon(lambda: asyncio.get_running_loop().call_later(delay, fire))
    return ran, done


@pytest.mark.usefixtures("sigint_raises")  # a background shell's ignored SIGINT runs no
# Python code, and would let the main thread drive
def test_the_main_thread_runs_the_loop_only_where_signals_wait_for_it() -> None:
    thread = LoopThread("skyward-test-loop")
    try:
        _, done = settle_later(thread, 0.01)
        assert not thread.drive(done.is_set)  # outside sigterm_unwinds: KeyboardInterrupt
        assert done.wait(2)  # could land inside asyncssh, so the loop's thread serves it
    finally:
        thread.stop()


def test_a_waiting_caller_runs_the_loop_itself(loop: LoopThread) -> None:
    ran, done = settle_later(loop, 0.01)
    time.sleep(0.005)  # the callback is scheduled on the loop's own thread first
    assert loop.drive(done.is_set)
    assert ran == [threading.get_ident()]


def test_the_loop_thread_takes_the_loop_back_for_work_nobody_waits_on(
    loop: LoopThread,
) -> None:
    _, done = settle_later(loop, 0.001)
    loop.drive(done.is_set)
    # nobody drives now: a submitted coroutine and a callback still run, on the loop's thread
    ran, later = settle_later(loop, 0.01)
    assert later.wait(2)
    assert ran != [threading.get_ident()]

    async def answer() -> int:
        return 42

    assert loop.submit(answer()).result(2) == 42


def test_many_callers_at_once_all_get_their_replies(loop: LoopThread) -> None:
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            for i in range(30):
                _, done = settle_later(loop, 0.0005 * (i % 3))
                if not loop.drive(done.is_set):  # another caller runs the loop: wait as before
                    assert done.wait(5), "a follower's reply never came"
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads)
    assert not errors


@pytest.mark.usefixtures("sigint_raises")
def test_ctrl_c_while_the_main_thread_runs_the_loop_waits_for_the_callback_to_finish(
    loop: LoopThread,
) -> None:
    finished: list[bool] = []

    def interrupted_midway() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # Python looks at signals between bytecodes: plenty of chances here
        finished.append(True)

    loop.call_soon(lambda: asyncio.get_running_loop().call_later(0.01, interrupted_midway))
    with pytest.raises(KeyboardInterrupt):
        loop.drive(lambda: False)  # never done: only the interrupt ends the wait
    assert finished == [True]

    async def still_works() -> str:
        return "yes"

    assert loop.run(still_works()) == "yes"


def test_stop_leaves_no_thread(loop: LoopThread) -> None:
    _, done = settle_later(loop, 0.001)
    loop.drive(done.is_set)
    loop.stop()
    assert not [t for t in threading.enumerate() if t.name == "skyward-test-loop"]
