"""What the user sees of a pool: where each node is, what the nodes print, skyward's own lines.

The way is chosen when the pool starts:

- live: stdout and stderr are a terminal, ``stream_output=True`` and ``SKYWARD_QUIET`` unset.
  A rich `Live` region at the bottom of the terminal holds a summary line and one line per node
  (its phase, the time in it, a detail: uv's last line, the plugin hook, node 0's latest
  `sky.report`). Node output and skyward's messages scroll above it. One region per terminal
  (`_Screen`), shared by the pools running at once; a thread redraws it 4 times a second and
  writes the nodes' lines in batches (at most 20 a second), so a node that prints freely costs
  one write per batch, not a redraw per line.
- plain: anything else (a file, a pipe, a CI log, ``stream_output=False``). One line per
  change, never redrawn: skyward's on stderr, node lines on stdout, each line one write, so
  lines are never interleaved mid-line. ``stream_output=False`` prints no node output.
- notebook: an IPython kernel runs the pool (Jupyter). What comes while a pool operation runs
  (a call, `start`, `close`) goes to one display in the cell that runs it, updated as it grows:
  node lines, and the pool's status line replaced in place (`skyward.notebook`).
- quiet (``SKYWARD_QUIET=1``): none of skyward's own lines; node output as in plain (or as in
  a notebook).

Whatever is shown, every phase and message is a `logging` record on the ``skyward`` logger
(`skyward.progress`). What a node prints is not: it is kept by the pool (``pool.logs()``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, TextIO, cast

from rich.console import Console as RichConsole
from rich.console import ConsoleOptions, Group, RenderResult
from rich.live import Live
from rich.segment import Segment
from rich.table import Column, Table
from rich.text import Text

from skyward.notebook import Notebook, kernel
from skyward.progress import Phase, Progress, logger
from skyward.reports import Report

_NODE_STYLES = ("cyan", "magenta", "green", "yellow", "blue", "red")
_PHASE_STYLES = {Phase.READY: "green", Phase.RUNNING: "bold cyan", Phase.LOST: "bold red"}
# Past this many nodes a pool's region lists the first ones and counts the rest by phase.
MAX_ROWS = 16
QUIET_ENV = "SKYWARD_QUIET"

# What a node is doing beyond what it was told, seen when the region is drawn: a call in
# flight (running), a plugin hook, a dead agent. Polled, so the calls themselves pay nothing.
Activity = Callable[[int], tuple[Phase, str] | None]


def quiet() -> bool:
    """Whether ``SKYWARD_QUIET`` asks skyward to print none of its own lines."""
    return os.environ.get(QUIET_ENV, "").strip().lower() not in ("", "0", "false", "no")


@dataclass
class _Node:
    phase: Phase
    since: float  # time.monotonic() when it entered `phase`
    detail: str = ""
    shown: Phase | None = None  # the phase the region showed last (running is seen, not told)
    shown_since: float = 0.0


class Console(Progress):
    """One pool's console: the `Progress` its provider reports to, and its nodes' output."""

    def __init__(
        self, name: str = "pool", nodes: int = 1, provider: str = "", stream_output: bool = True
    ) -> None:
        self.name = name
        self.provider = provider
        self.stream_output = stream_output
        self.activity: Activity | None = None
        self.latest: Report | None = None  # node 0's last report, shown on its line
        self._quiet = quiet()
        self._lock = threading.Lock()
        self._began = time.monotonic()
        self._wave = self._began  # when nodes were last requested: "ready in 3.1 s" counts from it
        self._nodes = [_Node(Phase.REQUESTED, self._began) for _ in range(nodes)]
        self._screen: _Screen | None = None
        self.notebook: Notebook | None = None  # set by `start` in a Jupyter kernel
        self._out: TextIO | None = None  # the stream the node prefixes below were made for
        self._prefixes: list[str] = []

    # -- the pool's lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        """Choose the way to show the pool (live region, notebook or plain lines) and say it is
        launching."""
        self._began = self._wave = time.monotonic()
        if kernel() is not None:
            self.notebook = Notebook()
        elif self.stream_output and not self._quiet and _terminal(sys.stdout, sys.stderr):
            self._screen = _Screen.of(sys.stdout)
            self._screen.attach(self)
        self.phase(None, Phase.REQUESTED)

    def calling(self) -> contextlib.AbstractContextManager[None]:
        """Around a pool operation the caller's thread waits for: in a notebook, what the pool
        shows meanwhile goes to the caller's cell."""
        return self.notebook.calling() if self.notebook is not None else contextlib.nullcontext()

    def finish(self, summary: str | None) -> None:
        """The pool is gone: take its region away and print `summary` (the teardown) last."""
        line = f"{self.name}: {summary}" if summary else None
        if line:
            logger.info("%s", line)
        screen, self._screen = self._screen, None
        if screen is not None:
            screen.detach(self, self._styled_status(line, screen) if line else "")
        elif line:
            self._say(line)

    # -- Progress ----------------------------------------------------------------------------

    def __call__(self, message: str) -> None:
        self.status(message)

    def status(self, message: str) -> None:
        """A message of the pool's: printed above the region (live) or as a line on stderr."""
        line = f"{self.name}: {message}"
        logger.info("%s", line)
        self._say(line)

    def phase(self, node: int | None, phase: Phase, detail: str = "") -> None:
        now = time.monotonic()
        with self._lock:
            for index in self._indices(node):
                self._nodes[index] = _Node(phase, now, detail)
            if phase is Phase.REQUESTED:
                self._wave = now
        line = f"{self.name}: {self._describe(node, phase, detail, now)}"
        logger.info("%s", line)
        screen = self._screen
        if screen is not None:
            screen.wake()
            if phase is Phase.READY and node is None:
                self._say(line)  # the start-up time stays in the scrollback
        else:
            self._say(line)

    def detail(self, node: int | None, line: str) -> None:
        logger.debug("%s: %s: %s", self.name, "every node" if node is None else node, line)
        text = line.strip()
        if text:
            with self._lock:
                for index in self._indices(node):
                    self._nodes[index].detail = text
        if self._screen is not None or self._quiet:
            return
        where = "" if node is None else f"node {node}: "
        if self.notebook is not None:
            if text:  # after the phase, in the status line: one line per build, not hundreds
                self.notebook.status(f"[skyward] {self.name}: {where}{text}")
        else:
            _write_line(sys.stderr, f"[skyward build] {where}{line}")

    # -- node output and reports -------------------------------------------------------------

    def node_line(self, node: int, line: str) -> None:
        """One line a node printed, with its node's prefix (in colour on a terminal)."""
        if not self.stream_output:
            return
        if self.notebook is not None:
            self.notebook.line(node, line)
            return
        screen = self._screen
        if screen is not None and sys.stdout is screen.stdout:
            if "\r" in line:  # a progress bar redrawn in place: what a terminal would show
                line = line.rsplit("\r", 1)[-1]
            screen.write(f"{screen.prefix(node)}{line}\n")
            return
        out = sys.stdout  # as it is now: a redirect_stdout() inside the pool's block wins
        if out is not self._out:
            self._out, self._prefixes = out, []
        while len(self._prefixes) <= node:
            self._prefixes.append(_node_prefix(len(self._prefixes), _painter(out)))
        out.write(f"{self._prefixes[node]}{line}\n")  # one write a line: never mid-line

    def node_partial(self, node: int, text: str) -> None:
        """What a node printed of a line since its last ``\\r`` (a progress bar redrawn in
        place): a notebook redraws the line now; elsewhere the whole line is shown when its
        newline comes."""
        if self.stream_output and self.notebook is not None:
            self.notebook.partial(node, text)

    def report(self, report: Report) -> None:
        """Note a node's `sky.report`: node 0's latest is shown on its line (never printed: a
        line per report would drown the nodes' own lines)."""
        if report.node == 0:
            self.latest = report

    # -- the region --------------------------------------------------------------------------

    def __rich_console__(self, console: RichConsole, options: ConsoleOptions) -> RenderResult:
        now = time.monotonic()
        with self._lock:
            rows = [self._seen(index, node, now) for index, node in enumerate(self._nodes)]
        counts: dict[Phase, int] = {}
        for _, phase, _, _ in rows:
            counts[phase] = counts.get(phase, 0) + 1
        tally = ", ".join(f"{n} {p.value}" for p, n in sorted(counts.items(), key=_order))
        yield Text.assemble(
            ("skyward ", "bold"),
            (self.name, "bold"),
            f"  {self.provider}  {len(rows)} node(s): {tally}  ",
            (_clock(now - self._began), "dim"),
        )
        table = Table.grid(
            Column(no_wrap=True),
            Column(no_wrap=True),
            Column(no_wrap=True, justify="right"),
            Column(no_wrap=True, overflow="ellipsis"),
            padding=(0, 2),
        )
        shown = rows if len(rows) <= MAX_ROWS else rows[: MAX_ROWS - 1]
        for index, phase, elapsed, detail in shown:
            table.add_row(
                Text(f"  node {index}", style=_NODE_STYLES[index % len(_NODE_STYLES)]),
                Text(phase.value, style=_PHASE_STYLES.get(phase, "yellow")),
                Text(_clock(elapsed), style="dim"),
                Text(detail, style="dim"),
            )
        if len(shown) < len(rows):
            rest: dict[Phase, int] = {}
            for _, phase, _, _ in rows[len(shown) :]:
                rest[phase] = rest.get(phase, 0) + 1
            more = ", ".join(f"{n} {p.value}" for p, n in sorted(rest.items(), key=_order))
            table.add_row(Text(f"  +{len(rows) - len(shown)} more", style="dim"), more, "", "")
        yield table

    def _seen(self, index: int, node: _Node, now: float) -> tuple[int, Phase, float, str]:
        """Node `index` as the region shows it now: (index, phase, seconds in it, detail)."""
        phase, detail = node.phase, node.detail
        if self.activity is not None and phase in (Phase.STARTING, Phase.READY):
            seen = self.activity(index)
            if seen is not None:
                phase, detail = seen
        if phase is not node.shown:
            # Told phases count from when they were told; seen ones from when first drawn.
            node.shown_since = node.since if node.shown is None else now
            node.shown = phase
        if index == 0 and self.latest is not None and phase in (Phase.READY, Phase.RUNNING):
            detail = _metrics(self.latest)
        return index, phase, now - node.shown_since, detail

    # -- helpers -----------------------------------------------------------------------------

    def _indices(self, node: int | None) -> Sequence[int]:
        if node is None:
            return range(len(self._nodes))
        while len(self._nodes) <= node:  # a provider may report before the pool knew (safety)
            self._nodes.append(_Node(Phase.REQUESTED, time.monotonic()))
        return (node,)

    def _describe(self, node: int | None, phase: Phase, detail: str, now: float) -> str:
        """The change in words: the plain line and the logging record."""
        count = len(self._nodes)
        if node is None and phase is Phase.REQUESTED:
            return f"launching {count} node(s) on {self.provider}"
        if node is None and phase is Phase.READY:
            return f"ready: {count} node(s) in {duration(now - self._wave)} s"
        if node is None and phase is Phase.STOPPING:
            return "stopping"
        who = (f"all {count} nodes" if count > 1 else "node 0") if node is None else f"node {node}"
        return f"{who} {phase.value}" + (f" ({detail})" if detail else "")

    def _say(self, line: str) -> None:
        """A line of skyward's: above the region, in the cell's status or on stderr."""
        screen = self._screen
        if screen is not None:
            screen.write(self._styled_status(line, screen))
        elif self._quiet:
            return
        elif self.notebook is not None:
            self.notebook.status(f"[skyward] {line}")
        else:
            _write_line(sys.stderr, f"[skyward] {line}")

    def _styled_status(self, line: str, screen: _Screen) -> str:
        return screen.paint(f"[skyward] {line}", "dim") + "\n"


