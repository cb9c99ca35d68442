"""The Local provider: every node is a child process on this machine.

GPUs: a pool without an accelerator runs on the CPU (its nodes see no GPU); one that names an
accelerator gives every node its own GPUs (`devices`).

The embedded default. Nodes talk to each other over loopback; the client talks to each agent over
its stdin/stdout pipes. What the nodes run is decided as on a remote host, by
`skyward.worker.hostcheck` (here in-process), the same way every time: this interpreter whenever
it satisfies the image (its Python and every requirement), else the environment built for the
image with uv, once per image hash; never one chosen because an earlier run left it. skyward
reaches the nodes as it reaches remote hosts (`skyward.providers.source`): the content-hashed
copy under the cache directory, first on their ``PYTHONPATH``.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from skyward import cachedir, checks
from skyward.console.progress import Phase, Progress
from skyward.errors import BootstrapError
from skyward.hardware import ClusterSpec, Hardware
from skyward.image import Image
from skyward.providers.base import Capability, Cluster, LivePool, Log, Node, Provider, count
from skyward.providers.environment import env_spec, packaged_uv
from skyward.providers.local import devices, processes
from skyward.providers.source import source_hash, source_tarball, unpack_command
from skyward.transport.agentwire import LINGER_ENV
from skyward.transport.base import AgentStream
from skyward.transport.pipes import spawn
from skyward.worker import envbuild, gpus, hostcheck
from skyward.worker.gpus import Inventory

LOOPBACK = "127.0.0.1"


def cache_dir() -> Path:
    """Where built environments live: ``$SKYWARD_CACHE_DIR`` or ``~/.cache/skyward``."""
    return Path(cachedir.cache_root())


# How long each end of a small call polls for the other's answer before it sleeps: several
# times a polled no-op round trip, so back-to-back calls find the other end awake, and short
# enough that an idle pool's last poll costs little CPU (measured with
# `benchmarks/bench_local.py --only rtt`; docs/concepts.md).
LINGER_SECONDS = 0.0002


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass
class LocalCluster(Cluster):
    """A Local pool: the interpreter its nodes run, once prepared, and how long they poll."""

    python: str | None = None
    linger: float = 0.0
    prepared: str = ""  # the environment hash `python` was chosen for
    # The nodes' output directories when the pool keeps none of its own on this machine
    # (no output_dir, or an s3:// one): removed with the pool.
    scratch: str | None = None


class LocalNode(Node):
    """A child process slot on this machine."""

    def __init__(self, index: int, cluster: LocalCluster) -> None:
        super().__init__(index, LOOPBACK, LOOPBACK)
        self._cluster = cluster

    async def start_agent(self, env: Mapping[str, str]) -> AgentStream:
        python, linger = self._cluster.python, self._cluster.linger
        if python is None:
            raise BootstrapError("the environment was not prepared before the agent started")
        full_env = {
            **os.environ,
            **devices.device_env(self.gpus),  # what the pool's own env= says still wins
            **env,
            "PYTHONPATH": _pythonpath(),
            "PYTHONUNBUFFERED": "1",
            LINGER_ENV: str(round(linger * 1e6)),
        }
        # The cache's umask from the first instruction: what the agent writes there before it
        # sets its own (bytecode of the environment's packages, as it imports them) is private.
        argv = [python, "-m", "skyward.worker"]
        return await spawn(argv, full_env, os.getcwd(), linger, umask=0o077)


class Local(Provider):
    """Nodes as child processes of this machine: the embedded default provider.

    Args:
        python: interpreter the nodes run; default: this one, or a uv environment built from it
            when the image asks for packages it lacks.
    """

    name = "local"
    capabilities = frozenset({Capability.REPLACE, Capability.SIGNALS})

    def live_pools(self) -> list[LivePool] | None:
        """This user's agents on this machine, by client, whatever started them: what
        ``skyward status`` lists as ``here`` (the same whatever this provider's arguments)."""
        return [pool.live() for pool in processes.local_pools()]

    def __init__(self, python: str | None = None) -> None:
        self._base_python = checks.optional_text(python, "sky.Local(python=)")

    def validate(self, spec: ClusterSpec) -> None:
        if spec.accelerator is not None:  # a request the machine cannot serve fails here
            devices.assign(machine_gpus(), spec.accelerator, spec.nodes)

    async def survey(self, cluster: Cluster, image: Image, progress: Progress) -> Hardware:
        """The GPUs `launch` dealt the nodes (none in a CPU pool) and this machine's CUDA."""
        cuda = (await asyncio.to_thread(machine_gpus)).cuda
        return Hardware.of([node.gpus for node in cluster.nodes], [cuda] * len(cluster.nodes))

    async def launch(self, spec: ClusterSpec, progress: Progress) -> Cluster:
        # With a core for each agent (every rank of every node) and one for the client, both
        # ends of a small call poll briefly for the other's answer instead of sleeping: it
        # saves the two wake-ups that are most of a small call's round trip. With fewer cores,
        # polling would steal them.
        agents = spec.nodes * spec.processes_per_node
        linger = LINGER_SECONDS if agents + 1 <= _usable_cores() else 0.0
        inventory = await asyncio.to_thread(machine_gpus)
        owned = devices.assign(inventory, spec.accelerator, spec.nodes)
        if spec.accelerator is None and devices.usable(inventory, os.environ):
            progress(
                f"this machine has {inventory.describe()}; the nodes run on the CPU: pass "
                "accelerator='GPU' (or e.g. 'GPU:2' per node) to give each its own"
            )
        cluster = LocalCluster(spec, [], linger=linger)
        if spec.outputs is None or spec.outputs.startswith("s3://"):
            cluster.scratch = tempfile.mkdtemp(prefix=f"skyward-{spec.pool_id}-")
        cluster.nodes = [LocalNode(i, cluster) for i in range(spec.nodes)]
        for node, mine in zip(cluster.nodes, owned, strict=True):
            node.gpus = mine
        return cluster

    async def replace(self, cluster: Cluster, index: int) -> Node:
        """A new process slot for a node whose process died (with the same GPUs)."""
        fresh = LocalNode(index, _local(cluster))
        fresh.gpus = cluster.nodes[index].gpus
        cluster.nodes[index] = fresh
        return fresh

    async def prepare(self, cluster: Cluster, image: Image, progress: Progress) -> None:
        local = _local(cluster)
        spec = env_spec(image)
        if local.prepared == spec.hash:
            return
        # One environment serves every node: they all go through the build together.
        progress.phase(None, Phase.BUILDING, "checking this machine")
        log = progress.log_for(None)
        cache = cache_dir()
        query = hostcheck.Query(
            cache=str(cache),
            env=spec.hash,
            src=source_hash(),
            apt=image.apt,
            requirements=spec.pip,
            probe=self._base_python is None,  # an explicit interpreter is always built from
        )
        report = await asyncio.to_thread(hostcheck.check, query)
        if report.apt_missing:
            missing = report.apt_missing
            raise BootstrapError(
                f"Image(apt=...) asks for {', '.join(missing)}, not installed on this machine; "
                f"the Local provider never runs apt for you: install them (apt-get install "
                f"{' '.join(missing)}) and start the pool again"
            )
        if not report.src:
            await asyncio.to_thread(_unpack_source, cache)
        decision = hostcheck.decide(report, spec.python, bool(spec.setup))
        try:
            if decision.python is None:
                built = await asyncio.to_thread(
                    envbuild.build, spec, cache, _uv_binary(), log, base_python=self._base_python
                )
                decision = hostcheck.Decision(str(built))
            elif decision.setup:
                await asyncio.to_thread(envbuild.run_setup_once, spec, cache, log)
        except envbuild.BuildFailed as exc:
            raise BootstrapError(
                f"building the environment {spec.hash} (cache {cache / 'envs' / spec.hash}) "
                "on this machine "
                f"failed: {exc}\n--- last lines ---\n{exc.output}",
                output=exc.output,
            ) from None
        local.python = decision.python
        local.prepared = spec.hash

    def node_output_dir(self, cluster: Cluster, node: Node) -> str:
        """The pool's own ``<output_dir>/node-<i>``: nothing to bring back afterwards."""
        local = _local(cluster)
        root = local.scratch or cluster.spec.outputs
        assert root is not None, "launch made a scratch directory"
        return os.path.join(root, f"node-{node.index}")

    async def collect_outputs(self, cluster: Cluster, nodes: Sequence[int], log: Log) -> None:
        uri = cluster.spec.outputs
        if uri is None or not uri.startswith("s3://"):
            return  # already where they belong
        from skyward.worker import s3sync

        await asyncio.gather(
            *(
                asyncio.to_thread(
                    s3sync.upload,
                    Path(self.node_output_dir(cluster, cluster.nodes[i])),
                    f"{uri.rstrip('/')}/node-{i}",
                )
                for i in nodes
                if Path(self.node_output_dir(cluster, cluster.nodes[i])).is_dir()
            )
        )

    def teardown_summary(self, cluster: Cluster) -> str:
        agents = len(cluster.nodes) * cluster.spec.processes_per_node  # a process a rank
        return f"stopped {count(agents, 'process', 'processes')}"

    def detached_kind(self) -> str:
        return "local"

    async def terminate(self, cluster: Cluster) -> None:
        # Agents are killed by the pool with their process groups; what is left is the
        # scratch output directory.
        scratch = _local(cluster).scratch
        if scratch is not None:
            await asyncio.to_thread(shutil.rmtree, scratch, True)


@functools.cache
def machine_gpus() -> Inventory:
    """This machine's GPUs, asked once per process (NVML, or nvidia-smi)."""
    return gpus.find()


def _local(cluster: Cluster) -> LocalCluster:
    if not isinstance(cluster, LocalCluster):
        raise TypeError(f"{cluster!r} is not a Local pool")
    return cluster


def _unpack_source(cache: Path) -> None:
    """skyward's content-hashed copy under `cache`, by the same command as on remote hosts."""
    done = subprocess.run(
        ["sh", "-c", unpack_command("$SKYWARD_SRC")],
        input=source_tarball(),
        env={**os.environ, "SKYWARD_SRC": str(cache / "src")},
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        raise BootstrapError(
            f"copying skyward to {cache / 'src'} failed (exit status {done.returncode}): "
            f"{done.stderr.decode(errors='replace').strip()}"
        )


def _uv_binary() -> str:
    found = packaged_uv() or shutil.which("uv")
    if found:
        return found
    raise BootstrapError("uv was not found: `pip install uv` (it builds the nodes' environments)")


def _pythonpath() -> str:
    """This client's own skyward (its shipped copy) first, then the directory of the script."""
    parts = [str(cache_dir() / "src" / source_hash())]
    script_dir = sys.path[0] if sys.path and sys.path[0] else os.getcwd()
    parts.append(script_dir)
    existing = os.environ.get("PYTHONPATH")
    if existing:
        parts.append(existing)
    return os.pathsep.join(parts)
