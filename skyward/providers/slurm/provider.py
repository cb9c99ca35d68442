"""The Slurm provider: a pool is one allocation of N nodes, each node's agent a job step.

`launch` runs ``salloc`` through the login (this machine, or a login node over SSH) with a
holding command that prints the granted nodes and then reads its stdin until it closes: the
pool keeps that stdin open for its life, so the allocation ends when the pool does, and also when
the client dies in any way (its pipe or SSH channel closes, the holder returns, salloc gives the
nodes back), with no reliance on the time limit. While the job pends, the console shows
``squeue``'s reason; a pool with ``price_per_hour`` pays for its nodes from the allocation's
start (`Progress.granted`), not for the wait. Each node is a `SlurmNode`: the remote
bootstrap runs on it through ``srun --overlap`` steps, and so does the agent, whose stdio is the
step's, so the pool talks to it through the same pipe (or SSH channel) transport as a Local or
SSH node.

On a cluster whose nodes share the cache directory (a shared home: the usual case), node 0
prepares the environment first and the others find it built; otherwise each node builds its own.
`terminate` cancels the job (``scancel``) and closes the holder's stdin, on every exit path.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata as metadata
import os
import re
import secrets
import shlex
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from skyward import checks
from skyward.cachedir import cache_root
from skyward.console.progress import Phase, Progress
from skyward.cost import Price
from skyward.data import S3_SCHEME, Data, Placement
from skyward.errors import ConfigError, ProvisionError
from skyward.hardware import Accelerator, ClusterSpec, Hardware
from skyward.image import Image
from skyward.providers.base import (
    Capability,
    Cluster,
    LivePool,
    Log,
    Node,
    NodeLoss,
    count,
    given_rate,
    local_outputs,
    output_path,
)
from skyward.providers.environment import env_spec
from skyward.providers.remote import bootstrap, connect, datasync, hoststeps
from skyward.providers.remote.bootstrap import RemoteNode
from skyward.providers.remote.hoststeps import CACHE
from skyward.providers.remote.replacing import (
    Made,
    ReplacingCluster,
    ReplacingProvider,
    drop_spares,
)
from skyward.providers.slurm import commands, jobs
from skyward.providers.slurm.login import Held, LocalLogin, Login, SSHLogin
from skyward.providers.slurm.steps import SlurmNode, StepHost
from skyward.transport.sshhost import Endpoint, KnownHosts
from skyward.worker import hostcheck, treestore
from skyward.worker.objectstore import Store, store_root

T = TypeVar("T")

# How often the pending job's reason is read while it waits.
PENDING_POLL_SECONDS = 2.0
# How long a Slurm command (squeue, scontrol, scancel) may take before it is given up on.
COMMAND_SECONDS = 30.0
# Words of a node's state (``scontrol show node``) that mean it runs no more of the pool's work.
UNUSABLE = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING")


@dataclass
class Allocation:
    """One job of the pool: its id (once salloc names it) and the holding salloc."""

    held: Held
    job_id: str = ""
    stderr: asyncio.Future[None] | None = None  # salloc's stderr, read until it ends


@dataclass
class SlurmCluster(ReplacingCluster):
    """A pool's allocations (the first for every node; one more per replaced node) and the
    login the commands go through; its `tell` is the pool's console (a replacement's pending
    reason)."""

    login: Login | None = None
    allocations: list[Allocation] = field(default_factory=list)
    shared_cache: bool | None = None  # whether the nodes share one cache directory
    client_shares: bool = False  # whether it is this machine's own (login=None, shared home)

    @property
    def job_id(self) -> str:
        """The pool's first job: every node's but the replacements'."""
        return self.allocations[0].job_id if self.allocations else ""


