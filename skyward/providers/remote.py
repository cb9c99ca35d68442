"""The remote bootstrap, shared by every provider whose nodes are hosts reached over SSH.

Plain functions, used by `sky.SSH` and `sky.AWS` (and by any other cloud's provider):

- `connect_all`: one verified connection per host, all at once; a host that fails closes the
  others and fails the whole launch. With a `BootWait`, each host is retried until a deadline
  (an instance that is still booting: sshd down, or still offering the image's own host key);
- `prepare_nodes`: per host, concurrently, ONE check command (`skyward.worker.hostcheck` run
  with the host's interpreter) reports what is already there and the host's GPUs. A pool that
  names an accelerator fails there, before anything is built, on a host without enough of
  it; the node owns the host's GPUs (`Node.gpus`, MIG-mode ones left out). Then only the
  missing pieces are built:

  - skyward itself (`skyward.providers.source`), unpacked once to
    ``~/.cache/skyward/src/<hash>/skyward`` (PYTHONPATH points there for envbuild and the agent);
  - apt packages (``sudo -n`` when not root);
  - uv, only when an environment must be built: ``python3 -m venv`` +
    ``pip install uv==<client's uv>`` under ``~/.cache/skyward/bootstrap``;
  - the image's environment with `skyward.worker.envbuild`, once per hash under
    ``~/.cache/skyward``, or only the image's setup commands when the host's interpreter
    already satisfies the image (`hostcheck.decide`);

- `RemoteNode`: a node on one `SSHHost`; it starts the agent in the prepared interpreter.

A second pool with the same image on the same hosts costs one check command and the agent start
per host.
"""

from __future__ import annotations

import asyncio
import importlib.metadata as metadata
import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from typing import TYPE_CHECKING, Any

import asyncssh

from skyward.cluster import Accelerator
from skyward.errors import BootstrapError, ProvisionError
from skyward.image import Image
from skyward.progress import Phase, Progress
from skyward.providers.base import Cluster, Log, Node
from skyward.providers.environment import env_spec
from skyward.providers.source import source_hash, source_tarball, unpack_command
from skyward.transport.base import AgentStream
from skyward.transport.channels import open_agent
from skyward.transport.ssh import Completed, Endpoint, SSHConnectError, SSHHost, connect, shell_env
from skyward.worker import hostcheck
from skyward.worker.gpus import Gpu, Inventory, visible_env

if TYPE_CHECKING:
    from skyward.providers.files import Receiver

CACHE = "$HOME/.cache/skyward"  # expanded by the remote shell
_CHECK_CACHE = "~/.cache/skyward"  # expanded by the check itself


@dataclass(frozen=True)
class ConnectOptions:
    """How to log into a pool's hosts: trusted host keys, login key, ssh_config, timeouts."""

    known_hosts: asyncssh.SSHKnownHosts | tuple[()]
    key: str | None = None
    config: Sequence[str] = ()  # () reads ~/.ssh/config; [] reads no config at all
    timeout: float = 10.0
    keepalive: float = 15.0

    async def connect(self, endpoint: Endpoint, timeout: float | None = None) -> SSHHost:
        return await connect(
            endpoint,
            known_hosts=self.known_hosts,
            key=self.key,
            config=self.config,
            timeout=self.timeout if timeout is None else timeout,
            keepalive=self.keepalive,
        )


@dataclass(frozen=True)
class BootWait:
    """Retry a host that refuses the verified login until `deadline` (the loop's clock): a
    machine that is still booting. `budget` names the deadline in the error."""

    deadline: float
    poll: float
    budget: str


@dataclass(frozen=True)
class Bootstrap:
    """How hosts are prepared: their interpreter, the uv to install, the build steps' env."""

    python: str | None = None  # default python3
    uv_version: str = field(default_factory=lambda: metadata.version("uv"))
    build_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def prefix(self) -> str:
        return f"export {shell_env(self.build_env)}; " if self.build_env else ""


