"""Removing a pool: its agents stopped, its outputs collected a last time, its nodes removed,
and the line that says so.

Whatever ended the pool stays the error the user sees: a problem of the teardown is added to it
as a note instead of replacing it. With no such error, the teardown's own problem is raised,
after the nodes are gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

from skyward.client.session import NodeSession
from skyward.client.transfers import Transfers
from skyward.console.console import Console, duration
from skyward.console.progress import Phase
from skyward.errors import SkywardError
from skyward.providers.base import Cluster, Provider
from skyward.transport.eventloop import LoopThread

# Seconds a node may take to unwind when it was busy or the pool ends on an error.
_HURRIED = 0.5


def tear_down(
    *,
    loop: LoopThread,
    console: Console,
    provider: Provider,
    cluster: Cluster | None,
    sessions: Sequence[NodeSession],
    transfers: Transfers,
    shutdown_timeout: float,
    graceful: bool,
    failure: BaseException | None,
    cost: Callable[[], str] = str,
    keep_nodes: bool = False,
) -> None:
    """Stop every agent, collect the outputs, remove every node, then stop `loop` and say what
    was removed and what the pool cost (`cost()`, once its machines are gone); `failure` is
    what ended the pool, if anything did. With `keep_nodes` the provider only lets the nodes
    go (`Provider.release`): a detached run holds them."""
    began = time.monotonic()
    summary: str | None = None
    try:
        console.phase(None, Phase.STOPPING)
        busy = any(session.pending for session in sessions)
        timeout = shutdown_timeout if graceful and not busy else _HURRIED
        with contextlib.suppress(Exception):
            loop.run(stop_agents(sessions, timeout, ending=True))
        collected = transfers.collect_at_close()
        summary = f"removing the pool failed after {duration(time.monotonic() - began)} s"
        try:
            loop.run(_terminate(provider, cluster, sessions, keep_nodes))
        except SkywardError as problem:
            if failure is None:
                raise
            failure.add_note(f"and removing the pool then failed too: {problem}")
        else:
            summary = _removed(provider, cluster, time.monotonic() - began)
            if spent := cost():
                summary = f"{summary}; {spent}"
        if collected is not None:
            if failure is None or isinstance(collected, KeyboardInterrupt):
                raise collected
            failure.add_note(f"and collecting the outputs failed: {collected}")
    finally:
        loop.stop()
        console.finish(summary)


async def stop_agents(
    sessions: Sequence[NodeSession], timeout: float, ending: bool = False
) -> None:
    """Ask every agent to unwind its plugins and exit; kill one still there after `timeout` s.
    `ending`: the nodes go next (`NodeSession.close`)."""
    await asyncio.gather(*(session.close(timeout, ending) for session in sessions))


async def _terminate(
    provider: Provider, cluster: Cluster | None, sessions: Sequence[NodeSession], keep: bool
) -> None:
    for session in sessions:
        session.stream.kill_at_end()
    if cluster is not None:
        await (provider.release(cluster) if keep else provider.terminate(cluster))


def _removed(provider: Provider, cluster: Cluster | None, seconds: float) -> str:
    """The teardown's last line: ``removed 4 instances in 38.2 s``."""
    if cluster is None:
        return f"nothing was left to remove ({duration(seconds)} s)"
    return f"{provider.teardown_summary(cluster)} in {duration(seconds)} s"
