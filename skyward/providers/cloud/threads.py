"""Blocking cloud calls off the pool's event loop, in threads that a Ctrl-C cannot stop."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


def in_thread(fn: Callable[[], T], name: str) -> Future[T]:
    """Run `fn` in a new non-daemon thread: the interpreter waits for it before exiting (a
    teardown half-way must finish even when the pool's loop is cancelled)."""
    future: Future[T] = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    # daemon=False explicitly: threads inherit daemon status from the (daemon) loop thread.
    threading.Thread(target=run, name=name, daemon=False).start()
    return future
