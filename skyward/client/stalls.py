"""Stalls named: calls that make no progress for `stall_timeout` seconds fail the pool, with
every node's stacks and the node(s) whose stack did not move.

Progress is a call finishing or a node reporting (`sky.report`). A rank waiting in a collective
for a peer that hangs keeps sending heartbeats, so without this a broadcast waits forever; with
it, the pool takes every node's stacks twice, a second apart (`activity.stacks`: the agents
answer from a signal handler), shows them, and fails the nodes still in a call whose stack did
not move between the two, so the broadcast raises `WorkerError` naming them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from skyward.client import activity
from skyward.client.session import NodeSession
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
        stuck = await asyncio.to_thread(name_stall, current, timeout, tell)
        for session, text in stuck:
            session.mark_dead(
                WorkerError(
                    f"node {session.node} made no progress for {timeout:g} s (stall_timeout: "
                    "no call finished and no node reported); its stack did not move:\n" + text,
                    node=session.node,
                    output_tail=tuple(list(session.lines)[-20:]),
                )
            )
            session.stream.kill()
        mark, since = None, time.monotonic()


def name_stall(
    sessions: Sequence[NodeSession], timeout: float, tell: Callable[[str], None]
) -> list[tuple[NodeSession, str]]:
    """Take the stacks twice, show each node's, and return the nodes still in a call whose
    stack did not move, with it (every node in a call when none answered twice)."""
    first = activity.stacks(list(sessions), ANSWER_SECONDS)
    time.sleep(SAMPLE_GAP)
    second = activity.stacks(list(sessions), ANSWER_SECONDS)
    busy = [s for s in sessions if s.dead is None and s.pending]
    still = [s for s in busy if s.node in first and first[s.node] == second.get(s.node)]
    tell(
        f"no call finished and no node reported for {timeout:g} s (stall_timeout); "
        f"node(s) {[s.node for s in still or busy]} did not move. Their stacks:"
    )
    for node, text in sorted(second.items()):
        tell(f"--- node {node}:\n{text.rstrip()}")
    return [(s, second.get(s.node, "")) for s in (still or busy)]
