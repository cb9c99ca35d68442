"""The JAX plugin: the right jax wheel on every node and `jax.distributed` initialized for you.

`transform` picks the wheel from the accelerator and the nodes' driver (CPU, ``jax[cuda12]``,
``jax[cuda13]`` where the driver supports CUDA 13, ``jax[tpu]``), adds the JAX release index
scoped to jax and jaxlib (unless the image names an index for everything, a private mirror),
and drops the user's own jax/jaxlib pins that would shadow it.
`around_app` exports ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``
then calls ``jax.distributed.initialize`` and, at shutdown, ``jax.distributed.shutdown``. A
process is a rank: one per node by default (it sees every device of its node), or
``processes_per_node`` of them, each with its share of the node's GPUs (on the CPU, each its
own CPU device), so ``jax.process_count()`` is every rank of every node. A
script written for another JAX launcher runs unchanged: its own ``initialize()`` with no
arguments, or with the pool's, returns quietly; with ``initialize=False`` it does the work, and
a bare call reads the JAX_* variables.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from skyward import checks
from skyward.errors import ConfigError
from skyward.plugins.base import Plugin
from skyward.plugins.wheels import driver_cuda, names_a_mirror
from skyward.worker import jaxenv

if TYPE_CHECKING:
    # Client-side types: an agent unpickles this plugin and must not load the image (and
    # packaging) with it; `transform`, which runs on the client, imports `Index` itself.
    from skyward.hardware import ClusterSpec
    from skyward.image import Image
    from skyward.info import InstanceInfo

JAX_RELEASES = "https://storage.googleapis.com/jax-releases/jax_releases.html"
LIBTPU_RELEASES = "https://storage.googleapis.com/jax-releases/libtpu_releases.html"

# cu12x is the older spelling (cu121, cu124, ...); it maps to the cuda12 wheel family.
_OLD_CUDA = re.compile(r"^cu(?P<major>1[23])\d?$")
_KNOWN = ("cuda12", "cuda13", "tpu", "cpu")


def normalize_cuda(value: str | None) -> str | None:
    """Map a `cuda` argument to cuda12/cuda13/tpu/cpu (None: decide from the accelerator)."""
    if value is None:
        return None
    # a value of the wrong type is told what to give, as an unknown name is
    text = value if isinstance(value, str) else ""
    key = text.strip().lower().replace("-", "").replace("_", "")
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
        self.version = checks.optional_text(version, "jax(version=)")
        self.initialize = checks.flag(initialize, "jax(initialize=)")
        self.initialization_timeout = checks.whole(
            initialization_timeout, "jax(initialization_timeout=) (seconds)", minimum=1
        )

    def for_script(self) -> JaxPlugin:
        """The same wheel and ``JAX_*`` variables, ``jax.distributed.initialize()`` left to
        the script (it finds its arguments in them)."""
        if not self.initialize:
            return self
        chosen = copy.copy(self)
        chosen.initialize = False
        return chosen

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
        return "cuda13" if driver_cuda(cluster) >= (13, 0) else "cuda12"

    def transform(self, image: Image, cluster: ClusterSpec) -> Image:
        from skyward.image import Index  # on the client only (see the imports above)

        flavour = self.flavour(cluster)
        pin = f"=={self.version}" if self.version else ""
        image = image.without_packages(["jax", "jaxlib"]).with_pip(f"jax[{flavour}]{pin}")
        if names_a_mirror(image):
            return image  # jax comes from the mirror too
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
        coordinator = export_launcher_env(info)
        if not self.initialize or info.world_size == 1:
            # The user's code may initialize JAX itself, with no arguments.
            jaxenv.teach_jax_when_imported()
            yield
            return
        import jax

        if not info.is_head:
            # A process that dials the coordinator before it listens waits ~1 s to retry.
            jaxenv.wait_for_listener(coordinator, self.initialization_timeout)
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=info.world_size,
            process_id=info.rank,
            local_device_ids=rank_devices(info),
            initialization_timeout=self.initialization_timeout,
        )
        try:
            with _pool_owns_initialization(coordinator, info.world_size, info.rank):
                yield
        finally:
            jax.distributed.shutdown()


def export_launcher_env(info: InstanceInfo) -> str:
    """Export ``JAX_COORDINATOR_ADDRESS`` (and ``JAX_COORDINATOR_BIND_ADDRESS``, the same),
    ``JAX_NUM_PROCESSES`` (every rank) and ``JAX_PROCESS_ID`` (this rank) for this rank (the
    coordinator on node 0's ``jax`` port), and the GPUs it uses where a node holds several
    ranks (`rank_devices`, for a bare ``initialize()``); returns the coordinator's address."""
    coordinator = f"{info.head_addr}:{info.ports['jax']}"
    os.environ["JAX_COORDINATOR_ADDRESS"] = coordinator
    # Node 0's coordinator listens only where the others dial it (the pool's private address;
    # 127.0.0.1 on Local): a script's own initialize() reads the variable too.
    jaxenv.bind_coordinator(coordinator)
    os.environ["JAX_NUM_PROCESSES"] = str(info.world_size)
    os.environ["JAX_PROCESS_ID"] = str(info.rank)
    devices = rank_devices(info)
    if devices is not None:
        os.environ[jaxenv.LOCAL_DEVICES_ENV] = ",".join(map(str, devices))
    return coordinator


def rank_devices(info: InstanceInfo) -> list[int] | None:
    """The node's GPUs (as its processes number them, from 0) that this rank's JAX uses where
    the node holds several ranks: an equal share each, in rank order (GPU ``LOCAL_RANK`` with
    one rank a GPU). None, every device of the node, with one rank per node or no GPU."""
    count, ranks = info.accelerator_count, info.processes_per_node
    if ranks == 1 or count == 0:
        return None
    share = count // ranks
    if share == 0:  # more ranks than GPUs: refused where GPUs were asked for
        return [info.local_rank % count]
    return list(range(info.local_rank * share, (info.local_rank + 1) * share))


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


@contextlib.contextmanager
def _pool_owns_initialization(coordinator: str, count: int, rank: int) -> Iterator[None]:
    """While the plugin's initialization stands, a script's own ``jax.distributed.initialize``
    returns quietly when it asks for nothing else (no arguments, or the pool's), and its
    ``jax.distributed.shutdown`` leaves the pool's runtime up; other arguments raise."""
    import jax.distributed as distributed

    real = distributed.initialize, distributed.shutdown
    pool = {"coordinator_address": coordinator, "num_processes": count, "process_id": rank}

    def initialize(
        coordinator_address: str | None = None,
        num_processes: int | None = None,
        process_id: int | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        asked = {
            "coordinator_address": coordinator_address,
            "num_processes": num_processes,
            "process_id": process_id,
        }
        conflicts = [
            f"{name}={value!r} (the pool's: {pool[name]!r})"
            for name, value in asked.items()
            if value is not None and value != pool[name]
        ]
        if conflicts:
            raise ConfigError(
                f"jax.distributed.initialize({', '.join(conflicts)}) conflicts with the JAX "
                "distributed setup the pool's JAX plugin already made on this node; to let "
                "your code initialize JAX itself, use sky.plugins.jax(initialize=False)"
            )
        _note_once(
            "jax.distributed.initialize() called on rank %d: the pool's JAX plugin already "
            "initialized it with these settings; nothing to do",
            rank,
        )

    def shutdown() -> None:
        _note_once("jax.distributed.shutdown() on rank %d: left to the pool", rank)

    distributed.initialize, distributed.shutdown = initialize, shutdown
    try:
        yield
    finally:
        distributed.initialize, distributed.shutdown = real


_noted: set[str] = set()


def _note_once(message: str, *args: object) -> None:
    if message not in _noted:
        _noted.add(message)
        logging.getLogger("skyward").debug(message, *args)
