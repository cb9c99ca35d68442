"""A detached run's record on the client: what it takes to find the run again.

One JSON file per run under ``<cache>/runs/`` (``$SKYWARD_CACHE_DIR`` or ~/.cache/skyward),
the directory 0700 and each file 0600: it names hosts, key files and job ids. The last state
seen of an ended run is kept in it, so listing ended runs reaches no node.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from skyward.cachedir import cache_root, write_private
from skyward.errors import ConfigError
from skyward.worker import supervisor

_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,47}")
_ADJECTIVES = [
    "amber",
    "brave",
    "calm",
    "crisp",
    "deft",
    "eager",
    "fair",
    "fleet",
    "glad",
    "keen",
    "lively",
    "lucid",
    "merry",
    "nimble",
    "proud",
    "quick",
    "quiet",
    "rapid",
    "sharp",
    "steady",
    "sunny",
    "swift",
    "tidy",
    "vivid",
    "warm",
    "witty",
    "bold",
    "bright",
]
_NOUNS = [
    "otter",
    "falcon",
    "heron",
    "lynx",
    "marten",
    "osprey",
    "puffin",
    "raven",
    "robin",
    "sparrow",
    "swift",
    "tern",
    "wren",
    "badger",
    "beaver",
    "bison",
    "cedar",
    "comet",
    "delta",
    "ember",
    "fjord",
    "glacier",
    "harbor",
    "maple",
    "meadow",
    "river",
]


@dataclass
class RunRecord:
    """A detached run as the client keeps it (see the module's docstring)."""

    name: str
    provider: str  # the provider's name: local, ssh, slurm
    kind: str  # how the client reaches the run: local, ssh, slurm
    nodes: int
    script: str
    args: list[str]
    created_at: float
    directories: list[str]  # each rank's run directory, on its node (node-major order)
    price_per_hour: float | None = None  # one node's, when known
    reach: dict[str, Any] = field(default_factory=dict)  # what `kind` needs to reach it
    key_tags: list[str | None] = field(default_factory=list)  # each node's authorized_keys tag
    output_dir: str | None = None  # where `fetch` (and the end, seen) brings the outputs
    keep_for: float = 0.0  # seconds each node stays up after the run's end (`--keep-for`)
    last: dict[str, Any] = field(default_factory=dict)  # the last run state read, once final
    ranks_per_node: int = 1  # the ranks each node holds (``--nproc-per-node``)

    @property
    def ranks(self) -> int:
        """Every rank of the run: one directory, log and follower each."""
        return self.nodes * self.ranks_per_node

    def rank_label(self, rank: int) -> str:
        """How lines and errors name rank `rank`: ``node i``, or ``node i rank r`` where a
        node holds several ranks."""
        node = rank // self.ranks_per_node
        return f"node {node}" if self.ranks_per_node == 1 else f"node {node} rank {rank}"

    def rank_path(self, rank: int) -> str:
        """Where rank `rank`'s outputs and kept log go under a local directory."""
        return supervisor.rank_path(rank // self.ranks_per_node, rank, self.ranks_per_node)


def runs_dir() -> Path:
    """``<cache>/runs``, made owner-only."""
    path = Path(cache_root()) / "runs"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def check_name(name: str) -> str:
    """`name` if it is a valid run name, else `ConfigError`."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(
            f"run name {name!r} is not valid: use 1-48 lowercase letters, digits and '-', "
            "starting with a letter or digit"
        )
    return name


def new_name() -> str:
    """A short readable name no run here has: ``swift-otter-3fa2``."""
    while True:
        words = f"{secrets.choice(_ADJECTIVES)}-{secrets.choice(_NOUNS)}"
        name = f"{words}-{secrets.token_hex(2)}"
        if not (runs_dir() / f"{name}.json").exists():
            return name


def save(record: RunRecord) -> None:
    write_private(runs_dir() / f"{record.name}.json", json.dumps(asdict(record), indent=1))


def exists(name: str) -> bool:
    return (runs_dir() / f"{name}.json").exists()


@contextlib.contextmanager
def claim(name: str) -> Iterator[None]:
    """Hold `name` while a run of that name starts: of two processes that start runs of one
    name at once, exactly one gets it, and the other a `ConfigError` before it starts
    anything. The hold is a lock on ``<runs>/NAME.lock``, which the kernel lets go with its
    process, so a client that dies while starting leaves the name free. A name whose run
    is recorded is refused; what a forgotten run of the same name left here goes."""
    fd = os.open(runs_dir() / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"a detached run named {name!r} is being started by another process; "
                "choose another --name"
            ) from None
        if exists(name):
            raise ConfigError(
                f"a detached run named {name!r} exists already; choose another --name, or "
                f"`skyward status --forget {name}` once it has ended"
            )
        _remove_kept(name)
        yield
    finally:
        os.close(fd)  # (and with it the lock)


def _remove_kept(name: str) -> None:
    """What the client kept of a run of this name besides its record (a cloud run's logs and
    outputs, its login key)."""
    shutil.rmtree(runs_dir() / f"{name}.logs", ignore_errors=True)
    (runs_dir() / f"{name}.key").unlink(missing_ok=True)


def load(name: str) -> RunRecord:
    """The record of run `name`; `ConfigError` listing the known runs when there is none."""
    path = runs_dir() / f"{check_name(name)}.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        known = [r.name for r in all_records()]
        listed = ", ".join(known) if known else "none"
        raise ConfigError(
            f"no detached run named {name!r} on this machine (known runs: {listed}); "
            "`skyward status` lists them"
        ) from None
    return RunRecord(**data)


def all_records() -> list[RunRecord]:
    """Every run recorded here, oldest first."""
    found = []
    for path in runs_dir().glob("*.json"):
        try:
            found.append(RunRecord(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(found, key=lambda r: r.created_at)


def forget(name: str) -> None:
    """Remove run `name`'s record and what the client kept of it (its nodes are not asked:
    `skyward status --forget` forgets only runs that have ended)."""
    (runs_dir() / f"{name}.json").unlink(missing_ok=True)
    _remove_kept(name)