class _Screen:
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

    _screens: ClassVar[dict[int, _Screen]] = {}
    _guard = threading.Lock()

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.rich = RichConsole(file=stream, highlight=False, soft_wrap=True)
        self.paint = _painter(stream)
        self.consoles: list[Console] = []
        self._pending: deque[str] = deque()
        self._wake = threading.Event()
        self._writing = threading.Lock()  # one writer of the terminal at a time
        self._life = threading.Lock()  # attach and detach, one at a time
        self._live: Live | None = None
        self._thread: threading.Thread | None = None
        self._prefixes: list[str] = []
        self._swapped: list[tuple[logging.StreamHandler[TextIO], TextIO]] = []
        self._real: tuple[TextIO, TextIO] | None = None  # sys.stdout, sys.stderr while up
        self.stdout: TextIO | None = None  # our proxy, while it is sys.stdout

    @classmethod
    def of(cls, stream: TextIO) -> _Screen:
        """The screen of the terminal behind `stream` (a `_Proxy` of ours unwrapped)."""
        real: TextIO = stream.real if isinstance(stream, _Proxy) else stream
        with cls._guard:
            screen = cls._screens.get(id(real))
            if screen is None or screen.stream is not real:
                screen = cls._screens[id(real)] = _Screen(real)
            return screen

    def attach(self, console: Console) -> None:
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

    def detach(self, console: Console, last: str) -> None:
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

    def prefix(self, node: int) -> str:
        while len(self._prefixes) <= node:
            self._prefixes.append(_node_prefix(len(self._prefixes), self.paint))
        return self._prefixes[node]

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

    def __init__(self, screen: _Screen, real: TextIO) -> None:
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

    def __init__(self, screen: _Screen) -> None:
        self._screen = screen

    def __rich_console__(self, console: RichConsole, options: ConsoleOptions) -> RenderResult:
        yield Group(*self._screen.consoles)


