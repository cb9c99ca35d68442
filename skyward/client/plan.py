"""What a pool asks for, settled before anything is launched or paid for.

The arguments checked, the `ClusterSpec` the provider gets, the nodes' image after the plugins'
transforms, and the plugins pickled for the nodes: bad input fails here, at no cost.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from dataclasses import replace

import cloudpickle

from skyward import checks
from skyward.data import location
from skyward.errors import ConfigError, SerializationError
from skyward.hardware import Accelerator, ClusterSpec
from skyward.image import Image
from skyward.plugins import hooks
from skyward.plugins.base import Plugin
from skyward.providers.base import Provider
from skyward.transport import frames
from skyward.worker.hostcheck import same_python


def checked(
    provider: object, nodes: int | None, image: Image | None, plugins: Sequence[Plugin]
) -> Provider:
    """The pool's provider, once its arguments are of the right kinds."""
    if not isinstance(provider, Provider):
        raise ConfigError(f"provider must be e.g. sky.Local() or sky.SSH([...]): {provider!r}")
    if nodes is not None and (isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1):
        raise ConfigError(f"nodes must be a whole number >= 1, got {nodes!r}")
    if image is not None and not isinstance(image, Image):
        raise ConfigError(f"image must be a sky.Image, got {type(image).__name__}")
    if isinstance(plugins, Plugin | str) or not isinstance(plugins, Sequence):
        raise ConfigError(f"plugins must be a list of sky.Plugin objects, got {plugins!r}")
    for plugin in plugins:
        if not isinstance(plugin, Plugin):
            raise ConfigError(
                f"plugins must be sky.Plugin objects (e.g. sky.plugins.jax()), got {plugin!r}"
            )
    return provider


def candidates(
    providers: Sequence[Provider],
    pool_id: str,
    nodes: int | None,
    accelerator: str | None,
    output_dir: str | os.PathLike[str] | None,
) -> list[tuple[Provider, ClusterSpec]]:
    """The providers a pool may start on, in the order given, each with its validated spec:
    one, or several for failover (``provider=[sky.AWS(...), sky.GCP(...)]``), which must
    agree on the pool's size."""
    found = [(p, cluster_spec(p, pool_id, nodes, accelerator, output_dir)) for p in providers]
    sizes = {spec.nodes for _, spec in found}
    if len(sizes) > 1:
        each = ", ".join(f"{p.name}: {spec.nodes}" for p, spec in found)
        raise ConfigError(
            f"the providers of one pool must agree on its size ({each}); pass nodes= that "
            "every one of them can give"
        )
    return found


def cluster_spec(
    provider: Provider,
    pool_id: str,
    nodes: int | None,
    accelerator: str | None,
    output_dir: str | os.PathLike[str] | None,
) -> ClusterSpec:
    """What the pool asks `provider` for, which the provider has validated."""
    # e.g. sky.AWS(instance_type="p4d.24xlarge"): plugins must see its GPUs
    if accelerator is not None:
        checks.text(accelerator, "accelerator")  # "A100", "A100:8"; None for CPU
    implied = None if accelerator else provider.implied_accelerator()
    chosen = Accelerator.parse(accelerator) if accelerator else implied
    spec = ClusterSpec(
        # A TPU slice has one node per host: the provider may fix the size.
        nodes=provider.nodes_for(chosen, nodes),
        pool_id=pool_id,
        accelerator=chosen,
        provider=provider.name,
        outputs=_outputs(output_dir),
    )
    provider.validate(spec)
    return spec


def processes_per_node(value: object, accelerator: object) -> int | None:
    """``processes_per_node=`` as asked: None (the plugins' default) or a whole number >= 1,
    no more than the GPUs each node is asked for (`accelerator`, as the pool was given it),
    checked before any provider is asked about anything."""
    if value is None:
        return None
    count = checks.whole(value, "processes_per_node", minimum=1)
    if isinstance(accelerator, str) and accelerator.strip():
        fits_gpus(count, Accelerator.parse(accelerator))
    return count


def fits_gpus(ranks: int | None, accelerator: Accelerator | None) -> None:
    """Refuse `ranks` a node (None: the default, one per GPU at most) beyond the node's GPUs:
    a rank uses one GPU of its own (NCCL refuses two ranks on one GPU)."""
    if ranks is None or accelerator is None or accelerator.is_tpu or ranks <= accelerator.count:
        return
    raise ConfigError(
        f"processes_per_node={ranks} asks for more ranks than the {accelerator.count} GPU(s) "
        f"each node has with accelerator={str(accelerator)!r}: a rank uses one GPU of its "
        f"own (NCCL refuses two ranks on one GPU); ask for accelerator="
        f"'{accelerator.name}:{ranks}', or for fewer ranks"
    )


def ranks_per_node(asked: int | None, plugins: Sequence[Plugin], spec: ClusterSpec) -> int:
    """The ranks each node of `spec` holds: `asked`, else one per GPU of a node where a
    plugin's framework runs a process per GPU (PyTorch), else one."""
    if asked is not None:
        return asked
    gpus = spec.accelerator
    if gpus is not None and not gpus.is_tpu and any(p.rank_per_gpu for p in plugins):
        return gpus.count
    return 1


def plan(
    plugins: Sequence[Plugin], asked: Image, spec: ClusterSpec, ranks: int | None = None
) -> tuple[Image, ClusterSpec]:
    """The nodes' image for `spec` (the plugins' transforms over the pool's own image `asked`)
    and `spec` with its hash and its ranks per node (`ranks`, the ``processes_per_node=``
    asked: `ranks_per_node`). Run before launch, then again if what the nodes turn out to
    have changes the spec."""
    spec = replace(spec, processes_per_node=ranks_per_node(ranks, plugins, spec))
    image = hooks.transform(plugins, asked, spec)
    if image.python and not same_python(platform.python_version(), image.python):
        raise ConfigError(
            f"the image asks for Python {image.python} but this client runs "
            f"{platform.python_version()}: the nodes run the client's Python, because functions "
            "pickled by cloudpickle do not cross minor versions. Run the client on Python "
            f"{image.python}, or leave Image(python=...) out"
        )
    return image, replace(spec, image_hash=image.content_hash)


def pickled(plugins: Sequence[Plugin]) -> bytes:
    """The plugins as every node's `Hello` carries them."""
    try:
        blob: bytes = cloudpickle.dumps(list(plugins), frames.PROTOCOL)
    except Exception as exc:
        raise SerializationError(f"a plugin could not be pickled for the nodes: {exc}") from exc
    return blob


def _outputs(output_dir: str | os.PathLike[str] | None) -> str | None:
    """The pool's `output_dir` as the provider takes it: an s3:// URI or an absolute path."""
    if output_dir is None:
        return None
    return location(output_dir, "output_dir").rstrip("/")
