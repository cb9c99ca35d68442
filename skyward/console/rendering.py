"""How the console's text looks: colour where a stream is a terminal (none elsewhere), the
``(node i)`` prefix of each node's lines (``(node i rank r)`` where nodes hold several ranks),
and a pool's part of the live region (its summary line and a row per node: phase, time in it,
detail).

Shared by the plain lines (`console.console`) and the live region (`console.terminal`), so a node
reads the same both ways.
"""

from __future__ import annotations

import io
import os
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TextIO

from rich.console import Console as RichConsole
from rich.table import Column, Table
from rich.text import Text

from skyward.console.progress import Phase, clock
from skyward.reports import Report

_NODE_STYLES = ("cyan", "magenta", "green", "yellow", "blue", "red")
_PHASE_STYLES = {Phase.READY: "green", Phase.RUNNING: "bold cyan", Phase.LOST: "bold red"}
_PHASE_ORDER = {phase: index for index, phase in enumerate(Phase)}

# A node as the region shows it: (index, phase, seconds in that phase, detail).
Row = tuple[int, Phase, float, str]

# Text in a rich style, as a stream should get it: ``paint("ready", "green")``.
Paint = Callable[[str, str], str]


def node_style(node: int) -> str:
    """Node `node`'s colour: the same on its prefix and on its line of the region."""
    return _NODE_STYLES[node % len(_NODE_STYLES)]


def is_terminal(*streams: TextIO) -> bool:
    """Whether every one of `streams` is a terminal that can show styles (not ``TERM=dumb``)."""
    if os.environ.get("TERM") == "dumb":
        return False
    try:
        return all(stream.isatty() for stream in streams)
    except (AttributeError, ValueError):  # not a file, or a closed one
        return False


def painter(stream: TextIO) -> Paint:
    """A `Paint` for `stream`: ANSI on a terminal (unless NO_COLOR), the text itself anywhere
    else."""
    target = RichConsole(file=stream)
    if not is_terminal(stream) or target.no_color or target.color_system is None:
        return lambda text, style: text
    # The standard 16 colours whatever the terminal claims: they are all the styles use.
    styled = RichConsole(
        file=io.StringIO(), force_terminal=True, color_system="standard", highlight=False
    )

    def paint(text: str, style: str) -> str:
        with styled.capture() as captured:
            styled.print(Text(text, style=style), end="")
        return captured.get()

    return paint


def who(rank: int, per_node: int) -> str:
    """Rank `rank` in words, as its lines are prefixed: ``node 1`` where each node holds one
    rank (the rank is the node), ``node 1 rank 3`` where each holds `per_node`."""
    return f"node {rank}" if per_node == 1 else f"node {rank // per_node} rank {rank}"


class Prefixes:
    """The ``(node i) `` prefix of each node's lines as one stream shows it (``(node i rank
    r) `` for a rank where nodes hold several), styled once each, in its node's colour."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.paint = painter(stream)
        self._made: list[str] = []
        self._ranks: dict[tuple[int, int], str] = {}

    def __getitem__(self, node: int) -> str:
        while len(self._made) <= node:
            index = len(self._made)
            self._made.append(self.paint(f"(node {index})", node_style(index)) + " ")
        return self._made[node]

    def rank(self, rank: int, per_node: int) -> str:
        """The prefix of rank `rank`'s lines where each node holds `per_node` (> 1) ranks."""
        made = self._ranks.get((rank, per_node))
        if made is None:
            style = node_style(rank // per_node)
            made = self._ranks[rank, per_node] = self.paint(f"({who(rank, per_node)})", style) + " "
        return made


def summary(name: str, provider: str, rows: list[Row], elapsed: float, spent: str = "") -> Text:
    """A pool's first line in the region: ``skyward pool-x  aws  4 node(s): 3 ready, ...``,
    its clock, and what it has spent (``$0.42 at $9.83/hour``) when it costs anything."""
    return Text.assemble(
        ("skyward ", "bold"),
        (name, "bold"),
        f"  {provider}  {len(rows)} node(s): {_tally(rows)}  ",
        (clock(elapsed), "dim"),
        (f"  {spent}" if spent else "", "dim"),
    )


def node_table(rows: list[Row], limit: int) -> Table:
    """A line per node, at most `limit`: past it the last line counts the rest by phase."""
    table = Table.grid(
        Column(no_wrap=True),
        Column(no_wrap=True),
        Column(no_wrap=True, justify="right"),
        Column(no_wrap=True, overflow="ellipsis"),
        padding=(0, 2),
    )
    shown = rows if len(rows) <= limit else rows[: limit - 1]
    for index, phase, elapsed, detail in shown:
        table.add_row(
            Text(f"  node {index}", style=node_style(index)),
            Text(phase.value, style=_PHASE_STYLES.get(phase, "yellow")),
            Text(clock(elapsed), style="dim"),
            Text(detail, style="dim"),
        )
    if len(shown) < len(rows):
        rest = rows[len(shown) :]
        table.add_row(Text(f"  +{len(rest)} more", style="dim"), _tally(rest), "", "")
    return table


def _tally(rows: Iterable[Row]) -> str:
    """How many nodes are in each phase, in the phases' order: ``3 ready, 1 building``."""
    counts = Counter(phase for _, phase, _, _ in rows)
    ordered = sorted(counts.items(), key=lambda item: _PHASE_ORDER[item[0]])
    return ", ".join(f"{count} {phase.value}" for phase, count in ordered)


def metrics(report: Report) -> str:
    """A report's metrics in a few words: ``loss=0.3127 step=120``."""
    words = []
    for key, value in list(report.metrics.items())[:8]:
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        words.append(f"{key}={shown}")
    return " ".join(words)
