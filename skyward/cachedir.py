"""skyward's cache directory on this machine, and the file modes node programs write with.

Standard library only and nothing else of skyward: the node programs that start often (a
detached run's supervisor, the tree store, the agent) import it before anything else.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a method of the path given is all it takes: no pathlib at start-up
    from pathlib import Path


def cache_root() -> str:
    """skyward's cache directory on this machine: ``$SKYWARD_CACHE_DIR`` or ~/.cache/skyward.

    Made 0700 on first use in each process (made so, or narrowed to it when it already exists):
    it holds environments whose ``.skyward-ready`` has the whole `EnvSpec` with its ``env=``
    values, data and outputs, often on a cluster's shared home. A directory closed to group and
    others keeps everything under it theirs alone, whatever a file's own mode."""
    explicit = os.environ.get("SKYWARD_CACHE_DIR")
    if explicit:
        root = os.path.expanduser(explicit)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "skyward")
    if root not in _private_roots:
        os.makedirs(root, mode=0o700, exist_ok=True)
        with contextlib.suppress(OSError):  # not ours (a site's shared directory): leave it
            os.chmod(root, 0o700)
        _private_roots.add(root)
    return root


_private_roots: set[str] = set()


def keep_private() -> None:
    """Make what this node-side process creates 0600 (files) and 0700 (directories).

    A umask, not a chmod at every place that writes: the agent, the environment build and the
    tree store write the cache from many places (and uv, and the user's functions under
    ``sky.output_dir()``), and a umask covers them all, and their children, at once."""
    os.umask(0o077)


def write_private(path: Path, data: str | bytes) -> None:
    """Write `data` to `path` owner-only (0600), atomically: a reader sees the old file or the
    new one, never half of it. The file beside it is named for this process and thread, so
    two writers of one path do not share it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)
