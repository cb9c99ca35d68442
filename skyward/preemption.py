"""`sky.preempting()` and `sky.on_preemption(callback)`: a node's notice that it is about to be
taken away, and what the user's code does about it (typically: save a checkpoint now and report
it, so a restart resumes from there).

A notice comes to the agent from its provider: a signal (SIGUSR1: what Slurm sends ahead of a
preemption or the time limit with ``--signal=USR1@<seconds>``, what ``scancel --signal=USR1``
sends, and what the client sends a node it was told is going). The agent records it here, tells
the client, and runs the callbacks in a thread of their own, so a callback may take its time
(save, then `sky.report(..., checkpoint=)`) while the call goes on.

Imported by the agent on the node, so it uses the standard library only.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Preemption:
    """A notice: where it came from, when, and by when the node goes (None: not said)."""

    source: str
    noticed_at: float
    deadline: float | None = None

    @property
    def seconds_left(self) -> float | None:
        """Seconds until the node goes, when the notice said; None otherwise."""
        return None if self.deadline is None else max(0.0, self.deadline - time.time())


_lock = threading.Lock()
_notice: Preemption | None = None
_callbacks: list[Callable[[Preemption], object]] = []


def preempting() -> Preemption | None:
    """On a node: the preemption notice it got, or None (also outside a node)."""
    return _notice


def on_preemption(callback: Callable[[Preemption], object]) -> None:
    """On a node: call `callback(notice)` when a preemption notice arrives, in a thread of its
    own (at once, when one already has). Typically: save a checkpoint and report it."""
    with _lock:
        _callbacks.append(callback)
        notice = _notice
    if notice is not None:
        _run([callback], notice)


def notice(source: str, seconds_left: float | None = None) -> Preemption | None:
    """Record a notice (the agent's part); the new one, or None when one was already there."""
    global _notice
    with _lock:
        if _notice is not None:
            return None
        now = time.time()
        _notice = Preemption(source, now, None if seconds_left is None else now + seconds_left)
        callbacks = list(_callbacks)
    _run(callbacks, _notice)
    return _notice


def _run(callbacks: list[Callable[[Preemption], object]], notice: Preemption) -> None:
    def run_all() -> None:
        for callback in callbacks:
            try:
                callback(notice)
            except Exception:  # the user's callback: say so on the node's output, go on
                traceback.print_exc()

    if callbacks:
        threading.Thread(target=run_all, name="skyward-preemption", daemon=True).start()