class Slurm(ReplacingProvider):
    """Nodes from a Slurm cluster: one allocation of N nodes, one agent per node as a job step.

    Args:
        partition: the partition to allocate from (default: the cluster's default one).
        account: the account to charge (default: the user's default account).
        time_limit: the allocation's time limit, in seconds or as Slurm writes it
            (``"2:00:00"``, ``"1-00:00:00"``); default: the partition's.
        login: ``None`` when this machine can run the Slurm commands (a login node, with
            ``SLURM_CONF`` as you have it), or ``"user@host[:port]"``, a login node reached
            over SSH with verified host keys.
        qos: the quality of service to ask for.
        gres: the generic resources per node, verbatim (``"gpu:4"`` on a site without GPU
            types); default: from the pool's accelerator (``A100:4`` -> ``gpu:a100:4``).
        options: more allocation options as sbatch and salloc take them
            (``["--constraint=ib", "--exclusive"]``).
        pending_timeout: seconds to wait for a pending allocation before giving up; default:
            wait, showing Slurm's reason (Priority, Resources, QOS...) in the console.
        python: the interpreter on the compute nodes (default ``python3``).
        key, known_hosts, connect_timeout, config: how to log into `login` (as `sky.SSH`).
        keepalive: with `login`, seconds between SSH keepalives, and between the lines the
            allocation's holder on the login node must hear: four missed, it ends the
            allocation (a client asleep or cut off whose connection the login node keeps).
        uv_version, build_env: as `sky.SSH`: the uv to install, and the build steps' env.
        price_per_hour: what one node costs you per hour, in US dollars (a site's charge
            rate), if anything: the pool then counts its spend and can keep a `max_cost`.
    """

    name = "slurm"
    capabilities = frozenset(
        {Capability.REPLACE, Capability.PRESTART, Capability.SIGNALS, Capability.LIST}
    )

    def __init__(
        self,
        partition: str | None = None,
        account: str | None = None,
        time_limit: float | str | None = None,
        login: str | None = None,
        *,
        qos: str | None = None,
        gres: str | None = None,
        options: Sequence[str] = (),
        pending_timeout: float | None = None,
        python: str | None = None,
        key: str | os.PathLike[str] | None = None,
        known_hosts: KnownHosts = None,
        connect_timeout: float = 10.0,
        keepalive: float = 15.0,
        config: Sequence[str] | None = None,
        uv_version: str | None = None,
        build_env: Mapping[str, str] | None = None,
        price_per_hour: float | None = None,
    ) -> None:
        self._price = given_rate(price_per_hour, "sky.Slurm")
        if isinstance(options, str):
            raise ConfigError("options must be a list of strings, e.g. ['--constraint=ib']")
        self.partition = checks.optional_text(partition, "sky.Slurm(partition=)")
        self.account = checks.optional_text(account, "sky.Slurm(account=)")
        self.time_limit = _time_limit(time_limit)
        self.qos = checks.optional_text(qos, "sky.Slurm(qos=)")
        self.gres = checks.optional_text(gres, "sky.Slurm(gres=)")
        # How this site's partition is asked for each accelerator (`_find_gres`).
        self._site_gres: dict[Accelerator, str] = {}
        self.options = checks.texts(options, "sky.Slurm(options=)")
        self.pending_timeout = (
            None
            if pending_timeout is None
            else checks.seconds(pending_timeout, "sky.Slurm(pending_timeout=)")
        )
        login = checks.optional_text(login, "sky.Slurm(login=)")
        self.login = Endpoint.parse(login, None, 22) if login else None
        self.connect_options = connect.login_options(
            key, known_hosts, config, connect_timeout, keepalive
        )
        self.keepalive = keepalive
        self.bootstrap = hoststeps.Bootstrap(
            python,
            metadata.version("uv") if uv_version is None else uv_version,
            checks.environment(build_env, "build_env"),
        )

    def find(self) -> dict[str, jobs.PoolJob]:
        """This user's pools' jobs in the queue, by pool id (`skyward ls --provider slurm`)."""
        return asyncio.run(self._with_login(jobs.find))

    def cleanup(self, pool: str | None = None) -> list[str]:
        """Cancel the job of `pool` (of every pool with None): what a crashed client left."""
        return asyncio.run(self._with_login(lambda login: jobs.cancel(login, pool)))

    def live_pools(self) -> list[LivePool]:
        """This user's pools' jobs in the queue (``skyward status``): squeue is asked for this
        user's jobs only."""
        where = f"{self.name:<6} {self.login or 'here'}"
        return [LivePool.of(where, job) for _, job in sorted(self.find().items())]

    async def _with_login(self, work: Callable[[Login], Awaitable[T]]) -> T:
        login = await self._open_login()
        try:
            return await work(login)
        finally:
            await login.close()

    async def price(self, spec: ClusterSpec) -> Price:
        return self._price

    def validate(self, spec: ClusterSpec) -> None:
        if spec.accelerator is not None and spec.accelerator.is_tpu:
            raise ConfigError("a Slurm pool cannot ask for a TPU; use sky.GCP for TPU slices")

    def _request(self, spec: ClusterSpec) -> commands.Request:
        return commands.Request(
            job_name=f"{jobs.JOB_PREFIX}{spec.pool_id}",
            comment=f"skyward pool {spec.pool_id}",
            nodes=spec.nodes,
            partition=self.partition,
            account=self.account,
            qos=self.qos,
            time_limit=self.time_limit,
            gres=self._gres(spec.accelerator),
            options=self.options,
        )

    def batch_command(
        self, cluster: Cluster, spec: ClusterSpec, run: str, script: str, output: str
    ) -> list[str]:
        """The ``sbatch`` command line of detached run `run` on the pool `spec` described (the
        same partition, account, time limit, GRES and options), its job named for the run.
        The run's logs are kept in the cache this machine shares with the nodes: refused when
        `cluster`'s nodes do not share it."""
        if not _slurm(cluster).client_shares:
            raise ConfigError(
                "a detached Slurm run needs this machine to share its cache directory with the "
                "nodes (the client on the login node, with a shared home or SKYWARD_CACHE_DIR "
                "on a shared filesystem): the nodes keep the run's logs there. Run it attached "
                "instead"
            )
        request = dataclasses.replace(
            self._request(spec),
            job_name=f"{jobs.JOB_PREFIX}run-{run}",
            comment=f"skyward detached run {run}",
        )
        return request.sbatch(script, output)

    def _gres(self, accelerator: Accelerator | None) -> str | None:
        """The GRES per node: `gres` as the user wrote it; else the form `_find_gres` found
        that the site has for the accelerator; else the typed one (``gpu:a100:4``)."""
        if self.gres:
            return self.gres
        if accelerator in self._site_gres:
            return self._site_gres[accelerator]
        return commands.gres_for(accelerator)

    async def _find_gres(self, login: Login, accelerator: Accelerator | None) -> None:
        """Read the partition's GRES (``sinfo``) and choose how to ask for the accelerator:
        ``gpu:<type>:<n>`` where the site has that GPU type, ``gpu:<n>`` where its GPUs have
        no type; a `ConfigError` naming what the partition has where it lacks the type, before
        anything is queued. Kept for `_request`, so that a replacement asks as the launch did.
        Skipped with `gres` given (it is the user's, verbatim), and where sinfo does not
        answer (salloc then judges the typed form)."""
        if self.gres or accelerator is None or commands.gres_for(accelerator) is None:
            return
        partition = f" -p {shlex.quote(self.partition)}" if self.partition else ""
        try:
            out = await self._command(login, f"sinfo -h -o '%P %G'{partition}")
        except (ProvisionError, TimeoutError):
            return
        if not out.strip():  # a partition that does not exist: salloc says so in its words
            return
        where = f"partition {self.partition!r}" if self.partition else "the default partition"
        listed = commands.partition_gres(out, self.partition)
        self._site_gres[accelerator] = commands.gres_request(accelerator, listed, where)

    async def _open_login(self) -> Login:
        if self.login is None:
            return LocalLogin()
        return SSHLogin(await self.connect_options.connect(self.login), self.keepalive)

    async def launch(self, spec: ClusterSpec, progress: Progress) -> Cluster:
        login = await self._open_login()
        cluster = SlurmCluster(spec, [], login=login, tell=progress)
        try:
            await self._find_gres(login, spec.accelerator)
            request = self._request(spec)
            for index in range(spec.nodes):
                progress.phase(index, Phase.BOOTING, "asking Slurm for the allocation")
            hosts = await self._allocate(cluster, request, progress)
            for index, host in enumerate(hosts):
                cluster.nodes.append(SlurmNode(index, host))
                progress.phase(index, Phase.CONNECTING, str(host))
        except BaseException:
            await self._release(cluster)
            raise
        return cluster

    # A lost node (`ReplacingProvider.replace`): where its machine is still the job's and
    # healthy (the agent died, not the node), a new step in the same job on it; otherwise a
    # node from a new one-node allocation (Slurm does not grow a running job), on none of the
    # pool's machines, started ahead on a preemption notice (`prestart`) where one came.
    # Either way the rest of the pool keeps its job, which survives a node's loss
    # (``--no-kill``).

    async def reuse(self, pool: ReplacingCluster, index: int) -> Node | None:
        slurm = _slurm(pool)
        assert slurm.login is not None
        lost = slurm.nodes[index]
        if isinstance(lost, SlurmNode) and await self._still_in_job(slurm.login, lost.step_host):
            return SlurmNode(index, lost.step_host)
        return None

    async def make_node(self, pool: ReplacingCluster, index: int) -> Made:
        slurm = _slurm(pool)
        # One node per machine, as at launch, on none of the pool's machines: node `index`'s
        # own is going (a notice: `prestart`) or gone.
        taken = ",".join(n.step_host.name for n in slurm.nodes if isinstance(n, SlurmNode))
        request = self._request(dataclasses.replace(slurm.spec, nodes=1))
        if taken:
            request = dataclasses.replace(request, options=(*self.options, f"--exclude={taken}"))
        (host,) = await self._allocate(slurm, request, slurm.tell, index)
        return Made(SlurmNode(index, host), host.name)

    async def _still_in_job(self, login: Login, host: StepHost) -> bool:
        """Whether `host`'s machine is up, in its job, and the job still runs."""
        try:
            state, _ = commands.node_state(
                await self._command(login, f"scontrol -o show node {shlex.quote(host.name)}")
            )
            if any(word in state for word in UNUSABLE):
                return False
            out = await self._command(login, f"squeue -h -j {host.job_id} -o '%T %N'")
            job_state, _, nodelist = out.strip().partition(" ")
            return job_state == "RUNNING" and host.name in await self._hostnames(login, nodelist)
        except Exception:
            return False

    async def _allocate(
        self,
        cluster: SlurmCluster,
        request: commands.Request,
        progress: Progress,
        node: int | None = None,
    ) -> list[StepHost]:
        """One more allocation for `cluster`, held open: a host for each of its nodes (for
        pool node `node` alone, or every node with None: whose console line shows the wait)."""
        login = cluster.login
        assert login is not None
        if isinstance(login, SSHLogin):
            request = dataclasses.replace(request, idle_seconds=login.idle_seconds)
        allocation = Allocation(await login.hold(shlex.join(request.salloc())))
        cluster.allocations.append(allocation)
        granted = await self._granted(allocation, login, progress, node)
        began = time.time()  # the allocation's start: what the queue's wait cost nothing
        allocation.job_id = granted.job_id
        names = await self._hostnames(login, granted.nodelist)
        addresses = commands.node_addresses(
            await self._command(login, "scontrol -o show node " + ",".join(names))
        )
        hosts = []
        for name, cpus in zip(names, granted.cpus_per_node(len(names)), strict=True):
            host = StepHost(login, granted.job_id, name, addresses.get(name, name), cpus)
            host.gres = request.gres
            hosts.append(host)
        for index in range(len(hosts)) if node is None else [node]:
            progress.granted(index, at=began)
        return hosts

    async def _granted(
        self, allocation: Allocation, login: Login, progress: Progress, node: int | None
    ) -> commands.Granted:
        """Wait for the holder's line; meanwhile read salloc's stderr for the job id and its
        errors, and show why the job pends."""
        errors: list[str] = []
        held = allocation.held

        async def read_stderr() -> None:
            while line := await held.stderr_line():
                errors.append(line.rstrip())
                job = commands.job_id_in(line)
                if job and not allocation.job_id:
                    allocation.job_id = job

        async def read_stdout() -> commands.Granted | None:
            while line := await held.stdout_line():
                granted = commands.Granted.parse(line)
                if granted is not None:
                    return granted
            return None

        stderr = asyncio.ensure_future(read_stderr())
        waiting = asyncio.ensure_future(read_stdout())
        loop = asyncio.get_running_loop()
        started, shown = loop.time(), ""
        try:
            while not waiting.done():
                await asyncio.wait({waiting}, timeout=PENDING_POLL_SECONDS)
                if waiting.done():
                    break
                if allocation.job_id:
                    shown = await self._show_pending(
                        login, allocation.job_id, progress, node, shown
                    )
                if (
                    self.pending_timeout is not None
                    and loop.time() - started > self.pending_timeout
                ):
                    raise ProvisionError(
                        f"Slurm job {allocation.job_id or '?'} was still pending after "
                        f"{self.pending_timeout:g} s ({shown or 'no reason given'}); it was "
                        "cancelled. Ask for fewer nodes, another partition, or wait longer "
                        "(pending_timeout=None waits)"
                    )
            granted = waiting.result()
            if granted is None:  # salloc ended without granting
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(stderr), 5)
                raise self._refused(errors)
            return granted
        finally:
            waiting.cancel()
            # salloc keeps writing to stderr ("Relinquishing..."): read on until it ends.
            allocation.stderr = stderr

    def _refused(self, errors: list[str]) -> Exception:
        found = commands.refusal(errors)
        asked = ", ".join(
            f"{name}={value!r}"
            for name, value in (
                ("partition", self.partition),
                ("account", self.account),
                ("qos", self.qos),
                ("gres", self.gres),
            )
            if value
        )
        if found is None:
            tail = "\n".join(errors[-10:]) or "(no output)"
            return ProvisionError(f"salloc ended without an allocation:\n{tail}")
        text, ours = found
        if ours:
            return ConfigError(
                f"Slurm refused the allocation: {text}"
                + (f" (asked: {asked})" if asked else "")
                + ". `sinfo -s` lists the partitions, `sacctmgr show assoc user=$USER` your "
                "accounts"
            )
        return ProvisionError(f"Slurm refused the allocation: {text}")

    async def _show_pending(
        self, login: Login, job_id: str, progress: Progress, node: int | None, shown: str
    ) -> str:
        with contextlib.suppress(Exception):
            out = await self._command(login, f"squeue -h -j {job_id} -o '%T %r'")
            state, _, reason = out.strip().partition(" ")
            if state == "PENDING":
                detail = f"job {job_id} pending: {reason or 'no reason given'}"
                if detail != shown:
                    progress.phase(node, Phase.BOOTING, detail)
                return detail
        return shown

    async def _hostnames(self, login: Login, nodelist: str) -> list[str]:
        out = await self._command(login, f"scontrol show hostnames {shlex.quote(nodelist)}")
        return out.split()

    async def _command(self, login: Login, command: str) -> str:
        done = await asyncio.wait_for(login.run(command), COMMAND_SECONDS)
        if done.status != 0:
            raise ProvisionError(f"`{command}` failed (exit status {done.status}): {done.tail}")
        return done.stdout.decode(errors="replace")

    async def survey(self, cluster: Cluster, image: Image, progress: Progress) -> Hardware:
        slurm = _slurm(cluster)
        checks = bootstrap.survey_nodes(cluster, image, self.bootstrap, progress)
        if slurm.shared_cache is not None:
            return await checks
        if not isinstance(slurm.login, LocalLogin):
            # No cache of this machine's to share: node 0's token, asked beside the checks.
            hardware, shared = await bootstrap.all_or_none(checks, _shares_cache(slurm))
            assert isinstance(hardware, Hardware) and isinstance(shared, bool)
            self._shared(slurm, shared, progress)
            return hardware
        # Whether the nodes see this machine's cache is read by the host check itself (the
        # token the client writes there, in its report): a step more per node cost about a
        # third of a pool's start (benchmarks/README.md, bench_slurm.py).
        token = _write_client_token()
        hardware = await checks
        nodes = bootstrap.remote_nodes(slurm)
        reports = [n.checked[1] for n in nodes if n.checked]
        slurm.client_shares = len(reports) == len(nodes) and all(
            r.client_token == token for r in reports
        )
        await self._find_shared_cache(slurm, progress)
        return hardware

    async def _find_shared_cache(self, slurm: SlurmCluster, progress: Progress) -> None:
        """Whether the nodes share one cache directory: this machine's (known from the host
        check), or one of their own, where node 0's token is read by the others."""
        if slurm.shared_cache is None:
            self._shared(slurm, slurm.client_shares or await _shares_cache(slurm), progress)

    def _shared(self, slurm: SlurmCluster, shared: bool, progress: Progress) -> None:
        slurm.shared_cache = shared
        if shared and len(slurm.nodes) > 1:
            progress("the nodes share one cache directory: one environment serves them all")

    async def prepare(self, cluster: Cluster, image: Image, progress: Progress) -> None:
        slurm = _slurm(cluster)
        await self._find_shared_cache(slurm, progress)
        nodes = bootstrap.remote_nodes(slurm)
        if slurm.shared_cache and len(nodes) > 1 and not _ready(nodes[0], image):
            # Node 0 builds; the others, checked before it did, look again and find it built.
            first = Cluster(slurm.spec, slurm.nodes[:1])
            await bootstrap.prepare_nodes(first, image, self.bootstrap, progress)
            for node in nodes[1:]:
                node.checked = None
        await bootstrap.prepare_nodes(slurm, image, self.bootstrap, progress)

    async def stage_data(self, cluster: Cluster, data: Data, log: Log) -> Placement:
        """Where the client shares the nodes' cache (a shared home, the client on the login
        node), the tree is built once into it and the nodes find it there; otherwise it is
        streamed through the login's SSH connection into a step on each node (on node 0 only
        when the nodes share one cache)."""
        if data.is_s3:
            return ("s3", data.source)
        slurm = _slurm(cluster)
        if not slurm.client_shares:
            if not slurm.shared_cache:
                return await datasync.stage_tree(cluster, data, log)
            first = Cluster(cluster.spec, cluster.nodes[:1])
            placement = await datasync.stage_tree(first, data, log)
            for node in bootstrap.remote_nodes(cluster):
                node.trees.add(placement[1])
            return placement
        root = data.existing_path()
        manifest = await asyncio.to_thread(treestore.scan, root)
        await asyncio.to_thread(treestore.import_tree, root, manifest, Store(store_root()))
        single = manifest.entries[0].path if manifest.single else ""
        return ("tree", manifest.digest, single)

    async def collect_outputs(self, cluster: Cluster, nodes: Sequence[int], log: Log) -> None:
        """Copied from the cache the client shares with the nodes; otherwise pulled through
        the login's SSH connection from a step on each node, or uploaded by the nodes to
        s3://."""
        outputs = cluster.spec.outputs
        if outputs is None:
            return
        if outputs.startswith(S3_SCHEME) or not _slurm(cluster).client_shares:
            await datasync.collect_outputs(cluster, nodes, outputs)
            return
        await asyncio.to_thread(_copy_outputs, cluster, nodes)

    def teardown_summary(self, cluster: Cluster) -> str:
        jobs = [a.job_id for a in _slurm(cluster).allocations if a.job_id]
        if not jobs:
            return "no allocation was made"
        which = f"job {jobs[0]}" if len(jobs) == 1 else f"jobs {', '.join(jobs)}"
        return f"cancelled {which} ({count(len(cluster.nodes), 'node')})"

    def detached_kind(self) -> str:
        if self.login is not None:
            raise ConfigError(
                "a detached Slurm run is submitted from the login node itself: run "
                "`skyward run --detach` there (without --login)"
            )
        return "slurm"

    async def terminate(self, cluster: Cluster) -> None:
        await self._release(_slurm(cluster))

    async def _release(self, cluster: SlurmCluster) -> None:
        """Cancel the jobs and end their holders; idempotent, bounded, never raises. What the
        pool wrote in the nodes' cache goes first, while the allocations still run steps."""
        login = cluster.login
        if login is None:
            return
        await drop_spares(cluster)  # a spare's allocation is among those cancelled below
        if cluster.client_shares:
            await asyncio.to_thread(shutil.rmtree, _client_outputs(cluster), True)
        elif cluster.nodes and cluster.job_id:
            with contextlib.suppress(Exception):
                await datasync.remove_outputs(cluster)
        jobs = " ".join(shlex.quote(a.job_id) for a in cluster.allocations if a.job_id)
        if jobs and not login.closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(login.run(f"scancel {jobs}"), COMMAND_SECONDS)
        for allocation in cluster.allocations:
            allocation.held.release()
        for allocation in cluster.allocations:
            with contextlib.suppress(Exception):
                await allocation.held.wait(10)
            if allocation.stderr is not None:  # its end: salloc's pipes are closed
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(allocation.stderr, 2)
        with contextlib.suppress(Exception):
            await login.close()

    async def explain(self, cluster: Cluster, node: Node) -> NodeLoss | None:
        slurm = _slurm(cluster)
        if slurm.login is None or slurm.login.closed or not isinstance(node, SlurmNode):
            return None
        name = node.step_host.name
        job_id = node.step_host.job_id
        # Both at once: the pool gives an explanation a few seconds (session.EXPLAIN_SECONDS),
        # which a loaded login node's two commands in turn could overrun.
        out, job_state = await asyncio.gather(
            self._command(slurm.login, f"scontrol -o show node {shlex.quote(name)}"),
            _settled_state(slurm.login, job_id),
        )
        state, reason = commands.node_state(out)
        # (The pool's job is salloc's, which Slurm never requeues: preempted, it is cancelled.)
        if job_state in {"PREEMPTED", "SUSPENDED"}:
            return NodeLoss(f"Slurm preempted job {job_id} ({job_state})", preempted=True)
        if any(word in state for word in UNUSABLE):
            why = f": {reason}" if reason else ""
            return NodeLoss(f"Slurm node {name} is {state}{why}")
        if job_state != "RUNNING":
            return NodeLoss(f"Slurm job {job_id} is {job_state}")
        return None


