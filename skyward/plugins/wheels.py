"""What the plugins that install an accelerated framework (JAX, PyTorch) read off a pool to
choose its wheels: the CUDA the nodes' drivers support, and whether the image names a default
index (a mirror) that must serve everything.

Runs on the client only (from the plugins' `transform`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from skyward.hardware import ClusterSpec
    from skyward.image import Image

ASSUMED_CUDA = (12, 0)
"""The drivers' CUDA when the provider cannot tell before launch: the oldest that every
framework's current GPU wheels still support."""


def driver_cuda(cluster: ClusterSpec) -> tuple[int, int]:
    """(major, minor) of the highest CUDA every node's driver supports (`ClusterSpec.cuda`, the
    lowest across the nodes), or `ASSUMED_CUDA` when it is not known yet."""
    if not cluster.cuda:
        return ASSUMED_CUDA
    parts = [int(p) for p in cluster.cuda.split(".")[:2] if p.isdigit()]
    return (parts[0], parts[1] if len(parts) > 1 else 0) if parts else ASSUMED_CUDA


def names_a_mirror(image: Image) -> bool:
    """Whether `image` names a default index (a private network's mirror, in place of PyPI):
    then a framework's wheels come from it too. A release index scoped to the framework would
    be the only place uv looked for it, and hosts that need a mirror cannot reach that index.
    An extra index, even unscoped, is not one: PyPI stays, and so does the release index."""
    return image.default_index is not None
