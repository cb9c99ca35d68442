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
    """One call's frame, encoded once however many nodes it goes to (a broadcast writes the same
    bytes to every node), and once more with the function's bytes when some node lacks them:
    both are made here, by whoever makes the call, so no node's writer comes back to encode."""

    __slots__ = ("call_id", "fn_id", "with_fn", "without_fn")

    def __init__(
        self,
        call_id: int,
        fn_id: int,
        segments: list[frames.Buffer],
        fn_bytes: bytes | None = None,
    ) -> None:
        """`fn_bytes`: the function's, when some node the call goes to may lack it."""
        self.call_id = call_id
        self.fn_id = fn_id
        self.without_fn = frames.encode_call(call_id, fn_id, segments)
        self.with_fn: list[frames.Buffer] | None = None
        if fn_bytes is not None:
            self.with_fn = frames.encode(messages.Call(call_id, fn_id, fn_bytes), segments)

    def chunks(self, node_has_function: bool) -> list[frames.Buffer]:
        """The bytes for a node that has the function (or not)."""
        if node_has_function:
            return self.without_fn
        if self.with_fn is None:
            raise ValueError(f"call {self.call_id} was made without its function's bytes")
        return self.with_fn