async def connect_host(
    endpoint: Endpoint, options: ConnectOptions, wait: BootWait | None = None, label: str = ""
) -> SSHHost:
    """One verified connection; with `wait`, retried until its deadline, never trusting more."""
    if wait is None:
        return await options.connect(endpoint)
    loop = asyncio.get_running_loop()
    while True:
        timeout = max(1.0, min(options.timeout, wait.deadline - loop.time()))
        try:
            return await options.connect(endpoint, timeout)
        except SSHConnectError as exc:
            # While the machine boots, sshd is down, still offers the image's own host key
            # (rejected: only ours is trusted) or has no authorized key yet. Wait, never trust.
            if loop.time() + wait.poll > wait.deadline:
                raise ProvisionError(
                    f"{label or endpoint} did not accept the verified SSH login within "
                    f"{wait.budget}; last error: {exc}"
                ) from None
            await asyncio.sleep(wait.poll)


async def connect_all(
    endpoints: Sequence[Endpoint],
    options: ConnectOptions,
    wait: BootWait | None = None,
    labels: Sequence[str] = (),
) -> list[SSHHost]:
    """Connect to every host at once; all of them, or close those that connected and raise."""
    names = list(labels) or [""] * len(endpoints)
    results = await asyncio.gather(
        *(connect_host(e, options, wait, n) for e, n in zip(endpoints, names, strict=True)),
        return_exceptions=True,
    )
    hosts = [r for r in results if isinstance(r, SSHHost)]
    failures = [r for r in results if isinstance(r, BaseException)]
    if not failures:
        return hosts
    await asyncio.gather(*(h.close() for h in hosts), return_exceptions=True)
    for failure in failures:
        if not isinstance(failure, Exception):
            raise failure  # cancellation, KeyboardInterrupt: not ours to reword
    first = failures[0]
    if len(failures) == 1 and isinstance(first, ProvisionError):
        raise first
    raise ProvisionError(
        f"{len(failures)} of {len(endpoints)} SSH host(s) could not be reached:\n"
        + "\n".join(f"  {f}" for f in failures)
    ) from first


class RemoteNode(Node):
    """A node on one SSH host: its connection and, once prepared, the interpreter to run."""

    def __init__(self, index: int, host: SSHHost, private_addr: str | None = None) -> None:
        super().__init__(index, private_addr or host.endpoint.host, host.endpoint.host)
        self.host = host
        self.python: str | None = None
        self.prepared = ""  # the environment hash the node was prepared for
        self.gpu_env: dict[str, str] = {}  # CUDA_VISIBLE_DEVICES for the GPUs it owns
        self.trees: set[str] = set()  # digests of the `sky.Data` trees pushed to it
        self.pulled: frozenset[str] = frozenset()  # what the last pull of its outputs listed
        self.agent_env: dict[str, str] = {}  # the pool's env= and the image's, once started
        self.receiver: Receiver | None = None  # its data receiver, opened by the first push

    async def start_agent(self, env: Mapping[str, str]) -> AgentStream:
        if self.python is None:
            raise BootstrapError(
                f"the environment of {self.host} was not prepared before the agent started",
                node=self.index,
            )
        self.agent_env = dict(env)  # node-side commands for the pool (an S3 upload) get it too
        # The source path must expand on the host, so it is the one value left unquoted.
        full = {**self.gpu_env, **env, "PYTHONUNBUFFERED": "1"}
        words = shell_env({k: v for k, v in full.items() if k != "PYTHONPATH"})
        command = (
            f'cd "$HOME" && exec env {_pythonpath()} {words} '
            f"{shlex.quote(self.python)} -m skyward.worker"
        )
        try:
            return await open_agent(self.host, command)
        except (OSError, asyncssh.Error) as exc:
            raise BootstrapError(
                f"starting the agent on {self.host} failed: {exc}", node=self.index
            ) from None


def remote_nodes(cluster: Cluster) -> list[RemoteNode]:
    """The cluster's nodes, each a `RemoteNode`."""
    nodes = [n for n in cluster.nodes if isinstance(n, RemoteNode)]
    if len(nodes) != len(cluster.nodes):
        raise TypeError(f"{cluster.nodes!r} are not all nodes on SSH hosts")
    return nodes


async def close_hosts(cluster: Cluster) -> None:
    """Close every node's connection (killing what it started); idempotent."""
    hosts = {id(n.host): n.host for n in remote_nodes(cluster)}
    await asyncio.gather(*(h.close() for h in hosts.values()), return_exceptions=True)


