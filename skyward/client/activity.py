"""What a pool sees of its nodes besides their results: what each is doing (for the console),
what they printed (`ComputePool.logs`) and what they reported (`sky.report`).

All of it is read off the node sessions or fed by them; nothing here writes to a node.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

from skyward.client.dispatch import Dispatch
from skyward.client.session import NodeSession, Stage
from skyward.console.console import Console
from skyward.console.progress import Phase
from skyward.reports import Report
from skyward.transport.eventloop import LoopThread
from skyward.transport.messages import Stacks
from skyward.worker.tensorboard import TensorBoard


def node_activity(dispatch: Dispatch, node: int) -> tuple[Phase, str] | None:
    """What the console sees of node `node` beyond its phase, read when it draws (so a call
    pays nothing for it): a call in flight, a plugin hook, a dead agent (of any of its
    ranks)."""
    sessions = dispatch.node_sessions(node)
    for session in sessions:
        if _died(session):
            return Phase.LOST, str(session.dead).splitlines()[0]
    calls = sum(len(session.pending) for session in sessions)
    if calls:
        return Phase.RUNNING, f"{calls} calls" if calls > len(sessions) else ""
    for session in sessions:
        if session.stage is Stage.IN_PLUGIN:
            return Phase.STARTING, session.where
    return None


def lost(sessions: list[NodeSession]) -> list[int]:
    """The nodes with an agent that died (of any of their ranks), not those the pool stopped
    because another one failed."""
    return sorted({session.node for session in sessions if _died(session)})


def _died(session: NodeSession) -> bool:
    return session.dead is not None and not session.dead.stopped


def logs(sessions: list[NodeSession], node: int | None) -> list[str]:
    """What the nodes printed: one node's lines, or every node's prefixed with its index;
    where a node holds several ranks, each rank's lines prefixed with its name."""
    chosen = [s for s in sessions if node is None or s.node == node]
    if node is not None and not any(s.shared for s in chosen):
        return [line for s in chosen for line in list(s.lines)]  # list() copies atomically
    return [f"({s.name}) {line}" for s in chosen for line in list(s.lines)]


def stacks(sessions: list[NodeSession], timeout: float) -> dict[int, str]:
    """Every live rank's threads' stacks, by rank (the node, with one rank per node), as its
    agent's faulthandler writes them on SIGUSR2 (from the signal handler: it answers while the
    main thread is stuck in a collective); a rank that does not answer within `timeout`
    seconds says so instead."""
    return {
        rank: f"(no answer within {timeout:g} s)" if answer is None else answer.text
        for rank, answer in answers(sessions, timeout).items()
    }


def answers(sessions: list[NodeSession], timeout: float) -> dict[int, Stacks | None]:
    """Every live rank's answer for its stacks (`stacks`), by rank; None for a rank that did
    not answer within `timeout` seconds."""
    live = [session for session in sessions if session.dead is None]
    asked = time.monotonic()
    for session in live:
        session.stream.signal(signal.SIGUSR2)
    deadline = asked + timeout
    # The answers arrive where frames are decoded (the loop, a pipe's reader): look now and then.
    while any(s.stacks[0] < asked for s in live) and time.monotonic() < deadline:
        time.sleep(0.02)
    return {s.rank: s.stacks[1] if s.stacks[0] >= asked else None for s in live}


def drain_output(loop: LoopThread) -> None:
    """Have `loop` read what the nodes' output pipes hold now: a call's last lines, written
    before its reply but read apart from it, so that they show with the call."""
    loop.run(_a_few_turns())


async def _a_few_turns() -> None:
    # Each turn of the loop polls its readers once and runs what they have read.
    for _ in range(3):
        await asyncio.sleep(0)


def report_sink(
    reports: list[Report],
    checkpoint: Callable[[Report], None],
    console: Console,
    on_report: Callable[[Report], object] | None,
    tensorboard: TensorBoard,
) -> Callable[[Report], None]:
    """What a node session calls with each report: kept in `reports`, its checkpoint copied
    (`checkpoint`), shown (and kept in the history), written for TensorBoard where it can be,
    and handed to the user's `on_report`."""

    def reported(report: Report) -> None:
        reports.append(report)
        checkpoint(report)
        console.report(report)
        tensorboard.report(report, console.ranks_per_node)
        if on_report is not None:
            try:
                on_report(report)
            except Exception:  # the user's callback must not break the stream it runs on
                logging.getLogger("skyward").exception(
                    "on_report raised on a report from node %d", report.node
                )

    return reported
