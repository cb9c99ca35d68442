"""`Dispatch`: how calls reach a pool's nodes and how their outcomes come back.

One call to one node (the next live one in turn, or a chosen one), one call to every node (a
broadcast: SPMD, so one failure stops the rest), or many independent calls spread over the nodes
(a gather). The root failure is what the caller sees: a node's death before a user exception,
before the errors of the nodes that were stopped because of it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any, TypeVar

from skyward.errors import ConfigError, PoolClosedError, WorkerError
from skyward.session import CallFrames, NodeSession
from skyward.transport import frames

if TYPE_CHECKING:
    from skyward.compute import PendingCall

T = TypeVar("T")
_call_ids = itertools.count(1)


class Dispatch:
    """The calls of one pool over its node sessions (`sessions` is replaced on a restart)."""

    def __init__(self, broadcast_grace: float) -> None:
        self.sessions: list[NodeSession] = []
        self.broken: str | None = None  # why the pool takes no more calls
        self._broadcast_grace = broadcast_grace
        self._cursor = itertools.count()

    def session(self, node: int) -> NodeSession:
        if not 0 <= node < len(self.sessions):
            raise ConfigError(f"node must be in 0..{len(self.sessions) - 1}, got {node}")
        return self.sessions[node]

    def _live(self) -> list[NodeSession]:
        live = [session for session in self.sessions if session.dead is None]
        if not live:
            raise PoolClosedError("every node of the pool has died; start a new pool")
        return live

    def _frames(self, call: PendingCall[Any], segments: list[frames.Buffer]) -> CallFrames:
        fn_id, fn_bytes = call.function.serialized()
        return CallFrames(next(_call_ids), fn_id, fn_bytes, segments)

    def submit(self, call: PendingCall[T], node: int | None) -> tuple[NodeSession, Future[T]]:
        """Send `call` to one node (the next in turn, or `node`); its session and future."""
        payload = call.serialized_args()
        if node is None:
            live = self._live()
            session = live[next(self._cursor) % len(live)]
        else:
            session = self.session(node)
        future: Future[T] = Future()
        session.submit([(self._frames(call, payload), future)])
        return session, future

    def run(self, call: PendingCall[T], node: int | None = None) -> T:
        """Run `call` on one node and return its result (what ``call >> pool`` does)."""
        session, future = self.submit(call, node)
        session.stream.wait_replies([session.stream], future.done)
        return future.result()

    def broadcast(self, call: PendingCall[T]) -> list[T]:
        """Run `call` on every node; results in node order (see `ComputePool.broadcast`)."""
        payload = call.serialized_args()
        dead = [session.node for session in self.sessions if session.dead is not None]
        if dead:
            raise PoolClosedError(f"a broadcast needs every node, and node(s) {dead} died")
        frames_ = self._frames(call, payload)  # encoded once, written to every node
        futures: list[Future[Any]] = [Future() for _ in self.sessions]
        for session, future in zip(self.sessions, futures, strict=True):
            session.submit([(frames_, future)])
        return self._collect(futures, list(self.sessions), spmd=True)

    def gather(self, calls: Sequence[PendingCall[Any]]) -> tuple[Any, ...]:
        """Run independent calls spread over the nodes; results in call order (see
        `ComputePool.gather`)."""
        payloads = [call.serialized_args() for call in calls]
        live = self._live()
        start = next(self._cursor)
        owners = [live[(start + i) % len(live)] for i in range(len(calls))]
        futures: list[Future[Any]] = [Future() for _ in calls]
        batches: dict[int, list[tuple[CallFrames, Future[Any]]]] = {}
        for session, call, payload, future in zip(owners, calls, payloads, futures, strict=True):
            batches.setdefault(session.node, []).append((self._frames(call, payload), future))
        for session in live:  # one write per node, however many calls it takes
            if session.node in batches:
                session.submit(batches[session.node])
        return tuple(self._collect(futures, owners, spmd=False))

    def _collect(
        self, futures: list[Future[Any]], owners: list[NodeSession], spmd: bool
    ) -> list[Any]:
        """Wait for every future; raise the root failure.

        `spmd` (a broadcast): the calls depend on each other, so a failure stops the rest.
        Otherwise (a gather) the calls are independent and all run to their end.
        """
        _wait_replies(owners, futures, spmd)
        if not spmd:
            wait_futures(futures)
            failed = sorted((f.exception() for f in futures if f.exception()), key=_blame_rank)
            if failed:
                raise failed[0]  # type: ignore[misc]
            return [future.result() for future in futures]
        done, running = wait_futures(futures, return_when=FIRST_EXCEPTION)
        first = next((f for f in futures if f in done and f.exception() is not None), None)
        if first is not None and running:
            error = first.exception()
            grace = 0.0 if isinstance(error, WorkerError) else self._broadcast_grace
            _, running = wait_futures(running, timeout=grace)
            if running:
                self._break(
                    f"node {owners[futures.index(first)].node} failed ({type(error).__name__}) "
                    "while the others were still running, and they were stopped; start a new pool",
                    [s for s, f in zip(owners, futures, strict=True) if not f.done()],
                )
        # A dead node is the root cause of what the others then report (a collective that lost
        # its peer, or being stopped), so its error is the one raised.
        failed = sorted(
            (f.exception() for f in futures if f.done() and f.exception() is not None),
            key=_blame_rank,
        )
        if not failed:
            return [future.result() for future in futures]
        root: BaseException = failed[0]  # type: ignore[assignment]
        if isinstance(root, WorkerError) and not root.stopped and len(owners) > 1:
            # The survivors of a broadcast that lost a rank hold a broken collective state.
            self._break(f"node {root.node} died during a broadcast; start a new pool", owners)
        raise root

    def _break(self, reason: str, stop: list[NodeSession]) -> None:
        self.broken = self.broken or reason
        for session in stop:
            session.abort_soon(reason)
        wait_futures([f for s in stop for f in list(s.pending.values())], timeout=5)


def _wait_replies(owners: list[NodeSession], futures: list[Future[Any]], spmd: bool) -> None:
    """Let the owners' streams read the replies in this thread, where they can, until every
    future is done or (`spmd`) one failed, so the SPMD rules apply at once."""
    # Completions are counted as they happen: polling every future after each read would cost
    # a lock per future per read, which on a broadcast is most of the client's work.
    finished: list[Future[Any]] = []
    failures_: list[Future[Any]] = []

    def on_done(future: Future[Any]) -> None:
        if future.exception() is not None:
            failures_.append(future)
        finished.append(future)  # list.append is atomic: replies may resolve on any thread

    for future in futures:
        future.add_done_callback(on_done)
    group = list({id(s.stream): s.stream for s in owners}.values())
    group[0].wait_replies(
        group, lambda: len(finished) == len(futures) or (spmd and bool(failures_))
    )


def _blame_rank(error: BaseException | None) -> int:
    if isinstance(error, WorkerError):
        return 2 if error.stopped else 0
    return 1
