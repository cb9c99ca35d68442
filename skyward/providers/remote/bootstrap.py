"""The remote bootstrap, shared by every provider whose nodes are hosts reached over SSH.

Plain functions, used by `sky.SSH`, `sky.AWS` and `sky.GCP` once their hosts are connected
(`skyward.providers.remote.connect`):

- `survey_nodes` (`Provider.survey`): per host, concurrently, ONE check command
  (`skyward.worker.hostcheck` run with the host's interpreter) reports what is already there
  for the image as planned and the host's GPUs. A pool that names an accelerator fails there,
  before anything is built, on a host without enough of it; the node owns the host's GPUs
  (`Node.gpus`, MIG-mode ones left out). The pool learns what the hosts have (`Hardware`)
  and its plugins choose their packages by it;
- `prepare_nodes`: per host, concurrently, the survey's check reused when the image stayed as
  planned (else one more check), then only the missing pieces are built:

  - skyward itself (`skyward.providers.source`), unpacked once to
    ``<cache>/src/<hash>/skyward`` (PYTHONPATH points there for envbuild and the agent), where
    ``<cache>`` is the host's (`CACHE`);
  - apt packages (``sudo -n`` when not root);
  - uv, only when an environment must be built and the host has none that fits
    (`hoststeps.install_uv`: the client's own binary, or the wheel from the image's indexes,
    under ``<cache>/bootstrap``; no pip or venv module needed);
  - the image's environment with `skyward.worker.envbuild`, once per hash under
    ``<cache>/envs``, on the client's Python (uv provides it where the host's python3 is
    another version), or only the image's setup commands when the host's interpreter
    already satisfies the image (`hostcheck.decide`);

- `RemoteNode`: a node on one `Host` (an SSH connection, or a Slurm node's job steps); it
  starts the agent in the prepared interpreter.

A fresh host costs one check command (it probes the image's requirements itself), then what
must be built. A second pool with the same image on the same hosts costs one check command and
the agent start per host (two check commands when what the hosts have changes the image: see
`survey_nodes`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shlex
from collections.abc import Awaitable, Mapping
from functools import cache
from typing import TypeVar

import asyncssh

from skyward.console.progress import Phase, Progress
from skyward.errors import BootstrapError
from skyward.hardware import Accelerator, Hardware
from skyward.image import Image
from skyward.providers.base import Cluster, Log, Node
from skyward.providers.environment import env_spec
from skyward.providers.remote import hoststeps
from skyward.providers.remote.host import Host, StreamedProcess
from skyward.providers.remote.hoststeps import CACHE, Bootstrap
from skyward.providers.source import source_hash, source_tarball, unpack_command
from skyward.transport.base import AgentStream
from skyward.transport.sshhost import SSHHost
from skyward.transport.sshstream import open_agent
from skyward.transport.stdinenv import READ_ENV, env_line
from skyward.worker import hostcheck
from skyward.worker.gpus import Inventory, visible_env

T = TypeVar("T")


class RemoteNode(Node):
    """A node on one SSH host: its connection and, once prepared, the interpreter to run."""

    def __init__(self, index: int, host: Host, private_addr: str | None = None) -> None:
        super().__init__(index, private_addr or host.address, host.address)
        self.host = host
        self.python: str | None = None
        self.prepared = ""  # the environment hash the node was prepared for
        self.gpu_env: dict[str, str] = {}  # CUDA_VISIBLE_DEVICES for the GPUs it owns
        # What the provider has the agent watch for itself (a cloud's preemption notice)
        self.provider_env: dict[str, str] = {}
        self.inventory: Inventory | None = None  # the host's GPUs, once listed
        # The survey's check and the environment hash it was for: `prepare_host` reuses it.
        self.checked: tuple[str, hostcheck.HostReport] | None = None
        self.trees: set[str] = set()  # digests of the `sky.Data` trees pushed to it
        self.pulled: frozenset[str] = frozenset()  # what the last pull of its outputs listed
        self.agent_env: dict[str, str] = {}  # the pool's env= and the image's, once started

    async def start_agent(self, env: Mapping[str, str]) -> AgentStream:
        if self.python is None:
            raise BootstrapError(
                f"the environment of {self.host} was not prepared before the agent started",
                node=self.index,
            )
        self.agent_env = dict(env)  # node-side commands for the pool (an S3 upload) get it too
        full = {**self.gpu_env, **self.provider_env, **env, "PYTHONUNBUFFERED": "1"}
        # The values travel as the first line of the agent's stdin, read by its shell before
        # the `exec` (`stdinenv`): the agent's command line, which lives as long as the pool
        # (on Slurm, srun's on the login node too), holds none of them. The source path must
        # expand on the host: it is the one variable on the command line. umask 077 from the
        # start: the bytecode the agent writes as it imports, before it sets its own, is in
        # the cache (the environment's packages) and private.
        line = env_line({k: v for k, v in full.items() if k != "PYTHONPATH"})
        command = (
            f'{READ_ENV}umask 077; cd "$HOME" && exec env {hoststeps.pythonpath()} '
            f"{shlex.quote(self.python)} -m skyward.worker"
        )
        try:
            stream = await self.open_agent(command)
            stream.write([line])
            return stream
        except (OSError, asyncssh.Error) as exc:
            raise BootstrapError(
                f"starting the agent on {self.host} failed: {exc}", node=self.index
            ) from None

    async def open_agent(self, command: str) -> AgentStream:
        """Start the agent's shell command line on the host, its stdio the stream: an SSH exec
        channel (a Slurm node, whose host is no SSH connection, starts a job step instead)."""
        return await open_agent(ssh_host(self), command)

    async def start_process(self, command: str) -> StreamedProcess:
        """Start a shell command line on the host whose stdio the client streams over (a data
        tree's push or pull), in a process group its SSH connection adopts."""
        return await ssh_host(self).start(command)


def ssh_host(node: RemoteNode) -> SSHHost:
    """The node's SSH connection, for what streams over one (the agent, a data tree)."""
    if not isinstance(node.host, SSHHost):
        raise TypeError(f"node {node.index} ({node.host}) is not reached over SSH")
    return node.host


def remote_nodes(cluster: Cluster) -> list[RemoteNode]:
    """The cluster's nodes, each a `RemoteNode`."""
    nodes = [n for n in cluster.nodes if isinstance(n, RemoteNode)]
    if len(nodes) != len(cluster.nodes):
        raise TypeError(f"{cluster.nodes!r} are not all nodes on SSH hosts")
    return nodes


async def close_hosts(cluster: Cluster, last: str = "") -> None:
    """Close every node's connection (killing what it started, then running `last` on the
    host in the same command: see `SSHHost.kill_all`); idempotent."""
    hosts = {id(n.host): n.host for n in remote_nodes(cluster)}
    await asyncio.gather(*(h.close(last) for h in hosts.values()), return_exceptions=True)


async def all_or_none(*steps: Awaitable[T]) -> list[T]:
    """Run `steps` at once; their results, or the first failure once the others are cancelled
    and have ended (`asyncio.gather` would leave them running: a host's command that outlives
    the pool's start, and its process with it)."""
    tasks = [asyncio.ensure_future(step) for step in steps]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def survey_nodes(
    cluster: Cluster, image: Image, bootstrap: Bootstrap, progress: Progress
) -> Hardware:
    """What the hosts have (`Provider.survey`): every host checked at once for `image`, its
    GPUs listed; a pool that names an accelerator fails here on a host without enough of it.

    The check is the one `prepare_nodes` starts with, kept on the node: when the image it then
    prepares is the same (what the hosts have did not change the plan), a pool costs one check
    command per host; where it changed (a CUDA wheel instead of the planned CPU one), two.
    """
    nodes = remote_nodes(cluster)
    await all_or_none(
        *(_survey(node, image, bootstrap, progress, cluster.spec.accelerator) for node in nodes)
    )
    hardware = Hardware.of(
        [node.gpus for node in nodes], [(node.inventory or Inventory()).cuda for node in nodes]
    )
    if cluster.spec.accelerator is None and hardware.gpus is not None:
        progress(f"no accelerator named; {hardware.describe()}: the nodes use them")
    return hardware


async def _survey(
    node: RemoteNode,
    image: Image,
    bootstrap: Bootstrap,
    progress: Progress,
    accelerator: Accelerator | None,
) -> None:
    progress.phase(node.index, Phase.BUILDING)
    report = await _first_check(node, image, bootstrap, progress.log_for(node.index))
    _own_gpus(node, report.gpus or Inventory(), accelerator)
    node.checked = (env_spec(image).hash, report)


async def prepare_nodes(
    cluster: Cluster, image: Image, bootstrap: Bootstrap, progress: Progress
) -> None:
    """Prepare every node of `cluster` not yet prepared for `image`, all hosts at once."""
    key = env_spec(image).hash
    await all_or_none(
        *(
            prepare_host(node, image, bootstrap, progress, cluster.spec.accelerator)
            for node in remote_nodes(cluster)
            if node.prepared != key
        )
    )


async def prepare_host(
    node: RemoteNode,
    image: Image,
    bootstrap: Bootstrap,
    progress: Progress,
    accelerator: Accelerator | None = None,
) -> None:
    """Check the host once (reusing the survey's check when it was for this image; a node not
    surveyed, a replacement, has its GPUs checked against `accelerator` here), build only
    what is missing, and set the node's interpreter; each step and its output lines are the
    node's `Phase.BUILDING` details."""
    spec = env_spec(image)
    host_log = progress.log_for(node.index)
    report = await _host_report(node, image, bootstrap, progress, accelerator)
    await _add_missing(node, bootstrap, report, host_log)
    if report.satisfied is None:  # not probed by the check (a report of another kind)
        report = await _probe_packages(node, image, bootstrap, report, host_log)
    decision = hostcheck.decide(report, spec.python, bool(spec.setup))
    node.python = await _environment(node, image, bootstrap, report, decision, host_log)
    node.prepared = spec.hash


async def _host_report(
    node: RemoteNode,
    image: Image,
    bootstrap: Bootstrap,
    progress: Progress,
    accelerator: Accelerator | None,
) -> hostcheck.HostReport:
    """The host's check for `image`: the survey's when it was for this image, else a new one
    (with the GPUs owned against `accelerator` for a node not surveyed)."""
    host_log = progress.log_for(node.index)
    checked, node.checked = node.checked, None
    if node.inventory is None:
        progress.phase(node.index, Phase.BUILDING)
        report = await _first_check(node, image, bootstrap, host_log)
        _own_gpus(node, report.gpus or Inventory(), accelerator)
        return report
    if checked is not None and checked[0] == env_spec(image).hash:
        return checked[1]
    return await _check(node, image, bootstrap, host_log, gpus=False)


async def _add_missing(
    node: RemoteNode, bootstrap: Bootstrap, report: hostcheck.HostReport, host_log: Log
) -> None:
    """What the check found missing that is not the environment: skyward's source, apt
    packages."""
    if not report.src:
        await _copy_source(node, bootstrap, host_log)
    if report.apt_missing:
        await hoststeps.apt_install(node, bootstrap, report.apt_missing, report.uid, host_log)


async def _copy_source(node: RemoteNode, bootstrap: Bootstrap, log: Log) -> None:
    await hoststeps.run_step(
        node,
        bootstrap,
        unpack_command(f"{CACHE}/src"),
        "copying skyward to the host",
        log,
        source_tarball(),
    )


async def _first_check(
    node: RemoteNode, image: Image, bootstrap: Bootstrap, log: Log
) -> hostcheck.HostReport:
    """A host's first check, its GPUs listed. On fresh hosts (`Bootstrap.fresh_hosts`)
    skyward's source is copied at the same time, since the check would find none: the copy
    overlaps the check (on three pods, about 0.15 s of the pool's start). The check's error
    comes first where both fail (no python3 says more than what tar then said)."""
    if not bootstrap.fresh_hosts:
        return await _check(node, image, bootstrap, log, gpus=True)
    checked, copied = await asyncio.gather(
        _check(node, image, bootstrap, log, gpus=True),
        _copy_source(node, bootstrap, log),
        return_exceptions=True,
    )
    if isinstance(checked, BaseException):
        raise checked
    if isinstance(copied, BaseException):
        raise copied
    return dataclasses.replace(checked, src=True)


async def _probe_packages(
    node: RemoteNode,
    image: Image,
    bootstrap: Bootstrap,
    report: hostcheck.HostReport,
    host_log: Log,
) -> hostcheck.HostReport:
    """The host's check run again with its own interpreter, for what its packages satisfy."""
    base = shlex.quote(report.python)
    return hostcheck.HostReport.from_json(
        await hoststeps.json_step(
            node,
            bootstrap,
            f'cd && {hoststeps.pythonpath()} exec {base} -m skyward.worker.hostcheck "{CACHE}"',
            "checking the host's packages",
            host_log,
            _query(image, bootstrap, gpus=False).to_json().encode(),
        )
    )


async def _environment(
    node: RemoteNode,
    image: Image,
    bootstrap: Bootstrap,
    report: hostcheck.HostReport,
    decision: hostcheck.Decision,
    host_log: Log,
) -> str | None:
    """The interpreter the node's agents run: the image's environment built where `decision`
    found none, or the one found (with the image's setup commands run, where it asks)."""
    spec = env_spec(image)
    base = shlex.quote(report.python)
    if decision.python is None:
        uv = await hoststeps.install_uv(node, bootstrap, report, image.indexes, host_log)
        built = await hoststeps.json_step(
            node,
            bootstrap,
            f"cd && {hoststeps.pythonpath()} exec {base} -m skyward.worker.envbuild "
            f'"{CACHE}" {shlex.quote(uv)}',
            f"building the environment for image {image.content_hash}",
            host_log,
            spec.to_json().encode(),
        )
        return str(json.loads(built)["python"])
    if decision.setup:
        await hoststeps.json_step(
            node,
            bootstrap,
            f"cd && {hoststeps.pythonpath()} exec {base} -m skyward.worker.envbuild "
            f'"{CACHE}" --setup-only',
            "running the image's setup commands",
            host_log,
            spec.to_json().encode(),
        )
    return decision.python


def _query(image: Image, bootstrap: Bootstrap, gpus: bool) -> hostcheck.Query:
    spec = env_spec(image)
    return hostcheck.Query(
        cache="",  # the host's, which the check command passes (see `_check`)
        env=spec.hash,
        src=source_hash(),
        uv=bootstrap.uv_version,
        apt=image.apt,
        requirements=spec.pip,
        gpus=gpus,
    )


async def _check(
    node: RemoteNode, image: Image, bootstrap: Bootstrap, log: Log, gpus: bool
) -> hostcheck.HostReport:
    """The one check command that reports what the host has for `image` (and its GPUs), run
    with the host's interpreter before skyward's source may be there."""
    python = bootstrap.python or "python3"
    query = _query(image, bootstrap, gpus)
    return hostcheck.HostReport.from_json(
        await hoststeps.json_step(
            node,
            bootstrap,
            f"P=$(command -v {shlex.quote(python)}) || "
            f"{{ echo {shlex.quote(f'python {python} was not found on this host')} >&2; "
            "exit 127; }; "
            f'exec "$P" -c {shlex.quote(_check_program())} "{CACHE}"',
            "checking the host",
            log,
            query.to_json().encode(),  # on stdin: a requirement may hold a URL's token
        )
    )


@cache
def _check_program() -> str:
    return hostcheck.program()


def _own_gpus(node: RemoteNode, inventory: Inventory, accelerator: Accelerator | None) -> None:
    """Give the node the host's GPUs: every usable one, or the first `accelerator.count` that
    `accelerator` names (a `BootstrapError` when the host has fewer than the pool asked for).
    A TPU is not NVIDIA's to list: it is left to the provider that made the machine."""
    node.inventory = inventory
    if accelerator is None or accelerator.is_tpu:
        node.gpus = inventory.usable
        # Without a name, a host's processes see its GPUs as they always have.
        node.gpu_env = {}
        return
    found = inventory.matching(accelerator.name)
    if len(found) < accelerator.count:
        raise BootstrapError(
            f"host {node.host} has {inventory.describe()}; the pool asked for {accelerator}. "
            f"Use hosts with {accelerator.count} x {accelerator.name} each, ask for what "
            "they have, or leave `accelerator` out to run on whatever GPUs each host has",
            node=node.index,
        )
    node.gpus = found[: accelerator.count]
    # A pool that named its GPUs shows each node only those.
    node.gpu_env = visible_env(node.gpus)


def module_command(
    python: str, module: str, *args: str, site: bool = True, cwd: str = '"$HOME"'
) -> str:
    """``python -m module args`` on a prepared host, in `cwd` (a shell word), with skyward's
    source on PYTHONPATH: how other parts (e.g. the data sync) run a `skyward.worker` module
    there. ``site=False`` (``python -S``) starts faster, for a module that needs only the
    stdlib."""
    words = " ".join(shlex.quote(a) for a in args)
    flags = "" if site else "-S "
    path = hoststeps.pythonpath()
    # umask 077, as for the agent: the module's bytecode and what it writes are the cache's.
    return f"umask 077; cd {cwd} && {path} exec {shlex.quote(python)} {flags}-m {module} {words}"
