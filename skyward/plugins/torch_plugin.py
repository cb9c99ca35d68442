"""The PyTorch plugin: the right torch wheel on every node and ``torch.distributed`` initialized.

`transform` adds ``torch`` (pinned with ``version=``) and the PyTorch wheel index that fits the
nodes, scoped to the torch packages: the CUDA build for the nodes' driver on GPU nodes, the CPU
build elsewhere (unless the image's default index replaces PyPI, a private mirror: torch then
comes from it, as PyPI serves it; an extra index leaves the choice as it is).
`around_app` exports torchrun's variables in every rank (``MASTER_ADDR``, ``MASTER_PORT``,
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, and Lightning's
``NODE_RANK``), then calls ``torch.distributed.init_process_group`` over every rank of every
node, on a store that rank 0 serves on the pool's address only (NCCL where the node has a GPU,
each rank on GPU ``LOCAL_RANK``; gloo otherwise) and destroys the group when the rank ends. A
pool with this plugin holds one rank per GPU of a node unless it says `processes_per_node`.
With ``initialize=False`` only the variables are exported, for a script that calls
``init_process_group()`` itself (``skyward run``), and a pool holds one rank per node unless it
says otherwise, as torchrun does.
"""

from __future__ import annotations

import contextlib
import copy
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
    """Installs PyTorch for the accelerator and joins every rank to one process group.

    Args:
        backend: ``"nccl"`` or ``"gloo"``; None: NCCL where the node has a GPU, gloo otherwise.
        version: a torch version to pin (``"2.13.0"``); default: the image's own requirement
            on torch if it has one, else the newest.
        initialize: call ``init_process_group``; False only exports the variables.
        timeout: seconds every rank has to join the group (and each collective to finish).
        per_gpu: whether a pool that does not say ``processes_per_node`` holds a rank for each
            GPU of a node; None: where the plugin makes the group (with ``initialize=False``
            the code that does says how many, as under torchrun).
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
        per_gpu: bool | None = None,
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
        self.per_gpu = None if per_gpu is None else checks.flag(per_gpu, "torch(per_gpu=)")

    @property
    def rank_per_gpu(self) -> bool:
        """`per_gpu`, by default where the plugin makes the group."""
        return self.initialize if self.per_gpu is None else self.per_gpu

    def for_script(self) -> TorchPlugin:
        """The same wheel and ``MASTER_*``/``RANK`` variables, ``init_process_group`` left to
        the script, and the same ranks a node by default (one per GPU where this plugin
        would have made the group)."""
        if not self.initialize:
            return self
        chosen = copy.copy(self)
        chosen.initialize = False
        chosen.per_gpu = self.rank_per_gpu
        return chosen

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
            torch.cuda.set_device(_rank_gpu(info, torch.cuda.device_count()))
        timeout = timedelta(seconds=self.timeout)
        # What ``init_method="env://"`` would make, except that node 0's store listens only on
        # the pool's address (torch's own binds every interface, where anyone could read and
        # write the keys the group bootstraps from). The store keeps the listening socket.
        listening = _listen(info) if info.is_head else None
        try:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                info.head_addr,
                info.ports["torch"],
                info.world_size,
                info.is_head,
                timeout,
                master_listen_fd=listening,
            )
        except BaseException:
            if listening is not None:
                os.close(listening)
            raise
        dist.init_process_group(
            backend, store=store, rank=info.rank, world_size=info.world_size, timeout=timeout
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


def _rank_gpu(info: InstanceInfo, visible: int) -> int:
    """The GPU a rank uses, as torchrun's ranks do: ``cuda:LOCAL_RANK`` of the node's GPUs."""
    if info.local_rank >= visible:
        raise ConfigError(
            f"rank {info.rank} is local rank {info.local_rank} of node {info.node}, which has "
            f"{visible} GPU(s): NCCL needs a GPU of its own for every rank; give the pool "
            f"processes_per_node={visible} or fewer (or backend='gloo' to run on the CPU)"
        )
    return info.local_rank


def _listen(info: InstanceInfo) -> int:
    """A socket listening on the pool's address and ``torch`` port, for rank 0's store: its
    file descriptor, which the store then owns (it does not copy it)."""
    family = socket.AF_INET6 if ":" in info.head_addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((info.head_addr, info.ports["torch"]))
        sock.listen(socket.SOMAXCONN)
        return sock.detach()


def export_torch_env(info: InstanceInfo) -> None:
    """Export what torchrun gives each process: ``MASTER_ADDR`` and ``MASTER_PORT`` (node 0's
    ``torch`` port), ``RANK`` (global), ``WORLD_SIZE`` (every rank), ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE`` (the ranks of a node), ``GROUP_RANK`` (the node), and ``NODE_RANK``,
    Lightning's name for the node (torchrun does not set it)."""
    os.environ.update(
        {
            "MASTER_ADDR": info.head_addr,
            "MASTER_PORT": str(info.ports["torch"]),
            "RANK": str(info.rank),
            "WORLD_SIZE": str(info.world_size),
            "LOCAL_RANK": str(info.local_rank),
            "LOCAL_WORLD_SIZE": str(info.processes_per_node),
            "GROUP_RANK": str(info.node),
            "NODE_RANK": str(info.node),
        }
    )


def torch(
    backend: str | None = None,
    *,
    version: str | None = None,
    initialize: bool = True,
    timeout: float = 120,
    per_gpu: bool | None = None,
) -> TorchPlugin:
    """The PyTorch plugin (see `TorchPlugin`): ``sky.plugins.torch()``."""
    return TorchPlugin(
        backend, version=version, initialize=initialize, timeout=timeout, per_gpu=per_gpu
    )
