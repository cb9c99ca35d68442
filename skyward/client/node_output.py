"""`NodeOutput`: one node's stdout and stderr as the client sees them.

The bytes come in chunks of any size; they leave as whole lines, kept (the last `KEPT_LINES`,
for error messages and `pool.logs()`) and handed to the console. A line being redrawn with
``\\r`` (a progress bar) is handed over as it changes too, since its newline may be minutes
away.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable

KEPT_LINES = 100_000
# A line this long without a newline is shown as it is rather than held.
OUTPUT_CHUNK = 1 << 16


class NodeOutput:
    """Splits one node's output into lines; `ended` is set once the stream has closed."""

    def __init__(
        self,
        node: int,
        on_line: Callable[[int, str], None],
        on_partial: Callable[[int, str], None] | None = None,
        earlier_lines: Iterable[str] = (),
    ) -> None:
        self.node = node
        self.lines: deque[str] = deque(earlier_lines, maxlen=KEPT_LINES)
        self.ended = asyncio.Event()
        self._on_line = on_line
        self._on_partial = on_partial
        self._partial = b""

    def feed(self, data: bytes) -> None:
        """Take the next chunk of output; an empty one means the stream has closed."""
        if not data:
            if self._partial:
                self.line(self._partial.decode(errors="replace"))
                self._partial = b""
            self.ended.set()
            return
        *lines, self._partial = (self._partial + data).split(b"\n")
        if len(self._partial) > OUTPUT_CHUNK:
            lines.append(self._partial)
            self._partial = b""
        for raw in lines:
            self.line(raw.decode(errors="replace").rstrip("\r"))
        if self._on_partial is not None and b"\r" in self._partial:
            redrawn = self._partial.rsplit(b"\r", 1)[-1]
            self._on_partial(self.node, redrawn.decode(errors="replace"))

    def line(self, text: str) -> None:
        """Keep one line and show it (skyward's own lines about the node come this way too)."""
        self.lines.append(text)
        self._on_line(self.node, text)
