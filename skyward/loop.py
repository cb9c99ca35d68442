"""The pool's event loop, run in a background thread, and the signal handling around it.

The public API is synchronous; underneath, one asyncio loop per pool owns every node's stream.
`LoopThread.run` hands it a coroutine from the caller's thread and waits for the result.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """An asyncio loop in a daemon thread, for one pool."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.call_soon(ready.set)
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()
        ready.wait()

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
        """Cancel what still runs on the loop, stop it and join its thread (bounded)."""

        async def cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel_rest(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While inside, SIGTERM raises `SystemExit` (so `with` blocks unwind and nodes are removed)
    instead of ending the process where it stands. Main thread only; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, previous)
