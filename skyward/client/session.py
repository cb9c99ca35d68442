"""`NodeSession`: the client's side of one rank's agent, from its first byte to its death.

A node holds one rank by default (then the session is the node's), or several
(``processes_per_node``), each its own agent and session. A session owns one agent's stream and
everything that happens on it: the handshake (`open`, `hello`, `ready`) with the rank's `Stage`
as it goes, the calls it holds and their futures, the rank's output (a `NodeOutput`), its
reports (`sky.report`, handed to the pool), its heartbeat deadline, and its death, which fails
every call it held with a `WorkerError`.

Threads: bytes arrive on the pool's event loop, or on whichever thread reads a local pipe (see
`AgentStream.wait_replies`); results resolve thread-safe futures there and reports go to
`on_report` there; every other message is handed to the loop. Calls are written from the
caller's thread, under the session's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TypeVar

from skyward.client import failures
from skyward.client.node_output import NodeOutput
from skyward.errors import PluginError, PoolClosedError, RemoteError, WorkerError
from skyward.info import InstanceInfo
from skyward.providers.base import NodeLoss
from skyward.reports import Report
from skyward.transport import frames, messages
from skyward.transport.base import AgentStream
from skyward.transport.fastpath import ReplyDecoder
from skyward.transport.frames import CallFrames, Calls, Outcome

# How long to wait for the rest of a dead node's output before reporting its death.
OUTPUT_DRAIN_SECONDS = 0.3
# How long the provider may take to say why a node went away before the error is raised.
EXPLAIN_SECONDS = 3.0

M = TypeVar("M", messages.Started, messages.Ready)


Explain = Callable[[], Awaitable[NodeLoss | None]]


class Stage(enum.Enum):
    """Where a node is in its life, as error messages name it."""

    STARTING = "starting the agent"
    SETTING_UP = "setting up plugins"
    IN_PLUGIN = "in plugin"
    READY = "running a call"


class NodeSession:
    """One rank's agent as the pool sees it: on node `node`, global rank `rank` (None: the
    node's only rank, which is the node; lines and errors then name the node alone)."""

    def __init__(
        self,
        node: int,
        stream: AgentStream,
        on_output: Callable[[int, str], None],
        explain: Explain | None = None,
        earlier_lines: Iterable[str] = (),
        on_report: Callable[[Report], None] | None = None,
        on_partial: Callable[[int, str], None] | None = None,
        on_notice: Callable[[int], None] | None = None,
        rank: int | None = None,
    ) -> None:
        self.node = node
        self.rank = node if rank is None else rank
        self.shared = rank is not None  # its node holds other ranks too
        # How lines and errors name it: ``node 1``, or ``node 1 rank 3`` beside other ranks.
        self.name = f"node {node} rank {rank}" if self.shared else f"node {node}"
        self.stream = stream
        # Its lines go to the console by rank (the node, with one rank per node).
        self.output = NodeOutput(self.rank, on_output, on_partial, earlier_lines)
        self.lines = self.output.lines
        self.pending: dict[int, Outcome] = {}
        self.dead: WorkerError | None = None
        # The agent's last answer to SIGUSR2 (`ComputePool.stacks`): when, and its threads.
        self.stacks: tuple[float, messages.Stacks] = (0.0, messages.Stacks("", ""))
        self.reports_seen = 0  # how many `sky.report`s the node sent
        self.preempting: messages.Preempting | None = None  # the node's preemption notice
        self.exit_status: int | None = None
        self.stage = Stage.STARTING
        self.plugin: str | None = None  # the plugin whose hook runs, in Stage.IN_PLUGIN
        self._hook = ""
        # The functions a write that carried their bytes has returned for (see `flush`);
        # read by the broadcast's fast path (`fastpath.register_each`), changed only here.
        self.sent_functions: set[int] = set()
        self._explain = explain
        self._on_output = on_output
        self._on_report = on_report
        self._on_notice = on_notice  # called with the node's index on a preemption notice
        self._control: asyncio.Queue[messages.Message | None] = asyncio.Queue()
        self._stopping = False
        self._ending = False  # `close(ending=True)`: the pool's nodes go next
        # Held while calls are registered (`register`) and the pending calls are taken away.
        self.lock = threading.Lock()
        self._decoder = ReplyDecoder(
            self, self._on_frame, self._unpicklable, self._on_control_end, self._on_broken_stream
        )
        self._ended_task: asyncio.Task[None] | None = None
        self._control_closed = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        stream.start(self._decoder.feed, self.output.feed)

    @property
    def ready(self) -> bool:
        """Whether the node passed its handshake and takes calls."""
        return self.stage is Stage.READY

    @property
    def where(self) -> str:
        """The stage in words: ``in plugin 'jax' around_app``, ``running a call``..."""
        if self.stage is Stage.IN_PLUGIN:
            return f"in plugin {self.plugin!r} {self._hook}"
        return str(self.stage.value)

    # -- the handshake (on the event loop) ---------------------------------------------------

    async def open(self, port_names: tuple[str, ...]) -> messages.Started:
        """Ask for the head ports the plugins need; the agent's `Started` answer."""
        self._send_at_start(messages.Open(port_names))
        return await self._expect(messages.Started, ())

    async def hello(
        self,
        info: InstanceInfo,
        plugins: bytes,
        peers: Sequence[NodeSession],
        silence_timeout: float = 0.0,
    ) -> None:
        """Give the node its identity and plugins, and wait until its plugins are set up.

        A failure names the node and, from `peers`, where the other nodes were at that moment.
        """
        self.stage = Stage.SETTING_UP  # from here on, `ping_agents` pings a remote node
        silence = silence_timeout if self.stream.remote else 0.0
        self._send_at_start(messages.Hello(info, silence), [plugins])
        await self._expect(messages.Ready, peers)
        self.stage = Stage.READY

    def _send_at_start(self, message: messages.Message, segments: frames.Segments = ()) -> None:
        """`send` during the handshake: an agent that is already gone (it exited at once) makes
        the write fail, and its end, which `_expect` then reads, says what happened."""
        with contextlib.suppress(OSError):
            self.send(message, segments)

    async def _expect(self, kind: type[M], peers: Sequence[NodeSession]) -> M:
        """Wait for a `kind` message, following the node's progress through its plugins."""
        while True:
            message = await self._control.get()
            if isinstance(message, kind):
                return message
            if isinstance(message, messages.HookStarted):
                self.stage, self.plugin, self._hook = Stage.IN_PLUGIN, message.plugin, message.hook
            elif isinstance(message, messages.HookFailed):
                raise self._hook_failed(message, peers)
            elif message is None:
                raise self._ended_during_startup(peers)

    def _hook_failed(
        self, failed: messages.HookFailed, peers: Sequence[NodeSession]
    ) -> PluginError:
        lines = [
            f"plugin {failed.plugin!r} failed in {failed.hook} on {self.name}: "
            f"{failed.error.type_name}: {failed.error.message}",
            *failures.laggards(self, peers, failed.plugin),
            f"remote traceback of {self.name}:\n{failed.error.traceback.rstrip()}",
        ]
        return PluginError("\n".join(lines), plugin=failed.plugin, hook=failed.hook, node=self.node)

    def _ended_during_startup(self, peers: Sequence[NodeSession]) -> WorkerError:
        error = self.dead or WorkerError(f"{self.name} ended during startup", node=self.node)
        plugin = self.plugin if self.stage is Stage.IN_PLUGIN else None
        others = failures.laggards(self, peers, plugin)
        if not others:
            return error
        return WorkerError(
            "\n".join([str(error), *others]),
            node=error.node,
            exit_status=error.exit_status,
            output_tail=error.output_tail,
        )

    # -- calls (from the caller's thread) ----------------------------------------------------

    def send(self, message: messages.Message, segments: frames.Segments = ()) -> None:
        """Write one control message."""
        self.stream.write(frames.encode(message, segments))

    def submit(self, calls: Calls) -> None:
        """Send calls in one write; their results resolve the futures."""
        self.flush(calls, self.enqueue(calls))

    def has_function(self, fn_id: int) -> bool:
        """Whether the node has function `fn_id` (a write that carried it has returned)."""
        return fn_id in self.sent_functions

    def enqueue(self, calls: Calls) -> list[frames.Buffer]:
        """Register calls as pending and return the bytes that send them (`flush` writes them).

        Split from the write so a broadcast writes to every node back to back: a write wakes
        that node's agent, which then competes for the cores with the rest of the loop."""
        chunks: list[frames.Buffer] = []
        carried: set[int] = set()  # the batch's first call of a function carries its bytes
        with self.lock:
            for call, future in calls:
                chunks += self.register(call, future, carried)
        return chunks if len(chunks) <= 1 else frames.coalesce(chunks)

    def register(
        self, call: CallFrames, future: Outcome, carried: set[int] | None = None
    ) -> list[frames.Buffer]:
        """Register `call` as pending, with `lock` held; the bytes that send it: none when the
        node is dead (the future fails now) or the call was cancelled. `carried`: the functions
        whose bytes an earlier call of the same write carries (this one is added to it)."""
        if self.dead is not None:
            future.set_exception(self.dead)
            return []
        if not future.set_running_or_notify_cancel():
            return []
        self.pending[call.call_id] = future
        has = call.fn_id in self.sent_functions
        if carried is not None and not has:
            has = call.fn_id in carried
            carried.add(call.fn_id)
        return call.chunks(has)

    def flush(self, calls: Calls, chunks: list[frames.Buffer]) -> None:
        """Write what `enqueue` (or `register`) returned for `calls`; a failed write fails
        those calls. Once a write that carried a function's bytes has returned, the node has
        it before any later write, and later calls go without it. (Marked no sooner: a call
        made by another thread meanwhile may be written first, and must carry the bytes too.)"""
        if not chunks:
            return
        try:
            self.stream.write(chunks)
        except OSError as exc:
            self.write_failed(exc, calls)
            return
        for call, _ in calls:
            if call.with_fn is not None:
                self.mark_sent(call.fn_id)

    def mark_sent(self, fn_id: int) -> None:
        """A write that carried function `fn_id`'s bytes has returned: the node will have it
        before any later write, so later calls go without it."""
        self.sent_functions.add(fn_id)

    def write_failed(self, exc: OSError, calls: Calls) -> None:
        """The write of `calls` failed with `exc`: fail those of them still pending."""
        error = self._error(f"could not send to {self.name}: {exc}")
        with self.lock:
            failed = [f for c, f in calls if self.pending.pop(c.call_id, None) is f]
        for future in failed:
            future.set_exception(error)

    # -- receiving ---------------------------------------------------------------------------

    def _on_broken_stream(self, exc: Exception) -> None:
        self.output.line(f"[skyward] broken stream from the agent of {self.name}: {exc!r}")
        self.stream.kill()

    def _on_control_end(self) -> None:
        self._loop.call_soon_threadsafe(self._control_ended)

    def _on_frame(self, message: messages.Message, segments: list[frames.Buffer]) -> None:
        # (a `Result` never comes here: the decoder settles its call)
        if type(message) is messages.Raised:
            self._reject(message, segments)
        elif type(message) is messages.Reported:
            self.reports_seen += len(message.entries)  # progress (`stalls`)
            if self._on_report is not None:
                for time_, metrics, checkpoint in message.entries:
                    self._on_report(Report(self.node, time_, metrics, checkpoint, self.rank))
        elif type(message) is messages.Stacks:
            self.stacks = (time.monotonic(), message)
        elif type(message) is messages.Preempting:
            self.preempting = message
            left = message.seconds_left
            when = f", {left:.0f} s left" if left is not None else ""
            self.output.line(
                f"[skyward] {self.name} got a preemption notice ({message.source}{when})"
            )
            if self._on_notice is not None:
                self._on_notice(self.node)
        elif type(message) is not messages.Heartbeat:
            self._loop.call_soon_threadsafe(self._control.put_nowait, message)

    def _unpicklable(self, future: Outcome, exc: Exception) -> None:
        future.set_exception(
            RemoteError(
                type(exc).__name__,
                f"the result could not be unpickled on the client: {exc}",
                "",
                node=self.node,
            )
        )

    def _reject(self, raised: messages.Raised, segments: list[frames.Buffer]) -> None:
        future = self.pending.pop(raised.call_id, None)
        if future is not None:
            future.set_exception(
                failures.rebuild_exception(raised.error, segments, self.node, self.name)
            )

    def _control_ended(self) -> None:
        self._control_closed.set()
        if self._ended_task is None:
            self._ended_task = self._loop.create_task(self._ended())

    async def _ended(self) -> None:
        """The control stream closed: collect the exit status and the last output."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.output.ended.wait(), OUTPUT_DRAIN_SECONDS)
        try:
            self.exit_status = await asyncio.wait_for(
                self.stream.exit_status(), OUTPUT_DRAIN_SECONDS
            )
        except Exception:
            self.exit_status = None
        self._kill_leftovers()
        self._control.put_nowait(None)
        if self._stopping or self.dead is not None:
            return
        loss = await self._ask_provider()
        if loss is None and self.preempting is not None:  # the node said it was going
            loss = NodeLoss(f"node {self.node} was preempted ({self.preempting.source})", True)
        error = self._error(f"the agent of {self.name} died")
        if loss is not None:
            error = WorkerError(
                f"{loss.reason}\n{error}",
                node=self.node,
                exit_status=error.exit_status,
                output_tail=error.output_tail,
                preempted=loss.preempted or self.preempting is not None,
            )
        self.mark_dead(error)

    async def _ask_provider(self) -> NodeLoss | None:
        """The provider's account of the loss (a reclaimed spot instance), if it has one soon."""
        if self._explain is None:
            return None
        try:
            return await asyncio.wait_for(self._explain(), EXPLAIN_SECONDS)
        except Exception:
            return None

    # -- failure -------------------------------------------------------------------------------

    def _error(self, what: str) -> WorkerError:
        return failures.worker_error(
            what, self.node, self.exit_status, self.where, self.lines, self.name
        )

    def mark_dead(self, error: WorkerError) -> None:
        """Fail every call this node holds with `error`, and say so in its output."""
        with self.lock:
            if self.dead is not None:
                return
            self.dead = error
            pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)
        self._on_output(self.rank, f"[skyward] {str(error).splitlines()[0]}")

    def check_heartbeat(self, now: float, timeout: float) -> None:
        """Declare the node dead if it has sent nothing for `timeout` seconds: no bytes at all
        (its decoder notes every chunk, the middle of a frame too, so a large result on a
        slow link is word from the node all the way)."""
        silent = now - self._decoder.last_fed
        if self.dead is None and silent > timeout:
            self.mark_dead(
                self._error(
                    f"{self.name} sent no word for {silent:.0f} s (heartbeat_timeout="
                    f"{timeout:g} s): the node or its network is down"
                )
            )
            self.stream.kill()

    def abort(self, reason: str) -> None:
        """Stop this node now (another node failed, or the pool is going away)."""
        if self.dead is None:
            self.mark_dead(
                WorkerError(
                    f"{self.name} was stopped: {reason}",
                    node=self.node,
                    output_tail=tuple(list(self.lines)[-failures.TAIL_LINES :]),
                    stopped=True,
                )
            )
        self.stream.kill()

    def _kill_leftovers(self) -> None:
        """The agent ended: what it may have left in its group goes now, or, when the pool is
        ending, with its node's connection."""
        if self._ending:
            self.stream.kill_at_end()
        else:
            self.stream.kill()

    def abort_soon(self, reason: str) -> None:
        """`abort`, from any thread."""
        self._loop.call_soon_threadsafe(self.abort, reason)

    async def close(self, timeout: float, ending: bool = False) -> None:
        """Ask the agent to finish (plugins unwind), then make sure it is gone. Once: a
        second close (a restart stops the agents before `_recover` would) finds it done and
        does not signal a process ID the host may have given to another process since.
        `ending`: the pool's nodes or their connections go next, and an agent that finished
        on its own has what is left of its group killed with them (`kill_at_end`)."""
        if self._stopping:
            return
        self._stopping = True
        self._ending = ending
        # Only an idle agent is asked to finish: a busy one may not be reading, and a write to
        # its full pipe would block this loop; it is killed after `timeout` like any laggard.
        if self.dead is None and self._ended_task is None and not self.pending:
            with contextlib.suppress(Exception):
                self.send(messages.Shutdown())
        try:
            await asyncio.wait_for(self._control_closed.wait(), timeout)
        except TimeoutError:
            self.output.line(f"[skyward] {self.name} did not stop within {timeout:g} s; killing it")
            self.stream.kill()
        else:
            self._kill_leftovers()
        self.stream.close_input()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.stream.exit_status(), timeout=2)
        if self._ended_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._ended_task, timeout=2)
        with self.lock:
            pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(PoolClosedError("the pool closed before this call ended"))


def named(sessions: Iterable[NodeSession]) -> str:
    """Sessions in words: ``node(s) [0, 2]``, or each rank's name where nodes hold several
    (``node 0 rank 1, node 1 rank 3``)."""
    chosen = sorted(sessions, key=lambda session: session.rank)
    if not any(session.shared for session in chosen):
        return f"node(s) {[session.node for session in chosen]}"
    return ", ".join(session.name for session in chosen)


async def watch_heartbeats(sessions: Callable[[], Sequence[NodeSession]], timeout: float) -> None:
    """Check every session's heartbeat deadline, a few times per `timeout`, forever."""
    while True:
        await asyncio.sleep(min(1.0, timeout / 4))
        now = time.monotonic()
        for session in sessions():
            session.check_heartbeat(now, timeout)


async def ping_agents(sessions: Callable[[], Sequence[NodeSession]], timeout: float) -> None:
    """Ping every remote agent past its Hello three times per `timeout`, forever: an agent
    that hears nothing for `timeout` stops (its client is gone or cut off)."""
    ping = frames.encode(messages.Ping())
    while True:
        await asyncio.sleep(timeout / 3)
        for session in sessions():
            if session.stream.remote and session.stage is not Stage.STARTING and not session.dead:
                session.stream.write(ping)
