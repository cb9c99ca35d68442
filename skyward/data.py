"""`sky.Data`: a file, a directory or an ``s3://`` prefix passed to a call; the function on the
node receives a ``str``, a local path holding that content.

How the content gets there depends on the provider (`Provider.stage_data`):

- Local: the absolute path itself, no copy;
- SSH, AWS: the tree is synced into a content-addressed store on every node at once
  (`skyward.worker.treestore`); only content a node lacks travels;
- ``s3://bucket/prefix``: every node downloads it itself, with its own credentials, into the same
  kind of cache (`skyward.worker.s3sync`).

A `Data` is found wherever it sits in a call's arguments (inside lists, dicts, dataclasses):
pickling the arguments reports every `Data` it meets (`collecting`), the pool stages them, and
the arguments are pickled again with each one's placement. On the node, unpickling a `Data`
resolves it to its path (`_on_node`), before the function runs; a failure there is a
`DataError` naming the node and the path.

This module is imported on the nodes too: standard library and skyward's shared modules only.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from skyward.errors import ConfigError, DataError, SerializationError

# Places each `sky.Data` of a call's arguments (the pool syncs it to the nodes); True when a
# placement changed.
Stager = Callable[[list["Data"]], bool]

S3_SCHEME = "s3://"

# Where a Data's content is on the nodes: decided by the pool's provider, the same for every
# node so that a broadcast pickles its arguments once.
#   ("path", "/abs/path")    this machine's own path (Local)
#   ("tree", digest, name)   a tree in each node's store (SSH, AWS); name: the root's basename
#   ("s3", uri)              each node downloads the URI itself
Placement = tuple[str, ...]

_collector = threading.local()


class Data(str):
    """Content for a call: ``train(sky.Data("./dataset")) >> pool`` hands ``train`` a path.

    Args:
        source: a local file or directory (``~`` expanded, relative to the current directory),
            or ``"s3://bucket/prefix"``.

    A `Data` is a ``str`` (its absolute source path or URI), so it type-checks where the
    function takes a path; the function receives a plain ``str``, a path on its node. Treat that
    path as read-only: on SSH and AWS nodes it is a shared cache entry that later calls with the
    same content reuse.
    """

    _placement: Placement | None

    def __new__(cls, source: str | os.PathLike[str]) -> Data:
        made = super().__new__(cls, location(source, "sky.Data"))
        made._placement = None
        return made

    @property
    def source(self) -> str:
        """The absolute local path or the ``s3://`` URI, as a plain ``str``."""
        return str.__str__(self)

    @property
    def is_s3(self) -> bool:
        """True for an ``s3://`` source, which the nodes download themselves."""
        return self.source.startswith(S3_SCHEME)

    @property
    def path(self) -> Path:
        """The local source as a path (not for an ``s3://`` source)."""
        if self.is_s3:
            raise ValueError(f"{self.source} is not a local path")
        return Path(self.source)

    def existing_path(self) -> Path:
        """The local source, checked: a `DataError` when it does not exist here."""
        path = self.path
        if not os.path.lexists(path):
            raise DataError(
                f"sky.Data path {self.source} does not exist on this machine (a relative path "
                "is taken from the current directory)",
                path=self.source,
            )
        return path

    @property
    def placement(self) -> Placement | None:
        """Where the provider put it for the nodes (None until a pool staged it)."""
        return self._placement

    def place(self, placement: Placement) -> bool:
        """Record where the nodes find this content; whether that changed (the pool's job)."""
        changed = placement != self._placement
        self._placement = placement
        return changed

    def __reduce__(self) -> tuple[Any, ...]:
        found: list[Data] | None = getattr(_collector, "found", None)
        if found is None:
            raise SerializationError(
                f"sky.Data({self.source!r}) was pickled outside a call's arguments (captured "
                "by the function, or pickled by hand); pass it as an argument of the call"
            )
        found.append(self)
        return (_on_node, (self._placement or ("unplaced", self.source),))

    def __repr__(self) -> str:
        return f"sky.Data({self.source!r})"


def location(value: object, what: str) -> str:
    """`value` as skyward keeps a place: an ``s3://bucket/...`` URI as given, or an absolute
    local path (``~`` expanded, relative to the current directory); `what` names it in errors."""
    if not isinstance(value, str | os.PathLike):
        raise ConfigError(f"{what} takes a path or an s3:// URI, got {value!r}")
    text = os.fspath(value)
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{what} takes a path or an s3:// URI, got {value!r}")
    if not text.startswith(S3_SCHEME):
        return str(Path(text).expanduser().absolute())
    if not text[len(S3_SCHEME) :].split("/", 1)[0]:
        raise ConfigError(f"{what}={text!r}: the URI names no bucket")
    return text


@contextlib.contextmanager
def collecting() -> Iterator[list[Data]]:
    """While inside, pickling a `Data` in this thread appends it to the list yielded."""
    previous = getattr(_collector, "found", None)
    found: list[Data] = []
    _collector.found = found
    try:
        yield found
    finally:
        _collector.found = previous


# A restarted agent's checkpoint to resume from: its placement, as JSON (`resume_from`).
RESUME_ENV = "SKYWARD_RESUME_FROM"


def resume_from() -> str | None:
    """On a node: the local path of the checkpoint to resume from, after the pool restarted
    the call (``ComputePool(restarts=N)``): the newest one a node reported with
    ``sky.report(..., checkpoint=path)``, placed on every node. None on a first run, or when
    nothing was reported before the failure."""
    text = os.environ.get(RESUME_ENV)
    if not text:
        return None
    kind, *rest = json.loads(text)
    return _on_node((str(kind), *map(str, rest)))


def _on_node(placement: Placement) -> str:
    """A `Data` unpickled on a node: its local path (downloaded or checked first)."""
    kind, *rest = placement
    try:
        if kind == "path":
            return _existing(rest[0])
        if kind == "tree":
            from skyward.worker import treestore

            return _existing(treestore.tree_path(rest[0], rest[1]))
        if kind == "s3":
            from skyward.worker import s3sync

            return s3sync.download(rest[0])
    except DataError as exc:
        if exc.node is None:
            exc.node = _this_node()
        raise
    raise DataError(
        f"a sky.Data reached node {_this_node()} without being staged ({rest[-1] if rest else ''});"
        " pass sky.Data only as an argument of a call run by a pool",
        node=_this_node(),
    )


def _existing(path: str) -> str:
    if not os.path.exists(path):
        raise DataError(f"sky.Data path {path} does not exist on node {_this_node()}", path=path)
    return path


def _this_node() -> int | None:
    from skyward import info

    with contextlib.suppress(Exception):
        return info.instance_info().node
    return None
