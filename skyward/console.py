"""Where the pool's progress and the nodes' output are shown on the client (with rich)."""

from __future__ import annotations

import sys

from rich.console import Console as RichConsole
from rich.text import Text

_NODE_STYLES = ("cyan", "magenta", "green", "yellow", "blue", "red")


class Console:
    """Prints pool status lines and node output lines; silent when disabled."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    def _console(self, stderr: bool) -> RichConsole:
        # A new rich console per line follows sys.stdout/sys.stderr if they are swapped
        # (pytest's capture, notebooks), at a cost far below a line's trip from the node.
        return RichConsole(
            file=sys.stderr if stderr else sys.stdout, highlight=False, soft_wrap=True
        )

    def status(self, message: str) -> None:
        if self.enabled:
            self._console(stderr=True).print(Text(f"[skyward] {message}", style="dim"))

    def build_log(self, line: str) -> None:
        if self.enabled:
            self._console(stderr=True).print(Text(f"[skyward build] {line}", style="dim"))

    def node_line(self, node: int, line: str) -> None:
        if self.enabled:
            style = _NODE_STYLES[node % len(_NODE_STYLES)]
            self._console(stderr=False).print(Text.assemble((f"(node {node}) ", style), line))