async def _settled_state(login: Login, job_id: str, seconds: float = 2.0) -> str:
    """The job's state once it is past COMPLETING (the steps being killed), or as it is after
    `seconds`: "PREEMPTED", "TIMEOUT", "RUNNING"...; "ENDED" once Slurm forgot it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while True:
        # -t all: a job that ended (preempted, timed out) stays listed a while (MinJobAge)
        done = await asyncio.wait_for(
            login.run(f"squeue -h -t all -j {shlex.quote(job_id)} -o %T"), COMMAND_SECONDS
        )
        state = done.stdout.decode(errors="replace").strip() or "ENDED"
        if state != "COMPLETING" or loop.time() >= deadline:
            return state
        await asyncio.sleep(0.2)


def _slurm(cluster: Cluster) -> SlurmCluster:
    if not isinstance(cluster, SlurmCluster):
        raise TypeError(f"{cluster!r} is not a Slurm pool's cluster")
    return cluster


def _ready(node: RemoteNode, image: Image) -> bool:
    """Whether the node's host check (for `image`) found nothing to build or copy."""
    if node.checked is None or node.checked[0] != env_spec(image).hash:
        return False
    report = node.checked[1]
    return report.src and not report.apt_missing and (bool(report.satisfied) or bool(report.env))


def _client_outputs(cluster: Cluster) -> Path:
    """The pool's outputs in this machine's cache (the nodes', when it is shared)."""
    return Path(cache_root()).absolute() / "outputs" / cluster.spec.pool_id


