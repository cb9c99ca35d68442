"""`ReplyDecoder`: a node session's frame decoder, which settles the calls its replies answer.

A chunk that starts at a frame's start (every reply of a small call comes as one such chunk) is
read by the client's fast path (`fastpath.settle_frames`), which settles each small `Result`
straight from the chunk; a frame cut short at the end of a chunk, and a frame with a large
segment, go through the plain `FrameDecoder`, and once the frame it holds is whole, the rest of
the chunk goes back to the fast path.
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
        if type(data) is bytes and data and not self.between_frames:
            # A frame cut short by the last chunk: its rest goes to the plain decoder, so that
            # the frames after it are read by the fast path too (a gather's replies come many
            # to a chunk, and chunks rarely end where a frame does).
            view, taken = memoryview(data), 0
            while 0 < (wanted := self.bytes_wanted()) < len(data) - taken:
                super().feed(view[taken : taken + wanted])
                taken += wanted
            if taken:
                data = data[taken:]
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
