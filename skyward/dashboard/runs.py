"""What the dashboard lists and shows: the pools in the history and the detached runs.

A pool is read from its history (`skyward.history`), written by the script that ran it. A
detached run is read as ``skyward status`` and ``skyward logs`` read it (`sky.Run`): a thread
looks at every run not known to have ended every `REFRESH_SECONDS`, so the list answers at
once however slow a node is to reach; its lines are read when its page asks for them, and its
``sky.report`` metrics from each rank's ``reports.jsonl`` where its directories are on this
machine (Local runs, and Slurm runs in the cache the login node shares).

Both kinds are described the same way, a `Row`: what the list shows of a run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from skyward import history
from skyward.detached import record
from skyward.detached.run import Run, RunStatus

REFRESH_SECONDS = 2.0
KEPT_LINES = 20_000  # a detached run's lines the dashboard holds, per run
KINDS = ("pool", "detached")
Row = dict[str, Any]


class Runs:
    """Every run the page may show, by kind and id; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._detached: dict[str, _Detached] = {}
        self._done = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="skyward-dashboard", daemon=True)

    def start(self) -> None:
        self._refresh()
        self._watcher.start()

    def close(self) -> None:
        self._done.set()
        with self._lock:
            views = list(self._detached.values())
        for view in views:
            view.close()

    # -- the list

    def listing(self) -> list[Row]:
        """Every run, newest first."""
        now = time.time()
        rows = [_pool_row(info, now) for info in history.runs()]
        with self._lock:
            rows += [view.row for view in self._detached.values() if view.row]
        return sorted(rows, key=lambda row: row["started"] or 0, reverse=True)

    def row(self, kind: str, run_id: str) -> Row | None:
        if kind == "pool":
            info = history.run(run_id)
            return None if info is None else _pool_row(info, time.time())
        view = self._view(run_id)
        return None if view is None else view.row

    # -- a run's page

    def records(self, kind: str, run_id: str, what: str, after: int) -> list[Row]:
        """A run's events, metrics or output lines (`history.FILES`) numbered past `after`."""
        if kind == "pool":
            found, _ = history.records(run_id, what, after)
            return found
        view = self._view(run_id)
        return [] if view is None else view.records(what, after)

    def stop(self, kind: str, run_id: str) -> str:
        """Stop a running run; what was done, in words. A pool is stopped as its script's
        Ctrl-C would: SIGTERM to the script, whose ``with`` block then removes its nodes."""
        row = self.row(kind, run_id)
        if row is None:
            raise LookupError(f"no {kind} {run_id!r}")
        if kind == "pool":
            if row["state"] in history.FINAL:
                return f"{row['name']} has ended already ({row['state']})"
            info = history.run(run_id) or {}
            if info.get("host") != socket.gethostname():
                raise PermissionError(f"{row['name']} runs on {info.get('host')}, not here")
            os.kill(int(info["pid"]), signal.SIGTERM)
            return f"{row['name']}: its script (pid {info['pid']}) was sent SIGTERM"
        view = self._view(run_id)
        assert view is not None
        return view.stop()

    # -- detached runs

    def _view(self, name: str) -> _Detached | None:
        with self._lock:
            view = self._detached.get(name)
        if view is None and record.exists(name):
            self._refresh()
            with self._lock:
                view = self._detached.get(name)
        return view

    def _watch(self) -> None:
        while not self._done.wait(REFRESH_SECONDS):
            with contextlib.suppress(Exception):  # a broken record must not stop the watch
                self._refresh()

    def _refresh(self) -> None:
        """Read the records again and ask every run not known to have ended how it stands."""
        records = {r.name: r for r in record.all_records()}
        with self._lock:
            for name in list(self._detached):
                if name not in records:  # forgotten (`skyward status --forget`)
                    self._detached.pop(name).close()
            for name, rec in records.items():
                if name not in self._detached:
                    self._detached[name] = _Detached(rec)
            live = [view for view in self._detached.values() if not view.ended]
        if live:
            with ThreadPoolExecutor(max_workers=min(8, len(live))) as pool:
                list(pool.map(_Detached.look, live))


def _pool_row(info: history.Record, now: float) -> Row:
    ended = info.get("ended")
    started = info.get("started") or now
    return {
        "kind": "pool",
        "id": info["id"],
        "name": info.get("name") or info["id"],
        "provider": info.get("provider", ""),
        "nodes": info.get("nodes", 0),
        "ranks_per_node": info.get("ranks_per_node", 1),
        "state": info.get("state", ""),
        "reason": info.get("reason", ""),
        "started": started,
        "duration": (ended or now) - started,
        "per_hour": info.get("per_hour"),
        "cost": info.get("cost"),
        "script": info.get("script", ""),
    }


