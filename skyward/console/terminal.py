"""The live region at the bottom of a terminal: every running pool's node phases, redrawn in
place, with what is printed meanwhile scrolling above it.

One region a terminal (`Screen`), shared by the pools that show on it. A thread redraws it 4
times a second and writes the waiting lines in batches (at most 20 a second), so a node that
prints freely costs one write per batch, not a redraw per line. What a pool shows in it is its
own business (`skyward.console.console.Console` is a rich renderable); this module only draws it.
"""

from __future__ import annotations

import io
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import ClassVar, TextIO, cast

from rich.console import Console as RichConsole
from rich.console import ConsoleOptions, ConsoleRenderable, Group, RenderResult
from rich.live import Live
from rich.segment import Segment

from skyward.console.progress import logger
from skyward.console.rendering import Prefixes


class Screen:
    """One terminal's live region, shared by every pool that shows on it.

    Everything bound for the terminal while the region is up goes through one queue and one
    writer, in order: node lines, skyward's lines, and what the client's own code writes to
    ``sys.stdout``/``sys.stderr`` (replaced by `_Proxy` meanwhile, and logging handlers that
    hold the real streams are pointed at them). A raw write below the region would break its
    redraws, and a second writer could reorder lines.
    """

    REFRESH = 0.25  # seconds between redraws of the clocks
    BATCH = 0.05  # seconds between writes while lines arrive: batches of lines, few redraws
    BACKLOG = 20_000  # lines waiting past which a node's reader writes them itself (back-pressure)

    _screens: ClassVar[dict[int, Screen]] = {}
    _guard = threading.Lock()

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.rich = RichConsole(file=stream, highlight=False, soft_wrap=True)
        self.prefixes = Prefixes(stream)
        self.paint = self.prefixes.paint
        self.consoles: list[ConsoleRenderable] = []  # the pools shown, in the order they came
        self._pending: deque[str] = deque()
        self._wake = threading.Event()
        self._writing = threading.Lock()  # one writer of the terminal at a time
        self._life = threading.Lock()  # attach and detach, one at a time
        self._live: Live | None = None
        self._thread: threading.Thread | None = None
        self._swapped: list[tuple[logging.StreamHandler[TextIO], TextIO]] = []
        self._real: tuple[TextIO, TextIO] | None = None  # sys.stdout, sys.stderr while up
        self.stdout: TextIO | None = None  # our proxy, while it is sys.stdout

    @classmethod
    def of(cls, stream: TextIO) -> Screen:
        """The screen of the terminal behind `stream` (a `_Proxy` of ours unwrapped)."""
        real: TextIO = stream.real if isinstance(stream, _Proxy) else stream
        with cls._guard:
            screen = cls._screens.get(id(real))
            if screen is None or screen.stream is not real:
                screen = cls._screens[id(real)] = cls(real)
            return screen

    def attach(self, console: ConsoleRenderable) -> None:
        """Show `console`'s pool in the region, putting the region up for the first one."""
        with self._life, self._writing:
            self.consoles.append(console)
            if self._live is not None:
                return
            self._live = Live(
                _Region(self),
                console=self.rich,
                auto_refresh=False,  # our thread draws: the lines and the region together
                transient=True,  # the region goes at the end; what was printed above stays
                redirect_stdout=False,  # our own proxies do it, through the same queue
                redirect_stderr=False,
            )
            self._live.start(refresh=True)
            self._redirect()
            self._thread = threading.Thread(target=self._run, name="skyward-console", daemon=True)
            self._thread.start()

    def detach(self, console: ConsoleRenderable, last: str) -> None:
        """Take `console`'s pool off the region and print `last` (its teardown line)."""
        if last:
            self.write(last)
        with self._life:
            if console in self.consoles:
                self.consoles.remove(console)
            if self.consoles:
                self._flush()
                return
            self._restore()
            self._flush()  # everything queued, the region drawn one last time with it
            with self._writing:
                live, self._live = self._live, None
                thread, self._thread = self._thread, None
                self._wake.set()
                if live is not None:
                    live.stop()
        if thread is not None:
            thread.join(timeout=2)

    def write(self, text: str) -> None:
        """Whole lines (each ending in a newline) to print above the region."""
        self._pending.append(text)
        if len(self._pending) == 1:
            self._wake.set()
        elif len(self._pending) > self.BACKLOG:
            self._flush()  # the terminal is slower than the nodes: the reader waits for it

    def wake(self) -> None:
        """Redraw soon (a phase changed)."""
        self._wake.set()

    def _run(self) -> None:
        while self._live is not None:
            self._wake.wait(self.REFRESH)
            self._wake.clear()
            self._flush()
            time.sleep(self.BATCH)

    def _flush(self) -> None:
        """Write the waiting lines above the region and redraw it, once for the batch."""
        with self._writing:
            pending = self._pending
            text = "".join([pending.popleft() for _ in range(len(pending))])
            try:
                if self._live is None:
                    if text:  # the region is gone: straight to the terminal
                        self.stream.write(text)
                        self.stream.flush()
                elif text:
                    # Through rich, so its Live moves the cursor over the region first and
                    # redraws it after; `_Raw` hands it text already styled: nothing is parsed.
                    self.rich.print(_Raw(text), crop=False, soft_wrap=True)
                else:
                    self._live.refresh()
            except Exception:  # a closed or broken terminal must not kill a pool's reader
                logger.debug("the console could not draw", exc_info=True)

    def _redirect(self) -> None:
        out, err = self._real = (sys.stdout, sys.stderr)
        proxies = {id(real): cast(TextIO, _Proxy(self, real)) for real in (out, err)}
        self.stdout = proxies[id(out)]
        sys.stdout, sys.stderr = self.stdout, proxies[id(err)]
        for handler in _stream_handlers():
            proxy = proxies.get(id(handler.stream))
            if proxy is not None:
                self._swapped.append((handler, handler.stream))
                handler.setStream(proxy)

    def _restore(self) -> None:
        for handler, stream in self._swapped:
            handler.setStream(stream)
        self._swapped.clear()
        if self._real is not None:
            for proxy in (sys.stdout, sys.stderr):
                if isinstance(proxy, _Proxy):
                    proxy.flush()
            # Only our own proxies are put back: a stream someone set since stays theirs.
            if isinstance(sys.stdout, _Proxy):
                sys.stdout = self._real[0]
            if isinstance(sys.stderr, _Proxy):
                sys.stderr = self._real[1]
            self._real = self.stdout = None


