"""`locked`: an exclusive flock on a file, for caches that several processes share.

Every cache a node keeps (environments, sky.Data trees, S3 versions) is written by whichever
pool gets there first while the others wait; an flock is released by the kernel when its holder
dies, so a killed builder never leaves the cache locked.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if missing) for the block."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