class _Detached:
    """One detached run as the dashboard follows it: its status, lines, events and metrics."""

    def __init__(self, rec: record.RunRecord) -> None:
        self.record = rec
        self.row: Row = {}
        self.ended = False
        self._lock = threading.Lock()
        self._run: Run | None = None
        self._lines: deque[Row] = deque(maxlen=KEPT_LINES)
        self._events: list[Row] = []
        self._metrics: list[Row] = []
        self._report_offsets: dict[int, int] = {}
        self._count = {"output": 0, "events": 0, "metrics": 0}
        self._said = ""
        self._event(rec.created_at, f"started on {rec.nodes} {rec.provider} node(s): {rec.script}")

    def _opened(self) -> Run:
        if self._run is None:
            self._run = Run(self.record.name)
        return self._run

    def close(self) -> None:
        with self._lock:
            if self._run is not None:
                self._run.close()
                self._run = None

    def look(self) -> None:
        """Ask the run how it stands (a node out of reach is said so in its row)."""
        with self._lock:
            try:
                status: RunStatus | str = self._opened().status()
            except Exception as exc:
                status = f"unreachable ({type(exc).__name__}: {exc})"
            self.row = self._row(status)
            reason = self.row["reason"]
            said = f"{self.row['state']}: {reason}" if reason else self.row["state"]
            if said != self._said:
                self._said = said
                self._event(time.time(), said)
            if isinstance(status, RunStatus) and status.ended:
                self.ended = True

    def _row(self, status: RunStatus | str) -> Row:
        rec = self.record
        per_hour = None if rec.price_per_hour is None else rec.price_per_hour * rec.nodes
        row: Row = {
            "kind": "detached",
            "id": rec.name,
            "name": rec.name,
            "provider": rec.provider,
            "nodes": rec.nodes,
            "ranks_per_node": rec.ranks_per_node,
            "started": rec.created_at,
            "per_hour": per_hour,
            "script": " ".join([rec.script, *rec.args]),
        }
        if isinstance(status, str):
            return {**row, "state": "unreachable", "reason": status, "duration": None, "cost": None}
        if status.state == "failed" and status.rank is not None:
            where = rec.rank_label(status.rank)
            reason = f"{where}: {status.reason}" if status.reason else where
        else:
            reason = status.reason
        return {
            **row,
            "state": status.state,
            "reason": reason,
            "started": status.started_at,
            "duration": status.duration,
            "cost": status.cost,
        }

    def records(self, what: str, after: int) -> list[Row]:
        with self._lock:
            if what == "output":
                self._read_lines()
                kept: list[Row] = list(self._lines)
            elif what == "metrics":
                self._read_reports()
                kept = self._metrics
            else:
                kept = self._events
            return [r for r in kept if r["n"] > after]

    def stop(self) -> str:
        with self._lock:
            status = self._opened().stop()
        self.look()
        return f"{self.record.name}: {status.state}"

    def _read_lines(self) -> None:
        try:
            lines = self._opened().new_lines()
        except Exception as exc:  # out of reach now: the page shows what it had
            self._event(time.time(), f"its lines could not be read: {exc}")
            return
        now = time.time()
        for who, line in lines:
            self._count["output"] += 1
            self._lines.append({"n": self._count["output"], "time": now, "who": who, "line": line})

    def _read_reports(self) -> None:
        """What each rank's ``reports.jsonl`` gained (where its directory is on this machine)."""
        rec = self.record
        # Local's directories are this machine's; a Slurm run's are in the cache the login
        # node shares with the nodes. Other runs' reports stay on their nodes.
        if rec.kind not in ("local", "slurm"):
            return
        for rank, directory in enumerate(rec.directories):
            path = Path(directory) / "reports.jsonl"
            try:
                entries, self._report_offsets[rank] = history.read_jsonl(
                    path, self._report_offsets.get(rank, 0)
                )
            except OSError:  # not readable now: the next look tries again
                continue
            for entry in entries:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    self._count["metrics"] += 1
                    found: Row = {
                        "n": self._count["metrics"],
                        "time": float(entry["time"]),
                        "who": rec.rank_label(rank),
                        "node": rank // rec.ranks_per_node,
                        "rank": rank,
                        "metrics": dict(entry["metrics"]),
                    }
                    if entry.get("checkpoint"):
                        found["checkpoint"] = entry["checkpoint"]
                    self._metrics.append(found)

    def _event(self, at: float, text: str) -> None:
        self._count["events"] += 1
        self._events.append({"n": self._count["events"], "time": at, "text": text})
