"""The build recipe shared by every provider: an `Image` plus what the agent itself needs."""

from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from skyward.image import Image
from skyward.worker import envbuild


def worker_pins() -> tuple[str, ...]:
    """What every built environment needs for the agent, pinned to the client's versions."""
    return (f"cloudpickle=={metadata.version('cloudpickle')}", "packaging")


def client_python() -> str:
    """This client's Python as major.minor ("3.11"): what the nodes run unless the image says."""
    return "{}.{}".format(*sys.version_info[:2])


def env_spec(image: Image) -> envbuild.EnvSpec:
    """The build recipe for `image`, including the agent's own pins and the nodes' Python (the
    client's major.minor unless `Image.python` names one)."""
    pins = worker_pins()
    pip = (
        *image.pip,
        *(
            p
            for p in pins
            if canonicalize_name(Requirement(p).name)
            not in {canonicalize_name(r.name) for r in image.requirements()}
        ),
    )
    python = image.python or client_python()
    # The agent's pins and the Python are part of the key: a client with another cloudpickle,
    # or on another Python, gets a fresh environment.
    recipe = f"{image.content_hash}|{'|'.join(pins)}|python={python}"
    key = hashlib.sha256(recipe.encode()).hexdigest()[:16]
    return envbuild.EnvSpec(
        hash=key,
        python=python,
        pip=pip,
        indexes=tuple((i.url, i.packages, i.flat) for i in image.indexes if not i.default),
        default_index=image.default_index.url if image.default_index is not None else None,
        setup=image.setup,
        env=dict(image.env),
    )


def packaged_uv() -> str | None:
    """The uv binary of the `uv` package this client has installed (its version is
    ``metadata.version("uv")``), or None."""
    try:
        from uv import find_uv_bin

        return str(find_uv_bin())
    except (ImportError, FileNotFoundError):
        return None
