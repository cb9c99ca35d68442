"""`ComputePool`: provision -> build environments -> start agents -> run calls -> tear down.

The pool keeps the lifecycle and the semantics of a broadcast, a gather and a failure. Each node's
wire is its `NodeSession`'s; the provider makes and removes the nodes. A call travels pool ->
session -> stream -> session -> pool: the caller's thread writes it, and reads the reply too
where the stream allows it (`AgentStream.wait_replies`); otherwise the pool's event loop (see
`loop.LoopThread`) reads it and resolves the call's future.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import cloudpickle

from skyward.checkpoints import Checkpoints
from skyward.cluster import Accelerator, ClusterSpec
from skyward.console import Console, duration
from skyward.data import Data, Placement, location
from skyward.dispatch import Dispatch
from skyward.errors import (
    ConfigError,
    DataError,
    PoolClosedError,
    SerializationError,
    SkywardError,
)
from skyward.handshake import handshake
from skyward.image import Image
from skyward.info import InstanceInfo
from skyward.loop import LoopThread, sigterm_unwinds
from skyward.plugins import hooks
from skyward.plugins.base import Plugin
from skyward.progress import Phase
from skyward.providers.base import Cluster, Node, Provider
from skyward.reports import Report
from skyward.session import NodeSession, Stage, ping_agents, watch_heartbeats
from skyward.transport import frames

if TYPE_CHECKING:
    from skyward.compute import PendingCall

T = TypeVar("T")


class ComputePool:
    """A pool of nodes that run `@sky.compute` functions; use it as a context manager.

    Args:
        provider: where nodes come from; default `sky.Local()` (processes on this machine).
        nodes: how many nodes; default: what the provider says (every host for `sky.SSH`),
            else 1.
        accelerator: what each node must have (``"A100"``, ``"A100:8"``); None for CPU.
        image: the nodes' environment (`sky.Image`); plugins may add to it.
        plugins: `sky.Plugin` objects, applied in order (e.g. jax, then keras).
        env: environment variables for the agents, on top of the image's.
        startup_timeout: seconds for every agent to start and pass its plugins' setup.
        shutdown_timeout: seconds a node may take to unwind at exit before it is killed.
        broadcast_grace: after one node of a broadcast fails, seconds the others get to finish
            before they are stopped (an SPMD program cannot go on without a rank).
        heartbeat_timeout: a node silent this long is declared dead.
        stream_output: print every node's output, prefixed with its node, as it arrives, and
            show the nodes' phases in a live region on a terminal; False prints no node output
            and only plain status lines (``SKYWARD_QUIET=1`` silences those too).
        output_dir: where every node's `sky.output_dir()` ends up: a local directory (node i's
            in ``<output_dir>/node-<i>``) or ``"s3://bucket/prefix"`` (the nodes upload there
            themselves). Collected when the pool ends, on every exit path, and on
            `collect_outputs`; without it, the nodes' outputs are removed with the pool.
        collect_timeout: seconds the collection of outputs at the end may take.
        on_report: called with each `sky.Report` as it arrives (they are kept in `reports` as
            well), on the thread that reads the node's replies: it must return quickly and
            must not use the pool; an exception it raises is logged on the ``skyward`` logger.
    """

    def __init__(
        self,
        provider: Provider | None = None,
        nodes: int | None = None,
        accelerator: str | None = None,
        image: Image | None = None,
        plugins: Sequence[Plugin] = (),
        env: Mapping[str, str] | None = None,
        *,
        startup_timeout: float = 300.0,
        shutdown_timeout: float = 10.0,
        broadcast_grace: float = 5.0,
        heartbeat_timeout: float = 30.0,
        stream_output: bool = True,
        output_dir: str | os.PathLike[str] | None = None,
        collect_timeout: float = 600.0,
        name: str = "pool",
        on_report: Callable[[Report], object] | None = None,
    ) -> None:
        if provider is None:
            from skyward.providers.local import Local

            provider = Local()
        if not isinstance(provider, Provider):
            raise ConfigError(f"provider must be e.g. sky.Local() or sky.SSH([...]): {provider!r}")
        if nodes is not None and (
            isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1
        ):
            raise ConfigError(f"nodes must be a whole number >= 1, got {nodes!r}")
        if image is not None and not isinstance(image, Image):
            raise ConfigError(f"image must be a sky.Image, got {type(image).__name__}")
        for plugin in plugins:
            if not isinstance(plugin, Plugin):
                raise ConfigError(
                    f"plugins must be sky.Plugin objects (e.g. sky.plugins.jax()), got {plugin!r}"
                )
        self.provider = provider
        self.plugins: tuple[Plugin, ...] = tuple(plugins)
        self.env: dict[str, str] = dict(env or {})
        self.pool_id = f"{name}-{uuid.uuid4().hex[:8]}"
        # e.g. sky.AWS(instance_type="p4d.24xlarge"): plugins must see its GPUs
        implied = None if accelerator else provider.implied_accelerator()
        chosen = Accelerator.parse(accelerator) if accelerator else implied
        # A TPU slice has one node per host: the provider may fix the size.
        nodes = provider.nodes_for(chosen, nodes)
        self.spec = ClusterSpec(
            nodes=nodes,
            pool_id=self.pool_id,
            accelerator=chosen,
            provider=provider.name,
            outputs=_outputs(output_dir),
        )
        self.provider.validate(self.spec)
        self._asked = image or Image()  # before the plugins' transforms
        self.image: Image = self._asked
        self.startup_timeout = startup_timeout
        self.shutdown_timeout = shutdown_timeout
        self.broadcast_grace = broadcast_grace
        self.heartbeat_timeout = heartbeat_timeout
        self.collect_timeout = collect_timeout
        self.console = Console(self.pool_id, nodes, provider.name, stream_output)
        self.console.activity = self._activity
        # What the nodes gave `sky.report`, in arrival order (appended to by skyward's threads).
        self.reports: list[Report] = []
        self._on_report = on_report
        self._checkpoints = Checkpoints(provider, self.console.status, self._submit)
        self.cluster: Cluster | None = None
        self.infos: list[InstanceInfo] = []
        self._dispatch = Dispatch(broadcast_grace)
        self._dispatch.stage = self._stage_data
        self._loop: LoopThread | None = None
        self._lifetime = contextlib.ExitStack()  # SIGTERM handling, around_client hooks
        self._closed = False
        self._plugins_blob = b""
        self._heartbeats: asyncio.Task[None] | None = None
        self._pings: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> ComputePool:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close(graceful=exc_type is None, failure=exc)

    def start(self) -> None:
        """Provision the nodes, build their environments, start the agents, run plugin setup."""
        if self._loop is not None:
            raise PoolClosedError("this pool was already started; create a new ComputePool")
        self._plan(self.spec)  # a plugin's failure costs nothing yet: nothing is launched
        try:
            self._plugins_blob = cloudpickle.dumps(list(self.plugins), frames.PROTOCOL)
        except Exception as exc:
            raise SerializationError(f"a plugin could not be pickled for the nodes: {exc}") from exc
        self._lifetime.enter_context(sigterm_unwinds())
        self._loop = LoopThread(f"skyward-{self.pool_id}")
        try:
            self.console.start()
            with self.console.calling():
                hooks.enter_hooks(
                    self._lifetime, self.plugins, "around_client", lambda p: p.around_client(self)
                )
                self._loop.run(self._start())
        except BaseException as exc:
            self._close(graceful=False, failure=exc)
            raise

    def close(self, graceful: bool = True) -> None:
        """Stop every agent and remove every node; safe to call again and from any state."""
        self._close(graceful, None)

    def _close(self, graceful: bool, failure: BaseException | None) -> None:
        """`close`; when `failure` is what ended the pool, it stays the error the user sees and
        a teardown problem is added to it as a note instead of replacing it."""
        if self._closed:
            return
        self._closed = True
        with self.console.calling():
            self._teardown(graceful, failure)

    def _teardown(self, graceful: bool, failure: BaseException | None) -> None:
        began = time.monotonic()
        summary: str | None = None
        try:
            if self._loop is not None:
                self.console.phase(None, Phase.STOPPING)
                busy = any(session.pending for session in self._sessions)
                timeout = self.shutdown_timeout if graceful and not busy else 0.5
                with contextlib.suppress(Exception):
                    self._loop.run(self._stop_agents(timeout))
                self._checkpoints.close()  # no copy may list a directory being removed
                collected = self._collect_at_close()
                summary = f"removing the pool failed after {duration(time.monotonic() - began)} s"
                try:
                    self._loop.run(self._terminate())
                except SkywardError as problem:
                    if failure is None:
                        raise
                    failure.add_note(f"and removing the pool then failed too: {problem}")
                else:
                    summary = self._removed(time.monotonic() - began)
                if collected is not None:
                    if failure is None or isinstance(collected, KeyboardInterrupt):
                        raise collected
                    failure.add_note(f"and collecting the outputs failed: {collected}")
        finally:
            if self._loop is not None:
                self._loop.stop()
                self.console.finish(summary)
            self._lifetime.close()

    def _removed(self, seconds: float) -> str:
        """The teardown's last line: ``removed 4 instances in 38.2 s``."""
        if self.cluster is None:
            return f"nothing was left to remove ({duration(seconds)} s)"
        return f"{self.provider.teardown_summary(self.cluster)} in {duration(seconds)} s"

    def _collect_at_close(self) -> BaseException | None:
        """Bring every node's outputs back before the nodes go; what went wrong, if anything
        (even Ctrl-C: the nodes are removed first, then it is raised)."""
        if self.spec.outputs is None or self.cluster is None or self._loop is None:
            return None
        try:
            self._loop.run(asyncio.wait_for(self._collect(), self.collect_timeout))
        except TimeoutError:
            return DataError(
                f"collecting the outputs to {self.spec.outputs} took longer than "
                f"collect_timeout={self.collect_timeout:g} s; what arrived is there",
                path=self.spec.outputs,
            )
        except BaseException as exc:
            return exc
        return None

    async def _collect(self) -> None:
        cluster = self.cluster
        assert cluster is not None, "launched first"
        await self._checkpoints.collect(cluster, [node.index for node in cluster.nodes])

    def collect_outputs(self) -> None:
        """Bring every node's `sky.output_dir()` to the pool's ``output_dir`` now (only what
        changed since the last time); the pool also does it when it ends."""
        if self.spec.outputs is None:
            raise ConfigError("this pool has no output_dir: ComputePool(output_dir=...)")
        if self._closed or self._loop is None:
            raise PoolClosedError("the pool is not running")
        with self.console.calling():
            self._loop.run(self._collect())

    def _stage_data(self, found: list[Data]) -> bool:
        """Sync each `sky.Data` of a call to the nodes; whether any placement changed."""
        if self._loop is None or self.cluster is None:
            raise PoolClosedError("the pool is not running")
        unique = list({id(d): d for d in found}.values())
        placements = self._loop.run(self._stage(unique))
        changed = [d.place(p) for d, p in zip(unique, placements, strict=True)]
        return any(changed)

    async def _stage(self, datas: list[Data]) -> list[Placement]:
        cluster = self.cluster
        assert cluster is not None, "launched first"
        return list(
            await asyncio.gather(
                *(self.provider.stage_data(cluster, d, self.console) for d in datas)
            )
        )

    async def _start(self) -> None:
        self.cluster = await self.provider.launch(self.spec, self.console)
        # Remote agents stop when the client goes quiet (cut off by the network): keep them
        # hearing from it from their Hello on.
        self._pings = asyncio.get_running_loop().create_task(
            ping_agents(lambda: self._sessions, self.heartbeat_timeout)
        )
        hardware = await self.provider.survey(self.cluster, self.image, self.console)
        if (seen := self.spec.seen(hardware)) is not self.spec:
            self._plan(seen)  # e.g. CUDA 13 drivers: the plugins choose their wheels again
        await self.provider.prepare(self.cluster, self.image, self.console)
        await self._start_agents()
        self._heartbeats = asyncio.get_running_loop().create_task(
            watch_heartbeats(lambda: self._sessions, self.heartbeat_timeout)
        )
        self.console.phase(None, Phase.READY)

    def _plan(self, spec: ClusterSpec) -> None:
        """The nodes' image for `spec`: the plugins' transforms over the pool's own image. Run
        before launch, then again if what the nodes turn out to have changes the spec."""
        self.image = hooks.transform(self.plugins, self._asked, spec)
        self.spec = replace(spec, image_hash=self.image.content_hash)

    async def _start_agents(self) -> None:
        """Start an agent on every node and take each through the handshake and the plugins."""
        cluster = self.cluster
        assert cluster is not None, "launched first"
        env = {**self.image.env, **self.env}
        self.console.phase(None, Phase.STARTING)
        streams = await asyncio.gather(*(node.start_agent(env) for node in cluster.nodes))
        earlier = {s.node: list(s.lines) for s in self._sessions}  # pool.logs() spans restarts
        self._dispatch.sessions = [
            NodeSession(
                node.index,
                stream,
                self.console.node_line,
                functools.partial(self.provider.explain, cluster, node),
                earlier.get(node.index, ()),
                self._reported,
                self.console.node_partial,
            )
            for node, stream in zip(cluster.nodes, streams, strict=True)
        ]
        self.infos = await handshake(
            self._sessions,
            cluster.nodes,
            self.spec,
            self.plugins,
            self._plugins_blob,
            [self.provider.node_output_dir(cluster, node) for node in cluster.nodes],
            self.heartbeat_timeout,
            startup_timeout=self.startup_timeout,
        )

    def replace(self, node: int) -> None:
        """Put a fresh node in place of node `node`, which died, and restart every agent.

        The provider supplies the node (a new EC2 instance, the SSH host reconnected, a new
        process). Every agent then restarts with its plugins (an SPMD program's ranks must all
        join a new coordinator together): about the cost of one pool start-up.
        """
        if self._closed or self._loop is None:
            raise PoolClosedError("the pool is not running")
        session = self._dispatch.session(node)
        if session.dead is None or session.dead.stopped:
            lost = [s.node for s in self._sessions if s.dead is not None and not s.dead.stopped]
            raise ConfigError(
                f"node {node} is not lost (it is alive, or was stopped because another node "
                f"failed); replace() takes a node that died: {lost or 'none did'}"
            )
        with self.console.calling():
            self._loop.run(self._replace(node))

    async def _replace(self, index: int) -> None:
        self.console.status(f"replacing node {index}")
        self.console.phase(index, Phase.REQUESTED)
        cluster = self.cluster
        assert cluster is not None, "launched first"
        await self.provider.replace(cluster, index)
        # The whole cluster: the others' environments are there, so that costs a check each.
        await self.provider.prepare(cluster, self.image, self.console)
        await self._stop_agents(self.shutdown_timeout)
        await self._start_agents()
        self._dispatch.broken = None
        self.console.phase(None, Phase.READY)

    async def _stop_agents(self, timeout: float) -> None:
        await asyncio.gather(*(session.close(timeout) for session in self._sessions))

    async def _terminate(self) -> None:
        for session in self._sessions:
            session.stream.kill()
        if self.cluster is not None:
            await self.provider.terminate(self.cluster)

    @property
    def nodes(self) -> list[Node]:
        """The pool's nodes, in node order (none before start)."""
        return self.cluster.nodes if self.cluster else []

    @property
    def _sessions(self) -> list[NodeSession]:
        return self._dispatch.sessions

    def _activity(self, node: int) -> tuple[Phase, str] | None:
        """What the console sees of node `node` beyond its phase, read when it draws (so a call
        pays nothing for it): a call in flight, a plugin hook, a dead agent."""
        sessions = self._sessions
        if node >= len(sessions):
            return None
        session = sessions[node]
        if session.dead is not None and not session.dead.stopped:
            return Phase.LOST, str(session.dead).splitlines()[0]
        if session.pending:
            calls = len(session.pending)
            return Phase.RUNNING, f"{calls} calls" if calls > 1 else ""
        if session.stage is Stage.IN_PLUGIN:
            return Phase.STARTING, session.where
        return None

    # -- calls -----------------------------------------------------------------------------

    def _check_open(self) -> Dispatch:
        if self._closed or not self._loop:
            raise PoolClosedError(
                "the pool is not running: use it inside `with sky.ComputePool(...) as pool:`"
            )
        if self._dispatch.broken:
            raise PoolClosedError(f"the pool cannot take more calls: {self._dispatch.broken}")
        return self._dispatch

    def submit(self, call: PendingCall[T], node: int | None = None) -> Future[T]:
        """Start `call` on one node (the next in turn, or `node`) and return its future."""
        return self._check_open().submit(call, node)

    def run(self, call: PendingCall[T], node: int | None = None) -> T:
        """Run `call` on one node and return its result (what ``call >> pool`` does)."""
        dispatch = self._check_open()
        if self.console.notebook is None:  # the common case pays one attribute read
            return dispatch.run(call, node)
        with self.console.notebook.calling(self._drain_output):
            return dispatch.run(call, node)

    def broadcast(self, call: PendingCall[T]) -> list[T]:
        """Run `call` on every node; results in node order (what ``call @ pool`` does).

        If one node fails, the others get `broadcast_grace` seconds to finish; any still running
        is then stopped (an SPMD program cannot go on without a rank) and the pool is closed.
        A node that dies stops the others at once.
        """
        dispatch = self._check_open()
        if self.console.notebook is None:
            return dispatch.broadcast(call)
        with self.console.notebook.calling(self._drain_output):
            return dispatch.broadcast(call)

    def gather(self, calls: Sequence[PendingCall[Any]]) -> tuple[Any, ...]:
        """Run several calls at once, spread over the nodes; results in call order.

        The calls are independent: one failing does not stop the others. Once all have ended,
        the first failure is raised (a node's death before a user exception).
        """
        dispatch = self._check_open()
        if self.console.notebook is None:
            return dispatch.gather(calls)
        with self.console.notebook.calling(self._drain_output):
            return dispatch.gather(calls)

    # -- output ----------------------------------------------------------------------------

    def _drain_output(self) -> None:
        """Have the loop read what the nodes' output pipes hold now: a call's last lines, written
        before its reply but read apart from it, so that they show with the call."""
        if self._loop is not None and not self._closed:
            self._loop.run(_a_few_turns())

    def _submit(self, coro: Coroutine[Any, Any, None]) -> Future[None]:
        if self._loop is None:
            coro.close()
            raise PoolClosedError("the pool is not running")
        return self._loop.submit(coro)

    def latest_checkpoint(self, timeout: float = 300.0) -> Data | None:
        """The newest checkpoint a node reported (``sky.report(..., checkpoint=path)``) as a
        `sky.Data` any node can read, e.g. to resume after `replace`; None if none was.

        Remote nodes' checkpoints must be under `sky.output_dir()` in a pool with
        ``output_dir=``: the reporting node's outputs are collected as soon as it reports, so
        the checkpoint outlives the node. Waits up to `timeout` s for that copy; a checkpoint
        whose copy failed (its node died first) is skipped for the one before it.
        """
        return self._checkpoints.latest(timeout)

    def _reported(self, report: Report) -> None:
        self.reports.append(report)
        if report.checkpoint is not None:
            self._checkpoints.reported(report, self.cluster)
        self.console.report(report)
        if self._on_report is not None:
            try:
                self._on_report(report)
            except Exception:  # the user's callback must not break the stream it runs on
                logging.getLogger("skyward").exception(
                    "on_report raised on a report from node %d", report.node
                )

    def logs(self, node: int | None = None) -> list[str]:
        """What the nodes printed: one node's lines, or every node's prefixed with its index."""
        if node is not None:
            return list(self._sessions[node].lines)  # list() copies atomically under the GIL
        return [f"(node {s.node}) {line}" for s in self._sessions for line in list(s.lines)]

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._sessions else "new"
        return f"<ComputePool {self.pool_id} {self.spec.provider} nodes={self.spec.nodes} {state}>"


async def _a_few_turns() -> None:
    # Each turn of the loop polls its readers once and runs what they have read.
    for _ in range(3):
        await asyncio.sleep(0)


def _outputs(output_dir: str | os.PathLike[str] | None) -> str | None:
    """The pool's `output_dir` as the provider takes it: an s3:// URI or an absolute path."""
    if output_dir is None:
        return None
    return location(output_dir, "output_dir").rstrip("/")
