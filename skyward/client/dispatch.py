"""`Dispatch`: how calls reach a pool's ranks and how their outcomes come back.

A session is one rank (one agent): a node's only one by default, or one of the
`ranks_per_node` it holds, in global rank order (node 0's first). One call to one rank (the
next live one in turn, a chosen rank, or a chosen node's first), one call to every rank (a
broadcast: SPMD, so one failure stops the rest), or many independent calls spread over the
ranks (a gather). The root failure is what the caller sees: a rank's death before a user
exception, before the errors of the ranks that were stopped because of it.

A dispatch's outcomes are `Reply`s, lighter than `concurrent.futures.Future`s, counted by a
`Tally` under one lock, which wakes the thread that waits for them.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, cast

from skyward.client.session import NodeSession, named
from skyward.data import Stager
from skyward.errors import ConfigError, PoolClosedError, WorkerError
from skyward.transport import frames
from skyward.transport.base import AgentStream
from skyward.transport.fastpath import register_each, write_each
from skyward.transport.frames import CallFrames, Calls
from skyward.transport.pipes import SubprocessStream

_call_ids = itertools.count(1)
_Wire = tuple[
    list[NodeSession], list[AgentStream], list[threading.Lock], list[threading.Lock] | None
]


class Function(Protocol):
    """What a dispatch reads of a `sky.compute` function: its id and pickled bytes."""

    def serialized(self) -> tuple[int, bytes]: ...


class PendingCall(Protocol):
    """What a dispatch reads of a pending call (`calls.PendingCall` is one)."""

    @property
    def function(self) -> Function: ...

    def serialized_args(self, stager: Stager | None = None) -> list[frames.Buffer]: ...


class Tally:
    """The replies of one dispatch, counted as they settle (on any thread); a waiter that
    must sleep is woken as they settle. Its lock guards the count, the failures and the state
    of every reply it counts."""

    __slots__ = ("_lock", "_wakeup", "failures", "settled", "total")

    def __init__(self, total: int) -> None:
        self.total = total
        # A count, not the replies: a reply holds its tally, so a list of them would be a
        # cycle, and every dispatch's replies would wait for the garbage collector instead of
        # going when the call returns (`test_calls_leave_no_garbage_for_the_collector`).
        self.settled = 0
        self.failures: list[Reply] = []  # in the order they failed
        self._lock = threading.Lock()
        # Made by the first waiter that has to sleep: most calls are answered before their
        # caller looks (a Local pipe's reply is read by the caller itself).
        self._wakeup: threading.Condition | None = None

    def settle(self, reply: Reply, value: Any, error: BaseException | None) -> None:
        """Settle `reply` with `value` or `error`, once (a later settling is ignored), and wake
        the waiter if one sleeps."""
        with self._lock:
            if reply.finished:
                return
            reply.value, reply.error, reply.finished = value, error, True
            self.settled += 1
            if error is not None:
                self.failures.append(reply)
            if self._wakeup is not None:
                self._wakeup.notify_all()

    def all_done(self) -> bool:
        return self.settled == self.total

    def all_done_or_failed(self) -> bool:
        return self.settled == self.total or bool(self.failures)

    def wait(self, enough: Callable[[], bool], timeout: float | None = None) -> bool:
        """Sleep until `enough()` or `timeout`; whether it is enough."""
        if enough():
            return True
        with self._lock:  # `enough()` is checked again under it, so no settling is missed
            if self._wakeup is None:
                self._wakeup = threading.Condition(self._lock)
            return self._wakeup.wait_for(enough, timeout)


class Reply:
    """One call's outcome in a `Tally`: lighter than a `Future` (never cancelled, set once,
    under its tally's lock)."""

    __slots__ = ("error", "finished", "tally", "value")

    def __init__(self, tally: Tally) -> None:
        self.tally = tally
        self.value: Any = None
        self.error: BaseException | None = None
        self.finished = False

    def set_running_or_notify_cancel(self) -> bool:
        return True

    def set_result(self, result: Any) -> None:
        self.tally.settle(self, result, None)

    def set_exception(self, exception: BaseException | None) -> None:
        self.tally.settle(self, None, exception)

    def done(self) -> bool:
        return self.finished


