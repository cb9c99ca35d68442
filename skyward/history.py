"""A pool's history on the client: what the dashboard shows of it, kept after it ends.

Each pool a script runs writes one directory, ``<cache>/history/<pool id>/`` (0700, its files
0600, as the detached runs' records are):

- ``run.json``: what the pool is and how it stands (name, provider, nodes, state, start, end,
  $/hour and cost so far, the client's pid), rewritten whole on a change of state, and for its
  cost every `COST_SECONDS`;
- ``events.jsonl``: skyward's own lines about it (launching, a node ready, lost, replaced,
  resumed, the budget spent, a stall with its stacks), in order;
- ``metrics.jsonl``: its `sky.report` metrics, with the node, the rank and the time;
- ``output.jsonl``: what its ranks printed, one line a record, the newest ``OUTPUT_BYTES`` or so.

Every record of a ``.jsonl`` file has a number ``n`` that only grows: a reader that has seen up
to ``n`` asks for what follows, whatever was dropped from the front meanwhile.

The pool hands records over as they come (an append to a list, on whatever thread they come
from); a thread of the recorder writes them out every `FLUSH_SECONDS`, so a node's output costs
the pool's event loop no file write. A pool whose client died without closing it still reads
``running`` in ``run.json``: `runs` says ``lost`` for it, since its pid is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from skyward.cachedir import cache_root, write_private

FLUSH_SECONDS = 0.5
# How often ``run.json`` is rewritten for its cost alone (a change of state rewrites it at once).
COST_SECONDS = 5.0
# Past this many bytes a file's older half is dropped (output and events); metrics are kept
# whole up to METRICS_BYTES, then no more are written (one event says so).
OUTPUT_BYTES = 8 << 20
METRICS_BYTES = 64 << 20
FILES = ("events", "metrics", "output")
FINAL = ("succeeded", "failed", "stopped", "lost")

Record = dict[str, Any]
# The pool's rate and what it has spent so far, in dollars (None: the price is unknown).
Costing = Callable[[], tuple[float | None, float | None]]


def history_dir() -> Path:
    """``<cache>/history``, made owner-only."""
    path = Path(cache_root()) / "history"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


class Recorder:
    """One pool's history as it is written (see the module's docstring); thread-safe."""

    def __init__(self, run_id: str, name: str, provider: str, nodes: int) -> None:
        self.directory = history_dir() / run_id
        self.directory.mkdir(mode=0o700, exist_ok=True)
        self.costing: Costing | None = None
        self._info: Record = {
            "id": run_id,
            "kind": "pool",
            "name": name,
            "provider": provider,
            "nodes": nodes,
            "ranks_per_node": 1,
            "state": "starting",
            "reason": "",
            "started": time.time(),
            "ended": None,
            "per_hour": None,
            "cost": None,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "script": " ".join(sys.argv) if sys.argv and sys.argv[0] else "",
        }
        self._lock = threading.Lock()
        self._pending: dict[str, list[Record]] = {kind: [] for kind in FILES}
        self._count = dict.fromkeys(FILES, 0)
        self._metrics_full = False
        self._dirty = True
        self._cost_written = -COST_SECONDS  # time.monotonic() of the last cost written
        self._done = threading.Event()
        self._writer: threading.Thread | None = None

    # -- what the pool tells it ------------------------------------------------------------

    def event(self, text: str) -> None:
        self._add("events", {"time": time.time(), "text": text})

    def line(self, who: str, text: str) -> None:
        """A line rank `who` (``node 1``, ``node 1 rank 3``) printed."""
        self._add("output", {"time": time.time(), "who": who, "line": text})

    def report(
        self,
        who: str,
        node: int,
        rank: int,
        at: float,
        metrics: dict[str, Any],
        checkpoint: str | None,
    ) -> None:
        record: Record = {"time": at, "who": who, "node": node, "rank": rank, "metrics": metrics}
        if checkpoint is not None:
            record["checkpoint"] = checkpoint
        self._add("metrics", record)

    def update(self, **fields: Any) -> None:
        """Change what ``run.json`` says (``state=``, ``provider=``, ``ranks_per_node=``)."""
        with self._lock:
            self._info.update(fields)
            self._dirty = True

    def _add(self, kind: str, record: Record) -> None:
        with self._lock:
            self._count[kind] += 1
            record["n"] = self._count[kind]
            self._pending[kind].append(record)

    # -- writing ---------------------------------------------------------------------------

    def start(self) -> None:
        """Write ``run.json`` now and the rest every `FLUSH_SECONDS` from here on."""
        self.flush()
        self._writer = threading.Thread(target=self._write_often, name="skyward-history")
        self._writer.daemon = True
        self._writer.start()

    def end(self, state: str, reason: str = "") -> None:
        """The pool ended in `state` (`FINAL`): everything is written, the writer stops."""
        self.update(state=state, reason=reason, ended=time.time())
        self._done.set()
        if self._writer is not None:
            self._writer.join(timeout=5)
        self.flush()

    def _write_often(self) -> None:
        while not self._done.wait(FLUSH_SECONDS):
            try:
                self.flush()
            except OSError:  # a full disk must not break the pool; the next flush tries again
                continue

    def flush(self) -> None:
        now = time.monotonic()
        with self._lock:
            pending = {kind: records for kind, records in self._pending.items() if records}
            self._pending = {kind: [] for kind in FILES}
            costs = self.costing is not None and now - self._cost_written >= COST_SECONDS
            info = dict(self._info) if self._dirty or costs else None
            self._dirty = False
        for kind, records in pending.items():
            self._append(kind, records)
        if info is None:
            return
        if self.costing is not None:  # the cost as of now, whatever made this write
            info["per_hour"], info["cost"] = self.costing()
            self._cost_written = now
        write_private(self.directory / "run.json", json.dumps(info, indent=1))

    def _append(self, kind: str, records: list[Record]) -> None:
        path = self.directory / f"{kind}.jsonl"
        if kind == "metrics" and self._metrics_full:
            return
        text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
        with _opened(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND) as fd:
            os.write(fd, text.encode())
            size = os.fstat(fd).st_size
        if kind == "metrics" and size > METRICS_BYTES:
            self._metrics_full = True
            self.event(f"metrics past {METRICS_BYTES >> 20} MiB are not kept in the history")
        elif kind != "metrics" and size > OUTPUT_BYTES:
            _drop_older_half(path)


@contextlib.contextmanager
def _opened(path: Path, flags: int) -> Iterator[int]:
    fd = os.open(path, flags, 0o600)
    try:
        yield fd
    finally:
        os.close(fd)


def _drop_older_half(path: Path) -> None:
    """Keep the newer half of `path`'s lines (whole lines), replacing the file at once."""
    data = path.read_bytes()
    write_private(path, data[data.find(b"\n", len(data) // 2) + 1 :])


# -- reading (the dashboard) -------------------------------------------------------------------


def runs() -> list[Record]:
    """Every pool in the history, newest first, a client that died without closing its pool
    read as ``lost``."""
    found = []
    for path in history_dir().glob("*/run.json"):
        with contextlib.suppress(OSError, ValueError):
            found.append(_judged(json.loads(path.read_text())))
    return sorted(found, key=lambda r: r.get("started") or 0, reverse=True)


def run(run_id: str) -> Record | None:
    """Pool `run_id`'s ``run.json``, judged as `runs` does; None if there is none."""
    if "/" in run_id or run_id.startswith("."):
        return None
    try:
        return _judged(json.loads((history_dir() / run_id / "run.json").read_text()))
    except (OSError, ValueError):
        return None


def _judged(info: Record) -> Record:
    if info.get("state") not in FINAL and not _alive(info):
        return {**info, "state": "lost", "reason": "its client ended without closing the pool"}
    return info


def _alive(info: Record) -> bool:
    if info.get("host") != socket.gethostname():
        return True  # another machine's: it cannot be told from here
    try:
        os.kill(int(info.get("pid", 0)), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, OverflowError):
        return True
    return True


def records(run_id: str, kind: str, after: int = 0, offset: int = 0) -> tuple[list[Record], int]:
    """The records of `kind` (`FILES`) in pool `run_id` numbered past `after`, read from byte
    `offset` on (where the last read stopped: 0 reads from the start), and where this read
    stopped. A file that shrank (its older half dropped) is read again from its start."""
    if kind not in FILES or run(run_id) is None:
        return [], 0
    found, offset = read_jsonl(history_dir() / run_id / f"{kind}.jsonl", offset)
    return [record for record in found if record.get("n", 0) > after], offset


def read_jsonl(path: Path, offset: int = 0) -> tuple[list[Record], int]:
    """The JSON objects of `path`'s whole lines from byte `offset` on (a line still being
    written waits for the next read), and the offset after them; a file shorter than `offset`
    (its older half dropped) is read from its start, a missing one is empty."""
    try:
        with path.open("rb") as handle:
            if offset > os.fstat(handle.fileno()).st_size:
                offset = 0
            handle.seek(offset)
            data = handle.read()
    except FileNotFoundError:
        return [], 0
    whole = data[: data.rfind(b"\n") + 1]
    found = []
    for line in whole.splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                found.append(record)
    return found, offset + len(whole)
