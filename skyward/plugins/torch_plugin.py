"""The PyTorch plugin: the right torch wheel on every node and ``torch.distributed`` initialized.

`transform` adds ``torch`` (pinned with ``version=``) and the PyTorch wheel index that fits the
nodes, scoped to the torch packages: the CUDA build for the nodes' driver on GPU nodes, the CPU
build elsewhere (unless the image's default index replaces PyPI, a private mirror: torch then
comes from it, as PyPI serves it; an extra index leaves the choice as it is).
`around_app` exports torchrun's variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``; one process per node), then calls
``torch.distributed.init_process_group`` on a store that node 0 serves on the pool's address
only (NCCL where the node has a GPU, gloo otherwise) and
destroys the group when the node ends. With ``initialize=False`` only the variables are
exported, for a script that calls ``init_process_group()`` itself (``skyward run``).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from skyward import checks
from skyward.errors import ConfigError
from skyward.plugins.base import Plugin
from skyward.plugins.wheels import driver_cuda

if TYPE_CHECKING:
    # Client-side types: an agent unpickles this plugin and must not load the image (and
    # packaging) with it; `transform`, which runs on the client, imports `Index` itself.
    from skyward.hardware import ClusterSpec
    from skyward.image import Image
    from skyward.info import InstanceInfo

TORCH_WHEELS = "https://download.pytorch.org/whl"
TORCH_PACKAGES = ("torch", "torchvision", "torchaudio")
BACKENDS = ("gloo", "nccl")

# The CUDA builds PyTorch publishes, newest first, with the lowest driver CUDA each needs.
# CUDA's minor-version compatibility lets a build run on any driver of its major version.
_CUDA_BUILDS = (((13, 0), "cu130"), ((12, 8), "cu128"), ((12, 6), "cu126"), ((12, 0), "cu126"))


class TorchPlugin(Plugin):
    """Installs PyTorch for the accelerator and joins every node to one process group.

    Args:
        backend: ``"nccl"`` or ``"gloo"``; None: NCCL where the node has a GPU, gloo otherwise.
        version: a torch version to pin (``"2.13.0"``); default: the image's own requirement
            on torch if it has one, else the newest.
        initialize: call ``init_process_group``; False only exports the variables.
        timeout: seconds every node has to join the group (and each collective to finish).
    """

    name = "torch"
    ports = ("torch",)

    def __init__(
        self,
        backend: str | None = None,
        *,
        version: str | None = None,
        initialize: bool = True,
        timeout: float = 120,
    ) -> None:
        super().__init__()
        if backend is not None and backend not in BACKENDS:
            raise ConfigError(
                f"sky.plugins.torch(backend={backend!r}) is not a torch.distributed backend "
                f"skyward sets up; use one of {BACKENDS}, or None to choose from the node"
            )
        self.backend = backend
        self.version = checks.optional_text(version, "torch(version=)")
        self.initialize = checks.flag(initialize, "torch(initialize=)")
        self.timeout = checks.seconds(timeout, "torch(timeout=)")

    def build(self, cluster: ClusterSpec) -> str:
        """The PyTorch build for `cluster`: ``"cpu"`` without GPUs (a TPU too: torch_xla is
        not installed), else the newest CUDA build its nodes' driver runs (``"cu128"``)."""
        accelerator = cluster.accelerator
        if accelerator is None or accelerator.is_tpu:
            return "cpu"
        cuda = driver_cuda(cluster)
        for lowest, tag in _CUDA_BUILDS:
            if cuda >= lowest:
                return tag
        raise ConfigError(
            f"the nodes' NVIDIA driver supports CUDA {cluster.cuda}; PyTorch's CUDA builds need "
            "12.0 or newer: use an image with a newer driver"
        )

    def transform(self, image: Image, cluster: ClusterSpec) -> Image:
        from skyward.image import Index  # on the client only (see the imports above)

        if self.version is not None:
            image = image.without_packages(["torch"]).with_pip(f"torch=={self.version}")
        elif not any(r.name.lower() == "torch" for r in image.requirements()):
            image = image.with_pip("torch")
        # Only a default index (a mirror in place of PyPI) serves torch itself; an extra index
        # (a company's own packages) does not make CPU nodes take PyPI's 3 GB CUDA build.
        if image.default_index is not None:
            return image
        url = f"{TORCH_WHEELS}/{self.build(cluster)}"
        return image.with_indexes(Index(url, packages=TORCH_PACKAGES))

    def around_app(self, info: InstanceInfo) -> contextlib.AbstractContextManager[Any]:
        return self._process_group(info)

    @contextlib.contextmanager
    def _process_group(self, info: InstanceInfo) -> Iterator[None]:
        export_torch_env(info)
        if not self.initialize:
            yield
            return
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        gpu = torch.cuda.is_available()
        backend = self.backend or ("nccl" if gpu else "gloo")
        if gpu:
            torch.cuda.set_device(0)  # the node's first GPU it owns: one process per node
        timeout = timedelta(seconds=self.timeout)
        # What ``init_method="env://"`` would make, except that node 0's store listens only on
        # the pool's address (torch's own binds every interface, where anyone could read and
        # write the keys the group bootstraps from). The store keeps the listening socket.
        listening = _listen(info) if info.is_head else None
        try:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                info.head_addr,
                info.ports["torch"],
                info.total_nodes,
                info.is_head,
                timeout,
                master_listen_fd=listening,
            )
        except BaseException:
            if listening is not None:
                os.close(listening)
            raise
        dist.init_process_group(
            backend, store=store, rank=info.node, world_size=info.total_nodes, timeout=timeout
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


def _listen(info: InstanceInfo) -> int:
    """A socket listening on the pool's address and ``torch`` port, for node 0's store: its
    file descriptor, which the store then owns (it does not copy it)."""
    family = socket.AF_INET6 if ":" in info.head_addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((info.head_addr, info.ports["torch"]))
        sock.listen(socket.SOMAXCONN)
        return sock.detach()


def export_torch_env(info: InstanceInfo) -> None:
    """Export what torchrun gives each process (one per node here): ``MASTER_ADDR`` and
    ``MASTER_PORT`` (node 0's ``torch`` port), ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``."""
    os.environ.update(
        {
            "MASTER_ADDR": info.head_addr,
            "MASTER_PORT": str(info.ports["torch"]),
            "RANK": str(info.node),
            "WORLD_SIZE": str(info.total_nodes),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
        }
    )


def torch(
    backend: str | None = None,
    *,
    version: str | None = None,
    initialize: bool = True,
    timeout: float = 120,
) -> TorchPlugin:
    """The PyTorch plugin (see `TorchPlugin`): ``sky.plugins.torch()``."""
    return TorchPlugin(backend, version=version, initialize=initialize, timeout=timeout)