async def prepare_nodes(
    cluster: Cluster, image: Image, bootstrap: Bootstrap, progress: Progress
) -> None:
    """Prepare every node of `cluster` not yet prepared for `image`, all hosts at once."""
    key = env_spec(image).hash
    await asyncio.gather(
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
    """Check the host once (its GPUs against `accelerator` too), build only what is missing,
    and set the node's interpreter and GPUs; each step and its output lines are the node's
    `Phase.BUILDING` details."""
    spec = env_spec(image)
    progress.phase(node.index, Phase.BUILDING)
    host_log = progress.log_for(node.index)

    query = hostcheck.Query(
        cache=_CHECK_CACHE,
        env=spec.hash,
        src=source_hash(),
        uv=bootstrap.uv_version,
        apt=image.apt,
        requirements=spec.pip,
        gpus=True,
    )
    python = bootstrap.python or "python3"
    report = hostcheck.Report.from_json(
        await _json(
            node,
            bootstrap,
            f"P=$(command -v {shlex.quote(python)}) || "
            f"{{ echo 'python {python} was not found on this host' >&2; exit 127; }}; "
            f'exec "$P" -c {shlex.quote(_check_program())} {shlex.quote(query.to_json())}',
            "checking the host",
            host_log,
        )
    )
    node.gpus = _gpus_for(node, report.gpus or Inventory(), accelerator)
    # A pool that named its GPUs shows each node only those; without a name a host's
    # processes see its GPUs as they always have.
    named = accelerator is not None and not accelerator.is_tpu
    node.gpu_env = visible_env(node.gpus) if named and node.gpus else {}
    base = shlex.quote(report.python)
    if not report.src:
        await _run(
            node,
            bootstrap,
            unpack_command(f"{CACHE}/src"),
            "copying skyward to the host",
            host_log,
            source_tarball(),
        )
    if report.apt_missing:
        await _apt(node, bootstrap, report.apt_missing, report.uid, host_log)
    if report.env is None and report.satisfied is None:  # first contact: skyward is there now
        report = hostcheck.Report.from_json(
            await _json(
                node,
                bootstrap,
                f"cd && {_pythonpath()} exec {base} -m skyward.worker.hostcheck "
                f"{shlex.quote(replace(query, gpus=False).to_json())}",
                "checking the host's packages",
                host_log,
            )
        )
    decision = hostcheck.decide(report, image.python, bool(spec.setup))
    if decision.python is None:
        uv = report.uv or await _install_uv(node, bootstrap, report.python, host_log)
        built = await _json(
            node,
            bootstrap,
            f"cd && {_pythonpath()} exec {base} -m skyward.worker.envbuild "
            f'"{CACHE}" {shlex.quote(uv)}',
            f"building the environment for image {image.content_hash}",
            host_log,
            spec.to_json().encode(),
        )
        decision = hostcheck.Decision(str(json.loads(built)["python"]))
    elif decision.setup:
        await _json(
            node,
            bootstrap,
            f'cd && {_pythonpath()} exec {base} -m skyward.worker.envbuild "{CACHE}" --setup-only',
            "running the image's setup commands",
            host_log,
            spec.to_json().encode(),
        )
    node.python = decision.python
    node.prepared = spec.hash


@cache
def _check_program() -> str:
    return hostcheck.program()


def _gpus_for(
    node: RemoteNode, inventory: Inventory, accelerator: Accelerator | None
) -> tuple[Gpu, ...]:
    """The GPUs the node owns: every usable one of the host, or the first `accelerator.count`
    that `accelerator` names; a `BootstrapError` when the host has fewer of them than the pool
    asked for. A TPU is not NVIDIA's to list: it is left to the provider that made the
    machine."""
    if accelerator is None or accelerator.is_tpu:
        return inventory.usable
    found = inventory.matching(accelerator.name)
    if len(found) < accelerator.count:
        raise BootstrapError(
            f"host {node.host} has {inventory.describe()}; the pool asked for {accelerator}. "
            f"Use hosts with {accelerator.count} x {accelerator.name} each, ask for what "
            "they have, or leave `accelerator` out to run on whatever GPUs each host has",
            node=node.index,
        )
    return found[: accelerator.count]


def _pythonpath() -> str:
    return f'PYTHONPATH="{CACHE}/src/{source_hash()}"'


def module_command(
    python: str, module: str, *args: str, site: bool = True, cwd: str = '"$HOME"'
) -> str:
    """``python -m module args`` on a prepared host, in `cwd` (a shell word), with skyward's
    source on PYTHONPATH: how other parts (e.g. the data sync) run a `skyward.worker` module
    there. ``site=False`` (``python -S``) starts faster, for a module that needs only the
    stdlib."""
    words = " ".join(shlex.quote(a) for a in args)
    flags = "" if site else "-S "
    return f"cd {cwd} && {_pythonpath()} exec {shlex.quote(python)} {flags}-m {module} {words}"


async def _install_uv(node: RemoteNode, bootstrap: Bootstrap, python: str, log: Log) -> str:
    version = bootstrap.uv_version
    root = f"{CACHE}/bootstrap"
    venv = f"{root}/uv-{version}"
    # flock: hosts sharing a home (NFS, or our test namespaces) install once.
    done = await _run(
        node,
        bootstrap,
        f'set -e; mkdir -p "{root}"; exec 9>"{venv}.lock"; flock 9; '
        f'if [ ! -x "{venv}/bin/uv" ]; then rm -rf "{venv}"; '
        f'{shlex.quote(python)} -m venv "{venv}"; '
        f'"{venv}/bin/python" -m pip install --disable-pip-version-check -q '
        f'{shlex.quote(f"uv=={version}")} || {{ rm -rf "{venv}"; exit 1; }}; fi; '
        f'echo "{venv}/bin/uv"',
        f"installing uv=={version} (python -m venv + pip install)",
        log,
        merge=True,
    )
    return done.stdout.decode(errors="replace").strip().splitlines()[-1]


async def _apt(
    node: RemoteNode, bootstrap: Bootstrap, packages: Sequence[str], uid: int, log: Log
) -> None:
    sudo = "" if uid == 0 else "sudo -n "
    names = " ".join(shlex.quote(p) for p in packages)
    await _run(
        node,
        bootstrap,
        f"export DEBIAN_FRONTEND=noninteractive; {sudo}apt-get update -q 2>&1 && "
        f"{sudo}apt-get install -y -q --no-install-recommends {names} 2>&1",
        f"installing apt packages {', '.join(packages)}",
        log,
        merge=True,
    )


async def _send(
    node: RemoteNode, bootstrap: Bootstrap, command: str, what: str, log: Log, input: bytes
) -> Completed:
    log(what)  # the step's name, then its output lines: the node's detail as it builds
    try:
        return await node.host.run(bootstrap.prefix + command, input, log)
    except (OSError, asyncssh.Error) as exc:
        raise BootstrapError(
            f"{what} on {node.host} failed: the connection broke ({exc})", node=node.index
        ) from None


async def _run(
    node: RemoteNode,
    bootstrap: Bootstrap,
    command: str,
    what: str,
    log: Log,
    input: bytes = b"",
    merge: bool = False,
) -> Completed:
    """Run one bootstrap command; a failure becomes a `BootstrapError` with its output."""
    command = f"exec 2>&1; {command}" if merge else command
    done = await _send(node, bootstrap, command, what, log, input)
    if done.status != 0:
        output = done.tail or done.stdout.decode(errors="replace")[-4000:]
        if merge:  # merged commands print to stdout: show its tail
            output = "\n".join(done.stdout.decode(errors="replace").splitlines()[-40:])
        raise BootstrapError(
            f"{what} on {node.host} failed (exit status {done.status})\n"
            f"--- last lines ---\n{output}",
            node=node.index,
            output=output,
        )
    return done


async def _json(
    node: RemoteNode, bootstrap: Bootstrap, command: str, what: str, log: Log, input: bytes = b""
) -> str:
    """Run a command that prints one JSON object (or ``{"error", "output"}``) last; its text."""
    done = await _send(node, bootstrap, command, what, log, input)
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    result: dict[str, Any] = {}
    if lines:
        try:
            result = json.loads(lines[-1])
        except ValueError:
            result = {}
    if done.status != 0 or "error" in result or not result:
        output = str(result.get("output") or done.tail)
        reason = result.get("error") or f"exit status {done.status}"
        raise BootstrapError(
            f"{what} on {node.host} failed: {reason}\n--- last lines ---\n{output}",
            node=node.index,
            output=output,
        )
    return lines[-1]
