"""`ComputePool`: provision -> build environments -> start agents -> run calls -> tear down.

The pool keeps the lifecycle and hands the rest to a part each: what is settled before launch
(`plan`), the calls (`Dispatch`), files in and out (`Transfers`), what the nodes do and print
(`activity`), the end (`teardown`). docs/architecture.md follows a call from here to a node.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypeVar

from skyward import checks
from skyward.client import activity, plan, recovery, shutdown, spend
from skyward.client.dispatch import Dispatch
from skyward.client.handshake import handshake
from skyward.client.session import NodeSession, ping_agents, watch_heartbeats
from skyward.client.stalls import watch_stalls
from skyward.client.transfers import Transfers
from skyward.console.console import Console
from skyward.console.progress import Phase
from skyward.cost import Cost, Price
from skyward.data import RESUME_ENV, Data
from skyward.errors import BudgetExceeded, ConfigError, NoCapacity, PoolClosedError
from skyward.hardware import ClusterSpec
from skyward.history import Recorder
from skyward.image import Image
from skyward.info import InstanceInfo
from skyward.plugins import hooks
from skyward.plugins.base import Plugin
from skyward.providers.base import Capability, Cluster, Node, Provider
from skyward.providers.local import Local
from skyward.reports import Report
from skyward.transport.eventloop import LoopThread, sigterm_unwinds
from skyward.worker.tensorboard import TensorBoard

if TYPE_CHECKING:
    from skyward.calls import PendingCall

# Seconds the pool waits for its price before launch (a first GCP lookup reads the whole
# Compute Engine catalog; it is cached after).
PRICE_TIMEOUT = 60.0

T = TypeVar("T")
P = ParamSpec("P")


class ComputePool:
    """A pool of nodes that run `@sky.compute` functions; use it as a context manager.

    Args:
        provider: where nodes come from; default `sky.Local()` (processes on this machine). A
            list (``[sky.AWS(...), sky.GCP(...)]``) fails over: when one has no room for the
            pool in any of its locations (`sky.NoCapacity`), the next is tried.
        nodes: how many nodes; default: what the provider says (every host for `sky.SSH`),
            else 1.
        accelerator: what each node must have (``"A100"``, ``"A100:8"``); None for CPU.
        processes_per_node: the ranks on each node, each its own agent process, as torchrun's
            ``--nproc-per-node``; a call `@ pool` runs on every rank and returns one result
            per rank, in global rank order (node 0's first). Default: one per GPU of a node
            with the torch plugin (or ``keras(backend="torch")``), one per node otherwise (JAX,
            CPU nodes). No more than the GPUs each node is asked for.
        image: the nodes' environment (`sky.Image`); plugins may add to it.
        plugins: `sky.Plugin` objects, applied in order (e.g. jax, then keras).
        env: environment variables for the agents, on top of the image's.
        startup_timeout: seconds for every agent to start and pass its plugins' setup.
        shutdown_timeout: seconds a node may take to unwind at exit before it is killed.
        broadcast_grace: after one node of a broadcast fails, seconds the others get to finish
            before they are stopped (an SPMD program cannot go on without a rank).
        heartbeat_timeout: a node silent this long is declared dead.
        stall_timeout: seconds the calls may run with none finishing and no node reporting
            (`sky.report`) before the pool shows every node's stacks and fails the node(s)
            in a call whose stack did not move in a second (a rank stuck in a collective), or
            that did not answer; one whose stack moved is working and goes on. None: no watch.
        restarts: how many times a broadcast that failed because a node died, was preempted
            or stalled is run again: the lost nodes replaced (the others keep their hosts),
            every agent restarted, and `sky.resume_from()` on the nodes the newest checkpoint
            reported with `sky.report(..., checkpoint=)`. 0: fail at once.
        restart_on: exception types raised by the function itself that are restarted too (by
            default a user error is not: a restart would repeat it).
        stream_output: print every node's output, prefixed with its node, as it arrives, and
            show the nodes' phases in a live region on a terminal; False prints no node output
            and only plain status lines (``SKYWARD_QUIET=1`` silences those too).
        output_dir: where every node's `sky.output_dir()` ends up: a local directory (node i's
            in ``<output_dir>/node-<i>``, each of its ranks' in ``rank-<r>`` there when it
            holds several) or ``"s3://bucket/prefix"`` (the nodes upload there
            themselves). Collected when the pool ends, on every exit path, and on
            `collect_outputs`; without it, the nodes' outputs are removed with the pool.
        collect_timeout: seconds the collection of outputs at the end may take.
        max_cost: a budget in US dollars. The pool's price is asked before launch (the cloud's
            price APIs; `cost`); a budget that does not cover every node's first minute is
            refused, 80% of it gets a warning, and once it is spent the running call is
            stopped, the pool torn down and `sky.BudgetExceeded` raised. Spend counts each
            machine from when it is granted (the instance runs, the allocation starts: not a
            queue's wait) at the price of what was launched (spot or on-demand, its zone), at
            least 60 s each, as the clouds bill.
        prefer: with several providers, the order they are tried in: ``"order"`` (as given) or
            ``"price"`` (cheapest pool first, by each provider's `price`; unknown prices last).
        on_report: called with each `sky.Report` as it arrives (they are kept in `reports` as
            well), on the thread that reads the node's replies: it must return quickly and
            must not use the pool; an exception it raises is logged on the ``skyward`` logger.
    """

    def __init__(
        self,
        provider: Provider | Sequence[Provider] | None = None,
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
        stall_timeout: float | None = None,
        restarts: int = 0,
        restart_on: Sequence[type[BaseException]] = (),
        stream_output: bool = True,
        output_dir: str | os.PathLike[str] | None = None,
        collect_timeout: float = 600.0,
        name: str = "pool",
        on_report: Callable[[Report], object] | None = None,
        max_cost: float | None = None,
        prefer: Literal["order", "price"] = "order",
        processes_per_node: int | None = None,
    ) -> None:
        listed = _providers(provider, nodes, image, plugins)
        # The ranks per node asked for (None: the plugins' default, `plan.ranks_per_node`,
        # settled with the nodes' GPUs); the spec holds the number in use.
        self._ranks = plan.processes_per_node(processes_per_node, accelerator)
        self._prefer = checks.one_of(prefer, "prefer", ("order", "price"))
        self.provider = listed[0]
        self.plugins: tuple[Plugin, ...] = tuple(plugins)
        self.env = checks.environment(env, "env")
        self.pool_id = f"{checks.text(name, 'name')}-{uuid.uuid4().hex[:8]}"
        # How the dashboard lists it: its name=, else its id.
        self.listed_as = name if name != "pool" else self.pool_id
        self.keeps_history = True  # whether the dashboard's history records it
        # Where the pool may start, each with its spec; `provider`/`spec` are the one in use.
        self._candidates = plan.candidates(listed, self.pool_id, nodes, accelerator, output_dir)
        self.spec = self._candidates[0][1]
        for _, spec in self._candidates:  # an instance type's GPUs (sky.AWS(instance_type=))
            plan.fits_gpus(self._ranks, spec.accelerator)
        self._asked = image or Image()  # before the plugins' transforms
        self.image: Image = self._asked
        self._timeouts(
            startup_timeout, shutdown_timeout, broadcast_grace, heartbeat_timeout, collect_timeout
        )
        self.stall_timeout = (
            None if stall_timeout is None else checks.seconds(stall_timeout, "stall_timeout")
        )
        self._policy = recovery.Policy(
            checks.whole(restarts, "restarts", minimum=0), _exception_types(restart_on)
        )
        self._resume: dict[str, str] = {}  # the agents' env after a restart: what to resume
        self._refuse_unserved()
        self._parts(stream_output, max_cost, on_report)
        self._not_started()

    def _timeouts(
        self, startup: float, shutdown: float, grace: float, heartbeat: float, collect: float
    ) -> None:
        self.startup_timeout = checks.seconds(startup, "startup_timeout")
        self.shutdown_timeout = checks.seconds(shutdown, "shutdown_timeout", zero=True)
        self.broadcast_grace = checks.seconds(grace, "broadcast_grace", zero=True)
        self.heartbeat_timeout = checks.seconds(heartbeat, "heartbeat_timeout")
        self.collect_timeout = checks.seconds(collect, "collect_timeout")

    def _refuse_unserved(self) -> None:
        """A feature a candidate provider cannot serve is refused now, before anything starts."""
        for candidate, spec in self._candidates:
            if self._policy.restarts:
                candidate.require(Capability.REPLACE, f"restarts={self._policy.restarts}", spec)
            if self.stall_timeout is not None:
                candidate.require(Capability.SIGNALS, f"stall_timeout={self.stall_timeout:g}", spec)

    def _parts(
        self,
        stream_output: bool,
        max_cost: float | None,
        on_report: Callable[[Report], object] | None,
    ) -> None:
        """The pool's parts, made before it starts: its console, dispatch, bill, transfers,
        and where reports go (their settings checked first)."""
        if max_cost is not None:
            max_cost = checks.dollars(max_cost, "max_cost", zero=False)
        if on_report is not None and not callable(on_report):
            raise ConfigError(f"on_report must be a function of a sky.Report, got {on_report!r}")
        stream_output = checks.flag(stream_output, "stream_output")
        self.console = Console(self.pool_id, self.spec.nodes, self.provider.name, stream_output)
        self._dispatch = Dispatch(self.broadcast_grace)
        self.console.activity = functools.partial(activity.node_activity, self._dispatch)
        self._bill = spend.Bill(spend.Meter(Price.unknown("not asked yet"), max_cost))
        self.console.spending = self._bill.so_far
        self.console.billing = self._bill.granted
        self._over_budget: BudgetExceeded | None = None  # set when max_cost was spent
        self._watching_budget = False
        self._transfers = Transfers(
            self.provider, self.console, self.spec.outputs, self.collect_timeout
        )
        self._dispatch.stager = self._transfers.stage
        # What the nodes gave `sky.report`, in arrival order (appended to by skyward's threads).
        self.reports: list[Report] = []
        self._tensorboard = TensorBoard(self.spec.outputs)
        self._reported = activity.report_sink(
            self.reports, self._transfers.reported, self.console, on_report, self._tensorboard
        )

    def _not_started(self) -> None:
        """Its life's state before `start`: no cluster, no loop, not closed."""
        self.cluster: Cluster | None = None
        self.infos: list[InstanceInfo] = []
        self._loop: LoopThread | None = None
        self._lifetime = contextlib.ExitStack()  # SIGTERM handling, around_client hooks
        self._closed = False
        self._closing = threading.Lock()  # one teardown; a second close waits for it
        self._start_task: asyncio.Task[None] | None = None
        self._plugins_blob = b""
        self._watchers: list[asyncio.Task[None]] = []  # the loop holds its tasks weakly

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
        # A plugin's failure costs nothing yet: nothing is launched.
        self.image, self.spec = plan.plan(self.plugins, self._asked, self.spec, self._ranks)
        self._plugins_blob = plan.pickled(self.plugins)
        self._lifetime.enter_context(sigterm_unwinds())
        self._loop = self._transfers.loop = LoopThread(f"skyward-{self.pool_id}")
        try:
            self._record_history()
            self.console.start()
            with self.console.calling():
                hooks.enter_hooks(
                    self._lifetime, self.plugins, "around_client", lambda p: p.around_client(self)
                )
                self._loop.run(self._start())
        except BaseException as exc:
            self._close(graceful=False, failure=exc)
            if self._over_budget is not None:
                raise self._over_budget from exc
            raise

    def close(self, graceful: bool = True, keep_nodes: bool = False) -> None:
        """Stop every agent and remove every node; safe to call again and from any state.
        With `keep_nodes` the nodes stay up (`Provider.release`): a detached run holds them."""
        self._close(graceful, None, keep_nodes)

    def _close(
        self, graceful: bool, failure: BaseException | None, keep_nodes: bool = False
    ) -> None:
        """`close`; `failure` is what ended the pool, if anything did (see `teardown`)."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
            try:
                self._tear_down(graceful, failure, keep_nodes)
            finally:
                self._tensorboard.close()
                self._end_history(failure)

    def _tear_down(self, graceful: bool, failure: BaseException | None, keep_nodes: bool) -> None:
        with self.console.calling():
            try:
                if self._loop is not None:
                    shutdown.tear_down(
                        loop=self._loop,
                        console=self.console,
                        provider=self.provider,
                        cluster=self.cluster,
                        sessions=self._sessions,
                        transfers=self._transfers,
                        shutdown_timeout=self.shutdown_timeout,
                        graceful=graceful,
                        failure=failure,
                        cost=self._bill.closed,
                        keep_nodes=keep_nodes,
                    )
            finally:
                self._lifetime.close()

    def _record_history(self) -> None:
        """Keep what the console shows in the history the dashboard reads (`skyward.history`);
        a cache that cannot be written costs the pool its history, nothing more."""
        if not self.keeps_history:
            return
        try:
            recorder = Recorder(self.pool_id, self.listed_as, self.provider.name, self.spec.nodes)
            recorder.costing = self._bill.dollars
            recorder.start()
        except OSError as exc:
            logging.getLogger("skyward").warning("the pool's history is not kept: %s", exc)
            return
        self.console.history = recorder

    def _end_history(self, failure: BaseException | None) -> None:
        recorder, self.console.history = self.console.history, None
        if recorder is None:
            return
        recorder.update(provider=self.provider.name, nodes=self.spec.nodes)
        if failure is None:
            recorder.end("succeeded")
        elif isinstance(failure, KeyboardInterrupt | SystemExit):
            recorder.end("stopped", type(failure).__name__)
        else:
            first = str(failure).strip().splitlines()
            recorder.end("failed", f"{type(failure).__name__}: {first[0] if first else ''}")

    def collect_outputs(self) -> None:
        """Bring every node's `sky.output_dir()` to the pool's ``output_dir`` now (only what
        changed since the last time); the pool also does it when it ends."""
        if self.spec.outputs is None:
            raise ConfigError("this pool has no output_dir: ComputePool(output_dir=...)")
        if self._closed or self._loop is None:
            raise PoolClosedError("the pool is not running")
        with self.console.calling():
            self._transfers.collect()

    async def _start(self) -> None:
        self._start_task = asyncio.current_task()
        self.cluster = self._transfers.cluster = await self._launch()
        # Remote agents stop when the client goes quiet (cut off by the network): keep them
        # hearing from it from their Hello on.
        self._watchers.append(
            asyncio.create_task(ping_agents(lambda: self._sessions, self.heartbeat_timeout))
        )
        hardware = await self.provider.survey(self.cluster, self.image, self.console)
        if (seen := self.spec.seen(hardware)) is not self.spec:
            # e.g. CUDA 13 drivers: the plugins choose their wheels again (and GPUs found where
            # none was named: a rank for each under PyTorch)
            self.image, self.spec = plan.plan(self.plugins, self._asked, seen, self._ranks)
        await self.provider.prepare(self.cluster, self.image, self.console)
        await self._start_agents()
        self._watchers.append(
            asyncio.create_task(watch_heartbeats(lambda: self._sessions, self.heartbeat_timeout))
        )
        if self.stall_timeout is not None:
            self._watchers.append(
                asyncio.create_task(
                    watch_stalls(lambda: self._sessions, self.stall_timeout, self.console.status)
                )
            )
        self.console.phase(None, Phase.READY)

    async def _start_agents(self) -> None:
        """Start an agent for every rank of every node (`processes_per_node` a node, in rank
        order) and take each through the handshake and the plugins."""
        cluster = self.cluster
        assert cluster is not None, "launched first"
        env = {**self.image.env, **self.env, **self._resume}
        self.console.phase(None, Phase.STARTING)
        per_node = self.spec.processes_per_node
        ranks = [node for node in cluster.nodes for _ in range(per_node)]
        streams = await asyncio.gather(*(node.start_agent(env) for node in ranks))
        earlier = {s.rank: list(s.lines) for s in self._sessions}  # pool.logs() spans restarts
        self._dispatch.ranks_per_node = self.console.ranks_per_node = per_node
        self._dispatch.sessions = [
            NodeSession(
                node.index,
                stream,
                self.console.node_line,
                functools.partial(self.provider.explain, cluster, node),
                earlier.get(rank, ()),
                self._reported,
                self.console.node_partial,
                self._noticed,
                rank=rank if per_node > 1 else None,
            )
            for rank, (node, stream) in enumerate(zip(ranks, streams, strict=True))
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

    async def _launch(self) -> Cluster:
        """The nodes, from the first provider with room (one, or each of a list in turn)."""
        order = self._candidates
        if self._prefer == "price" and len(order) > 1:
            order = await _cheapest_first(order)
        failed: list[tuple[str, NoCapacity]] = []
        refused: ConfigError | None = None
        for provider, spec in order:
            self._use(provider, spec)
            try:
                await self._price()
            except ConfigError as exc:  # the budget cannot be kept there: the next may do
                if len(order) == 1:
                    raise
                refused = refused or exc
                self.console.status(f"{provider.name}: {exc}; trying the next provider")
                continue
            try:
                cluster = await provider.launch(self.spec, self.console)
            except NoCapacity as exc:
                self._bill.let_go()
                if len(order) == 1:
                    raise
                failed.append((provider.name, exc))
                self.console.status(f"{provider.name} had no room for the pool; trying the next")
                continue
            self._bill.settled(range(len(cluster.nodes)))
            if line := self._bill.launched_line():
                self.console.status(line)
            return cluster
        if not failed and refused is not None:
            raise refused  # not one provider could keep the budget
        raise NoCapacity(
            "no provider could start the pool; nothing was left running:\n"
            + "\n".join(f"  {name}: {line}" for name, exc in failed for line in _lines(exc)),
            attempts=[
                (f"{name} {where}", said) for name, exc in failed for where, said in exc.attempts
            ],
        )

    def _use(self, provider: Provider, spec: ClusterSpec) -> None:
        """Start the pool on `provider` (one of several when it fails over)."""
        if provider is self.provider:
            return
        self.provider = provider
        self.image, self.spec = plan.plan(self.plugins, self._asked, spec, self._ranks)
        self.console.provider = provider.name
        if self.console.history is not None:
            self.console.history.update(provider=provider.name, nodes=self.spec.nodes)
        self._transfers.use(provider)
        self.console.status(f"launching {self.spec.nodes} node(s) on {provider.name}")

    async def _price(self) -> None:
        """Ask the pool's price, keep the budget (nothing is launched when it cannot be kept)
        and say both; the nodes are billed as they are granted (`Progress.granted`)."""
        meter = self._bill.meter
        self._bill.quoted(await _price_of(self.provider, self.spec))
        meter.check_start(self.spec.nodes)
        self.console.status(self._bill.price_line(self.spec.nodes))
        if meter.max_cost is not None and not self._watching_budget:
            self._watching_budget = True
            self._watchers.append(
                asyncio.create_task(
                    spend.watch_budget(meter, self.console.status, self._budget_spent)
                )
            )

    def _budget_spent(self, error: BudgetExceeded) -> None:
        """On the loop, once `max_cost` is spent: the running call is stopped and the pool
        torn down (a launch under way is cancelled, and removes what it made)."""
        self._over_budget = error
        self.console.status(str(error))
        self._dispatch.broken = self._dispatch.broken or str(error)
        for session in self._sessions:
            session.abort("the pool's max_cost was spent")
        if self._start_task is not None and not self._start_task.done():
            self._start_task.cancel()  # `start` tears down what was made
            return
        threading.Thread(
            target=self._close, args=(False, error), name=f"skyward-{self.pool_id}-budget"
        ).start()

    @property
    def cost(self) -> Cost:
        """What the pool costs: one node's price (what was launched, once it was), the rate
        now, what it has spent so far (each machine from its grant, at its own price, at least
        60 s each), and its `max_cost`."""
        return self._bill.meter.cost()

    def _noticed(self, node: int) -> None:
        """A node got a preemption notice: with restarts left, its replacement starts now, so
        it is on its way before the node is gone, where the provider can start one ahead
        (`Capability.PRESTART`; from any thread)."""
        if self._policy.restarts <= 0 or self._loop is None or self._closed:
            return
        if Capability.PRESTART in self.provider.capabilities_for(self.spec):
            self._loop.submit(self._prestart(node))

    async def _prestart(self, index: int) -> None:
        cluster = self.cluster
        if cluster is None:
            return
        try:
            started = await self.provider.prestart(cluster, index)
        except Exception as exc:  # the replacement is made when the node is lost instead
            self.console.status(f"could not start node {index}'s replacement ahead: {exc}")
            return
        if started:  # billed from its grant, which the provider reports
            self.console.status(f"node {index} is being preempted: its replacement is starting")

    def replace(self, node: int) -> None:
        """Put a fresh node in place of node `node`, which died, and restart every agent.

        The provider supplies the node (a new EC2 instance, the SSH host reconnected, a new
        process). Every agent then restarts with its plugins (an SPMD program's ranks must all
        join a new coordinator together): about the cost of one pool start-up.
        """
        if self._closed or self._loop is None:
            raise PoolClosedError("the pool is not running")
        if not 0 <= node < len(self.nodes):
            raise ConfigError(f"node must be in 0..{len(self.nodes) - 1}, got {node}")
        if node not in (lost := activity.lost(self._sessions)):
            raise ConfigError(
                f"node {node} is not lost (it is alive, or was stopped because another node "
                f"failed); replace() takes a node that died: {lost or 'none did'}"
            )
        with self.console.calling():
            self._loop.run(self._replace(node))

    async def _replace(self, index: int) -> None:
        self.console.status(f"replacing node {index}")
        await self._recover([index])

    async def _recover(self, lost: Sequence[int]) -> None:
        """Replace the `lost` nodes and start every agent again (an SPMD program's ranks must
        all join a new coordinator together)."""
        await self._replace_lost(lost)
        await self._restart_agents()

    async def _replace_lost(self, lost: Sequence[int]) -> None:
        cluster = self.cluster
        assert cluster is not None, "launched first"
        for index in lost:
            self.console.phase(index, Phase.REQUESTED)
            self._bill.replaced(index)
            await self.provider.replace(cluster, index)
            self._bill.settled([index])
        if lost:  # the whole cluster: the others' environments are there, a check each
            await self.provider.prepare(cluster, self.image, self.console)

    async def _restart_agents(self) -> None:
        await shutdown.stop_agents(self._sessions, self.shutdown_timeout)
        await self._start_agents()
        self._dispatch.broken = None
        self.console.phase(None, Phase.READY)

    def _restart(self, error: BaseException, attempt: int) -> None:
        """Restart number `attempt` of a failed broadcast (see `restarts`)."""
        lost = activity.lost(self._sessions)
        first = (str(error).splitlines() or [type(error).__name__])[0].rstrip(".")
        what = f"replacing node(s) {lost}" if lost else "restarting every agent"
        self.console.status(
            f"restart {attempt} of {self._policy.restarts} after {type(error).__name__}: "
            f"{first}; {what}"
        )
        assert self._loop is not None
        with self.console.calling():
            # Every agent is stopped and its stream read to the end before the checkpoint is
            # chosen: a survivor's report written just before the loss may still be on its way
            # (over SSH it races the lost node's end), and it is the newest.
            self._loop.run(shutdown.stop_agents(self._sessions, self.shutdown_timeout))
            checkpoint = self._transfers.latest_checkpoint(self.collect_timeout)
            self._loop.run(self._replace_lost(lost))
            if checkpoint is not None:  # onto every node, the replacements included
                self._transfers.stage([checkpoint])
                self._resume = {RESUME_ENV: json.dumps(checkpoint.placement)}
                self.console.status(f"resuming from {checkpoint.source}")
            self._loop.run(self._restart_agents())

    @property
    def nodes(self) -> list[Node]:
        """The pool's nodes, in node order (none before start)."""
        return self.cluster.nodes if self.cluster else []

    @property
    def _sessions(self) -> list[NodeSession]:
        return self._dispatch.sessions

    # -- calls -----------------------------------------------------------------------------

    def _check_open(self) -> Dispatch:
        if self._closed or not self._loop:
            raise PoolClosedError(
                "the pool is not running: use it inside `with sky.ComputePool(...) as pool:`"
            )
        if self._dispatch.broken:
            raise PoolClosedError(f"the pool cannot take more calls: {self._dispatch.broken}")
        return self._dispatch

    def submit(
        self, call: PendingCall[T], node: int | None = None, *, rank: int | None = None
    ) -> Future[T]:
        """Start `call` on one rank (the next in turn, rank `rank`, or node `node`'s first)
        and return its future."""
        return self._check_open().submit(call, node, rank)

    def run(self, call: PendingCall[T], node: int | None = None, *, rank: int | None = None) -> T:
        """Run `call` on one rank (the next in turn, rank `rank`, or node `node`'s first) and
        return its result (what ``call >> pool`` does)."""
        result: T = self._calling(self._check_open().run, call, node, rank)
        return result

    def broadcast(self, call: PendingCall[T]) -> list[T]:
        """Run `call` on every rank; results in rank order, node 0's ranks first (what ``call
        @ pool`` does; with one rank per node, one result per node in node order).

        If one rank fails, the others get `broadcast_grace` seconds to finish; any still
        running is then stopped (an SPMD program cannot go on without a rank) and the pool is
        closed. A rank that dies stops the others at once, on every node. With `restarts`, a
        lost node is replaced, with all its ranks, and the call run again, resumed from the
        newest reported checkpoint.
        """
        if not self._policy.restarts:  # nothing to retry: the call goes straight through
            return self._calling(self._check_open().broadcast, call)
        return recovery.with_restarts(
            lambda: self._calling(self._check_open().broadcast, call), self._policy, self._restart
        )

    def gather(self, calls: Sequence[PendingCall[Any]]) -> tuple[Any, ...]:
        """Run several calls at once, spread over the ranks; results in call order.

        The calls are independent: one failing does not stop the others. Once all have ended,
        the first failure is raised (a node's death before a user exception).
        """
        return self._calling(self._check_open().gather, calls)

    def _calling(self, method: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`method(*args)`; in a notebook, with what the nodes print meanwhile in the cell."""
        notebook = self.console.notebook
        try:
            if notebook is None:  # the common case pays one attribute read
                return method(*args, **kwargs)
            with notebook.calling(self._drain_output):
                return method(*args, **kwargs)
        except Exception as exc:
            if self._over_budget is not None:  # the budget stopped the call
                raise self._over_budget from exc
            raise

    # -- output ----------------------------------------------------------------------------

    def _drain_output(self) -> None:
        """Show a call's last lines with it (see `activity.drain_output`)."""
        if self._loop is not None and not self._closed:
            activity.drain_output(self._loop)

    def latest_checkpoint(self, timeout: float = 300.0) -> Data | None:
        """The newest checkpoint a node reported (``sky.report(..., checkpoint=path)``) as a
        `sky.Data` any node can read, e.g. to resume after `replace`; None if none was.

        Remote nodes' checkpoints must be under `sky.output_dir()` in a pool with
        ``output_dir=``: the reporting node's outputs are collected as soon as it reports, so
        the checkpoint outlives the node. Waits up to `timeout` s for that copy; a checkpoint
        whose copy failed (its node died first) is skipped for the one before it.
        """
        return self._transfers.latest_checkpoint(timeout)

    def stacks(self, timeout: float = 5.0) -> dict[int, str]:
        """Every live rank's Python stacks, thread by thread, by rank (the node, with one rank
        per node): what a hang investigation starts with. The agents answer from a signal
        handler, so a rank stuck in a collective or a C extension answers too; one that does
        not within `timeout` seconds gets a line saying so."""
        self._check_open()
        return activity.stacks(self._sessions, timeout)

    def logs(self, node: int | None = None) -> list[str]:
        """What the nodes printed: one node's lines, or every node's prefixed with its index
        (each rank's with ``(node i rank r)`` where nodes hold several ranks)."""
        return activity.logs(self._sessions, node)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._sessions else "new"
        return f"<ComputePool {self.pool_id} {self.spec.provider} nodes={self.spec.nodes} {state}>"


def _providers(
    provider: Provider | Sequence[Provider] | None,
    nodes: int | None,
    image: Image | None,
    plugins: Sequence[Plugin],
) -> list[Provider]:
    """The providers a pool may start on, in order, each checked against the pool's settings
    (`plan.checked`); None is the embedded default, Local."""
    asked = [provider] if provider is None or isinstance(provider, Provider) else provider
    if isinstance(asked, str) or not isinstance(asked, Sequence):
        raise ConfigError(f"provider must be e.g. sky.Local() or a list of them: {provider!r}")
    listed = [plan.checked(Local() if p is None else p, nodes, image, plugins) for p in asked]
    if not listed:
        raise ConfigError("provider=[] names no provider: give one, or a list to fail over")
    return listed


async def _price_of(provider: Provider, spec: ClusterSpec) -> Price:
    try:
        return await asyncio.wait_for(provider.price(spec), PRICE_TIMEOUT)
    except TimeoutError:
        return Price.unknown(f"the price lookup took longer than {PRICE_TIMEOUT:g} s")


async def _cheapest_first(
    candidates: list[tuple[Provider, ClusterSpec]],
) -> list[tuple[Provider, ClusterSpec]]:
    """`candidates` by the price of their pool, cheapest first; unknown prices last, in the
    order given."""
    prices = await asyncio.gather(*(_price_of(p, spec) for p, spec in candidates))

    def key(item: tuple[int, Price]) -> tuple[bool, float, int]:
        index, price = item
        nodes = candidates[index][1].nodes
        return (price.per_hour is None, (price.per_hour or 0.0) * nodes, index)

    return [candidates[i] for i, _ in sorted(enumerate(prices), key=key)]


def _lines(error: BaseException) -> list[str]:
    """A provider's `NoCapacity` without its first line: a line per location."""
    return [line.strip() for line in str(error).splitlines()[1:] if line.startswith("  ")]


def _exception_types(types: object) -> tuple[type[BaseException], ...]:
    """`restart_on`: a list of exception classes (one class is not a list of them)."""
    if isinstance(types, type) or not isinstance(types, Sequence) or isinstance(types, str):
        raise ConfigError(f"restart_on must be a list of exception types, got {types!r}")
    for kind in types:
        if not (isinstance(kind, type) and issubclass(kind, BaseException)):
            raise ConfigError(f"restart_on must hold exception types (e.g. OSError), got {kind!r}")
    return tuple(types)