class _Raw:
    """Text already styled (ANSI), handed to rich as one segment."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __rich_console__(self, console: RichConsole, options: ConsoleOptions) -> RenderResult:
        yield Segment(self.text)


def _terminal(*streams: TextIO) -> bool:
    if os.environ.get("TERM") == "dumb":
        return False
    try:
        return all(stream.isatty() for stream in streams)
    except (AttributeError, ValueError):
        return False


def _painter(stream: TextIO) -> Callable[[str, str], str]:
    """A function that returns text in a style as `stream` should get it: ANSI on a terminal
    (unless NO_COLOR), the text itself anywhere else."""
    target = RichConsole(file=stream)
    if not _terminal(stream) or target.no_color or target.color_system is None:
        return lambda text, style: text
    painter = RichConsole(
        file=io.StringIO(), force_terminal=True, color_system="standard", highlight=False
    )

    def paint(text: str, style: str) -> str:
        with painter.capture() as captured:
            painter.print(Text(text, style=style), end="")
        return captured.get()

    return paint


def _node_prefix(node: int, paint: Callable[[str, str], str]) -> str:
    return paint(f"(node {node})", _NODE_STYLES[node % len(_NODE_STYLES)]) + " "


def _write_line(stream: TextIO, line: str) -> None:
    stream.write(line + "\n")  # one write a line: never interleaved mid-line
    stream.flush()


def _stream_handlers() -> Iterator[logging.StreamHandler[TextIO]]:
    """The handlers of the root and ``skyward`` loggers that write to a stream."""
    seen: set[int] = set()
    for name in (None, "skyward"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and id(handler) not in seen:
                seen.add(id(handler))
                yield handler


def _order(item: tuple[Phase, int]) -> int:
    return list(Phase).index(item[0])


def _clock(seconds: float) -> str:
    whole = int(max(seconds, 0))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def duration(seconds: float) -> str:
    """Seconds for a status line: ``0.04``, ``3.1``, ``38``."""
    if seconds < 1:
        return f"{seconds:.2f}"
    return f"{seconds:.1f}" if seconds < 10 else f"{seconds:.0f}"


def _metrics(report: Report) -> str:
    """A report's metrics in a few words: ``loss=0.3127 step=120``."""
    words = []
    for key, value in list(report.metrics.items())[:8]:
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        words.append(f"{key}={shown}")
    return " ".join(words)
