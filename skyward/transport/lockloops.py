"""Steps taken for every pipe or session of a broadcast, as loops run in C.

A broadcast takes a lock for each node, more than once per call. A ``with`` block per node
costs two special-method lookups and two bound methods each time; mapping the lock type's own
``acquire`` over the list costs neither, and `consume` runs such a map to its end with no
bytecode per item::

    held: list[bool] = []
    try:
        held.extend(map(ACQUIRE, locks))  # `extend` keeps what it took if interrupted
        ...
    finally:
        consume(map(RELEASE, locks[: len(held)]))

Locks are always taken in their list's order, so two callers cannot deadlock.
"""

from __future__ import annotations

import _thread
import collections
from collections.abc import Callable, Iterable

ACQUIRE, RELEASE = _thread.LockType.acquire, _thread.LockType.release
# Runs an iterator to its end in C.
consume: Callable[[Iterable[object]], None] = collections.deque[object](maxlen=0).extend
