"""`sky.report`: metrics a running call sends to the client while it runs, and `Report`.

On a node, `report` checks the metrics, stamps them with the time and queues them; the agent's
sender thread (`Outbox`) takes the queue to the client in batches, so the call's thread never
waits on the wire. The client receives each one as a `Report` (`pool.reports`, `on_report`).

Imported by the agent on the node, so it uses the standard library only.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Metric = float | int | str
# What travels for one report: (time, metrics, checkpoint). Metric values are plain, except a
# JAX array that is read only when sent (`_Later`).
Entry = tuple[float, dict[str, Any], str | None]

# Reports per frame: a frame is pickled while holding the GIL, so a large backlog goes out in
# slices that each hold up the user's threads for well under a millisecond.
BATCH = 1000
# After a frame, the sender waits this long before the next: a burst of reports then costs a
# few frames a second, not one frame each.
INTERVAL_SECONDS = 0.05

_PLAIN = frozenset({float, int, str, bool})
_writing = threading.Lock()

_put: Callable[[Entry], None] | None = None  # set by the agent; None outside a node
_warned = False
# A script that `skyward run` starts is not the agent: its reports go, a JSON line each, to
# the pipe its agent reads (``skyward run``) or to its rank's file (a detached run's).
REPORTS_FD_ENV = "SKYWARD_REPORTS_FD"
REPORTS_FILE_ENV = "SKYWARD_REPORTS_FILE"


@dataclass(frozen=True, slots=True)
class Report:
    """One `sky.report` as the client receives it.

    `time` is the node's wall clock (``time.time()``) when `report` was called; `checkpoint` is
    the path the node gave, as a string on that node (nothing is copied). `rank` is the rank
    that reported (None: the node's only rank, which is the node).
    """

    node: int
    time: float
    metrics: dict[str, Metric]
    checkpoint: str | None = None
    rank: int | None = None

    @property
    def global_rank(self) -> int:
        """The rank that reported, counted over every node (the node, with one rank a node)."""
        return self.node if self.rank is None else self.rank

    @property
    def first_rank(self) -> bool:
        """Whether rank 0 (node 0's first rank) made it: the one the console shows."""
        return self.global_rank == 0


def report(
    metrics: Mapping[str, Metric], *, checkpoint: str | os.PathLike[str] | None = None
) -> None:
    """Send `metrics` (and a checkpoint path) to the client from a running call; returns at once.

    Keys are strings; values are ``float``, ``int``, ``bool`` or ``str``, or a scalar that
    converts to one: a numpy scalar or one-element array, ``tensor.item()``-style objects, and
    a one-element JAX array, which is read in the background, when the report is sent, so a
    training step is not made to wait for the device. Anything else raises `TypeError` naming
    the key, here and now. The metrics are copied: changing the mapping afterwards changes
    nothing. Reports of a call reach the client before that call's result.

    In a script that ``skyward run`` started (detached or not), the reports go to the run the
    same way. Outside a skyward node (in the client, in ``.local()``, or in a process the call
    starts on its node) this checks the metrics, warns once per process, and sends nothing.
    """
    clean = _checked(metrics)
    path = checkpoint if checkpoint is None or type(checkpoint) is str else _path(checkpoint)
    put = _put
    if put is None:
        put = script_sink()
        if put is None:
            _warn_outside()
            return
    put((time.time(), clean, path))


def script_sink() -> Callable[[Entry], None] | None:
    """Where a script's reports go (see `REPORTS_FD_ENV`), installed on its first report;
    None outside a script skyward started."""
    fd_text, file_name = os.environ.get(REPORTS_FD_ENV), os.environ.get(REPORTS_FILE_ENV)
    if fd_text:
        # "FD:INODE": a process the script started inherits the variable, not the pipe, and
        # its FD may be another file there.
        number, _, inode = fd_text.partition(":")
        try:
            fd = int(number)
            if os.fstat(fd).st_ino != int(inode):
                return None
        except (OSError, ValueError):
            return None
    elif file_name:
        fd = os.open(file_name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    else:
        return None

    def write(entry: Entry) -> None:
        stamp, metrics, path = entry
        plain = {k: v.value() if type(v) is _Later else v for k, v in metrics.items()}
        line = json.dumps({"time": stamp, "metrics": plain, "checkpoint": path}) + "\n"
        with _writing:  # one line at a time from the script's threads
            os.write(fd, line.encode())

    install(write)
    return write


def entry_of(line: bytes) -> Entry:
    """A report as a script's line carries it (`script_sink`); ValueError if it is not one."""
    data = json.loads(line)
    if not isinstance(data, dict) or not isinstance(data.get("metrics"), dict):
        raise ValueError(f"not a report: {line[:80]!r}")
    checkpoint = data.get("checkpoint")
    return float(data["time"]), data["metrics"], checkpoint if isinstance(checkpoint, str) else None


def _checked(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `metrics` with plain values; TypeError naming the first key that is not."""
    try:
        clean = dict(metrics)
    except (TypeError, ValueError):
        raise TypeError(
            f"sky.report takes a mapping of names to numbers, got {type(metrics).__name__}"
        ) from None
    for key, value in clean.items():
        if type(key) is not str:
            raise TypeError(f"sky.report: metric names must be str, got {key!r}")
        if type(value) not in _PLAIN:
            clean[key] = _plain(key, value)  # replaces a value: the dict's size does not change
    return clean


def _plain(key: str, value: Any) -> Any:
    """`value` as a plain float, int or str (or a `_Later` for a JAX array)."""
    if isinstance(value, float):  # numpy.float64 is one
        return float(value)
    if isinstance(value, int):  # an IntEnum: the client may not have its class
        return int(value)
    if isinstance(value, str):
        return str(value)
    if getattr(value, "size", None) == 1 and hasattr(value, "item"):
        if type(value).__module__.startswith(("jax", "jaxlib")):
            if "Tracer" in type(value).__name__:
                raise TypeError(
                    f"sky.report: metric {key!r} is a traced JAX value; report outside jax.jit"
                )
            return _Later(value)
        item = value.item()  # numpy and torch scalars: read now, they may be changed in place
        if type(item) in _PLAIN:
            return item
    raise TypeError(
        f"sky.report: metric {key!r} must be a float, int, bool or str (or a one-element numpy "
        f"or JAX array), got {type(value).__module__}.{type(value).__qualname__}"
    )


def _path(checkpoint: Any) -> str:
    try:
        path = os.fspath(checkpoint)
    except TypeError:
        raise TypeError(
            f"sky.report: checkpoint must be a path (str), got {type(checkpoint).__name__}"
        ) from None
    return path if isinstance(path, str) else os.fsdecode(path)


def _warn_outside() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "sky.report called outside a skyward node; ignored", UserWarning, stacklevel=3
        )


class _Later:
    """A JAX array reported as a metric: read (which waits for the device) only when sent."""

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array

    def value(self) -> Any:
        try:
            return self.array.item()
        except Exception as exc:  # e.g. its buffer was donated to a later step
            return f"<unreadable: {type(exc).__name__}: {exc}>"


class Outbox:
    """The node's queue of reports and the thread that sends it (one per agent).

    `put` is all a call's thread does: append to a deque and, when the sender sleeps, wake it.
    The sender sends what is queued in frames of at most `BATCH` reports, then rests for
    `INTERVAL_SECONDS`. `flush` sends the rest from the caller's thread, after any frame the
    sender is writing: the agent calls it before a call's result, so the client has the call's
    reports before its result.
    """

    def __init__(self, send: Callable[[list[Entry]], None]) -> None:
        self._send = send
        self.queue: collections.deque[Entry] = collections.deque()
        self._wake = threading.Event()
        self.sending = threading.Lock()  # held from taking a batch to having written it
        self._closed = False

    def put(self, entry: Entry) -> None:
        self.queue.append(entry)  # atomic under the GIL: no lock on the call's path
        if entry[2] is not None:
            # A checkpoint is what a restart resumes from: on the wire before `report` returns,
            # not up to `INTERVAL_SECONDS` later (a node stopped meanwhile would lose it).
            with contextlib.suppress(OSError):  # the client is gone: the watcher handles it
                self.flush()
        elif not self._wake.is_set():
            self._wake.set()

    def start(self) -> None:
        threading.Thread(target=self._run, name="skyward-reports", daemon=True).start()

    def flush(self) -> None:
        """Send everything queued so far; OSError when the client is gone."""
        # Nothing queued and no batch being written (one taken is written under the lock):
        # nothing to wait for. The common case after a call, so it takes no lock.
        if not self.queue and not self.sending.locked():
            return
        with self.sending:
            # Only what is queued now: a thread that keeps reporting must not keep us here.
            left = len(self.queue)
            while left and not self._closed:
                size = min(left, BATCH)
                self._send_batch(size)
                left -= size

    def _send_batch(self, size: int) -> None:
        queue = self.queue
        batch = [queue.popleft() for _ in range(size)]
        for i, (stamp, metrics, path) in enumerate(batch):
            if any(type(v) is _Later for v in metrics.values()):
                read = {k: v.value() if type(v) is _Later else v for k, v in metrics.items()}
                batch[i] = (stamp, read, path)
        try:
            self._send(batch)
        except OSError:
            self._closed = True  # the client is gone; the agent's watcher handles that
            raise
        except Exception as exc:  # a value that will not pickle: say so, send the rest
            print(f"[skyward] sky.report could not send metrics: {exc!r}", file=sys.stderr)

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()  # before taking the queue: a later put wakes us again
            try:
                self.flush()
            except OSError:
                return
            time.sleep(INTERVAL_SECONDS)


def install(put: Callable[[Entry], None] | None) -> None:
    """Route this process's reports to `put` (the agent's `Outbox.put`), or nowhere (None)."""
    global _put
    _put = put


def _forgotten_in_child() -> None:
    # A forked child has no sender thread: its reports would pile up unsent.
    install(None)


os.register_at_fork(after_in_child=_forgotten_in_child)
