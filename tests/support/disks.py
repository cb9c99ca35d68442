"""Small real disks for full-disk tests: a tmpfs mounted for the test (root only), and a way to
fill one up."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (``8m``) mounted at `mount` (created) for the block."""
    mount.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path, leave: int) -> Path:
    """Fill `disk` until only about `leave` bytes are free; the file that does it."""
    stat = os.statvfs(disk)
    filler = disk / "filler"
    with filler.open("wb") as out:
        out.write(b"\0" * max(0, stat.f_bavail * stat.f_frsize - leave))
    return filler
