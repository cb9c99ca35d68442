"""`ClusterSpec`: what a pool asks its provider for, and the accelerator spelling it accepts."""

from __future__ import annotations

import re
from dataclasses import dataclass

from skyward.errors import ConfigError

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
    # The highest CUDA every node's driver supports ("13.0"), when the provider knows it before
    # launch; None otherwise (the JAX plugin then assumes CUDA 12 for a GPU).
    cuda: str | None = None
    # Where the nodes' outputs go when the pool ends: an absolute local directory (node i's in
    # its ``node-<i>`` folder) or an ``s3://bucket/prefix`` the nodes upload to; None: nowhere.
    outputs: str | None = None
