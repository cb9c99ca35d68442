"""The Local provider: every node is a child process on this machine.

The embedded default. Nodes talk to each other over loopback; the client talks to each agent over
its stdin/stdout pipes. When this interpreter already satisfies the image, the nodes run it
directly; otherwise the environment is built with uv once per image hash and reused.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import skyward
from skyward.cluster import ClusterSpec
from skyward.errors import BootstrapError, ConfigError
from skyward.image import Image
from skyward.providers.base import Cluster, Log, Node, Provider
from skyward.providers.environment import env_spec
from skyward.transport.base import AgentStream
from skyward.transport.pipes import spawn
from skyward.worker import envbuild, probe
from skyward.worker.agent import LINGER_ENV

LOOPBACK = "127.0.0.1"


def cache_dir() -> Path:
    """Where built environments live: ``$SKYWARD_CACHE_DIR`` or ``~/.cache/skyward``."""
    explicit = os.environ.get("SKYWARD_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "skyward"


# How long each end of a small call polls for the other's answer before it sleeps.
LINGER_SECONDS = 0.0002


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass
class LocalCluster(Cluster):
    """A Local pool: the interpreter its nodes run, and how long each end polls for replies."""

    python: str | None = None
    linger: float = 0.0


class LocalNode(Node):
    """A child process slot on this machine."""

    def __init__(self, index: int, cluster: LocalCluster) -> None:
        super().__init__(index, LOOPBACK, LOOPBACK)
        self._cluster = cluster

    async def start_agent(self, env: Mapping[str, str]) -> AgentStream:
        python = self._cluster.python
        if python is None:
            raise BootstrapError("the environment was not prepared before the agent started")
        linger = self._cluster.linger
        full_env = {
            **os.environ,
            **env,
            "PYTHONPATH": _pythonpath(),
            "PYTHONUNBUFFERED": "1",
            LINGER_ENV: str(round(linger * 1e6)),
        }
        return await spawn([python, "-m", "skyward.worker"], full_env, os.getcwd(), linger)


class Local(Provider):
    """Nodes as child processes of this machine: the embedded default provider.

    Args:
        python: interpreter the nodes run; default: this one, or a uv environment built from it
            when the image asks for packages it lacks.
    """

    name = "local"

    def __init__(self, python: str | None = None) -> None:
        self._base_python = python

    def validate(self, spec: ClusterSpec) -> None:
        if spec.accelerator is not None:
            raise ConfigError(
                f"the Local provider runs nodes on this machine's CPU and cannot provide "
                f"accelerator={str(spec.accelerator)!r}; drop `accelerator` or use sky.SSH or "
                "sky.AWS"
            )

    async def launch(self, spec: ClusterSpec, log: Log) -> Cluster:
        # With a core for each node and one for the client, both ends of a small call poll
        # briefly for the other's answer instead of sleeping: it saves the two wake-ups that
        # are most of a small call's round trip. With fewer cores, polling would steal them.
        linger = LINGER_SECONDS if spec.nodes + 1 <= _usable_cores() else 0.0
        cluster = LocalCluster(spec, [], linger=linger)
        cluster.nodes = [LocalNode(i, cluster) for i in range(spec.nodes)]
        return cluster

    async def replace(self, cluster: Cluster, index: int) -> Node:
        """A new process slot for a node whose process died."""
        assert isinstance(cluster, LocalCluster)
        cluster.nodes[index] = LocalNode(index, cluster)
        return cluster.nodes[index]

    async def prepare(self, cluster: Cluster, image: Image, log: Log) -> None:
        assert isinstance(cluster, LocalCluster)
        _check_apt(image.apt)
        spec = env_spec(image)
        cache = cache_dir()
        try:
            if self._base_python is None and _satisfied_here(image):
                await asyncio.to_thread(envbuild.run_setup_once, spec, cache, log)
                cluster.python = sys.executable
            else:
                uv = _uv_binary()
                built = await asyncio.to_thread(
                    envbuild.build, spec, cache, uv, log, base_python=self._base_python
                )
                cluster.python = str(built)
        except envbuild.BuildFailed as exc:
            raise BootstrapError(
                f"building the environment {spec.hash} (cache {cache / 'envs' / spec.hash}) "
                "on this machine "
                f"failed: {exc}\n--- last lines ---\n{exc.output}",
                output=exc.output,
            ) from None

    async def terminate(self, cluster: Cluster) -> None:
        # Agents are killed by the pool with their process groups; nothing else exists.
        return None


def _satisfied_here(image: Image) -> bool:
    """Whether this interpreter already has every requirement of `image` (and the Python)."""
    if image.python and not platform.python_version().startswith(image.python):
        return False
    return probe.satisfied(image.pip)


def _check_apt(packages: tuple[str, ...]) -> None:
    if not packages:
        return
    missing = []
    for package in packages:
        result = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}", package],
            capture_output=True,
            text=True,
            check=False,
        )
        if "install ok installed" not in result.stdout:
            missing.append(package)
    if missing:
        raise BootstrapError(
            f"Image(apt=...) asks for {', '.join(missing)}, not installed on this machine; the "
            f"Local provider never runs apt for you: install them (apt-get install "
            f"{' '.join(missing)}) and start the pool again"
        )


def _uv_binary() -> str:
    try:
        from uv import find_uv_bin

        return str(find_uv_bin())
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if found:
            return found
    raise BootstrapError("uv was not found: `pip install uv` (it builds the nodes' environments)")


def _pythonpath() -> str:
    """This client's own skyward first, then the directory of the script that started it."""
    package = Path(skyward.__file__).resolve().parent
    digest = hashlib.sha256(str(package).encode()).hexdigest()[:12]
    shim = cache_dir() / "src" / digest
    link = shim / "skyward"
    if not link.exists():
        shim.mkdir(parents=True, exist_ok=True)
        tmp = shim / f".skyward-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(package, target_is_directory=True)
        os.replace(tmp, link)
    parts = [str(shim)]
    script_dir = sys.path[0] if sys.path and sys.path[0] else os.getcwd()
    parts.append(script_dir)
    existing = os.environ.get("PYTHONPATH")
    if existing:
        parts.append(existing)
    return os.pathsep.join(parts)
