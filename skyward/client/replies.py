"""How a dispatch's outcomes are counted.

A `Reply` is one call's outcome, lighter than a `concurrent.futures.Future`; a `Tally` counts a
dispatch's replies, so that waiting for all of them costs no lock per reply.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Tally:
    """The replies of one dispatch, counted as they settle (on any thread), so that waiting
    for them costs no lock per reply; a waiter that must sleep is woken as they settle."""

    __slots__ = ("cond", "failures", "settled", "total", "waiting")

    def __init__(self, total: int) -> None:
        self.total = total
        self.failures: list[Reply] = []  # in the order they failed
        # One entry per settled reply (list.append is atomic under the GIL), not the reply
        # itself: a reply holds its tally, so that would be a cycle, and every dispatch's
        # replies would wait for the garbage collector instead of going when the call returns.
        self.settled: list[None] = []
        self.waiting = False
        self.cond: threading.Condition | None = None  # made by the first waiter that sleeps

    def settle(self, reply: Reply) -> None:
        """Count `reply`, settled (once) on any thread, and wake the waiter if one sleeps."""
        if reply.error is not None:
            self.failures.append(reply)
        self.settled.append(None)
        if self.waiting:  # read after the append: see `wait`
            self.wake()

    def wake(self) -> None:
        """Wake the waiter that sleeps (`wait`)."""
        if self.cond is not None:
            with self.cond:
                self.cond.notify_all()

    def all_done(self) -> bool:
        return len(self.settled) == self.total

    def all_done_or_failed(self) -> bool:
        return len(self.settled) == self.total or bool(self.failures)

    def wait(self, enough: Callable[[], bool], timeout: float | None = None) -> bool:
        """Sleep until `enough()` or `timeout`; whether it is enough."""
        if enough():
            return True
        if self.cond is None:
            self.cond = threading.Condition(threading.Lock())
        with self.cond:
            # Set before `enough()` is checked again under the lock: a reply that settles after
            # that check sees the flag and notifies; one that settled before, the check sees.
            self.waiting = True
            return self.cond.wait_for(enough, timeout)


class Reply:
    """One call's outcome in a `Tally`: lighter than a `Future` (no lock, never cancelled, set
    exactly once). Made without an ``__init__`` (its fields start as class defaults): a
    broadcast makes one per node on every call."""

    tally: Tally
    value: Any = None
    error: BaseException | None = None
    finished = False

    def set_running_or_notify_cancel(self) -> bool:
        return True

    def set_result(self, result: Any) -> None:
        if not self.finished:  # counted once, whatever happens
            self.value, self.finished = result, True
            self.tally.settle(self)

    def set_exception(self, exception: BaseException | None) -> None:
        if not self.finished:
            self.error, self.finished = exception, True
            self.tally.settle(self)

    def done(self) -> bool:
        return self.finished


def new_reply(tally: Tally) -> Reply:
    """A `Reply` counted by `tally`."""
    reply = Reply()
    reply.tally = tally
    return reply
