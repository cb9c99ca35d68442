"""The hardware of a pool: `ClusterSpec`, what it asks its provider for, with `Accelerator`, the
accelerator spelling it accepts; `Hardware`, what the provider found on the nodes once they
were up. (The `Cluster` a provider made is `skyward.providers.base.Cluster`.)"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from skyward.errors import ConfigError
from skyward.worker.gpus import ANY, Gpu

_ACCELERATOR = re.compile(r"^(?P<name>[A-Za-z][A-Za-z0-9._-]*)(?::(?P<count>[1-9][0-9]*))?$")

# Accelerator families the JAX plugin maps to wheels; providers may know more names.
TPU_PREFIX = "TPU"
# The TPU API's own accelerator types (V4-32, V5LITEPOD-16, V6E-8) are TPUs too.
_TPU_TYPE = re.compile(r"^V\d+[A-Z]*-\d+$")


@dataclass(frozen=True)
class Accelerator:
    """An accelerator per node: a name such as ``"A100"`` and how many of it (``"A100:8"``)."""

    name: str
    count: int = 1

    @classmethod
    def parse(cls, text: str) -> Accelerator:
        """Parse ``"NAME"`` or ``"NAME:COUNT"``; raises `ConfigError` on anything else."""
        match = _ACCELERATOR.match(text.strip())
        if not match:
            raise ConfigError(
                f"accelerator {text!r} is not of the form NAME or NAME:COUNT (e.g. 'A100:8')"
            )
        return cls(match["name"].upper(), int(match["count"] or 1))

    @property
    def is_tpu(self) -> bool:
        return self.name.startswith(TPU_PREFIX) or bool(_TPU_TYPE.match(self.name))

    def __str__(self) -> str:
        return self.name if self.count == 1 else f"{self.name}:{self.count}"


@dataclass(frozen=True)
class ClusterSpec:
    """The shape of a pool, given to the provider and to every plugin's `transform` hook."""

    nodes: int
    pool_id: str
    accelerator: Accelerator | None = None
    provider: str = "local"
    image_hash: str = ""
    # The highest CUDA every node's driver supports ("13.0"), once the nodes are up and their
    # provider has looked (`Hardware`); None before, without GPUs, or when a driver did not say
    # (the JAX plugin then assumes CUDA 12 for a GPU).
    cuda: str | None = None
    # Where the nodes' outputs go when the pool ends: an absolute local directory (node i's in
    # its ``node-<i>`` folder) or an ``s3://bucket/prefix`` the nodes upload to; None: nowhere.
    outputs: str | None = None
    # The ranks (agent processes) on each node: what `processes_per_node=` asked, or the
    # plugins' default for the nodes' GPUs once they are known (one per GPU for PyTorch).
    processes_per_node: int = 1

    def seen(self, hardware: Hardware) -> ClusterSpec:
        """This spec with what the nodes turned out to have: the CUDA their drivers support
        and, when no accelerator was named and every node owns GPUs, those GPUs as the
        accelerator (so plugins choose for them). Itself when nothing changes."""
        accelerator = self.accelerator or hardware.gpus
        if (accelerator, hardware.cuda) == (self.accelerator, self.cuda):
            return self
        return replace(self, accelerator=accelerator, cuda=hardware.cuda)


@dataclass(frozen=True)
class Hardware:
    """What the nodes of a launched pool have, as their provider found it (`Provider.survey`).

    Both are None unless every node owns at least one GPU. `gpus` is then the accelerator
    they share: the GPUs' name when all have the same (``H100``), else ``GPU``, and the fewest
    any node owns. `cuda` is the lowest of the CUDA versions their drivers support, so that a
    wheel built for it runs on every node; None when a driver did not say.
    """

    cuda: str | None = None
    gpus: Accelerator | None = None

    @classmethod
    def of(cls, owned: Sequence[tuple[Gpu, ...]], cuda: Sequence[str | None]) -> Hardware:
        """From each node's GPUs and the CUDA its driver supports, in node order."""
        if not owned or not all(owned):
            return cls()
        names = {gpu.name for gpus in owned for gpu in gpus}
        gpus = Accelerator(names.pop() if len(names) == 1 else ANY, min(map(len, owned)))
        known = [version for version in cuda if version]
        lowest = min(known, key=_version_key) if len(known) == len(cuda) else None
        return cls(lowest, gpus)

    def describe(self) -> str:
        """In words, for the pool's status line: "every node has 8 x H100 (CUDA 12.4)"."""
        if self.gpus is None:
            return "some node has no GPU"
        cuda = f" (CUDA {self.cuda})" if self.cuda else ""
        return f"every node has {self.gpus.count} x {self.gpus.name}{cuda}"


def _version_key(version: str) -> tuple[int, ...]:
    """ "12.4" -> (12, 4): CUDA versions compare by number, not as text ("12.10" > "12.4")."""
    return tuple(int(part) for part in version.split(".") if part.isdigit())
