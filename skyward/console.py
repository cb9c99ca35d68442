"""Where the pool's progress and the nodes' output are shown on the client.

A terminal gets colour through rich: one rich console per output stream, made again only when
the stream itself changes (pytest's capture, a notebook swapping ``sys.stdout``). Anything else
(a file, a pipe, a CI log) gets plain lines written straight to the stream: a node that prints
freely must not be slowed down by rendering it will never need.
"""

from __future__ import annotations

import sys
from typing import TextIO

from rich.console import Console as RichConsole
from rich.text import Text

from skyward.reports import Report

_NODE_STYLES = ("cyan", "magenta", "green", "yellow", "blue", "red")


class Console:
    """Prints pool status lines and node output lines; silent when disabled."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._rich: dict[int, tuple[TextIO, RichConsole]] = {}
        self.latest: Report | None = None  # node 0's last report, for a live status line

    def _styled(self, stream: TextIO) -> RichConsole | None:
        """A rich console for `stream` when it is a terminal, else None (plain lines)."""
        try:
            terminal = stream.isatty()
        except (AttributeError, ValueError):
            terminal = False
        if not terminal:
            return None
        kept = self._rich.get(id(stream))
        if kept is None or kept[0] is not stream:
            kept = (stream, RichConsole(file=stream, highlight=False, soft_wrap=True))
            self._rich[id(stream)] = kept
        return kept[1]

    def _show(self, stream: TextIO, prefix: str, line: str, style: str, whole: bool) -> None:
        """`prefix` then `line`; `style` colours the prefix, or the whole line (`whole`)."""
        rich = self._styled(stream)
        if rich is None:
            stream.write(f"{prefix}{line}\n")  # one write a line: never interleaved mid-line
        elif whole:
            rich.print(Text(prefix + line, style=style))
        else:
            rich.print(Text.assemble((prefix, style), line))

    def status(self, message: str) -> None:
        if self.enabled:
            self._show(sys.stderr, "[skyward] ", message, "dim", whole=True)

    def build_log(self, line: str) -> None:
        if self.enabled:
            self._show(sys.stderr, "[skyward build] ", line, "dim", whole=True)

    def node_line(self, node: int, line: str) -> None:
        if self.enabled:
            style = _NODE_STYLES[node % len(_NODE_STYLES)]
            self._show(sys.stdout, f"(node {node}) ", line, style, whole=False)

    def report(self, report: Report) -> None:
        """Note a node's `sky.report`. Nothing is printed: reports would drown the nodes' own
        lines; the latest of node 0 is kept for a live status line to show."""
        if report.node == 0:
            self.latest = report
