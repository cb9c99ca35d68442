"""Whether an interpreter already has what an image asks for (runs on the node, or locally).

Standard library plus `packaging`; without `packaging` nothing counts as satisfied, and the
environment is built instead.

JAX's accelerator extras are judged by what runs JAX, not by how the CUDA libraries arrived:
``jax[cuda13]`` is satisfied by jax with its CUDA 13 plugin installed, whether the CUDA libraries
came as the extra's pip wheels or with the machine (a system CUDA, an image built by hand), as
on most GPU workstations and deep-learning images. Otherwise a multi-gigabyte environment would
be built beside a jax that already runs on the GPU.
"""

from __future__ import annotations

import importlib.metadata as metadata
from collections.abc import Iterable
from typing import Any


def satisfied(requirements: Iterable[str]) -> bool:
    """True when this interpreter has a distribution matching every requirement (and extras)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return False
    return all(_installed(Requirement(text), frozenset()) for text in requirements)


# jax's accelerator extras: their requirements count without the extras they ask of them in turn
# (``jax-cuda13-plugin[with-cuda]``: the CUDA libraries as pip wheels).
JAX_ACCELERATORS = frozenset({"cuda12", "cuda13", "tpu"})


def _installed(req: Any, seen: frozenset[str]) -> bool:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    if req.marker is not None and not req.marker.evaluate():
        return True
    name = canonicalize_name(req.name)
    if name in seen:
        return True
    try:
        dist = metadata.distribution(req.name)
    except metadata.PackageNotFoundError:
        return False
    if req.specifier and not req.specifier.contains(dist.version, prereleases=True):
        return False
    bare = name == "jax" and bool(req.extras) and set(req.extras) <= JAX_ACCELERATORS
    for extra in req.extras:
        for dep_text in dist.requires or ():
            dep = Requirement(dep_text)
            if dep.marker is not None and dep.marker.evaluate({"extra": extra}):
                dep.marker = None
                if bare:
                    dep.extras = set()
                if not _installed(dep, seen | {name}):
                    return False
    return True


def main() -> None:
    """``python -m skyward.worker.probe REQUIREMENTS_JSON``: print ``{"satisfied": bool}``."""
    import json
    import sys

    print(json.dumps({"satisfied": satisfied(json.loads(sys.argv[1]))}))


if __name__ == "__main__":
    main()
