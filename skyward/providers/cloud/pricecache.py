"""The clouds' price answers, kept on disk with the time they were fetched.

A pool's price is asked before every launch, and the price services are slow (GCP's catalog is
tens of thousands of SKUs) or rate-limited, so each answer is kept in skyward's cache directory
(``prices/``, one JSON file an entry) until it is older than its kind allows: a list price
changes a few times a year, a spot price within the hour. An entry records when it was fetched,
so a price read from the cache still says how old it is.

The cache is only ever a shortcut: a file that cannot be read or parsed, whose value is not
of the shape its reader expects, or that cannot be written, means the cloud is asked (again),
never an error. Writes go to a temporary file that
is renamed over the entry, so a reader never sees half an entry and the last writer wins.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Generic, TypeVar

from skyward import cachedir

ON_DEMAND = timedelta(days=7)
"""How long a list (on-demand) price or a catalog of SKUs is kept."""

SPOT = timedelta(hours=1)
"""How long a spot price is kept."""

logger = logging.getLogger("skyward.prices")

T = TypeVar("T")

# What reading a stored value that has the wrong shape raises (a float of a list, a missing key).
_MISSHAPEN = (ValueError, TypeError, KeyError, AttributeError)


@dataclass(frozen=True)
class CachedPrice(Generic[T]):
    """One answer of a price service, as its reader made it, and when it was fetched (UTC)."""

    value: T
    fetched: datetime

    @property
    def day(self) -> str:
        """``2026-11-25``: the fetch date, for a list price's source."""
        return self.fetched.strftime("%Y-%m-%d")

    @property
    def minute(self) -> str:
        """``2026-11-25 14:02 UTC``: the fetch time, for a spot price's source."""
        return self.fetched.strftime("%Y-%m-%d %H:%M UTC")


def folder() -> Path:
    """Where the entries live: ``prices/`` under skyward's cache directory."""
    return Path(cachedir.cache_root()) / "prices"


def cached(
    provider: str,
    query: str,
    max_age: timedelta,
    fetch: Callable[[], Any],
    read: Callable[[Any], T],
) -> CachedPrice[T]:
    """`query` of `provider`: the stored answer if it is younger than `max_age`, else `fetch()`'s
    (a JSON value), stored. `read` makes either into what the caller uses; a stored answer it
    cannot read counts as none. What `fetch` raises is raised, and nothing is stored: a failed
    lookup is tried again next time."""
    path = _path(provider, query)
    now = datetime.now(UTC)
    stored = _read(path, provider, query)
    # An entry from the future (a clock set back since) is as untrustworthy as an old one.
    if stored is not None and timedelta(0) <= now - stored[1] <= max_age:
        try:
            return CachedPrice(read(stored[0]), stored[1])
        except _MISSHAPEN as exc:
            logger.debug("ignoring the misshapen price cache entry %s: %r", path, exc)
    answer = fetch()
    entry = CachedPrice(read(answer), now)
    _write(path, provider, query, answer, now)
    return entry


def _path(provider: str, query: str) -> Path:
    # Queries hold spaces, slashes and region names: a digest makes a safe, fixed-length name,
    # and the entry repeats the query so that a reader can check it is the one it asked for.
    digest = hashlib.sha256(f"{provider}\n{query}".encode()).hexdigest()[:32]
    return folder() / f"{provider}-{digest}.json"


def _read(path: Path, provider: str, query: str) -> tuple[Any, datetime] | None:
    """The stored JSON value of `query` and when it was fetched, or None."""
    try:
        data = json.loads(path.read_text())
        if data["provider"] != provider or data["query"] != query:
            return None
        fetched = datetime.fromisoformat(data["fetched"])
        if fetched.tzinfo is None:
            return None
        return data["value"], fetched.astimezone(UTC)
    except FileNotFoundError:
        return None
    except (OSError, *_MISSHAPEN) as exc:
        logger.debug("ignoring the unreadable price cache entry %s: %r", path, exc)
        return None


def _write(path: Path, provider: str, query: str, value: Any, fetched: datetime) -> None:
    data = {"provider": provider, "query": query, "fetched": fetched.isoformat(), "value": value}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(handle, "w") as out:
                json.dump(data, out)
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
    except OSError as exc:  # a full or read-only disk: the price is still good, only not kept
        logger.debug("could not keep the price cache entry %s: %s", path, exc)
