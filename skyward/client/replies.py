"""How a dispatch's outcomes are counted.

A `Reply` is one call's outcome, lighter than a `concurrent.futures.Future`; a `Tally` counts a
dispatch's replies under one lock, and wakes the thread that waits for them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Tally:
    """The replies of one dispatch, counted as they settle (on any thread); a waiter that
    must sleep is woken as they settle. Its lock guards the count, the failures and the state
    of every reply it counts."""

    __slots__ = ("_lock", "_wakeup", "failures", "settled", "total")

    def __init__(self, total: int) -> None:
        self.total = total
        # A count, not the replies: a reply holds its tally, so a list of them would be a
        # cycle, and every dispatch's replies would wait for the garbage collector instead of
        # going when the call returns (`test_calls_leave_no_garbage_for_the_collector`).
        self.settled = 0
        self.failures: list[Reply] = []  # in the order they failed
        self._lock = threading.Lock()
        # Made by the first waiter that has to sleep: most calls are answered before their
        # caller looks (a Local pipe's reply is read by the caller itself).
        self._wakeup: threading.Condition | None = None

    def settle(self, reply: Reply, value: Any, error: BaseException | None) -> None:
        """Settle `reply` with `value` or `error`, once (a later settling is ignored), and wake
        the waiter if one sleeps."""
        with self._lock:
            if reply.finished:
                return
            reply.value, reply.error, reply.finished = value, error, True
            self.settled += 1
            if error is not None:
                self.failures.append(reply)
            if self._wakeup is not None:
                self._wakeup.notify_all()

    def all_done(self) -> bool:
        return self.settled == self.total

    def all_done_or_failed(self) -> bool:
        return self.settled == self.total or bool(self.failures)

    def wait(self, enough: Callable[[], bool], timeout: float | None = None) -> bool:
        """Sleep until `enough()` or `timeout`; whether it is enough."""
        if enough():
            return True
        with self._lock:  # `enough()` is checked again under it, so no settling is missed
            if self._wakeup is None:
                self._wakeup = threading.Condition(self._lock)
            return self._wakeup.wait_for(enough, timeout)


class Reply:
    """One call's outcome in a `Tally`: lighter than a `Future` (never cancelled, set once,
    under its tally's lock)."""

    __slots__ = ("error", "finished", "tally", "value")

    def __init__(self, tally: Tally) -> None:
        self.tally = tally
        self.value: Any = None
        self.error: BaseException | None = None
        self.finished = False

    def set_running_or_notify_cancel(self) -> bool:
        return True

    def set_result(self, result: Any) -> None:
        self.tally.settle(self, result, None)

    def set_exception(self, exception: BaseException | None) -> None:
        self.tally.settle(self, None, exception)

    def done(self) -> bool:
        return self.finished
