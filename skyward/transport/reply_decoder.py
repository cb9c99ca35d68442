"""`ReplyDecoder`: a node session's frame decoder, which settles the calls its replies answer.

A chunk that starts at a frame's start (every reply of a small call comes as one such chunk) is
read by the client's fast path (`fastpath.settle_frames`), which settles each small `Result`
straight from the chunk; whatever is left of it, and every other chunk, goes through the plain
`FrameDecoder`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from skyward.transport import fastpath, frames, messages
from skyward.transport.callframes import Outcome


class HoldsCalls(Protocol):
    """Whose calls the replies answer: a node session."""

    @property
    def pending(self) -> dict[int, Outcome]:
        """The calls sent and not yet answered, by call id."""
        ...


class ReplyDecoder(frames.FrameDecoder):
    """Decodes one node's control stream; a `Result` settles its call in `calls.pending`."""

    def __init__(
        self,
        calls: HoldsCalls,
        on_frame: Callable[[messages.Message, list[frames.Buffer]], None],
        on_unpicklable: Callable[[Outcome, Exception], None],
        on_end: Callable[[], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        """`on_frame` gets every message but a `Result`; `on_unpicklable` an outcome whose
        result could not be unpickled, and why."""
        super().__init__(self._on_message, on_end, on_error)
        self._calls = calls
        self._on_other = on_frame
        self._on_unpicklable = on_unpicklable

    def feed(self, data: frames.Buffer) -> None:
        if type(data) is bytes and data and self.between_frames:
            self.last_fed = time.monotonic()
            try:
                taken = fastpath.settle_frames(
                    data, self._calls.pending, self._on_unpicklable, self._on_other
                )
            except Exception as exc:
                if self._on_error is None:
                    raise
                self._on_error(exc)
                return
            if taken == len(data):
                return
            data = data[taken:]
        super().feed(data)

    def _on_message(self, message: messages.Message, segments: list[frames.Buffer]) -> None:
        if type(message) is messages.Result:  # a large one, or one split across chunks
            fastpath.settle(self._calls.pending, message.call_id, segments, self._on_unpicklable)
        else:
            self._on_other(message, segments)
