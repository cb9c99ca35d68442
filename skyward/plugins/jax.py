"""The JAX plugin: the right jax wheel on every node and `jax.distributed` initialized for you.

`transform` picks the wheel from the accelerator and the nodes' driver (CPU, ``jax[cuda12]``,
``jax[cuda13]`` where the driver supports CUDA 13, ``jax[tpu]``), adds the JAX release index
scoped to jax and jaxlib, and drops the user's own jax/jaxlib pins that would shadow it.
`around_app` exports ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``
(so scripts written for other JAX launchers work with ``initialize=False``), then calls
``jax.distributed.initialize`` and, at shutdown, ``jax.distributed.shutdown``.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

from skyward.cluster import ClusterSpec
from skyward.errors import ConfigError
from skyward.image import Image, Index
from skyward.info import InstanceInfo
from skyward.plugins.base import Plugin

JAX_RELEASES = "https://storage.googleapis.com/jax-releases/jax_releases.html"
LIBTPU_RELEASES = "https://storage.googleapis.com/jax-releases/libtpu_releases.html"

# cu12x is the older spelling (cu121, cu124, ...); it maps to the cuda12 wheel family.
_OLD_CUDA = re.compile(r"^cu(?P<major>1[23])\d?$")
_KNOWN = ("cuda12", "cuda13", "tpu", "cpu")


def normalize_cuda(value: str | None) -> str | None:
    """Map a `cuda` argument to cuda12/cuda13/tpu/cpu (None: decide from the accelerator)."""
    if value is None:
        return None
    key = value.strip().lower().replace("-", "").replace("_", "")
    if key in _KNOWN:
        return key
    old = _OLD_CUDA.match(key)
    if old:
        return f"cuda{old['major']}"
    raise ConfigError(
        f"sky.plugins.jax(cuda={value!r}) is not a known JAX accelerator flavour; use one of "
        f"'cuda12', 'cuda13', 'tpu', 'cpu' (or the older 'cu12x' spelling, e.g. 'cu124'), "
        "or None to choose from the pool's accelerator"
    )


class JaxPlugin(Plugin):
    """Installs JAX for the accelerator and runs ``jax.distributed.initialize`` on every node.

    Args:
        cuda: ``"cuda12"``, ``"cuda13"``, ``"tpu"``, ``"cpu"``, an older ``"cu12x"`` tag, or None to
            choose from the pool's accelerator (CPU when there is none; for a GPU, cuda13 where
            the nodes' driver supports CUDA 13, else cuda12).
        version: a jax version to pin (``"0.4.35"``); default: the newest.
        initialize: call ``jax.distributed.initialize``; False only exports the JAX_* variables.
        initialization_timeout: seconds every node has to join the coordinator.
    """

    name = "jax"
    ports = ("jax",)

    def __init__(
        self,
        cuda: str | None = None,
        *,
        version: str | None = None,
        initialize: bool = True,
        initialization_timeout: int = 120,
    ) -> None:
        super().__init__()
        self.cuda = normalize_cuda(cuda)
        self.version = version
        self.initialize = initialize
        self.initialization_timeout = initialization_timeout

    def flavour(self, cluster: ClusterSpec) -> str:
        """The wheel family for `cluster`: the explicit `cuda`; else from its accelerator and
        the highest CUDA its nodes' drivers support (cuda13 where they support CUDA 13, cuda12
        otherwise or when the provider cannot tell before launch)."""
        if self.cuda is not None:
            return self.cuda
        accelerator = cluster.accelerator
        if accelerator is None:
            return "cpu"
        if accelerator.is_tpu:
            return "tpu"
        major = int(cluster.cuda.split(".")[0]) if cluster.cuda else 12
        return "cuda13" if major >= 13 else "cuda12"

    def transform(self, image: Image, cluster: ClusterSpec) -> Image:
        flavour = self.flavour(cluster)
        pin = f"=={self.version}" if self.version else ""
        image = image.without_packages(["jax", "jaxlib"]).with_pip(f"jax[{flavour}]{pin}")
        if flavour == "tpu":
            image = image.with_indexes(
                Index(JAX_RELEASES, packages=("jax", "jaxlib"), flat=True),
                Index(LIBTPU_RELEASES, packages=("libtpu",), flat=True),
            )
        elif flavour != "cpu":
            image = image.with_indexes(Index(JAX_RELEASES, packages=("jax", "jaxlib"), flat=True))
        return image

    def around_app(self, info: InstanceInfo) -> contextlib.AbstractContextManager[Any]:
        return self._distributed(info)

    @contextlib.contextmanager
    def _distributed(self, info: InstanceInfo) -> Iterator[None]:
        port = info.ports["jax"]
        coordinator = f"{info.head_addr}:{port}"
        os.environ["JAX_COORDINATOR_ADDRESS"] = coordinator
        os.environ["JAX_NUM_PROCESSES"] = str(info.total_nodes)
        os.environ["JAX_PROCESS_ID"] = str(info.node)
        if not self.initialize:
            _teach_jax_the_environment()
            yield
            return
        if info.total_nodes == 1:
            yield
            return
        import jax

        if not info.is_head:
            _wait_for_coordinator(info.head_addr, port, self.initialization_timeout)
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=info.total_nodes,
            process_id=info.node,
            initialization_timeout=self.initialization_timeout,
        )
        try:
            yield
        finally:
            jax.distributed.shutdown()  # type: ignore[no-untyped-call]


def jax(
    cuda: str | None = None,
    *,
    version: str | None = None,
    initialize: bool = True,
    initialization_timeout: int = 120,
) -> JaxPlugin:
    """The JAX plugin (see `JaxPlugin`): ``sky.plugins.jax()``."""
    return JaxPlugin(
        cuda, version=version, initialize=initialize, initialization_timeout=initialization_timeout
    )


def _wait_for_coordinator(host: str, port: int, timeout: float) -> None:
    """Return once the head's coordinator accepts connections (or `timeout` passed).

    A process that dials the coordinator before it listens is refused, and gRPC then waits about
    a second before trying again: on a pool whose nodes import JAX at slightly different speeds
    that second is most of the start-up. Knocking first costs a few milliseconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.02)


_taught = False


def _teach_jax_the_environment() -> None:
    """Make a bare ``jax.distributed.initialize()`` read the JAX_* variables exported above.

    JAX reads only ``JAX_COORDINATOR_ADDRESS`` by itself; the process count and id come from a
    cluster environment it detects (SLURM, MPI, ...). Registering one for skyward lets launcher
    scripts call ``initialize()`` with no arguments. The hook is JAX-internal, so its absence in
    some JAX release only means those scripts must pass the variables themselves.
    """
    global _taught
    if _taught:
        return
    try:
        from jax._src import clusters
    except ImportError:
        return

    class SkywardCluster(clusters.ClusterEnv):  # type: ignore[no-untyped-call]  # registers itself
        name = "skyward"

        @classmethod
        def is_env_present(cls) -> bool:
            return "JAX_NUM_PROCESSES" in os.environ and "JAX_PROCESS_ID" in os.environ

        @classmethod
        def get_coordinator_address(
            cls, timeout_secs: int | None, override_coordinator_port: str | None = None
        ) -> str:
            return os.environ["JAX_COORDINATOR_ADDRESS"]

        @classmethod
        def get_process_count(cls) -> int:
            return int(os.environ["JAX_NUM_PROCESSES"])

        @classmethod
        def get_process_id(cls) -> int:
            return int(os.environ["JAX_PROCESS_ID"])

    _taught = SkywardCluster is not None
