"""`CallFrames`: one call's frame as the nodes get it, encoded once for every node.

Shared by the dispatch (which makes it) and the node sessions (which register and write it).
"""

from __future__ import annotations

from typing import Any, Protocol

from skyward.transport import frames, messages


class Outcome(Protocol):
    """Where a call's result or exception goes: a `concurrent.futures.Future`, or the lighter
    `client.replies.Reply`. The session sets each outcome it holds exactly once."""

    def set_running_or_notify_cancel(self) -> bool: ...
    def set_result(self, result: Any) -> None: ...
    def set_exception(self, exception: BaseException | None) -> None: ...
    def done(self) -> bool: ...


Calls = list[tuple["CallFrames", Outcome]]


class CallFrames:
    """One call's frame, encoded at most twice (with and without the function's bytes) however
    many nodes it goes to: a broadcast writes the same bytes to every node."""

    __slots__ = ("_with_fn", "call_id", "fn_bytes", "fn_id", "segments", "without_fn")

    def __init__(
        self, call_id: int, fn_id: int, fn_bytes: bytes, segments: list[frames.Buffer]
    ) -> None:
        self.call_id = call_id
        self.fn_id = fn_id
        self.fn_bytes = fn_bytes
        self.segments = segments
        # what a node that has the function gets: nearly every call needs it, so it is made now
        self.without_fn = frames.encode_call(call_id, fn_id, segments)
        self._with_fn: list[frames.Buffer] | None = None

    @property
    def carries_function(self) -> bool:
        """Whether the frame with the function's bytes was made (some node lacked it)."""
        return self._with_fn is not None

    def chunks(self, first_time: bool) -> list[frames.Buffer]:
        if not first_time:
            return self.without_fn
        if self._with_fn is None:
            call = messages.Call(self.call_id, self.fn_id, self.fn_bytes)
            self._with_fn = frames.encode(call, self.segments)
        return self._with_fn
