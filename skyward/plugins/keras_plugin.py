"""The Keras plugin: the backend chosen before Keras is imported, and data parallelism over nodes.

With the jax backend, on several nodes it installs ``keras.distribution.DataParallel`` over
every device of every node, so ``model.fit`` on each node trains one replicated model, each node
feeding its own batches.
One node with several devices (``accelerator="H100:8"``) gets the same over its own devices.
Stacked after the JAX plugin it reuses the ``jax.distributed`` setup already done; alone, it asks
Keras to initialize the distributed runtime itself, its coordinator on node 0 listening only on
the pool's address, as the JAX plugin's does. With the torch backend (stacked after the
PyTorch plugin) data parallelism is torch.distributed's: the plugin sets the backend and says so,
and a pool holds one rank per GPU of a node, as PyTorch wants (unless it says
``processes_per_node``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from skyward import checks
from skyward.errors import ConfigError
from skyward.plugins.base import Plugin
from skyward.worker import jaxenv

if TYPE_CHECKING:
    # Client-side types: an agent unpickles this plugin and must not load the image (and
    # packaging) with it.
    from skyward.hardware import ClusterSpec
    from skyward.image import Image
    from skyward.info import InstanceInfo

BACKENDS = ("jax", "tensorflow", "torch", "numpy")
TORCH_DATA_PARALLEL = (
    "keras plugin: with the torch backend, Keras's own distribution API (JAX-only) is not used; "
    "data parallelism across nodes is torch.distributed's: stack sky.plugins.torch() first and "
    "wrap the model in torch.nn.parallel.DistributedDataParallel"
)


class KerasPlugin(Plugin):
    """Sets ``KERAS_BACKEND`` on every node and, with several nodes, a data-parallel distribution.

    Args:
        backend: the Keras backend (``"jax"``; ``"torch"`` on several nodes with the torch plugin
            doing the data parallelism; others work on a single node).
        distribute: install ``DataParallel`` over all devices when there are several (several
            nodes, or one node with several GPUs).
    """

    name = "keras"
    ports = ("keras",)

    def __init__(self, backend: str = "jax", *, distribute: bool = True) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ConfigError(f"unknown Keras backend {backend!r}; use one of {BACKENDS}")
        self.backend = backend
        self.distribute = checks.flag(distribute, "keras(distribute=)")

    @property
    def rank_per_gpu(self) -> bool:
        """On the torch backend a model is a torch module, trained a rank per GPU (DDP)."""
        return self.backend == "torch"

    def transform(self, image: Image, cluster: ClusterSpec) -> Image:
        if any(r.name.lower() == "keras" for r in image.requirements()):
            return image
        return image.with_pip("keras>=3")

    def around_app(self, info: InstanceInfo) -> contextlib.AbstractContextManager[Any]:
        return self._configured(info)

    @contextlib.contextmanager
    def _configured(self, info: InstanceInfo) -> Iterator[None]:
        loaded = sys.modules.get("keras")
        if loaded is not None and loaded.backend.backend() != self.backend:
            raise ConfigError(
                f"keras was imported with backend {loaded.backend.backend()!r} before the keras "
                f"plugin could set {self.backend!r}; do not import keras at node start-up"
            )
        os.environ["KERAS_BACKEND"] = self.backend
        alone = info.world_size == 1
        if not self.distribute or (alone and self.backend != "jax"):
            yield
            return
        if self.backend == "torch":
            # Keras's distribution API is JAX-only; with torch, the model is a torch module
            # and data parallelism is torch.distributed's (DDP), which the torch plugin sets up.
            if info.is_head:
                print(TORCH_DATA_PARALLEL, file=sys.stderr, flush=True)
            yield
            return
        if self.backend != "jax":
            raise ConfigError(
                f"multi-node data parallelism needs the jax or torch backend, not "
                f"{self.backend!r}: pass distribute=False to train each node on its own"
            )
        import keras

        if not alone and not _jax_distributed_ready():
            coordinator = f"{info.head_addr}:{info.ports['keras']}"
            # Keras passes no bind address to jax.distributed.initialize: without this its
            # coordinator would listen on every interface, as the JAX plugin's does not.
            jaxenv.bind_coordinator(coordinator)
            keras.distribution.initialize(
                job_addresses=coordinator,
                num_processes=info.world_size,
                process_id=info.rank,
            )
        elif not alone:
            # Keras's own initialize() agrees one random seed across processes, so unseeded
            # models start identical on every node; do the same when JAX was set up for it.
            keras.utils.set_random_seed(_shared_seed(info.pool_id))
        devices = keras.distribution.list_devices()  # every node's (one node: its own GPUs)
        if len(devices) > 1:
            # Each node feeds its own batches (numpy arrays or its own dataset): Keras must not
            # try to shard the input itself, which it can only do for a tf.data.Dataset.
            distribution = keras.distribution.DataParallel(
                devices=devices, auto_shard_dataset=False
            )
            keras.distribution.set_distribution(distribution)
        yield


def _shared_seed(pool_id: str) -> int:
    """A seed every node of the pool derives alike, and another pool does not."""
    return int.from_bytes(hashlib.sha256(pool_id.encode()).digest()[:4], "big")


def _jax_distributed_ready() -> bool:
    # Asking jax.process_count() would start the backend and make a later initialize fail.
    import jax

    return bool(jax.distributed.is_initialized())


def keras(backend: str = "jax", *, distribute: bool = True) -> KerasPlugin:
    """The Keras plugin (see `KerasPlugin`): ``sky.plugins.keras(backend="jax")``."""
    return KerasPlugin(backend, distribute=distribute)