class _Proxy(io.TextIOBase):
    """``sys.stdout`` or ``sys.stderr`` while a region is up: whole lines join the screen's
    queue (a partial line waits for its newline, or for `flush`)."""

    def __init__(self, screen: Screen, real: TextIO) -> None:
        super().__init__()
        self.real = real
        self._screen = screen
        self._partial = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            whole, newline, rest = (self._partial + text).rpartition("\n")
            self._partial = rest
        if newline:
            self._screen.write(whole + newline)
        return len(text)

    def flush(self) -> None:
        with self._lock:
            partial, self._partial = self._partial, ""
        if partial:
            self._screen.write(partial + "\n")  # the region needs the cursor at a line start

    def isatty(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.real.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.real.encoding


class _Region:
    """The live region: every attached pool's summary and node lines, drawn fresh each time."""

    def __init__(self, screen: Screen) -> None:
        self._screen = screen

    def __rich_console__(self, console: RichConsole, options: ConsoleOptions) -> RenderResult:
        yield Group(*self._screen.consoles)


class _Raw:
    """Text already styled (ANSI), handed to rich as one segment."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __rich_console__(self, console: RichConsole, options: ConsoleOptions) -> RenderResult:
        yield Segment(self.text)


def _stream_handlers() -> Iterator[logging.StreamHandler[TextIO]]:
    """The handlers of the root and ``skyward`` loggers that write to a stream."""
    seen: set[int] = set()
    for name in (None, "skyward"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and id(handler) not in seen:
                seen.add(id(handler))
                yield handler
