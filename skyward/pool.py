"""`ComputePool`: provision -> build environments -> start agents -> run calls -> tear down.

The public API is synchronous. Underneath, one asyncio loop in a background thread owns every
node's stream and resolves the `concurrent.futures.Future`s callers wait on; a call's frame is
written from the caller's thread (through the stream's thread-safe `write`), which is the one
other place where threads meet.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future
from concurrent.futures import wait as wait_futures
from dataclasses import replace
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import cloudpickle

from skyward.cluster import Accelerator, ClusterSpec
from skyward.connection import AgentConnection, CallFrames
from skyward.console import Console
from skyward.errors import (
    BootstrapError,
    ConfigError,
    PluginError,
    PoolClosedError,
    SerializationError,
    SkywardError,
    WorkerError,
)
from skyward.image import Image
from skyward.info import InstanceInfo
from skyward.plugins.base import Plugin
from skyward.providers.base import Cluster, Node, NodeLoss, Provider
from skyward.transport import frames
from skyward.transport.frames import Buffer

if TYPE_CHECKING:
    from skyward.compute import PendingCall

T = TypeVar("T")
_call_ids = itertools.count(1)
READY_STAGE = "running a call"


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
        stream_output: print every node's output, prefixed with its node, as it arrives.
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
        name: str = "pool",
    ) -> None:
        if nodes is None:
            nodes = provider.default_nodes() if provider is not None else 1
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ConfigError(f"nodes must be a whole number >= 1, got {nodes!r}")
        if image is not None and not isinstance(image, Image):
            raise ConfigError(f"image must be a sky.Image, got {type(image).__name__}")
        for plugin in plugins:
            if not isinstance(plugin, Plugin):
                raise ConfigError(
                    f"plugins must be sky.Plugin objects (e.g. sky.plugins.jax()), got {plugin!r}"
                )
        if provider is None:
            from skyward.providers.local import Local

            provider = Local()
        self.provider: Provider = provider
        self.plugins: tuple[Plugin, ...] = tuple(plugins)
        self.env: dict[str, str] = dict(env or {})
        self.pool_id = f"{name}-{uuid.uuid4().hex[:8]}"
        self.spec = ClusterSpec(
            nodes=nodes,
            pool_id=self.pool_id,
            accelerator=Accelerator.parse(accelerator) if accelerator else None,
            provider=getattr(provider, "name", type(provider).__name__.lower()),
        )
        implied = provider.implied_accelerator()
        if self.spec.accelerator is None and implied is not None:
            # e.g. sky.AWS(instance_type="p4d.24xlarge"): plugins must see its GPUs
            self.spec = replace(self.spec, accelerator=implied)
        self.provider.validate(self.spec)
        self.image: Image = image or Image()
        self.startup_timeout = startup_timeout
        self.shutdown_timeout = shutdown_timeout
        self.broadcast_grace = broadcast_grace
        self.heartbeat_timeout = heartbeat_timeout
        self.console = Console(enabled=stream_output)
        self.cluster: Cluster | None = None
        self.infos: list[InstanceInfo] = []
        self._conns: list[AgentConnection] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client_hooks = contextlib.ExitStack()
        self._closed = False
        self._broken: str | None = None
        self._cursor = itertools.count()
        self._previous_sigterm: Any = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._plugins_blob = b""

    @property
    def nodes(self) -> list[Node]:
        """The pool's nodes, in node order (none before the launch)."""
        return self.cluster.nodes if self.cluster is not None else []

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
        self.close(graceful=exc_type is None)

    def start(self) -> None:
        """Provision the nodes, build their environments, start the agents, run plugin setup."""
        if self._loop is not None:
            raise PoolClosedError("this pool was already started; create a new ComputePool")
        for plugin in self.plugins:
            self.image = _run_hook(plugin, "transform", plugin.transform, self.image, self.spec)
        self.spec = replace(self.spec, image_hash=self.image.content_hash)
        try:
            plugins_blob = cloudpickle.dumps(list(self.plugins), frames.PROTOCOL)
        except Exception as exc:
            raise SerializationError(f"a plugin could not be pickled for the nodes: {exc}") from exc
        self._install_sigterm_handler()
        self._start_loop()
        try:
            for plugin in self.plugins:
                hook = _run_hook(plugin, "around_client", plugin.around_client, self)
                if hook is not None:
                    self._client_hooks.enter_context(_NamedHook(plugin.name, hook))
            self._plugins_blob = plugins_blob
            self._run(self._start(plugins_blob))
        except BaseException:
            self.close(graceful=False)
            raise

    def close(self, graceful: bool = True) -> None:
        """Stop every agent and remove every node; safe to call again and from any state."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._loop is not None:
                busy = any(conn.pending for conn in self._conns)
                timeout = self.shutdown_timeout if graceful and not busy else 0.5
                with contextlib.suppress(Exception):
                    self._run(self._stop_agents(timeout))
                self._run(self._terminate())
        finally:
            self._stop_loop()
            self._client_hooks.close()
            self._restore_sigterm_handler()

    async def _start(self, plugins_blob: bytes) -> None:
        self.console.status(
            f"{self.pool_id}: launching {self.spec.nodes} node(s) on {self.spec.provider}"
        )
        self.cluster = await self.provider.launch(self.spec, self.console.build_log)
        await self.provider.prepare(self.cluster, self.image, self.console.build_log)
        await self._start_agents(plugins_blob)
        self._heartbeat_task = asyncio.get_running_loop().create_task(self._watch_heartbeats())
        self.console.status(f"{self.pool_id}: ready ({self.spec.nodes} node(s))")

    async def _start_agents(self, plugins_blob: bytes) -> None:
        """Start an agent on every node and take each through the handshake and the plugins."""
        env = {**self.image.env, **self.env}
        streams = await asyncio.gather(*(node.start_agent(env) for node in self.nodes))
        earlier = {conn.node: list(conn.lines) for conn in self._conns}
        self._conns = [
            AgentConnection(
                node.index, stream, self.console.node_line, self._node_died, self._explainer(node)
            )
            for node, stream in zip(self.nodes, streams, strict=True)
        ]
        for conn in self._conns:  # pool.logs() keeps what the nodes printed before a restart
            conn.lines.extendleft(reversed(earlier.get(conn.node, [])))
        try:
            await asyncio.wait_for(self._handshake(plugins_blob), self.startup_timeout)
        except TimeoutError:
            raise BootstrapError(
                self._stuck_report(
                    "the pool did not become ready within "
                    f"startup_timeout={self.startup_timeout:g} s"
                )
            ) from None

    def replace(self, node: int) -> None:
        """Put a fresh node in place of node `node`, which died, and restart every agent.

        The provider supplies the new node (a new EC2 instance; the same host, reconnected, for
        SSH; a new process for Local). Every agent then starts again, plugins included: an SPMD
        program's ranks must all join a new ``jax.distributed`` coordinator together. The
        environments are already built, so this costs about one pool start-up.
        """
        if self._closed or self._loop is None:
            raise PoolClosedError("the pool is not running")
        if not 0 <= node < len(self._conns):
            raise ConfigError(f"node must be in 0..{len(self._conns) - 1}, got {node}")
        dead = self._conns[node].dead
        if dead is None or dead.stopped:
            lost = [c.node for c in self._conns if c.dead is not None and not c.dead.stopped]
            raise ConfigError(
                f"node {node} is not lost (it is alive, or was stopped because another node "
                f"failed); replace() takes a node that died: {lost or 'none did'}"
            )
        self._run(self._replace(node))

    async def _replace(self, index: int) -> None:
        self.console.status(f"{self.pool_id}: replacing node {index}")
        assert self.cluster is not None
        await self.provider.replace(self.cluster, index)
        await self.provider.prepare(self.cluster, self.image, self.console.build_log)
        await self._stop_agents(self.shutdown_timeout)
        await self._start_agents(self._plugins_blob)
        self._broken = None
        self.console.status(f"{self.pool_id}: node {index} replaced; ready")

    async def _handshake(self, plugins_blob: bytes) -> None:
        started = await asyncio.gather(*(self._expect(c, frames.STARTED) for c in self._conns))
        versions = {meta[5] for meta in started}
        from skyward import __version__

        if versions != {__version__}:
            raise BootstrapError(
                f"the nodes run skyward {sorted(versions)} but this client runs {__version__}"
            )
        head_port = started[0][3]
        peers = tuple(node.private_addr for node in self.nodes)
        accelerator = self.spec.accelerator
        self.infos = [
            InstanceInfo(
                node=node.index,
                total_nodes=len(self.nodes),
                head_addr=peers[0],
                head_port=head_port,
                peers=peers,
                pool_id=self.pool_id,
                accelerator=accelerator.name if accelerator else None,
                accelerator_count=accelerator.count if accelerator else 0,
                provider=self.spec.provider,
            )
            for node in self.nodes
        ]
        for conn, info in zip(self._conns, self.infos, strict=True):
            conn.stage = "setting up plugins"
            conn.send((frames.HELLO, info, {}), [plugins_blob])
        await asyncio.gather(*(self._expect(c, frames.READY) for c in self._conns))
        for conn in self._conns:
            conn.stage = READY_STAGE

    async def _expect(self, conn: AgentConnection, kind: int) -> frames.Meta:
        """Wait for a startup message from one agent, following its progress on the way."""
        while True:
            meta = await conn.control.get()
            if meta is None:
                error = conn.dead or WorkerError(
                    f"node {conn.node} ended during startup", node=conn.node
                )
                plugin = conn.stage.split("'")[1] if conn.stage.startswith("in plugin") else None
                others = self._laggards(conn, plugin)
                if others:
                    error = WorkerError(
                        "\n".join([str(error), *others]),
                        node=error.node,
                        exit_status=error.exit_status,
                        output_tail=error.output_tail,
                    )
                raise error
            if meta[0] == kind:
                if kind == frames.READY:
                    conn.stage = READY_STAGE
                return meta
            if meta[0] == frames.PROGRESS:
                conn.stage = f"in plugin {meta[1]!r} {meta[2]}"
            elif meta[0] == frames.HOOK_FAILED:
                raise self._hook_failed(conn, meta)

    def _hook_failed(self, conn: AgentConnection, meta: frames.Meta) -> PluginError:
        _, plugin, hook, type_name, message, remote_tb = meta
        lines = [f"plugin {plugin!r} failed in {hook} on node {conn.node}: {type_name}: {message}"]
        lines += self._laggards(conn, plugin)
        lines.append(f"remote traceback of node {conn.node}:\n{remote_tb.rstrip()}")
        return PluginError("\n".join(lines), plugin=plugin, hook=hook, node=conn.node)

    def _laggards(self, failed: AgentConnection, plugin: str | None) -> list[str]:
        """Where the other nodes were when `failed` failed in `plugin`: often the real culprit."""
        lines = []
        for other in self._conns:
            if other is failed or other.stage == READY_STAGE:
                continue
            if plugin is not None and f"{plugin!r}" not in other.stage:
                lines.append(
                    f"node {other.node} never reached plugin {plugin!r}: it was "
                    f"{other.stage}; its last output:"
                )
            else:
                lines.append(f"node {other.node} was {other.stage}; its last output:")
            lines += [f"    {line}" for line in list(other.lines)[-10:]] or ["    (nothing)"]
        return lines

    def _stuck_report(self, headline: str) -> str:
        lines = [headline + ":"]
        for conn in self._conns:
            if conn.stage != READY_STAGE:
                lines.append(f"node {conn.node} is {conn.stage}; its last output:")
                lines += [f"    {line}" for line in list(conn.lines)[-10:]] or ["    (nothing)"]
        lines.append("Raise startup_timeout if the nodes only need more time.")
        return "\n".join(lines)

    async def _stop_agents(self, timeout: float) -> None:
        await asyncio.gather(*(conn.close(timeout) for conn in self._conns))

    async def _terminate(self) -> None:
        for conn in self._conns:
            conn.stream.kill()
        if self.cluster is not None:
            await self.provider.terminate(self.cluster)

    async def _watch_heartbeats(self) -> None:
        while not self._closed:
            await asyncio.sleep(min(1.0, self.heartbeat_timeout / 4))
            now = time.monotonic()
            for conn in self._conns:
                silent = now - conn.last_seen
                if conn.dead is None and silent > self.heartbeat_timeout:
                    conn.fail(
                        f"node {conn.node} sent no word for {silent:.0f} s (heartbeat_timeout="
                        f"{self.heartbeat_timeout:g} s): the node or its network is down"
                    )

    def _explainer(self, node: Node) -> Callable[[], Awaitable[NodeLoss | None]] | None:
        cluster = self.cluster
        if cluster is None:
            return None
        return lambda: self.provider.explain(cluster, node)

    def _node_died(self, conn: AgentConnection, error: WorkerError) -> None:
        self.console.node_line(conn.node, f"[skyward] {str(error).splitlines()[0]}")

    # -- the loop thread -------------------------------------------------------------------

    def _start_loop(self) -> None:
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        self._thread = threading.Thread(target=run, name=f"skyward-{self.pool_id}", daemon=True)
        self._thread.start()
        ready.wait()
        self._loop = loop

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel_rest(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        if not thread.is_alive():
            loop.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def _install_sigterm_handler(self) -> None:
        # SIGTERM would end the process without unwinding `with`; make it unwind instead.
        if threading.current_thread() is not threading.main_thread():
            return

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            raise SystemExit(128 + signum)

        self._previous_sigterm = signal.signal(signal.SIGTERM, on_sigterm)

    def _restore_sigterm_handler(self) -> None:
        if self._previous_sigterm is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    # -- calls -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed or self._loop is None:
            raise PoolClosedError(
                "the pool is not running: use it inside `with sky.ComputePool(...) as pool:`"
            )
        if self._broken:
            raise PoolClosedError(f"the pool cannot take more calls: {self._broken}")

    def _live(self) -> list[AgentConnection]:
        live = [conn for conn in self._conns if conn.dead is None]
        if not live:
            raise PoolClosedError("every node of the pool has died; start a new pool")
        return live

    def _frames(self, call: PendingCall[Any], segments: list[Buffer]) -> CallFrames:
        fn_id, fn_bytes = call.function.serialized()
        return CallFrames(next(_call_ids), fn_id, fn_bytes, segments)

    def submit(self, call: PendingCall[T], node: int | None = None) -> Future[T]:
        """Start `call` on one node (the next in turn, or `node`) and return its future."""
        return self._submit(call, node)[1]

    def _submit(self, call: PendingCall[T], node: int | None) -> tuple[AgentConnection, Future[T]]:
        self._check_open()
        payload = call.serialized_args()
        if node is None:
            live = self._live()
            conn = live[next(self._cursor) % len(live)]
        else:
            if not 0 <= node < len(self._conns):
                raise ConfigError(f"node must be in 0..{len(self._conns) - 1}, got {node}")
            conn = self._conns[node]
        future: Future[T] = Future()
        conn.submit([(self._frames(call, payload), future)])
        return conn, future

    def run(self, call: PendingCall[T], node: int | None = None) -> T:
        """Run `call` on one node and return its result (what ``call >> pool`` does)."""
        conn, future = self._submit(call, node)
        read_here = getattr(conn.stream, "read_until", None)
        if read_here is not None:
            # A local agent's reply is read by this thread itself: no hand-off on the way back.
            read_here(future.done)
        return future.result()

    def broadcast(self, call: PendingCall[T]) -> list[T]:
        """Run `call` on every node; results in node order (what ``call @ pool`` does).

        If one node fails, the others get `broadcast_grace` seconds to finish; any still running
        is then stopped (an SPMD program cannot go on without a rank) and the pool is closed.
        A node that dies stops the others at once.
        """
        self._check_open()
        payload = call.serialized_args()
        dead = [conn.node for conn in self._conns if conn.dead is not None]
        if dead:
            raise PoolClosedError(f"a broadcast needs every node, and node(s) {dead} died")
        frames_ = self._frames(call, payload)  # encoded once, written to every node
        futures: list[Future[Any]] = [Future() for _ in self._conns]
        for conn, future in zip(self._conns, futures, strict=True):
            conn.submit([(frames_, future)])
        return self._collect(futures, list(self._conns), spmd=True)

    def gather(self, calls: Sequence[PendingCall[Any]]) -> tuple[Any, ...]:
        """Run several calls at once, spread over the nodes; results in call order.

        The calls are independent: one failing does not stop the others. Once all have ended,
        the first failure is raised (a node's death before a user exception).
        """
        self._check_open()
        payloads = [call.serialized_args() for call in calls]
        live = self._live()
        start = next(self._cursor)
        owners = [live[(start + i) % len(live)] for i in range(len(calls))]
        futures: list[Future[Any]] = [Future() for _ in calls]
        batches: dict[int, list[tuple[CallFrames, Future[Any]]]] = {}
        for conn, call, payload, future in zip(owners, calls, payloads, futures, strict=True):
            batches.setdefault(conn.node, []).append((self._frames(call, payload), future))
        for conn in live:  # one write per node, however many calls it takes
            if conn.node in batches:
                conn.submit(batches[conn.node])
        return tuple(self._collect(futures, owners, spmd=False))

    def _collect(
        self, futures: list[Future[Any]], owners: list[AgentConnection], spmd: bool
    ) -> list[Any]:
        """Wait for every future; raise the root failure.

        `spmd` (a broadcast): the calls depend on each other, so a failure stops the rest.
        Otherwise (a gather) the calls are independent and all run to their end.
        """
        self._read_replies_here(owners, futures, spmd)
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
            grace = 0.0 if isinstance(error, WorkerError) else self.broadcast_grace
            _, running = wait_futures(running, timeout=grace)
            if running:
                self._break(
                    f"node {owners[futures.index(first)].node} failed ({type(error).__name__}) "
                    "while the others were still running, and they were stopped; start a new pool",
                    [conn for conn, f in zip(owners, futures, strict=True) if not f.done()],
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

    def _read_replies_here(
        self, owners: list[AgentConnection], futures: list[Future[Any]], spmd: bool
    ) -> None:
        """Read local agents' replies in this thread, as `run` does (no hand-off per reply).

        Stops at the first failure of a broadcast, so the SPMD rules below apply at once.
        """
        streams = list({id(conn.stream): conn.stream for conn in owners}.values())
        read_many = getattr(streams[0], "read_many_until", None)
        if read_many is None or len({type(stream) for stream in streams}) > 1:
            return

        # Completions are counted as they happen: polling every future after each read would
        # cost a lock per future per read, which on a broadcast is most of the client's work.
        finished: list[Future[Any]] = []
        failures: list[Future[Any]] = []

        def on_done(future: Future[Any]) -> None:
            if future.exception() is not None:
                failures.append(future)
            finished.append(future)  # list.append is atomic: replies may resolve on any thread

        for future in futures:
            future.add_done_callback(on_done)

        def settled() -> bool:
            return len(finished) == len(futures) or (spmd and bool(failures))

        read_many(streams, settled)

    def _break(self, reason: str, stop: list[AgentConnection]) -> None:
        assert self._loop is not None
        self._broken = self._broken or reason

        def abort_all() -> None:
            for conn in stop:
                conn.abort(reason)

        self._loop.call_soon_threadsafe(abort_all)
        wait_futures([f for conn in stop for f in list(conn.pending.values())], timeout=5)

    # -- output ----------------------------------------------------------------------------

    def logs(self, node: int | None = None) -> list[str]:
        """What the nodes printed: one node's lines, or every node's prefixed with its index."""
        if node is not None:
            return list(self._conns[node].lines)  # list() copies atomically under the GIL
        return [f"(node {c.node}) {line}" for c in self._conns for line in list(c.lines)]

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._conns else "new"
        return f"<ComputePool {self.pool_id} {self.spec.provider} nodes={self.spec.nodes} {state}>"


class _NamedHook(contextlib.AbstractContextManager[Any]):
    """A plugin's `around_client` context whose failures name the plugin."""

    def __init__(self, plugin: str, inner: contextlib.AbstractContextManager[Any]) -> None:
        self._plugin = plugin
        self._inner = inner

    def __enter__(self) -> Any:
        try:
            return self._inner.__enter__()
        except SkywardError:
            raise
        except Exception as exc:
            raise PluginError(
                f"plugin {self._plugin!r} failed entering around_client: "
                f"{type(exc).__name__}: {exc}",
                plugin=self._plugin,
                hook="around_client",
            ) from exc

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        try:
            return self._inner.__exit__(exc_type, exc, tb)
        except SkywardError:
            raise
        except Exception as error:
            if error is exc:
                raise
            raise PluginError(
                f"plugin {self._plugin!r} failed leaving around_client: "
                f"{type(error).__name__}: {error}",
                plugin=self._plugin,
                hook="around_client",
            ) from error


def _blame_rank(error: BaseException | None) -> int:
    if isinstance(error, WorkerError):
        return 2 if error.stopped else 0
    return 1


def _run_hook(plugin: Plugin, hook: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except SkywardError:
        raise
    except Exception as exc:
        raise PluginError(
            f"plugin {plugin.name!r} failed in {hook}: {type(exc).__name__}: {exc}",
            plugin=plugin.name,
            hook=hook,
        ) from exc