def _copy_outputs(cluster: Cluster, nodes: Sequence[int]) -> None:
    for index in nodes:
        source = Path(cache_root()).absolute() / output_path(cluster, index)
        if source.is_dir():
            shutil.copytree(source, local_outputs(cluster, index), dirs_exist_ok=True)


def _write_client_token() -> str:
    """A fresh token in this machine's cache (`hostcheck.CLIENT_TOKEN`), for the host check to
    read back where a node sees this very directory. Pools started at once may overwrite each
    other's: a node then seems not to share it, and builds for itself: slower, never wrong."""
    token = secrets.token_hex(8)
    path = Path(cache_root()).absolute() / hostcheck.CLIENT_TOKEN
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.{token}")
    with os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
        out.write(token)  # owner-only whatever the user's umask, as the whole cache is
    temporary.replace(path)
    return token


async def _shares_cache(cluster: SlurmCluster) -> bool:
    """Whether every node sees one cache directory: a token node 0 writes, read by the rest."""
    if len(cluster.nodes) < 2:
        return False
    token = secrets.token_hex(8)
    path = f'"{CACHE}"/' + shlex.quote(f".shared-{cluster.spec.pool_id}")
    first = bootstrap.remote_nodes(cluster)[0].host
    with contextlib.suppress(Exception):
        await first.run(f'umask 077 && mkdir -p "{CACHE}" && echo {token} > {path}')
        seen = await asyncio.gather(
            *(n.host.run(f"cat {path} 2>/dev/null") for n in bootstrap.remote_nodes(cluster)[1:])
        )
        await first.run(f"rm -f {path}")
        return all(done.stdout.decode().strip() == token for done in seen)
    return False


# What Slurm's --time takes: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds, or no limit.
_SLURM_TIME = re.compile(r"^(?:\d+-\d+(?::\d+){0,2}|\d+(?::\d+){0,2}|UNLIMITED|INFINITE)$", re.I)


def _time_limit(value: object) -> str | None:
    """`time_limit` as Slurm's --time takes it: a string of Slurm's own, checked, or seconds
    (a positive, finite number) rounded up to the minute Slurm counts in."""
    if value is None:
        return None
    if isinstance(value, str):
        if not _SLURM_TIME.match(value.strip()):
            raise ConfigError(
                f"sky.Slurm(time_limit=) {value!r} is not a Slurm time: give seconds as a "
                "number, or Slurm's own form ('90' minutes, '2:00:00', '1-00:00:00')"
            )
        return value.strip()
    return commands.duration(checks.seconds(value, "sky.Slurm(time_limit=)"))
