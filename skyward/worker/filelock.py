"""`locked`: an exclusive flock on a file, for caches that several processes share.

Every cache a node keeps (environments, sky.Data trees, S3 versions) is written by whichever
pool gets there first while the others wait; an flock is released by the kernel when its holder
dies, so a killed builder never leaves the cache locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created 0600 if missing) for the block."""
    # Owner-only whatever the umask of the process (a Local build runs in the client's): the
    # cache is the user's alone (`skyward.cachedir`).
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