class Dispatch:
    """The calls of one pool over its rank sessions (`sessions` is replaced on a restart)."""

    def __init__(self, broadcast_grace: float) -> None:
        self.ranks_per_node = 1  # the sessions of node i are ranks_per_node * i and on
        # The sessions with their streams and locks, and the pipes' write locks when every
        # node is Local; each list made once per restart (a Local stream keeps the pipe group
        # of a broadcast's streams by the list's identity).
        self._wire: _Wire = ([], [], [], None)
        self.broken: str | None = None  # why the pool takes no more calls
        self._broadcast_grace = broadcast_grace
        self._cursor = itertools.count()
        # Syncs the `sky.Data` of a call's arguments to the nodes before it is sent.
        self.stager: Stager | None = None

    @property
    def sessions(self) -> list[NodeSession]:
        return self._wire[0]

    @sessions.setter
    def sessions(self, sessions: list[NodeSession]) -> None:
        streams = [session.stream for session in sessions]
        pipes = [s for s in streams if isinstance(s, SubprocessStream)]
        pipe_locks = [p.write_lock for p in pipes] if len(pipes) == len(streams) else None
        self._wire = (sessions, streams, [session.lock for session in sessions], pipe_locks)

    def session(self, rank: int) -> NodeSession:
        """The session of rank `rank` (of node `rank` with one rank per node)."""
        count = len(self.sessions)
        name = "node" if self.ranks_per_node == 1 else "rank"
        if not 0 <= rank < count:
            raise ConfigError(f"{name} must be in 0..{count - 1}, got {rank}")
        return self.sessions[rank]

    def node_sessions(self, node: int) -> list[NodeSession]:
        """The sessions of node `node`'s ranks, in rank order."""
        per = self.ranks_per_node
        return self.sessions[node * per : (node + 1) * per]

    def _live(self) -> list[NodeSession]:
        live = [session for session in self.sessions if session.dead is None]
        if not live:
            raise PoolClosedError("every node of the pool has died; start a new pool")
        return live

    def _frames(
        self, call: PendingCall, segments: list[frames.Buffer], to: Sequence[NodeSession]
    ) -> CallFrames:
        """`call`'s frames for the sessions `to`: with the function's bytes too if one of them
        may lack it (a session only ever gains functions, so one that has it keeps it)."""
        fn_id, fn_bytes = call.function.serialized()
        lacking = not all(session.has_function(fn_id) for session in to)
        return CallFrames(next(_call_ids), fn_id, segments, fn_bytes if lacking else None)

    def _pick(self, node: int | None, rank: int | None) -> NodeSession:
        if node is not None and rank is not None:
            raise ConfigError(f"give node= or rank=, not both (node={node}, rank={rank})")
        if rank is not None:
            return self.session(rank)
        if node is not None:
            per = self.ranks_per_node
            if per == 1:
                return self.session(node)
            nodes = len(self.sessions) // per
            if not 0 <= node < nodes:
                raise ConfigError(f"node must be in 0..{nodes - 1}, got {node}")
            return self.sessions[node * per]  # the node's first rank
        live = self._live()
        return live[next(self._cursor) % len(live)]

    def submit(self, call: PendingCall, node: int | None, rank: int | None = None) -> Future[Any]:
        """Send `call` to one rank (the next in turn, `rank`, or `node`'s first); its future."""
        payload = call.serialized_args(self.stager)
        future: Future[Any] = Future()
        session = self._pick(node, rank)
        session.submit([(self._frames(call, payload, (session,)), future)])
        return future

    def run(self, call: PendingCall, node: int | None = None, rank: int | None = None) -> Any:
        """Run `call` on one rank and return its result (what ``call >> pool`` does)."""
        payload = call.serialized_args(self.stager)
        session = self._pick(node, rank)
        tally = Tally(1)
        reply = Reply(tally)
        session.submit([(self._frames(call, payload, (session,)), reply)])
        session.stream.wait_replies((session.stream,), reply.done)
        tally.wait(reply.done)
        if reply.error is not None:
            raise reply.error
        return reply.value

    def broadcast(self, call: PendingCall) -> list[Any]:
        """Run `call` on every rank; results in rank order (see `ComputePool.broadcast`)."""
        payload = call.serialized_args(self.stager)
        sessions, streams, locks, pipe_locks = self._wire  # replaced, not changed
        if any(session.dead is not None for session in sessions):
            dead = [session for session in sessions if session.dead is not None]
            raise PoolClosedError(f"a broadcast needs every rank, and {named(dead)} died")
        frames_ = self._frames(call, payload, sessions)  # encoded once, written to every node
        tally = Tally(len(sessions))
        replies = [Reply(tally) for _ in sessions]
        # Registered on every session first, then written back to back: each write wakes a
        # node, which then competes for the cores with the rest of this loop.
        chunks = register_each(frames_, sessions, replies, locks)
        if pipe_locks is not None:  # Local: every write in one call (see `fastpath`)
            failed = write_each(cast(list[SubprocessStream], streams), pipe_locks, chunks)
        else:
            failed = []
            for index, (stream, node_chunks) in enumerate(zip(streams, chunks, strict=True)):
                try:
                    if node_chunks:
                        stream.write(node_chunks)
                except OSError as exc:
                    failed.append((index, exc))
        for index, error in failed:
            sessions[index].write_failed(error, [(frames_, replies[index])])
        if frames_.with_fn is not None:  # some node lacked the function: those written have it
            unsent = {index for index, _ in failed}
            for index, session in enumerate(sessions):
                if chunks[index] and index not in unsent:
                    session.mark_sent(frames_.fn_id)
        return self._collect(tally, replies, sessions, spmd=True, streams=streams)

    def gather(self, calls: Sequence[PendingCall]) -> tuple[Any, ...]:
        """Run independent calls spread over the nodes; results in call order (see
        `ComputePool.gather`)."""
        payloads = [call.serialized_args(self.stager) for call in calls]
        live = self._live()
        start = next(self._cursor)
        owners = [live[(start + i) % len(live)] for i in range(len(calls))]
        tally = Tally(len(calls))
        replies = [Reply(tally) for _ in calls]
        batches: dict[int, Calls] = {}
        for session, call, payload, reply in zip(owners, calls, payloads, replies, strict=True):
            frames_ = self._frames(call, payload, (session,))
            batches.setdefault(session.rank, []).append((frames_, reply))
        for session in live:  # one write per rank, however many calls it takes
            if session.rank in batches:
                session.submit(batches[session.rank])
        # every node takes part: the pool's stream list, whose pipe group is kept
        every = len(calls) >= len(live) == len(self.sessions)
        streams = self._wire[1] if every else None
        return tuple(self._collect(tally, replies, owners, spmd=False, streams=streams))

    def _collect(
        self,
        tally: Tally,
        replies: list[Reply],
        owners: list[NodeSession],
        spmd: bool,
        streams: list[AgentStream] | None = None,
    ) -> list[Any]:
        """Wait for every reply; return the values, or raise the root failure.

        `spmd` (a broadcast): the calls depend on each other, so a failure stops the rest.
        Otherwise (a gather) the calls are independent and all run to their end.
        """
        # `streams`: those of `owners`, each once, in a list kept from call to call
        group = streams or list({id(s.stream): s.stream for s in owners}.values())
        group[0].wait_replies(group, tally.all_done if not spmd else tally.all_done_or_failed)
        if spmd:
            tally.wait(tally.all_done_or_failed)
            if tally.failures and not tally.all_done():
                first = tally.failures[0]
                grace = 0.0 if isinstance(first.error, WorkerError) else self._broadcast_grace
                if not tally.wait(tally.all_done, grace):
                    self._break(
                        f"{owners[replies.index(first)].name} failed "
                        f"({type(first.error).__name__}) while the others were still running, "
                        "and they were stopped; start a new pool",
                        [s for s, r in zip(owners, replies, strict=True) if not r.done()],
                    )
                    tally.wait(tally.all_done, 5)
        else:
            tally.wait(tally.all_done)
        if not tally.failures:
            return [reply.value for reply in replies]
        # A dead node is the root cause of what the others then report (a collective that lost
        # its peer, or being stopped), so its error is the one raised.
        failed = sorted(
            (r.error for r in replies if r.done() and r.error is not None), key=_blame_rank
        )
        root = failed[0]
        if spmd and isinstance(root, WorkerError) and not root.stopped and len(owners) > 1:
            # The survivors of a broadcast that lost a rank hold a broken collective state.
            lost = next(o for o, r in zip(owners, replies, strict=True) if r.error is root)
            self._break(
                f"{lost.name} died during a broadcast; call pool.replace({root.node}) "
                "or start a new pool",
                owners,
            )
        raise root

    def _break(self, reason: str, stop: list[NodeSession]) -> None:
        self.broken = self.broken or reason
        for session in stop:
            session.abort_soon(reason)


def _blame_rank(error: BaseException | None) -> int:
    if isinstance(error, WorkerError):
        return 2 if error.stopped else 0
    return 1
