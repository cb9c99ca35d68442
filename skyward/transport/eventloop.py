"""The pool's event loop, run in a background thread, and the signal handling around it.

The public API is synchronous; underneath, one asyncio loop per pool owns every node's stream.
`LoopThread.run` hands it a coroutine from the caller's thread and waits for the result.

A caller that waits for replies read on the loop (an SSH channel's) runs the loop itself
(`LoopThread.drive`), so a reply reaches it with no thread in between: the loop's own thread
steps aside while callers come and takes the loop back once none has for a moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import signal
import threading
import time
from _signal import getsignal as _getsignal
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")
_MAIN_THREAD = threading.main_thread().ident


def _runs_a_loop() -> bool:
    """Whether this thread runs an asyncio loop (a notebook's)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class _MainDrive:
    """The main thread's run of a pool's loop, and the signal that came meanwhile."""

    driving: LoopThread | None = None
    pending: Callable[[], None] | None = None  # what the signal does, once the run is over


_main = _MainDrive()


class _Selector(selectors.DefaultSelector):
    """The loop's selector: a run driven by a caller ends where the loop would block once the
    caller's replies are in (`until`), since replies settle in the loop's callbacks."""

    def __init__(self) -> None:
        super().__init__()
        self.until: Callable[[], bool] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        until = self.until
        if until is not None and until():
            assert self.loop is not None
            self.loop.stop()
            return []
        return super().select(timeout)


class _Loop(asyncio.SelectorEventLoop):
    """A pool's loop, which knows its `LoopThread` (see `lender`)."""

    def __init__(self, selector: _Selector, owner: LoopThread) -> None:
        super().__init__(selector)
        selector.loop = self
        self.skyward_owner = owner


def lender(loop: asyncio.AbstractEventLoop) -> LoopThread | None:
    """The `LoopThread` whose loop `loop` is, which can lend it to a waiting caller; or None."""
    return loop.skyward_owner if isinstance(loop, _Loop) else None


class LoopThread:
    """An asyncio loop in a daemon thread, for one pool, lent to callers that wait on it.

    One thread runs the loop at a time: whoever holds it (`_holder`). A caller that wants it
    while the loop's own thread runs it asks that thread to step aside; the thread then stays
    out while callers come, looking now and then (`POLL`), and takes the loop back `LINGER`
    seconds after the last one left, so back-to-back calls cost it no wake-ups. In between
    nobody runs the loop: a reply that no caller drives for (a `submit` future) can wait up
    to about `POLL` after a caller left.
    """

    POLL = 0.002
    LINGER = 0.001

    def __init__(self, name: str) -> None:
        self._selector = _Selector()
        self._loop = _Loop(self._selector, self)
        self._lock = threading.Lock()
        self._parked = threading.Condition(self._lock)  # callers wait for the thread to step aside
        self._resume = threading.Condition(self._lock)  # the thread waits for the loop
        self._holder: int | None = None  # the thread running the loop (None: nobody)
        self._parking = False  # the loop's thread was asked to step aside
        self._wanted = 0  # callers waiting for it to
        self._last_driven = 0.0
        # The replies of callers that wait on the loop while another caller drives it: the loop's
        # thread takes it back at once when a driver leaves before they are in.
        self._followers: list[Callable[[], bool]] = []
        self._closing = False
        ready = threading.Event()
        self._thread = threading.Thread(target=self._home, args=(ready,), name=name, daemon=True)
        self._thread.start()
        ready.wait()
        assert self._thread.ident is not None
        self._home_id: int = self._thread.ident

    def _home(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(ready.set)
        me = threading.get_ident()
        while True:
            with self._lock:
                while not self._closing:
                    if self._holder is None and not self._wanted:
                        self._followers = [done for done in self._followers if not done()]
                        wait = self.LINGER - (time.monotonic() - self._last_driven)
                        if wait <= 0 or self._followers:
                            break
                    else:
                        wait = self.POLL
                    self._resume.wait(wait)
                if self._closing:
                    return
                self._holder = me
            try:
                self._loop.run_forever()
            finally:
                with self._lock:
                    self._holder = None
                    self._parking = False
                    self._parked.notify_all()

    def _park(self) -> None:
        if threading.get_ident() == self._home_id:
            self._loop.stop()

    def drive(self, done: Callable[[], bool]) -> bool:
        """Run the loop in this thread until `done()`; whether it did.

        It does not when another caller already runs the loop (that one's run settles this
        caller's replies too), when the loop's thread runs it for callers that wait already,
        or when this thread cannot (it runs a loop of its own, a notebook's; or it is the main
        thread and a signal handler not ours could raise inside the loop's callbacks): the
        caller then waits for its replies as a caller of any thread would.
        """
        if done():
            return True
        me = threading.get_ident()
        if me == self._home_id or _runs_a_loop():
            return False
        if me != _MAIN_THREAD:
            return self._drive(me, done, done)
        if not _interrupts_wait():
            return False
        # A SIGINT or SIGTERM now waits for the loop's turn to end (see `sigterm_unwinds`): an
        # exception raised in the middle of asyncssh's packet handling would break the
        # connection that the pool's teardown needs.
        _main.driving = self
        try:
            return self._drive(me, done, lambda: done() or _main.pending is not None)
        finally:
            _main.driving = None
            act, _main.pending = _main.pending, None
            if act is not None:
                act()

    def _drive(self, me: int, done: Callable[[], bool], until: Callable[[], bool]) -> bool:
        with self._lock:
            while self._holder is not None:
                if self._holder != self._home_id or self._closing:
                    self._followers.append(done)
                    return False
                self._followers = [d for d in self._followers if not d()]
                if self._followers:  # the loop's thread serves waiting callers: join them
                    self._followers.append(done)
                    return False
                if not self._parking:
                    self._parking = True
                    self._loop.call_soon_threadsafe(self._park)
                self._wanted += 1
                try:
                    self._parked.wait(0.05)
                finally:
                    self._wanted -= 1
                if until():
                    return False
            self._holder = me
        try:
            self._selector.until = until
            while not until():
                self._loop.run_forever()
        finally:
            self._selector.until = None
            with self._lock:
                self._holder = None
                self._last_driven = time.monotonic()
                self._followers = [d for d in self._followers if not d()]
                if self._followers or self._closing:
                    self._resume.notify()
        return True

    def settled(self) -> None:
        """Called on the loop when replies may have come in: a caller's run of the loop ends
        right after this turn if it has what it waits for, instead of one turn later."""
        until = self._selector.until
        if until is not None and until():
            self._loop.stop()

    def borrow(self) -> bool:
        """Whether this thread may touch the loop's objects now: it runs the loop, or nobody
        does and it took the loop (then `give_back` it)."""
        me = threading.get_ident()
        with self._lock:
            if self._holder is None:
                self._holder = me
                return True
        return False

    def holds(self) -> bool:
        """Whether this thread runs the loop now."""
        return self._holder == threading.get_ident()

    def give_back(self) -> None:
        with self._lock:
            self._holder = None

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and wait for it; an interrupted wait cancels it."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Start `coro` on the loop, from any thread (the loop's own included); its future."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop, from any thread."""
        self._loop.call_soon_threadsafe(fn)

    def stop(self) -> None:
        """Cancel what still runs on the loop, stop it and join its thread (bounded); once."""
        if self._closing:
            return

        async def cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel_rest(), self._loop).result(5)
        with self._lock:
            self._closing = True
            self._resume.notify()
        self._loop.call_soon_threadsafe(self._park)
        self._thread.join(5)
        with self._lock:
            if not self._thread.is_alive() and self._holder is None:
                self._holder = -1  # nobody may take it any more
                self._loop.close()


def _defer(act: Callable[[], None]) -> bool:
    """In a signal handler: if the main thread runs a pool's loop, keep `act` for the end of
    that run, wake the loop so the run ends now, and say so."""
    drive = _main.driving
    if drive is None:
        return False
    if _main.pending is None:
        _main.pending = act
    with contextlib.suppress(RuntimeError):  # a closed loop: the run is over anyway
        drive._loop.call_soon_threadsafe(_nothing)
    return True


def _nothing() -> None:
    pass


def _interrupts_wait() -> bool:
    """Whether SIGINT and SIGTERM wait for the end of the main thread's run of a loop: their
    handlers are ours, or they run no Python code."""
    # Asked on every call a main thread waits for: `signal.getsignal` turns a Python handler
    # into an enum first and fails (a ValueError raised and caught on every call); the C
    # function under it returns the handler as it is.
    return all(
        getattr(handler, "skyward_defers", False) or not callable(handler)
        for handler in (_getsignal(signal.SIGINT), _getsignal(signal.SIGTERM))
    )


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While inside, SIGTERM raises `SystemExit` (so `with` blocks unwind and nodes are removed)
    instead of ending the process where it stands. Main thread only; elsewhere a no-op.

    Both SIGTERM and SIGINT (Ctrl-C) then wait for the loop's turn to end when they come while
    the main thread runs a pool's loop (`LoopThread.drive`), and act right after it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        if not _defer(lambda: on_sigterm(signum, None)):
            raise SystemExit(128 + signum)

    interrupt = signal.getsignal(signal.SIGINT)

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        if not _defer(lambda: on_sigint(signum, None)) and callable(interrupt):
            interrupt(signum, frame)

    on_sigterm.skyward_defers = True  # type: ignore[attr-defined]
    on_sigint.skyward_defers = True  # type: ignore[attr-defined]
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    if callable(interrupt):
        signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, previous)
            if callable(interrupt) and signal.getsignal(signal.SIGINT) is on_sigint:
                signal.signal(signal.SIGINT, interrupt)
