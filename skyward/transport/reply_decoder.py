"""`ReplyDecoder`: a node session's frame decoder, which settles the calls its replies answer.

Every reply of a broadcast is one small `Result` that arrives as one chunk. The decoder
recognises such a chunk with one struct and settles its call within `feed`, so a reply costs
the client one Python call, not a decoder's call and then a session's (see docs/architecture.md,
"Why the per-call path is written flat"). Any other chunk goes through `FrameDecoder`.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import Protocol

from skyward.transport import frames, messages
from skyward.transport.callframes import Outcome
from skyward.transport.frames import PACKED, PACKED_RESULT, RESULT, RESULT_FRAME

_monotonic = time.monotonic
_loads = pickle.loads


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
        super().__init__(on_frame, self.settle, on_end, on_error)
        self._calls = calls
        self._on_unpicklable = on_unpicklable

    def feed(self, data: frames.Buffer) -> None:
        if type(data) is bytes and len(data) >= RESULT_FRAME.size and not self._buf:
            meta_len, count, first, marker, kind, call_id = RESULT_FRAME.unpack_from(data)
            if (
                marker == PACKED
                and kind == RESULT
                and count == 1
                and meta_len == PACKED_RESULT.size
                and len(data) == RESULT_FRAME.size + first
                and self._meta is None
            ):
                self.last_fed = _monotonic()
                future = self._calls.pending.pop(call_id, None)
                if future is None:
                    return
                try:
                    value = _loads(data[RESULT_FRAME.size :])
                except Exception as exc:
                    self._on_unpicklable(future, exc)
                    return
                future.set_result(value)
                return
        super().feed(data)

    def settle(self, call_id: int, segments: list[frames.Buffer]) -> None:
        """Settle call `call_id` with the result its segments hold (a large result's too)."""
        future = self._calls.pending.pop(call_id, None)
        if future is None:
            return
        try:
            value = _loads(segments[0], buffers=segments[1:])
        except Exception as exc:
            self._on_unpicklable(future, exc)
            return
        future.set_result(value)
