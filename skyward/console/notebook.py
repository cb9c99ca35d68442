"""A pool's output in a Jupyter notebook: in the cell that made the call, as one growing display.

A kernel runs a cell on its main thread, but the nodes' output reaches the client on skyward's
own threads, and ipykernel sends what a thread prints to whichever cell its bookkeeping names
(the cell that started the thread, the last one run, or none): not the cell that is waiting for
the call. So while the caller's thread is blocked in a pool operation (`Notebook.calling`: a
call, `start`, `close`), the nodes' lines and the pool's status go into one display in the
caller's cell (``display(..., display_id=True)``, then ``update`` as text grows). The display is
made and updated in a copy of the caller's `contextvars` context: ipykernel keeps the cell a
message belongs to (its parent header) in a context variable, so the messages name the caller's
cell whichever thread sends them.

What a view shows: the node lines, prefixed ``(node i)``, the last `LINES` of them (all are in
``pool.logs()``), and under them the pool's latest status line, replaced in place. A line a
node redraws with ``\\r`` (a progress bar) is replaced in place too, as it arrives. Updates are
sent at most every `INTERVAL` seconds, and once more when the operation ends. Calls of one cell
share its view. Lines that arrive while no operation runs (a `submit`'s output read between
cells, a node that dies meanwhile) are kept for the next view, the last `LINES` of them, and
so is the latest status.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, cast

LINES = 500  # node lines a view keeps: a chatty job must not make the notebook huge
INTERVAL = 0.1  # seconds between updates of a view: each sends its whole text


class _Handle(Protocol):
    def update(self, obj: object, *, raw: bool) -> None: ...


def kernel() -> Any | None:
    """The IPython kernel's shell this process runs in, or None.

    Only an IPython already imported is looked at (a kernel imports it before any cell runs):
    skyward does not depend on IPython, and importing it costs a second elsewhere."""
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    shell = get() if get is not None else None
    # A terminal IPython has no kernel: it is a terminal, and gets the live region.
    return shell if getattr(shell, "kernel", None) is not None else None


@dataclass(slots=True)
class _Line:
    text: str


class _View:
    """One cell's display: its node lines and the pool's status, sent as one text."""

    def __init__(self, cell: object, context: contextvars.Context, held: list[str]) -> None:
        self.cell = cell  # the id of the request the cell ran as (its parent header's msg_id)
        self.context = context  # the caller's: its messages go to its cell
        self.lines: deque[_Line] = deque((_Line(text) for text in held), maxlen=LINES)
        self.count = len(self.lines)  # lines ever added: past LINES, the first are gone
        self.redrawn: dict[int, _Line] = {}  # per node, its line a \r redraws, until its \n
        self.status = ""
        self.handle: _Handle | None = None
        self.shown = ""  # the text last sent
        self.sent = 0.0  # time.monotonic() of the last update
        self.timer: threading.Timer | None = None

    def add(self, text: str) -> _Line:
        line = _Line(text)
        self.lines.append(line)
        self.count += 1
        return line

    def text(self) -> str:
        shown = [line.text for line in self.lines]
        if self.count > len(shown):
            shown.insert(0, f"[skyward] ... {self.count - len(shown)} earlier lines: pool.logs()")
        if self.status:
            shown.append(self.status)
        return "\n".join(shown)


class Notebook:
    """Where one pool's console shows in a notebook (see the module's docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the view's text, and its updates in order
        self._view: _View | None = None  # the last cell's view, current while `_depth` > 0
        self._depth = 0  # operations running now (a cell's threads may call at once)
        self._held: deque[str] = deque(maxlen=LINES)  # lines that came while none ran
        self._status = ""  # the status that came while none ran: the next view's

    @contextlib.contextmanager
    def calling(self, drain: Callable[[], None] | None = None) -> Iterator[None]:
        """The caller's thread runs a pool operation: show what comes meanwhile in its cell.

        `drain` is run at the end, before the last update: it lets the pool read what the
        nodes printed before they replied (output travels apart from results)."""
        cell = _cell()
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                held, self._held = list(self._held), deque(maxlen=LINES)
                view = self._view
                if view is None or view.cell != cell or cell is None:
                    view = self._view = _View(cell, contextvars.copy_context(), held)
                else:  # the same cell's next call: its view grows on
                    for text in held:
                        view.add(text)
                if self._status:
                    view.status, self._status = self._status, ""
        try:
            yield
        finally:
            if drain is not None:
                with contextlib.suppress(Exception):  # a pool already closed has none to read
                    drain()
            with self._lock:
                self._depth -= 1
                if self._view is not None and self._depth == 0:
                    self._send(self._view)

    def line(self, node: int, text: str, who: str | None = None) -> None:
        """A whole line node `node` printed (with its ``\\r`` redraws, if any); `who` names
        the rank in its prefix (``node 1 rank 3``) where `node` is a rank of several."""
        shown = f"({who or f'node {node}'}) {text.rsplit(chr(13), 1)[-1]}"
        with self._lock:
            view = self._current()
            if view is None:
                self._held.append(shown)
                return
            redrawn = view.redrawn.pop(node, None)
            if redrawn is not None:
                redrawn.text = shown
            else:
                view.add(shown)
            self._changed(view)

    def partial(self, node: int, text: str, who: str | None = None) -> None:
        """What node `node` has printed of a line since its last ``\\r``: the line so far
        (`who`: as for `line`)."""
        shown = f"({who or f'node {node}'}) {text}"
        with self._lock:
            view = self._current()
            if view is None:
                return  # the whole line will come: it is what is kept
            redrawn = view.redrawn.get(node)
            if redrawn is not None:
                redrawn.text = shown
            else:
                view.redrawn[node] = view.add(shown)
            self._changed(view)

    def status(self, line: str) -> None:
        """The pool's status now (``[skyward] pool-x: ready ...``): it replaces the last."""
        with self._lock:
            view = self._current()
            if view is None:
                self._status = line
                return
            view.status = line
            self._changed(view)

    def _current(self) -> _View | None:
        return self._view if self._depth > 0 else None

    def _changed(self, view: _View) -> None:
        """Send `view` now if the last update is old enough, else once it is."""
        wait = view.sent + INTERVAL - time.monotonic()
        if wait <= 0:
            self._send(view)
        elif view.timer is None:
            view.timer = threading.Timer(wait, self._send_later, (view,))
            view.timer.daemon = True
            view.timer.start()

    def _send_later(self, view: _View) -> None:
        with self._lock:
            view.timer = None
            self._send(view)

    def _send(self, view: _View) -> None:
        """Show `view`'s text in its cell (made on the first text); under the lock."""
        if view.timer is not None:
            view.timer.cancel()
            view.timer = None
        text = view.text()
        if text == view.shown:  # nothing new (the update at the end, after a timely one)
            return
        view.sent, view.shown = time.monotonic(), text
        bundle = {"text/plain": text}
        try:
            if view.handle is None:
                view.handle = view.context.run(_display, bundle)
            else:
                view.context.run(view.handle.update, bundle, raw=True)
        except Exception:  # a kernel going away must not break the pool's reader
            from skyward.console.progress import logger

            logger.debug("the notebook display failed", exc_info=True)


def _display(bundle: dict[str, str]) -> _Handle:
    from IPython.display import display

    return cast(_Handle, display(bundle, raw=True, display_id=True))  # type: ignore[no-untyped-call]


def _cell() -> object:
    """Which cell the calling thread runs (the msg_id of its request), or None if unknown."""
    shell = kernel()
    publisher = getattr(shell, "display_pub", None)
    header = getattr(publisher, "parent_header", None)
    return header.get("msg_id") if isinstance(header, dict) else None
