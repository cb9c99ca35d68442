"""What the user sees of a pool: where each node is, what the nodes print, skyward's own lines.

The way is chosen when the pool starts:

- live: stdout and stderr are a terminal, ``stream_output=True`` and ``SKYWARD_QUIET`` unset.
  A rich `Live` region at the bottom of the terminal holds a summary line and one line per node
  (its phase, the time in it, a detail: uv's last line, the plugin hook, node 0's latest
  `sky.report`). Node output and skyward's messages scroll above it. One region per terminal
  (`skyward.console.terminal`), shared by the pools running at once.
- plain: anything else (a file, a pipe, a CI log, ``stream_output=False``). One line per
  change, never redrawn: skyward's on stderr, node lines on stdout, each line one write, so
  lines are never interleaved mid-line. ``stream_output=False`` prints no node output.
- notebook: an IPython kernel runs the pool (Jupyter). What comes while a pool operation runs
  (a call, `start`, `close`) goes to one display in the cell that runs it, updated as it grows:
  node lines, and the pool's status line replaced in place (`skyward.console.notebook`).
- quiet (``SKYWARD_QUIET=1``): none of skyward's own lines; node output as in plain (or as in
  a notebook).

Whatever is shown, every phase and message is a `logging` record on the ``skyward`` logger
(`skyward.console.progress`). What a node prints is not: it is kept by the pool (``pool.logs()``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

from rich.console import Console as RichConsole
from rich.console import ConsoleOptions, RenderResult

from skyward.console.notebook import Notebook, kernel
from skyward.console.progress import Phase, Progress, logger
from skyward.console.rendering import (
    Prefixes,
    Row,
    is_terminal,
    metrics,
    node_table,
    summary,
    who,
)
from skyward.console.terminal import Screen
from skyward.cost import Price
from skyward.history import Recorder
from skyward.reports import Report

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
        # The ranks each node holds: lines come by rank and are prefixed with node and rank.
        self.ranks_per_node = 1
        # What the pool has spent so far, in words, for the region's first line ("" = nothing).
        self.spending: Callable[[], str] | None = None
        # Where a node's grant goes (the pool's bill): see `Progress.granted`.
        self.billing: Callable[[int, Price | None, float | None], None] | None = None
        self.latest: Report | None = None  # node 0's last report, shown on its line
        # Where what is shown is kept for the dashboard (`skyward.history`), once started.
        self.history: Recorder | None = None
        self._quiet = quiet()
        self._lock = threading.Lock()
        self._began = time.monotonic()
        self._wave = self._began  # when nodes were last requested: "ready in 3.1 s" counts from it
        self._nodes = [_Node(Phase.REQUESTED, self._began) for _ in range(nodes)]
        self._screen: Screen | None = None
        self.notebook: Notebook | None = None  # set by `start` in a Jupyter kernel
        self._prefixes: Prefixes | None = None  # for the stream node lines last went to

    # -- the pool's lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        """Choose the way to show the pool (live region, notebook or plain lines) and say it is
        launching."""
        self._began = self._wave = time.monotonic()
        if kernel() is not None:
            self.notebook = Notebook()
        elif self.stream_output and not self._quiet and is_terminal(sys.stdout, sys.stderr):
            self._screen = Screen.of(sys.stdout)
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
        if self.history is not None:
            self.history.event(message)
        self._say(line)

    def granted(self, node: int, price: Price | None = None, at: float | None = None) -> None:
        super().granted(node, price, at)
        if self.billing is not None:
            self.billing(node, price, at)

    def phase(self, node: int | None, phase: Phase, detail: str = "") -> None:
        now = time.monotonic()
        with self._lock:
            for index in self._indices(node):
                self._nodes[index] = _Node(phase, now, detail)
            if phase is Phase.REQUESTED:
                self._wave = now
        described = self._describe(node, phase, detail, now)
        line = f"{self.name}: {described}"
        logger.info("%s", line)
        if self.history is not None:
            self.history.event(described)
            if phase is Phase.READY and node is None:
                self.history.update(state="running", ranks_per_node=self.ranks_per_node)
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

    def node_line(self, rank: int, line: str) -> None:
        """One line rank `rank` printed (the node, with one rank per node), with its prefix (in
        colour on a terminal): ``(node 1)``, or ``(node 1 rank 3)`` where nodes hold several."""
        per_node = self.ranks_per_node
        if self.history is not None:
            self.history.line(who(rank, per_node), line)
        if not self.stream_output:
            return
        if self.notebook is not None:
            self.notebook.line(rank, line, who(rank, per_node))
            return
        screen = self._screen
        if screen is not None and sys.stdout is screen.stdout:
            if "\r" in line:  # a progress bar redrawn in place: what a terminal would show
                line = line.rsplit("\r", 1)[-1]
            ranked = screen.prefixes
            prefix = ranked[rank] if per_node == 1 else ranked.rank(rank, per_node)
            screen.write(f"{prefix}{line}\n")
            return
        out = sys.stdout  # as it is now: a redirect_stdout() inside the pool's block wins
        prefixes = self._prefixes
        if prefixes is None or prefixes.stream is not out:
            prefixes = self._prefixes = Prefixes(out)
        prefix = prefixes[rank] if per_node == 1 else prefixes.rank(rank, per_node)
        out.write(f"{prefix}{line}\n")  # one write a line: never mid-line

    def node_partial(self, rank: int, text: str) -> None:
        """What a rank printed of a line since its last ``\\r`` (a progress bar redrawn in
        place): a notebook redraws the line now; elsewhere the whole line is shown when its
        newline comes."""
        if self.stream_output and self.notebook is not None:
            self.notebook.partial(rank, text, who(rank, self.ranks_per_node))

    def report(self, report: Report) -> None:
        """Note a rank's `sky.report`: rank 0's latest is shown on node 0's line (never
        printed: a line per report would drown the nodes' own lines)."""
        if self.history is not None:
            rank = report.global_rank
            self.history.report(
                who(rank, self.ranks_per_node),
                report.node,
                rank,
                report.time,
                report.metrics,
                report.checkpoint,
            )
        if report.first_rank:
            self.latest = report

    # -- the region --------------------------------------------------------------------------

    def __rich_console__(self, console: RichConsole, options: ConsoleOptions) -> RenderResult:
        now = time.monotonic()
        with self._lock:
            rows = [self._seen(index, node, now) for index, node in enumerate(self._nodes)]
        spent = self.spending() if self.spending is not None else ""
        yield summary(self.name, self.provider, rows, now - self._began, spent)
        yield node_table(rows, MAX_ROWS)

    def _seen(self, index: int, node: _Node, now: float) -> Row:
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
            detail = metrics(self.latest)
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
            per = self.ranks_per_node
            ranks = f" x {per} ranks" if per > 1 else ""
            return f"ready: {count} node(s){ranks} in {duration(now - self._wave)} s"
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

    def _styled_status(self, line: str, screen: Screen) -> str:
        return screen.paint(f"[skyward] {line}", "dim") + "\n"


def duration(seconds: float) -> str:
    """Seconds for a status line: ``0.04``, ``3.1``, ``38``."""
    if seconds < 1:
        return f"{seconds:.2f}"
    return f"{seconds:.1f}" if seconds < 10 else f"{seconds:.0f}"


def _write_line(stream: TextIO, line: str) -> None:
    stream.write(line + "\n")  # one write a line: never interleaved mid-line
    stream.flush()
