"""Stalls named: calls that make no progress for `stall_timeout` seconds fail the nodes that
are stuck in them, with every node's stacks and which nodes' stacks moved.

Progress is a call finishing or a node reporting (`sky.report`). A rank waiting in a collective
for a peer that hangs keeps sending heartbeats, so without this a broadcast waits forever; with
it, the pool takes every node's stacks twice, a second apart (`activity.answers`: the agents
answer from a signal handler), shows them, and fails the nodes still in a call whose stack did
not move between the two, or that did not answer, so the broadcast raises `WorkerError` naming
them. When every busy node's stack moved, the nodes are working without reporting: none is
failed, the console says so, and the watch looks again after another `stall_timeout`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from skyward.client import activity
from skyward.client.session import NodeSession, named
from skyward.errors import WorkerError

# Between the two samples of the stacks: a node whose stack is the same a second later is stuck.
SAMPLE_GAP = 1.0
# How long each node has to answer for its stacks.
ANSWER_SECONDS = 5.0

Mark = tuple[tuple[tuple[int, ...], int], ...]


def progress_mark(sessions: Sequence[NodeSession]) -> Mark:
    """What changes whenever a call ends or a node reports: each node's pending calls and the
    number of reports it sent."""
    return tuple((tuple(session.pending), session.reports_seen) for session in sessions)


async def watch_stalls(
    sessions: Callable[[], Sequence[NodeSession]],
    timeout: float,
    tell: Callable[[str], None],
) -> None:
    """Forever: when the nodes' calls have made no progress for `timeout` seconds, name the
    stall (`name_stall`) and fail the nodes stuck in it."""
    mark: Mark | None = None
    since = time.monotonic()
    while True:
        await asyncio.sleep(min(1.0, timeout / 4))
        current = list(sessions())
        now = progress_mark(current)
        busy = any(session.pending for session in current if session.dead is None)
        if not busy or now != mark:
            mark, since = now, time.monotonic()
            continue
        if time.monotonic() - since < timeout:
            continue
        stall = await asyncio.to_thread(name_stall, current, timeout, tell)
        for session, why in stall.failing():
            session.mark_dead(
                WorkerError(
                    f"{session.name} made no progress for {timeout:g} s (stall_timeout: "
                    f"no call finished and no node reported); {why}",
                    node=session.node,
                    output_tail=tuple(list(session.lines)[-20:]),
                )
            )
            session.stream.kill()
        mark, since = None, time.monotonic()


@dataclass(frozen=True)
class Stall:
    """What two samples of the stacks, a second apart, say of the nodes still in a call."""

    stuck: dict[NodeSession, str]  # the calls' thread's stack the same both times: that stack
    silent: list[NodeSession]  # did not answer one of the two asks
    moved: list[NodeSession]  # a different stack the second time: working, not stuck

    def failing(self) -> list[tuple[NodeSession, str]]:
        """The nodes to fail, each with why (a node whose stack moved is never one of them)."""
        return [
            (session, f"its stack did not move in {SAMPLE_GAP:g} s:\n{stack}")
            for session, stack in self.stuck.items()
        ] + [
            (session, f"it did not answer when asked for its stack ({ANSWER_SECONDS:g} s, twice)")
            for session in self.silent
        ]


def name_stall(
    sessions: Sequence[NodeSession], timeout: float, tell: Callable[[str], None]
) -> Stall:
    """Take the stacks twice, show each node's, and sort the nodes still in a call into those
    whose stack did not move, those that did not answer and those whose stack moved."""
    first = activity.answers(list(sessions), ANSWER_SECONDS)
    time.sleep(SAMPLE_GAP)
    second = activity.answers(list(sessions), ANSWER_SECONDS)
    busy = [s for s in sessions if s.dead is None and s.pending]
    # The thread that runs the calls: the agent's own threads move whenever they answer.
    calls = {
        s: (a.calls, b.calls)
        for s in busy
        if (a := first.get(s.rank)) is not None and (b := second.get(s.rank)) is not None
    }
    stall = Stall(
        stuck={s: now for s, (then, now) in calls.items() if then == now},
        silent=[s for s in busy if s not in calls],
        moved=[s for s, (then, now) in calls.items() if then != now],
    )
    if not busy:  # the calls ended while they were sampled: that is progress
        return stall
    seen = [
        f"{named(group)} {what}"
        for group, what in (
            (stall.stuck, f"did not move in {SAMPLE_GAP:g} s"),
            (stall.silent, "did not answer"),
            (stall.moved, "moved"),
        )
        if group
    ]
    tell(
        f"no call finished and no node reported for {timeout:g} s (stall_timeout); of the "
        f"nodes in a call, {'; '.join(seen)}. Their stacks:"
    )
    names = {session.rank: session.name for session in sessions}
    for rank, answer in sorted(second.items()):
        shown = answer.text if answer is not None else f"(no answer within {ANSWER_SECONDS:g} s)"
        tell(f"--- {names[rank]}:\n{shown.rstrip()}")
    if failing := stall.failing():
        tell(f"failing {named(session for session, _ in failing)}")
    else:
        tell(
            "no node is stuck: every node in a call is working, so none is failed and the "
            f"watch looks again in {timeout:g} s (a long loop shows progress with sky.report; "
            "or raise stall_timeout)"
        )
    return stall
